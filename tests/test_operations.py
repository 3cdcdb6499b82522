"""Operations under faults and load: bounded retries, quarantine, cancel, threads, stats, logs."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfsm import FailureKind, TransferJob, TransferState
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, Raise, ReturnErr, StayProc
from kvfsm.tiers import (
    DrainTimeout,
    FileTier,
    Lookup,
    ObjectStoreTier,
    TierClosedError,
    UnknownJobError,
)

FOREVER = 10**6


@pytest.fixture
def primary() -> torch.Tensor:
    return torch.arange(16 * 32, dtype=torch.float32).view(16, 32)


def store(job_id: int, block: int) -> TransferJob:
    return TransferJob(job_id, [f"key-{block}"], [block])


# -- F9: a release that never succeeds ------------------------------------------------------------

def test_f9_past_its_attempts_a_stuck_release_is_quarantined_and_the_engine_goes_idle(
    primary: torch.Tensor,
) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(max_attempts=3))
    agent.inject("release_xfer_handle", Raise("NIXL_ERR_NOT_ALLOWED"), times=FOREVER)
    tier.submit_store(store(1, 0))
    assert tier.get_finished_jobs() == []  # release failure 1: retried
    assert tier.get_finished_jobs() == []  # failure 2: retried
    (result,) = tier.get_finished_jobs()  # failure 3: the bound is spent
    assert (result.job_id, result.success) == (1, False)
    assert not tier.has_pending_work(), "the engine can go idle"
    tier.drain_jobs(timeout=1)  # returns at once: nothing left to wait for
    stats = tier.stats()
    assert (stats["quarantined"], stats["quarantined_running"], stats["retries"]) == (1, 0, 2)
    assert agent.call_count("release_xfer_handle") == 3
    assert agent.live_xfer_handles() == 1, "a quarantined handle is never released"


def test_f9_a_time_bound_with_backoff_spaces_the_attempts_out(primary: torch.Tensor) -> None:
    agent = FakeNixlAgent()
    policy = RetryPolicy(max_seconds=0.2, backoff=0.02, max_backoff=0.05)
    tier = ObjectStoreTier(primary, agent=agent, policy=policy)
    agent.inject("release_xfer_handle", Raise(), times=FOREVER)
    tier.submit_store(store(1, 0))
    tier.drain_jobs(timeout=10)  # polls every 0.5 ms; the backoff decides when to call
    (result,) = tier.get_finished_jobs()
    assert not result.success
    attempts = agent.call_count("release_xfer_handle")
    assert 3 <= attempts <= 10, f"{attempts} attempts in 0.2 s with a 20-50 ms backoff"
    assert tier.stats()["quarantined"] == 1


def test_at_the_shutdown_deadline_a_release_backing_off_gets_one_last_try(
    primary: torch.Tensor,
) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(backoff=60, max_backoff=60))
    agent.inject("release_xfer_handle", Raise("NIXL_ERR_BACKEND"))  # the first release only
    tier.submit_store(store(1, 0))
    assert tier.get_finished_jobs() == []  # the release raised; the next try is a minute away
    assert tier.state_of(1) is TransferState.DONE
    tier.shutdown(timeout=0.05)  # the deadline comes long before the backoff ends
    (result,) = tier.get_finished_jobs()
    assert result.success, "the last try released the handle: the store keeps its outcome"
    assert tier.stats()["quarantined"] == 0 and tier.closed
    assert agent.call_count("release_xfer_handle") == 2
    assert agent.live_xfer_handles() == 0


def test_f9_without_a_bound_drain_stops_at_its_deadline_and_names_the_stuck_job(
    primary: torch.Tensor,
) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(max_seconds=None))
    agent.inject("release_xfer_handle", Raise("NIXL_ERR_NOT_ALLOWED"), times=FOREVER)
    tier.submit_store(store(7, 0))
    started = time.monotonic()
    with pytest.raises(DrainTimeout, match=r"job 7: DONE, retries=\d+, last error: "
                                           r"FakeNixlError: NIXL_ERR_NOT_ALLOWED"):
        tier.drain_jobs(timeout=0.05)
    assert time.monotonic() - started < 5
    assert tier.state_of(7) is TransferState.DONE, "a drain that gives up changes nothing"


def test_a_bad_retry_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="max_attempts must be positive"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="backoff <= max_backoff"):
        RetryPolicy(backoff=2.0, max_backoff=1.0)


# -- F10: cancel and shutdown ----------------------------------------------------------------------

def test_f10_a_cancelled_job_fails_once_and_its_transfer_is_waited_for(
    primary: torch.Tensor,
) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("check_xfer_state", StayProc(3))
    tier.submit_store(store(1, 0))
    tier.cancel(1)
    assert tier.state_of(1) is TransferState.CANCELLING
    tier.cancel(1)  # again: nothing more happens
    for _ in range(3):
        assert tier.get_finished_jobs() == [], "NIXL still runs it: the handle is kept"
        assert agent.live_xfer_handles() == 1
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success) == (1, False)
    assert agent.live_xfer_handles() == 0
    assert tier.get_finished_jobs() == []
    with pytest.raises(UnknownJobError, match="job 1 is not in flight"):
        tier.cancel(1)
    tier.shutdown()


def test_f10_a_cancelled_transfer_that_then_fails_keeps_nixls_error(
    primary: torch.Tensor,
) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("check_xfer_state", StayProc(1))
    agent.inject("check_xfer_state", ReturnErr(), at=2)
    tier.submit_store(store(1, 0))
    assert tier.get_finished_jobs() == []
    tier.cancel(1)
    (result,) = tier.get_finished_jobs()
    assert not result.success
    assert agent.running_transfers() == 0
    tier.shutdown()


@pytest.mark.timeout(30)
def test_f10_a_cancelled_transfer_retries_its_release_from_when_nixl_ended_it(
    primary: torch.Tensor,
) -> None:
    """The release of a transfer is retried for ``max_seconds`` after the transfer ended. One
    cancelled while it ran ends when NIXL says so, not at the cancel: NIXL runs it on for
    longer than ``max_seconds``, then its release raises once, and is tried again rather than
    quarantined; the result's ``transfer_time`` runs until NIXL ended it."""
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(max_seconds=0.1))
    agent.inject("check_xfer_state", StayProc(3))
    agent.inject("release_xfer_handle", Raise())
    tier.submit_store(store(1, 0))
    cancelled = time.monotonic()
    tier.cancel(1)
    results = []
    while not results and time.monotonic() - cancelled < 10:
        time.sleep(0.06)  # three polls answered PROC: NIXL ends it 0.18 s after the cancel
        results = tier.get_finished_jobs()
    (result,) = results
    assert (result.success, result.reason.kind) == (False, FailureKind.CANCELLED)
    assert tier.stats()["quarantined"] == 0, "retried, not given up at once"
    assert tier.stats()["retries"] == 1 and agent.live_xfer_handles() == 0
    assert result.transfer_time >= 0.15, "the transfer ran until NIXL ended it"
    tier.shutdown()


def test_f10_cancelling_a_failed_transfer_waiting_to_release_changes_nothing(
    primary: torch.Tensor,
) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("check_xfer_state", Raise())
    agent.inject("release_xfer_handle", Raise())
    tier.submit_store(store(1, 0))
    assert tier.get_finished_jobs() == []
    assert tier.state_of(1) is TransferState.FAILED
    tier.cancel(1)
    assert tier.state_of(1) is TransferState.FAILED
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
    tier.shutdown()


def test_f10_cancelling_a_finished_transfer_keeps_its_outcome(primary: torch.Tensor) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("release_xfer_handle", Raise())
    tier.submit_store(store(1, 0))
    assert tier.get_finished_jobs() == []
    assert tier.state_of(1) is TransferState.DONE
    tier.cancel(1)
    (result,) = tier.get_finished_jobs()
    assert result.success, "the data is stored; the outcome is never recomputed (F3)"
    tier.shutdown()


def test_f10_a_transfer_still_running_at_the_shutdown_deadline_is_never_given_up(
    primary: torch.Tensor,
) -> None:
    """Publishing it would let the engine reuse blocks NIXL still writes: shutdown says so."""
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("check_xfer_state", StayProc(400))  # about 0.2 s of polls
    tier.submit_store(store(1, 0))
    tier.submit_store(store(2, 1))
    with pytest.raises(DrainTimeout, match=r"(?s)NIXL still runs these.*job 1: CANCELLING"):
        tier.shutdown(timeout=0.02)
    assert sorted(r.job_id for r in tier.get_finished_jobs()) == [2]
    assert tier.state_of(1) is TransferState.CANCELLING
    assert not tier.closed and agent.live_registrations("DRAM") == 1
    with pytest.raises(TierClosedError):
        tier.submit_store(store(3, 2))  # shutting down: nothing new
    tier.shutdown(timeout=5)  # NIXL finishes it after all
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
    assert tier.closed and agent.running_transfers() == 0 and agent.misuses == []


def test_a_running_bound_quarantines_a_stuck_transfer_when_a_user_asks_for_it(
    primary: torch.Tensor,
) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(max_running_seconds=0.02))
    agent.inject("check_xfer_state", StayProc(FOREVER))
    tier.submit_store(store(1, 0))
    assert tier.get_finished_jobs() == []
    time.sleep(0.03)
    (result,) = tier.get_finished_jobs()
    assert not result.success
    assert tier.stats()["quarantined_running"] == 1
    assert agent.live_xfer_handles() == 1, "never released while it may run"


def test_a_running_bound_also_holds_for_a_cancelled_transfer(primary: torch.Tensor) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(max_running_seconds=0.02))
    agent.inject("check_xfer_state", StayProc(FOREVER))
    tier.submit_store(store(1, 0))
    tier.cancel(1)
    time.sleep(0.03)
    (result,) = tier.get_finished_jobs()
    assert not result.success
    assert tier.stats()["quarantined_running"] == 1


def test_a_listener_that_raises_costs_no_result(primary: torch.Tensor) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent)

    def broken(transfer: object) -> None:
        raise RuntimeError("listener bug")

    tier.on_published.append(broken)
    tier.submit_store(store(1, 0))
    (result,) = tier.get_finished_jobs()
    assert result.success
    tier.shutdown()
    assert agent.misuses == []


# -- threads -------------------------------------------------------------------------------------

def test_submit_collect_and_lookup_from_three_threads_lose_and_duplicate_nothing(
    primary: torch.Tensor,
) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent)
    jobs = 400
    results: list[int] = []
    lookups: list[Lookup] = []
    submitted = threading.Event()

    def submit() -> None:
        for job_id in range(jobs):
            tier.submit_store(TransferJob(job_id, [f"key-{job_id}"], [job_id % 16]))
        submitted.set()

    def collect() -> None:
        deadline = time.monotonic() + 30
        while len(results) < jobs and time.monotonic() < deadline:
            results.extend(r.job_id for r in tier.get_finished_jobs())

    def look() -> None:
        # (until a HIT too: a lookup thread that ran ahead of the stores, asking each key
        # before it was stored, and stopped as the last result came out saw none)
        deadline = time.monotonic() + 30
        hit = False
        while ((len(results) < jobs or len(lookups) < 200 or not hit)
               and time.monotonic() < deadline):
            lookups.append(tier.lookup(f"key-{len(lookups) % jobs}"))
            hit = hit or lookups[-1] is Lookup.HIT

    threads = [threading.Thread(target=f) for f in (submit, collect, look)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(results) == list(range(jobs)), "every job exactly once"
    assert Lookup.HIT in lookups, "lookups saw stores finish"
    assert agent.misuses == []
    tier.shutdown()


def test_lookups_on_another_thread_never_deadlock_shutdown(primary: torch.Tensor) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent)  # probes share the tier's agent and lock
    agent.inject("check_xfer_state", StayProc(50))
    tier.submit_store(store(1, 0))
    stop = threading.Event()

    def look() -> None:
        count = 0
        while not stop.is_set():
            try:
                tier.lookup(f"unknown-{count}")
            except TierClosedError:  # shut down: lookups are refused from then on
                return
            count += 1

    looker = threading.Thread(target=look)
    looker.start()
    done = threading.Thread(target=tier.shutdown, kwargs={"timeout": 10})
    done.start()
    done.join(timeout=20)
    stop.set()
    looker.join(timeout=20)
    assert not done.is_alive(), "shutdown finished while another thread looked blocks up"
    assert tier.closed


# -- stats and logs -------------------------------------------------------------------------------

def test_stats_count_states_failures_and_latency(primary: torch.Tensor) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("check_xfer_state", StayProc(2), at=1)
    agent.inject("check_xfer_state", Raise(), at=4)
    for job_id in range(3):
        tier.submit_store(store(job_id, job_id))
    tier.get_finished_jobs()
    assert tier.stats()["in_flight"] == {"PROCESSING": 1}
    tier.drain_jobs(timeout=5)
    stats = tier.stats()
    assert (stats["published"], stats["failed"], stats["in_flight"]) == (3, 1, {})
    assert set(stats["latency"]) == {"p50", "p90", "p99"}
    assert 0 <= stats["latency"]["p50"] <= stats["latency"]["p99"] < 5
    tier.shutdown()


def test_log_lines_carry_job_state_and_nixl_error_and_nothing_is_logged_per_poll(
    primary: torch.Tensor, caplog: pytest.LogCaptureFixture
) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(primary, agent=agent)
    caplog.set_level(logging.DEBUG, logger="kvfsm")
    agent.inject("check_xfer_state", StayProc(500))
    tier.submit_store(store(1, 0))
    for _ in range(500):
        tier.get_finished_jobs()
    assert caplog.records == [], "500 polls answered PROC: not one log line"
    tier.drain_jobs(timeout=5)

    agent.inject("check_xfer_state", Raise("NIXL_ERR_BACKEND"))
    tier.submit_store(store(2, 1))
    tier.drain_jobs(timeout=5)
    (line,) = [r for r in caplog.records if getattr(r, "kvfsm_job_id", None) == 2]
    assert line.levelno == logging.WARNING
    assert (line.kvfsm_state, line.kvfsm_nixl_error) == (  # type: ignore[attr-defined]
        "PUBLISHED", "FakeNixlError: NIXL_ERR_BACKEND")
    assert "job 2: store of 1 block(s) failed" in line.getMessage()
    tier.shutdown()


# -- teardown: a dropped tier lets go of its agent at once ----------------------------------------

@pytest.mark.parametrize("kind", ["object store", "files"])
def test_a_tier_that_is_shut_down_and_dropped_frees_its_agent_at_once(
    kind: str, primary: torch.Tensor, tmp_path: Path,
) -> None:
    """A NIXL agent torn down by the garbage collector tears down in whatever code runs then
    (a real agent's teardown took tens of ms); so nothing in a tier may hold it in a cycle."""
    agent = FakeNixlAgent()
    tier = (ObjectStoreTier(primary, agent=agent) if kind == "object store"
            else FileTier(primary, tmp_path, agent=agent))
    agent.inject("transfer", Raise())  # a failed post keeps NIXL's exception for a while
    tier.submit_store(store(1, 0))
    tier.submit_store(store(2, 1))
    agent.inject("check_xfer_state", Raise())  # and so does a failed state check
    agent.inject("release_xfer_handle", Raise())  # and a release that raised once
    tier.drain_jobs(timeout=5)
    assert sorted(r.success for r in tier.get_finished_jobs()) == [False, False]
    if kind == "object store":  # (the fake agent has no FILE backend: posts fail earlier)
        assert agent.pending_faults() == [], "every fault fired"
    tier.shutdown()
    gone = weakref.ref(agent)
    gc.disable()
    try:
        del tier, agent
        assert gone() is None, "the agent outlived its tier: something holds it in a cycle"
    finally:
        gc.enable()


# -- interrupts: a Ctrl-C in the middle of a NIXL call loses nothing -----------------------------

class InterruptedAgent(FakeNixlAgent):
    """A fake agent whose ``call`` is interrupted once (KeyboardInterrupt), before or after NIXL
    did its work."""

    def __init__(self, call: str, *, after: bool) -> None:
        super().__init__()
        self.interrupt_call, self.after, self.interrupted = call, after, False

    def _maybe_interrupt(self, call: str, work: Any) -> Any:
        if call != self.interrupt_call or self.interrupted:
            return work()
        self.interrupted = True
        if self.after:
            work()
        raise KeyboardInterrupt

    def transfer(self, handle: Any, notif_msg: bytes | str = b"") -> str:
        return str(self._maybe_interrupt("transfer", lambda: super(InterruptedAgent, self)
                                         .transfer(handle, notif_msg)))

    def release_xfer_handle(self, handle: Any) -> None:
        self._maybe_interrupt("release_xfer_handle",
                              lambda: super(InterruptedAgent, self).release_xfer_handle(handle))

    def deregister_memory(self, dereg_list: Any, backends: Any = ()) -> None:
        self._maybe_interrupt("deregister_memory", lambda: super(
            InterruptedAgent, self).deregister_memory(dereg_list, backends))


@pytest.mark.parametrize(("call", "after"), [
    ("transfer", True),               # posted, then interrupted: NIXL runs it
    ("release_xfer_handle", False),   # the copy is done; interrupted before the release
    ("deregister_memory", True),      # released, cleanup half done
])
def test_an_interrupt_during_a_nixl_call_leaves_the_transfer_to_finish_on_a_later_poll(
    call: str, after: bool, primary: torch.Tensor,
) -> None:
    agent = InterruptedAgent(call, after=after)
    tier = ObjectStoreTier(primary, agent=agent)
    with pytest.raises(KeyboardInterrupt):
        tier.submit_store(store(1, 0))
        tier.get_finished_jobs()
    assert agent.interrupted
    assert tier.has_pending_work(), "the job still owes its result"
    tier.drain_jobs(timeout=5)  # the next polls pick the transfer up where its calls got to
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    assert agent.live_xfer_handles() == 0
    assert agent.misuses == [], "nothing released twice, nothing released while running"


def test_an_interrupt_in_the_finish_of_a_failed_post_orphans_nothing(
    primary: torch.Tensor,
) -> None:
    agent = InterruptedAgent("deregister_memory", after=True)
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("transfer", ReturnErr())  # over at once: the finish runs inside submit
    with pytest.raises(KeyboardInterrupt):
        tier.submit_store(store(1, 0))
    tier.drain_jobs(timeout=5)  # a later poll finds it: it was kept in the poll lists
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
    assert agent.misuses == [] and agent.live_xfer_handles() == 0


class ReleaseClock(FakeNixlAgent):
    """Notes when each release call starts."""

    def __init__(self) -> None:
        super().__init__()
        self.release_started: list[float] = []

    def release_xfer_handle(self, handle: Any) -> None:
        self.release_started.append(time.monotonic())
        super().release_xfer_handle(handle)


def test_a_transfer_counts_as_finished_when_nixl_says_so_not_when_its_handle_is_released(
    primary: torch.Tensor,
) -> None:
    agent = ReleaseClock()
    tier = ObjectStoreTier(primary, agent=agent)
    finished: list[float] = []
    tier.on_published.append(lambda transfer: finished.append(transfer.finished_at))
    tier.submit_store(store(1, 0))
    tier.drain_jobs(timeout=5)
    (result,) = tier.get_finished_jobs()
    assert result.success
    (released,) = agent.release_started
    assert finished[0] <= released, "DONE is latched before the release call is made"


class StopIterationAgent(FakeNixlAgent):
    """A check that raises StopIteration once (an exhausted iterator somewhere inside it)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.checks = 0

    def check_xfer_state(self, handle: Any) -> str:
        self.checks += 1
        status = super().check_xfer_state(handle)
        if self.checks == 2:  # the second check of the run: job 1's (NIXL has finished it)
            raise StopIteration
        return status


def test_a_state_check_that_raises_stopiteration_fails_its_transfer_and_no_other(
    primary: torch.Tensor,
) -> None:
    agent = StopIterationAgent(complete_after_polls=1)
    tier = ObjectStoreTier(primary, agent=agent)
    for job_id in range(3):
        tier.submit_store(store(job_id, job_id))
    tier.drain_jobs(timeout=5)
    results = {r.job_id: r.success for r in tier.get_finished_jobs()}
    assert results == {0: True, 1: False, 2: True}, "the raise is that transfer's answer (F4)"
    assert tier.transfer_of(1) is None and agent.live_xfer_handles() == 0


# -- found by review: interrupts and re-entry around a result ------------------------------------

class _CtrlCWhileLogged(logging.Handler):
    """Ctrl-C lands while kvfsm logs a failed job (a handler is code of the application's)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def emit(self, record: logging.LogRecord) -> None:
        if self.armed and record.getMessage().startswith("job ") and "failed" in (
                record.getMessage()):
            self.armed = False
            raise KeyboardInterrupt


def test_an_interrupt_while_a_failure_is_logged_keeps_a_running_transfers_registration(
    primary: torch.Tensor,
) -> None:
    """The tier's books are written before any handler or listener runs: a transfer given up
    while NIXL still runs it stays counted, and shutdown keeps the primary registration its
    handles use."""
    handler = _CtrlCWhileLogged()
    logging.getLogger("kvfsm").addHandler(handler)
    agent = FakeNixlAgent(name="ctrl-c")
    try:
        tier = ObjectStoreTier(primary, agent=agent,
                               policy=RetryPolicy(max_running_seconds=0.01))
        agent.inject("transfer", StayProc(10**6))  # NIXL keeps running it
        tier.submit_store(store(1, 0))
        time.sleep(0.02)
        with pytest.raises(KeyboardInterrupt):
            tier.get_finished_jobs()  # quarantined while it may still run; logged, interrupted
        assert not handler.armed
        assert tier.stats()["quarantined_running"] == 1
        assert tier.stats()["quarantined"] == 1
        tier.shutdown(timeout=1)
        assert agent.live_registrations("DRAM") == 1, "kept: a running transfer refers to it"
        assert agent.misuses == []
    finally:
        logging.getLogger("kvfsm").removeHandler(handler)


class _CtrlCInCleanup(FakeNixlAgent):
    def __init__(self) -> None:
        super().__init__(name="ctrl-c-cleanup")
        self.armed = True

    def release_dlist_handle(self, handle: Any) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt  # Ctrl-C while the cleanup runs
        super().release_dlist_handle(handle)


def test_cancel_and_shutdown_after_an_interrupted_cleanup_finish_the_job(
    primary: torch.Tensor,
) -> None:
    agent = _CtrlCInCleanup()
    tier = ObjectStoreTier(primary, agent=agent)
    tier.submit_store(store(1, 0))
    with pytest.raises(KeyboardInterrupt):
        tier.get_finished_jobs()
    assert tier.state_of(1) is TransferState.XFER_RELEASED, "released, not yet cleaned"
    tier.cancel(1)  # over already: keeps its outcome
    tier.shutdown(timeout=5)
    assert tier.closed
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    assert agent.misuses == []
    agent.close()


@pytest.mark.parametrize("policy", [None, RetryPolicy(max_running_seconds=60)],
                         ids=["fast-path", "general-path"])
def test_a_listener_that_polls_again_costs_the_outer_poll_nothing(
    primary: torch.Tensor, policy: RetryPolicy | None
) -> None:
    agent = FakeNixlAgent(name="reentrant")
    tier = ObjectStoreTier(primary, agent=agent, policy=policy)
    got: list[int] = []
    tier.on_published.append(lambda _: got.extend(r.job_id for r in tier.get_finished_jobs()))
    tier.submit_store(store(1, 0))
    tier.submit_store(store(2, 1))
    agent.inject("check_xfer_state", StayProc(1), times=2)  # both answer on the same poll
    got += [r.job_id for r in tier.get_finished_jobs()]
    got += [r.job_id for r in tier.get_finished_jobs()]
    assert sorted(got) == [1, 2], "each result once, none lost"
    tier.shutdown(timeout=5)
    agent.close()
