"""Back-pressure: a tier with an :class:`~kvfsm.policy.InFlightLimit` refuses a store past its
bound on jobs or bytes in flight (nothing registered, no result), lets loads through, says so
beforehand (``saturated``) and in its stats; the tiering manager does not cascade to a saturated
tier, so a slow tier cannot pile up pins on the primary."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
import torch

from kvfsm import TransferJob
from kvfsm.machines.transfer import FailureKind
from kvfsm.policy import InFlightLimit, RetryPolicy
from kvfsm.testing import FakeNixlAgent, FakeNixlError, ReturnErr
from kvfsm.tiering import CPUPrimaryTier, TieringDrainTimeout, TieringManager
from kvfsm.tiers import FileTier, Lookup, ObjectStoreTier, TierSaturatedError
from kvfsm.tiers.base import KnownNames

from .test_poll_schedule import Held
from .test_tiering import BLOCK_BYTES, DictTier, InterruptedAfterPost, content, write

BLOCKS = 16


def tier_on(agent: FakeNixlAgent, **limit: Any) -> ObjectStoreTier:
    primary = torch.arange(BLOCKS * 64, dtype=torch.float32).view(BLOCKS, 64)  # 256 B a block
    return ObjectStoreTier(primary, agent=agent, in_flight=InFlightLimit(**limit))


def store(tier: ObjectStoreTier, job_id: int, *blocks: int) -> None:
    tier.submit_store(TransferJob(job_id, [f"block-{b}" for b in blocks], list(blocks)))


def test_a_store_past_the_jobs_bound_is_refused_and_changes_nothing() -> None:
    agent = Held()
    tier = tier_on(agent, jobs=3)
    for job_id in range(3):
        store(tier, job_id, job_id)
    assert tier.saturated()
    calls = len(agent.calls)

    with pytest.raises(TierSaturatedError, match=r"store job 3 \(256 bytes\) refused: 3 job\(s\) "
                       r"and 768 bytes in flight, bound 3 job\(s\)"):
        store(tier, 3, 3)

    assert len(agent.calls) == calls  # not one NIXL call for it
    assert tier.state_of(3) is None and tier.transfer_of(3) is None
    assert tier.stats()["in_flight_limit"] == {"jobs": 3, "bytes": 768, "max_jobs": 3,
                                               "max_bytes": None, "stores_refused": 1}
    # the three run on and end; none of the results is job 3's
    agent.held.clear()
    tier.drain_jobs(timeout=5)
    assert sorted(r.job_id for r in tier.get_finished_jobs()) == [0, 1, 2]
    assert not tier.saturated()
    store(tier, 3, 3)  # room again: the same job is taken now
    agent.held.clear()
    tier.drain_jobs(timeout=5)
    assert [r.job_id for r in tier.get_finished_jobs()] == [3]
    tier.shutdown(timeout=5)
    assert agent.live_xfer_handles() == 0


def test_stores_given_up_while_nixl_runs_them_still_take_their_room() -> None:
    """A disk that hangs: two stores run past the running bound and are published as given
    up, and NIXL may still run them (a file tier's files stay open, their blocks in use).
    They keep counting against the bound, so a third is refused and the tier reads as
    saturated: the manager goes elsewhere. (They stopped counting: a tier bounded to 2 jobs
    took a store every step its disk hung, 283 open files in 2 s.)"""
    agent = Held()
    primary = torch.arange(BLOCKS * 64, dtype=torch.float32).view(BLOCKS, 64)
    tier = ObjectStoreTier(primary, agent=agent, in_flight=InFlightLimit(jobs=2),
                           policy=RetryPolicy(max_running_seconds=0.01))
    store(tier, 1, 1)
    store(tier, 2, 2)
    time.sleep(0.02)
    given_up = tier.get_finished_jobs()
    assert [(r.job_id, r.success, r.blocks_in_use) for r in given_up] == [
        (1, False, True), (2, False, True)]
    assert tier.saturated()
    with pytest.raises(TierSaturatedError, match=r"store job 3 \(256 bytes\) refused: 2 job\(s\) "
                       r"and 512 bytes in flight, bound 2 job\(s\)"):
        store(tier, 3, 3)
    assert tier.stats()["in_flight_limit"] == {"jobs": 2, "bytes": 512, "max_jobs": 2,
                                               "max_bytes": None, "stores_refused": 1}
    agent.held.clear()  # NIXL ends them; only the exit asks of them again
    assert tier.saturated()
    tier.shutdown(timeout=5)


def test_a_store_given_up_that_nixl_then_ended_and_was_released_takes_no_room() -> None:
    """A lifecycle whose running bound gives up softly: past it a store waits in OVERDUE for
    NIXL's end, then is released and published as usual. Once released it holds nothing: the
    bound has room again, a store of its key vouches for it, and shutdown lets the cache go.
    (It stayed among those NIXL may run: the tier refused every store, the key stayed a MISS,
    and shutdown kept the cache registered.)"""
    from kvfsm import TRANSFER_MACHINE  # noqa: PLC0415

    soft = TRANSFER_MACHINE.extend(
        "soft_give_up", states=["OVERDUE"],
        replace={("PROCESSING", "poll", "exhausted"): {"dest": "OVERDUE",
                                                       "after": "latch_failure"}},
        transitions=[
            {"trigger": "poll", "source": "OVERDUE", "dest": "OVERDUE", "conditions": "running"},
            {"trigger": "poll", "source": "OVERDUE", "dest": "FAILED", "conditions": "finished",
             "after": "note_ended"},
            {"trigger": "poll", "source": "OVERDUE", "dest": "FAILED", "conditions": "errored",
             "after": ["note_ended", "note_error"]},
            {"trigger": "poll", "source": "OVERDUE", "dest": "QUARANTINED",
             "conditions": "exhausted", "after": "quarantine"},
            {"trigger": "cancel", "source": "OVERDUE", "dest": "OVERDUE"}],
        effects={"OVERDUE": "poll"}, running=["OVERDUE"], failure_states=["OVERDUE"])
    agent = Held()
    primary = torch.arange(BLOCKS * 64, dtype=torch.float32).view(BLOCKS, 64)
    tier = ObjectStoreTier(primary, agent=agent, machine=soft, in_flight=InFlightLimit(jobs=1),
                           policy=RetryPolicy(max_running_seconds=0.01))
    store(tier, 1, 1)
    time.sleep(0.02)
    tier.get_finished_jobs()
    assert tier.state_of(1) is not None and tier.state_of(1).name == "OVERDUE"
    agent.held.clear()  # NIXL ends it
    tier.drain_jobs(timeout=5)
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
    assert agent.live_xfer_handles() == 0
    assert tier.in_flight_figures()["jobs"] == 0 and not tier.saturated()
    assert tier.stats()["quarantined_running"] == 0  # nothing NIXL may still run
    store(tier, 2, 1)  # the same key again
    agent.held.clear()
    tier.drain_jobs(timeout=5)
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(2, True)]
    assert tier.lookup("block-1") is Lookup.HIT  # (it stayed doubted for good)
    tier.shutdown(timeout=5)
    assert agent.live_registrations() == 0  # (the cache stayed registered)


def test_loads_go_first_they_are_never_refused_and_take_the_room_of_stores() -> None:
    agent = Held()
    tier = tier_on(agent, jobs=2)
    store(tier, 0, 0)
    store(tier, 1, 1)
    agent.held.clear()
    tier.drain_jobs(timeout=5)
    assert [r.success for r in tier.get_finished_jobs()] == [True, True]

    for job_id, block in ((10, 0), (11, 1), (12, 0)):  # three loads, past the bound of two
        tier.submit_load(TransferJob(job_id + 100, [f"block-{block}"], [job_id - 8],
                                     is_promotion=True))
    assert tier.stats()["in_flight_limit"]["jobs"] == 3
    assert tier.saturated()
    with pytest.raises(TierSaturatedError):
        store(tier, 20, 5)
    agent.held.clear()
    tier.drain_jobs(timeout=5)
    assert all(r.success for r in tier.get_finished_jobs())
    tier.shutdown(timeout=5)


def test_the_bytes_bound_counts_the_store_asked_for() -> None:
    agent = Held()
    tier = tier_on(agent, bytes=3 * 256)
    assert tier.saturated(4 * 256) and not tier.saturated(3 * 256)
    with pytest.raises(TierSaturatedError):  # larger than the bound: refused even when idle
        store(tier, 0, 0, 1, 2, 3)
    store(tier, 1, 0, 1)
    with pytest.raises(TierSaturatedError):
        store(tier, 2, 2, 3)
    store(tier, 3, 2)
    assert tier.stats()["in_flight_limit"] == {"jobs": 2, "bytes": 768, "max_jobs": None,
                                               "max_bytes": 768, "stores_refused": 2}
    agent.held.clear()
    tier.drain_jobs(timeout=5)
    assert sorted(r.job_id for r in tier.get_finished_jobs()) == [1, 3]
    assert tier.stats()["in_flight_limit"]["bytes"] == 0
    tier.shutdown(timeout=5)


def test_a_refused_store_leaves_what_the_tier_holds_as_it_was() -> None:
    agent = Held()
    tier = tier_on(agent, jobs=1)
    store(tier, 0, 0)
    agent.held.clear()
    tier.drain_jobs(timeout=5)
    tier.get_finished_jobs()
    assert tier.lookup("block-0") is Lookup.HIT
    store(tier, 1, 1)  # runs on: the tier is saturated
    with pytest.raises(TierSaturatedError):
        store(tier, 2, 0)  # block-0 again: refused, and block-0 stays HIT
    assert tier.lookup("block-0") is Lookup.HIT
    agent.held.clear()
    tier.drain_jobs(timeout=5)
    tier.shutdown(timeout=5)


@pytest.mark.parametrize(("fields", "words"), [
    ({"jobs": 0}, "InFlightLimit.jobs must be a positive int or None, got 0"),
    ({"jobs": True}, "InFlightLimit.jobs must be a positive int or None, got True (bool)"),
    ({"bytes": 1.5}, "InFlightLimit.bytes must be a positive int or None, got 1.5"),
    ({"bytes": -4}, "InFlightLimit.bytes must be a positive int or None, got -4"),
])
def test_a_bad_bound_is_refused_naming_it(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as refused:
        InFlightLimit(**fields)
    assert str(refused.value) == words


def test_a_tier_given_something_else_than_a_bound_is_refused_before_any_agent() -> None:
    primary = torch.zeros((4, 64), dtype=torch.float32)
    agent = FakeNixlAgent("unused")
    with pytest.raises(ValueError, match="in_flight must be an InFlightLimit or None, got dict"):
        ObjectStoreTier(primary, agent=agent, in_flight={"jobs": 4})  # type: ignore[arg-type]
    assert agent.calls == []


def test_the_manager_does_not_cascade_to_a_saturated_tier_so_pins_stay_bounded() -> None:
    """A tier ten times slower than the stores come: without a bound its jobs and the pins
    they hold grow with every step; with one they stay at the bound, and the fast tier gets
    every store."""

    def run(limit: InFlightLimit | None) -> tuple[int, dict[str, Any]]:
        primary = CPUPrimaryTier(400, BLOCK_BYTES, torch.uint8)
        slow_agent = Held()
        slow = ObjectStoreTier(primary.cache, agent=slow_agent, in_flight=limit)
        manager = TieringManager(primary, {"fast": DictTier(primary.cache), "slow": slow})
        most_pinned = 0
        for step in range(300):  # a store a step; the slow tier ends one job in ten steps
            (block,) = write(primary, f"key-{step}")
            manager.store([block])
            if step % 10 == 0:
                running = [h for h in slow_agent.posted if id(h) in slow_agent.held]
                if running:
                    slow_agent.held.discard(id(running[0]))
            manager.step()
            most_pinned = max(most_pinned, primary.stats()["pinned"])
        stats = manager.stats()
        slow_agent.held.clear()
        manager.shutdown(timeout=10)
        assert primary.stats()["pinned"] == 0
        return most_pinned, stats

    unbounded, _ = run(None)
    bounded, stats = run(InFlightLimit(jobs=8))
    assert unbounded > 250  # every store still waits on the slow tier
    assert bounded <= 8
    # the fast tier took all 300; the slow one what was not skipped (8 still running)
    taken_by_slow = 300 - stats["stores_skipped"]["slow"]
    assert stats["outstanding"] == {"fast": 0, "slow": 8}
    assert stats["stores_ok"] + 8 == 300 + taken_by_slow
    assert stats["stores_skipped"] == {"fast": 0, "slow": stats["stores_skipped"]["slow"]}
    assert stats["stores_skipped"]["slow"] > 250


def test_the_manager_skips_a_tier_deleting_the_block_it_is_asked_to_store_again() -> None:
    """An object store evicted key-a and its delete is still in flight when the engine stores
    key-a again: that tier refuses the job as busy, so the manager skips it (no pin kept, no
    error to the engine) and the other tier takes it; once the delete is answered, the next
    store of key-a goes to both."""
    sent, gate = threading.Event(), threading.Event()
    agent = FakeNixlAgent()

    def slow_remove(names: list[str]) -> int:
        sent.set()
        gate.wait()  # (the test sets it, finally too)
        return agent.remove_objects(names)

    primary = CPUPrimaryTier(8, BLOCK_BYTES, torch.uint8)
    objects = ObjectStoreTier(primary.cache, agent=agent, capacity_bytes=BLOCK_BYTES,
                              remove=slow_remove)
    manager = TieringManager(primary, {"fast": DictTier(primary.cache), "objects": objects})
    try:
        (a,) = write(primary, "key-a")
        (b,) = write(primary, "key-b")
        for block in (a, b):  # key-b's store evicts key-a: its delete is sent, held
            assert len(manager.store([block])) == 2
            while manager.has_pending_work():
                manager.step()
        assert sent.wait(10)

        assert len(manager.store([a])) == 1  # the fast tier's job only
        assert manager.stats()["stores_skipped"] == {"fast": 0, "objects": 1}
        while manager.has_pending_work():
            manager.step()
        assert primary.stats()["pinned"] == 0

        gate.set()
        assert objects.wait_for_removals(10)
        assert objects.object_key("key-a") not in agent.objects
        assert len(manager.store([a])) == 2
        while manager.has_pending_work():
            manager.step()
        assert objects.object_key("key-a") in agent.objects
        assert objects.lookup("key-a") is Lookup.HIT
        assert primary.stats()["pinned"] == 0
    finally:
        gate.set()
        manager.shutdown(timeout=10)



def test_a_key_written_again_is_not_loaded_with_the_bytes_a_skipped_tier_still_holds() -> None:
    """The engine stored seq0/blk0, freed it, wrote new bytes under the same key and stored
    them while the object store was saturated: the store skipped that tier, which still held
    the first bytes as a HIT, and a later load published them as a success. The skipped tier
    forgets the key now: the load finds nothing until the new bytes are stored there."""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    agent = Held()
    tier = ObjectStoreTier(primary.cache, agent=agent, in_flight=InFlightLimit(jobs=1))
    manager = TieringManager(primary, {"objects": tier})

    def settle() -> list[Any]:
        agent.held.clear()
        return manager.drain(timeout=5)

    def write_as(key: str, version: str) -> int:
        (block,) = primary.allocate([key])
        primary.cache[block] = content(version)
        primary.complete_write([block], success=True)
        return block

    first = write_as("seq0/blk0", "first bytes")
    assert len(manager.store([first])) == 1
    settle()
    assert tier.lookup("seq0/blk0") is Lookup.HIT
    primary.free([first])  # the sequence ends; the key is free to be written again
    second = write_as("seq0/blk0", "second bytes")
    manager.store([write_as("other", "other bytes")])  # in flight: the tier is saturated
    assert manager.store([second]) == []
    assert manager.stats()["stores_skipped"] == {"objects": 1}
    assert tier.lookup("seq0/blk0") is Lookup.MISS, "the old copy is not vouched for"
    settle()
    primary.free([second])
    assert manager.load(["seq0/blk0"]) is None  # (it loaded the first bytes as a success)
    named = manager.load(["seq0/blk0"], tier="objects")  # no lookup asked: still not loaded
    [refused] = settle()
    assert (refused.job_id, refused.success) == (named, False)
    assert refused.reason is not None and refused.reason.error_type == "ForgottenKeyError"
    assert "forgot 'seq0/blk0'" in refused.reason.error
    assert primary.stats()["pinned"] == 0 and primary.block_of("seq0/blk0") is None

    again = write_as("seq0/blk0", "second bytes")  # stored once there is room: found again
    assert len(manager.store([again])) == 1
    settle()
    primary.free([again])
    assert manager.load(["seq0/blk0"]) is not None
    [loaded] = settle()
    assert loaded.success
    assert torch.equal(primary.cache[loaded.job.block_ids[0]], content("second bytes"))
    manager.shutdown(timeout=5)


@pytest.mark.parametrize("took", [True, False], ids=["first tier took it", "before its pin"])
def test_a_store_interrupted_in_its_cascade_leaves_no_tier_vouching_for_the_old_bytes(
        took: bool, tmp_path: Any) -> None:
    """The engine stored "k" to both tiers, then wrote new bytes under it and stored them;
    a Ctrl-C landed in the first tier's submit, once NIXL had the transfer (or before its
    pin), and store() raised it before the second tier was reached: that tier got no job and
    was not told to forget, so it still answered HIT, and the next load published the first
    bytes as a success. Every tier without its job now forgets the keys before the interrupt
    goes on; the first tier's store, which NIXL went on with, is the one a load finds."""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    first_agent = InterruptedAfterPost("first")
    tiers = {"first": FileTier(primary.cache, str(tmp_path / "a"), agent=first_agent,
                               durable=False),
             "second": FileTier(primary.cache, str(tmp_path / "b"),
                                agent=FakeNixlAgent("second"), durable=False)}
    manager = TieringManager(primary, tiers)
    (block,) = write(primary, "k")  # the first bytes
    manager.store([block])
    assert all(done.success for done in manager.drain(timeout=5))
    primary.free([block])
    (block,) = primary.allocate(["k"])
    primary.cache[block] = content("the second bytes")
    primary.complete_write([block], success=True)
    if took:
        first_agent.armed = True
    else:
        def interrupted(blocks: Any) -> None:
            raise KeyboardInterrupt
        primary.pin = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        manager.store([block])
    if not took:
        del primary.pin
    assert [done.success for done in manager.drain(timeout=5)] == ([True] if took else [])
    assert [tier.lookup("k") for tier in tiers.values()] == [
        Lookup.HIT if took else Lookup.MISS, Lookup.MISS]
    primary.free([block])
    job = manager.load(["k"])
    if took:  # from the first tier: the second bytes
        [loaded] = manager.drain(timeout=5)
        assert (loaded.job_id, loaded.tier, loaded.success) == (job, "first", True)
        assert torch.equal(primary.cache[loaded.job.block_ids[0]], content("the second bytes"))
    else:
        assert job is None, "no tier may load the first bytes as the second"
    manager.shutdown(timeout=5)


class BrokenSaturated(ObjectStoreTier):
    """A tier whose saturated() raises an ordinary error."""

    def saturated(self, nbytes: int = 0) -> bool:
        raise RuntimeError("saturated() raised")


class InterruptedInForget(ObjectStoreTier):
    """A tier whose forget is where a Ctrl-C lands."""

    def forget(self, keys: Any) -> None:
        super().forget(keys)
        raise KeyboardInterrupt


def test_a_ctrl_c_landing_in_a_forget_after_a_tier_raised_is_not_swallowed() -> None:
    """A tier's saturated() raised, so every tier without its job is told to forget the keys;
    a Ctrl-C lands in one of those forgets. It goes on (the error it replaced is its cause):
    it was dropped, and the caller carried on as if no Ctrl-C had come."""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    last = ObjectStoreTier(primary.cache, agent=FakeNixlAgent("last"))
    manager = TieringManager(primary, {
        "broken": BrokenSaturated(primary.cache, agent=FakeNixlAgent("broken")),
        "interrupted": InterruptedInForget(primary.cache, agent=FakeNixlAgent("interrupted")),
        "last": last})
    (block,) = write(primary, "k")
    with pytest.raises(KeyboardInterrupt) as raised:
        manager.store([block])
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert last.verdict("k") is Lookup.MISS, "the tiers after it forgot all the same"
    manager.shutdown(timeout=5)


class StallingRelease(FakeNixlAgent):
    """Each release stalls 0.3 s, then raises (a retry is due at the next poll): a poll of a
    tier with a transfer over takes that long."""

    def __init__(self, name: str) -> None:
        super().__init__(name, complete_after_polls=0)
        self.releases = 0
        self.mended = False

    def release_xfer_handle(self, handle: Any) -> None:
        if self.mended:
            return super().release_xfer_handle(handle)
        self.releases += 1
        time.sleep(0.3)
        raise FakeNixlError("NIXL_ERR_BACKEND")


def test_a_manager_drain_polls_each_tier_once_at_most_past_its_deadline() -> None:
    """Three tiers, each with a store over whose release stalls and raises: a drain of 0.1 s
    finishes the step under way at its deadline, one poll of each tier (so a short bound
    still finds every tier's finished jobs), and begins no other. The manager's shutdown
    drains so too, then each tier's shutdown makes the poll under way at its deadline (past
    already) and its one last try: three calls a tier, and the three jobs fail, quarantined."""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    agents = [StallingRelease(f"stalling-{index}") for index in range(3)]
    manager = TieringManager(primary, {
        f"t{index}": ObjectStoreTier(primary.cache, agent=agent,
                                     policy=RetryPolicy(max_seconds=None))
        for index, agent in enumerate(agents)})
    (block,) = write(primary, "k")
    assert len(manager.store([block])) == 3  # each release raised once at its submit
    before = [agent.releases for agent in agents]
    with pytest.raises(TieringDrainTimeout):
        manager.drain(timeout=0.1)
    assert [agent.releases - was for agent, was in zip(agents, before, strict=True)] == [
        1, 1, 1], "one poll of each tier, no more"
    before = [agent.releases for agent in agents]
    finalized = manager.shutdown(timeout=0.1)
    assert [agent.releases - was for agent, was in zip(agents, before, strict=True)] == [
        3, 3, 3], "the drain's poll, then the tier shutdown's poll and last try, no more"
    assert [(done.success, done.reason and done.reason.kind) for done in finalized] == [
        (False, FailureKind.QUARANTINED)] * 3
    assert primary.stats()["pinned"] == 0 and manager.closed


class SaturatedForgetting(DictTier):
    """A user's tier that is always saturated and whose ``forget`` raises."""

    def saturated(self, nbytes: int = 0) -> bool:
        return True

    def forget(self, keys: Any) -> None:
        raise RuntimeError("forget is broken")


def test_a_tier_whose_forget_raises_is_logged_and_the_others_keep_their_jobs(
        caplog: pytest.LogCaptureFixture) -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"fast": DictTier(primary.cache),
                                       "broken": SaturatedForgetting(primary.cache)})
    (block,) = write(primary, "key-a")
    [job_id] = manager.store([block])
    assert manager.stats()["stores_skipped"] == {"fast": 0, "broken": 1}
    assert "tier broken: forget() raised" in caplog.text
    assert [done.job_id for done in manager.drain(timeout=5)] == [job_id]
    assert primary.stats()["pinned"] == 0
    manager.shutdown(timeout=5)


def test_forget_makes_a_held_block_a_miss_until_it_is_stored_again() -> None:
    """``forget`` answers MISS for blocks the tier holds, within a capacity too (whose books
    still count the old copy), and a later store makes them HIT; a bad key forgets nothing."""
    agent = FakeNixlAgent("forget")
    primary = torch.zeros((4, 64), dtype=torch.uint8)
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=4 * 64,
                           remove=agent.remove_objects)
    tier.submit_store(TransferJob(1, ["a", "b"], [0, 1]))
    tier.drain_jobs(timeout=5)
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    with pytest.raises(ValueError):
        tier.forget(["a", ""])
    assert (tier.lookup("a"), tier.lookup("b")) == (Lookup.HIT, Lookup.HIT)
    tier.forget(["a"])
    assert (tier.lookup("a"), tier.verdict("a"), tier.lookup("b")) == (
        Lookup.MISS, Lookup.MISS, Lookup.HIT)
    tier.submit_store(TransferJob(2, ["a"], [2]))
    tier.drain_jobs(timeout=5)
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    assert tier.lookup("a") is Lookup.HIT
    tier.shutdown(timeout=5)


class SmallCache(ObjectStoreTier):
    """An object store tier whose lookup cache keeps the verdicts on four names."""

    known_names = 4


class SmallFileCache(FileTier):
    """A file tier whose lookup cache keeps the verdicts on four names."""

    known_names = 4


def settled(tier: Any, key: str) -> Lookup:
    """The tier's answer once its probe (an object store's, on a thread) is in."""
    deadline = time.monotonic() + 5
    while (answer := tier.lookup(key)) is Lookup.RETRY and time.monotonic() < deadline:
        time.sleep(0.005)
    return answer


@pytest.mark.parametrize("kind", ["objects", "files"])
def test_a_forgotten_key_stays_a_miss_after_its_verdict_left_the_lookup_cache(
        kind: str, tmp_path: Any) -> None:
    """The engine made a tier forget key "a" (it holds other bytes now than the tier's copy).
    Stores of other keys then push the MISS out of the lookup cache, which keeps four names:
    a probe finds the old copy all the same, and it must not bring it back as a HIT (a load
    would publish the old bytes as a success). A load of "a" submitted all the same fails
    without a NIXL call, saying why; the next store of "a" makes it a HIT again, and loadable.
    Only the last four keys forgotten are kept so: the tier's memory stays bounded."""
    agent = FakeNixlAgent(f"forgotten-{kind}")
    primary = torch.zeros((16, 64), dtype=torch.uint8)
    tier = (SmallCache(primary, agent=agent) if kind == "objects"
            else SmallFileCache(primary, str(tmp_path), agent=agent))
    job_ids = itertools.count()

    def run(keys: list[str], blocks: list[int], load: bool = False) -> bool:
        job = TransferJob(next(job_ids), keys, blocks, is_promotion=load)
        (tier.submit_load if load else tier.submit_store)(job)
        tier.drain_jobs(timeout=5)
        results = tier.get_finished_jobs()
        failed.extend(result for result in results if not result.success)
        return all(result.success for result in results)

    failed: list[Any] = []

    primary[0] = 1
    assert run(["a"], [0])
    assert settled(tier, "a") is Lookup.HIT
    tier.forget(["a"])
    for index in range(1, 9):  # eight verdicts: the cache of four keeps none of "a"'s
        assert run([f"other{index}"], [index])
    assert settled(tier, "a") is Lookup.MISS, "the old copy was found and vouched for"
    assert tier.verdict("a") is Lookup.MISS
    made = len(agent.calls)
    assert not run(["a", "other8"], [9, 8], load=True)  # the old copy: not the engine's bytes
    assert agent.calls[made:] == [], "no NIXL call for a load of a forgotten key"
    (reason,) = [result.reason for result in failed]
    assert (reason.call, reason.error_type) == ("open", "ForgottenKeyError")
    assert "the tier forgot 'a' (a store failed, or it was told to forget" in reason.error
    assert not torch.equal(primary[9], primary[0]), "nothing was read into the block"
    assert settled(tier, "a") is Lookup.MISS
    primary[10] = 2
    assert run(["a"], [10])
    assert settled(tier, "a") is Lookup.HIT
    assert run(["a"], [11], load=True)
    assert torch.equal(primary[11], primary[10])

    tier.forget([f"other{index}" for index in range(1, 6)])  # five: "other1" goes first
    for index in range(12, 16):
        assert run([f"fill{index}"], [index])
    assert settled(tier, "other1") is Lookup.HIT, "only the last four forgotten are kept"
    assert settled(tier, "other5") is Lookup.MISS
    tier.shutdown(timeout=5)


def test_a_probe_answering_after_its_key_was_forgotten_does_not_bring_the_copy_back() -> None:
    """A probe sent before the key was forgotten finds the old copy and answers once the
    forget's MISS has left the lookup cache: its HIT is not taken."""
    known = KnownNames(2)
    known.forget(["a"])
    known.record(["b", "c", "d"], Lookup.HIT)  # the cache keeps two verdicts: none of "a"
    known.offer("a", Lookup.HIT)
    assert known.get("a") is Lookup.MISS
    known.record(["a"], Lookup.HIT)  # a store of it succeeded
    assert known.get("a") is Lookup.HIT


def test_a_key_a_store_may_still_land_on_stays_a_miss_past_the_limit_on_the_forgotten() -> None:
    """A store of "a" was cancelled while NIXL ran it (its copy may still land): the lookup
    cache doubts "a". The engine then has the tier forget more keys than the cache keeps
    forgotten, so "a" leaves the forgotten: it stays a MISS all the same, to a lookup, a
    probe's HIT and a later store's HIT, and a load of it is refused, until the cancelled
    store is over. (Pushed out of the forgotten, "a" was asked of the store again and vouched
    for.)"""
    known = KnownNames(2)
    known.forget(["a"])
    known.doubt(7, ["a"])
    known.forget(["b", "c", "d"])  # the last two forgotten are kept: not "a"
    known.record(["e", "f", "g"], Lookup.HIT)  # nor its verdict
    assert known.get("a") is Lookup.MISS
    known.offer("a", Lookup.HIT)
    assert known.get("a") is Lookup.MISS, "a probe's HIT taken"
    known.record(["a"], Lookup.HIT)
    assert known.get("a") is Lookup.MISS, "a later store vouched for it"
    assert known.stale(["a", "e"]) == ["a"], "a load of it is not refused"
    known.undoubt(7)
    known.record(["a"], Lookup.HIT)  # the cancelled store is over: a store of it vouches
    assert (known.get("a"), known.stale(["a"])) == (Lookup.HIT, [])


@pytest.mark.parametrize("kind", ["objects", "files"])
def test_a_key_whose_store_failed_stays_a_miss_after_its_verdict_left_the_lookup_cache(
        kind: str, tmp_path: Any) -> None:
    """The engine stored "k", then wrote other bytes under it, and their store failed (NIXL
    answered ERR): the tier still holds the first copy. Stores of other keys push the failed
    store's MISS out of a lookup cache of four names; a probe finds the first copy, and must
    not make it a HIT (a load would publish the first bytes as the second's)."""
    agent = FakeNixlAgent(f"failed-store-{kind}")
    primary = torch.zeros((16, 64), dtype=torch.uint8)
    tier = (SmallCache(primary, agent=agent) if kind == "objects"
            else SmallFileCache(primary, str(tmp_path), agent=agent))
    job_ids = itertools.count()

    def stored(keys: list[str], blocks: list[int]) -> bool:
        tier.submit_store(TransferJob(next(job_ids), keys, blocks))
        tier.drain_jobs(timeout=5)
        return all(result.success for result in tier.get_finished_jobs())

    primary[0] = 1
    assert stored(["k"], [0])
    primary[1] = 2  # the engine's new bytes under "k"
    agent.inject("check_xfer_state", ReturnErr(), times=1)
    assert not stored(["k"], [1])
    for index in range(2, 10):
        assert stored([f"other{index}"], [index])
    assert settled(tier, "k") is Lookup.MISS, "the first copy was found and vouched for"
    assert stored(["k"], [1])
    assert settled(tier, "k") is Lookup.HIT
    tier.shutdown(timeout=5)


@pytest.mark.parametrize("keys", ["abc", b"abc", None, 3], ids=["a str", "bytes", "None",
                                                                "an int"])
def test_forget_or_touch_given_one_key_or_no_list_is_refused_and_changes_nothing(
        keys: Any) -> None:
    """``forget("abc")`` once forgot the keys "a", "b" and "c" (one of them held, a MISS
    from then on) and left "abc" found; None met a TypeError. Each is refused by name, and
    every key answers as before."""
    tier = ObjectStoreTier(torch.zeros(4, 64, dtype=torch.uint8),
                           agent=FakeNixlAgent(complete_after_polls=0),
                           capacity_bytes=4 * 64, remove=lambda names: 0)
    tier.submit_store(TransferJob(1, ["a", "abc"], [0, 1]))
    tier.drain_jobs(5)
    assert [result.success for result in tier.get_finished_jobs()] == [True]
    for call in (tier.forget, tier.touch):
        with pytest.raises(ValueError, match=f"{call.__name__}: keys must be a list or tuple "
                                             "of keys .*nothing changed"):
            call(keys)
    assert (tier.lookup("a"), tier.lookup("abc")) == (Lookup.HIT, Lookup.HIT)
    tier.forget(["a"])
    assert (tier.lookup("a"), tier.lookup("abc")) == (Lookup.MISS, Lookup.HIT)
    tier.shutdown(5)


@pytest.mark.parametrize("nbytes", ["x", -1, 1.5, True, None])
def test_saturated_asked_about_what_is_no_byte_count_says_so(nbytes: Any) -> None:
    """With no bound on bytes it used to answer False to anything; with one, raise a
    TypeError from inside."""
    for limit in (InFlightLimit(jobs=4), InFlightLimit(bytes=4 * 64)):
        tier = ObjectStoreTier(torch.zeros(4, 64, dtype=torch.uint8), agent=FakeNixlAgent(),
                               in_flight=limit)
        with pytest.raises(ValueError, match="saturated: nbytes must be an int >= 0, got"):
            tier.saturated(nbytes)
        assert not tier.saturated(64)
        tier.shutdown(5)
