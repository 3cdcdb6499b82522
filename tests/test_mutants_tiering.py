"""The tiering manager's figures and messages, stated whole (docs/testing.md, "Mutation
testing").

mutmut left alive mutants of kvfsm/tiering.py that change ``stats()`` (a key renamed, the
outstanding count per tier started at 1 or counted by 2), the text of ``Submitted`` and of
the errors that list jobs or issues (the separators of their lines), ``find`` made to refuse a
repeated key, and ``is_ready`` on a free block. The stories in test_tiering.py match these
with regular expressions or look at one figure; these state each one exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfsm import FailureKind, FailureReason, JobResult, TransferJob
from kvfsm.testing import FakeNixlAgent
from kvfsm.tiering import (
    BlockStateError,
    BookkeepingError,
    CPUPrimaryTier,
    ManagerClosedError,
    PrimaryTierError,
    Submitted,
    TieringDrainTimeout,
    TieringInputError,
    TieringManager,
    TierSubmitError,
)
from kvfsm.tiers import Lookup, ObjectStoreTier

from .test_tiering import BLOCK_BYTES, DictTier, ScriptedPolls, build, write


class Holding(DictTier):
    """A tier that gives no result until told to."""

    def get_finished_jobs(self) -> list[JobResult]:
        return []

    def has_pending_work(self) -> bool:
        return True


def test_the_managers_stats_count_each_outstanding_job_on_its_tier() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    left, right = DictTier(primary.cache), DictTier(primary.cache)
    manager = TieringManager(primary, {"left": left, "right": right})
    assert manager.stats() == {"outstanding": {"left": 0, "right": 0}, "stores_ok": 0,
                               "stores_failed": 0, "loads_ok": 0, "loads_failed": 0,
                               "blocks_held": 0, "stores_skipped": {"left": 0, "right": 0},
                               "bookkeeping_errors": 0}
    a, b = write(primary, "a", "b")
    manager.store([a])
    manager.store([b])
    assert manager.stats()["outstanding"] == {"left": 2, "right": 2}
    manager.drain(timeout=5)
    assert manager.stats() == {"outstanding": {"left": 0, "right": 0}, "stores_ok": 4,
                               "stores_failed": 0, "loads_ok": 0, "loads_failed": 0,
                               "blocks_held": 0, "stores_skipped": {"left": 0, "right": 0},
                               "bookkeeping_errors": 0}
    manager.shutdown()


def test_the_primarys_stats_count_blocks_by_what_they_hold() -> None:
    primary = CPUPrimaryTier(5, BLOCK_BYTES, torch.uint8)
    a, b, _ = write(primary, "a", "b", "c")
    primary.allocate(["d"])
    primary.pin([a, b])
    primary.pin([a, b])  # two readers each: no block has a count of 1
    assert primary.stats() == {"free": 1, "writing": 1, "ready": 1, "pinned": 2,
                               "retired": 0, "evictions": 0}
    with pytest.raises(PrimaryTierError, match=r"got str 'ab'$"):
        primary.check_new_keys("ab")  # type: ignore[arg-type]
    with pytest.raises(PrimaryTierError, match=r"got str 'ab'$"):
        primary.pin("ab")  # type: ignore[arg-type]


def test_a_free_block_is_not_ready() -> None:
    primary = CPUPrimaryTier(2, BLOCK_BYTES, torch.uint8)
    assert not primary.is_ready(0)
    (block,) = write(primary, "a")
    assert primary.is_ready(block)


def test_a_submitted_job_says_what_it_moves_and_where() -> None:
    store = Submitted(TransferJob(3, ["a", "b"], [0, 1]), "left")
    load = Submitted(TransferJob(4, ["a"], [2], is_promotion=True), "right")
    assert str(store) == "job 3: store of blocks [0, 1] on tier 'left'"
    assert str(load) == "job 4: load of blocks [2] on tier 'right'"


def test_a_drain_timeout_lists_each_outstanding_job_on_a_line_of_its_own() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"slow": Holding(primary.cache)})
    a, b = write(primary, "a", "b")
    manager.store([a])
    manager.store([a, b])
    with pytest.raises(TieringDrainTimeout) as raised:
        manager.drain(timeout=0)
    assert str(raised.value) == ("drain: 2 job(s) without a result\n"
                                 "  job 1: store of blocks [0] on tier 'slow'\n"
                                 "  job 2: store of blocks [0, 1] on tier 'slow'\n"
                                 "  tier 'slow' has work in flight")


def test_a_bookkeeping_error_lists_each_issue_on_a_line_of_its_own() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    tier = DictTier(primary.cache)
    manager = TieringManager(primary, {"left": tier})
    tier.pending += [JobResult(98, True), JobResult(99, False)]
    with pytest.raises(BookkeepingError) as raised:
        manager.step()
    assert str(raised.value) == (
        "2 bookkeeping error(s):\n"
        f"  job 98 from tier 'left': result {JobResult(98, True)!r} is for no outstanding job "
        "(never submitted, or already finalized)\n"
        f"  job 99 from tier 'left': result {JobResult(99, False)!r} is for no outstanding job "
        "(never submitted, or already finalized)")


def test_a_submit_error_lists_each_refusal_on_a_line_of_its_own() -> None:
    stack = build()
    (block,) = write(stack.primary, "a")
    for tier in stack.tiers.values():
        tier.shutdown()
    with pytest.raises(TierSubmitError) as raised:
        stack.manager.store([block])
    lines = str(raised.value).split("\n")
    assert len(lines) == 2
    assert lines[0].startswith("tier 'first' refused job 1: TierClosedError: ")
    assert lines[1].startswith("tier 'second' refused job 2: TierClosedError: ")
    stack.close()


def test_find_takes_a_key_named_twice() -> None:
    """A repeated key is a question asked twice, not two blocks named alike: ``find`` answers
    it (a load or a store of such keys is refused)."""
    stack = build()
    (block,) = write(stack.primary, "a")
    stack.manager.store([block])
    stack.manager.drain(timeout=5)
    assert stack.tiers["first"].lookup("a") is Lookup.HIT
    assert stack.manager.find(["a", "a"]) == "first"
    assert stack.manager.lookup("a") is Lookup.HIT
    stack.close()


class Refusing(DictTier):
    """A tier whose shutdown raises."""

    def __init__(self, cache: torch.Tensor, error: Exception) -> None:
        super().__init__(cache)
        self.error = error

    def shutdown(self) -> None:
        self.shut_down = True
        raise self.error


def test_shutdown_raises_the_first_tiers_error_with_a_note_after_shutting_every_tier() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    first = Refusing(primary.cache, RuntimeError("first"))
    second = Refusing(primary.cache, RuntimeError("second"))
    third = DictTier(primary.cache)
    manager = TieringManager(primary, {"a": first, "b": second, "c": third})
    with pytest.raises(RuntimeError) as raised:
        manager.shutdown(timeout=None)
    assert raised.value is first.error
    assert raised.value.__notes__ == ["raised by the shutdown of tier 'a'"]
    assert second.error.__notes__ == ["raised by the shutdown of tier 'b'"]
    assert first.shut_down and second.shut_down and third.shut_down
    assert manager.closed is False


def test_shutdown_checks_its_timeout_first_and_takes_none() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    tier = DictTier(primary.cache)
    manager = TieringManager(primary, {"a": tier})
    with pytest.raises(ValueError) as refused:
        manager.shutdown(timeout=-1)
    assert str(refused.value) == "timeout must be a number of seconds >= 0, got -1"
    assert not tier.shut_down
    assert manager.shutdown(timeout=None) == []
    assert manager.closed and tier.shut_down


class Odd:
    """A result that is not a JobResult: no job id at all."""

    success = True


def test_a_result_without_a_job_id_is_a_bookkeeping_issue() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    tier = DictTier(primary.cache)
    manager = TieringManager(primary, {"left": tier})
    odd = Odd()
    tier.pending.append(odd)  # type: ignore[arg-type]
    with pytest.raises(BookkeepingError) as raised:
        manager.step()
    assert [str(issue) for issue in raised.value.issues] == [
        f"poll from tier 'left': result {odd!r} is for no outstanding job (never submitted, "
        "or already finalized)"]


def test_only_a_failed_result_keeps_its_reason_and_only_a_failure_reason() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    tier = DictTier(primary.cache)
    manager = TieringManager(primary, {"left": tier})
    a, b, c = write(primary, "a", "b", "c")
    why = FailureReason(FailureKind.ERR, "transfer", "answered 'ERR'")
    ids = [*manager.store([a]), *manager.store([b]), *manager.store([c])]
    tier.pending = [JobResult(ids[0], True, reason=why), JobResult(ids[1], False, reason=why),
                    JobResult(ids[2], False, reason="not a reason")]  # type: ignore[arg-type]
    done = {finalized.job_id: finalized for finalized in manager.step()}
    assert done[ids[0]].success and done[ids[0]].reason is None
    assert done[ids[1]].reason == why
    assert not done[ids[2]].success and done[ids[2]].reason is None


def test_finishing_a_read_of_a_free_block_is_refused() -> None:
    primary = CPUPrimaryTier(2, BLOCK_BYTES, torch.uint8)
    with pytest.raises(BlockStateError):
        primary.complete_read([0])
    (block,) = write(primary, "a")
    with pytest.raises(BlockStateError):
        primary.complete_read([block])


class Late(ScriptedPolls):
    """A tier that hands out its results on the first poll and a stray one on the second."""

    def poll(self, number: int) -> list[JobResult]:
        if number == 1:
            return super().poll(number)
        return [JobResult(999, True)] if number == 2 else []

    def has_pending_work(self) -> bool:
        return self.polls < 2


def test_a_bookkeeping_error_in_a_drain_carries_every_job_the_drain_finalized() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    tier = Late(primary.cache)
    manager = TieringManager(primary, {"late": tier})
    (block,) = write(primary, "a")
    (job,) = manager.store([block])
    with pytest.raises(BookkeepingError) as raised:
        manager.drain(timeout=None)
    assert [done.job_id for done in raised.value.finalized] == [job]


def test_a_closed_manager_and_empty_calls_say_so() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"left": DictTier(primary.cache)})
    with pytest.raises(TieringInputError) as refused:
        manager.store([])
    assert str(refused.value) == "a store needs at least one block"
    with pytest.raises(TieringInputError) as refused:
        manager.store("ab")  # type: ignore[arg-type]
    assert str(refused.value) == "block ids must be a list or tuple, got str 'ab'"
    with pytest.raises(TieringInputError) as refused:
        manager.load([])
    assert str(refused.value) == "a load needs at least one key"
    manager.shutdown()
    with pytest.raises(ManagerClosedError) as closed:
        manager.store([0])
    assert str(closed.value) == "the TieringManager is shut down"


def test_every_tier_that_names_keys_is_checked_after_one_that_does_not() -> None:
    """A tier without ``remote_name`` (a user's own) is skipped, not the end of the check."""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    agent = FakeNixlAgent("named")
    named = ObjectStoreTier(primary.cache, agent=agent)
    manager = TieringManager(primary, {"plain": DictTier(primary.cache), "named": named})
    blocks = write(primary, "6b")
    blocks += primary.allocate([b"k"])
    primary.complete_write(blocks[1:], success=True)
    with pytest.raises(TieringInputError,
                       match=f"name the same block '{named.object_key('6b')}' in tier 'named'"):
        manager.store(blocks)
    assert manager.outstanding() == []
    manager.shutdown()
    agent.close()


def test_a_manager_is_built_only_from_what_it_can_use_and_says_what_was_wrong() -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    tier = DictTier(primary.cache)
    with pytest.raises(TypeError) as wrong:
        TieringManager("primary", [tier])  # type: ignore[arg-type]
    assert str(wrong.value) == "primary must be a CPUPrimaryTier, got str"
    with pytest.raises(TieringInputError) as refused:
        TieringManager(primary, [])
    assert str(refused.value) == "a TieringManager needs at least one secondary tier"
    for name in ("", 1):
        with pytest.raises(TieringInputError) as refused:
            TieringManager(primary, {name: tier})  # type: ignore[dict-item]
        assert str(refused.value) == f"tier names must be non-empty str, got {name!r}"
    other = ObjectStoreTier(torch.zeros(4, BLOCK_BYTES, dtype=torch.uint8),
                            agent=FakeNixlAgent("other"))
    with pytest.raises(TieringInputError) as refused:
        TieringManager(primary, {"other": other})
    assert str(refused.value) == ("tier 'other' copies to and from another tensor than the "
                                  "primary tier's cache")
    other.shutdown()
    # the same bytes cut into blocks of half the size: block 1 would be the first half of
    # the primary's block 0, and a load "succeeded" into the wrong bytes
    halves = ObjectStoreTier(primary.cache.view(8, BLOCK_BYTES // 2),
                             agent=FakeNixlAgent("halves"))
    with pytest.raises(TieringInputError) as refused:
        TieringManager(primary, {"halves": halves})
    assert str(refused.value) == (
        f"tier 'halves' cuts the primary tier's cache into 8 blocks of {BLOCK_BYTES // 2} "
        f"bytes, the primary tier into 4 of {BLOCK_BYTES}: a block id would name other bytes "
        "in each")
    halves.shutdown()


class SecondPoll(DictTier):
    """A tier whose results come on the poll after the one they were ready for."""

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__(cache)
        self.ready: list[JobResult] = []

    def get_finished_jobs(self) -> list[JobResult]:
        results, self.ready = self.ready, super().get_finished_jobs()
        return results

    def has_pending_work(self) -> bool:
        return bool(self.ready or self.pending)


def test_a_drain_steps_again_at_once_by_default() -> None:
    """The default poll interval is half a millisecond: a drain that needs a few steps takes
    milliseconds, not seconds (the manager's wait between steps is its poll_interval)."""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"slow": SecondPoll(primary.cache)})
    assert manager.poll_interval == 0.0005
    (block,) = write(primary, "a")
    (job,) = manager.store([block])
    assert [done.job_id for done in manager.drain(timeout=30)] == [job]


@pytest.mark.parametrize(("args", "message"), [
    ((0, 4), "num_blocks must be an int >= 1, got 0"),
    ((True, 4), "num_blocks must be an int >= 1, got True"),
    ((2.0, 4), "num_blocks must be an int >= 1, got 2.0"),
    ((2, 0), "block_shape must be ints >= 1, got 0"),
    ((2, ()), "block_shape must be ints >= 1, got ()"),
    ((2, (4, True)), "block_shape must be ints >= 1, got (4, True)"),
    ((2, (4, 2.0)), "block_shape must be ints >= 1, got (4, 2.0)"),
    ((2, (4, 0)), "block_shape must be ints >= 1, got (4, 0)"),
    ((2, 16.0), "block_shape must be ints >= 1, got 16.0"),  # (was: 'float' is not iterable)
    ((2, None), "block_shape must be ints >= 1, got None"),
    ((2, "16"), "block_shape must be ints >= 1, got '16'"),
    ((2, {4: 4}), "block_shape must be ints >= 1, got {4: 4}"),
])
def test_a_primary_tier_of_no_blocks_or_of_empty_blocks_is_refused(
        args: tuple[object, object], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        CPUPrimaryTier(*args)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_a_primary_tier_takes_numpys_ints_as_torch_does() -> None:
    primary = CPUPrimaryTier(2, (np.int64(4), np.int32(2)), torch.uint8)
    assert tuple(primary.cache.shape) == (2, 4, 2) and primary.block_bytes == 8
    assert CPUPrimaryTier(2, np.int64(16), torch.uint8).block_bytes == 16


def test_the_smallest_primary_tier_has_one_block_of_one_element() -> None:
    primary = CPUPrimaryTier(1, 1, torch.uint8)
    assert tuple(primary.cache.shape) == (1, 1) and primary.block_bytes == 1
    shaped = CPUPrimaryTier(2, (3, 2), torch.float32)
    assert tuple(shaped.cache.shape) == (2, 3, 2) and shaped.block_bytes == 24
    assert shaped.cache.is_pinned() == torch.cuda.is_available()


def test_every_eviction_is_counted() -> None:
    primary = CPUPrimaryTier(2, BLOCK_BYTES, torch.uint8)
    write(primary, "a", "b")
    write(primary, "c")
    write(primary, "d")
    write(primary, "e")
    assert primary.evictions == 3
    assert primary.stats()["evictions"] == 3
