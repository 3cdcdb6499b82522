"""What the caller hands a tier is read while it submits: lists it changes after the call
returns change nothing the tier records or checks; and a book of the tier's that raises never
holds a job unpublished, nor goes unseen."""

from __future__ import annotations

import pytest
import torch

from examples.verify_lifecycle import VERIFY_MACHINE, Checksums
from kvfsm import JobResult, TransferJob
from kvfsm.testing import FakeNixlAgent, Raise
from kvfsm.tiers import HoldingEvent, Lookup, ObjectStoreTier, SecondaryTier
from kvfsm.tiers.base import KnownNames

from .test_capacity import BLOCK, settle
from .test_peer import fake_peers


def test_a_key_list_the_caller_changes_after_submit_changes_nothing_the_tier_records(
    primary: torch.Tensor, agent: FakeNixlAgent,
) -> None:
    """An engine reuses its list of keys for the next job as soon as submit_store returns.
    The tier stored the blocks under the keys it was given: those are HIT, their removal is
    reported under them, and the tier drains and shuts down (it used to read the list again
    when the job ended: a shorter one broke its books for good, one of the same length made it
    report keys it never stored)."""
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=2 * BLOCK,
                           record_events=True, remove=agent.remove_objects)
    keys = ["a", "b"]
    tier.submit_store(TransferJob(1, keys, [0, 1]))
    keys[:] = ["x"]  # the engine's next job's keys, in the same list
    assert [(r.job_id, r.success) for r in settle(tier)] == [(1, True)]
    assert tier.lookup("a") is tier.lookup("b") is Lookup.HIT
    assert tier.lookup("x") is not Lookup.HIT  # (asked of the store: never stored here)
    assert tier.take_events() == [HoldingEvent(("a", "b"), removed=False)]

    keys[:] = ["c", "d"]
    tier.submit_store(TransferJob(2, keys, [2, 3]))
    keys[:] = ["y", "z"]
    assert [(r.job_id, r.success) for r in settle(tier)] == [(2, True)]
    assert tier.take_events() == [HoldingEvent(("a", "b"), removed=True),
                                  HoldingEvent(("c", "d"), removed=False)]
    assert sorted(agent.objects) == sorted(tier.object_key(k) for k in ("c", "d"))
    tier.shutdown(timeout=5)
    assert tier.closed


def test_a_peer_job_whose_lists_change_after_submit_and_expect_lands_where_it_was_sent() -> None:
    """The sender's notification names the receiver blocks of the keys it was given, and the
    receiver publishes the blocks it was told to expect, whatever the lists say later."""
    sender, receiver, name = fake_peers()
    blocks = [2]
    receiver.expect(TransferJob(1, ["2"], blocks, is_promotion=True), name)
    blocks[:] = [0]
    keys = ["2"]
    sender.submit_store(TransferJob(1, keys, [3]))
    keys[:] = ["1"]
    sender.drain_jobs(timeout=5)
    assert [(r.job_id, r.success) for r in sender.get_finished_jobs()] == [(1, True)]
    receiver.drain_jobs(timeout=5)
    assert [(r.job_id, r.success) for r in receiver.get_finished_jobs()] == [(1, True)]
    assert torch.equal(receiver.primary[2], sender.primary[3])
    assert not receiver.primary[1].any() and not receiver.primary[0].any()
    receiver.expect(TransferJob(2, ["2"], [2], is_promotion=True), name)  # block 2 is free
    sender.shutdown(timeout=5)
    receiver.shutdown()


def test_a_step_sees_the_job_as_it_was_submitted_whatever_the_list_holds_later(
    agent: FakeNixlAgent,
) -> None:
    """The verify example's checksum step reads the blocks of the job it checks: a load whose
    block list the engine reused after submit was checked in another block, and a load of
    corrupted bytes published as verified."""
    cache = torch.arange(8 * 64, dtype=torch.float32).view(8, 64)
    tier = ObjectStoreTier(cache, agent=agent, machine=VERIFY_MACHINE,
                           steps={"verify": Checksums()})
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.drain_jobs(timeout=5)
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    (name,) = agent.objects
    agent.objects[name] = b"\xff" + agent.objects[name][1:]  # the stored copy goes bad
    blocks = [4]
    tier.submit_load(TransferJob(2, ["a"], blocks, is_promotion=True))
    blocks[:] = [0]  # the engine's next job, in the same list
    tier.drain_jobs(timeout=5)
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success) == (2, False)
    assert "checksum mismatch in block 4" in str(result.reason)
    tier.shutdown(timeout=5)


def raise_once(calls: list[int]) -> object:
    def book(transfer: object, *_: object) -> None:
        calls.append(transfer.job_id)  # type: ignore[attr-defined]
        if len(calls) == 1:
            raise RuntimeError("a book that broke")
    return book


@pytest.mark.parametrize("books", ["on_final", "on_failed"])
def test_a_book_of_the_tier_that_raises_is_raised_once_its_job_is_published(
    books: str, primary: torch.Tensor, agent: FakeNixlAgent,
) -> None:
    """A book the runner calls as a job ends that raises an ordinary exception (a bug, or no
    memory left) is raised from the call that ended the job, once the job is published and
    its record gone: the job's result is handed out by the next call, the next job is not
    touched, and the tier drains and shuts down (the job's record used to stay half-written,
    so drain and shutdown never ended)."""
    tier: SecondaryTier = ObjectStoreTier(primary, agent=agent)
    calls: list[int] = []
    getattr(tier._runner, books).append(raise_once(calls))
    if books == "on_failed":
        agent.inject("check_xfer_state", Raise(), times=2)  # both jobs fail
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.submit_store(TransferJob(2, ["b"], [1]))
    with pytest.raises(RuntimeError, match="a book that broke") as raised:
        tier.get_finished_jobs()
    assert raised.value.__notes__ == [
        "kvfsm: raised by the tier's book raise_once.<locals>.book as job 1 ended; the job was "
        "published, its result as it was, and its record is gone; what that book keeps for "
        "the job's keys may be out of date"]
    assert tier.state_of(1) is None
    results: list[JobResult] = []
    for _ in range(20):
        results += tier.get_finished_jobs()
    assert sorted((r.job_id, r.success) for r in results) == [
        (1, books == "on_final"), (2, books == "on_final")]
    assert calls == [1, 2]
    assert not tier.has_pending_work()
    tier.shutdown(timeout=5)
    assert tier.closed


def test_a_failed_store_whose_forget_raises_is_never_silent(
    primary: torch.Tensor, agent: FakeNixlAgent, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed store forgets its keys, so that a load does not read the copy an older store
    left as the new bytes. When that forget raises, the engine hears it from the call that
    ended the store's next poll (it was logged and the tier went on, still answering HIT),
    never from the submit that took the job (a caller would take that for a refusal)."""
    tier = ObjectStoreTier(primary, agent=agent)
    tier.submit_store(TransferJob(1, ["k"], [0]))
    tier.drain_jobs(timeout=5)
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]

    def broken(self: KnownNames, names: object) -> None:
        raise MemoryError("no memory to forget with")

    monkeypatch.setattr(KnownNames, "forget", broken)
    agent.inject("transfer", Raise())
    tier.submit_store(TransferJob(2, ["k"], [1]))  # it failed at once: never raised here
    assert tier.state_of(2) is None  # published
    with pytest.raises(MemoryError, match="no memory to forget with"):
        tier.get_finished_jobs()
    monkeypatch.undo()
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success) == (2, False)
    tier.shutdown(timeout=5)


def test_a_verdict_that_cannot_be_recorded_still_unpins_the_blocks(
    primary: torch.Tensor, agent: FakeNixlAgent, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tier's book records the verdicts on a store's keys, then unpins them within the
    capacity: a record that raised skipped the unpin, and the blocks' room stayed taken for
    good (every later store refused, TierFullError, with nothing in flight)."""
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=2 * BLOCK,
                           remove=agent.remove_objects)

    def broken(self: KnownNames, *args: object, **kwargs: object) -> None:
        raise MemoryError("no memory to record with")

    monkeypatch.setattr(KnownNames, "record", broken)
    tier.submit_store(TransferJob(1, ["a", "b"], [0, 1]))
    with pytest.raises(MemoryError):
        tier.drain_jobs(timeout=5)
    monkeypatch.undo()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    assert tier.stats()["holdings"]["writing_blocks"] == 0
    tier.submit_store(TransferJob(2, ["c"], [2]))  # room is made: one of a and b goes
    assert [(r.job_id, r.success) for r in settle(tier)] == [(2, True)]
    tier.shutdown(timeout=5)
