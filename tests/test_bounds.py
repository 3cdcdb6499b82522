"""What a tier keeps stays bounded, and its calls keep their bounds when the store stops answering.

Each test here was written against a bug found by attacking kvfsm: a lookup cache holding one
entry per key ever stored, a leak record copied whole by every ``stats()``, ids such as ``True``
taken as job 1, and ``shutdown(timeout=2)`` waiting 30 s (or, with many keys, without end) for a
lookup probe against an object store that had stopped answering.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import random
import socket
import threading
import time
import weakref
from typing import Any

import pytest
import torch

from kvfsm import TransferJob
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, FakeNixlError, Raise, StayProc
from kvfsm.tiering import CPUPrimaryTier, TieringManager
from kvfsm.tiers import (
    DrainTimeout,
    InvalidJobError,
    Lookup,
    ObjectStoreTier,
    TierClosedError,
    UnknownJobError,
)

from .conftest import NUM_BLOCKS


def store(job_id: int, key: str, block: int = 0) -> TransferJob:
    return TransferJob(job_id, [key], [block])


def run_to_idle(tier: ObjectStoreTier) -> list[bool]:
    outcomes = []
    for _ in range(50):
        outcomes += [r.success for r in tier.get_finished_jobs()]
        if not tier.has_pending_work():
            return outcomes
    raise AssertionError(f"still pending: {tier.unpublished()}")


# -- the lookup cache ----------------------------------------------------------------------------

class SmallCacheTier(ObjectStoreTier):
    known_names = 8


def test_the_lookup_cache_keeps_the_most_recent_names_and_asks_again_for_the_others(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    tier = SmallCacheTier(primary, agent=agent)
    for job in range(100):
        tier.submit_store(store(job, f"key-{job}"))
        assert run_to_idle(tier) == [True]
    assert tier.stats()["lookup_cache"] == 8, "one entry per key ever stored, before the bound"

    assert tier.lookup("key-99") is Lookup.HIT, "a recent store is known at once"
    assert tier.lookup("key-0") is Lookup.RETRY, "a forgotten one is probed, never guessed"
    for _ in range(1000):
        if tier.lookup("key-0") is not Lookup.RETRY:
            break
        threading.Event().wait(0.001)
    assert tier.lookup("key-0") is Lookup.HIT, "and the probe finds it in the store"
    assert tier.stats()["lookup_cache"] == 8
    tier.shutdown(timeout=5)


def test_a_failed_load_is_remembered_as_a_miss_until_newer_names_push_it_out(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    tier = SmallCacheTier(primary, agent=agent)
    tier.submit_store(store(1, "kept"))
    assert run_to_idle(tier) == [True]
    agent.inject("check_xfer_state", Raise())
    tier.submit_load(TransferJob(2, ["kept"], [1], is_promotion=True))
    assert run_to_idle(tier) == [False]
    assert tier.lookup("kept") is Lookup.MISS, "F11 holds within the bound"
    tier.shutdown(timeout=5)


# -- the leak record and stats -------------------------------------------------------------------

class SmallRecordTier(ObjectStoreTier):
    leak_record = 4


def test_every_leak_is_counted_and_the_last_few_are_listed(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    tier = SmallRecordTier(primary, agent=agent)
    for job in range(10):
        agent.inject("deregister_memory", Raise())
        tier.submit_store(store(job, f"key-{job}"))
        assert run_to_idle(tier) == [True], "a leak never costs the result"
    stats = tier.stats()
    assert stats["leaks"] == 10
    assert [job for job, leak in stats["leaked"]] == [6, 7, 8, 9]
    assert {leak.call for _, leak in stats["leaked"]} == {"deregister_memory"}
    tier.shutdown(timeout=5)


def test_the_counts_stats_keeps_as_transfers_move_match_a_recount_at_every_step(
    primary: torch.Tensor,
) -> None:
    """stats() no longer walks the transfers: its per-state counts and retries are kept as
    transfers move. Under random faults, cancels and releases that keep raising, they must
    equal what walking the transfers gives after every call."""
    rng = random.Random(13)
    agent = FakeNixlAgent(name="recount")
    tier = ObjectStoreTier(primary, agent=agent)
    free = list(range(NUM_BLOCKS))
    in_use: dict[int, int] = {}
    published_retries: list[int] = []
    tier.on_published.append(lambda transfer: published_retries.append(transfer.retries))
    for job in range(400):
        if free and rng.random() < 0.6:
            fault = rng.choice(["none", "none", "check_xfer_state", "release_xfer_handle",
                                "transfer", "deregister_memory"])
            if fault != "none" and fault not in {call for call, _, _ in agent.pending_faults()}:
                agent.inject(fault, Raise(), times=rng.choice([1, 2, 3]))
            block = free.pop()
            in_use[job] = block
            tier.submit_store(store(job, f"key-{job}", block))
        if in_use and rng.random() < 0.1:
            victim = rng.choice(sorted(in_use))
            if tier.state_of(victim) is not None:
                tier.cancel(victim)
        for result in tier.get_finished_jobs():
            free.append(in_use.pop(result.job_id))
        stats = tier.stats()
        recount = collections.Counter(t.state.name for t in tier.unpublished())
        assert stats["in_flight"] == dict(recount)
        assert stats["retries"] == sum(published_retries) + sum(
            t.retries for t in tier.unpublished())
    agent.clear_faults()
    tier.drain_jobs(timeout=5)
    tier.get_finished_jobs()
    stats = tier.stats()
    assert stats["in_flight"] == {}
    assert stats["retries"] == sum(published_retries) > 0, "the faults made releases retry"
    tier.shutdown(timeout=5)
    agent.close()


# -- job ids -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [True, False, 1.0, 2.0, "1", [1], None, (1,)])
def test_an_id_that_is_not_an_int_is_refused_by_name_and_changes_nothing(
    tier: ObjectStoreTier, bad: object
) -> None:
    for job in (0, 1, 2):
        tier.submit_store(store(job, f"key-{job}", job))
    before = {job: tier.state_of(job) for job in (0, 1, 2)}
    for call in (tier.cancel, tier.state_of, tier.transfer_of):
        with pytest.raises(InvalidJobError, match="a job id is an int"):
            call(bad)  # type: ignore[arg-type]
    assert {job: tier.state_of(job) for job in (0, 1, 2)} == before
    assert run_to_idle(tier) == [True, True, True], "no job was cancelled by a look-alike id"


def test_cancelling_an_unknown_int_id_names_it(tier: ObjectStoreTier) -> None:
    with pytest.raises(UnknownJobError, match="job 7 is not in flight"):
        tier.cancel(7)


# -- a lookup probe that does not come back ------------------------------------------------------

class StalledStore(FakeNixlAgent):
    """A probe agent whose store has stopped answering: query_memory waits until let go (or
    ten seconds, so a tier that waits for it cannot hang the suite)."""

    def __init__(self) -> None:
        super().__init__(name="stalled-probe")
        self.go = threading.Event()
        self.asked = threading.Event()
        self.finished = threading.Event()

    def query_memory(self, *args: object, **kwargs: object) -> list[dict[str, str] | None]:
        self.asked.set()
        self.go.wait(10)
        answers = super().query_memory(*args, **kwargs)  # type: ignore[arg-type]
        self.finished.set()
        return answers


def test_shutdown_returns_by_its_deadline_while_a_lookup_probe_waits_on_the_store(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    stalled = StalledStore()
    tier = ObjectStoreTier(primary, agent=agent, probe_agent=stalled)
    for index in range(40):
        assert tier.lookup(f"key-{index}") is Lookup.RETRY
    assert stalled.asked.wait(5)
    tier.submit_store(store(1, "written-meanwhile"))
    assert run_to_idle(tier) == [True], "submits and polls go on while a probe waits"

    tier.shutdown(timeout=0.2)
    assert tier.closed
    assert not stalled.finished.is_set(), "shutdown waited for the probe past its deadline"
    assert agent.live_registrations("DRAM") == 0, "the tier's own agent is released"

    stalled.go.set()
    assert stalled.finished.wait(5)
    probe_threads = [t for t in threading.enumerate() if t.name == "kvfsm-object-probe"]
    for thread in probe_threads:
        thread.join(5)
    assert stalled.call_count("query_memory") == 1, "the names not yet asked were dropped"
    stalled.close()


def test_a_tier_dropped_while_a_probe_waits_never_blocks_the_dropping_thread(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    stalled = StalledStore()
    tier = ObjectStoreTier(primary, agent=agent, probe_agent=stalled)
    for index in range(40):
        tier.lookup(f"key-{index}")
    assert stalled.asked.wait(5)
    tier.shutdown(timeout=0)  # (so the fixture's agent ends clean); the prober still waits
    gone = weakref.ref(tier)
    del tier
    gc.collect()
    assert gone() is None
    assert not stalled.finished.is_set(), "dropping the tier waited for the probe"
    stalled.go.set()
    assert stalled.finished.wait(5)
    for thread in [t for t in threading.enumerate() if t.name == "kvfsm-object-probe"]:
        thread.join(5)
        assert not thread.is_alive()
    assert stalled.call_count("query_memory") == 1
    stalled.close()


def test_the_probe_thread_runs_only_while_names_wait_and_is_not_a_daemon(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """An interpreter exiting under a daemon thread that is inside NIXL's query_memory aborts
    (measured: 'terminate called without an active exception'); a non-daemon thread is waited
    for instead, so it must not outlive the names it has to ask about."""
    stalled = StalledStore()
    tier = ObjectStoreTier(primary, agent=agent, probe_agent=stalled)
    assert not [t for t in threading.enumerate() if t.name == "kvfsm-object-probe"]
    tier.lookup("key-1")
    assert stalled.asked.wait(5)
    (thread,) = [t for t in threading.enumerate() if t.name == "kvfsm-object-probe"]
    assert not thread.daemon
    stalled.go.set()
    thread.join(5)
    assert not thread.is_alive(), "idle, the prober keeps no thread"
    assert tier.lookup("key-1") is Lookup.MISS
    tier.shutdown(timeout=5)
    stalled.close()


def test_drain_keeps_its_deadline_while_another_thread_holds_the_tier(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """A poll on another thread that takes long (here a listener that blocks while a result
    is published) must not hold drain_jobs past its deadline."""
    tier = ObjectStoreTier(primary, agent=agent)
    inside, let_go = threading.Event(), threading.Event()

    def slow_listener(transfer: object) -> None:
        inside.set()
        let_go.wait(10)

    tier.on_published.append(slow_listener)
    tier.submit_store(store(1, "first"))
    tier.submit_store(store(2, "second", 1))
    poller = threading.Thread(target=tier.get_finished_jobs)
    poller.start()
    assert inside.wait(5)
    with pytest.raises(DrainTimeout, match="drain_jobs"):
        tier.drain_jobs(timeout=0.1)
    assert not let_go.is_set() and poller.is_alive(), "drain waited for the other thread"
    let_go.set()
    poller.join(5)
    tier.drain_jobs(timeout=5)
    tier.shutdown(timeout=5)


def test_stats_answers_while_another_thread_holds_the_tier(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """A monitoring thread's stats() is never held up behind a poll."""
    tier = ObjectStoreTier(primary, agent=agent)
    inside, let_go = threading.Event(), threading.Event()
    tier.on_published.append(lambda transfer: (inside.set(), let_go.wait(10)))
    tier.submit_store(store(1, "first"))
    poller = threading.Thread(target=tier.get_finished_jobs)
    poller.start()
    assert inside.wait(5)
    answered: list[dict[str, object]] = []
    reader = threading.Thread(target=lambda: answered.append(tier.stats()))
    reader.start()
    reader.join(5)
    assert answered and not let_go.is_set(), "stats() waited for the poll to end"
    let_go.set()
    poller.join(5)
    assert tier.stats()["published"] == 1
    tier.shutdown(timeout=5)


def test_a_tier_that_is_shut_down_answers_no_lookup(tier: ObjectStoreTier) -> None:
    tier.submit_store(store(1, "stored"))
    assert run_to_idle(tier) == [True]
    assert tier.lookup("stored") is Lookup.HIT
    tier.shutdown(timeout=5)
    with pytest.raises(TierClosedError, match=r"shut down; lookup\('stored'\) refused"):
        tier.lookup("stored")


def test_drain_returns_when_another_threads_poll_published_the_last_job(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    tier = ObjectStoreTier(primary, agent=agent)
    inside, let_go = threading.Event(), threading.Event()
    tier.on_published.append(lambda transfer: (inside.set(), let_go.wait(10)))
    tier.submit_store(store(1, "only"))
    poller = threading.Thread(target=tier.get_finished_jobs)
    poller.start()
    assert inside.wait(5)  # job 1 is published; the poll still holds the tier
    tier.drain_jobs(timeout=0.1)  # nothing is unpublished: no DrainTimeout
    let_go.set()
    poller.join(5)
    tier.shutdown(timeout=5)


def test_the_names_waiting_for_a_probe_stay_bounded_while_the_store_is_slow(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    from kvfsm.tiers.object_store import MAX_WANTED  # noqa: PLC0415

    stalled = StalledStore()
    tier = ObjectStoreTier(primary, agent=agent, probe_agent=stalled)
    tier.lookup("first")
    assert stalled.asked.wait(5)  # the probe thread is stuck in its first query
    for index in range(3 * MAX_WANTED):
        assert tier.lookup(f"name-{index}") is Lookup.RETRY
    assert tier.stats()["probes_waiting"] <= MAX_WANTED
    tier.shutdown(timeout=0)
    stalled.go.set()
    assert stalled.finished.wait(5)
    stalled.close()


class DeadStore(FakeNixlAgent):
    """A probe agent whose store does not answer: every query raises at once."""

    def query_memory(self, *args: object, **kwargs: object) -> list[dict[str, str] | None]:
        raise FakeNixlError("NIXL_ERR_BACKEND")


class TornDown(FakeNixlAgent):
    """A probe agent whose store gives up each query after ``hold`` seconds (as NIXL does
    against a frozen store, its HTTP request still running), noting on which thread and when
    the last reference to it went (its teardown, which for a real agent waits for that request
    holding the interpreter's lock)."""

    def __init__(self, torn: list[tuple[str, float]], hold: float = 0.0) -> None:
        super().__init__(name="torn-down-probe")
        self.torn, self.hold = torn, hold
        self.asked = threading.Event()

    def query_memory(self, *args: object, **kwargs: object) -> list[dict[str, str] | None]:
        self.asked.set()
        time.sleep(self.hold)
        raise FakeNixlError("NIXL_ERR_BACKEND")

    def __del__(self) -> None:
        self.torn.append((threading.current_thread().name, time.monotonic()))


@pytest.mark.parametrize("asking", [False, True])
def test_a_probe_agent_whose_query_was_given_up_is_let_go_of_only_once_it_settled(
    primary: torch.Tensor, agent: FakeNixlAgent, asking: bool,
) -> None:
    """Tearing down a real probe agent whose query NIXL gave up waits, holding the
    interpreter's lock, for the HTTP request still running: no thread ran for 28.6 s after a
    shutdown that had returned. Such an agent is let go of only its settle time after the
    give-up (SETTLE_SECONDS, 45 s, for an agent the tier made: tests/test_real_nixl.py), by a
    thread that sleeps meanwhile. Shutdown waits for the query in flight when it finds one
    (``asking``), not for the settle."""
    torn: list[tuple[str, float]] = []
    probe = TornDown(torn, hold=0.3 if asking else 0.0)
    tier = ObjectStoreTier(primary, agent=agent, probe_agent=probe)
    tier._prober.settle_seconds = 2.0
    asked = probe.asked
    del probe
    tier.lookup("k")
    assert asked.wait(5)
    if not asking:
        for _ in range(1000):  # the query was given up, and the probe thread ended
            if not tier._prober.busy and tier._prober.errors:
                break
            time.sleep(0.005)
    started = time.monotonic()
    tier.shutdown(timeout=10)
    assert time.monotonic() - started < 1.5, "shutdown waited for the settle"
    assert not tier._prober.busy
    assert torn == [], "not let go of before it settled"
    gave_up = tier._prober._gave_up_at
    for _ in range(800):
        if torn:
            break
        time.sleep(0.01)
    ((thread, when),) = torn
    assert thread == "kvfsm-probe-agent-settle"
    assert gave_up is not None and when >= gave_up + 2.0


def test_the_names_whose_probe_failed_stay_bounded_while_the_store_is_down(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """Each name whose probe failed is kept, to answer MISS until a probe about it is answered:
    against a store that stays down, as many as MAX_WANTED, the oldest forgotten first."""
    from kvfsm.tiers.object_store import MAX_WANTED  # noqa: PLC0415

    tier = ObjectStoreTier(primary, agent=agent, probe_agent=DeadStore())
    for start in range(0, 2 * MAX_WANTED, MAX_WANTED // 4):
        for index in range(start, start + MAX_WANTED // 4):
            tier.lookup(f"name-{index}")
        for _ in range(10_000):  # until the probe thread asked about them all
            if tier.stats()["probes_waiting"] == 0 and not tier._prober.busy:
                break
            time.sleep(0.001)
    assert tier.stats()["probes_unanswered"] == MAX_WANTED
    assert tier.lookup(f"name-{2 * MAX_WANTED - 1}") is Lookup.MISS, "the latest: MISS"
    tier.shutdown(timeout=5)


# -- timeouts and intervals: a bound that cannot be kept is refused by name ---------------------

@pytest.mark.parametrize("call", ["drain_jobs", "shutdown"])
@pytest.mark.parametrize("timeout", [float("nan"), "1", True])
def test_a_timeout_that_is_not_a_number_is_refused_and_changes_nothing(
    tier: ObjectStoreTier, agent: FakeNixlAgent, call: str, timeout: object,
) -> None:
    """NaN once made both calls loop for ever (no time is ever past a NaN deadline)."""
    agent.inject("check_xfer_state", StayProc(3))
    tier.submit_store(store(1, "running"))
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds or None, got"):
        getattr(tier, call)(timeout)
    assert not tier.closed
    tier.submit_store(store(2, "still-taken"))  # a refused shutdown closed nothing
    assert sorted(run_to_idle(tier)) == [True, True], "the running job was not cancelled"


def test_an_infinite_timeout_is_no_bound(primary: torch.Tensor, agent: FakeNixlAgent) -> None:
    """It raised OverflowError (from the lock's wait) once the tier had started closing."""
    tier = ObjectStoreTier(primary, agent=agent)
    tier.submit_store(store(1, "k"))
    tier.drain_jobs(float("inf"))
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    tier.shutdown(1e300)
    assert tier.closed


def test_drain_and_shutdown_never_sleep_past_their_deadline(
    primary: torch.Tensor, agent: FakeNixlAgent,
) -> None:
    """A drain sleeps poll_interval between polls: a long one once ran a whole interval past
    the deadline (3 s for a deadline of 0.2 s)."""
    tier = ObjectStoreTier(primary, agent=agent, poll_interval=3.0)
    agent.inject("check_xfer_state", StayProc(20))
    tier.submit_store(store(1, "stuck"))
    for call in (tier.drain_jobs, tier.shutdown):
        started = time.monotonic()
        with pytest.raises(DrainTimeout):
            call(0.2)
        assert time.monotonic() - started < 2.0, f"{call.__name__} slept past its deadline"
    tier.poll_interval = 0.0005
    tier.shutdown(timeout=None)  # NIXL's transfer ends after its 20 answers PROC
    assert tier.closed


@pytest.mark.parametrize("interval", [-1, float("nan"), float("inf"), "0.1", None])
def test_a_poll_interval_that_is_not_seconds_is_refused_before_anything_is_registered(
    primary: torch.Tensor, agent: FakeNixlAgent, interval: object,
) -> None:
    with pytest.raises(ValueError, match=r"poll_interval must be a finite number of seconds"):
        ObjectStoreTier(primary, agent=agent, poll_interval=interval)  # type: ignore[arg-type]
    assert agent.live_registrations() == 0


def test_the_managers_shutdown_bounds_its_tiers_shutdowns(primary: torch.Tensor,
                                                          agent: FakeNixlAgent) -> None:
    """The manager called each tier's shutdown with the tier's own default (30 s), whatever
    its own timeout: a lookup probe waiting on a store that stopped answering held it."""
    cpu = CPUPrimaryTier(NUM_BLOCKS, 16)
    stalled = StalledStore()
    tier = ObjectStoreTier(cpu.cache, agent=agent, probe_agent=stalled)
    manager = TieringManager(cpu, [tier])
    manager.load(["asked-of-the-store"])  # a lookup: a probe is queued, and waits
    assert stalled.asked.wait(5)
    started = time.monotonic()
    manager.shutdown(timeout=0.3)
    assert time.monotonic() - started < 5, "the tier's shutdown waited past the manager's"
    assert manager.closed and tier.closed
    stalled.go.set()
    assert stalled.finished.wait(5)
    stalled.close()


@pytest.mark.parametrize("probe_batch", [0, 1.5])
def test_a_refused_probe_batch_registers_nothing(primary: torch.Tensor, agent: FakeNixlAgent,
                                                 probe_batch: object) -> None:
    """It was checked after the primary cache was registered, which then stayed so."""
    with pytest.raises(ValueError, match=r"probe_batch must be an int of at least 1"):
        ObjectStoreTier(primary, agent=agent, probe_batch=probe_batch)  # type: ignore[arg-type]
    assert (agent.live_registrations(), agent.live_dlist_handles()) == (0, 0)


def test_a_probe_thread_that_cannot_start_leaves_the_lookup_answering_and_shutdown_closing(
    primary: torch.Tensor, agent: FakeNixlAgent, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of threads once: the lookup raised RuntimeError, every later lookup of that name
    answered RETRY for good, and shutdown raised joining a thread never started."""
    prober = FakeNixlAgent("probe", objects=agent.objects)
    agent.objects["256-bytes/k"] = bytes(256)  # block k, stored by another process
    tier = ObjectStoreTier(primary, agent=agent, probe_agent=prober)
    start = threading.Thread.start

    def out_of_threads(thread: threading.Thread) -> None:
        if thread.name == "kvfsm-object-probe":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", out_of_threads)
    assert tier.lookup("k") is Lookup.RETRY
    monkeypatch.setattr(threading.Thread, "start", start)  # threads are back
    answers = [tier.lookup("k")]
    deadline = time.monotonic() + 5
    while answers[-1] is Lookup.RETRY and time.monotonic() < deadline:
        time.sleep(0.01)
        answers.append(tier.lookup("k"))
    assert answers[-1] is Lookup.HIT, "a later lookup probes again"
    tier.shutdown(timeout=1.0)
    assert tier.closed and agent.live_registrations() == 0
    prober.close()


def test_deletes_without_a_thread_to_send_them_are_counted_not_kept(
    primary: torch.Tensor, agent: FakeNixlAgent, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of threads when an eviction's delete is due: the names stayed queued, nothing sent
    them, and wait() said none was left; now they are counted as objects not deleted."""
    removed: list[str] = []
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=int(primary[0].nbytes),
                           remove=lambda names: removed.extend(names) or 0)
    start = threading.Thread.start

    def out_of_threads(thread: threading.Thread) -> None:
        if thread.name == "kvfsm-object-remove":
            raise RuntimeError("can't start new thread")
        start(thread)

    tier.submit_store(store(1, "first"))
    assert run_to_idle(tier) == [True]
    monkeypatch.setattr(threading.Thread, "start", out_of_threads)
    tier.submit_store(store(2, "second", 1))  # evicts "first": its delete is due
    monkeypatch.setattr(threading.Thread, "start", start)
    assert run_to_idle(tier) == [True]
    assert tier.wait_for_removals(5)
    assert removed == []
    assert tier.stats()["holdings"]["remove_errors"] == 1
    tier.shutdown(timeout=1)


# -- found by review: shutdown's deadline, and bounds given as numbers too large or not numbers --

def shutting_down_behind_a_probe(primary: torch.Tensor, agent: FakeNixlAgent, timeout: float,
                                 ) -> tuple[StalledStore, ObjectStoreTier, threading.Thread]:
    """A tier whose lookup probe waits on the store, and a shutdown(timeout) on a thread of its
    own, returned once that shutdown closed the tier (it then waits for the probe)."""
    stalled = StalledStore()
    tier = ObjectStoreTier(primary, agent=agent, probe_agent=stalled)
    tier.lookup("key-0")
    assert stalled.asked.wait(5)
    shutter = threading.Thread(target=tier.shutdown, args=(timeout,))
    shutter.start()
    deadline = time.monotonic() + 5
    while not tier.closed and time.monotonic() < deadline:
        time.sleep(0.001)
    return stalled, tier, shutter


def test_shutdown_lets_go_of_the_tier_while_it_waits_for_a_probe(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """Shutdown waits for a probe in flight up to its deadline once the tier is closed, not
    holding the tier: a submit on another thread is refused at once meanwhile, and a poll
    answers (they both waited for the probe with it, 1.8 s for a 2 s probe)."""
    stalled, tier, shutter = shutting_down_behind_a_probe(primary, agent, 30)
    assert tier.closed and shutter.is_alive(), "shutdown waits for the probe, the tier closed"
    with pytest.raises(TierClosedError):
        tier.submit_store(store(1, "after"))
    assert tier.get_finished_jobs() == []
    assert shutter.is_alive(), "the calls returned while the probe (and shutdown) still waits"
    stalled.go.set()
    shutter.join(5)
    assert not shutter.is_alive()
    stalled.close()


class SlowFailingRelease(FakeNixlAgent):
    """A release that stalls 0.4 s, then raises: each poll that retries it holds the tier."""

    def release_xfer_handle(self, handle: object) -> None:
        time.sleep(0.4)
        raise FakeNixlError("NIXL_ERR_BACKEND")


def test_shutdown_counts_waiting_for_another_threads_polls_against_its_deadline(
    primary: torch.Tensor,
) -> None:
    """Another thread polls back to back, each poll 0.4 s: shutdown(0.3) returns by its
    deadline plus one poll (it took 2.9-22 s: its waits for the lock restarted the clock)."""
    agent = SlowFailingRelease("slow-release", complete_after_polls=0)
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(max_seconds=None))
    tier.submit_store(store(1, "stuck-release"))
    stop = threading.Event()
    poller = threading.Thread(target=lambda: [tier.get_finished_jobs()
                                              for _ in iter(stop.is_set, True)])
    poller.start()
    try:
        time.sleep(0.1)
        began = time.monotonic()
        with contextlib.suppress(DrainTimeout):
            tier.shutdown(timeout=0.3)
        took = time.monotonic() - began
        assert took < 0.3 + 0.4 + 0.5, f"shutdown(0.3) took {took:.2f} s"
    finally:
        stop.set()
        poller.join(10)
    tier.shutdown(timeout=10)  # alone now: the last try quarantines the stuck release
    assert tier.closed and tier.stats()["quarantined"] == 1
    agent.close()


@pytest.mark.parametrize("timeout", [1e10, 10**400])
def test_a_timeout_longer_than_any_wait_is_no_bound(
    primary: torch.Tensor, agent: FakeNixlAgent, timeout: float
) -> None:
    """Longer than threading.TIMEOUT_MAX (some 292 years): the joins raised OverflowError
    halfway through a shutdown (jobs cancelled, the tier not closed), and a drain did too."""
    stalled = StalledStore()
    tier = ObjectStoreTier(primary, agent=agent, probe_agent=stalled,
                           policy=RetryPolicy(progress_interval=0.01))
    tier.submit_store(store(1, "k"))
    tier.drain_jobs(timeout)
    tier.lookup("probed")
    assert stalled.asked.wait(5)
    stalled.go.set()
    tier.shutdown(timeout)
    assert tier.closed and [r.success for r in tier.get_finished_jobs()] == [True]
    stalled.close()


@pytest.mark.parametrize("timeout", [float("nan"), "1", True])
def test_wait_for_removals_refuses_a_timeout_that_is_not_seconds(
    primary: torch.Tensor, agent: FakeNixlAgent, timeout: object
) -> None:
    """NaN answered False at once, True waited a second, "1" raised TypeError."""
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=4 * int(primary[0].nbytes),
                           remove=agent.remove_objects)
    with pytest.raises(ValueError, match="timeout must be a number of seconds or None"):
        tier.wait_for_removals(timeout)  # type: ignore[arg-type]
    assert tier.wait_for_removals(1.0)
    tier.shutdown(timeout=5)


class FailingRelease(FakeNixlAgent):
    """Every release raises; when each was asked for is kept."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.releases: list[float] = []

    def release_xfer_handle(self, handle: object) -> None:
        self.releases.append(time.monotonic())
        raise FakeNixlError("NIXL_ERR_BACKEND")


def test_a_release_that_keeps_failing_quarantines_at_max_seconds_not_a_backoff_later(
    primary: torch.Tensor,
) -> None:
    """max_seconds=0.2 with an hour's backoff: the next try waited the whole backoff, so the
    quarantine (and a drain waiting for it) came an hour later; the try now comes at the
    bound, and the drain returns (it raised DrainTimeout at its 10 s)."""
    agent = FailingRelease("failing-release", complete_after_polls=0)
    tier = ObjectStoreTier(primary, agent=agent,
                           policy=RetryPolicy(max_seconds=0.2, backoff=3600.0,
                                              max_backoff=3600.0))
    tier.submit_store(store(1, "k"))
    tier.drain_jobs(timeout=10)
    (result,) = tier.get_finished_jobs()
    assert not result.success and tier.stats()["quarantined"] == 1
    assert len(agent.releases) == 2, "the first try, and the last at the bound"
    assert agent.releases[1] - agent.releases[0] > 0.1, "not at once: at the bound (0.2 s)"
    tier.shutdown(timeout=1)


@pytest.mark.parametrize("peer_timeout", [True, "30", float("nan"), 0, -1])
def test_a_peer_timeout_that_is_not_seconds_is_refused_by_name(
    primary: torch.Tensor, peer_timeout: object
) -> None:
    """True was taken as 1 s, and "30" raised a bare TypeError."""
    from kvfsm.peer import PeerReceiver  # noqa: PLC0415

    agent = FakeNixlAgent("peer-timeout")
    with pytest.raises(ValueError, match="peer_timeout must be > 0 seconds or None"):
        PeerReceiver(primary, agent=agent, peer_timeout=peer_timeout)  # type: ignore[arg-type]
    agent.close()


class ProbedOnTheTiersAgent(FakeNixlAgent):
    """The tier's own agent, which its lookups also probe with: notes a query made once the
    tier is closed, and releases the cache's registration slowly (a probe waits meanwhile)."""

    def __init__(self) -> None:
        super().__init__(name="probed-on-the-tiers-agent")
        self.tier: ObjectStoreTier | None = None
        self.after_close = 0

    def query_memory(self, *args: object, **kwargs: object) -> list[dict[str, str] | None]:
        if self.tier is not None and self.tier.closed:
            self.after_close += 1
        time.sleep(0.005)
        return super().query_memory(*args, **kwargs)  # type: ignore[arg-type]

    def deregister_memory(self, *args: object, **kwargs: object) -> None:
        time.sleep(0.2)
        super().deregister_memory(*args, **kwargs)  # type: ignore[arg-type]


def test_no_probe_asks_the_tiers_agent_once_shutdown_closed_the_tier(
    primary: torch.Tensor,
) -> None:
    """A probe that shares the tier's agent waited for the tier's lock while shutdown closed
    the tier, then asked the agent anyway, after the cache's registration was released and
    possibly after shutdown had returned (the caller may destroy the agent then)."""
    agent = ProbedOnTheTiersAgent()
    tier = ObjectStoreTier(primary, agent=agent, probe_batch=1)
    agent.tier = tier
    for index in range(300):
        tier.lookup(f"key-{index}")
    time.sleep(0.02)
    tier.shutdown(timeout=2)
    for thread in [t for t in threading.enumerate() if t.name == "kvfsm-object-probe"]:
        thread.join(5)
    assert agent.after_close == 0, f"{agent.after_close} probe(s) once the tier was closed"
    agent.close()


def test_a_shutdown_cut_short_while_it_waits_for_the_background_is_finished_by_the_next(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """An interrupt while shutdown waited for the probe left the tier closed, and a second
    shutdown returned at once: the deletes of evicted objects were never stopped."""
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=4 * int(primary[0].nbytes),
                           remove=agent.remove_objects)
    stop, calls = tier._prober.stop, []

    def interrupted_once(timeout: float | None = None) -> bool:
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return stop(timeout)

    tier._prober.stop = interrupted_once  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        tier.shutdown(timeout=1)
    assert tier.closed
    tier.shutdown(timeout=1)
    assert len(calls) == 2 and tier._remover is not None and tier._remover._stopping
    tier.shutdown(timeout=1)
    assert len(calls) == 2, "done once it was finished"


def test_a_second_shutdown_waits_for_the_first_ones_wait_on_the_background(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """A shutdown on another thread while the first waits for a probe returned at once,
    before the probe was over; it now waits for it too, until its own deadline."""
    stalled, tier, first = shutting_down_behind_a_probe(primary, agent, 10)
    threading.Timer(0.3, stalled.go.set).start()
    tier.shutdown(timeout=5)
    assert stalled.finished.is_set(), "it returned once the probe was over, not before"
    first.join(5)
    tier.shutdown(timeout=0)  # all done: nothing to wait for, no DrainTimeout
    assert tier.closed
    stalled.close()


@pytest.mark.timeout(30)
def test_the_bucket_check_keeps_its_timeout_against_a_server_that_answers_a_byte_at_a_time(
) -> None:
    """Its timeout bounded each socket operation, not the check: a server answering a byte
    every 50 ms held it for as long as the server went on (a name lookup that hangs, likewise).
    The check now raises BucketUnreachable at its timeout, naming it."""
    from kvfsm.nixl_agents import BucketUnreachable, StoreConfig, check_bucket  # noqa: PLC0415

    listener = socket.create_server(("127.0.0.1", 0))
    port, stop = listener.getsockname()[1], threading.Event()

    def trickle() -> None:
        connection, _ = listener.accept()
        with connection:
            answer = b"HTTP/1.1 200 OK\r\n" + b"X-Slow: y\r\n" * 1000
            for byte in answer:
                if stop.wait(0.05):
                    return
                connection.sendall(bytes([byte]))

    server = threading.Thread(target=trickle)
    server.start()
    config = StoreConfig(bucket="slow", endpoint=f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(BucketUnreachable, match=rf"cannot reach bucket 'slow' at "
                                                    rf"http://127.0.0.1:{port}: no answer "
                                                    r"within 0.5 s"):
            check_bucket(config, timeout=0.5)
    finally:
        stop.set()
        server.join()
        listener.close()
    with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds > 0, "
                                         r"got nan"):
        check_bucket(config, timeout=float("nan"))


class DownThenFrozen(FakeNixlAgent):
    """A probe agent whose store is down (its first query raises, as NIXL's does for a refused
    connection), then frozen (the next waits until let go, as NIXL waits 30 s on a server that
    does not answer), then back."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        super().__init__("down-then-frozen", objects=objects)
        self.inject("query_memory", Raise("NIXL_ERR_BACKEND"))
        self.asked, self.go = threading.Event(), threading.Event()

    def query_memory(self, *args: object, **kwargs: object) -> list[dict[str, str] | None]:
        if self.call_count("query_memory") == 1:  # the second query: frozen until let go
            self.asked.set()
            self.go.wait(10)
        return super().query_memory(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_lookup_against_a_store_that_stopped_answering_answers_miss_until_it_answers(
    primary: torch.Tensor,
) -> None:
    """A probe whose query failed left its names unanswered, so every lookup of them
    answered RETRY for as long as the store was down, and vLLM deferred the request for as
    long. A failed query now answers MISS (the engine goes on without the block), and so do
    the lookups while the store is asked again, however long that takes; once it answers,
    its answer counts."""
    agent = FakeNixlAgent("store")
    writer = ObjectStoreTier(primary, agent=agent)
    writer.submit_store(store(1, "k"))
    assert run_to_idle(writer) == [True]
    probe = DownThenFrozen(agent.objects)

    class Impatient(ObjectStoreTier):
        probed_miss_seconds = 0.0  # (asked again at the next lookup)

    tier = Impatient(primary, agent=FakeNixlAgent("reader"), probe_agent=probe)

    def verdict() -> Lookup:
        answer, deadline = tier.lookup("k"), time.monotonic() + 10
        while answer is Lookup.RETRY and time.monotonic() < deadline:
            time.sleep(0.01)
            answer = tier.lookup("k")
        return answer

    assert verdict() is Lookup.MISS, "the query failed: MISS, not RETRY"
    assert tier.probe_errors == 1
    assert probe.asked.wait(10), "a later lookup asks the store again"
    seen = {tier.lookup("k") for _ in range(20)}  # the store frozen: that query waits
    assert seen == {Lookup.MISS}, "while it is asked again: MISS, not RETRY"
    probe.go.set()
    deadline = time.monotonic() + 10
    while tier.lookup("k") is not Lookup.HIT and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier.lookup("k") is Lookup.HIT, "the store answered: its answer counts"
    for each in (tier, writer):
        each.shutdown(timeout=5)
