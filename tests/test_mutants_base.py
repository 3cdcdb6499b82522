"""The tier base where mutmut found it untested (docs/testing.md, "Mutation testing").

kvfsm/tiers/base.py holds the secondary-tier contract and a tier's lookup cache
(``KnownNames``). The run of every mutant of the module at 43c0bfb found these untested, each
stated whole here:

* the lookup cache's bound (how many verdicts it keeps, and which it forgets: the oldest) and
  the age of a MISS a probe found: MISS until it expires, then forgotten (probed again).
  Earlier verdicts held these "timing dependent"; an age already spent, or an hour, tells
  them apart with no wait;
* what a poll advances: the transfers waiting when it started, one round each, and those its
  state checks or the running bound just ended, each once (not the whole waiting list again);
  the schedule a poll checks by, and a drain's every running transfer;
* ``saturated()``'s default (a store of no bytes), ``touch`` deciding which block is removed,
  a load counting as use when submitted and not again when it finishes, a job's
  ``is_promotion`` given as a NumPy bool, a tier without a capacity (``touch``,
  ``take_events``);
* shutdown: with no deadline; the words of its DrainTimeout and of the error it logs when
  quarantined transfers keep the primary registered; a lookup probe under way waited for
  within the deadline; one last release per transfer at the deadline.

Mutant numbers are mutmut's (``cd build/mutation && ../../.venv/bin/mutmut show NAME``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from kvfsm import JobResult, TransferJob
from kvfsm.contract import DrainTimeout
from kvfsm.driver import TransferDriver
from kvfsm.lifecycle import TRANSFER_MACHINE
from kvfsm.machines.transfer import FailureKind, FailureReason
from kvfsm.policy import InFlightLimit, RetryPolicy
from kvfsm.runner import Outcome
from kvfsm.testing import FakeNixlAgent, FakeNixlError, Raise, StayProc
from kvfsm.tiers import InvalidJobError, ObjectStoreTier, TierClosedError, TierSaturatedError
from kvfsm.tiers.base import KnownNames, Lookup, SecondaryTier

from .test_mutants_tiers import JobNumber
from .test_runner import _Side, _Tier

HIT, MISS = Lookup.HIT, Lookup.MISS


# -- KnownNames: the bound and the age of a MISS ------------------------------------------------

def test_the_lookup_cache_keeps_exactly_its_limit_of_the_most_recent_verdicts() -> None:
    """Recorded or offered, once more than ``limit`` verdicts are known the oldest go, down to
    the limit and not below (``>`` made ``>=`` forgot one more; ``popitem(last=True)`` forgot
    the newest)."""
    known = KnownNames(2)
    known.record(["a", "b"], HIT)
    assert len(known) == 2 and known.get("a") is HIT
    known.record(["a"], MISS)  # "a" is now the most recent
    known.record(["c"], HIT)
    assert len(known) == 2
    assert (known.get("a"), known.get("b"), known.get("c")) == (MISS, None, HIT)
    known.offer("d", HIT)
    assert len(known) == 2
    assert (known.get("a"), known.get("c"), known.get("d")) == (None, HIT, HIT)
    known.offer("c", MISS)  # a probe's answer never replaces a verdict known
    assert known.get("c") is HIT


def test_a_lookup_cache_of_one_keeps_one_verdict() -> None:
    """The smallest limit allowed is 1; 0 and a limit that is no int are refused."""
    known = KnownNames(1)
    known.record(["a"], HIT)
    known.offer("b", MISS)
    assert len(known) == 1 and known.get("b") is MISS and known.get("a") is None
    for limit in (0, 1.0, True):
        with pytest.raises(ValueError, match=f"a limit of at least 1, got {limit!r}"):
            KnownNames(limit)  # type: ignore[arg-type]


def test_a_miss_a_probe_found_is_kept_for_its_age_then_forgotten() -> None:
    """A MISS offered with ``miss_for`` is MISS until it expires, then not known (and gone
    from the cache: the name is probed again). A MISS with no age, and a HIT with one, are
    kept for good. Earlier verdicts held these "timing dependent"; an age of an hour, and one
    already spent, need no wait: mutants that subtracted the age, gave every MISS an age or
    none, or left an expired one in the cache are caught."""
    known = KnownNames(8)
    known.offer("fresh", MISS, miss_for=3600.0)
    known.offer("spent", MISS, miss_for=-1.0)
    known.offer("forever", MISS)
    known.offer("found", HIT, miss_for=-1.0)
    assert len(known) == 4
    assert known.get("fresh") is MISS
    assert known.get("spent") is None
    assert len(known) == 3, "the expired MISS is forgotten"
    assert known.get("spent") is None
    assert (known.get("forever"), known.get("found")) == (MISS, HIT)
    known.record(["spent"], HIT)  # a transfer's verdict after the MISS expired
    assert known.get("spent") is HIT


# -- the tier: room, use, events and shutdown, where no test read them -------------------------

BLOCK = 256  # bytes of one block of the conftest primary


def settle(tier: SecondaryTier) -> list[JobResult]:
    results: list[JobResult] = []
    for _ in range(100):
        results += tier.get_finished_jobs()
        if not tier.has_pending_work():
            break
    return results


def test_saturated_asks_about_the_store_of_no_bytes_by_default(
        primary: torch.Tensor, agent: FakeNixlAgent) -> None:
    """A tier whose bytes in flight are exactly at its bound is not saturated for nothing
    more (the default), and is for one byte more: the default had no test of its own."""
    tier = ObjectStoreTier(primary, agent=agent, in_flight=InFlightLimit(bytes=BLOCK))
    tier.submit_store(TransferJob(1, ["a"], [0]))
    assert tier.saturated(BLOCK) and tier.saturated(1)
    assert not tier.saturated()
    settle(tier)
    assert not tier.saturated(BLOCK)
    tier.shutdown(timeout=5)


def test_a_touched_block_is_removed_after_those_not_touched(
        primary: torch.Tensor, agent: FakeNixlAgent) -> None:
    """``touch`` makes a block the most recently used: the store that needs room then removes
    the oldest block not touched. (The existing story touched a block whose removal a load
    decided the same way either way.)"""
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=3 * BLOCK,
                           remove=agent.remove_objects)
    tier.submit_store(TransferJob(1, ["a", "b", "c"], [0, 1, 2]))
    settle(tier)
    tier.touch(["a"])  # order now b, c, a
    tier.submit_store(TransferJob(2, ["d"], [3]))
    assert [r.success for r in settle(tier)] == [True]
    assert tier.wait_for_removals(5)
    assert sorted(agent.objects) == [tier.object_key(key) for key in "acd"]
    assert (tier.holds("a"), tier.holds("b")) == (True, False)
    tier.shutdown(timeout=5)


def test_touch_never_waits_for_a_poll_under_way_and_still_counts(
        primary: torch.Tensor, agent: FakeNixlAgent) -> None:
    """vLLM touches blocks on its lookup path: with another thread's call holding the tier's
    lock (a poll on the progress thread), ``touch`` returns at once (it used to wait for that
    poll), and the block it touched still counts as used when the next store makes room."""
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=3 * BLOCK,
                           remove=agent.remove_objects)
    tier.submit_store(TransferJob(1, ["a", "b", "c"], [0, 1, 2]))
    settle(tier)
    holding, release = threading.Event(), threading.Event()

    def poll_under_way() -> None:
        with tier._lock:
            holding.set()
            release.wait(10)

    poller = threading.Thread(target=poll_under_way)
    poller.start()
    try:
        assert holding.wait(5)
        toucher = threading.Thread(target=tier.touch, args=(["a"],))
        toucher.start()
        toucher.join(5)
        assert not toucher.is_alive(), "touch waited for the lock"
    finally:
        release.set()
        poller.join(5)
    tier.submit_store(TransferJob(2, ["d"], [3]))  # order was b, c, a: b goes
    assert [r.success for r in settle(tier)] == [True]
    assert tier.wait_for_removals(5)
    assert (tier.holds("a"), tier.holds("b")) == (True, False)
    tier.shutdown(timeout=5)


def test_a_tier_without_a_capacity_ignores_touch_and_has_no_events(tier: ObjectStoreTier) -> None:
    """Without ``capacity_bytes`` nothing is tracked: touching is a no-op (for keys it never
    stored too) and there are no events to take."""
    tier.submit_store(TransferJob(1, ["a"], [0]))
    settle(tier)
    tier.touch(["a", "never-stored"])
    assert tier.take_events() == []
    assert tier.holds("a") and "holdings" not in tier.stats()


def test_a_shutdown_with_no_deadline_waits_as_long_as_it_takes(
        primary: torch.Tensor) -> None:
    """``shutdown(None)``: no deadline (the tests always gave one)."""
    agent = FakeNixlAgent("patient", complete_after_polls=3)
    tier = ObjectStoreTier(primary, agent=agent)
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.shutdown(timeout=None)
    assert tier.closed
    [result] = tier.get_finished_jobs()
    assert not result.success  # cancelled while NIXL ran it
    assert agent.live_xfer_handles() == 0 and agent.live_registrations() == 0


def test_a_shutdown_that_times_out_on_a_running_transfer_says_call_it_again(
        primary: torch.Tensor) -> None:
    """The words of the DrainTimeout a shutdown raises, read whole; the tier stays open."""
    agent = FakeNixlAgent("stuck")
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("check_xfer_state", StayProc(10**6))
    tier.submit_store(TransferJob(1, ["a"], [0]))
    with pytest.raises(DrainTimeout) as timed_out:
        tier.shutdown(timeout=0.01)
    assert str(timed_out.value) == (
        "shutdown (NIXL still runs these, or a store's commit, such as a durable file tier's "
        "flush; call shutdown again to wait longer): 1 transfer(s) "
        "not published\n  job 1: CANCELLING, retries=0, last error: cancelled by shutdown()")
    assert [t.job_id for t in timed_out.value.stuck] == [1] and not tier.closed
    assert agent.running_transfers() == 1, "never released while NIXL runs it"


def test_a_shutdown_leaving_quarantined_transfers_logs_why_the_cache_stays_registered(
        primary: torch.Tensor, caplog: pytest.LogCaptureFixture) -> None:
    """The words of the error logged when shutdown keeps the primary registration."""
    agent = FakeNixlAgent("held")
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(max_attempts=1))
    agent.inject("release_xfer_handle", Raise(), times=2)
    tier.submit_store(TransferJob(1, ["a"], [0]))
    [result] = settle(tier)
    assert not result.success
    caplog.set_level(logging.ERROR, logger="kvfsm")
    caplog.clear()
    tier.shutdown(timeout=5)
    assert [r.getMessage() for r in caplog.records if r.name == "kvfsm"] == [
        "shutdown: 1 quarantined transfer(s) hold their handles (0 may still run); the "
        "primary cache stays registered"]
    assert agent.live_registrations("DRAM") == 1


def test_each_poll_gives_a_waiting_transfer_one_round_and_a_newly_ended_one_its_own(
        primary: torch.Tensor) -> None:
    """A poll makes the calls due for the transfers that were waiting when it started (one
    round each) and for those its state checks found ended; a release that fails in it is
    not made again in the same poll, even with no backoff. Mutants that advanced the whole
    waiting list (those just filed there included) instead of the transfers named made a
    failing release twice or more a poll."""
    agent = FakeNixlAgent("one-round")
    tier = ObjectStoreTier(primary, agent=agent,
                           policy=RetryPolicy(max_attempts=None, max_seconds=None, backoff=0))
    agent.inject("release_xfer_handle", Raise(), times=10**6)
    releases = []

    def poll() -> None:
        before = agent.call_count("release_xfer_handle")
        assert tier.get_finished_jobs() == []
        releases.append(agent.call_count("release_xfer_handle") - before)

    tier.submit_store(TransferJob(1, ["a"], [0]))
    poll()  # job 1 ends: its release fails
    tier.submit_store(TransferJob(2, ["b"], [1]))
    poll()  # job 1 waits: one try; job 2 ends: one try
    poll()  # both wait: one try each
    assert releases == [1, 2, 2]
    assert tier.transfer_of(1).retries == 3  # type: ignore[union-attr]
    agent.clear_faults()
    assert len(settle(tier)) == 2
    tier.shutdown(timeout=5)


def test_a_load_whose_job_says_is_promotion_with_a_numpy_bool_is_taken(
        tier: ObjectStoreTier) -> None:
    """``is_promotion`` compared by value once it is no bool: a NumPy bool (or 1) is taken as
    the bool it equals, by ``submit_load``; a mutant refused every such job."""
    tier.submit_store(TransferJob(1, ["a"], [0]))
    settle(tier)
    for job_id, flag in ((2, np.bool_(True)), (3, 1)):
        tier.submit_load(TransferJob(job_id, ["a"], [4], is_promotion=flag))  # type: ignore[arg-type]
        [result] = settle(tier)
        assert result.success and result.job_id == job_id
    with pytest.raises(InvalidJobError, match="job 4 has is_promotion=0: a load is a "
                                              "TransferJob with is_promotion=True"):
        tier.submit_load(TransferJob(4, ["a"], [4], is_promotion=0))  # type: ignore[arg-type]


def test_a_poll_asks_about_the_schedules_pick_and_a_drain_about_every_running_transfer(
        primary: torch.Tensor) -> None:
    """``get_finished_jobs`` polls by the schedule (past ``check_all_below`` running, the
    oldest first, a batch of 16, while they are found ended, then the sweep's share) and
    ``drain_jobs`` asks about every running transfer. A mutant made every poll ask about
    every one (``everything=True`` by default)."""
    agent = FakeNixlAgent("scheduled", complete_after_polls=10**6)
    tier = ObjectStoreTier(primary, agent=agent,
                           policy=RetryPolicy(check_all_below=2, max_unpolled=3600.0))
    for job_id in range(40):
        tier.submit_store(TransferJob(job_id, [f"k{job_id}"], [job_id % 8]))
    assert tier.get_finished_jobs() == []
    assert agent.call_count("check_xfer_state") == 16, "the oldest batch, none ended"
    with pytest.raises(DrainTimeout):
        tier.drain_jobs(timeout=0)
    assert agent.call_count("check_xfer_state") == 16 + 40


def test_a_load_counts_as_use_when_submitted_not_again_when_it_finishes(
        primary: torch.Tensor, agent: FakeNixlAgent) -> None:
    """The holdings hear a finished load as a load: it unpins its blocks and changes nothing
    else. A mutant that told them a store (``load=None``) made the block the most recent
    again when the load finished, so a block touched meanwhile was removed before it."""
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=3 * BLOCK,
                           remove=agent.remove_objects)
    tier.submit_store(TransferJob(1, ["a", "b", "c"], [0, 1, 2]))
    settle(tier)
    tier.submit_load(TransferJob(2, ["a"], [5], is_promotion=True))  # order now b, c, a
    tier.touch(["b"])  # order now c, a, b, while the load runs
    assert [r.success for r in settle(tier)] == [True]
    tier.submit_store(TransferJob(3, ["d", "e"], [3, 4]))  # room for two: c and a go
    assert [r.success for r in settle(tier)] == [True]
    assert tier.wait_for_removals(5)
    assert sorted(agent.objects) == [tier.object_key(key) for key in "bde"]
    tier.shutdown(timeout=5)


class SlowStore(FakeNixlAgent):
    """A probe agent whose object-store queries take a while (a store far away)."""

    def __init__(self) -> None:
        super().__init__("slow-probe")
        self.asked = threading.Event()

    def query_memory(self, *args: Any, **kwargs: Any) -> Any:
        self.asked.set()
        time.sleep(0.2)
        return super().query_memory(*args, **kwargs)


def test_a_shutdown_waits_for_a_lookup_probe_under_way_within_its_deadline(
        primary: torch.Tensor, agent: FakeNixlAgent, caplog: pytest.LogCaptureFixture) -> None:
    """Background work is waited for until the shutdown's deadline (``timeout`` from now): a
    probe that answers within it is not left behind. A mutant that set the deadline
    ``timeout`` seconds in the past waited for nothing, and warned."""
    probe = SlowStore()
    tier = ObjectStoreTier(primary, agent=agent, probe_agent=probe)
    assert tier.lookup("far") is Lookup.RETRY
    assert probe.asked.wait(5)
    tier.shutdown(timeout=5)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert tier.closed


class Watched(ObjectStoreTier):
    """An object-store tier that notes how many releases were made when a drain ended."""

    releases_when_drained = -1

    def drain_jobs(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().drain_jobs(*args, **kwargs)
        finally:
            agent: Any = self.agent
            self.releases_when_drained = agent.call_count("release_xfer_handle")


def test_at_the_shutdown_deadline_each_transfer_that_is_over_gets_one_last_release(
        primary: torch.Tensor) -> None:
    """Past the deadline, each transfer still waiting on its release is tried once more, then
    given up: one call each. A mutant that made the last try for every waiting transfer at
    each one's turn tried those due at once (no backoff) again."""
    agent = FakeNixlAgent("deadline", complete_after_polls=0)
    tier = Watched(primary, agent=agent,
                   policy=RetryPolicy(max_attempts=None, max_seconds=None, backoff=0))
    agent.inject("release_xfer_handle", Raise(), times=10**6)
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.submit_store(TransferJob(2, ["b"], [1]))
    tier.shutdown(timeout=0.02)
    assert agent.call_count("release_xfer_handle") - tier.releases_when_drained == 2
    results = {r.job_id: r for r in tier.get_finished_jobs()}
    assert sorted(results) == [1, 2]
    assert all(r.reason is not None and r.reason.error.startswith("shutdown deadline passed")
               for r in results.values())


def test_a_poll_gives_a_transfer_the_running_bound_failed_its_own_round_only(
        primary: torch.Tensor) -> None:
    """The running bound fails a store whose commit never ended (``overdue``); the poll then
    makes that transfer's calls, and the calls of those that were waiting when it started,
    once each. A mutant that advanced the whole waiting list for the overdue transfers made a
    failing release of another transfer twice in the poll."""
    agent = FakeNixlAgent("overdue", complete_after_polls=1)
    tier = _Tier(primary, agent=agent, remote=_Side(BLOCK, committed=False),
                 policy=RetryPolicy(max_running_seconds=0.5, max_attempts=None,
                                    max_seconds=None, backoff=0))
    agent.objects["b"] = bytes(BLOCK)
    agent.inject("release_xfer_handle", Raise(), times=10**6)
    tier.submit_store(TransferJob(1, ["a"], [0]))  # NIXL finishes it; its commit never does
    tier.submit_load(TransferJob(2, ["b"], [1], is_promotion=True))
    assert tier.get_finished_jobs() == []  # job 2 ends: its release fails
    assert agent.call_count("release_xfer_handle") == 1
    time.sleep(0.6)
    assert tier.get_finished_jobs() == []  # job 1 failed by the bound: one release each
    assert agent.call_count("release_xfer_handle") == 3
    agent.clear_faults()
    results = {r.job_id: r for r in settle(tier)}
    assert results[1].reason is not None and results[1].reason.call == "commit"
    assert results[2].success
    tier.shutdown(timeout=5)


class StoreJob(TransferJob):
    """A TransferJob subclass, as an engine may make."""


def test_a_refused_job_is_named_whole(tier: ObjectStoreTier) -> None:
    """The words of each refusal of a malformed job, read whole (tests/test_api.py, left out of
    the mutation run, matched some of them): not a TransferJob, a job id that is no int, a
    job for the other submit, a bad key; a TransferJob subclass and an int-subclass job id are
    taken."""
    cases: list[tuple[Any, str]] = [
        ("job", "expected a TransferJob, got str"),
        (TransferJob(True, ["a"], [0]), "job_id must be an int, got True"),
        (TransferJob(1, ["a"], [0], is_promotion=True),
         "job 1 has is_promotion=True: a load, submit it with submit_load (a store has "
         "is_promotion=False)"),
        (TransferJob(1, ["a", ""], [0, 1]), "job 1: keys[1]: a key must not be empty"),
    ]
    for job, message in cases:
        with pytest.raises(InvalidJobError) as refused:
            tier.submit_store(job)
        assert str(refused.value) == message
    with pytest.raises(InvalidJobError) as refused:
        tier.submit_load(TransferJob(1, ["a"], [0]))
    assert str(refused.value) == ("job 1 has is_promotion=False: a load is a TransferJob "
                                  "with is_promotion=True"), "never told to store it instead"
    tier.submit_store(StoreJob(JobNumber(7), ["a"], [0]))
    assert [(r.job_id, r.success) for r in settle(tier)] == [(7, True)]


def test_a_closed_or_saturated_tier_refuses_a_store_saying_why(
        primary: torch.Tensor, agent: FakeNixlAgent) -> None:
    """The words of the refusal of a store past the in-flight bound and after shutdown."""
    tier = ObjectStoreTier(primary, agent=agent, in_flight=InFlightLimit(jobs=1))
    tier.submit_store(TransferJob(1, ["a"], [0]))
    with pytest.raises(TierSaturatedError) as refused:
        tier.submit_store(TransferJob(2, ["b"], [1]))
    assert str(refused.value) == (
        f"ObjectStoreTier: store job 2 ({BLOCK} bytes) refused: 1 job(s) and {BLOCK} bytes in "
        "flight, bound 1 job(s) and None bytes (InFlightLimit); nothing was registered, and "
        "no result will come")
    tier.shutdown(timeout=5)
    with pytest.raises(TierClosedError) as closed:
        tier.submit_store(TransferJob(3, ["c"], [2]))
    assert str(closed.value) == "ObjectStoreTier is shut down; job 3 refused"


class InterruptedAfterPost(TransferDriver):
    """A driver on which a Ctrl-C lands after the post was made, before its answer is taken
    (CPython may raise one at any bytecode of the caller)."""

    before_call = False

    def post(self, *args: Any) -> Outcome:
        if self.before_call:
            raise KeyboardInterrupt
        super().post(*args)
        raise KeyboardInterrupt


@pytest.mark.parametrize("before_call", [False, True], ids=["posted", "not-posted"])
def test_an_interrupt_before_the_post_answered_settles_the_job_by_its_handle(
        primary: torch.Tensor, agent: FakeNixlAgent, before_call: bool) -> None:
    """The submit files the transfer by what is known: one with a handle may be running (a
    poll says: here it ends and succeeds), one without failed to post (its reason says so);
    the interrupt is raised again. No test reached it (the driver catches an interrupt during
    its calls)."""
    tier = ObjectStoreTier(primary, agent=agent)
    driver = InterruptedAfterPost(agent, tier._driver.remote, TRANSFER_MACHINE)
    driver.before_call = before_call
    tier._driver = driver
    with pytest.raises(KeyboardInterrupt):
        tier.submit_store(TransferJob(1, ["a"], [0]))
    [result] = settle(tier)
    if before_call:
        assert result.reason == FailureReason(
            FailureKind.RAISED, "post",
            "PostInterrupted: the submit was interrupted before NIXL answered the post",
            "PostInterrupted")
    else:
        assert result.success
        assert agent.objects[tier.object_key("a")] == primary[0].numpy().tobytes()
    tier.shutdown(timeout=5)


def test_the_base_tier_refuses_an_in_flight_bound_that_is_none(primary: torch.Tensor) -> None:
    """A tier made on the base class directly checks ``in_flight=`` itself (the shipped tiers
    check it again before they make an agent), before any NIXL call."""
    agent = FakeNixlAgent("bounded")
    with pytest.raises(ValueError) as refused:
        _Tier(primary, agent=agent, remote=_Side(BLOCK), in_flight=3)  # type: ignore[arg-type]
    assert str(refused.value) == "in_flight must be an InFlightLimit or None, got int 3"
    assert agent.calls == []


def test_a_drain_polls_every_half_millisecond_by_default(
    primary: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``poll_interval`` defaults to 0.5 ms: a drain of a transfer NIXL finishes on its
    fifth state check sleeps that long between its polls, four times."""
    agent = FakeNixlAgent("draining", complete_after_polls=5)
    tier = _Tier(primary, agent=agent, remote=_Side(BLOCK))
    assert tier.poll_interval == 0.0005
    tier.submit_store(TransferJob(1, ["a"], [0]))
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)  # the environment: no time passes
    tier.drain_jobs(timeout=None)
    assert slept == [0.0005] * 4
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    tier.shutdown(timeout=5)


def test_a_store_over_at_its_submit_makes_its_own_calls_only(primary: torch.Tensor) -> None:
    """A store NIXL finishes at ``transfer()`` has its release made at the submit; the calls
    of other transfers waiting (a release retried) wait for the next poll. A mutant made
    every waiting transfer's calls at each such submit."""
    agent = FakeNixlAgent("at-once", complete_after_polls=0)
    tier = ObjectStoreTier(primary, agent=agent,
                           policy=RetryPolicy(max_attempts=None, max_seconds=None, backoff=0))
    agent.inject("release_xfer_handle", Raise(), times=10**6)
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.submit_store(TransferJob(2, ["b"], [1]))
    assert agent.call_count("release_xfer_handle") == 2, "one each, at its own submit"
    agent.clear_faults()
    assert len(settle(tier)) == 2
    tier.shutdown(timeout=5)


@pytest.mark.parametrize(("primary", "message"), [
    ([0.0] * 8, "primary must be a torch.Tensor, got list"),
    (torch.zeros(4, 8, device="meta"), "primary must be a CPU tensor, got device meta"),
    (torch.zeros(0, 8), "primary must have a first dimension of blocks, got shape (0, 8)"),
    (torch.zeros(8, 4).t(), "primary must be contiguous (blocks must be adjacent in memory)"),
    (torch.zeros(4, 0), "primary has empty blocks: shape (4, 0)"),
])
def test_a_primary_cache_a_tier_cannot_use_is_refused_saying_why(
        primary: Any, message: str) -> None:
    agent = FakeNixlAgent("refusing")
    with pytest.raises(ValueError) as refused:
        _Tier(primary, agent=agent, remote=_Side(BLOCK))
    assert str(refused.value) == message
    assert agent.calls == []


@pytest.mark.parametrize("primary", [torch.zeros(8), torch.zeros(1)], ids=["1-d", "one-block"])
def test_a_primary_of_one_dimension_or_of_one_block_is_taken(primary: torch.Tensor) -> None:
    """Blocks of one element each, or one block of one element: the first dimension indexes
    blocks, whatever else there is."""
    agent = FakeNixlAgent("small")
    tier = _Tier(primary, agent=agent, remote=_Side(int(primary[0].nbytes)))
    assert tier.num_blocks == primary.shape[0] and tier.closed is False
    tier.shutdown(timeout=5)
    assert tier.closed is True


def test_a_capacity_asks_for_a_remover_and_events_for_a_capacity(primary: torch.Tensor) -> None:
    """The words of both refusals, read whole."""
    agent = FakeNixlAgent("holding")
    with pytest.raises(ValueError) as refused:
        _Tier(primary, agent=agent, remote=_Side(BLOCK), record_events=True)
    assert str(refused.value) == ("record_events=True needs capacity_bytes: a tier keeps track "
                                  "of what it stored only within a capacity")
    with pytest.raises(ValueError) as refused:
        _Tier(primary, agent=agent, remote=_Side(BLOCK), capacity_bytes=BLOCK)
    assert str(refused.value) == "capacity_bytes needs a way to remove blocks (remove=)"
    assert agent.calls == []


def test_a_tier_whose_primary_cannot_be_prepped_releases_its_registration(
        primary: torch.Tensor) -> None:
    """The primary is registered, then prepped; a prep that fails raises, and deregisters
    what was registered (a mutant deregistered nothing)."""
    agent = FakeNixlAgent("unprepped")
    agent.inject("prep_xfer_dlist", Raise())
    with pytest.raises(FakeNixlError):
        _Tier(primary, agent=agent, remote=_Side(BLOCK))
    assert agent.calls == ["register_memory", "prep_xfer_dlist", "deregister_memory"]
    assert agent.live_registrations() == 0 and agent.misuses == []


def test_keys_and_block_ids_may_be_any_sequence_but_text(tier: ObjectStoreTier) -> None:
    """A job's keys and block ids are a list or a tuple on the fast path; any other sequence
    (a ``range``) is taken too, text is not. A mutant refused every sequence but the two."""
    tier.submit_store(TransferJob(1, ("a", "b"), range(2)))
    assert [(r.job_id, r.success) for r in settle(tier)] == [(1, True)]
    with pytest.raises(InvalidJobError) as refused:
        tier.submit_store(TransferJob(2, "ab", [0, 1]))
    assert str(refused.value) == "job 2: keys must be a list or tuple, got str 'ab'"
