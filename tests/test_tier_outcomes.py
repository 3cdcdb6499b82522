"""What a tier's user sees when a transfer goes wrong: each quarantine path, leaks, and F11.

Every story here is told through the tier's public contract only: the results
``get_finished_jobs`` hands out (``success``, ``reason``, ``transfer_size``, ``transfer_time``),
what ``lookup`` answers afterwards, what ``stats()`` counts, and what ``shutdown`` leaves held.
The NIXL side is a :class:`~kvfsm.testing.FakeNixlAgent` (its counters say what is still
registered or held), and, for the leak and F11 stories, a real POSIX agent wrapped in a
:class:`~kvfsm.testing.FaultyAgent` under a :class:`~kvfsm.tiers.FileTier`.

The quarantine paths (docs/operations.md, "Retries and quarantine"):

(a) a transfer finished, then its release kept raising until the retry bound was spent;
(b) the same after the transfer failed (the first reason stays);
(c) a transfer NIXL still ran past ``max_running_seconds``;
(d) the shutdown deadline passed with a release still failing.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfsm import FailureKind, FailureReason, JobResult, TransferJob, TransferState
from kvfsm.engine import CompiledMachine
from kvfsm.machines.transfer import TRANSFER_MACHINE
from kvfsm.nixl_agents import make_agent
from kvfsm.policy import RetryPolicy
from kvfsm.runner import Runner
from kvfsm.testing import FakeNixlAgent, FaultyAgent, Raise, ReturnErr, StayProc
from kvfsm.tiering import CPUPrimaryTier, TieringManager
from kvfsm.tiers import FileTier, Lookup, ObjectStoreTier, TierClosedError
from kvfsm.tiers import base as base_tier
from kvfsm.tiers.base import KnownNames
from kvfsm.transfer import Leak

from .real_nixl import require_nixl
from .test_interrupts import ctrl_c_at_second_pass, ctrl_c_entering
from .test_poll_schedule import Held

#: what the fake agent's injected Raise() says, as a reason's error text
BACKEND = "FakeNixlError: NIXL_ERR_BACKEND"
KEYS = ["seq0/blk0", "seq0/blk1"]
#: the NIXL transfers an object-store job of KEYS makes: one per block (NIXL's OBJ backend
#: answers one request's error while the others still run: kvfsm.driver.Split)
XFERS = len(KEYS)
_agent_names = itertools.count()

Tier = ObjectStoreTier | FileTier


# -- helpers -------------------------------------------------------------------------------------

def results_of(tier: Tier, jobs: int, timeout: float = 10) -> dict[int, JobResult]:
    """Poll as the engine's scheduler does, until ``jobs`` results arrived; each job once."""
    results: dict[int, JobResult] = {}
    deadline = time.monotonic() + timeout
    while len(results) < jobs:
        for result in tier.get_finished_jobs():
            assert result.job_id not in results, f"job {result.job_id} published twice"
            results[result.job_id] = result
        if len(results) < jobs:
            assert time.monotonic() < deadline, f"only {sorted(results)} of {jobs} published"
            time.sleep(0.001)
    assert tier.get_finished_jobs() == [], "nothing more is published"
    return results


def stored(tier: Tier, job_id: int, keys: list[str], blocks: list[int]) -> JobResult:
    """Store ``keys`` from ``blocks``; it must succeed and make the keys HIT."""
    tier.submit_store(TransferJob(job_id, keys, blocks))
    result = results_of(tier, 1)[job_id]
    assert result.success, result.reason
    assert [tier.lookup(key) for key in keys] == [Lookup.HIT] * len(keys)
    return result


def submit(tier: Tier, job: TransferJob) -> None:
    (tier.submit_load if job.is_promotion else tier.submit_store)(job)


def job_for(tier: Tier, direction: str, job_id: int) -> TransferJob:
    """A store of KEYS from blocks 0 and 1; or (after storing them) a load into blocks 4, 5."""
    if direction == "store":
        return TransferJob(job_id, KEYS, [0, 1])
    stored(tier, job_id - 1, KEYS, [0, 1])
    return TransferJob(job_id, KEYS, [4, 5], is_promotion=True)


def logged(caplog: pytest.LogCaptureFixture, level: int, job_id: int | None,
           *words: str) -> int:
    """How many lines the ``kvfsm`` logger wrote at ``level`` about ``job_id`` (its
    ``kvfsm_job_id`` record attribute; None: about no job) that contain each of ``words``."""
    return sum(1 for r in caplog.records
               if r.name == "kvfsm" and r.levelno == level
               and getattr(r, "kvfsm_job_id", None) == job_id
               and all(word in r.getMessage() for word in words))


@pytest.fixture
def fake() -> Iterator[FakeNixlAgent]:
    """A fake agent the test may leave with a quarantined transfer running: it is checked for
    misuse at the end, and closed only when nothing runs (closing would be a misuse then)."""
    agent = FakeNixlAgent(f"outcomes-{next(_agent_names)}")
    yield agent
    assert agent.misuses == [], agent.misuses
    if agent.running_transfers() == 0:
        agent.close()


def assert_primary_kept_registered(tier: Tier, agent: FakeNixlAgent, held: int) -> None:
    """Shut down with ``held`` quarantined transfers: the tier is closed, but the primary
    cache's registration (which their handles refer to) and their handles stay."""
    assert tier.closed
    assert agent.live_registrations("DRAM") == 1, "the primary cache stays registered"
    assert agent.live_dlist_handles() == 1 + held, "its descriptor list, and theirs"
    assert agent.live_xfer_handles() == held * XFERS, "the quarantined handles are held for " \
                                                       "good"
    with pytest.raises(TierClosedError):
        tier.lookup(KEYS[0])


# -- (a) a finished transfer whose release keeps raising ----------------------------------------

@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_finished_transfer_whose_release_keeps_raising_is_quarantined_not_recomputed(
    direction: str, primary: torch.Tensor, fake: FakeNixlAgent, caplog: pytest.LogCaptureFixture,
) -> None:
    """NIXL said DONE; then releasing the handle raised three times with a bound of three.

    The success latched at DONE is never recomputed: the state is not checked again, and the
    job fails only because its handle is held for good, saying so (QUARANTINED, naming the
    release and its last error). The engine goes idle, and shutdown keeps the primary cache
    registered under the held handle. (Its keys are MISS from then on, as after any failure:
    the next test.)"""
    caplog.set_level(logging.WARNING, logger="kvfsm")
    tier = ObjectStoreTier(primary, agent=fake, policy=RetryPolicy(max_attempts=3))
    job = job_for(tier, direction, job_id=2)
    checks = fake.call_count("check_xfer_state")
    fake.inject("release_xfer_handle", Raise(), times=3)
    submit(tier, job)

    assert tier.get_finished_jobs() == [], "poll 1: DONE, but the release raised: no result"
    assert tier.state_of(job.job_id) is TransferState.DONE
    assert tier.stats()["in_flight"] == {"DONE": 1}
    assert tier.stats()["retries"] == 1
    assert tier.has_pending_work()
    assert tier.get_finished_jobs() == [], "poll 2: raised again, retried again"
    assert tier.stats()["retries"] == 2
    (result,) = tier.get_finished_jobs()  # poll 3: the bound is spent

    assert result.job_id == job.job_id
    assert (result.success, result.transfer_size) == (False, 0)
    assert result.reason == FailureReason(FailureKind.QUARANTINED, "release_xfer_handle",
                                          f"retry bound spent; last error: {BACKEND}")
    assert fake.call_count("check_xfer_state") == checks + XFERS, \
        "DONE was latched once (each block's), never polled again"
    # its keys are MISS now: the next test
    stats = tier.stats()
    assert stats["in_flight"] == {}
    assert (stats["quarantined"], stats["quarantined_running"]) == (1, 0)
    assert (stats["failed"], stats["retries"], stats["leaks"]) == (1, 2, 0)
    assert stats["published"] == (1 if direction == "store" else 2)
    assert 0 <= result.transfer_time <= stats["latency"]["p99"]
    if direction == "store":  # its only job: every percentile is its time
        assert set(stats["latency"].values()) == {result.transfer_time}
    assert not tier.has_pending_work()
    tier.drain_jobs(timeout=1)  # nothing left to wait for (F9)
    assert logged(caplog, logging.ERROR, job.job_id, "quarantined", BACKEND) == 1

    releases = fake.call_count("release_xfer_handle")
    tier.shutdown(timeout=1)
    assert_primary_kept_registered(tier, fake, held=1)
    assert fake.call_count("release_xfer_handle") == releases, "never released again"
    assert tier.stats()["leaks"] == 0, "the primary registration was not even tried"
    assert logged(caplog, logging.ERROR, None, "quarantined", "stays registered") == 1
    assert tier.get_finished_jobs() == []


@pytest.mark.parametrize("direction", ["store", "load"])
def test_the_keys_of_a_job_quarantined_after_it_finished_are_a_miss(
    direction: str, primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    """One rule after any failure (docs/lifecycle.md): a job that publishes a failure makes its
    keys MISS in that tier, until a later store of them succeeds. A job quarantined after NIXL
    said DONE publishes a failure, so the engine counts the store (or load) as failed: the tier
    must not offer the keys all the same."""
    tier = ObjectStoreTier(primary, agent=fake, policy=RetryPolicy(max_attempts=1))
    job = job_for(tier, direction, job_id=2)
    fake.inject("release_xfer_handle", Raise())
    submit(tier, job)
    result = results_of(tier, 1)[2]
    assert result.success is False
    assert result.reason is not None and result.reason.kind is FailureKind.QUARANTINED
    try:
        assert [tier.lookup(key) for key in KEYS] == [Lookup.MISS, Lookup.MISS]
    finally:
        tier.shutdown(timeout=1)
        assert_primary_kept_registered(tier, fake, held=1)


def test_the_time_a_quarantined_job_took_is_its_transfers_not_its_retries(
    primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    """transfer_time (and the latency stats) measure submit to NIXL's DONE: the retries that
    followed, backing off, are not the transfer's time."""
    tier = ObjectStoreTier(primary, agent=fake,
                           policy=RetryPolicy(max_attempts=3, backoff=0.1, max_backoff=0.1))
    fake.inject("release_xfer_handle", Raise(), times=3)
    releases: list[float] = []  # when each release was asked for
    releasing = fake.release_xfer_handle

    def timed_release(handle: Any) -> None:
        releases.append(time.monotonic())
        releasing(handle)

    fake.release_xfer_handle = timed_release  # type: ignore[method-assign]
    started = time.monotonic()
    tier.submit_store(TransferJob(1, KEYS, [0, 1]))
    result = results_of(tier, 1)[1]
    assert result.reason is not None and result.reason.kind is FailureKind.QUARANTINED
    assert len(releases) == 3 and releases[2] - releases[0] >= 0.2, "two backoffs of 0.1 s"
    # NIXL's DONE came before the first release: the transfer's time ends there at the latest
    assert 0 <= result.transfer_time <= releases[0] - started
    assert tier.stats()["latency"] == {"p50": result.transfer_time, "p90": result.transfer_time,
                                       "p99": result.transfer_time}
    tier.shutdown(timeout=1)
    assert_primary_kept_registered(tier, fake, held=1)


def test_cancelling_a_finished_job_whose_release_is_retried_keeps_its_success(
    primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    """The outcome latched at DONE is kept by a cancel too: once the release goes through, the
    job publishes its success and its keys are HIT."""
    tier = ObjectStoreTier(primary, agent=fake, policy=RetryPolicy(max_attempts=3))
    fake.inject("release_xfer_handle", Raise())
    tier.submit_store(TransferJob(1, KEYS, [0, 1]))
    assert tier.get_finished_jobs() == []
    assert tier.state_of(1) is TransferState.DONE
    tier.cancel(1)
    assert tier.state_of(1) is TransferState.DONE
    result = results_of(tier, 1)[1]
    assert (result.success, result.reason) == (True, None)
    assert result.transfer_size == 2 * primary[0].nbytes
    assert [tier.lookup(key) for key in KEYS] == [Lookup.HIT, Lookup.HIT]
    stats = tier.stats()
    assert (stats["published"], stats["failed"], stats["retries"], stats["quarantined"]) == \
        (1, 0, 1, 0)
    tier.shutdown(timeout=1)
    assert tier.closed
    assert (fake.live_registrations(), fake.live_xfer_handles()) == (0, 0)


# -- (b) a failed transfer whose release keeps raising --------------------------------------------

def _err_on_check(tier: Tier, agent: FakeNixlAgent, job: TransferJob) -> None:
    agent.inject("check_xfer_state", ReturnErr())
    tier.submit_store(job)


def _raise_on_check(tier: Tier, agent: FakeNixlAgent, job: TransferJob) -> None:
    agent.inject("check_xfer_state", Raise())
    tier.submit_store(job)


def _err_on_post(tier: Tier, agent: FakeNixlAgent, job: TransferJob) -> None:
    agent.inject("transfer", ReturnErr())
    tier.submit_store(job)


def _cancelled_while_running(tier: Tier, agent: FakeNixlAgent, job: TransferJob) -> None:
    agent.inject("check_xfer_state", StayProc(2))
    tier.submit_store(job)
    assert tier.get_finished_jobs() == []
    tier.cancel(job.job_id)
    assert tier.state_of(job.job_id) is TransferState.CANCELLING


@pytest.mark.parametrize(("fail", "reason"), [
    (_err_on_check, FailureReason(FailureKind.ERR, "check_xfer_state", "answered 'ERR'")),
    (_raise_on_check, FailureReason(FailureKind.RAISED, "check_xfer_state", BACKEND)),
    (_err_on_post, FailureReason(FailureKind.ERR, "transfer", "answered 'ERR'")),
    (_cancelled_while_running, FailureReason(FailureKind.CANCELLED, None, "cancelled")),
], ids=["check-answered-ERR", "check-raised", "transfer-answered-ERR", "cancelled"])
def test_a_failed_transfer_whose_release_keeps_raising_is_quarantined_with_its_first_reason(
    fail: Callable[[Tier, FakeNixlAgent, TransferJob], None], reason: FailureReason,
    primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    """The keys were stored once (HIT); a second store of them failed, then its release raised
    until the bound was spent. The job says what failed it first, not the quarantine; the tier
    no longer vouches for the keys; the held handle keeps the primary registered."""
    tier = ObjectStoreTier(primary, agent=fake, policy=RetryPolicy(max_attempts=3))
    stored(tier, 1, KEYS, [0, 1])
    fake.inject("release_xfer_handle", Raise(), times=3)
    fail(tier, fake, TransferJob(2, KEYS, [2, 3]))

    result = results_of(tier, 1)[2]
    assert (result.success, result.transfer_size) == (False, 0)
    assert result.reason == reason
    assert result.reason is not None and result.reason.kind is not FailureKind.QUARANTINED
    assert [tier.lookup(key) for key in KEYS] == [Lookup.MISS, Lookup.MISS]
    stats = tier.stats()
    assert (stats["published"], stats["failed"], stats["retries"]) == (2, 1, 2)
    assert (stats["quarantined"], stats["quarantined_running"]) == (1, 0)
    assert stats["in_flight"] == {}
    assert len(stats["latency"]) == 3 and result.transfer_time >= 0
    assert not tier.has_pending_work()

    tier.shutdown(timeout=1)
    assert_primary_kept_registered(tier, fake, held=1)


@pytest.mark.parametrize("fail", [_cancelled_while_running, _err_on_check],
                         ids=["cancelled-while-running", "check-answered-ERR"])
def test_a_store_whose_failure_is_latched_makes_its_keys_miss_before_its_result(
    fail: Callable[[Tier, FakeNixlAgent, TransferJob], None],
    primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    """The keys were stored once (HIT). A second store of them latched its failure but is not
    published yet: cancelled while NIXL still runs it (its bytes may land whole all the same),
    or answered ERR with its release raising. From that moment the keys are MISS, and a load
    of them submitted meanwhile fails, instead of publishing whatever the failed store left
    as a success; the store's own result comes later, a failure."""
    tier = ObjectStoreTier(primary, agent=fake, policy=RetryPolicy(max_attempts=5))
    stored(tier, 1, KEYS, [0, 1])
    primary[2:4] = 7.0  # the failed store's bytes
    fake.inject("release_xfer_handle", Raise(), times=2)
    fail(tier, fake, TransferJob(2, KEYS, [2, 3]))
    if tier.state_of(2) is TransferState.PROCESSING:  # (ERR comes with the next check)
        assert tier.get_finished_jobs() == [], "its release raised: not published yet"
    assert tier.state_of(2) in (TransferState.CANCELLING, TransferState.FAILED)

    assert [tier.lookup(key) for key in KEYS] == [Lookup.MISS, Lookup.MISS]
    before = primary[4:6].clone()
    tier.submit_load(TransferJob(3, KEYS, [4, 5], is_promotion=True))
    results = results_of(tier, 2)
    assert not results[2].success
    load = results[3]
    assert not load.success and load.reason is not None
    assert "forgot" in load.reason.error, load.reason
    assert torch.equal(primary[4:6], before), "the load wrote nothing into the engine's blocks"
    tier.shutdown(timeout=1)


def test_a_store_stored_again_while_a_cancelled_one_still_runs_does_not_vouch_for_its_keys(
    primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    """A store of the keys is cancelled while NIXL runs it; another store of them succeeds
    before NIXL ended the first, whose bytes may then land whole over the second's. The keys
    stay MISS (a load of them fails) until the cancelled store is over; then a store of them
    that succeeds makes them HIT again. (The second store's success vouched for them, and a
    load read the cancelled store's bytes as a success.)"""
    tier = ObjectStoreTier(primary, agent=fake)
    fake.inject("check_xfer_state", StayProc(3))  # the first store's checks: still running
    tier.submit_store(TransferJob(2, KEYS, [2, 3]))
    tier.cancel(2)
    tier.submit_store(TransferJob(3, KEYS, [0, 1]))
    assert results_of(tier, 1)[3].success and tier.state_of(2) is TransferState.CANCELLING
    assert [tier.lookup(key) for key in KEYS] == [Lookup.MISS, Lookup.MISS], "it may land"
    tier.submit_load(TransferJob(4, KEYS, [4, 5], is_promotion=True))
    results = results_of(tier, 2)
    assert not results[2].success
    assert not results[4].success and "forgot" in str(results[4].reason)
    stored(tier, 5, KEYS, [0, 1])  # the cancelled store is over: HIT again
    tier.shutdown(timeout=1)


def test_a_ctrl_c_as_a_cancelled_store_forgets_its_keys_leaves_them_forgotten(
    primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    """A Ctrl-C lands as a cancel's books start to forget the store's keys: the next call
    into the tier forgets them first, so a load of them submitted then fails instead of
    reading what the cancelled store may land."""
    tier = ObjectStoreTier(primary, agent=fake)
    stored(tier, 1, KEYS, [0, 1])
    fake.inject("check_xfer_state", StayProc(2))
    tier.submit_store(TransferJob(2, KEYS, [2, 3]))

    with ctrl_c_entering(Runner._failing):
        tier.cancel(2)
    tier.submit_load(TransferJob(3, KEYS, [4, 5], is_promotion=True))
    results = results_of(tier, 2)
    assert not results[2].success
    assert not results[3].success and "forgot" in str(results[3].reason)
    tier.shutdown(timeout=1)


# -- two stores of one key at once ---------------------------------------------------------------

def two_versions(policy: RetryPolicy | None = None
                 ) -> tuple[torch.Tensor, Held, ObjectStoreTier]:
    """An object store tier on an agent whose transfers run until the test ends them (their
    bytes land then); blocks 0-1 hold the engine's first version of KEYS, blocks 2-3 its
    second."""
    primary = torch.zeros((8, 64), dtype=torch.uint8)
    for block in range(4):
        primary[block] = block + 1
    agent = Held()
    return primary, agent, ObjectStoreTier(primary, agent=agent, policy=policy)


def published(tier: ObjectStoreTier) -> dict[int, JobResult]:
    return {result.job_id: result for result in tier.get_finished_jobs()}


def loads_back(tier: ObjectStoreTier, agent: Held, job_id: int, transfers: tuple[int, int],
               expected: torch.Tensor) -> bool:
    """Load KEYS into blocks 6-7 (job ``job_id``, NIXL's ``transfers``-th transfers): True
    when it succeeds with ``expected``'s bytes."""
    tier.submit_load(TransferJob(job_id, KEYS, [6, 7], is_promotion=True))
    agent.end(*transfers)
    results = published(tier)
    return ([r.success for r in results.values()] == [True]
            and torch.equal(tier.primary[6:8], expected))


def test_two_stores_of_the_same_keys_at_once_never_vouch_for_the_mix_they_leave() -> None:
    """The engine stores KEYS, then stores them again from other blocks before the first store
    is over. NIXL makes a transfer per block, and the four land in any order: here the second
    store's first block, then the whole first store (published), then the second store's last
    block (published last). Both succeed, and the tier holds the first version of one key and
    the second of the other. It vouches for neither: they are MISS from the second submit on,
    a load of them fails without a NIXL call, and a store of them made alone later makes them
    HIT and loadable again. (Both were HIT after the second store, and a load published the
    mix as a success.)"""
    primary, agent, tier = two_versions()
    tier.submit_store(TransferJob(1, KEYS, [0, 1]))  # posted: transfers 0, 1
    tier.submit_store(TransferJob(2, KEYS, [2, 3]))  # posted: transfers 2, 3
    agent.end(2)
    assert published(tier) == {}
    agent.end(0, 1)
    assert [r.success for r in published(tier).values()] == [True]
    agent.end(3)
    assert [r.success for r in published(tier).values()] == [True]
    assert [tier.lookup(key) for key in KEYS] == [Lookup.MISS] * 2, "a mix vouched for"

    posted = len(agent.posted)
    tier.submit_load(TransferJob(3, KEYS, [6, 7], is_promotion=True))
    (load,) = published(tier).values()
    assert not load.success and load.reason is not None, "the mix was loaded as a success"
    assert load.reason.error_type == "ForgottenKeyError"
    assert "two stores of a key ran at once" in load.reason.error
    assert len(agent.posted) == posted and not primary[6:].any(), "nothing was read"

    primary[4] = primary[5] = 9
    tier.submit_store(TransferJob(4, KEYS, [4, 5]))  # alone: it vouches once it succeeds
    agent.end(4, 5)
    assert [r.success for r in published(tier).values()] == [True]
    assert [tier.lookup(key) for key in KEYS] == [Lookup.HIT] * 2
    assert loads_back(tier, agent, 5, (6, 7), primary[4:6])
    tier.shutdown(timeout=1)


def test_two_stores_of_a_key_from_one_block_at_once_still_vouch_for_it() -> None:
    """The engine stores KEYS from blocks 0-1 twice before the first store is over (two
    requests sharing the blocks): the blocks are not written while a store of them is
    unpublished, so both carry the same bytes, and the keys are HIT once both are over, and
    loadable. (They were forgotten as two stores at once, and an engine that took them for
    stored never stored them again.)"""
    primary, agent, tier = two_versions()
    tier.submit_store(TransferJob(1, KEYS, [0, 1]))
    tier.submit_store(TransferJob(2, KEYS, [0, 1]))
    agent.end(2, 0)
    assert published(tier) == {}
    agent.end(1, 3)
    assert [r.success for r in published(tier).values()] == [True, True]
    assert [tier.lookup(key) for key in KEYS] == [Lookup.HIT] * 2
    assert loads_back(tier, agent, 3, (4, 5), primary[0:2])
    tier.shutdown(timeout=1)


def test_a_ctrl_c_as_a_cancelled_stores_books_are_written_leaves_no_doubt_behind() -> None:
    """A store of "x" is cancelled while NIXL runs it (so "x" is doubted until it is over);
    a Ctrl-C lands as its books begin, once NIXL ended it. The next call drops the doubt of
    the store that ended: a store of "x" made alone then makes it HIT. And its job id, used
    again for a store of "y" the running bound gives up, has "y" doubted for good: a later
    store of "y" does not vouch for it. (The doubt stayed for good, under the job id, so
    "x" was never loadable again, and the given-up store of "y" was not doubted at all.)"""
    _, agent, tier = two_versions(RetryPolicy(max_running_seconds=0.2))
    tier.submit_store(TransferJob(2, ["x"], [0]))  # transfer 0
    tier.cancel(2)
    agent.end(0)
    with ctrl_c_entering(base_tier._record_verdicts):
        tier.get_finished_jobs()
    assert [r.success for r in published(tier).values()] == [False]
    tier.submit_store(TransferJob(3, ["x"], [1]))  # transfer 1
    agent.end(1)
    assert [r.success for r in published(tier).values()] == [True]
    assert tier.lookup("x") is Lookup.HIT, "doubted for good"

    tier.submit_store(TransferJob(2, ["y"], [2]))  # transfer 2, never ends
    time.sleep(0.3)  # past the running bound
    (result,) = published(tier).values()
    assert result.reason is not None and result.reason.kind is FailureKind.QUARANTINED
    tier.submit_store(TransferJob(4, ["y"], [3]))  # transfer 3
    agent.end(3)
    assert [r.success for r in published(tier).values()] == [True]
    assert tier.lookup("y") is Lookup.MISS, "the given-up store may still land"
    tier.shutdown(timeout=1)


@pytest.mark.parametrize("given_up", [False, True])
def test_a_ctrl_c_between_two_keys_of_a_doubt_leaves_each_key_doubted_as_it_should(
        given_up: bool) -> None:
    """A store of KEYS NIXL runs is cancelled (doubted until NIXL ended it), or given up by
    the running bound (doubted for good); a Ctrl-C lands between the two keys, as the doubt
    is counted, or, for the cancelled store, as it is taken back once NIXL ended it. The next
    call counts the doubts again from the stores: a store of KEYS made alone afterwards vouches
    for both once the cancelled store is over, and for neither while the given-up one may
    land. (The second key stayed doubted for good, or was never doubted.)"""
    _, agent, tier = two_versions(RetryPolicy(max_running_seconds=0.2) if given_up else None)
    tier.submit_store(TransferJob(1, KEYS, [0, 1]))  # transfers 0, 1
    if given_up:
        time.sleep(0.3)  # past the running bound
        with ctrl_c_at_second_pass(KnownNames.doubt):
            tier.get_finished_jobs()
        assert [r.success for r in published(tier).values()] == [False]
    else:
        tier.cancel(1)
        agent.end(0, 1)
        with ctrl_c_at_second_pass(KnownNames.undoubt):
            tier.get_finished_jobs()
        assert [r.success for r in published(tier).values()] == [False]
    tier.submit_store(TransferJob(2, KEYS, [2, 3]))  # transfers 2, 3
    agent.end(2, 3)
    assert [r.success for r in published(tier).values()] == [True]
    expected = Lookup.MISS if given_up else Lookup.HIT
    assert [tier.lookup(key) for key in KEYS] == [expected] * 2
    tier.shutdown(timeout=1)


def test_a_ctrl_c_as_a_store_is_given_up_leaves_it_running_and_not_held_for_good() -> None:
    """A Ctrl-C lands as the running bound gives a store up, before its give-up is fired:
    it is still running, not given up; NIXL then ends it with an error. It fails as any
    store NIXL failed: a store of its key made alone afterwards vouches for it. (It was
    counted as given up while NIXL ran it, and its key doubted for good.)"""
    _, agent, tier = two_versions(RetryPolicy(max_running_seconds=0.2))
    tier.submit_store(TransferJob(1, ["x"], [0]))  # transfer 0
    time.sleep(0.3)  # past the running bound
    with ctrl_c_entering(CompiledMachine.fire, called_from="give_up"):
        tier.get_finished_jobs()
    agent.inject("check_xfer_state", ReturnErr())
    assert ends_then_stored_alone(tier, agent) is Lookup.HIT, "held as given up, for good"
    assert tier.stats()["quarantined_running"] == 0
    tier.shutdown(timeout=1)


def ends_then_stored_alone(tier: ObjectStoreTier, agent: Held) -> Lookup:
    """NIXL ends store 1 of "x" (transfer 0), which fails; a store 2 of "x" made alone
    (transfer 1) succeeds: what a lookup of "x" answers then."""
    agent.end(0)
    assert [r.success for r in published(tier).values()] == [False]
    tier.submit_store(TransferJob(2, ["x"], [1]))
    agent.end(1)
    assert [r.success for r in published(tier).values()] == [True]
    return tier.lookup("x")


def test_a_store_given_up_into_a_running_state_stays_held_through_a_ctrl_c_elsewhere() -> None:
    """A lifecycle of the user's gives a store up past the running bound into CANCELLING, a
    running state (NIXL may still run it). A Ctrl-C then lands in an unrelated poll, and the
    next call mends the books: the store stays counted as given up while NIXL runs it, and
    its key MISS though a later store of it succeeds meanwhile. (The mend took every store
    still in a running state for one whose give-up never fired.) Once NIXL ended it and its
    handle was released, it is no longer counted."""
    machine = TRANSFER_MACHINE.extend("given_up_to_cancelling", replace={
        ("PROCESSING", "poll", "exhausted"): {"dest": "CANCELLING",
                                              "after": ["latch_cancelled"]}})
    agent = Held()
    tier = ObjectStoreTier(torch.zeros((8, 64), dtype=torch.uint8), agent=agent,
                           machine=machine, policy=RetryPolicy(max_running_seconds=0.2))
    tier.submit_store(TransferJob(1, ["x"], [0]))  # transfer 0
    time.sleep(0.3)  # past the running bound
    assert published(tier) == {} and tier.state_of(1).name == "CANCELLING"
    agent.interrupt_in = 1
    with pytest.raises(KeyboardInterrupt):
        tier.get_finished_jobs()
    assert published(tier) == {}  # (mended)
    assert tier.stats()["quarantined_running"] == 1
    tier.submit_store(TransferJob(2, ["x"], [1]))  # transfer 1, while the given-up one runs
    agent.end(1)
    assert [r.success for r in published(tier).values()] == [True]
    assert tier.lookup("x") is Lookup.MISS, "given up and running, yet vouched for"
    agent.end(0)  # NIXL ends it: released, over
    assert [r.success for r in published(tier).values()] == [False]
    assert tier.stats()["quarantined_running"] == 0
    tier.shutdown(timeout=1)
    assert agent.live_registrations() == 0


def test_a_store_given_up_that_nixl_then_ended_in_an_error_held_for_good_runs_no_more() -> None:
    """A lifecycle of the user's gives a store up into CANCELLING past the running bound,
    then NIXL ends it with an error, which the lifecycle quarantines (its handle held for
    good, as it may choose). NIXL said it is over: its result does not say its blocks are in
    use, nothing counts it as running, and a bound of one job has room again. (Only a
    released handle took it out of those NIXL may run: blocks_in_use stayed true, the parent
    kept its pins, and the tier stayed saturated for good.)"""
    from kvfsm.policy import InFlightLimit  # noqa: PLC0415

    machine = TRANSFER_MACHINE.extend("given_up_then_held", replace={
        ("PROCESSING", "poll", "exhausted"): {"dest": "CANCELLING",
                                              "after": ["latch_cancelled"]},
        ("CANCELLING", "poll", "errored"): {"dest": "QUARANTINED", "after": ["quarantine"]}})
    agent = Held()
    tier = ObjectStoreTier(torch.zeros((8, 64), dtype=torch.uint8), agent=agent,
                           machine=machine, policy=RetryPolicy(max_running_seconds=0.2),
                           in_flight=InFlightLimit(jobs=1))
    tier.submit_store(TransferJob(1, ["x"], [0]))  # transfer 0
    time.sleep(0.3)  # past the running bound
    assert published(tier) == {} and tier.state_of(1).name == "CANCELLING"
    assert tier.saturated()
    agent.inject("check_xfer_state", ReturnErr())
    agent.end(0)
    (result,) = published(tier).values()
    assert (result.success, result.blocks_in_use) == (False, False)
    assert tier.stats()["quarantined_running"] == 0 and tier.stats()["quarantined"] == 1
    assert not tier.saturated()
    tier.submit_store(TransferJob(2, ["y"], [1]))  # transfer 1: taken
    agent.end(1)
    assert [r.success for r in published(tier).values()] == [True]
    tier.shutdown(timeout=1)


def test_a_ctrl_c_as_a_store_is_counted_out_leaves_no_key_unloadable_for_good() -> None:
    """Two stores of KEYS at once; a Ctrl-C lands in the poll that publishes the first, as its
    keys are about to be counted out. The next call counts the unpublished stores again: once
    the second is over, the keys are MISS (the two overlapped), and a store of them made
    alone makes them HIT and loadable. (Counted as still written by a store, they would
    have been forgotten by every store of them alone for good.) A Ctrl-C as a store is
    counted in (its post not made yet) fails that job, and leaves no count behind either."""
    primary, agent, tier = two_versions()
    with ctrl_c_entering(KnownNames.storing_begins):
        tier.submit_store(TransferJob(9, KEYS, [0, 1]))
    assert [r.success for r in published(tier).values()] == [False] and agent.posted == []
    tier.submit_store(TransferJob(1, KEYS, [0, 1]))
    tier.submit_store(TransferJob(2, KEYS, [2, 3]))
    agent.end(0, 1)
    with ctrl_c_entering(KnownNames.store_ended):
        tier.get_finished_jobs()
    assert [r.success for r in published(tier).values()] == [True]
    agent.end(2, 3)
    assert [r.success for r in published(tier).values()] == [True]
    assert [tier.lookup(key) for key in KEYS] == [Lookup.MISS] * 2, "a mix vouched for"
    tier.submit_store(TransferJob(3, KEYS, [2, 3]))
    agent.end(4, 5)
    assert [r.success for r in published(tier).values()] == [True]
    assert loads_back(tier, agent, 4, (6, 7), primary[2:4])
    tier.shutdown(timeout=1)


# -- (c) a transfer still running past max_running_seconds ----------------------------------------

@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_transfer_running_past_max_running_seconds_is_quarantined_and_counted_as_running(
    direction: str, primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    """NIXL keeps answering PROC for one job; another job beside it finishes. Past the bound the
    stuck job fails as quarantined while running (its keys MISS), the other succeeds (HIT), and
    shutdown does not wait for the stuck one, nor release anything it may still use."""
    tier = ObjectStoreTier(primary, agent=fake, policy=RetryPolicy(max_running_seconds=0.05))
    stuck = job_for(tier, direction, job_id=2)
    fake.inject("check_xfer_state", StayProc(10**6))  # the next check: the stuck job's first
    submit(tier, stuck)
    tier.submit_store(TransferJob(3, ["other"], [6]))

    results = results_of(tier, 2)
    assert results[3].success and results[3].reason is None
    result = results[2]
    assert (result.success, result.transfer_size) == (False, 0)
    assert result.reason == FailureReason(FailureKind.QUARANTINED, "check_xfer_state",
                                          "still running after 0.05 s")
    assert result.transfer_time >= 0.05, "it ran (as far as the tier knows) until given up"
    assert tier.stats()["latency"]["p99"] == result.transfer_time, "the slowest, by far"
    assert [tier.lookup(key) for key in KEYS] == [Lookup.MISS, Lookup.MISS]
    assert tier.lookup("other") is Lookup.HIT
    stats = tier.stats()
    assert (stats["quarantined"], stats["quarantined_running"]) == (1, 1)
    assert (stats["failed"], stats["retries"], stats["in_flight"]) == (1, 0, {})
    assert fake.running_transfers() == XFERS, "NIXL still runs it (a transfer per block): " \
                                              "nothing was released under it"

    started = time.monotonic()
    tier.shutdown()  # the default deadline (30 s) is not waited for: the job was given up
    assert time.monotonic() - started < 5
    assert_primary_kept_registered(tier, fake, held=1)
    assert fake.running_transfers() == XFERS


def test_a_store_given_up_while_nixl_runs_it_keeps_its_keys_missed_whatever_succeeds_after(
    primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    """A store NIXL still runs past ``max_running_seconds`` is given up, its handles held: its
    PUT may still land whole, at any time, over whatever is stored under its keys later. So a
    later store of the same keys that succeeds does not make them HIT, and a load of them fails
    without a NIXL call instead of reading what the given-up store may have landed. (That
    later store vouched for them, and a load was published as a success.) Other keys are not
    touched."""
    tier = ObjectStoreTier(primary, agent=fake, policy=RetryPolicy(max_running_seconds=0.05))
    fake.inject("check_xfer_state", StayProc(10**6))
    tier.submit_store(TransferJob(2, KEYS, [2, 3]))
    given_up = results_of(tier, 1)[2]
    assert given_up.reason is not None and given_up.reason.kind is FailureKind.QUARANTINED
    fake.clear_faults()

    tier.submit_store(TransferJob(3, KEYS, [0, 1]))
    tier.submit_store(TransferJob(4, ["other"], [6]))
    results = results_of(tier, 2)
    assert results[3].success and results[4].success
    assert [tier.lookup(key) for key in KEYS] == [Lookup.MISS, Lookup.MISS], "it may land"
    assert tier.lookup("other") is Lookup.HIT
    made = len(fake.calls)
    tier.submit_load(TransferJob(5, KEYS, [4, 5], is_promotion=True))
    (load,) = results_of(tier, 1).values()
    assert not load.success and load.reason is not None
    assert load.reason.error_type == "ForgottenKeyError", load.reason
    assert [call for call in fake.calls[made:] if call[0] == "make_prepped_xfer"] == []
    assert tier.stats()["quarantined_running"] == 1
    tier.shutdown(timeout=1)


def test_a_cancelled_store_under_the_job_id_of_one_given_up_keeps_its_keys_missed() -> None:
    """Job 2 (another key) is given up while NIXL runs it; once its result is out, the
    engine uses job id 2 again, for a store of KEYS that it cancels while NIXL runs it. A
    store of KEYS succeeds meanwhile, and then the cancelled one lands: the keys stay MISS.
    (The given-up job's doubt kept its id, the cancelled store under that id was not
    doubted, and the later store vouched for the keys its PUT then overwrote, until the
    cancelled store's release went through.)"""
    primary = torch.zeros((8, 64), dtype=torch.uint8)
    agent = Held()
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(max_running_seconds=60))
    tier.submit_store(TransferJob(2, ["other"], [6]))  # posted: transfer 0, never ends
    given_up = tier.transfer_of(2)
    assert given_up is not None
    given_up.started_at -= 120  # submitted long ago: past the bound
    (result,) = published(tier).values()
    assert result.reason is not None and result.reason.kind is FailureKind.QUARANTINED

    tier.submit_store(TransferJob(2, KEYS, [0, 1]))  # posted: transfers 1, 2
    tier.cancel(2)
    tier.submit_store(TransferJob(3, KEYS, [2, 3]))  # posted: transfers 3, 4
    agent.end(3, 4)
    assert [r.success for r in published(tier).values()] == [True]
    agent.inject("release_xfer_handle", Raise(), times=10**6)  # it waits in FAILED
    agent.end(1, 2)  # the cancelled store lands, over job 3's
    assert published(tier) == {} and tier.state_of(2) is TransferState.FAILED
    assert [tier.lookup(key) for key in KEYS] == [Lookup.MISS, Lookup.MISS], "it landed"
    agent.clear_faults()
    assert [r.success for r in published(tier).values()] == [False]
    assert [tier.lookup(key) for key in KEYS] == [Lookup.MISS, Lookup.MISS]
    tier.shutdown(timeout=1)


# -- (d) the shutdown deadline passes with a release still failing --------------------------------

def test_a_release_still_failing_at_the_shutdown_deadline_is_quarantined_by_shutdown(
    primary: torch.Tensor, fake: FakeNixlAgent, caplog: pytest.LogCaptureFixture,
) -> None:
    """No retry bound of its own (it would retry forever): the shutdown deadline is the bound.
    Shutdown returns by it, the job finished but held gets its one failure, saying the deadline
    was why, and a job that had ended well before keeps its success."""
    caplog.set_level(logging.WARNING, logger="kvfsm")
    tier = ObjectStoreTier(primary, agent=fake, policy=RetryPolicy(max_seconds=None,
                                                                   backoff=0.01))
    stored(tier, 1, ["before"], [7])
    fake.inject("release_xfer_handle", Raise(), times=10**6)
    tier.submit_store(TransferJob(2, KEYS, [0, 1]))
    assert tier.get_finished_jobs() == []
    assert tier.state_of(2) is TransferState.DONE
    assert tier.lookup(KEYS[0]) is not Lookup.HIT, "not vouched for before its result"

    started = time.monotonic()
    tier.shutdown(timeout=0.2)
    assert time.monotonic() - started < 2, "returns by its deadline, plus a poll"
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success, result.transfer_size) == (2, False, 0)
    assert result.reason == FailureReason(
        FailureKind.QUARANTINED, "release_xfer_handle",
        f"shutdown deadline passed; last error: {BACKEND}")
    assert result.transfer_time < 0.2, "the transfer itself was quick"
    stats = tier.stats()
    assert (stats["published"], stats["failed"]) == (2, 1)
    assert (stats["quarantined"], stats["quarantined_running"]) == (1, 0)
    assert stats["retries"] >= 1 and stats["in_flight"] == {}
    assert_primary_kept_registered(tier, fake, held=1)
    assert logged(caplog, logging.ERROR, 2, "quarantined", "shutdown deadline passed") == 1
    tier.shutdown(timeout=0.2)  # idempotent
    assert tier.get_finished_jobs() == []
    fake.clear_faults()


def test_a_failed_transfer_still_unreleased_at_the_shutdown_deadline_keeps_its_reason(
    primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    tier = ObjectStoreTier(primary, agent=fake, policy=RetryPolicy(max_seconds=None))
    fake.inject("check_xfer_state", ReturnErr())
    fake.inject("release_xfer_handle", Raise(), times=10**6)
    tier.submit_store(TransferJob(1, KEYS, [0, 1]))
    assert tier.get_finished_jobs() == []
    assert tier.state_of(1) is TransferState.FAILED
    tier.shutdown(timeout=0.1)
    (result,) = tier.get_finished_jobs()
    assert result.reason == FailureReason(FailureKind.ERR, "check_xfer_state", "answered 'ERR'")
    stats = tier.stats()
    assert (stats["failed"], stats["quarantined"], stats["quarantined_running"]) == (1, 1, 0)
    assert_primary_kept_registered(tier, fake, held=1)
    fake.clear_faults()


# -- leaks: a cleanup call that fails costs no result ---------------------------------------------

@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_cleanup_that_leaks_still_publishes_the_success_and_records_each_leak(
    direction: str, primary: torch.Tensor, fake: FakeNixlAgent,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvfsm")
    tier = ObjectStoreTier(primary, agent=fake)
    job = job_for(tier, direction, job_id=2)
    fake.inject("release_dlist_handle", Raise())
    fake.inject("deregister_memory", Raise("NIXL_ERR_NOT_FOUND"))
    submit(tier, job)

    result = results_of(tier, 1)[2]
    assert (result.success, result.reason) == (True, None), "a leak fails nothing"
    assert result.transfer_size == 2 * primary[0].nbytes
    if direction == "load":
        assert torch.equal(primary[4:6], primary[0:2]), "the bytes arrived"
    assert [tier.lookup(key) for key in KEYS] == [Lookup.HIT, Lookup.HIT]
    stats = tier.stats()
    assert stats["leaks"] == 2
    assert stats["leaked"] == [
        (2, Leak("release_dlist_handle", BACKEND)),
        (2, Leak("deregister_memory", "FakeNixlError: NIXL_ERR_NOT_FOUND"))]
    assert (stats["failed"], stats["quarantined"], stats["retries"]) == (0, 0, 0)
    assert logged(caplog, logging.WARNING, 2, "leak", "release_dlist_handle", BACKEND) == 1
    assert logged(caplog, logging.WARNING, 2, "leak", "deregister_memory",
                  "FakeNixlError: NIXL_ERR_NOT_FOUND") == 1
    assert logged(caplog, logging.WARNING, 2) == 2, "a line for each leak, and nothing else"
    assert fake.live_registrations("OBJ") == len(KEYS), "the leaked registration (a descriptor " \
                                                        "a key), as NIXL keeps it"

    tier.shutdown(timeout=1)
    assert tier.closed
    assert tier.stats()["leaks"] == 2, "shutdown released the primary's handles cleanly"
    assert fake.live_registrations("DRAM") == 0
    assert fake.live_xfer_handles() == 0


def test_a_primary_registration_that_cannot_be_released_at_shutdown_is_a_leak_of_no_job(
    primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    tier = ObjectStoreTier(primary, agent=fake)
    stored(tier, 1, KEYS, [0, 1])
    fake.inject("deregister_memory", Raise())
    tier.shutdown(timeout=1)
    assert tier.closed
    assert tier.stats()["leaked"] == [(-1, Leak("deregister_memory", BACKEND))]
    assert tier.stats()["leaks"] == 1
    assert fake.live_registrations("DRAM") == 1


# -- F11: a failed load is not made again and again -----------------------------------------------

def test_f11_a_failed_load_makes_the_keys_miss_until_a_store_succeeds_again(
    fake: FakeNixlAgent,
) -> None:
    """The manager promotes from a tier whose lookup says HIT. After a load from it failed,
    the tier says MISS, so the manager stops trying (no load is submitted); a later store
    that succeeds makes the key HIT again, and the load then brings the bytes back."""
    primary = CPUPrimaryTier(8, 256, torch.uint8)
    tier = ObjectStoreTier(primary.cache, agent=fake)
    manager = TieringManager(primary, {"objects": tier})
    (block,) = primary.allocate(["k"])
    primary.cache[block] = 7
    primary.complete_write([block], success=True)
    manager.store([block])
    assert [f.success for f in manager.drain(timeout=5)] == [True]
    assert tier.lookup("k") is Lookup.HIT
    primary.free([block])

    fake.inject("check_xfer_state", Raise())  # the load's first state check
    failed = manager.load(["k"])
    assert failed is not None
    assert [(f.job_id, f.success) for f in manager.drain(timeout=5)] == [(failed, False)]
    assert tier.lookup("k") is Lookup.MISS, "the tier no longer offers it"
    loads = fake.call_count("make_prepped_xfer")
    for _ in range(3):  # the engine asks again on later steps: nothing is submitted
        assert manager.load(["k"]) is None
        assert manager.step() == []
    assert fake.call_count("make_prepped_xfer") == loads
    assert tier.stats()["failed"] == 1

    (block,) = primary.allocate(["k"])
    primary.cache[block] = 9
    primary.complete_write([block], success=True)
    manager.store([block])
    assert [f.success for f in manager.drain(timeout=5)] == [True]
    assert tier.lookup("k") is Lookup.HIT, "stored again: offered again"
    primary.free([block])
    primary.cache.zero_()
    loaded = manager.load(["k"])
    assert [(f.job_id, f.success) for f in manager.drain(timeout=5)] == [(loaded, True)]
    again = primary.block_of("k")
    assert again is not None and bool((primary.cache[again] == 9).all())
    manager.shutdown(timeout=5)
    assert tier.closed and fake.live_registrations() == 0


@pytest.mark.parametrize("fault", [Raise(), ReturnErr()], ids=["raised", "answered-ERR"])
def test_f11_on_the_tier_a_failed_store_or_load_is_a_miss_a_later_store_a_hit(
    fault: Raise | ReturnErr, primary: torch.Tensor, fake: FakeNixlAgent,
) -> None:
    tier = ObjectStoreTier(primary, agent=fake)
    stored(tier, 1, KEYS, [0, 1])
    fake.inject("check_xfer_state", fault)
    tier.submit_load(TransferJob(2, KEYS, [4, 5], is_promotion=True))
    assert results_of(tier, 1)[2].success is False
    assert [tier.lookup(key) for key in KEYS] == [Lookup.MISS, Lookup.MISS]

    stored(tier, 3, KEYS[:1], [0])  # one of the two stored again
    assert [tier.lookup(key) for key in KEYS] == [Lookup.HIT, Lookup.MISS]
    fake.inject("check_xfer_state", fault)
    tier.submit_store(TransferJob(4, KEYS[:1], [2]))
    assert results_of(tier, 1)[4].success is False
    assert tier.lookup(KEYS[0]) is Lookup.MISS, "a failed store is not vouched for"
    stored(tier, 5, KEYS, [0, 1])
    stats = tier.stats()
    assert (stats["published"], stats["failed"], stats["quarantined"]) == (5, 2, 0)
    tier.shutdown(timeout=1)


# -- the leak and F11 stories on real NIXL (POSIX files) ------------------------------------------

@pytest.fixture
def real_files(tmp_path: Path) -> Iterator[tuple[FileTier, FaultyAgent, torch.Tensor]]:
    """A file tier on a real POSIX agent that faults can be injected into."""
    require_nixl()
    cache = torch.randint(0, 256, (8, 4096), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(11))
    agent = FaultyAgent(make_agent(f"tier-outcomes-{next(_agent_names)}", "POSIX"))
    tier = FileTier(cache, tmp_path / "blocks", agent=agent, durable=False)
    yield tier, agent, cache
    tier.shutdown(timeout=30)
    assert tier.closed
    assert agent.misuses == [], agent.misuses


@pytest.mark.nixl
def test_a_cleanup_that_leaks_on_real_nixl_still_publishes_the_success(
    real_files: tuple[FileTier, FaultyAgent, torch.Tensor], caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvfsm")
    tier, agent, cache = real_files
    agent.inject("release_dlist_handle", Raise())
    agent.inject("deregister_memory", Raise())
    tier.submit_store(TransferJob(1, KEYS, [0, 1]))
    result = results_of(tier, 1, timeout=30)[1]
    assert (result.success, result.reason) == (True, None)
    assert result.transfer_size == 2 * cache[0].nbytes
    for key, block in zip(KEYS, (0, 1), strict=True):
        assert tier.path_of(key).read_bytes() == cache[block].numpy().tobytes()
        assert tier.lookup(key) is Lookup.HIT
    stats = tier.stats()
    assert stats["leaks"] == 2
    assert stats["leaked"] == [(1, Leak("release_dlist_handle", BACKEND)),
                               (1, Leak("deregister_memory", BACKEND))]
    assert (stats["failed"], stats["quarantined"]) == (0, 0)
    assert stats["latency"]["p50"] == result.transfer_time > 0
    assert logged(caplog, logging.WARNING, 1, "leak", "release_dlist_handle", BACKEND) == 1
    assert logged(caplog, logging.WARNING, 1, "leak", "deregister_memory", BACKEND) == 1
    assert logged(caplog, logging.WARNING, 1) == 2, "a line for each leak, and nothing else"

    cache[2:4] = 0  # the leak cost nothing: the blocks load back whole
    tier.submit_load(TransferJob(2, KEYS, [2, 3], is_promotion=True))
    assert results_of(tier, 1, timeout=30)[2].success
    assert torch.equal(cache[2:4], cache[0:2])
    assert tier.stats()["leaks"] == 2


@pytest.mark.nixl
def test_f11_on_real_nixl_a_failed_load_is_a_miss_though_the_file_is_there(
    real_files: tuple[FileTier, FaultyAgent, torch.Tensor],
) -> None:
    tier, agent, cache = real_files
    original = cache[0].clone()
    stored(tier, 1, KEYS[:1], [0])
    agent.inject("check_xfer_state", Raise())  # answered once NIXL finished reading
    tier.submit_load(TransferJob(2, KEYS[:1], [5], is_promotion=True))
    result = results_of(tier, 1, timeout=30)[2]
    assert result.success is False and result.reason is not None
    assert (result.reason.kind, result.reason.call) == (FailureKind.RAISED, "check_xfer_state")
    assert tier.path_of(KEYS[0]).exists(), "the file is whole on disk..."
    assert tier.lookup(KEYS[0]) is Lookup.MISS, "...but the tier no longer offers it"
    assert tier.stats()["failed"] == 1

    stored(tier, 3, KEYS[:1], [0])
    assert tier.lookup(KEYS[0]) is Lookup.HIT
    cache[5] = 0
    tier.submit_load(TransferJob(4, KEYS[:1], [5], is_promotion=True))
    assert results_of(tier, 1, timeout=30)[4].success
    assert torch.equal(cache[5], original)

