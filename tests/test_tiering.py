"""The parent and the primary tier: pins, cascades, promotions, eviction, bookkeeping, faults.

Most stories run on two object-store tiers over two fake NIXL agents (the fake has no FILE
backend), moving real bytes between the primary cache and the fake object stores. The last ones
run the same cascade and promotion on real NIXL: an object store against a local S3 server, and
files on the POSIX backend.
"""

from __future__ import annotations

import re
import threading
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvfsm import JobResult, TransferJob
from kvfsm.machines.transfer import FailureKind
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, Fault, Raise, ReturnErr, StayProc
from kvfsm.tiering import (
    BlockStateError,
    BookkeepingError,
    CPUPrimaryTier,
    DuplicateKeyError,
    Finalized,
    ManagerClosedError,
    OffloadTier,
    OutOfBlocksError,
    PrimaryTierError,
    TieringDrainTimeout,
    TieringInputError,
    TieringManager,
    TierSubmitError,
    UnknownBlockError,
)
from kvfsm.tiers import FileTier, Lookup, ObjectStoreTier, TierClosedError

from .real_nixl import S3Server, require_nixl, s3_server

__all__ = ["s3_server"]  # a fixture, imported for pytest

NUM_BLOCKS = 8
BLOCK_BYTES = 256
TIER_NAMES = ("first", "second")


# -- helpers -------------------------------------------------------------------------------------

def content(key: str, nbytes: int = BLOCK_BYTES) -> torch.Tensor:
    """The bytes the engine computed for ``key``: random, but the same on every call."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def write(primary: CPUPrimaryTier, *keys: str) -> list[int]:
    """What the engine does with new KV blocks: allocate, fill, mark ready."""
    blocks = primary.allocate(list(keys))
    for key, block in zip(keys, blocks, strict=True):
        primary.cache[block] = content(key, primary.block_bytes)
    primary.complete_write(blocks, success=True)
    return blocks


def holds(primary: CPUPrimaryTier, key: str) -> bool:
    """Whether a ready block holds ``key`` with exactly its bytes."""
    block = primary.block_of(key)
    return (block is not None and primary.is_ready(block)
            and torch.equal(primary.cache[block], content(key, primary.block_bytes)))


def snapshot(primary: CPUPrimaryTier) -> tuple[object, ...]:
    """Everything the primary tier's books say."""
    blocks = range(primary.num_blocks)
    return (tuple(primary.pin_count(b) for b in blocks), tuple(primary.key_of(b) for b in blocks),
            tuple(primary.evictable()), primary.stats())


def ids(finalized: list[Finalized]) -> list[tuple[int, str, bool]]:
    return [(done.job_id, done.tier, done.success) for done in finalized]


@dataclass
class Stack:
    """A primary tier, and a manager over object-store tiers on fake agents, one per name."""

    primary: CPUPrimaryTier
    manager: TieringManager
    tiers: dict[str, ObjectStoreTier]
    agents: dict[str, FakeNixlAgent]
    probes: list[FakeNixlAgent] = field(default_factory=list)

    def close(self) -> None:
        """Shut down; no NIXL misuse, no pin, no block left half written."""
        self.manager.shutdown(timeout=5)
        for agent in [*self.agents.values(), *self.probes]:
            assert agent.misuses == [], agent.misuses
            assert agent.live_xfer_handles() == 0
            agent.close()
        assert self.primary.stats()["pinned"] == 0
        assert self.primary.stats()["writing"] == 0


def build(num_blocks: int = NUM_BLOCKS, names: tuple[str, ...] = TIER_NAMES) -> Stack:
    primary = CPUPrimaryTier(num_blocks, BLOCK_BYTES, torch.uint8)
    tiers, agents, probes = {}, {}, []
    for name in names:
        agent = FakeNixlAgent(f"{name}-agent")
        # lookups of unknown keys probe on an agent of their own (from a background thread),
        # so the NIXL calls of transfers are numbered the same on every run
        probe = FakeNixlAgent(f"{name}-probe", objects=agent.objects)
        tiers[name] = ObjectStoreTier(primary.cache, agent=agent, probe_agent=probe)
        agents[name] = agent
        probes.append(probe)
    return Stack(primary, TieringManager(primary, tiers), tiers, agents, probes)


@pytest.fixture
def stack() -> Iterator[Stack]:
    made = build()
    yield made
    made.close()


@pytest.fixture
def small_stack() -> Iterator[Stack]:
    """A stack whose primary tier has four blocks."""
    made = build(num_blocks=4)
    yield made
    made.close()


class DictTier:
    """A user's own tier: blocks kept in a dict, copied at submit, results on the next poll.

    It has the secondary-tier contract and nothing of kvfsm's tiers. ``pending`` holds the
    results the next poll hands out; a test may add results of its own there.
    """

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.blocks: dict[bytes | str, torch.Tensor] = {}
        self.pending: list[JobResult] = []
        self.shut_down = False

    def submit_store(self, job: TransferJob) -> None:
        for key, block in zip(job.keys, job.block_ids, strict=True):
            self.blocks[key] = self.cache[block].clone()
        self.pending.append(JobResult(job.job_id, True))

    def submit_load(self, job: TransferJob) -> None:
        found = all(key in self.blocks for key in job.keys)
        if found:
            for key, block in zip(job.keys, job.block_ids, strict=True):
                self.cache[block] = self.blocks[key]
        self.pending.append(JobResult(job.job_id, found))

    def get_finished_jobs(self) -> list[JobResult]:
        results, self.pending = self.pending, []
        return results

    def has_pending_work(self) -> bool:
        return bool(self.pending)

    def lookup(self, key: bytes | str) -> Lookup:
        return Lookup.HIT if key in self.blocks else Lookup.MISS

    def shutdown(self) -> None:
        self.shut_down = True


class ScriptedPolls(DictTier):
    """A user's tier whose n-th poll answers ``poll(n)`` (numbered from 1)."""

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__(cache)
        self.polls = 0

    def get_finished_jobs(self) -> list[JobResult]:
        self.polls += 1
        return self.poll(self.polls)

    def poll(self, number: int) -> list[JobResult]:
        return super().get_finished_jobs()


# -- the primary tier ----------------------------------------------------------------------------

def test_a_block_is_written_then_ready_then_read_by_each_pin() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    assert primary.cache.is_pinned() == torch.cuda.is_available()
    (block,) = primary.allocate(["seq0/blk0"])
    assert primary.pin_count(block) == -1, "being written"
    assert primary.key_of(block) == "seq0/blk0"
    assert primary.block_of("seq0/blk0") == block
    assert primary.evictable() == [], "a block being written is not evictable"
    primary.complete_write([block], success=True)
    assert primary.pin_count(block) == 0, "ready"
    assert primary.evictable() == [block]

    primary.pin([block])
    primary.pin([block])
    assert primary.pin_count(block) == 2, "read by two transfers"
    assert primary.evictable() == []
    primary.complete_read([block])
    primary.complete_read([block])
    assert primary.pin_count(block) == 0
    assert primary.evictable() == [block]


def test_a_failed_write_frees_its_block() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    blocks = primary.allocate(["a", "b"])
    assert primary.free_blocks == 2
    primary.complete_write(blocks, success=False)
    assert primary.free_blocks == 4
    assert [primary.key_of(b) for b in blocks] == [None, None]
    assert primary.block_of("a") is None
    assert primary.allocate(["a"]) == [blocks[0]], "the key and the block can be used again"
    primary.complete_write([blocks[0]], success=True)


@pytest.fixture
def four_states() -> CPUPrimaryTier:
    """Block 0 ready ("a"), 1 pinned once ("b"), 2 being written ("c"), 3 free."""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    write(primary, "a", "b")
    primary.pin([1])
    assert primary.allocate(["c"]) == [2]
    return primary


@pytest.mark.parametrize(("operation", "error", "message"), [
    (lambda p: p.pin([9]), UnknownBlockError, r"block 9 is out of range \[0, 4\)"),
    (lambda p: p.pin([-1]), UnknownBlockError, r"block -1 is out of range"),
    (lambda p: p.pin(["0"]), UnknownBlockError, "block id '0' is not an int"),
    (lambda p: p.pin([True]), UnknownBlockError, "block id True is not an int"),
    (lambda p: p.pin(0), UnknownBlockError, "must be a list or tuple of ints"),
    (lambda p: p.pin([2]), BlockStateError,
     r"block 2 is not readable \(it is being written with key 'c'\)"),
    (lambda p: p.pin([3]), BlockStateError, r"block 3 is not readable \(it is free\)"),
    (lambda p: p.pin([0, 2]), BlockStateError, "block 2 is not readable"),  # 0 stays unpinned
    (lambda p: p.pin([0, 0]), BlockStateError, "block 0 appears twice"),
    (lambda p: p.complete_read([0]), BlockStateError,
     r"block 0 is not pinned \(it is ready with key 'a'\)"),
    (lambda p: p.complete_read([1, 0]), BlockStateError, "block 0 is not pinned"),  # 1 keeps it
    (lambda p: p.complete_read([1, 1]), BlockStateError, "block 1 appears twice"),
    (lambda p: p.complete_write([0], True), BlockStateError, "block 0 is not being written"),
    (lambda p: p.complete_write([3], False), BlockStateError,
     r"block 3 is not being written \(it is free\)"),
    (lambda p: p.complete_write([2, 1], True), BlockStateError,
     r"block 1 is not being written \(it holds key 'b', pinned by 1\)"),
    (lambda p: p.free([1]), BlockStateError, "block 1 cannot be freed"),
    (lambda p: p.free([2]), BlockStateError, "block 2 cannot be freed"),
    (lambda p: p.touch([3]), BlockStateError, "block 3 is not readable"),
    (lambda p: p.allocate(["a"]), DuplicateKeyError,
     r"key 'a' is already held by block 0 \(it is ready"),
    (lambda p: p.allocate(["c"]), DuplicateKeyError, "key 'c' is already held by block 2"),
    (lambda p: p.allocate(["x", "x"]), DuplicateKeyError, "key 'x' appears twice"),
    (lambda p: p.allocate([""]), PrimaryTierError, r"keys\[0\] must be a non-empty str"),
    (lambda p: p.allocate([7]), PrimaryTierError, r"keys\[0\] must be a non-empty str"),
    (lambda p: p.allocate("ab"), PrimaryTierError, "keys must be a list or tuple"),
    (lambda p: p.pin_count(4), UnknownBlockError, "block 4 is out of range"),
    (lambda p: p.key_of(-1), UnknownBlockError, "block -1 is out of range"),
])
def test_bad_input_to_the_primary_names_what_was_wrong_and_changes_nothing(
    four_states: CPUPrimaryTier, operation: object, error: type[Exception], message: str
) -> None:
    before = snapshot(four_states)
    with pytest.raises(error, match=message) as raised:
        operation(four_states)  # type: ignore[operator]
    assert isinstance(raised.value, ValueError)
    assert snapshot(four_states) == before


def test_eviction_takes_the_least_recently_used_block_never_a_pinned_or_written_one() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    a, b, c, d = write(primary, "a", "b", "c", "d")
    primary.touch([a])  # the engine used "a" again: "b" is now the least recently used
    primary.pin([b])
    assert primary.evictable() == [c, d, a]

    assert primary.allocate(["e"]) == [c], "b is older but pinned"
    assert primary.block_of("c") is None
    assert primary.evictions == 1

    before = snapshot(primary)
    with pytest.raises(OutOfBlocksError, match=r"3 block\(s\) wanted, 0 free and 2 evictable "
                                               r"\(1 pinned, 1 being written, 0 retired\)"):
        primary.allocate(["f", "g", "h"])
    assert snapshot(primary) == before, "nothing evicted when the allocation cannot be met"

    assert sorted(primary.allocate(["f", "g"])) == sorted([d, a]), "then d, then a"
    assert primary.evictable() == []
    with pytest.raises(OutOfBlocksError):
        primary.allocate(["h"])
    primary.complete_read([b])
    assert primary.allocate(["h"]) == [b], "unpinned, it may go"


# -- the parent: the third regression -------------------------------------------------------------

def test_regression_3_a_store_keeps_its_pin_until_its_one_result() -> None:
    """The state check raises, then the first release raises: the pin outlives the handle."""
    primary = CPUPrimaryTier(NUM_BLOCKS, BLOCK_BYTES, torch.uint8)
    agent = FakeNixlAgent("regression-3")
    manager = TieringManager(primary, [ObjectStoreTier(primary.cache, agent=agent)])
    (block,) = write(primary, "seq0/blk0")
    agent.inject("check_xfer_state", Raise())
    agent.inject("release_xfer_handle", Raise())
    (job_id,) = manager.store([block])
    assert primary.pin_count(block) == 1

    assert manager.step() == [], "step 1: the handle could not be released, no result"
    assert primary.pin_count(block) == 1, "still pinned: NIXL may hold it until the release"
    assert manager.has_pending_work()
    assert [job.job_id for job in manager.outstanding()] == [job_id]
    assert primary.allocate(["other"]) != [block], "a pinned block is not evicted"

    assert ids(manager.step()) == [(job_id, "ObjectStoreTier[0]", False)], "step 2: finalized"
    assert primary.pin_count(block) == 0
    assert not manager.has_pending_work()
    assert manager.step() == [], "step 3: nothing more"
    assert agent.call_count("release_xfer_handle") == 2
    assert agent.misuses == []
    primary.complete_write([primary.block_of("other")], success=False)  # type: ignore[list-item]
    manager.shutdown()
    agent.close()


# -- cascades and promotions on the fake agent ---------------------------------------------------

def test_a_store_cascades_to_both_tiers_pinning_once_per_tier(stack: Stack) -> None:
    primary, manager = stack.primary, stack.manager
    blocks = write(primary, "seq0/blk0", "seq0/blk1")
    first, second = manager.store(blocks)
    assert [primary.pin_count(b) for b in blocks] == [2, 2], "one pin for each tier's job"
    assert primary.evictable() == []
    assert {job.tier for job in manager.outstanding()} == set(TIER_NAMES)

    done = manager.drain(timeout=5)
    assert sorted(ids(done)) == [(first, "first", True), (second, "second", True)]
    assert [primary.pin_count(b) for b in blocks] == [0, 0]
    assert not manager.has_pending_work()
    for name, tier in stack.tiers.items():
        for key in ("seq0/blk0", "seq0/blk1"):
            stored = stack.agents[name].objects[tier.object_key(key)]
            assert stored == content(key).numpy().tobytes()
            assert tier.lookup(key) is Lookup.HIT
    assert manager.stats()["stores_ok"] == 2


def test_promotion_from_either_tier_brings_back_the_bytes(stack: Stack) -> None:
    primary, manager = stack.primary, stack.manager
    blocks = write(primary, "k0", "k1", "k2")
    manager.store(blocks)
    manager.drain(timeout=5)
    primary.free(blocks)  # the engine dropped them from host memory

    from_first = manager.load(["k0", "k1"])  # the first tier that holds both
    from_second = manager.load(["k2"], tier="second")
    assert from_first is not None and from_second is not None
    loading = [primary.block_of(key) for key in ("k0", "k1", "k2")]
    assert [primary.pin_count(b) for b in loading] == [-1, -1, -1]  # type: ignore[arg-type]
    assert primary.evictable() == [], "blocks being loaded are never evicted"

    assert sorted(ids(manager.drain(timeout=5))) == [(from_first, "first", True),
                                                     (from_second, "second", True)]
    assert all(holds(primary, key) for key in ("k0", "k1", "k2"))
    assert manager.stats()["loads_ok"] == 2


def test_a_failed_promotion_frees_its_block_and_the_next_comes_from_the_other_tier(
    stack: Stack,
) -> None:
    primary, manager = stack.primary, stack.manager
    (block,) = write(primary, "k0")
    manager.store([block])
    manager.drain(timeout=5)
    primary.free([block])
    # the first tier lost the object, but its lookup still says HIT
    del stack.agents["first"].objects[stack.tiers["first"].object_key("k0")]
    free_before = primary.free_blocks

    job = manager.load(["k0"])
    assert [job.tier for job in manager.outstanding()] == ["first"]
    assert primary.free_blocks == free_before - 1
    (done,) = manager.drain(timeout=5)
    assert (done.job_id, done.tier, done.success) == (job, "first", False)
    assert primary.block_of("k0") is None, "the failed load's block is free again"
    assert primary.free_blocks == free_before
    assert stack.tiers["first"].lookup("k0") is Lookup.MISS

    retried = manager.load(["k0"])
    assert ids(manager.drain(timeout=5)) == [(retried, "second", True)]
    assert holds(primary, "k0")


def test_eviction_never_takes_a_block_pinned_by_a_store_in_flight(small_stack: Stack) -> None:
    primary, manager = small_stack.primary, small_stack.manager
    old = write(primary, "a", "b", "c", "d")
    manager.store(old)
    manager.drain(timeout=5)
    primary.free(old)

    e, f, g, h = write(primary, "e", "f", "g", "h")  # least recently used first
    manager.store([e, f])  # in flight until the next step: e and f pinned by both tiers
    assert manager.load(["a", "b"]) is not None
    assert [primary.key_of(b) for b in (e, f)] == ["e", "f"], "pinned: not evicted"
    assert [primary.pin_count(b) for b in (e, f)] == [2, 2]
    assert {primary.key_of(g), primary.key_of(h)} == {"a", "b"}, "g and h were evicted instead"

    before = snapshot(primary)
    with pytest.raises(OutOfBlocksError,
                       match=r"0 evictable \(2 pinned, 2 being written, 0 retired\)"):
        manager.load(["c"])
    assert snapshot(primary) == before
    assert len(manager.outstanding()) == 3, "no job for the load that could not get a block"

    manager.drain(timeout=5)
    assert all(holds(primary, key) for key in ("a", "b", "e", "f"))
    assert manager.load(["c"]) is not None
    manager.drain(timeout=5)
    assert primary.block_of("e") is None, "once unpinned, the least recently used goes first"
    assert holds(primary, "c")


def test_load_waits_while_no_tier_knows_the_key(stack: Stack) -> None:
    primary, manager = stack.primary, stack.manager
    (block,) = write(primary, "elsewhere")
    manager.store([block])
    manager.drain(timeout=5)
    primary.free([block])
    assert manager.load(["never-stored"]) is None, "every tier answers RETRY or MISS"
    assert primary.block_of("never-stored") is None, "nothing allocated"
    assert manager.lookup("never-stored") in (Lookup.RETRY, Lookup.MISS)
    assert manager.lookup("elsewhere") is Lookup.HIT
    assert manager.outstanding() == []


# -- a user's own tier, and the books --------------------------------------------------------------

def test_a_users_own_tier_plugs_in_beside_an_object_store() -> None:
    primary = CPUPrimaryTier(NUM_BLOCKS, BLOCK_BYTES, torch.uint8)
    agent = FakeNixlAgent("objects")
    mine = DictTier(primary.cache)
    assert isinstance(mine, OffloadTier)
    manager = TieringManager(primary, {"objects": ObjectStoreTier(primary.cache, agent=agent),
                                       "mine": mine})
    blocks = write(primary, "k0", "k1")
    manager.store(blocks)
    assert sorted(done.tier for done in manager.drain(timeout=5)) == ["mine", "objects"]
    primary.free(blocks)
    job = manager.load(["k1", "k0"], tier="mine")
    assert ids(manager.step()) == [(job, "mine", True)]
    assert holds(primary, "k0") and holds(primary, "k1")
    manager.shutdown()
    assert mine.shut_down
    assert agent.misuses == []
    agent.close()


@pytest.fixture
def books() -> Iterator[tuple[CPUPrimaryTier, TieringManager, DictTier, DictTier]]:
    primary = CPUPrimaryTier(NUM_BLOCKS, BLOCK_BYTES, torch.uint8)
    left, right = DictTier(primary.cache), DictTier(primary.cache)
    yield primary, TieringManager(primary, {"left": left, "right": right}), left, right


def test_a_result_for_an_unknown_job_id_is_a_bookkeeping_error_naming_job_and_tier(
    books: tuple[CPUPrimaryTier, TieringManager, DictTier, DictTier],
) -> None:
    primary, manager, left, _ = books
    (block,) = write(primary, "k0")
    on_left, on_right = manager.store([block])
    left.pending.append(JobResult(999, True))  # a job nobody submitted

    with pytest.raises(BookkeepingError, match=r"job 999 from tier 'left': result .* is for no "
                                               r"outstanding job") as raised:
        manager.step()
    assert [(i.job_id, i.tier) for i in raised.value.issues] == [(999, "left")]
    assert sorted(ids(list(raised.value.finalized))) == [(on_left, "left", True),
                                                         (on_right, "right", True)], \
        "every other result was finalized before the error"
    assert primary.pin_count(block) == 0
    assert [(i.job_id, i.tier) for i in manager.bookkeeping_errors] == [(999, "left")]
    assert manager.step() == [], "the books are consistent: stepping goes on"
    assert not manager.has_pending_work()


def test_a_duplicated_or_misrouted_result_finalizes_nothing_twice(
    books: tuple[CPUPrimaryTier, TieringManager, DictTier, DictTier],
) -> None:
    primary, manager, left, right = books
    (block,) = write(primary, "k0")
    on_left, on_right = manager.store([block])
    left.pending.append(JobResult(on_left, True))  # published twice
    right_results = right.get_finished_jobs()  # the right tier's result is held back ...
    left.pending += right_results  # ... and the left tier reports it as its own

    with pytest.raises(BookkeepingError) as raised:
        manager.step()
    assert [(i.job_id, i.tier, i.problem) for i in raised.value.issues] == [
        (on_left, "left", f"result {JobResult(on_left, True)!r} is for no outstanding job "
                          "(never submitted, or already finalized)"),
        (on_right, "left", "the job was submitted to tier 'right'"),
    ]
    assert ids(list(raised.value.finalized)) == [(on_left, "left", True)]
    assert primary.pin_count(block) == 1, "the right tier's job still holds its pin"
    assert [job.job_id for job in manager.outstanding()] == [on_right]
    assert not right.has_pending_work()
    assert manager.has_pending_work(), "pending while the books have a job without a result"

    right.pending += right_results  # the right tier reports it after all
    assert ids(manager.step()) == [(on_right, "right", True)]
    assert primary.pin_count(block) == 0


def test_a_tier_whose_poll_raises_is_reported_and_the_others_are_finalized(
    books: tuple[CPUPrimaryTier, TieringManager, DictTier, DictTier],
) -> None:
    primary, manager, left, _ = books
    (block,) = write(primary, "k0")
    _, on_right = manager.store([block])

    def broken() -> list[JobResult]:
        raise OSError("tier backend gone")

    left.get_finished_jobs = broken  # type: ignore[method-assign]
    with pytest.raises(BookkeepingError, match="poll from tier 'left': get_finished_jobs "
                                               "raised OSError: tier backend gone") as raised:
        manager.step()
    assert ids(list(raised.value.finalized)) == [(on_right, "right", True)]
    assert primary.pin_count(block) == 1, "the left job has no result: its pin stays"
    del left.get_finished_jobs
    manager.step()
    assert primary.pin_count(block) == 0


def test_a_pin_dropped_behind_the_managers_back_is_reported_when_its_result_comes(
    books: tuple[CPUPrimaryTier, TieringManager, DictTier, DictTier],
) -> None:
    primary, manager, _, _ = books
    (block,) = write(primary, "k0")
    on_left, on_right = manager.store([block])
    primary.complete_read([block])
    primary.complete_read([block])  # someone else dropped both jobs' pins

    with pytest.raises(BookkeepingError, match=rf"job {on_left} from tier 'left': finalizing the "
                                               rf"primary failed: block {block} is not pinned"
                       ) as raised:
        manager.step()
    assert list(raised.value.finalized) == [], "not finalized, nor counted as such"
    assert manager.stats()["stores_ok"] == 0
    assert manager.outstanding() == [], "both results were taken; neither job is outstanding"
    assert primary.pin_count(block) == 0, "never below 0"
    assert {issue.job_id for issue in manager.bookkeeping_errors} == {on_left, on_right}


# -- submits that raise ---------------------------------------------------------------------------

def test_a_tier_refusing_a_store_drops_its_pin_and_the_cascade_goes_on(stack: Stack) -> None:
    primary, manager = stack.primary, stack.manager
    stack.tiers["first"].shutdown()  # it refuses every job from now on
    (block,) = write(primary, "k0")

    with pytest.raises(TierSubmitError, match=r"tier 'first' refused job 1: TierClosedError") \
            as raised:
        manager.store([block])
    assert isinstance(raised.value.__cause__, TierClosedError)
    assert raised.value.submitted == (2,), "the second tier took its job"
    assert [(job.job_id, job.tier) for job in manager.outstanding()] == [(2, "second")]
    assert primary.pin_count(block) == 1, "only the second tier's pin"

    assert ids(manager.step()) == [(2, "second", True)]
    assert primary.pin_count(block) == 0
    assert not manager.has_pending_work()


def test_a_tier_refusing_a_load_frees_its_block(stack: Stack) -> None:
    primary, manager = stack.primary, stack.manager
    (block,) = write(primary, "k0")
    manager.store([block])
    manager.drain(timeout=5)
    primary.free([block])
    stack.tiers["second"].shutdown()
    before = snapshot(primary)

    with pytest.raises(TierSubmitError, match="tier 'second' refused job 3"):
        manager.load(["k0"], tier="second")
    assert snapshot(primary) == before, "the block allocated for it is free again"
    assert manager.outstanding() == []
    assert not manager.has_pending_work()


class InterruptedAfterPost(FakeNixlAgent):
    """A fake agent on which a signal lands right after ``transfer()`` returned, once armed."""

    armed = False

    def transfer(self, *args: object, **kwargs: object) -> str:
        status = super().transfer(*args, **kwargs)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return status


def interrupted_stack() -> tuple[CPUPrimaryTier, TieringManager, InterruptedAfterPost]:
    """A manager over one object store on that agent, and a primary of one block."""
    primary = CPUPrimaryTier(1, BLOCK_BYTES, torch.uint8)
    agent = InterruptedAfterPost("interrupted", complete_after_polls=3)
    tier = ObjectStoreTier(primary.cache, agent=agent,
                           probe_agent=FakeNixlAgent("probe", objects=agent.objects))
    return primary, TieringManager(primary, {"only": tier}), agent


def test_a_block_stored_twice_at_once_stays_found_and_loadable() -> None:
    """The engine stores a block through the manager, then stores it twice more before a step
    (two requests sharing it): the block is pinned meanwhile, so every store carries its bytes,
    and the key is still found in the tier, and loads. (Two stores of a key at once made the
    tier forget it, and the engine, which took it for stored, never stored it again.)"""
    primary = CPUPrimaryTier(4, 64, torch.uint8)
    tier = ObjectStoreTier(primary.cache, agent=FakeNixlAgent("twice", complete_after_polls=1))
    manager = TieringManager(primary, [tier])
    (block,) = primary.allocate(["k"])
    primary.cache[block] = 7
    primary.complete_write([block], success=True)
    manager.store([block])
    manager.drain()
    manager.store([block])
    manager.store([block])
    assert len(manager.drain()) == 2
    primary.free([block])
    assert manager.lookup("k") is Lookup.HIT
    assert manager.load(["k"]) is not None
    (loaded,) = manager.drain()
    assert loaded.success and int(primary.cache[loaded.job.block_ids[0]][0]) == 7
    manager.shutdown()


def test_an_interrupt_once_a_tier_took_a_store_keeps_its_pin_until_the_result() -> None:
    """A signal lands just after NIXL posted a store. The tier took the job, and NIXL goes on
    reading the block: the manager keeps the job and its pin (it once dropped both, and the
    engine's next block went into the block under the running PUT, which then stored those
    bytes under the first key, published as a success)."""
    primary, manager, agent = interrupted_stack()
    (block,) = write(primary, "k1")
    agent.armed = True
    with pytest.raises(KeyboardInterrupt):
        manager.store([block])
    assert [(job.job_id, job.tier) for job in manager.outstanding()] == [(1, "only")]
    assert primary.pin_count(block) == 1, "NIXL still reads the block"
    with pytest.raises(BlockStateError, match="pinned by 1"):  # the engine cannot reuse it
        primary.free([block])
    with pytest.raises(OutOfBlocksError):
        primary.allocate(["k2"])

    assert ids(manager.drain(timeout=5)) == [(1, "only", True)]
    assert primary.pin_count(block) == 0
    primary.free([block])
    (again,) = write(primary, "k2")  # now the block may take other bytes
    assert again == block
    loaded = manager.load(["k1"])
    assert loaded is not None
    assert ids(manager.drain(timeout=5)) == [(loaded, "only", True)]
    assert holds(primary, "k1"), "k1's object holds k1's bytes"
    manager.shutdown(timeout=5)


def test_an_interrupt_once_a_tier_took_a_load_keeps_its_blocks_until_the_result() -> None:
    """The same signal, just after a load was posted: its blocks stay being written (neither
    freed nor handed to another load, which NIXL's GET would overwrite) until its result."""
    primary, manager, agent = interrupted_stack()
    (block,) = write(primary, "k1")
    manager.store([block])
    manager.drain(timeout=5)
    primary.free([block])
    agent.armed = True
    with pytest.raises(KeyboardInterrupt):
        manager.load(["k1"], tier="only")
    assert [job.tier for job in manager.outstanding()] == ["only"]
    assert primary.stats()["writing"] == 1, "NIXL still writes the block"
    with pytest.raises(OutOfBlocksError):
        primary.allocate(["k3"])
    (done,) = manager.drain(timeout=5)
    assert done.success and holds(primary, "k1")
    manager.shutdown(timeout=5)


def test_an_interrupted_submit_to_a_tier_that_cannot_say_what_it_took(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A tier whose ``owes`` raises says nothing: the job is kept (its blocks are not reused
    under a transfer that may run), the error is logged, and the interrupt goes on as it is
    rather than as the owes error. A tier without ``owes`` (a user's own) cannot be asked:
    the manager takes its pin back, as before, and says it could not tell."""

    class BrokenOwes(DictTier):
        def submit_store(self, job: TransferJob) -> None:
            super().submit_store(job)
            raise KeyboardInterrupt

        def owes(self, job_id: int) -> bool:
            raise RuntimeError("owes broke")

    class NoOwes(DictTier):
        def submit_store(self, job: TransferJob) -> None:
            raise KeyboardInterrupt

    primary = CPUPrimaryTier(2, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"broken": BrokenOwes(primary.cache)})
    (block,) = write(primary, "k1")
    with pytest.raises(KeyboardInterrupt):
        manager.store([block])
    assert [job.tier for job in manager.outstanding()] == ["broken"]
    assert primary.pin_count(block) == 1
    assert "the tier's owes() raised; the job is kept" in caplog.text
    assert ids(manager.drain(timeout=5)) == [(1, "broken", True)]
    assert primary.pin_count(block) == 0
    manager.shutdown(timeout=5)

    primary = CPUPrimaryTier(2, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"plain": NoOwes(primary.cache)})
    (block,) = write(primary, "k1")
    with pytest.raises(KeyboardInterrupt):
        manager.store([block])
    assert manager.outstanding() == [] and primary.pin_count(block) == 0
    assert "the tier has no owes() to say whether it took the job" in caplog.text
    manager.shutdown(timeout=5)


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda m, b: m.store([]), TieringInputError, "a store needs at least one block"),
    (lambda m, b: m.store(3), TieringInputError, "block ids must be a list or tuple"),
    (lambda m, b: m.store([b["ready"], 99]), UnknownBlockError, "block 99 is out of range"),
    (lambda m, b: m.store([b["free"]]), BlockStateError, r"is not readable \(it is free\)"),
    (lambda m, b: m.store([b["ready"], b["writing"]]), BlockStateError,
     r"is not readable \(it is being written"),
    (lambda m, b: m.store([b["ready"], b["ready"]]), BlockStateError, "appears twice"),
    (lambda m, b: m.load([]), TieringInputError, "a load needs at least one key"),
    (lambda m, b: m.load(["ready"]), DuplicateKeyError, "key 'ready' is already held"),
    (lambda m, b: m.load(["x", "x"]), DuplicateKeyError, "key 'x' appears twice"),
    (lambda m, b: m.load(["x"], tier="third"), TieringInputError, "no tier named 'third'"),
])
def test_bad_input_to_the_manager_reaches_no_tier_and_changes_nothing(
    stack: Stack, call: object, error: type[Exception], message: str
) -> None:
    primary = stack.primary
    blocks = {"ready": write(primary, "ready")[0], "writing": primary.allocate(["writing"])[0]}
    blocks["free"] = next(b for b in range(NUM_BLOCKS) if primary.key_of(b) is None)
    before = snapshot(primary), [list(agent.calls) for agent in stack.agents.values()]
    with pytest.raises(error, match=message) as raised:
        call(stack.manager, blocks)  # type: ignore[operator]
    assert isinstance(raised.value, ValueError)
    assert (snapshot(primary), [list(agent.calls) for agent in stack.agents.values()]) == before
    assert stack.manager.outstanding() == []
    primary.complete_write([blocks["writing"]], success=False)


def test_a_manager_is_built_only_on_tiers_of_its_own_cache() -> None:
    primary = CPUPrimaryTier(NUM_BLOCKS, BLOCK_BYTES, torch.uint8)
    agent = FakeNixlAgent("elsewhere")
    other = ObjectStoreTier(torch.zeros(NUM_BLOCKS, BLOCK_BYTES, dtype=torch.uint8), agent=agent)
    with pytest.raises(TieringInputError, match=r"'ObjectStoreTier\[0\]' copies to and from "
                                                "another tensor"):
        TieringManager(primary, [other])
    with pytest.raises(TypeError, match=r"tier 'object\[0\]' \(object\) lacks the "
                                        "secondary-tier contract: no submit_store, submit_load"):
        TieringManager(primary, [object()])  # type: ignore[list-item]
    mine = DictTier(primary.cache)
    with pytest.raises(TieringInputError, match="tiers 'a' and 'b' are the same object"):
        TieringManager(primary, {"a": mine, "b": mine})
    with pytest.raises(TieringInputError, match="at least one secondary tier"):
        TieringManager(primary, [])
    other.shutdown()
    agent.close()


# -- drain and shutdown ---------------------------------------------------------------------------

class TimedTier(DictTier):
    """A user's tier whose shutdown takes a timeout, as kvfsm's do: it keeps what it was given."""

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__(cache)
        self.given: list[float | None] = []

    def shutdown(self, timeout: float | None = 30.0) -> None:  # type: ignore[override]
        self.given.append(timeout)
        super().shutdown()


@pytest.mark.timeout(30)
def test_each_tier_is_shut_down_within_what_is_left_of_the_managers_timeout_or_with_none() -> None:
    """shutdown(timeout=None) means no bound, for the tiers too: a tier given its own default
    (30 s) instead would cut its background waits short where the caller asked for none."""
    primary = CPUPrimaryTier(2, 16, dtype=torch.uint8, pin_memory=False)
    for timeout in (None, 5.0):
        tier = TimedTier(primary.cache)
        TieringManager(primary, {"timed": tier}).shutdown(timeout=timeout)
        (given,) = tier.given
        if timeout is None:
            assert given is None, "no bound asked for, none given"
        else:
            assert given is not None and 0 < given <= timeout

def test_drain_with_a_deadline_names_what_is_outstanding_and_keeps_it(stack: Stack) -> None:
    primary, manager = stack.primary, stack.manager
    (block,) = write(primary, "k0")
    stack.agents["second"].inject("release_xfer_handle", Raise(), times=10**6)
    first, second = manager.store([block])

    with pytest.raises(TieringDrainTimeout,
                       match=rf"1 job\(s\) without a result\n  job {second}: store of blocks "
                             rf"\[{block}\] on tier 'second'") as raised:
        manager.drain(timeout=0.02)
    assert ids(list(raised.value.finalized)) == [(first, "first", True)]
    assert primary.pin_count(block) == 1, "the second tier's transfer may still hold the block"
    assert not manager.closed and not stack.tiers["second"].closed, "nothing shut down"

    stack.agents["second"].clear_faults()  # the fault clears up
    assert ids(manager.shutdown(timeout=5)) == [(second, "second", True)]
    assert primary.pin_count(block) == 0
    assert manager.closed and all(tier.closed for tier in stack.tiers.values())
    assert manager.shutdown() == [], "idempotent"
    with pytest.raises(ManagerClosedError):
        manager.store([block])
    with pytest.raises(ManagerClosedError):
        manager.load(["k9"])


def test_a_shutdown_at_its_deadline_gives_up_a_finished_store_whose_release_keeps_raising(
) -> None:
    """NIXL finished the second tier's store, but its release raises every time. The drain
    runs out at the deadline, and the tiers' shutdowns end what they can, as a tier's own
    shutdown does: one last release, then the transfer is quarantined, and its failure is
    finalized. NIXL is done with the block, so its pin goes, and the manager closes. (Every
    shutdown raised TieringDrainTimeout instead, for as long as the release kept raising: the
    manager never closed.)"""
    stack = build()
    primary, manager = stack.primary, stack.manager
    (block,) = write(primary, "k0")
    stack.agents["second"].inject("release_xfer_handle", Raise(), times=10**6)
    first, second = manager.store([block])

    finalized = manager.shutdown(timeout=0.05)
    assert sorted(ids(finalized)) == [(first, "first", True), (second, "second", False)]
    (given_up,) = [done for done in finalized if done.job_id == second]
    assert given_up.reason is not None and given_up.reason.kind is FailureKind.QUARANTINED
    assert primary.pin_count(block) == 0
    assert manager.closed and all(tier.closed for tier in stack.tiers.values())
    assert stack.tiers["second"].stats()["quarantined"] == 1
    assert stack.agents["second"].live_xfer_handles() == 1, "held for good, never released"
    assert all(agent.misuses == [] for agent in stack.agents.values())


def test_a_shutdown_at_its_deadline_cancels_what_nixl_still_runs_and_waits_for_it(
    stack: Stack
) -> None:
    """The second tier's store still runs at the deadline: its tier's shutdown cancels it, but
    never gives it up while NIXL may still read the block, so the shutdown raises
    TieringDrainTimeout naming it (with the first tier's job, finalized), its pin kept and the
    manager open. Once NIXL ends the transfer, the next shutdown finalizes the job's one
    failure, cancelled, and closes."""
    primary, manager = stack.primary, stack.manager
    (block,) = write(primary, "k0")
    stack.agents["second"].inject("check_xfer_state", StayProc(1), times=10**6)
    first, second = manager.store([block])

    with pytest.raises(TieringDrainTimeout, match=rf"job {second}: store") as raised:
        manager.shutdown(timeout=0.05)
    assert ids(list(raised.value.finalized)) == [(first, "first", True)]
    assert primary.pin_count(block) == 1, "NIXL may still read the block"
    assert not manager.closed

    stack.agents["second"].clear_faults()  # NIXL ends the transfer
    (cancelled,) = manager.shutdown(timeout=5)
    assert ids([cancelled]) == [(second, "second", False)]
    assert cancelled.reason is not None and cancelled.reason.kind is FailureKind.CANCELLED
    assert primary.pin_count(block) == 0
    assert manager.closed and all(tier.closed for tier in stack.tiers.values())


@pytest.mark.timeout(30)
def test_drain_keeps_its_deadline_while_another_thread_holds_a_tiers_lock(stack: Stack) -> None:
    """A call on another thread (a long submit, a probe sharing the tier's agent) holds the
    second tier: the drain comes back at its deadline with what the other tier finished,
    instead of waiting for that call."""
    primary, manager = stack.primary, stack.manager
    (block,) = write(primary, "k0")
    first, second = manager.store([block])
    outcome: list[BaseException | None] = []

    def drain() -> None:
        try:
            manager.drain(timeout=0.1)
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    drainer = threading.Thread(target=drain)
    with stack.tiers["second"]._lock:  # held far past the drain's deadline
        drainer.start()
        drainer.join(10)
        came_back = not drainer.is_alive()
    drainer.join()

    assert came_back, "the drain waited for the other thread's call past its deadline"
    (error,) = outcome
    assert isinstance(error, TieringDrainTimeout), error
    assert ids(list(error.finalized)) == [(first, "first", True)]
    assert [s.job_id for s in manager.outstanding()] == [second]
    assert primary.pin_count(block) == 1, "the second tier's store may still read the block"
    assert ids(manager.drain(timeout=5)) == [(second, "second", True)]
    assert primary.pin_count(block) == 0


# -- every single fault --------------------------------------------------------------------------

@dataclass
class Run:
    """What one run of the scenario did."""

    stack: Stack
    submitted: list[int] = field(default_factory=list)
    finalized: list[Finalized] = field(default_factory=list)
    #: NIXL calls each agent made after the tiers were built
    calls: dict[str, list[str]] = field(default_factory=dict)


def run_scenario(fault: tuple[str, str, int, Fault] | None = None) -> Run:
    """Stores and loads across two tiers, some in flight together, then shutdown.

    ``fault``: (tier, NIXL call, occurrence counted after the tiers were built, fault).
    """
    stack = build()
    primary, manager = stack.primary, stack.manager
    start = {name: len(agent.calls) for name, agent in stack.agents.items()}
    if fault is not None:
        name, call, occurrence, kind = fault
        agent = stack.agents[name]
        agent.inject(call, kind, at=agent.call_count(call) + occurrence)
    run = Run(stack)

    old = write(primary, "k0", "k1")
    run.submitted += manager.store(old)
    run.finalized += manager.drain(timeout=5)
    primary.free(old)

    new = write(primary, "k2", "k3")
    run.submitted += manager.store(new[:1])
    for keys, tier in ((["k0"], None), (["k1"], "second")):
        job = manager.load(keys, tier=tier)
        assert job is not None, f"no tier holds {keys} (a single fault hits one tier)"
        run.submitted.append(job)
    run.submitted += manager.store(new[1:])
    run.finalized += manager.step()
    run.finalized += manager.shutdown(timeout=5)
    run.calls = {name: agent.calls[start[name]:] for name, agent in stack.agents.items()}
    return run


def check(run: Run) -> None:
    """Every job finalized exactly once; every pin back to 0; the bytes right; NIXL unharmed."""
    stack, primary = run.stack, run.stack.primary
    finalized = Counter(done.job_id for done in run.finalized)
    assert finalized == Counter(run.submitted), "each job finalized exactly once"
    assert all(count == 1 for count in finalized.values())
    assert [primary.pin_count(b) for b in range(NUM_BLOCKS)] == [0] * NUM_BLOCKS
    assert not stack.manager.has_pending_work()
    assert stack.manager.bookkeeping_errors == []
    for done in run.finalized:
        for key in done.job.keys:
            assert isinstance(key, str)
            if not done.job.is_promotion:
                stored = stack.agents[done.tier].objects.get(stack.tiers[done.tier].object_key(key))
                assert (stored == content(key).numpy().tobytes()) or not done.success
            elif done.success:
                assert holds(primary, key), f"{key} loaded from {done.tier}"
            else:
                assert primary.block_of(key) is None, f"a failed load of {key} freed its block"
    for agent in [*stack.agents.values(), *stack.probes]:
        assert agent.misuses == [], agent.misuses
        assert agent.running_transfers() == 0
        assert agent.live_xfer_handles() == 0
        assert agent.pending_faults() == [], "the fault fired"
        agent.close()


#: the NIXL calls a transfer makes on its tier's agent
TRANSFER_CALLS = ("register_memory", "prep_xfer_dlist", "make_prepped_xfer", "transfer",
                  "check_xfer_state", "release_xfer_handle", "release_dlist_handle",
                  "deregister_memory")
#: the calls shutdown makes on each agent: it releases the primary cache's registration
SHUTDOWN_CALLS = ("release_dlist_handle", "deregister_memory")
#: the calls of a transfer an object-store job makes once per block (a NIXL transfer each:
#: kvfsm.driver.Split); the others it makes once
PER_BLOCK = ("make_prepped_xfer", "transfer", "check_xfer_state", "release_xfer_handle")
#: the NIXL calls the fault-free scenario makes on each tier's agent: four jobs (three stores,
#: the first of two blocks, and a load), then shutdown; the fault-free test checks that the
#: scenario makes these
SCENARIO_CALLS: Counter[str] = Counter(TRANSFER_CALLS * 4 + PER_BLOCK + SHUTDOWN_CALLS)


def fault_points(calls: dict[str, Counter[str]]) -> list[tuple[str, str, int, Fault]]:
    """Each call of ``calls`` (tier name -> how often each NIXL call is made on its agent), at
    each of its occurrences, with each fault it can take."""
    points: list[tuple[str, str, int, Fault]] = []
    for name, counts in calls.items():
        for call, count in sorted(counts.items()):
            kinds: list[Fault] = [Raise()]
            if call in ("transfer", "check_xfer_state"):
                kinds.append(ReturnErr())
            points += [(name, call, occurrence, kind)
                       for occurrence in range(1, count + 1) for kind in kinds]
    return points


# the fault points are what the scenario is declared to call, not what one run of it called:
# collecting the tests runs no scenario, so a bug in it fails the fault-free test below (which
# runs it and checks these are its calls) instead of the collection of this module
FAULT_POINTS = fault_points(dict.fromkeys(TIER_NAMES, SCENARIO_CALLS))


def test_the_fault_free_scenario_succeeds_and_covers_every_nixl_call_of_a_transfer() -> None:
    run = run_scenario()
    check(run)
    assert all(done.success for done in run.finalized)
    assert sorted((done.job.is_promotion, done.tier) for done in run.finalized) == [
        (False, "first"), (False, "first"), (False, "first"),
        (False, "second"), (False, "second"), (False, "second"),
        (True, "first"), (True, "second")]
    for calls in run.calls.values():  # four jobs, five transfers, on each agent; shutdown
        assert Counter(calls) == SCENARIO_CALLS
    made = {name: Counter(calls) for name, calls in run.calls.items()}
    assert fault_points(made) == FAULT_POINTS, "a fault for every call the scenario makes"
    assert len(FAULT_POINTS) == 2 * (len(TRANSFER_CALLS) * 4 + len(PER_BLOCK) + 2
                                     + 2 * 5)  # ERR for 2 calls


@pytest.mark.parametrize(
    "fault", FAULT_POINTS,
    ids=[f"{tier}-{call}#{n}-{type(kind).__name__}" for tier, call, n, kind in FAULT_POINTS])
def test_under_every_single_fault_pins_return_to_zero_and_jobs_finalize_once(
    fault: tuple[str, str, int, Fault],
) -> None:
    check(run_scenario(fault))


# -- transfers given up while NIXL runs them ------------------------------------------------------

def bounded_stack(num_blocks: int = 4, names: tuple[str, ...] = ("s3",)) -> Stack:
    """A stack whose tiers give up a transfer still running a minute after its submit
    (``max_running_seconds``), their agents answering PROC to every state check: a test
    makes a transfer overdue by moving its start back, with no sleeping."""
    primary = CPUPrimaryTier(num_blocks, BLOCK_BYTES, torch.uint8)
    tiers, agents, probes = {}, {}, []
    for name in names:
        agent = FakeNixlAgent(f"{name}-agent")
        probe = FakeNixlAgent(f"{name}-probe", objects=agent.objects)
        tiers[name] = ObjectStoreTier(primary.cache, agent=agent, probe_agent=probe,
                                      policy=RetryPolicy(max_running_seconds=60))
        agents[name], probes = agent, [*probes, probe]
    return Stack(primary, TieringManager(primary, tiers), tiers, agents, probes)


def overdue(stack: Stack, name: str, job_id: int) -> None:
    """Job ``job_id`` on tier ``name`` was submitted long before the running bound."""
    transfer = stack.tiers[name].transfer_of(job_id)
    assert transfer is not None
    transfer.started_at -= 120


def test_a_store_given_up_while_nixl_runs_it_keeps_its_pin_and_the_block_its_bytes() -> None:
    """The failure comes at once, saying the block is in use; the pin stays, so no allocation
    evicts the block and the engine never writes over what the PUT may still be reading."""
    stack = bounded_stack()
    primary, manager = stack.primary, stack.manager
    stack.agents["s3"].inject("check_xfer_state", StayProc(10**6))
    (block,) = write(primary, "a")
    [job] = manager.store([block])
    assert manager.step() == []
    overdue(stack, "s3", job)
    [done] = manager.step()
    assert (done.job_id, done.success, done.blocks_in_use) == (job, False, True)
    assert done.reason is not None and done.reason.kind is FailureKind.QUARANTINED
    assert primary.pin_count(block) == 1, "NIXL may still read it: never unpinned"
    assert manager.stats()["blocks_held"] == 1 and manager.stats()["stores_failed"] == 1
    assert not manager.has_pending_work()
    with pytest.raises(OutOfBlocksError, match="1 pinned"):
        primary.allocate(["b", "c", "d", "e"])  # every block: one is held
    assert sorted(write(primary, "b", "c", "d")) == [1, 2, 3]
    assert holds(primary, "a"), "the engine still reads its own copy"
    manager.shutdown(timeout=5)
    assert primary.pin_count(block) == 1, "held for good, as the transfer handle is"


def test_a_load_given_up_while_nixl_runs_it_retires_its_blocks_and_frees_their_keys() -> None:
    """NIXL may write the blocks at any time: they are never handed out again, and their keys
    may be loaded again, into other blocks."""
    stack = bounded_stack()
    primary, manager, tier = stack.primary, stack.manager, stack.tiers["s3"]
    # stored by another engine: no store of this tier's is first in its submit order
    stack.agents["s3"].objects[tier.remote_name("a")] = content("a").numpy().tobytes()
    stack.agents["s3"].inject("check_xfer_state", StayProc(10**6))
    job = manager.load(["a"], tier="s3")
    assert job is not None and manager.step() == []
    (loading,) = [b for b in range(primary.num_blocks) if primary.pin_count(b) == -1]
    overdue(stack, "s3", job)
    [done] = manager.step()
    assert (done.job_id, done.success, done.blocks_in_use) == (job, False, True)
    assert primary.key_of(loading) is None and primary.pin_count(loading) == -2
    assert primary.stats()["retired"] == 1 and manager.stats()["blocks_held"] == 1
    with pytest.raises(OutOfBlocksError, match="0 being written, 1 retired"):
        primary.allocate(["w", "x", "y", "z"])  # four keys, three blocks to be had
    stack.agents["s3"].clear_faults()
    again = manager.load(["a"], tier="s3")  # the key is free to load again, elsewhere
    assert again is not None
    [reloaded] = manager.drain(timeout=5)
    assert reloaded.success and not reloaded.blocks_in_use and holds(primary, "a")
    assert primary.block_of("a") != loading
    with pytest.raises(BlockStateError, match=re.escape(
            f"block {loading} is not being written (it is retired: NIXL may still write it)")):
        primary.complete_write([loading], True)


def test_a_store_given_up_on_one_tier_keeps_only_that_tiers_pin() -> None:
    stack = bounded_stack(names=("slow", "fast"))
    primary, manager = stack.primary, stack.manager
    stack.agents["slow"].inject("check_xfer_state", StayProc(10**6))
    (block,) = write(primary, "a")
    slow, fast = manager.store([block])
    assert [(d.job_id, d.success) for d in manager.step()] == [(fast, True)]
    overdue(stack, "slow", slow)
    [done] = manager.step()
    assert (done.job_id, done.blocks_in_use) == (slow, True)
    assert primary.pin_count(block) == 1


def test_a_failure_once_nixl_said_the_transfer_is_over_frees_the_blocks() -> None:
    """A release that kept failing quarantines too, but NIXL is done with the blocks: the
    result says so, and the pin goes."""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    agent = FakeNixlAgent("release-fails")
    tier = ObjectStoreTier(primary.cache, agent=agent, policy=RetryPolicy(max_attempts=1))
    manager = TieringManager(primary, {"s3": tier})
    agent.inject("release_xfer_handle", Raise("NIXL_ERR_BACKEND"))
    (block,) = write(primary, "a")
    manager.store([block])
    [done] = manager.drain(timeout=5)
    assert done.reason is not None and done.reason.kind is FailureKind.QUARANTINED
    assert (done.success, done.blocks_in_use) == (False, False)
    assert primary.pin_count(block) == 0 and manager.stats()["blocks_held"] == 0
    manager.shutdown(timeout=5)


@pytest.mark.parametrize("blocks, problem", [
    ([0], "block 0 is not being written (it is ready with key 'a')"),
    ([3], "block 3 is not being written (it is free)"),
    ([1, 1], "block 1 appears twice"),
])
def test_retire_refuses_blocks_not_being_written_and_changes_nothing(
        blocks: list[int], problem: str) -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    write(primary, "a")
    primary.allocate(["b", "c"])
    before = snapshot(primary)
    with pytest.raises(BlockStateError, match=re.escape(problem)):
        primary.retire(blocks)
    assert snapshot(primary) == before



# -- real NIXL -----------------------------------------------------------------------------------

REAL_BLOCKS, REAL_BLOCK_BYTES = 8, 64 * 1024


@pytest.mark.nixl
def test_cascade_and_promotion_on_real_nixl(s3_server: S3Server, tmp_path: Path) -> None:
    require_nixl()
    primary = CPUPrimaryTier(REAL_BLOCKS, REAL_BLOCK_BYTES, torch.uint8)
    bucket = s3_server.new_bucket()
    objects = ObjectStoreTier(primary.cache, store=s3_server.config(bucket, key_prefix="kv/"))
    files = FileTier(primary.cache, tmp_path / "blocks")
    manager = TieringManager(primary, {"s3": objects, "files": files})
    keys = [f"seq0/blk{i}" for i in range(4)]
    try:
        blocks = write(primary, *keys)
        manager.store(blocks)
        assert [primary.pin_count(b) for b in blocks] == [2] * 4
        done = manager.drain(timeout=60)
        assert sorted((d.tier, d.success) for d in done) == [("files", True), ("s3", True)]
        assert [primary.pin_count(b) for b in blocks] == [0] * 4
        s3 = s3_server.client()
        for key in keys:
            expected = content(key, REAL_BLOCK_BYTES).numpy().tobytes()
            stored = s3.get_object(Bucket=bucket, Key=objects.object_key(key))["Body"].read()
            assert stored == expected
            assert files.path_of(key).read_bytes() == expected

        primary.free(blocks)
        primary.cache.zero_()
        from_s3 = manager.load(keys[:2])  # the first tier answering HIT
        from_files = manager.load(keys[2:], tier="files")
        done = manager.drain(timeout=60)
        assert sorted(ids(done)) == sorted([(from_s3, "s3", True), (from_files, "files", True)])
        for key in keys:
            block = primary.block_of(key)
            assert block is not None and primary.pin_count(block) == 0
            assert torch.equal(primary.cache[block], content(key, REAL_BLOCK_BYTES)), key

        free_before = primary.free_blocks
        failed = manager.load(["never-stored"], tier="files")
        assert ids(manager.drain(timeout=60)) == [(failed, "files", False)]
        assert primary.block_of("never-stored") is None
        assert primary.free_blocks == free_before
    finally:
        manager.shutdown(timeout=60)
    assert objects.closed and files.closed
    assert primary.stats()["pinned"] == 0
