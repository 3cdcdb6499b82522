"""What the caller hands a tier is read once: lists it changes after the call returns change
nothing the tier records, and a book of the tier's that raises never holds a job unpublished."""

from __future__ import annotations

import logging

import pytest
import torch

from kvfsm import JobResult, TransferJob
from kvfsm.testing import FakeNixlAgent, Raise
from kvfsm.tiers import HoldingEvent, Lookup, ObjectStoreTier, SecondaryTier

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


def raise_once(calls: list[int]) -> object:
    def book(transfer: object, *_: object) -> None:
        calls.append(transfer.job_id)  # type: ignore[attr-defined]
        if len(calls) == 1:
            raise RuntimeError("a book that broke")
    return book


@pytest.mark.parametrize("books", ["on_final", "on_failed"])
def test_a_book_of_the_tier_that_raises_never_holds_a_job_unpublished(
    books: str, primary: torch.Tensor, agent: FakeNixlAgent, caplog: pytest.LogCaptureFixture,
) -> None:
    """A book the runner calls as a job ends (the tier's records of its keys, a failed store's
    forget) that raises an ordinary exception is logged with the job's id; the job is still
    published once, the next job is not touched, and the tier drains and shuts down."""
    tier: SecondaryTier = ObjectStoreTier(primary, agent=agent)
    calls: list[int] = []
    getattr(tier._runner, books).append(raise_once(calls))
    if books == "on_failed":
        agent.inject("check_xfer_state", Raise(), times=2)  # both jobs fail
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.submit_store(TransferJob(2, ["b"], [1]))
    results: list[JobResult] = []
    for _ in range(20):
        results += tier.get_finished_jobs()
    assert sorted((r.job_id, r.success) for r in results) == [
        (1, books == "on_final"), (2, books == "on_final")]
    assert calls == [1, 2]
    assert not tier.has_pending_work()
    assert tier.state_of(1) is None
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR
            and "book" in r.getMessage()] == [
        "job 1: the tier's book raise_once.<locals>.book raised; the job's result stands, "
        "and what that book keeps for its keys may be out of date"]
    tier.shutdown(timeout=5)
    assert tier.closed
