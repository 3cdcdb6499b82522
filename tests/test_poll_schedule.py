"""The poll schedule: with many transfers running, a poll asks NIXL about those likely to have
ended (the oldest, while they are found ended) and a share of the rest in turn, so a scheduler
step costs what ended, and no running transfer goes unchecked longer than ``max_unpolled``.

The agent here is the fake one with transfers that run until the story lets them end; a clock
the test moves stands in for the runner's, so the bound is checked exactly, not timed."""

from __future__ import annotations

import collections
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvfsm.runner
from kvfsm import TransferJob
from kvfsm.contract import DrainTimeout
from kvfsm.machines.transfer import Answer, TransferEvent, TransferState
from kvfsm.policy import RetryPolicy
from kvfsm.runner import FRONT_BATCH
from kvfsm.testing import FakeNixlAgent, Raise
from kvfsm.tiers import FileTier, ObjectStoreTier
from kvfsm.transfer import Transfer

from .test_file_tier import BlockingFsync, posix
from .test_runner import Again, _Side, _Tier, verify_again

N = 1_000


class Held(FakeNixlAgent):
    """Transfers answer PROC until :meth:`end` lets them go; every state check is counted.
    ``interrupt_in`` set to k makes the k-th state check from then on raise KeyboardInterrupt
    (as a signal arriving inside NIXL's call would), once."""

    def __init__(self) -> None:
        super().__init__("held", complete_after_polls=1)
        self.posted: list[Any] = []  # handles, in post order
        self.held: set[int] = set()  # id() of handles still running
        self.checks: collections.Counter[int] = collections.Counter()
        self.interrupt_in = 0

    def transfer(self, handle: Any, notif_msg: bytes | str = b"") -> str:
        answer = super().transfer(handle, notif_msg)
        self.posted.append(handle)
        self.held.add(id(handle))
        return answer

    def check_xfer_state(self, handle: Any) -> str:
        if self.interrupt_in:
            self.interrupt_in -= 1
            if not self.interrupt_in:
                raise KeyboardInterrupt
        self.checks[id(handle)] += 1
        if id(handle) in self.held:
            return "PROC"
        return super().check_xfer_state(handle)

    def end(self, *indices: int) -> None:
        """Let the transfers posted ``indices``-th (0 the first) end at their next check."""
        for index in indices:
            self.held.discard(id(self.posted[index]))

    def total_checks(self) -> int:
        return sum(self.checks.values())


class Clock:
    """The runner's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(kvfsm.runner, "time", clock)
    return clock


@pytest.fixture
def held() -> Iterator[Held]:
    agent = Held()
    yield agent
    assert agent.misuses == [], agent.misuses


def running_tier(agent: Held, n: int = N, **policy: Any) -> ObjectStoreTier:
    """A tier with ``n`` one-block stores running, posted in job-id order."""
    primary = torch.zeros((64, 16), dtype=torch.float32)
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(**policy))
    for job_id in range(n):
        tier.submit_store(TransferJob(job_id, [f"block-{job_id}"], [job_id % 64]))
    assert tier.stats()["in_flight"] == {"PROCESSING": n}
    return tier


def finish(tier: ObjectStoreTier, agent: Held) -> None:
    """Let everything end; the drain hands every result out."""
    agent.held.clear()
    tier.drain_jobs(timeout=30)
    tier.get_finished_jobs()
    tier.shutdown(timeout=5)
    assert agent.live_xfer_handles() == 0


def thread_poll(tier: ObjectStoreTier | FileTier, limit: int) -> None:
    """One poll as the progress thread makes it: under the tier's lock, at most ``limit``
    state checks of the schedule."""
    with tier._lock:
        tier._poll(limit=limit)


def unchecked_for(agent: Held, seen: dict[int, int], last: dict[int, float],
                  now: float) -> float:
    """After a poll: the longest any posted transfer has gone without a state check (their
    last checks updated from the agent's counts)."""
    worst = 0.0
    for handle in agent.posted:
        key = id(handle)
        if agent.checks[key] != seen.get(key, 0):
            seen[key] = agent.checks[key]
            last[key] = now
        worst = max(worst, now - last.setdefault(key, now))
    return worst


def test_a_step_asks_nixl_about_what_ended_not_about_everything_in_flight(
        held: Held, clock: Clock) -> None:
    tier = running_tier(held, max_unpolled=60.0)
    tier.get_finished_jobs()  # the first poll after the submits
    before = held.total_checks()

    # transfers end in the order they were posted: the ten oldest end before the next step
    held.end(*range(10))
    clock.advance(0.01)
    results = tier.get_finished_jobs()

    assert sorted(r.job_id for r in results) == list(range(10))
    assert all(r.success for r in results)
    made = held.total_checks() - before
    # the ten, the batch after them that found none ended, and the sweep's share for 10 ms
    # of a 60 s bound: not a thousand
    share = math.ceil(N * 0.01 / 60.0)
    assert made <= 10 + 2 * FRONT_BATCH + share
    assert made < N // 10
    finish(tier, held)


def test_many_ending_at_once_are_all_found_in_the_same_step(held: Held, clock: Clock) -> None:
    tier = running_tier(held, max_unpolled=60.0)
    tier.get_finished_jobs()
    held.end(*range(300))  # far more than one batch: the oldest-first checks go on
    clock.advance(0.01)

    assert sorted(r.job_id for r in tier.get_finished_jobs()) == list(range(300))
    finish(tier, held)


def test_no_running_transfer_goes_unchecked_longer_than_max_unpolled(
        held: Held, clock: Clock) -> None:
    limit, tick = 0.2, 0.01
    tier = running_tier(held, max_unpolled=limit)
    last = {id(handle): clock.now for handle in held.posted}  # started running
    seen: dict[int, int] = {}
    per_poll = []
    for _ in range(200):  # 2 s: ten times the bound
        clock.advance(tick)
        before = held.total_checks()
        tier.get_finished_jobs()
        per_poll.append(held.total_checks() - before)
        assert unchecked_for(held, seen, last, clock.now) <= limit + 1e-9
    # the checks are spread out: about N * tick / limit a poll (plus the oldest batch), not
    # all N at once every limit seconds
    assert max(per_poll[20:]) <= math.ceil(N * tick / limit) + FRONT_BATCH + 1
    finish(tier, held)


def test_a_transfer_that_ends_out_of_order_is_handed_out_within_max_unpolled(
        held: Held, clock: Clock) -> None:
    limit, tick = 0.5, 0.01
    tier = running_tier(held, max_unpolled=limit)
    tier.get_finished_jobs()
    held.end(700)  # far behind the oldest, which still run
    waited = 0.0
    results: list[Any] = []
    while not results:
        clock.advance(tick)
        waited += tick
        results = tier.get_finished_jobs()
        assert waited <= limit + tick + 1e-9
    assert [r.job_id for r in results] == [700]
    finish(tier, held)


def test_old_transfers_that_never_end_do_not_hide_those_behind_them(
        held: Held, clock: Clock) -> None:
    limit, tick = 0.3, 0.01
    tier = running_tier(held, max_unpolled=limit)
    tier.get_finished_jobs()
    # the 2 * FRONT_BATCH oldest hang; the next hundred end
    held.end(*range(2 * FRONT_BATCH, 2 * FRONT_BATCH + 100))
    handed_out: list[int] = []
    waited = 0.0
    while len(handed_out) < 100:
        clock.advance(tick)
        waited += tick
        handed_out += [r.job_id for r in tier.get_finished_jobs()]
        assert waited <= limit + tick + 1e-9
    assert sorted(handed_out) == list(range(2 * FRONT_BATCH, 2 * FRONT_BATCH + 100))
    finish(tier, held)


def test_a_drain_checks_every_running_transfer_each_round(held: Held, clock: Clock) -> None:
    tier = running_tier(held, max_unpolled=3600.0)
    tier.get_finished_jobs()
    held.end(*range(N - 1, 0, -2))  # every other one, newest first: out of order
    before = held.total_checks()
    with pytest.raises(DrainTimeout):  # one round, then the deadline: the rest still run
        tier.drain_jobs(timeout=0.0)
    assert held.total_checks() - before == N  # each checked, though none was due for an hour
    assert sorted(r.job_id for r in tier.get_finished_jobs()) == list(range(1, N, 2))
    finish(tier, held)


def test_few_running_are_each_checked_on_every_poll(held: Held, clock: Clock) -> None:
    tier = running_tier(held, n=64, max_unpolled=3600.0)
    for _ in range(3):
        before = held.total_checks()
        tier.get_finished_jobs()
        assert held.total_checks() - before == 64
    held.end(40)
    assert [r.job_id for r in tier.get_finished_jobs()] == [40]
    finish(tier, held)


def test_the_stays_counted_are_the_checks_that_answered_proc(held: Held, clock: Clock) -> None:
    tier = running_tier(held, max_unpolled=1.0)
    stay = tier.machine.table[TransferState.PROCESSING][TransferEvent.POLL][Answer.PROC]
    counted = stay.taken
    before = held.total_checks()
    for _ in range(30):
        clock.advance(0.01)
        tier.get_finished_jobs()
    made = held.total_checks() - before
    assert N > made > 0
    assert stay.taken - counted == made  # every check answered PROC: one stay each
    finish(tier, held)


def test_the_schedule_keeps_no_more_than_what_runs(held: Held, clock: Clock) -> None:
    tier = running_tier(held, n=100, max_unpolled=0.05)
    runner = tier._runner
    next_job = 100
    for round_ in range(50):  # the oldest 40 end each round and 40 new ones start
        oldest = [i for i, h in enumerate(held.posted) if id(h) in held.held][:40]
        held.end(*oldest)
        clock.advance(0.01)
        assert len(tier.get_finished_jobs()) == 40, round_
        for _ in range(40):
            tier.submit_store(TransferJob(next_job, [f"block-{next_job}"], [next_job % 64]))
            next_job += 1
        running = len(runner.running.transfers)
        assert running == 100
        assert len(runner._front) <= 2 * running + 64
        swept = sum(len(batch) for _, batch in runner._sweep) + len(runner._joined)
        assert swept <= 2 * running + 64
    finish(tier, held)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("max_unpolled", 0, "a positive number of seconds, at most 1e"),
    ("max_unpolled", -1.0, "a positive number of seconds, at most 1e"),
    ("max_unpolled", math.inf, "a positive number of seconds, at most 1e"),
    ("max_unpolled", 1e10, "at most 1e+09, got 10000000000.0"),
    ("max_unpolled", math.nan, "a number of seconds"),
    ("max_unpolled", True, "a number of seconds"),
    ("max_unpolled", "1", "a number of seconds"),
    ("check_all_below", -1, "an int of at least 0"),
    ("check_all_below", 2.0, "an int of at least 0"),
    ("check_all_below", False, "an int of at least 0"),
])
def test_a_bad_poll_schedule_is_refused_naming_the_field(field: str, value: Any,
                                                         words: str) -> None:
    with pytest.raises(ValueError, match=rf"RetryPolicy\.{field} must be") as refused:
        RetryPolicy(**{field: value})
    assert words in str(refused.value)


def test_a_transfer_is_asked_about_at_most_once_a_step(held: Held, clock: Clock) -> None:
    """A step where every turn in the sweep is due asks NIXL about each running transfer once:
    the oldest, which the oldest-first checks asked about, are not asked again by the sweep,
    and each stays PROCESSING once in the table's counts."""
    tier = running_tier(held, max_unpolled=1.0)
    tier.get_finished_jobs()
    clock.advance(1.0)  # every transfer's turn is due; the oldest-first checks run as well
    held.checks.clear()
    stay = tier._runner.table[TransferState.PROCESSING][TransferEvent.POLL][Answer.PROC]
    stays_before = stay.taken

    assert tier.get_finished_jobs() == []

    assert len(held.checks) == N and set(held.checks.values()) == {1}
    assert stay.taken - stays_before == N
    finish(tier, held)


def test_an_interrupt_inside_the_sweeps_checks_leaves_their_turn_due(
        held: Held, clock: Clock) -> None:
    """A KeyboardInterrupt out of a state check in the middle of the sweep's share: the poll
    raises it, and the share it did not ask about is due at the next poll, so no transfer
    goes unchecked past the bound."""
    limit, tick = 0.2, 0.01
    tier = running_tier(held, max_unpolled=limit)
    seen: dict[int, int] = {}
    last = {id(handle): clock.now for handle in held.posted}  # started running
    for poll in range(100):
        clock.advance(tick)
        if poll == 30:  # past the oldest batch, inside the sweep's share of 50
            held.interrupt_in = FRONT_BATCH + 5
            with pytest.raises(KeyboardInterrupt):
                tier.get_finished_jobs()
        else:
            tier.get_finished_jobs()
        assert unchecked_for(held, seen, last, clock.now) <= limit + tick + 1e-9
    finish(tier, held)


def test_a_transfer_running_again_is_queued_once_and_asked_about_once_a_step(
        held: Held, clock: Clock) -> None:
    """A lifecycle step sends one transfer back to PROCESSING each time NIXL says it is done,
    for 500 steps: it is asked about at most twice a step (once by the schedule, once when the
    step sends it back to running, which is asked about in the same round), and the schedule's
    queues hold it once, however many times it ran again."""
    bouncing = {150}
    primary = torch.zeros((64, 16), dtype=torch.float32)
    tier = ObjectStoreTier(
        primary, agent=held, machine=verify_again(), policy=RetryPolicy(max_unpolled=1.0),
        steps={"verify": lambda transfer, _primary: (
            Again.AGAIN if transfer.job_id in bouncing else Again.MATCH)})
    for job_id in range(200):
        tier.submit_store(TransferJob(job_id, [f"block-{job_id}"], [job_id % 64]))
    held.end(150)
    handle = id(held.posted[150])
    runner = tier._runner
    asked = []
    for _ in range(500):
        clock.advance(0.01)
        before = held.checks[handle]
        assert tier.get_finished_jobs() == []
        asked.append(held.checks[handle] - before)
    assert max(asked) == 2 and sum(asked) >= 10  # asked again and again, never more
    assert [t.job_id for t in runner._front].count(150) == 1
    assert len(runner._front) <= len(runner.running.transfers) + FRONT_BATCH
    bouncing.clear()  # it settles now
    finish(tier, held)


def test_what_ended_behind_a_transfer_that_never_ends_is_walked_past_once(
        held: Held, clock: Clock) -> None:
    """The oldest transfer hangs while those behind it end in order, a hundred a step: each
    step walks past what ended since the last one, not past all that ever ended behind it
    (the oldest-first queue holds what runs, and the batch in front)."""
    tier = running_tier(held, n=5_000, max_unpolled=60.0)
    runner = tier._runner
    tier.get_finished_jobs()
    for step in range(40):
        held.end(*range(1 + 100 * step, 1 + 100 * (step + 1)))
        clock.advance(0.01)
        assert len(tier.get_finished_jobs()) == 100
        assert len(runner._front) <= len(runner.running.transfers) + 100
    finish(tier, held)


def test_a_poll_with_a_slice_leaves_the_turns_past_it_due_and_takes_them_first_next(
        held: Held, clock: Clock) -> None:
    """The progress thread's poll makes at most its slice of state checks, however many turns
    are due: every running transfer's turn is overdue here, and a slice of 100 takes them in
    the order they were due (posting order), each poll going on where the one before stopped,
    until every one of the thousand was asked about."""
    tier = running_tier(held, max_unpolled=0.01)
    tier.get_finished_jobs()
    clock.advance(1.0)  # every turn is due, a hundred times over
    held.checks.clear()
    polls = 0
    while len(held.checks) < N:
        polls += 1
        assert polls <= N // (100 - FRONT_BATCH) + 1, "the turns past the slice never came"
        before = held.total_checks()
        thread_poll(tier, limit=100)
        assert held.total_checks() - before <= 100
        asked = [id(handle) in held.checks for handle in held.posted]
        assert asked == sorted(asked, reverse=True)  # oldest turn first: a prefix of them
        # behind while turns it did not take are due: the thread polls again at once
        assert tier._runner.behind is (not all(asked))

    assert polls > N // 100  # a slice at a time, not everything at once
    finish(tier, held)


def test_once_few_run_a_poll_with_a_slice_is_behind_no_more(held: Held, clock: Clock) -> None:
    """A thread's poll left turns due (behind: it polls again at once); then nearly all end.
    With few enough running that each is checked every poll, no turn is left behind: the
    thread goes back to its interval instead of polling without a pause."""
    tier = running_tier(held, max_unpolled=0.01)
    tier.get_finished_jobs()
    clock.advance(1.0)
    thread_poll(tier, limit=100)
    assert tier._runner.behind
    held.end(*range(10, N))  # the ten oldest keep running
    while tier.stats()["in_flight"].get("PROCESSING", 0) > 10:
        clock.advance(0.001)
        thread_poll(tier, limit=100)
    thread_poll(tier, limit=100)
    assert not tier._runner.behind
    finish(tier, held)


class SlowCommit(_Side):
    """A remote side of the user's own whose stores become visible some time after NIXL
    finished them (a commit the test ends), and which says so through ``commit_over``."""

    def __init__(self, block_bytes: int) -> None:
        super().__init__(block_bytes, committed=False)
        self.waiting: dict[int, Transfer] = {}  # job id -> a store whose commit is under way
        self.over: set[int] = set()
        self.asked = 0

    def commit(self, transfer: Transfer) -> bool:
        self.asked += 1
        if transfer.job_id in self.over:
            return True
        self.waiting[transfer.job_id] = transfer
        return False

    def end(self, *job_ids: int, tell: bool = True) -> None:
        """The commits of ``job_ids`` are over; the tier is told unless ``tell`` is False."""
        for job_id in job_ids:
            self.over.add(job_id)
            transfer = self.waiting.pop(job_id)
            if tell:
                assert self.commit_over is not None, "the tier never wired commit_over"
                self.commit_over(transfer)


def committing_tier(agent: Held, n: int, **policy: Any) -> tuple[_Tier, SlowCommit]:
    """``n`` stores NIXL finished, each waiting on its (slow) commit."""
    primary = torch.zeros((64, 16), dtype=torch.float32)
    side = SlowCommit(int(primary[0].nbytes))
    tier = _Tier(primary, agent=agent, remote=side, policy=RetryPolicy(**policy))
    for job_id in range(n):
        tier.submit_store(TransferJob(job_id, [f"block-{job_id}"], [job_id % 64]))
    agent.held.clear()
    assert tier.get_finished_jobs() == []
    assert len(side.waiting) == n and tier.stats()["in_flight"] == {"PROCESSING": n}
    return tier, side


def test_a_remote_side_of_your_own_tells_the_tier_its_slow_commits_are_over(
        held: Held, clock: Clock) -> None:
    """300 stores NIXL finished wait on a commit of the user's remote side. The polls walk
    past them once and ask about them no more (NIXL would answer DONE for each, poll after
    poll); the side says which commits are over, and the next poll checks exactly those and
    publishes them, with no turn of the sweep due (``max_unpolled`` is a minute)."""
    tier, side = committing_tier(held, 300, max_unpolled=60.0)
    checks, asked = held.total_checks(), side.asked
    for _ in range(5):
        clock.advance(0.01)
        assert tier.get_finished_jobs() == []
    assert held.total_checks() - checks <= 5 and side.asked - asked <= 5  # the sweep's share
    assert not tier._runner._front  # walked past once: the oldest-first queue keeps none
    side.end(*range(100, 150))
    checks = held.total_checks()
    results = tier.get_finished_jobs()
    assert sorted(r.job_id for r in results) == list(range(100, 150))
    assert all(r.success for r in results)
    assert held.total_checks() - checks == 50
    side.end(*range(150, 300))
    side.end(*range(100), tell=False)  # never told: found at their turn in the sweep
    assert len(tier.get_finished_jobs()) == 150
    clock.advance(60.0)
    assert len(tier.get_finished_jobs()) == 100
    assert not tier.unpublished() and not tier._runner.commits_over
    finish(tier, held)


def test_a_poll_of_the_thread_takes_the_commits_told_over_within_its_slice(
        held: Held, clock: Clock) -> None:
    """The progress thread's poll counts the checks of the commits told over in its slice:
    250 told at once take three polls of 100, oldest telling first (every poll the schedule's:
    ``check_all_below`` is 0), before the oldest-first checks: 20 stores NIXL finished since
    are asked about in the third poll, with what is left of its slice."""
    tier, side = committing_tier(held, 250, max_unpolled=60.0, check_all_below=0)
    side.end(*range(250))
    for job_id in range(250, 270):
        tier.submit_store(TransferJob(job_id, [f"block-{job_id}"], [job_id % 64]))
    held.held.clear()
    published, behind = [], []
    for _ in range(3):
        checks = held.total_checks()
        thread_poll(tier, limit=100)
        assert held.total_checks() - checks <= 100
        published.append(tier.stats()["published"])
        behind.append(tier._runner.behind)  # tellings left: the thread polls again soon
    assert published == [100, 200, 250]
    assert behind == [True, True, False]
    assert [r.job_id for r in tier.get_finished_jobs()] == list(range(250))
    assert sorted(side.waiting) == list(range(250, 270))  # found done, their commits begun
    side.end(*range(250, 270))
    assert len(tier.get_finished_jobs()) == 20
    finish(tier, held)


def test_a_store_told_over_twice_is_checked_once(held: Held, clock: Clock) -> None:
    """A side that repeats itself: the round asks NIXL once about the store it told twice."""
    tier, side = committing_tier(held, 100, max_unpolled=60.0, check_all_below=0)
    side.end(*range(100))
    side.commit_over(tier._runner.records[1])
    checks = held.total_checks()
    assert len(tier.get_finished_jobs()) == 100
    assert held.total_checks() - checks == 100
    finish(tier, held)


def test_a_store_told_over_after_it_failed_is_not_asked_about(held: Held, clock: Clock) -> None:
    """80 stores whose commits outlast ``max_running_seconds`` fail, their handles released,
    and 80 new stores under the same job ids wait on their commits in turn. The side then
    tells the tier the first 80 commits are over: the next poll asks NIXL about none of their
    handles, which are gone (nor about the new stores, whose commits are not over)."""
    clock.now = time.monotonic()  # the tier's submit times and the runner's bound agree
    tier, side = committing_tier(held, 80, max_unpolled=60.0, check_all_below=0,
                                 max_running_seconds=30.0)
    failed = list(tier._runner.records.values())
    for transfer in failed:
        transfer.started_at -= 60  # submitted long ago: past the bound (no sleeping for it)
    results = tier.get_finished_jobs()
    assert len(results) == 80 and not any(r.success for r in results)
    for job_id in range(80):
        tier.submit_store(TransferJob(job_id, [f"block-{job_id}"], [job_id % 64]))
    held.held.clear()
    assert tier.get_finished_jobs() == [] and len(side.waiting) == 80  # the new ones
    for transfer in failed:
        side.commit_over(transfer)
    checks = held.total_checks()
    assert tier.get_finished_jobs() == []
    assert held.total_checks() == checks
    side.end(*range(80))
    results = tier.get_finished_jobs()
    assert len(results) == 80 and all(r.success for r in results)
    finish(tier, held)


def test_a_store_told_over_again_while_its_release_is_retried_is_not_asked_about(
        held: Held, clock: Clock) -> None:
    """A store whose commit is over is found DONE, and its release raises: it waits for the
    retry, no longer running. The side tells the tier again (it repeats itself): the next
    poll retries the release and publishes the store, asking NIXL nothing of its state."""
    tier, side = committing_tier(held, 70, max_unpolled=60.0, check_all_below=0)
    held.inject("release_xfer_handle", Raise(), times=1)
    side.end(0)
    assert tier.get_finished_jobs() == []
    assert tier.state_of(0) is not TransferState.PROCESSING  # over, its release to retry
    side.commit_over(tier._runner.records[0])
    checks = held.total_checks()
    [result] = tier.get_finished_jobs()
    assert result.job_id == 0 and result.success
    assert held.total_checks() == checks
    side.end(*range(1, 70))
    assert len(tier.get_finished_jobs()) == 69
    finish(tier, held)


def test_commits_told_over_are_kept_through_an_interrupted_round_and_a_drain_takes_them(
        held: Held, clock: Clock) -> None:
    """A signal inside a round's state checks, whether in those of the stores told over, in
    the oldest-first checks after them, or in a drain's: the round's answers are lost, and
    so the tellings are not: they are the next round's first, in the same order. A drain
    checks every running transfer, and with them every telling is taken."""
    tier, side = committing_tier(held, 100, max_unpolled=60.0, check_all_below=0)
    side.end(*range(100))
    told = list(tier._runner.commits_over)
    for job_id in range(100, 120):  # running: the oldest-first checks come to them
        tier.submit_store(TransferJob(job_id, [f"block-{job_id}"], [job_id % 64]))

    def interrupted_at(call: int) -> Any:
        calls = []

        def check(handles: list[Any]) -> list[Any]:
            calls.append(handles)
            if len(calls) == call:
                raise KeyboardInterrupt
            return tier._driver.check(handles)
        return check

    for call, everything in ((1, False), (2, False), (1, True)):
        with tier._lock, pytest.raises(KeyboardInterrupt):
            tier._runner.check_round(interrupted_at(call), everything=everything)
        assert list(tier._runner.commits_over) == told
    assert tier.stats()["in_flight"] == {"PROCESSING": 120}
    side.over.update(range(100, 120))  # their commits are over at once
    held.held.clear()
    tier.drain_jobs(timeout=5)
    assert len(tier.get_finished_jobs()) == 120
    assert not tier._runner.commits_over
    finish(tier, held)


def test_with_a_late_sweep_the_commits_told_over_leave_it_half_the_slice(
        held: Held, clock: Clock) -> None:
    """A store posted first, whose commit will be over at once, then 300 stores that wait
    on their commit. The first ends, and all 300 commits are told over at once, more than a
    slice of the progress thread's poll. Every turn of the sweep is late: the tellings take
    half of the slice, the sweep the rest, and the first store is found by the first poll
    (with the whole slice to the tellings it would wait for three)."""
    primary = torch.zeros((64, 16), dtype=torch.float32)
    side = SlowCommit(int(primary[0].nbytes))
    side.over.add(0)
    tier = _Tier(primary, agent=held, remote=side,
                          policy=RetryPolicy(max_unpolled=0.5, check_all_below=0))
    for job_id in range(301):
        tier.submit_store(TransferJob(job_id, [f"block-{job_id}"], [job_id % 64]))
    held.end(*range(1, 301))  # the 300 end, the first keeps running
    assert tier.get_finished_jobs() == [] and len(side.waiting) == 300
    held.end(0)
    side.end(*range(1, 301))
    clock.advance(1.0)  # every turn is due, a bound late
    checks = held.total_checks()
    thread_poll(tier, limit=101)  # (an odd slice: the half is 50)
    assert held.total_checks() - checks <= 101
    assert tier.stats()["published"] == 51  # the first and 50 stores told over
    assert tier.transfer_of(0) is None  # published
    assert 0 in {r.job_id for r in tier.get_finished_jobs()}
    finish(tier, held)


@pytest.fixture
def flushing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock,
             ) -> Iterator[Callable[..., tuple[FileTier, Any, BlockingFsync]]]:
    """Makes a durable file tier on real NIXL with ``stores`` one-block stores that NIXL
    finished and that wait on their flush (held until the test releases it; the fixture
    does at the end, and shuts the tier down); its agent counts calls."""
    fsync = BlockingFsync(lambda fd: None)  # held, then not made: durability is not the story
    monkeypatch.setattr(os, "fsync", fsync)
    made: list[FileTier] = []

    def make(stores: int, **policy: Any) -> tuple[FileTier, Any, BlockingFsync]:
        agent = posix(faulty=True)  # (nothing injected: its calls are counted)
        primary = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
        tier = FileTier(primary, tmp_path, agent=agent, policy=RetryPolicy(**policy))
        made.append(tier)
        for job_id in range(stores):
            tier.submit_store(TransferJob(job_id, [f"block-{job_id}"], [job_id % 64]))
        deadline = time.monotonic() + 30
        while len(tier._runner._committing) < stores:  # NIXL finishes each; its flush is held
            assert time.monotonic() < deadline, "the stores never all waited on their flush"
            clock.advance(0.001)
            assert tier.get_finished_jobs() == []
            time.sleep(0.001)
        assert tier.stats()["in_flight"] == {"PROCESSING": stores}
        return tier, agent, fsync

    yield make
    fsync.release.set()
    for tier in made:
        if not tier.closed:
            tier.shutdown(timeout=5)


def nixl_done(agent: Any, handle: Any) -> None:
    """Wait (in real time) until NIXL says the transfer is over (asked of the real agent:
    the faulty one's count of checks is the tier's alone)."""
    deadline = time.monotonic() + 30
    while agent.wrapped.check_xfer_state(handle) != "DONE":
        assert time.monotonic() < deadline, "NIXL never finished the transfer"
        time.sleep(0.001)


def told_over(tier: FileTier, count: int) -> None:
    """Wait (in real time) until the flusher has told the tier of ``count`` flushes over."""
    deadline = time.monotonic() + 30
    while len(tier._runner.commits_over) < count:
        assert time.monotonic() < deadline, "the flusher never told the tier"
        time.sleep(0.001)


@pytest.mark.nixl
def test_stores_waiting_on_their_flush_cost_a_poll_nothing_and_are_found_once_it_is_over(
        clock: Clock, flushing: Callable[..., tuple[FileTier, Any, BlockingFsync]]) -> None:
    """A durable file tier on real NIXL whose flushes fall behind: 299 stores NIXL finished
    wait on their flush, and NIXL answers DONE for each until it is over. The oldest-first
    checks walk past them once and ask about them no more, so a poll costs what ended: a load
    posted after them all, which NIXL finished, is found by the next poll at a handful of
    checks. Once the flushes are over the flusher tells the tier, and the next polls (the
    progress thread's, a slice of 100 checks each) publish all 299, with no turn of the sweep
    due (``max_unpolled`` is a minute): told, not found by a sweep coming round."""
    tier, agent, fsync = flushing(299, max_unpolled=60.0)
    checks = agent.call_count("check_xfer_state")
    for _ in range(3):
        clock.advance(0.001)
        assert tier.get_finished_jobs() == []
    assert agent.call_count("check_xfer_state") - checks <= 3  # (the sweep's share: 1 a poll)

    tier.path_of("warm").write_bytes(bytes(tier.block_bytes))  # a block there is to load
    tier.submit_load(TransferJob(299, ["warm"], [63], is_promotion=True))
    nixl_done(agent, tier._runner.records[299].xfer)
    checks = agent.call_count("check_xfer_state")
    clock.advance(0.001)
    [result] = tier.get_finished_jobs()
    assert result.job_id == 299 and result.success
    assert agent.call_count("check_xfer_state") - checks <= 2

    fsync.release.set()
    told_over(tier, 299)
    for published in (100, 200, 299):
        checks = agent.call_count("check_xfer_state")
        thread_poll(tier, limit=100)
        assert agent.call_count("check_xfer_state") - checks <= 100
        assert tier.stats()["published"] == 1 + published
    results = tier.get_finished_jobs()
    assert sorted(r.job_id for r in results) == list(range(299))
    assert all(r.success for r in results)
    assert tier.path_of("block-298").read_bytes() == tier.primary[298 % 64].numpy().tobytes()
    tier.shutdown(timeout=5)
    assert agent.misuses == []


@pytest.mark.nixl
def test_a_flush_told_over_after_its_store_failed_is_left_alone(
        clock: Clock, flushing: Callable[..., tuple[FileTier, Any, BlockingFsync]]) -> None:
    """Stores whose flushes outlast ``max_running_seconds`` fail (their handles released);
    when the flushes end the flusher tells the tier all the same. The next round (the poll
    schedule's: a load runs) asks NIXL about none of them, whose handles are gone, only
    about the load, and publishes nothing twice."""
    clock.now = time.monotonic()  # the tier's submit times and the runner's bound agree
    tier, agent, fsync = flushing(80, check_all_below=0, max_unpolled=60.0,
                                  max_running_seconds=30.0)
    for transfer in tier._runner.records.values():
        transfer.started_at -= 60  # submitted long ago: past the bound (no sleeping for it)
    results = tier.get_finished_jobs()
    assert len(results) == 80 and not any(r.success for r in results)
    fsync.release.set()
    told_over(tier, 80)
    tier.path_of("warm").write_bytes(bytes(tier.block_bytes))
    tier.submit_load(TransferJob(80, ["warm"], [63], is_promotion=True))
    nixl_done(agent, tier._runner.records[80].xfer)
    checks = agent.call_count("check_xfer_state")
    clock.advance(0.001)
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(80, True)]
    assert agent.call_count("check_xfer_state") - checks == 1  # the load's, found done
    assert not tier._runner.commits_over  # (the tellings were taken, and dropped)
    tier.shutdown(timeout=5)
    assert agent.misuses == []


def test_a_round_limited_to_no_check_is_refused_by_name(held: Held, clock: Clock) -> None:
    tier = running_tier(held, n=100)
    with pytest.raises(ValueError, match="limit is at least one check, not 0"):
        tier._runner.check_round(tier._driver.check, limit=0)
    finish(tier, held)


def test_with_a_slice_the_oldest_first_checks_may_take_all_of_it_while_the_sweep_keeps_up(
        held: Held, clock: Clock) -> None:
    """Ninety of the oldest end at once, and no turn of the sweep is late: one poll of the
    thread (a slice of 100) finds all ninety, its oldest-first checks taking what they need."""
    tier = running_tier(held, max_unpolled=1.0)
    tier.get_finished_jobs()
    held.end(*range(90))
    clock.advance(0.001)
    thread_poll(tier, limit=100)
    assert tier.stats()["published"] == 90  # (get_finished_jobs would poll again)
    assert sorted(r.job_id for r in tier.get_finished_jobs()) == list(range(90))
    finish(tier, held)


@pytest.mark.parametrize("limit", [1, 97])
def test_a_slice_of_the_oldest_first_checks_ends_exactly_at_its_limit(
        held: Held, clock: Clock, limit: int) -> None:
    """200 of the oldest end at once: a poll of the thread with a slice of ``limit`` checks
    asks about exactly that many of them (the last batch cut short to fit, down to one), and
    publishes them; the rest wait for the next poll. (The sweep went past those 200 first:
    its next turn is another's.)"""
    tier = running_tier(held, max_unpolled=1.0)
    clock.advance(0.2)
    tier.get_finished_jobs()  # the sweep's share: the 200 oldest, all running
    held.end(*range(200))
    clock.advance(0.001)
    checks = held.total_checks()
    thread_poll(tier, limit=limit)
    assert held.total_checks() - checks == limit
    assert tier.stats()["published"] == limit
    finish(tier, held)
