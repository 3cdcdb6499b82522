"""Transfers backing off cost a poll nothing until their next try is due.

A release that raised (or a user's step that answered "not yet") is tried again after the
:class:`~kvfsm.policy.RetryPolicy`'s backoff. While it waits, the transfer is out of the list a
round goes through (:meth:`kvfsm.runner.Runner.waiting_now`): a heap of the times the tries come
due brings each back, at the end of the list, once its time has come. These stories check the
order and the timing on the runner's clock, that a poll beside many transfers backing off
makes no call for them and still publishes the others, that the heap forgets the transfers
that moved on before their try (a shutdown's last try) and keeps those still backing off, and
that a transfer moved on while backing off has its next call made at once."""

from __future__ import annotations

import time
from typing import Any, TypeVar

import pytest
import torch

import kvfsm.runner
from kvfsm import Declaration, TransferJob
from kvfsm.lifecycle import Answer, CallFailed, TransferState
from kvfsm.machines.transfer import FailureKind
from kvfsm.policy import RetryPolicy
from kvfsm.runner import END, Outcome
from kvfsm.testing import FakeNixlAgent, Raise
from kvfsm.tiers import ObjectStoreTier
from kvfsm.transfer import Transfer

from .test_poll_schedule import Clock
from .test_runner import CLEAN_OK, OK, Pending, runner, submitted, verify_pending

S = TransferState
RAISED = Outcome(Answer.RAISED, CallFailed("release_xfer_handle", RuntimeError("busy")))
FOREVER = 10**6
Agent = TypeVar("Agent", bound=FakeNixlAgent)


@pytest.fixture
def moved(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The runner's clock, moved by the story (binary fractions of a second: exact)."""
    clock = Clock()
    monkeypatch.setattr(kvfsm.runner, "time", clock)
    return clock


def test_a_transfer_backing_off_leaves_the_round_and_comes_back_at_the_end_when_due(
        moved: Clock) -> None:
    """Three transfers wait on their release. The first's raises (next try in 1/2 s), then a
    quarter second later the second's (next try at 3/4 s); the third is not tried yet. A round
    goes on with the third only, then with the first again once its time has come, then with
    both, each joining the end in the order its try came due."""
    books = runner(RetryPolicy(max_attempts=None, max_seconds=None, backoff=0.5,
                               max_backoff=4.0))
    first, second, third = (submitted(books, job_id) for job_id in (1, 2, 3))
    for transfer in (first, second, third):
        books.take(transfer, "post", Outcome(Answer.DONE))
    assert books.waiting_now() == [first, second, third]

    books.take(first, END, (RAISED, Outcome(None)))
    moved.advance(0.25)
    books.take(second, END, (RAISED, Outcome(None)))
    assert books.waiting_now() == [third]
    assert list(books.waiting) == [1, 2, 3], "all three still wait on their release"
    moved.advance(0.25)
    assert books.waiting_now() == [third, first]
    moved.advance(0.25)
    assert books.waiting_now() == [third, first, second]

    books.take(first, END, (RAISED, Outcome(None)))  # again: the next try a second away
    assert first.retry_at == moved.now + 1.0
    assert books.waiting_now() == [third, second]
    books.take(second, END, (OK, CLEAN_OK))
    books.take(third, END, (OK, CLEAN_OK))
    assert books.waiting_now() == [] and list(books.waiting) == [1]
    moved.advance(1.0)
    assert books.waiting_now() == [first]
    books.take(first, END, (OK, CLEAN_OK))
    assert books.waiting_now() == [] and books.waiting == {}
    assert [r.job_id for r in books.take_results()] == [2, 3, 1]


def test_a_transfer_tried_early_and_backing_off_again_comes_back_at_its_new_time(
        moved: Clock) -> None:
    """A shutdown tries a transfer backing off at once (its ``retry_at`` cleared). When that
    try raises too, the transfer backs off again, for longer; the time its first backoff was
    due brings nothing back, its new one does."""
    books = runner(RetryPolicy(max_attempts=None, max_seconds=None, backoff=0.5,
                               max_backoff=4.0))
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.DONE))
    books.take(transfer, END, (RAISED, Outcome(None)))
    transfer.retry_at = 0.0  # what shutdown does for its last try
    assert list(books.due([transfer])) == [(transfer, END)]
    books.take(transfer, END, (RAISED, Outcome(None)))
    assert transfer.retry_at == moved.now + 1.0
    moved.advance(0.5)
    assert books.waiting_now() == []
    moved.advance(0.5)
    assert books.waiting_now() == [transfer]


def test_a_published_transfer_never_comes_back_from_its_backoff(moved: Clock) -> None:
    """A transfer published while it backs off (tried early, and released) is not handed to a
    round when its backoff would have ended."""
    books = runner(RetryPolicy(max_seconds=None, backoff=0.5, max_backoff=0.5))
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.DONE))
    books.take(transfer, END, (RAISED, Outcome(None)))
    transfer.retry_at = 0.0
    books.take(transfer, END, (OK, CLEAN_OK))
    assert [r.job_id for r in books.take_results()] == [1]
    moved.advance(0.5)
    assert books.waiting_now() == [] and books.records == {}


def test_a_poll_beside_a_thousand_releases_backing_off_makes_no_call_for_them(
        moved: Clock) -> None:
    """A thousand stores whose release raised wait a minute for their next try. Polls in that
    minute make no release call, hand no transfer of theirs to a round, and still publish a
    store submitted after them; once the minute is over, the next poll tries every release
    again, and those that now answer are published."""
    agent, tier = _backing_off(FakeNixlAgent(), 1_000, backoff=60)
    runner = tier._runner
    assert runner.in_state[S.DONE] == 1_000 and runner.waiting_now() == []

    tier.submit_store(TransferJob(1_000, ["block-1000"], [1_000]))
    (late,) = tier.get_finished_jobs()  # the fake agent's transfers end at their first check
    assert late.job_id == 1_000 and late.success
    moved.advance(59.5)
    assert tier.get_finished_jobs() == []
    assert agent.call_count("release_xfer_handle") == 1_001, "no try before its minute is over"

    moved.advance(0.5)
    results = tier.get_finished_jobs()
    assert sorted(r.job_id for r in results) == list(range(1_000))
    assert all(r.success for r in results) and agent.call_count("release_xfer_handle") == 2_001
    assert agent.live_xfer_handles() == 0
    tier.shutdown(timeout=10)


def test_the_heap_forgets_transfers_a_shutdown_released_before_their_try() -> None:
    """200 stores back off an hour after their release raised once; shutdown's deadline gives
    each its last try, which releases it. Each is published with its outcome, and the heap of
    backoffs does not keep the 200 for the hour their tries would have taken (it keeps at
    most 64 entries beside nothing waiting)."""
    agent, tier = _backing_off(FakeNixlAgent(), 200, backoff=3600)
    tier.shutdown(timeout=0.05)
    results = tier.get_finished_jobs()
    assert len(results) == 200 and all(r.success for r in results)
    runner = tier._runner
    assert runner.waiting == {} and runner.waiting_now() == []
    assert len(runner._backing_off) <= 64, len(runner._backing_off)
    assert agent.live_xfer_handles() == 0


class _InterruptedOnce(FakeNixlAgent):
    """A fake agent whose ``interrupt_in``-th release from now (once set) is cut short by a
    Ctrl-C (before NIXL sees it: the handle stays live)."""

    interrupt_in = 0

    def release_xfer_handle(self, handle: object) -> None:  # type: ignore[override]
        if self.interrupt_in:
            self.interrupt_in -= 1
            if not self.interrupt_in:
                raise KeyboardInterrupt
        super().release_xfer_handle(handle)  # type: ignore[arg-type]


@pytest.mark.parametrize("backoff", [3600, 0.05], ids=["its-try-an-hour-away", "its-try-due"])
def test_a_shutdown_last_try_cut_short_is_tried_again_at_the_next_poll(backoff: float) -> None:
    """A store's release raised; its next try is an hour (or 50 ms) away. Shutdown's deadline
    passes and its last try of the release is interrupted (Ctrl-C). The backoff was cut short
    for that try, so the store is not left out of the rounds for the hour: the next poll
    (after the 50 ms, when the backoff's own time has come too) releases it and publishes
    it, and a drain has nothing left to wait for."""
    agent, tier = _backing_off(_InterruptedOnce(), 1, backoff=backoff)
    agent.interrupt_in = 1
    with pytest.raises(KeyboardInterrupt):
        tier.shutdown(timeout=0.01)
    time.sleep(0.1 if backoff < 1 else 0)
    assert agent.live_xfer_handles() == 1  # the interrupted release never reached NIXL
    results = tier.get_finished_jobs()
    assert [(r.job_id, r.success) for r in results] == [(0, True)]
    assert agent.live_xfer_handles() == 0
    tier.drain_jobs(0.5)
    tier.shutdown(timeout=1)


def _backing_off(agent: Agent, stores: int, backoff: float) -> tuple[Agent, ObjectStoreTier]:
    """An object-store tier on ``agent`` whose ``stores`` one-block stores (job ids from 0)
    NIXL finished and whose release raised once each: each now waits ``backoff`` seconds for
    its next try (no bound on the tries). Room for 24 more blocks after them."""
    agent.inject("release_xfer_handle", Raise("NIXL_ERR_BACKEND"), times=stores)
    primary = torch.zeros((stores + 24, 16), dtype=torch.float32)
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(
        max_attempts=None, max_seconds=None, backoff=backoff, max_backoff=backoff))
    for job_id in range(stores):
        tier.submit_store(TransferJob(job_id, [f"block-{job_id}"], [job_id]))
    while agent.call_count("release_xfer_handle") < stores:
        assert tier.get_finished_jobs() == []
    return agent, tier


def test_a_shutdown_cut_short_leaves_the_stores_it_did_not_reach_backing_off(
        moved: Clock) -> None:
    """300 stores back off an hour after their release raised once. Shutdown's deadline gives
    each its last try in turn: 200 are released and published, then a Ctrl-C cuts the 201st
    short. The heap of backoffs was compacted as the 200 went (it no longer holds their
    entries), and kept those of the 99 not reached: a poll retries the interrupted one at
    once, and the 99 when their hour is over."""
    agent, tier = _backing_off(_InterruptedOnce(), 300, backoff=3600)
    agent.interrupt_in = 201
    with pytest.raises(KeyboardInterrupt):
        tier.shutdown(timeout=0.01)
    first = tier.get_finished_jobs()
    assert len(first) == 201 and all(r.success for r in first)
    runner = tier._runner
    assert len(runner.waiting) == 99 and len(runner._backing_off) < 300
    moved.advance(3599.5)
    assert tier.get_finished_jobs() == []
    moved.advance(0.5)
    rest = tier.get_finished_jobs()
    assert sorted(r.job_id for r in first + rest) == list(range(300))
    assert all(r.success for r in rest) and agent.live_xfer_handles() == 0
    tier.shutdown(timeout=1)


def _cancellable_verify() -> Declaration[Any, Any]:
    """test_runner's lifecycle with a user step ``verify`` after NIXL's DONE that may answer
    PENDING (a retry: it backs off where it is), with a cancel that fails the transfer from
    there: it moves on to FAILED, whose effect is the release."""
    return verify_pending().extend(
        "cancellable_verify",
        replace={("VERIFYING", "cancel", ""): {"dest": "FAILED", "after": ["latch_cancelled"]}})


def test_a_cancel_moving_a_step_backing_off_on_has_its_next_call_made_at_once() -> None:
    """A store's own ``verify`` step answers PENDING; its next try is an hour away. A cancel
    moves it on to FAILED, whose call is the release: that call is the next effect's first
    try, made by the next poll, not an hour later; the job fails as cancelled."""
    tries: list[int] = []

    def verify(transfer: Transfer, primary: torch.Tensor) -> Pending:
        tries.append(transfer.job_id)
        return Pending.PENDING

    agent = FakeNixlAgent()
    tier = ObjectStoreTier(torch.zeros((4, 16)), agent=agent, machine=_cancellable_verify(),
                           steps={"verify": verify}, policy=RetryPolicy(
                               max_attempts=None, max_seconds=None, backoff=3600,
                               max_backoff=3600))
    tier.submit_store(TransferJob(1, ["block-1"], [0]))
    while not tries:
        assert tier.get_finished_jobs() == []
    assert tier.get_finished_jobs() == [] and tries == [1]  # backing off
    tier.cancel(1)
    (result,) = tier.get_finished_jobs()
    assert not result.success and result.reason is not None
    assert result.reason.kind is FailureKind.CANCELLED
    assert tries == [1] and agent.call_count("release_xfer_handle") == 1
    assert agent.live_xfer_handles() == 0
    tier.shutdown(timeout=1)

