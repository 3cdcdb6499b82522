"""What the caller hands a tier is read while it submits: lists it changes after the call
returns change nothing the tier records or checks; and a book of the tier's that raises never
holds a job unpublished, nor leaves the tier vouching for a copy it should have forgotten."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch

from examples.verify_lifecycle import VERIFY_MACHINE, Checksums
from kvfsm import TransferJob
from kvfsm.policy import RetryPolicy
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


def raise_once(calls: list[tuple[int, str]]) -> object:
    def book(transfer: object, *_: object) -> None:
        calls.append((transfer.job_id, threading.current_thread().name))  # type: ignore[attr-defined]
        if len(calls) == 1:
            raise RuntimeError("a book that broke")
    return book


@pytest.mark.parametrize("books", ["on_final", "on_failed"])
def test_a_book_of_the_tier_that_raises_is_logged_and_its_job_published(
    books: str, primary: torch.Tensor, agent: FakeNixlAgent, caplog: pytest.LogCaptureFixture,
) -> None:
    """A book the runner calls as a job ends that raises an ordinary exception (a bug, or no
    memory left) is logged with the job's id and its traceback; the job is published once,
    the next job is not touched, and the tier drains and shuts down (the job's record used to
    stay half-written, so drain and shutdown never ended). The progress thread, whose poll
    ended the job, goes on."""
    tier: SecondaryTier = ObjectStoreTier(primary, agent=agent,
                                          policy=RetryPolicy(progress_interval=0.001))
    calls: list[tuple[int, str]] = []
    getattr(tier._runner, books).append(raise_once(calls))
    if books == "on_failed":
        agent.inject("check_xfer_state", Raise(), times=2)  # both jobs fail
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.submit_store(TransferJob(2, ["b"], [1]))
    for _ in range(1000):  # published by the progress thread (the caller does not poll)
        if not tier._runner.records:
            break
        time.sleep(0.005)
    results = tier.get_finished_jobs()
    assert sorted((r.job_id, r.success) for r in results) == [
        (1, books == "on_final"), (2, books == "on_final")]
    # (on_failed: as each failure is latched, before its release, and again as the job ends)
    assert sorted(job for job, _ in calls) == ([1, 2] if books == "on_final" else [1, 1, 2, 2])
    # (in either order: the progress thread may poll before job 2 is submitted)
    assert {thread for _, thread in calls} == {"kvfsm-progress-ObjectStoreTier"}
    assert not tier.has_pending_work() and tier.state_of(1) is None
    (record,) = [r for r in caplog.records if "book" in r.getMessage()]
    assert (record.levelno, record.getMessage()) == (
        logging.ERROR, "job 1: the tier's book raise_once.<locals>.book raised as the job "
        "ended; the job is published with its result as it was, and what that book keeps for "
        "its keys may be out of date")
    assert record.exc_info is not None and "a book that broke" in str(record.exc_info[1])
    assert tier.stats()["progress"]["error"] is None, "the progress thread goes on"
    tier.submit_store(TransferJob(3, ["c"], [2]))
    tier.drain_jobs(timeout=5)
    assert [r.job_id for r in tier.get_finished_jobs()] == [3]
    tier.shutdown(timeout=5)
    assert tier.closed


def test_a_tier_whose_forget_raised_vouches_for_no_key_any_more(
    primary: torch.Tensor, agent: FakeNixlAgent, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failed store forgets its keys, so that a load does not read the copy an older store
    left as the new bytes. A forget that raises (no memory left) may leave some vouched for,
    and which cannot be told: the tier then answers MISS for every key and refuses every
    load, saying why, rather than go on answering HIT for the old copy (it logged the error
    and did, before)."""
    tier = ObjectStoreTier(primary, agent=agent)
    tier.submit_store(TransferJob(1, ["k"], [0]))
    tier.submit_store(TransferJob(2, ["j"], [1]))
    tier.drain_jobs(timeout=5)
    assert [r.success for r in tier.get_finished_jobs()] == [True, True]
    assert tier.stats()["distrusted"] is None

    def broken(self: KnownNames, names: object) -> None:
        raise MemoryError("no memory to forget with")

    monkeypatch.setattr(KnownNames, "_forget", broken)
    agent.inject("transfer", Raise())
    tier.submit_store(TransferJob(3, ["k"], [2]))  # the engine's block k holds new bytes
    monkeypatch.undo()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(3, False)]
    assert tier.lookup("k") is tier.lookup("j") is Lookup.MISS
    why = "forgetting 1 name(s) raised MemoryError: no memory to forget with"
    assert tier.stats()["distrusted"] == why  # what an operator sees, and the log
    assert (f"the tier vouches for no key any more ({why}): every lookup answers MISS and "
            "every load is refused until a new tier is made") in caplog.messages
    tier.submit_load(TransferJob(4, ["j"], [3], is_promotion=True))
    tier.drain_jobs(timeout=5)
    (load,) = tier.get_finished_jobs()
    assert not load.success
    assert str(load.reason) == (
        "open raised ForgottenKeyError: the tier vouches for no key any more (forgetting 1 "
        "name(s) raised MemoryError: no memory to forget with): what it holds under 'j', if "
        "anything, may not be the caller's bytes; a new tier (a restart) trusts its store "
        "again")
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
    tier.drain_jobs(timeout=5)
    monkeypatch.undo()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    assert tier.stats()["holdings"]["writing_blocks"] == 0
    tier.submit_store(TransferJob(2, ["c"], [2]))  # room is made: one of a and b goes
    assert [(r.job_id, r.success) for r in settle(tier)] == [(2, True)]
    tier.shutdown(timeout=5)


class EngineJob(TransferJob):
    """A TransferJob of an engine's own, with what its instances hold of their own."""

    def __init__(self, job_id: int, keys: list[str], block_ids: list[int],
                 request: str) -> None:
        super().__init__(job_id, keys, block_ids)
        object.__setattr__(self, "request", request)  # (frozen, as its fields are)


class SlotJob(EngineJob):
    """The same, in a slot of its own."""

    __slots__ = ("request",)


class PrivateSlotJob(TransferJob):
    """The same, in a private slot (its name mangled with the class's)."""

    __slots__ = ("__request",)

    def __init__(self, job_id: int, keys: list[str], block_ids: list[int],
                 request: str) -> None:
        super().__init__(job_id, keys, block_ids)
        object.__setattr__(self, "_PrivateSlotJob__request", request)

    @property
    def request(self) -> str:
        return self.__request


@pytest.mark.parametrize("kind", [EngineJob, SlotJob, PrivateSlotJob])
def test_a_job_of_the_engines_own_class_is_kept_whole_as_its_lists_are_copied(
    kind: Any, primary: torch.Tensor, agent: FakeNixlAgent,
) -> None:
    """Listeners and steps see the engine's job: its class, what it holds of its own, and its
    lists as they were at submit (the copy was a plain TransferJob, and then one without what
    the instance held, when the lists were lists)."""
    tier = ObjectStoreTier(primary, agent=agent)
    seen: list[TransferJob] = []
    tier.on_published.append(lambda transfer: seen.append(transfer.job))
    keys, blocks = ["a", "b"], [0, 1]
    tier.submit_store(kind(1, keys, blocks, request="r-7"))
    keys[:], blocks[:] = ["x", "y"], [5, 6]
    tier.drain_jobs(timeout=5)
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    (kept,) = seen
    assert type(kept) is kind and kept.request == "r-7"  # type: ignore[attr-defined]
    assert (kept.job_id, kept.keys, kept.block_ids) == (1, ("a", "b"), (0, 1))
    tier.shutdown(timeout=5)


class Unsayable(MemoryError):
    """No memory left even to say so: its text cannot be made."""

    def __str__(self) -> str:
        raise MemoryError


def test_a_forget_whose_error_cannot_even_be_told_still_leaves_the_tier_vouching_for_none(
    primary: torch.Tensor, agent: FakeNixlAgent, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The distrust is noted before its reason is put in words (that needs memory too): the
    tier stayed trusted when the words failed, and loaded the old copy as the new bytes."""
    tier = ObjectStoreTier(primary, agent=agent)
    tier.submit_store(TransferJob(1, ["k"], [0]))
    tier.drain_jobs(timeout=5)
    tier.get_finished_jobs()

    def broken(self: KnownNames, names: object) -> None:
        raise Unsayable

    monkeypatch.setattr(KnownNames, "_forget", broken)
    agent.inject("transfer", Raise())
    tier.submit_store(TransferJob(2, ["k"], [1]))
    monkeypatch.undo()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(2, False)]
    assert tier.lookup("k") is Lookup.MISS
    tier.submit_load(TransferJob(3, ["k"], [2], is_promotion=True))
    tier.drain_jobs(timeout=5)
    (load,) = tier.get_finished_jobs()
    assert not load.success and "vouches for no key any more (a forget raised)" in str(
        load.reason)
    tier.shutdown(timeout=5)
