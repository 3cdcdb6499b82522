"""The progress thread (``RetryPolicy.progress_interval``): a tier polls on a thread of its own,
so the scheduler's ``get_finished_jobs`` only hands out what that thread published. These
stories show where each NIXL call is made, that a step never waits for the tier's lock, that
the thread comes and goes with the work, that a poll that raises on it costs no result, and that
a process that forgot ``shutdown`` still never exits with a transfer in flight."""

from __future__ import annotations

import _thread
import collections
import contextlib
import functools
import itertools
import logging
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import kvfsm.contract
from kvfsm import JobResult, TransferJob
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, FaultyAgent
from kvfsm.tiering import BookkeepingError, CPUPrimaryTier, TieringDrainTimeout, TieringManager
from kvfsm.tiers import InvalidJobError, ObjectStoreTier, TierClosedError
from kvfsm.tiers.base import PROGRESS_SLICE
from kvfsm.transfer import Transfer

from .test_poll_schedule import Held

INTERVAL = 0.001


class Watched(Held):
    """Held transfers, and the thread each state check was made on."""

    def __init__(self) -> None:
        super().__init__()
        self.check_threads: set[str] = set()

    def check_xfer_state(self, handle: Any) -> str:
        self.check_threads.add(threading.current_thread().name)
        return super().check_xfer_state(handle)


@pytest.fixture
def watched() -> Iterator[Watched]:
    agent = Watched()
    yield agent
    assert agent.misuses == [], agent.misuses


def tier_on(agent: FakeNixlAgent, **policy: Any) -> ObjectStoreTier:
    primary = torch.arange(64 * 16, dtype=torch.float32).view(64, 16)
    return ObjectStoreTier(primary, agent=agent,
                           policy=RetryPolicy(progress_interval=INTERVAL, **policy))


def store(tier: ObjectStoreTier, job_id: int, block: int | None = None) -> None:
    block = job_id % 64 if block is None else block
    tier.submit_store(TransferJob(job_id, [f"block-{job_id}"], [block]))


def collect(tier: ObjectStoreTier, count: int, timeout: float = 10.0) -> list[JobResult]:
    """Results as a scheduler takes them, a step every millisecond, until ``count`` came."""
    results: list[JobResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < count:
        assert time.monotonic() < deadline, f"{len(results)} of {count} results came"
        results += tier.get_finished_jobs()
        time.sleep(0.001)
    return results


def wait_for(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "waited in vain"
        time.sleep(0.001)


def progress_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvfsm-progress")]


def test_every_state_check_is_made_on_the_progress_thread_and_results_still_come(
        watched: Watched) -> None:
    tier = tier_on(watched)
    for job_id in range(200):  # past check_all_below: the poll schedule picks the checks
        store(tier, job_id)
    watched.end(*range(200))

    results = collect(tier, 200)

    assert sorted(r.job_id for r in results) == list(range(200))
    assert all(r.success for r in results)
    assert watched.check_threads == {"kvfsm-progress-ObjectStoreTier"}
    assert tier.get_finished_jobs() == []  # each result handed out once
    tier.shutdown(timeout=5)
    assert watched.live_xfer_handles() == 0


def test_a_step_never_waits_for_the_tier_lock(watched: Watched) -> None:
    tier = tier_on(watched)
    for job_id in range(3):
        store(tier, job_id)
    watched.end(0, 1)
    wait_for(lambda: len(tier._books.results) == 2)

    # the tier's lock is held (here by the test: a long submit or a drain on another thread)
    # while the scheduler steps on its own thread
    taken: list[JobResult] = []
    step = threading.Thread(target=lambda: taken.extend(tier.get_finished_jobs()))
    with tier._lock:
        step.start()
        step.join(5)
        stepped = not step.is_alive()
    step.join()

    assert stepped, "the step waited for the tier's lock"
    assert sorted(r.job_id for r in taken) == [0, 1]
    watched.end(2)
    assert [r.job_id for r in collect(tier, 1)] == [2]
    tier.shutdown(timeout=5)


def test_the_thread_runs_while_jobs_are_unpublished_and_comes_back_with_the_next_submit(
        watched: Watched) -> None:
    tier = tier_on(watched)
    assert tier.stats()["progress"] == {"running": False, "polls": 0, "error": None}
    assert progress_threads() == []

    store(tier, 0)
    assert tier.stats()["progress"]["running"]
    assert progress_threads() == ["kvfsm-progress-ObjectStoreTier"]
    time.sleep(20 * INTERVAL)
    assert tier.has_pending_work()  # job 0 still runs: the thread polls on
    watched.end(0)
    assert [r.job_id for r in collect(tier, 1)] == [0]
    wait_for(lambda: not progress_threads())  # nothing unpublished: it ended
    assert not tier.stats()["progress"]["running"]
    polls = tier.stats()["progress"]["polls"]
    assert polls >= 1
    assert watched.total_checks() == polls  # one running transfer: one check a poll, its own

    store(tier, 1)  # the next submit starts it again
    assert tier.stats()["progress"]["running"]
    watched.end(1)
    assert [r.job_id for r in collect(tier, 1)] == [1]
    assert tier.stats()["progress"]["polls"] > polls
    tier.shutdown(timeout=5)
    assert progress_threads() == []


def test_shutdown_stops_the_thread_and_publishes_every_job_once(watched: Watched) -> None:
    tier = tier_on(watched)
    for job_id in range(100):
        store(tier, job_id)
    watched.end(*range(0, 100, 2))  # half end; the other half run until shutdown cancels

    def let_the_rest_end() -> None:
        time.sleep(0.05)
        watched.end(*range(1, 100, 2))

    ender = threading.Thread(target=let_the_rest_end)
    ender.start()
    tier.shutdown(timeout=10)
    ender.join()

    results = tier.get_finished_jobs()
    assert sorted(r.job_id for r in results) == list(range(100))
    assert progress_threads() == []
    assert watched.live_xfer_handles() == 0
    assert tier.closed


def test_a_poll_that_raises_on_the_thread_costs_no_result(
        watched: Watched, caplog: pytest.LogCaptureFixture) -> None:
    tier = tier_on(watched)
    for job_id in range(5):
        store(tier, job_id)
    watched.interrupt_in = 1  # the thread's next state check raises KeyboardInterrupt
    with caplog.at_level(logging.ERROR, logger="kvfsm"):
        wait_for(lambda: tier.stats()["progress"]["error"] is not None)
    progress = tier.stats()["progress"]
    assert (progress["running"], progress["error"]) == (False, "KeyboardInterrupt: ")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "ObjectStoreTier: the progress thread's poll raised; get_finished_jobs polls on the "
        "caller's thread from now on"]

    # from now on the caller's step polls, as without the thread: no job is lost
    watched.end(*range(5))
    store(tier, 5)
    watched.end(5)
    assert sorted(r.job_id for r in collect(tier, 6)) == list(range(6))
    assert progress_threads() == []  # and it is not started again
    assert "MainThread" in watched.check_threads
    tier.shutdown(timeout=5)
    assert watched.live_xfer_handles() == 0


def test_submits_steps_and_the_thread_at_once_hand_out_every_result_once() -> None:
    """Two submitting threads reuse job ids as soon as their results are out, while the
    scheduler takes results and the progress thread publishes them: no result is lost or
    handed out twice, and a job id is never refused once its result was taken."""
    agent = FakeNixlAgent("busy", complete_after_polls=2)
    tier = tier_on(agent)
    rounds, ids_per_thread = 40, 16
    taken: list[JobResult] = []
    outstanding: dict[int, threading.Event] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def submitter(first: int) -> None:
        rng = random.Random(first)
        try:
            for _ in range(rounds):
                waits = {}
                for job_id in range(first, first + ids_per_thread):
                    waits[job_id] = done = threading.Event()
                    with lock:
                        outstanding[job_id] = done
                    store(tier, job_id, rng.randrange(64))
                for job_id, done in waits.items():
                    assert done.wait(10), f"job {job_id} never came"
        except BaseException as error:  # surfaced by the main thread
            errors.append(error)

    threads = [threading.Thread(target=submitter, args=(first,)) for first in (0, 1000)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        for result in tier.get_finished_jobs():
            taken.append(result)
            with lock:
                outstanding.pop(result.job_id).set()  # KeyError: a result nobody waited for
    for thread in threads:
        thread.join(1)
    assert errors == []
    assert len(taken) == 2 * rounds * ids_per_thread
    assert all(r.success for r in taken)
    assert outstanding == {}
    tier.shutdown(timeout=5)
    assert agent.live_xfer_handles() == 0


def test_a_job_id_is_refused_while_its_result_waits_and_taken_once_it_was_handed_out(
        watched: Watched) -> None:
    tier = tier_on(watched)
    store(tier, 7)
    watched.end(0)
    wait_for(lambda: len(tier._books.results) == 1)  # published by the thread, not taken
    with pytest.raises(InvalidJobError, match="job 7 has a result not yet collected"):
        store(tier, 7)
    assert [r.job_id for r in tier.get_finished_jobs()] == [7]
    store(tier, 7)  # its result is out: the id is free again
    watched.end(1)
    assert [r.job_id for r in collect(tier, 1)] == [7]
    tier.shutdown(timeout=5)


def test_pending_work_is_never_denied_while_the_thread_publishes(
        watched: Watched, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread is held inside the publishing of a result: the caller still sees work
    pending (the record, or the result), so a loop that stops when there is none, or a drain,
    cannot end before the result can be taken."""
    inside, go_on = threading.Event(), threading.Event()
    making = Transfer.result

    def held_result(transfer: Transfer) -> JobResult:
        inside.set()
        go_on.wait(10)
        return making(transfer)

    monkeypatch.setattr(Transfer, "result", held_result)
    tier = tier_on(watched)
    store(tier, 0)
    watched.end(0)
    assert inside.wait(10)
    try:
        assert tier.has_pending_work()
        assert tier.get_finished_jobs() == []
    finally:
        go_on.set()
    assert [r.job_id for r in collect(tier, 1)] == [0]
    assert not tier.has_pending_work()
    tier.shutdown(timeout=5)


def test_without_a_thread_to_be_had_the_caller_polls(
        watched: Watched, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def refuse(thread: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    tier = tier_on(watched)
    with caplog.at_level(logging.ERROR, logger="kvfsm"):
        store(tier, 0)  # taken all the same: the job is in flight
    assert tier.state_of(0) is not None
    assert tier.stats()["progress"] == {
        "running": False, "polls": 0,
        "error": "not started: RuntimeError: can't start new thread"}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "ObjectStoreTier: the progress thread could not start (can't start new thread); "
        "get_finished_jobs polls on the caller's thread"]
    watched.end(0)
    assert [r.job_id for r in collect(tier, 1)] == [0]
    assert watched.check_threads == {"MainThread"}
    tier.shutdown(timeout=5)
    assert watched.live_xfer_handles() == 0


def test_no_thread_is_started_for_a_job_that_was_over_at_submit() -> None:
    agent = FakeNixlAgent("at-once", complete_after_polls=0)  # transfer() answers DONE
    tier = ObjectStoreTier(torch.zeros(8, 16), agent=agent,
                           policy=RetryPolicy(progress_interval=0.5))
    store(tier, 0, 0)
    assert progress_threads() == []  # nothing unpublished: no thread to poll it
    assert [r.job_id for r in tier.get_finished_jobs()] == [0]
    tier.shutdown(timeout=5)


def test_shutdown_without_a_deadline_stops_the_thread(watched: Watched) -> None:
    tier = tier_on(watched)
    store(tier, 0)
    watched.end(0)
    tier.shutdown(timeout=None)
    assert progress_threads() == []
    assert [r.job_id for r in tier.get_finished_jobs()] == [0]


def test_shutdown_wakes_the_thread_from_a_long_interval_and_it_ends_without_a_poll(
        watched: Watched) -> None:
    """Shutdown wakes the thread from its pause: it ends at once, without a poll, and neither
    shutdown nor the process waits out the interval (it used to sleep out its 1.5 s)."""
    primary = torch.zeros(8, 16)
    tier = ObjectStoreTier(primary, agent=watched,
                           policy=RetryPolicy(progress_interval=3600.0))  # past the test's time
    store(tier, 0, 0)
    watched.end(0)
    thread = tier._progress_last
    assert thread is not None
    tier.shutdown(timeout=None)  # (one that waited out the interval fails on the test timeout)
    thread.join(30)
    assert not thread.is_alive(), "the thread slept on after shutdown"
    assert tier.closed and [r.job_id for r in tier.get_finished_jobs()] == [0]
    assert watched.total_checks() == 1  # made by shutdown's drain: the thread never polled


def test_a_process_that_forgets_shutdown_exits_only_once_every_transfer_is_published() -> None:
    script = textwrap.dedent("""
        import atexit, time, torch
        from kvfsm import TransferJob
        from kvfsm.policy import RetryPolicy
        from kvfsm.testing import FakeNixlAgent
        from kvfsm.tiers import ObjectStoreTier

        agent = FakeNixlAgent("slow", complete_after_polls=200)  # about 0.2 s of polls
        tier = ObjectStoreTier(torch.zeros(8, 16), agent=agent,
                               policy=RetryPolicy(progress_interval=0.001))
        # runs after the interpreter waited for its threads, as the process exits
        atexit.register(lambda: print("at exit:", len(tier.unpublished()),
                                      agent.running_transfers(), agent.live_xfer_handles()))
        for job_id in range(8):
            tier.submit_store(TransferJob(job_id, [f"block-{job_id}"], [job_id]))
        print("main ends with", agent.running_transfers(), "running", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["main ends with 8 running", "at exit: 0 0 0"]


@pytest.mark.parametrize("bad", [0, -0.5, float("inf"), 1e10, float("nan"), True, "0.001"])
def test_a_bad_progress_interval_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match=r"RetryPolicy\.progress_interval must be"):
        RetryPolicy(progress_interval=bad)  # type: ignore[arg-type]


def poll_of_each_check(agent: FakeNixlAgent, tier: ObjectStoreTier) -> list[int]:
    """From now on, for each state check ``agent`` answers on the tier's progress thread, which
    of its polls made it (``stats()`` reads the books without the tier's lock). A check made
    on another thread is not counted: the caller's own poll, while no progress thread runs
    (the last job published, the next submit not yet made), is not the thread's, nor sliced."""
    made: list[int] = []
    answer = agent.check_xfer_state

    def check_xfer_state(handle: Any) -> str:
        if threading.current_thread().name.startswith("kvfsm-progress"):
            made.append(tier.stats()["progress"]["polls"])
        return answer(handle)

    agent.check_xfer_state = check_xfer_state  # type: ignore[method-assign]
    return made


def test_the_threads_poll_makes_at_most_a_slice_of_checks_however_many_are_due() -> None:
    """Every running transfer due every millisecond, thousands running: far more checks than
    a poll may make while it holds the tier's lock (a submit waits for it). Each poll of the
    thread makes at most PROGRESS_SLICE; the turns past it come in the next polls, so every
    transfer is still asked about, and every result comes."""
    agent = Held()
    tier = tier_on(agent, max_unpolled=0.001)
    count = 3 * PROGRESS_SLICE
    for job_id in range(count):
        store(tier, job_id)
    poll_of_check = poll_of_each_check(agent, tier)
    wait_for(lambda: len(poll_of_check) >= 3 * count)

    per_poll = collections.Counter(poll_of_check)
    assert max(per_poll.values()) <= PROGRESS_SLICE
    assert max(per_poll.values()) == PROGRESS_SLICE  # the slice was spent: all were due
    assert all(agent.checks[id(handle)] >= 2 for handle in agent.posted)
    agent.end(*range(count))
    assert len(collect(tier, count)) == count
    tier.shutdown(timeout=5)
    assert agent.live_xfer_handles() == 0 and agent.misuses == []


class Gated(FakeNixlAgent):
    """Each transfer ends at its 20th state check, counted from the time ``opens_at``
    transfers were posted (until then every check answers PROC): that many run at once,
    however fast the submits are against the checks."""

    def __init__(self, opens_at: int) -> None:
        super().__init__("behind", complete_after_polls=20)
        self.closed_for = opens_at

    def transfer(self, handle: Any, notif_msg: bytes | str = b"") -> str:
        answer = super().transfer(handle, notif_msg)
        self.closed_for = max(self.closed_for - 1, 0)
        return answer

    def check_xfer_state(self, handle: Any) -> str:
        if self.closed_for:
            self._xfer("check_xfer_state", handle)  # a released handle is still a misuse
            return "PROC"
        return super().check_xfer_state(handle)


def test_a_thread_far_behind_with_faults_still_hands_out_every_result_once() -> None:
    """Two threads submit 3,000 stores between them while the thread is asked to check every
    running transfer every millisecond (over 1,100 run at once, each for 20 checks: more than
    its slice), and 2 % of NIXL's calls fail at random: the thread polls slice after slice,
    the submits go on meanwhile, and every job has exactly one result; no handle is released
    twice."""
    fake = Gated(opens_at=1_100)
    agent = FaultyAgent(fake)
    tier = tier_on(agent, max_unpolled=0.001)
    poll_of_check = poll_of_each_check(fake, tier)
    agent.chaos(0.02, seed=18)  # (after the tier's own registration)
    per_thread = 1_500
    errors: list[BaseException] = []

    def submitter(first: int) -> None:
        try:
            for job_id in range(first, first + per_thread):
                store(tier, job_id)
        except BaseException as error:  # surfaced by the main thread
            errors.append(error)

    threads = [threading.Thread(target=submitter, args=(first,)) for first in (0, 10_000)]
    for thread in threads:
        thread.start()
    results = collect(tier, 2 * per_thread, timeout=50)  # (seconds here; mutmut's stats
    for thread in threads:  # run, every call through its trampolines, needs over 30)
        thread.join(5)

    assert errors == []
    assert collections.Counter(r.job_id for r in results) == collections.Counter(
        [*range(per_thread), *range(10_000, 10_000 + per_thread)])
    assert any(r.success for r in results) and any(not r.success for r in results)
    assert tier.stats()["progress"]["error"] is None
    per_poll = collections.Counter(poll_of_check)
    # behind, a slice at a time (a check that raised never reached the fake agent)
    assert PROGRESS_SLICE * 3 // 4 < max(per_poll.values()) <= PROGRESS_SLICE
    tier.shutdown(timeout=5)
    assert agent.misuses == []


def test_a_listener_on_the_progress_thread_may_shut_the_tier_down() -> None:
    """An on_published listener runs on the progress thread, which publishes; its shutdown
    once tried to join that very thread, and raised instead of closing the tier."""
    agent = FakeNixlAgent("listener-shutdown", complete_after_polls=3)
    tier = ObjectStoreTier(torch.zeros(4, 16), agent=agent,
                           policy=RetryPolicy(progress_interval=0.001))
    raised: list[BaseException] = []
    published: list[int] = []

    def listener(transfer: Transfer) -> None:
        published.append(transfer.job_id)
        if len(published) < 2:
            return  # (the second submit must come first, however slowly this runs)
        try:
            tier.shutdown(timeout=1.0)
        except BaseException as error:  # (kept, for the assertion below)
            raised.append(error)

    tier.on_published.append(listener)
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.submit_store(TransferJob(2, ["b"], [1]))
    results: list[JobResult] = []
    deadline = time.monotonic() + 10
    while len(results) < 2 and time.monotonic() < deadline:
        results += tier.get_finished_jobs()
        time.sleep(0.001)
    assert sorted((r.job_id, r.success) for r in results) == [(1, True), (2, True)]
    assert raised == []
    assert tier.closed
    assert (agent.live_registrations(), agent.misuses) == (0, [])


@pytest.mark.timeout(30)
def test_a_listener_holding_its_own_lock_shuts_the_tier_down_while_another_thread_drains(
) -> None:
    """A listener keeps its books under a lock of its own and shuts the tier down on the
    progress thread; meanwhile the scheduler's thread drains. The listener's shutdown waits
    holding the tier's lock, so the scheduler's drain waits for it, and job 2 is published on
    the progress thread, inside the shutdown. (A shutdown that let go of the poll's hold while
    it slept let the scheduler's poll in: it ran the listener, which waited for the
    listener's lock, while the progress thread waited for the tier's: a deadlock.)"""
    agent = Held()
    tier = ObjectStoreTier(torch.zeros(4, 16), agent=agent, poll_interval=0.01,
                           policy=RetryPolicy(progress_interval=0.001))
    books = threading.RLock()
    inside = threading.Event()
    published: list[tuple[int, str]] = []

    def listener(transfer: Transfer) -> None:
        with books:
            published.append((transfer.job_id, threading.current_thread().name))
            if transfer.job_id == 1:
                inside.set()
                tier.shutdown(timeout=10)

    tier.on_published.append(listener)
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.submit_store(TransferJob(2, ["b"], [1]))
    agent.end(0)
    assert inside.wait(10)
    time.sleep(0.05)  # the listener's shutdown waits for job 2
    agent.end(1)
    scheduler = threading.Thread(target=tier.drain_jobs, args=(10,), name="scheduler",
                                 daemon=True)
    scheduler.start()
    scheduler.join(15)
    assert not scheduler.is_alive(), "the scheduler's drain returned"
    assert tier.closed
    assert [job for job, _ in published] == [1, 2]
    assert {thread for _, thread in published} == {tier._progress_last.name}


@pytest.mark.timeout(30)
def test_a_submit_is_refused_at_once_while_a_listeners_shutdown_on_the_progress_thread_waits(
) -> None:
    """A listener on the progress thread shuts the tier down while NIXL still runs job 2: the
    shutdown waits for it inside the thread's poll, which holds the tier's lock. Meanwhile a
    submit on the scheduler's thread is refused at once, not once the shutdown is over (it
    waited for the lock, 1.95 s in a review's run). Once NIXL ends job 2 the shutdown
    publishes it and closes the tier."""
    agent = Held()
    tier = ObjectStoreTier(torch.zeros(4, 16), agent=agent,
                           policy=RetryPolicy(progress_interval=0.001))
    waiting, over = threading.Event(), threading.Event()
    raised: list[BaseException] = []

    def listener(transfer: Transfer) -> None:
        if transfer.job_id != 1:
            return
        waiting.set()
        try:
            tier.shutdown(timeout=5)
        except BaseException as error:  # (kept, for the assertion below)
            raised.append(error)
        finally:
            over.set()

    tier.on_published.append(listener)
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.submit_store(TransferJob(2, ["b"], [1]))
    agent.end(0)  # job 1 ends; job 2 runs on
    assert waiting.wait(10)
    with pytest.raises(TierClosedError, match="job 3 refused"):
        tier.submit_store(TransferJob(3, ["c"], [2]))
    assert not over.is_set(), "refused while the listener's shutdown waits for job 2"
    assert tier.stats()["in_flight"] == {"CANCELLING": 1}, "cancelled, NIXL still runs it"
    agent.end(1)
    assert over.wait(10) and raised == []
    assert tier.closed
    assert sorted((r.job_id, r.success) for r in tier.get_finished_jobs()) == [
        (1, True), (2, False)]
    assert (agent.live_registrations(), agent.misuses) == (0, [])


def _a_manager_whose_tier_polls_on_its_thread(
        interval: float) -> tuple[TieringManager, ObjectStoreTier]:
    """A manager with one tier whose progress thread polls every ``interval`` seconds, and
    one store of it that NIXL has over (its first state check answers DONE) but that no
    poll has asked about yet."""
    primary = CPUPrimaryTier(4, 256, torch.uint8)
    agent = FakeNixlAgent("progress", complete_after_polls=1)
    tier = ObjectStoreTier(primary.cache, agent=agent,
                           policy=RetryPolicy(progress_interval=interval))
    manager = TieringManager(primary, {"t": tier})
    (block,) = primary.allocate(["k"])
    primary.complete_write([block], success=True)
    assert len(manager.store([block])) == 1
    return manager, tier


def test_a_managers_drain_polls_a_tier_whose_thread_polls_and_finds_what_nixl_finished(
) -> None:
    """A drain waits: like the tier's own drain_jobs, the manager's drain polls each tier on
    the caller's thread, progress thread or not. drain(0) is one step, and it finds the store
    NIXL finished, though the tier's thread would poll only a minute later."""
    manager, tier = _a_manager_whose_tier_polls_on_its_thread(60.0)
    try:
        (done,) = manager.drain(0)
        assert done.success and done.tier == "t"
        assert not manager.has_pending_work() and not tier.has_pending_work()
    finally:
        manager.shutdown(5)


def test_a_managers_shutdown_is_not_held_up_by_a_tiers_progress_thread_pause() -> None:
    """Shutdown drains first: with the tier's one store over in NIXL, the manager closes
    within its bound instead of waiting for the thread's next poll, a minute away."""
    manager, tier = _a_manager_whose_tier_polls_on_its_thread(60.0)
    manager.shutdown(5)
    assert manager.closed and tier.closed


class LookingTier(ObjectStoreTier):
    """A tier of the user's own that looks at every result it hands out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[int] = []

    def get_finished_jobs(self) -> list[JobResult]:
        results = super().get_finished_jobs()
        self.seen += [result.job_id for result in results]
        return results


@pytest.mark.parametrize("timeout", [None, 5.0], ids=["drain()", "drain(5)"])
def test_a_managers_drain_hands_results_out_through_a_tiers_own_get_finished_jobs(
        timeout: float | None) -> None:
    """A tier whose get_finished_jobs is its own is drained through it: it sees every
    result the manager finalizes."""
    primary = CPUPrimaryTier(4, 256, torch.uint8)
    tier = LookingTier(primary.cache, agent=FakeNixlAgent("own", complete_after_polls=1))
    manager = TieringManager(primary, {"t": tier})
    (block,) = primary.allocate(["k"])
    primary.complete_write([block], success=True)
    (job_id,) = manager.store([block])
    (done,) = manager.drain(timeout)
    assert done.success and tier.seen == [job_id]
    manager.shutdown(5)


def test_drain0_of_a_tier_with_its_own_hand_out_and_a_progress_thread_finds_what_nixl_finished(
) -> None:
    """operations.md: drain(0) is one step, each kvfsm tier's poll made on the caller's
    thread, every running transfer checked, a progress thread or not."""
    primary = CPUPrimaryTier(4, 256, torch.uint8)
    tier = LookingTier(primary.cache, agent=FakeNixlAgent("own", complete_after_polls=1),
                       policy=RetryPolicy(progress_interval=60.0))
    manager = TieringManager(primary, {"t": tier})
    (block,) = primary.allocate(["k"])
    primary.complete_write([block], success=True)
    manager.store([block])
    try:
        (done,) = manager.drain(0)
        assert done.success
    finally:
        manager.shutdown(5)


def test_drain0_of_an_overriding_tier_checks_every_running_transfer() -> None:
    """A drain's poll checks every running transfer (as drain_jobs), past check_all_below:
    the newest store that NIXL finished is found though the oldest still runs."""
    primary = CPUPrimaryTier(40, 256, torch.uint8)
    agent = Held()
    tier = LookingTier(primary.cache, agent=agent,
                       policy=RetryPolicy(check_all_below=0, max_unpolled=60.0))
    manager = TieringManager(primary, {"t": tier})
    blocks = primary.allocate([f"k{i}" for i in range(40)])
    primary.complete_write(blocks, success=True)
    for block in blocks:
        manager.store([block])
    assert manager.step() == []
    agent.end(39)
    try:
        with pytest.raises(TieringDrainTimeout) as timed_out:  # (three still run)
            manager.drain(0)
        assert [done.job.job_id for done in timed_out.value.finalized] == [40]
    finally:
        agent.end(*range(39))
        manager.shutdown(5)


class HandingOnTier(ObjectStoreTier):
    """Hands its results to a worker thread that calls the tier (cancel, of a job it no
    longer wants) and waits for it, as a tier of the user's own may."""

    handed = False
    worker_done = False

    def get_finished_jobs(self) -> list[JobResult]:
        results = super().get_finished_jobs()
        self.handed = True
        if results:
            def work() -> None:
                with contextlib.suppress(Exception):
                    self.cancel(10**6)  # (UnknownJobError, once it has the lock)
            worker = threading.Thread(target=work, daemon=True)
            worker.start()
            worker.join(2.0)
            self.worker_done = not worker.is_alive()
        return results


def _one_store_over(cls: type[ObjectStoreTier]) -> tuple[TieringManager, Any]:
    """A manager over one tier of ``cls``, one store submitted that NIXL ends at the next
    state check."""
    primary = CPUPrimaryTier(4, 256, torch.uint8)
    tier = cls(primary.cache, agent=FakeNixlAgent("own", complete_after_polls=1))
    manager = TieringManager(primary, {"t": tier})
    (block,) = primary.allocate(["k"])
    primary.complete_write([block], success=True)
    manager.store([block])
    return manager, tier


@pytest.mark.parametrize("how", ["step", "drain"])
def test_a_managers_drain_runs_a_tiers_own_get_finished_jobs_with_the_lock_free(
        how: str) -> None:
    """A tier of the user's own whose hand-out has another thread call the tier and waits
    for it: the lock is free then, in a drain as in a step."""
    manager, tier = _one_store_over(HandingOnTier)
    try:
        (done,) = manager.step() if how == "step" else manager.drain(5)
        assert done.success and tier.worker_done
    finally:
        manager.shutdown(5)


class CountingTier(ObjectStoreTier):
    """Counts its polls."""

    polls = 0

    def _poll(self, *args: Any, **kwargs: Any) -> None:
        self.polls += 1
        super()._poll(*args, **kwargs)


class CountingOwnHandOut(CountingTier):
    """A tier of the user's own that hands its results out through its own method."""

    def get_finished_jobs(self) -> list[JobResult]:
        return super().get_finished_jobs()


class CountingGeneratorHandOut(CountingTier):
    """A tier of the user's own that looks at each result as it hands it out (a generator:
    the manager takes any iterable, and keeps those yielded before a raise)."""

    def get_finished_jobs(self) -> Iterator[JobResult]:  # type: ignore[override]
        yield from super().get_finished_jobs()


def test_drain0_polls_a_tier_with_its_own_hand_out_once_as_any_other() -> None:
    """drain(0) is one step, at most one poll of each tier: a tier whose get_finished_jobs
    is its own is polled once too (its hand-out under the drain only hands out)."""
    polls = {}
    for cls in (CountingTier, CountingOwnHandOut, CountingGeneratorHandOut):
        manager, tier = _one_store_over(cls)
        tier.polls = 0
        (done,) = manager.drain(0)
        assert done.success
        polls[cls.__name__] = tier.polls
        manager.shutdown(5)
    assert polls == {"CountingTier": 1, "CountingOwnHandOut": 1, "CountingGeneratorHandOut": 1}


class HandedOver:
    """A tier's lock that, armed, waits after the release that lets go of it until another
    thread took it (``taken``): the thread switch there made certain."""

    def __init__(self, inner: Any, taken: threading.Event) -> None:
        self.inner, self.taken, self.armed = inner, taken, False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return bool(self.inner.acquire(blocking, timeout))

    def release(self) -> None:
        self.inner.release()
        if self.armed and not self.inner._is_owned():
            self.armed = False
            self.taken.wait(5)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@pytest.mark.parametrize("cls", [CountingTier, CountingOwnHandOut, CountingGeneratorHandOut])
def test_a_drain_never_waits_past_its_deadline_for_a_lock_taken_after_its_poll(
        cls: type[ObjectStoreTier]) -> None:
    """Another thread's call takes the tier's lock the moment the drain's poll lets go of
    it, and holds it until the test says: drain(0.2) returns meanwhile, with its job (it
    waited for that lock in the tier's own get_finished_jobs, without a bound)."""
    manager, tier = _one_store_over(cls)
    taken, go = threading.Event(), threading.Event()
    lock = tier._lock = HandedOver(tier._lock, taken)

    def other_call() -> None:  # (a submit whose NIXL call is slow, say)
        with lock.inner:
            taken.set()
            go.wait(10)

    holder = threading.Thread(target=other_call, daemon=True)
    drains_poll = tier._poll

    def poll(*args: Any, **kwargs: Any) -> None:
        drains_poll(*args, **kwargs)
        if kwargs.get("everything") and not holder.is_alive() and not taken.is_set():
            lock.armed = True
            holder.start()  # (it waits for the lock the drain lets go of next)

    tier._poll = poll  # type: ignore[method-assign]
    try:
        (done,) = manager.drain(0.2)
        assert done.success
        assert holder.is_alive() and not go.is_set(), "the drain waited for the lock"
    finally:
        go.set()
        holder.join(10)
        manager.shutdown(5)


def test_a_drain_past_its_deadline_hands_out_through_the_tiers_own_method() -> None:
    manager, tier = _one_store_over(LookingTier)
    with tier._lock:
        tier._poll(everything=True)  # (published, not yet handed out)
    taken, go = threading.Event(), threading.Event()

    def other_call() -> None:
        with tier._lock:
            taken.set()
            go.wait(10)

    holder = threading.Thread(target=other_call, daemon=True)
    holder.start()
    taken.wait(5)
    try:
        (done,) = manager.drain(0.05)
        assert tier.seen == [done.job.job_id], "handed out past the tier's own method"
    finally:
        go.set()
        holder.join(10)
        manager.shutdown(5)


class RaisingGeneratorHandOut(ObjectStoreTier):
    """A tier of the user's own whose hand-out raises once, after handing out one result."""

    raised = False

    def get_finished_jobs(self) -> Iterator[JobResult]:  # type: ignore[override]
        for result in super().get_finished_jobs():
            yield result
            if not self.raised:
                self.raised = True
                raise RuntimeError("the hand-out's own check failed")


def test_a_hand_out_that_raises_in_a_drain_loses_no_result_it_handed_before() -> None:
    """Its drain reports the error; the result handed out before it is handed out again by
    the next step, and finalized once."""
    manager, _ = _one_store_over(RaisingGeneratorHandOut)
    with pytest.raises(BookkeepingError, match="the hand-out's own check failed"):
        manager.drain(0)
    (done,) = manager.step()
    assert done.success and not manager.has_pending_work()
    manager.shutdown(5)


def _two_stores_over(cls: type[ObjectStoreTier]) -> tuple[TieringManager, Any]:
    primary = CPUPrimaryTier(4, 256, torch.uint8)
    tier = cls(primary.cache, agent=FakeNixlAgent("own", complete_after_polls=1))
    manager = TieringManager(primary, {"t": tier})
    for key in ("k1", "k2"):
        (block,) = primary.allocate([key])
        primary.complete_write([block], success=True)
        manager.store([block])
    return manager, tier


class RaisingListHandOut(ObjectStoreTier):
    """A list hand-out whose own check after super() fails once it has results: it raises
    ``raises``, once."""

    raises: BaseException | None = RuntimeError("the hand-out's own check failed")

    def get_finished_jobs(self) -> list[JobResult]:
        results = super().get_finished_jobs()
        if results and self.raises is not None:
            error, self.raises = self.raises, None
            raise error
        return results


def test_a_list_hand_out_that_raises_in_a_drain_loses_no_result() -> None:
    manager, tier = _one_store_over(RaisingListHandOut)
    try:
        with pytest.raises(BookkeepingError, match="own check failed"):
            manager.drain(0)
        assert tier.has_pending_work() or not manager.outstanding(), (
            "the result super() took under the mark was neither handed out nor given back")
        (done,) = manager.drain(1)
        assert done.success
    finally:
        manager.shutdown(5)


def test_a_generator_hand_out_that_raises_mid_way_loses_no_later_result() -> None:
    manager, tier = _two_stores_over(RaisingGeneratorHandOut)
    try:
        with pytest.raises(BookkeepingError, match="own check failed"):
            manager.drain(0)
        assert len(manager.outstanding()) == 2
        assert len(tier._books.results) == 2, (
            f"given back {len(tier._books.results)} of the 2 results super() took")
        done = manager.drain(1)
        assert len(done) == 2
    finally:
        manager.shutdown(5)


def test_a_ctrl_c_in_a_list_hand_out_under_a_drain_loses_no_result() -> None:
    manager, tier = _one_store_over(RaisingListHandOut)
    tier.raises = KeyboardInterrupt()
    try:
        with pytest.raises(KeyboardInterrupt):
            manager.drain(0)
        assert tier.owes(manager.outstanding()[0].job.job_id), "the result is lost"
        (done,) = manager.drain(1)
        assert done.success
    finally:
        manager.shutdown(5)


def test_a_ctrl_c_as_a_drain_gives_a_hand_outs_results_back_loses_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-out raised; a Ctrl-C lands as the drain gives its results back (made
    pending from inside the give-back's only call after the results are back: its job-id
    getter, a C callable). The result is back in the tier's books, the job outstanding, and
    the next drain finalizes it."""
    manager, tier = _one_store_over(RaisingListHandOut)
    sigint_from_c = functools.partial(
        next, map(_thread.interrupt_main, itertools.repeat(signal.SIGINT)))
    monkeypatch.setattr(kvfsm.contract, "_JOB_ID", sigint_from_c)
    with pytest.raises(KeyboardInterrupt):
        manager.drain(0)
    monkeypatch.undo()
    assert len(manager.outstanding()) == 1 and tier.has_pending_work()
    (done,) = manager.drain(5)
    assert done.success
    manager.shutdown(5)
