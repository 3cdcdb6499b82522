"""The object-store tier on the fake agent: round trips and the fault classes F1-F8, F10."""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import pytest
import torch

from kvfsm import Declaration, JobResult, TransferJob, TransferState
from kvfsm.lifecycle import ACTIONS, ANSWERS, GUARDS, TRANSFER_MACHINE, TRANSITIONS
from kvfsm.policy import RetryPolicy
from kvfsm.runner import FRONT_BATCH
from kvfsm.testing import FakeNixlAgent, Raise, ReturnErr, StayProc
from kvfsm.tiers import InvalidJobError, Lookup, ObjectStoreTier, TierClosedError

from .conftest import NUM_BLOCKS, assert_nothing_held_but_recorded_leaks
from .test_capacity import wait_for_verdict


def store(job_id: int, *blocks: int) -> TransferJob:
    return TransferJob(job_id, [f"key-{b}" for b in blocks], list(blocks))


def load(job_id: int, keys_to_blocks: dict[str, int]) -> TransferJob:
    return TransferJob(job_id, list(keys_to_blocks), list(keys_to_blocks.values()),
                       is_promotion=True)


def results_until_idle(tier: ObjectStoreTier, polls: int = 20) -> list[JobResult]:
    results: list[JobResult] = []
    for _ in range(polls):
        results += tier.get_finished_jobs()
        if not tier.has_pending_work():
            break
    return results


# -- the happy path ------------------------------------------------------------------------------

def test_store_then_load_round_trip_moves_every_byte(
    tier: ObjectStoreTier, primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    original = primary.clone()
    tier.submit_store(store(1, 0, 1, 2, 3))
    tier.submit_store(store(2, 4, 5, 6, 7))
    results = results_until_idle(tier)
    assert sorted((r.job_id, r.success) for r in results) == [(1, True), (2, True)]
    assert all(r.transfer_size == 4 * primary[0].nbytes for r in results)
    for block in range(NUM_BLOCKS):
        assert agent.objects[tier.object_key(f"key-{block}")] == original[block].numpy().tobytes()

    primary.zero_()
    # load back into other slots, in another order: key-b goes to slot 7 - b
    tier.submit_load(load(3, {f"key-{b}": NUM_BLOCKS - 1 - b for b in range(NUM_BLOCKS)}))
    (loaded,) = results_until_idle(tier)
    assert loaded.success
    assert torch.equal(primary, original.flip(0))


def test_the_result_waits_while_nixl_answers_proc(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("check_xfer_state", StayProc(3))
    tier.submit_store(store(1, 0))
    for _ in range(3):
        assert tier.get_finished_jobs() == []
        assert tier.state_of(1) is TransferState.PROCESSING
        assert tier.has_pending_work()
    assert [r.job_id for r in tier.get_finished_jobs()] == [1]
    assert tier.state_of(1) is None
    assert not tier.has_pending_work()
    tier.shutdown()


def test_a_transfer_nixl_finishes_at_once_is_published_without_polling(
    primary: torch.Tensor,
) -> None:
    agent = FakeNixlAgent(complete_after_polls=0)
    tier = ObjectStoreTier(primary, agent=agent)
    tier.submit_store(store(1, 0, 1))
    assert tier.state_of(1) is None, "DONE at post goes straight on to PUBLISHED"
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    assert agent.call_count("check_xfer_state") == 0
    tier.shutdown()
    agent.close()


def test_jobs_are_tracked_independently(tier: ObjectStoreTier, agent: FakeNixlAgent) -> None:
    agent.inject("check_xfer_state", StayProc(2), at=1)  # job 1 runs longer
    tier.submit_store(store(1, 0))
    tier.submit_store(store(2, 1))
    assert [r.job_id for r in tier.get_finished_jobs()] == [2]
    assert tier.state_of(1) is TransferState.PROCESSING
    assert [r.job_id for r in results_until_idle(tier)] == [1]


def test_a_job_with_no_blocks_publishes_success_at_once(
    tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    calls_before = len(agent.calls)
    tier.submit_store(TransferJob(9, [], []))
    assert tier.state_of(9) is None, "published within the submit call"
    assert tier.get_finished_jobs() == [JobResult(9, True, 0, pytest.approx(0.0, abs=1.0))]
    assert len(agent.calls) == calls_before, "no NIXL call for an empty job"


def test_drain_blocks_until_published_and_results_surface_on_the_next_call(
    tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    agent.inject("check_xfer_state", StayProc(5))
    tier.submit_store(store(1, 0, 1))
    tier.submit_store(store(2, 2))
    tier.drain_jobs(timeout=5)
    assert tier.state_of(1) is None and tier.state_of(2) is None
    assert tier.has_pending_work(), "results not yet collected are pending work"
    assert sorted(r.job_id for r in tier.get_finished_jobs()) == [1, 2]
    assert not tier.has_pending_work()


def test_a_load_of_a_missing_object_publishes_one_failure(
    tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    tier.submit_load(load(1, {"never-stored": 0}))
    (result,) = results_until_idle(tier)
    assert result == JobResult(1, False, 0, result.transfer_time)


# -- a transfer per block ------------------------------------------------------------------------
#
# NIXL 1.5.1's OBJ backend answers a transfer's state check with the error of one failed request
# while the transfer's other requests still run, and says nothing when they end: a job published
# as failed then has NIXL write into blocks the engine reuses (a load), or read blocks the engine
# overwrites into objects another process then loads as a success (a store). So an object-store
# job makes one NIXL transfer per block, and is over only once every one it posted is.

def test_a_load_whose_first_block_fails_is_published_only_once_its_other_blocks_are_over(
    tier: ObjectStoreTier, agent: FakeNixlAgent, primary: torch.Tensor,
) -> None:
    """Block 0's object is missing, and its transfer fails at its first check; block 1's
    transfer runs three checks more. The job stays unpublished and holds every handle until
    block 1's transfer is over: its bytes landed before the failure was published, never
    into a block the engine took back. Each handle is released once."""
    agent.objects[tier.object_key("k1")] = b"\x01" * 256
    agent.objects[tier.object_key("k2")] = b"\x02" * 256
    tier.submit_load(load(1, {"missing": 0, "k1": 1, "k2": 2}))
    assert agent.call_count("make_prepped_xfer") == 3, "a NIXL transfer per block"
    checks = agent.call_count("check_xfer_state")
    agent.inject("check_xfer_state", StayProc(3), at=checks + 2)  # block 1's first check

    for poll in range(3):  # block 0 failed at the first; block 1 still runs
        assert tier.get_finished_jobs() == [], f"poll {poll + 1}: block 1's transfer runs"
        assert tier.state_of(1) is TransferState.PROCESSING
        assert agent.call_count("release_xfer_handle") == 0, "nothing released under it"
        assert agent.running_transfers() == 2, "blocks 1 and 2, asked in turn"
    (result,) = tier.get_finished_jobs()

    assert (result.job_id, result.success) == (1, False)
    assert result.reason is not None and result.reason.call == "check_xfer_state"
    assert bytes(primary[1].numpy().tobytes()) == b"\x01" * 256, "landed before the result"
    assert bytes(primary[2].numpy().tobytes()) == b"\x02" * 256
    assert agent.running_transfers() == 0
    assert agent.call_count("release_xfer_handle") == 3, "each handle released once"


def test_a_store_whose_middle_block_fails_keeps_its_other_objects_whole(
    tier: ObjectStoreTier, agent: FakeNixlAgent, primary: torch.Tensor,
) -> None:
    """Block 1's transfer fails while block 2's still runs: the failure comes once block 2's
    object is written whole, from the block as it was when the store was submitted."""
    tier.submit_store(store(1, 0, 1, 2))
    checks = agent.call_count("check_xfer_state")
    agent.inject("check_xfer_state", Raise(), at=checks + 2)  # block 1's first check
    agent.inject("check_xfer_state", StayProc(2), at=checks + 3)  # block 2's first check

    assert tier.get_finished_jobs() == [], "block 2's transfer runs"
    assert agent.call_count("release_xfer_handle") == 0
    (result,) = results_until_idle(tier)

    assert (result.success, str(result.reason)) == (
        False, "check_xfer_state raised FakeNixlError: NIXL_ERR_BACKEND")
    assert agent.objects[tier.object_key("key-2")] == primary[2].numpy().tobytes()
    assert tier.object_key("key-1") not in agent.objects
    assert agent.call_count("release_xfer_handle") == 3


def test_a_post_that_fails_after_the_first_fails_the_job_once_the_posted_ones_are_over(
    tier: ObjectStoreTier, agent: FakeNixlAgent,
) -> None:
    """Block 1's post raises: block 2's is never made, and the job fails naming the post,
    but not before block 0's transfer, posted and running, is over."""
    posts, checks = agent.call_count("transfer"), agent.call_count("check_xfer_state")
    agent.inject("transfer", Raise(), at=posts + 2)
    agent.inject("check_xfer_state", StayProc(2), at=checks + 1)  # block 0's first check
    tier.submit_store(store(1, 0, 1, 2))

    assert tier.get_finished_jobs() == [], "block 0's transfer runs"
    assert agent.call_count("release_xfer_handle") == 0
    (result,) = results_until_idle(tier)

    assert result.success is False
    assert str(result.reason) == "transfer raised FakeNixlError: NIXL_ERR_BACKEND"
    assert agent.call_count("transfer") == posts + 2, "block 2 was never posted"
    assert agent.call_count("release_xfer_handle") == 3, "posted or not, each released once"


@pytest.mark.parametrize("post", [1, 2])
def test_a_post_that_answers_err_fails_the_job_by_its_answer_and_nothing_after_it_is_posted(
    tier: ObjectStoreTier, agent: FakeNixlAgent, post: int,
) -> None:
    """Block ``post - 1``'s ``transfer()`` answers ERR (NIXL did not take it): the blocks
    after it are never posted, the job fails with that answer, and only the blocks posted
    before it are asked (block 0, when the second post failed)."""
    agent.inject("transfer", ReturnErr(), at=agent.call_count("transfer") + post)
    checks = agent.call_count("check_xfer_state")
    tier.submit_store(store(1, 0, 1, 2))
    (result,) = results_until_idle(tier)
    assert (result.success, str(result.reason)) == (False, "transfer answered 'ERR'")
    assert agent.call_count("transfer") == post
    assert agent.call_count("check_xfer_state") - checks == post - 1
    assert agent.call_count("release_xfer_handle") == 3, "posted or not, each released once"


def test_a_job_whose_posts_nixl_finished_at_once_is_over_without_a_check_even_if_one_failed(
    primary: torch.Tensor,
) -> None:
    """NIXL finishes each post at once (DONE), but block 1's post raises: the job's answer is
    known at the submit, the failure of that post, and no state check is made."""
    agent = FakeNixlAgent("at-once", complete_after_polls=0)
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("transfer", Raise(), at=2)
    tier.submit_store(store(1, 0, 1, 2))
    (result,) = tier.get_finished_jobs()
    assert str(result.reason) == "transfer raised FakeNixlError: NIXL_ERR_BACKEND"
    assert agent.call_count("check_xfer_state") == 0
    assert sorted(agent.objects) == [tier.object_key("key-0")]
    tier.shutdown(timeout=5)
    assert_nothing_held_but_recorded_leaks(tier, agent)
    assert agent.misuses == []


def test_a_block_nixl_finished_at_its_post_does_not_stand_for_the_next_one_still_running(
    primary: torch.Tensor,
) -> None:
    """Blocks 0 and 1 are DONE as they are posted; block 2's transfer runs three checks. The
    job waits for block 2 (asked, not skipped over because the one before it was over
    already), and each handle is released once it is over."""
    agent = FakeNixlAgent("at-once", complete_after_polls=0)
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("transfer", StayProc(3), at=3)  # block 2's post: PROC, then two checks more
    tier.submit_store(store(1, 0, 1, 2))
    assert tier.get_finished_jobs() == [], "block 2's transfer runs"
    assert agent.running_transfers() == 1
    assert agent.call_count("release_xfer_handle") == 0
    (result,) = results_until_idle(tier)
    assert result.success
    assert agent.call_count("check_xfer_state") == 3, "block 2's, none of the others'"
    assert sorted(agent.objects) == [tier.object_key(f"key-{b}") for b in range(3)]
    tier.shutdown(timeout=5)
    assert_nothing_held_but_recorded_leaks(tier, agent)
    assert agent.misuses == []


def test_a_one_block_job_makes_one_transfer_and_no_extra_check(
    tier: ObjectStoreTier, agent: FakeNixlAgent,
) -> None:
    tier.submit_store(store(1, 0))
    (result,) = results_until_idle(tier)
    assert result.success
    assert [agent.call_count(call) for call in (
        "make_prepped_xfer", "transfer", "check_xfer_state", "release_xfer_handle")] == [1] * 4


# -- the regressions that started the project ----------------------------------------------------

def test_regression_1_state_check_raises_then_release_raises_once(
    tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    """F1: the release that raised is retried; the result is neither lost nor early."""
    agent.inject("check_xfer_state", Raise())
    agent.inject("release_xfer_handle", Raise())
    tier.submit_store(store(1, 0))

    assert tier.get_finished_jobs() == [], "poll 1: no result while the handle is held"
    assert tier.state_of(1) is TransferState.FAILED
    assert tier.has_pending_work()

    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success) == (1, False), "poll 2: exactly one failed result"
    assert tier.get_finished_jobs() == [], "poll 3: nothing more"
    assert not tier.has_pending_work()
    assert agent.call_count("check_xfer_state") == 1, "the verdict was not re-polled (F3)"
    assert agent.call_count("release_xfer_handle") == 2


@pytest.mark.parametrize("failing_call", ["release_dlist_handle", "deregister_memory"])
def test_regression_2_cleanup_failure_still_publishes_one_success(
    tier: ObjectStoreTier, agent: FakeNixlAgent, failing_call: str
) -> None:
    """F7: best-effort cleanup never holds a result back, and the leak is recorded."""
    agent.inject(failing_call, Raise())
    tier.submit_store(store(1, 0, 1))
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success) == (1, True)
    assert tier.get_finished_jobs() == []
    stats = tier.stats()
    assert stats["leaks"] == 1
    assert [(job, leak.call) for job, leak in stats["leaked"]] == [(1, failing_call)]
    assert_nothing_held_but_recorded_leaks(tier, agent)


# -- the fault classes ---------------------------------------------------------------------------

def test_f1_a_release_that_keeps_raising_keeps_the_transfer_and_its_result(
    tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    agent.inject("release_xfer_handle", Raise(), times=4)
    tier.submit_store(store(1, 0))
    for _ in range(4):
        assert tier.get_finished_jobs() == []
        assert tier.state_of(1) is TransferState.DONE
    transfer = tier.transfer_of(1)
    assert transfer is not None and transfer.retries == 4
    assert transfer.error == "FakeNixlError: NIXL_ERR_BACKEND"
    (result,) = tier.get_finished_jobs()
    assert result.success, "F3: the DONE verdict survived four failed releases"


def test_f2_f8_release_comes_before_cleanup_which_comes_before_the_result(
    tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    agent.inject("release_xfer_handle", Raise())
    tier.submit_store(store(1, 0))
    assert tier.get_finished_jobs() == []
    assert agent.live_dlist_handles() == 2, "remote descriptors kept while the handle is held"
    assert agent.live_registrations("OBJ") == 1
    calls_before_result = len(agent.calls)
    assert len(tier.get_finished_jobs()) == 1
    tail = agent.calls[calls_before_result:]
    assert tail == ["release_xfer_handle", "release_dlist_handle", "deregister_memory"]


@pytest.mark.parametrize("fault", [ReturnErr(), Raise()], ids=["answers-ERR", "raises"])
def test_f4_every_answer_of_the_state_check_is_handled(
    tier: ObjectStoreTier, agent: FakeNixlAgent, fault: Raise | ReturnErr
) -> None:
    agent.inject("check_xfer_state", fault)
    tier.submit_store(store(1, 0))
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success, result.transfer_size) == (1, False, 0)
    assert tier.get_finished_jobs() == []


@pytest.mark.parametrize(("call", "at", "fault"), [
    ("register_memory", 2, Raise()),  # the first registration is the primary cache's
    ("prep_xfer_dlist", 2, Raise()),  # the first prep is the primary cache's
    ("make_prepped_xfer", 1, Raise()),
    ("transfer", 1, Raise()),
    ("transfer", 1, ReturnErr()),
])
def test_f5_a_failure_at_any_submit_step_publishes_one_failure_and_releases_what_was_made(
    tier: ObjectStoreTier, agent: FakeNixlAgent, call: str, at: int, fault: Raise | ReturnErr
) -> None:
    agent.inject(call, fault, at=at)
    tier.submit_store(store(1, 0, 1))  # never raises: the failure is the job's result
    assert tier.state_of(1) is None, "a failed submit goes straight on to its result"
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success) == (1, False)
    assert_nothing_held_but_recorded_leaks(tier, agent)
    assert tier.stats()["leaks"] == 0


def test_f6_each_job_publishes_exactly_once_over_many_polls(
    tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    agent.inject("check_xfer_state", StayProc(2), at=3)
    agent.inject("release_xfer_handle", Raise(), at=2, times=3)
    for job_id in range(NUM_BLOCKS):
        tier.submit_store(store(job_id, job_id))
    seen = [r.job_id for _ in range(10) for r in tier.get_finished_jobs()]
    assert sorted(seen) == list(range(NUM_BLOCKS))


def test_f10_shutdown_cancels_what_runs_but_waits_for_nixl_before_releasing(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("check_xfer_state", StayProc(4))
    tier.submit_store(store(1, 0))
    tier.submit_load(load(2, {"absent": 1}))
    tier.shutdown(timeout=5)
    assert agent.running_transfers() == 0, "never torn down with a transfer in flight"
    assert agent.call_count("check_xfer_state") >= 5, "it waited for NIXL's DONE"
    assert sorted((r.job_id, r.success) for r in tier.get_finished_jobs()) == [
        (1, False), (2, False)], "every unfinished job publishes exactly one failure"
    tier.shutdown()  # idempotent
    with pytest.raises(TierClosedError):
        tier.submit_store(store(3, 0))
    assert agent.live_registrations() == 0


def test_f9_a_release_that_never_succeeds_is_quarantined_at_the_shutdown_deadline(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    tier = ObjectStoreTier(primary, agent=agent)
    agent.inject("release_xfer_handle", Raise("NIXL_ERR_NOT_ALLOWED"), times=10**6)
    tier.submit_store(store(1, 0))
    tier.shutdown(timeout=0.01)
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
    stats = tier.stats()
    assert (stats["quarantined"], stats["quarantined_running"]) == (1, 0)
    assert tier.closed
    assert agent.live_xfer_handles() == 1, "the quarantined handle is held for good"
    assert agent.live_registrations("DRAM") == 1, "and so is the memory it refers to"
    assert agent.running_transfers() == 0, "the transfer itself was over"
    agent.clear_faults()


# -- bad input changes nothing -------------------------------------------------------------------

@pytest.mark.parametrize(("job", "message"), [
    (TransferJob(5, ["a", "b"], [0]), "2 keys but 1 block ids"),
    (TransferJob(5, ["a"], [NUM_BLOCKS]), rf"block_ids\[0\] = {NUM_BLOCKS} is out of range"),
    (TransferJob(5, ["a"], [-1]), r"block_ids\[0\] = -1 is out of range"),
    (TransferJob(5, ["a"], ["0"]), r"block_ids\[0\] is '0', not an int"),  # type: ignore[list-item]
    (TransferJob(5, [3], [0]), r"keys\[0\]: a key must be bytes or str, got int 3"),  # type: ignore[list-item]
    (TransferJob(5, [""], [0]), r"keys\[0\]: a key must not be empty"),
    # (<name_prefix>: the tier's, which starts every object name)
    (TransferJob(5, ["a", "a"], [0, 1]),
     r"keys\[0\] and keys\[1\] name the same block '<name_prefix>a'"),
    (TransferJob(5, ["6b", b"k"], [0, 1]), "name the same block '<name_prefix>6b'"),
    (TransferJob(5, "ab", [0, 1]), "keys must be a list or tuple, got str 'ab'"),
    (TransferJob(5, None, [0]), "keys must be a list or tuple, got NoneType"),  # type: ignore[arg-type]
    (TransferJob(5, ["a"], 0), "block_ids must be a list or tuple, got int 0"),  # type: ignore[arg-type]
    (TransferJob(5, ["a"], [True]), r"block_ids\[0\] is True, not an int"),
    (TransferJob(5, ["a"], [0], is_promotion=True), "submit it with submit_load"),
    (TransferJob("5", ["a"], [0]), "job_id must be an int"),  # type: ignore[arg-type]
])
def test_bad_input_is_refused_by_name_and_changes_nothing(
    tier: ObjectStoreTier, agent: FakeNixlAgent, job: TransferJob, message: str
) -> None:
    calls_before = list(agent.calls)
    with pytest.raises(InvalidJobError,
                       match=message.replace("<name_prefix>", re.escape(tier.name_prefix))):
        tier.submit_store(job)
    assert agent.calls == calls_before
    assert not tier.has_pending_work()
    assert tier.state_of(5) is None
    assert tier.get_finished_jobs() == []


def test_a_duplicate_job_id_is_refused_while_in_flight_or_uncollected(
    tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    agent.inject("check_xfer_state", StayProc(1))
    tier.submit_store(store(1, 0))
    with pytest.raises(InvalidJobError, match="job 1 is already in flight"):
        tier.submit_store(store(1, 1))
    tier.drain_jobs(timeout=5)
    with pytest.raises(InvalidJobError, match="job 1 has a result not yet collected"):
        tier.submit_store(store(1, 1))
    assert [r.job_id for r in tier.get_finished_jobs()] == [1]
    tier.submit_store(store(1, 1))  # collected: the id may be used again
    assert [r.job_id for r in results_until_idle(tier)] == [1]


def test_numpy_and_torch_integers_are_block_ids(
    tier: ObjectStoreTier, primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    tier.submit_store(TransferJob(1, ["a", "b"], [np.int64(2), torch.tensor(3)]))
    (result,) = results_until_idle(tier)
    assert result.success
    assert agent.objects[tier.object_key("b")] == primary[3].numpy().tobytes()


def test_a_load_into_the_same_block_twice_is_refused(tier: ObjectStoreTier) -> None:
    with pytest.raises(InvalidJobError, match="same block twice"):
        tier.submit_load(TransferJob(1, ["a", "b"], [0, 0], is_promotion=True))


@pytest.mark.parametrize(("primary", "message"), [
    (torch.zeros(4, 8).t(), "contiguous"),
    (torch.zeros(0, 8), "first dimension of blocks"),
    ("not a tensor", "torch.Tensor"),
])
def test_a_bad_primary_cache_is_refused(
    agent: FakeNixlAgent, primary: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ObjectStoreTier(primary, agent=agent)  # type: ignore[arg-type]
    assert agent.calls == []


def test_object_keys_name_the_block_key(primary: torch.Tensor, agent: FakeNixlAgent) -> None:
    tier = ObjectStoreTier(primary, agent=agent, key_prefix="kv/")
    assert tier.name_prefix == "kv/256-bytes/"  # the prefix, then the block size's folder
    assert tier.object_key("layer0/block7") == "kv/256-bytes/layer0/block7"
    assert tier.object_key(b"\x01\xff") == "kv/256-bytes/01ff"
    with pytest.raises(ValueError, match="bytes or str"):
        tier.object_key(7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be empty"):
        tier.object_key(b"")
    tier.shutdown()


@pytest.mark.parametrize("capacity", [None, 4 * 256])
@pytest.mark.parametrize(("keys", "message"), [
    (["x", 3], "bytes or str, got int 3"),
    ([None], "bytes or str, got NoneType"),
    ([""], "must not be empty"),
    ([b""], "must not be empty"),
    ([["nested"]], "bytes or str, got list"),
    (["a\udc80"], "lone surrogate"),
])
def test_touch_refuses_a_bad_key_with_or_without_a_capacity(
    primary: torch.Tensor, agent: FakeNixlAgent, capacity: int | None, keys: list[Any],
    message: str,
) -> None:
    """touch() says it refuses a key that is not a non-empty str or bytes; without a capacity
    it took any (only a tier counting its blocks named them), so an engine's wrong keys went
    unnoticed until a capacity was set."""
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=capacity,
                           remove=None if capacity is None else (lambda names: 0))
    with pytest.raises(ValueError, match=message):
        tier.touch(keys)
    tier.touch(["fine", b"also-fine", "caf\u00e9"])  # (keys the tier does not hold: ignored)
    tier.shutdown()


def test_a_subclass_that_names_its_objects_is_obeyed_by_transfers_and_lookups(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """Two layouts keep their blocks apart by naming them in a subclass (``object_key``).
    Every name the tier uses is the subclass's: a store lands under it, and the other
    layout's tier, whose name for the key holds nothing, neither finds nor loads it (the
    base class's names were once used for transfers whatever the subclass said, so the
    other layout loaded these bytes as a success)."""

    class Layout(ObjectStoreTier):
        def __init__(self, name: str) -> None:
            self.layout = name
            super().__init__(primary, agent=agent,
                             probe_agent=FakeNixlAgent(f"probe-{name}", objects=agent.objects))

        def object_key(self, key: bytes | str) -> str:
            return f"{self.layout}/{super().object_key(key)}"

    first, second = Layout("a"), Layout("b")
    first.submit_store(TransferJob(1, ["k"], [1]))
    assert [r.success for r in results_until_idle(first)] == [True]
    assert sorted(agent.objects) == [f"a/{first.name_prefix}k"]
    assert first.remote_name("k") == f"a/{first.name_prefix}k"
    assert first.lookup("k") is Lookup.HIT

    primary[2] = -1.0
    second.submit_load(TransferJob(2, ["k"], [2], is_promotion=True))
    assert [r.success for r in results_until_idle(second)] == [False]
    assert bool((primary[2] == -1.0).all()), "no byte of the other layout landed"
    first.shutdown()
    second.shutdown()

    third = ObjectStoreTier(primary, agent=agent)  # named on the instance, not in a subclass
    third.object_key = lambda key: f"c/{key}"  # type: ignore[method-assign]
    third.submit_store(TransferJob(3, ["k"], [1]))
    assert [r.success for r in results_until_idle(third)] == [True]
    assert sorted(agent.objects) == [f"a/{first.name_prefix}k", "c/k"]
    third.shutdown()

    fourth = ObjectStoreTier(primary, agent=agent)  # remote_name, on the instance
    fourth.remote_name = lambda key: f"d/{key}"  # type: ignore[method-assign]
    fourth.submit_store(TransferJob(4, ["k"], [1]))
    assert [r.success for r in results_until_idle(fourth)] == [True]
    assert "d/k" in agent.objects, sorted(agent.objects)
    fourth.shutdown()
    for size_folder in (None, 0, "no"):
        with pytest.raises(ValueError, match="size_folder must be True or False"):
            ObjectStoreTier(primary, agent=agent, size_folder=size_folder)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_a_key_prefix_ending_in_a_digit_is_refused_where_it_runs_into_the_size_folder(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """Prefix "1" with 2,048-byte blocks would name key k "12048-bytes/k", as prefix "" with
    12,048-byte blocks does: each tier would load a part of the other's blocks as a success.
    With the size's folder a prefix may not end in a digit; without it (the old layout, or
    vLLM's folders) it may, and one that ends otherwise is taken as it is."""
    for prefix in ("1", "kv/run2", "model-7"):
        with pytest.raises(ValueError, match=rf"key_prefix {prefix!r} ends in a digit, which "
                           rf"runs into the block size's folder \({prefix}256-bytes/"):
            ObjectStoreTier(primary, agent=agent, key_prefix=prefix)
    assert agent.live_registrations() == 0, "a refused tier registers nothing"
    for prefix, size_folder, name_prefix in (("1", False, "1"), ("run2-", True, "run2-256-bytes/"),
                                             ("kv/2/", True, "kv/2/256-bytes/")):
        tier = ObjectStoreTier(primary, agent=agent, key_prefix=prefix, size_folder=size_folder)
        assert tier.name_prefix == name_prefix
        tier.shutdown()


@pytest.mark.timeout(10)
def test_a_key_prefix_holding_a_size_folder_is_refused_where_another_tier_names_under_it(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """A tier of 256-byte blocks on prefix "kv/" names key "512-bytes/k" as a tier of 512-byte
    blocks on prefix "kv/256-bytes/" would name key "k": the larger tier would load the
    smaller one's object into half of its block as a success. Such a prefix is refused."""
    short = ObjectStoreTier(primary, agent=agent, key_prefix="kv/")
    assert short.object_key("512-bytes/k") == "kv/256-bytes/512-bytes/k"
    wide = torch.zeros(4, 128, dtype=torch.float32)  # 512-byte blocks
    for prefix in ("kv/256-bytes/", "kv-256-bytes/", "a/1-bytes/b/"):
        folder = re.search(r"\d+-bytes/", prefix)[0]  # type: ignore[index]
        with pytest.raises(ValueError, match=rf"key_prefix {prefix!r} holds a block size's "
                                             rf"folder \('{folder}'\)"):
            ObjectStoreTier(wide, agent=agent, key_prefix=prefix)
    assert agent.live_registrations() == 1, "only the first tier's cache is registered"
    for prefix, name_prefix in (("kv/256-bytes/", "kv/256-bytes/"),
                                ("kv/x-bytes/", "kv/x-bytes/512-bytes/")):
        tier = ObjectStoreTier(wide, agent=agent, key_prefix=prefix,
                               size_folder=name_prefix != prefix)
        assert tier.name_prefix == name_prefix
        tier.shutdown()
    short.shutdown()


@pytest.mark.timeout(30)
def test_a_tier_of_another_block_size_on_the_same_prefix_neither_finds_nor_loads_its_blocks(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """A tier of 256-byte blocks and one of 512-byte blocks share a bucket and a key prefix.
    Each keeps its objects in its block size's folder: the 512-byte tier's probe finds
    nothing under k, its load of k fails and leaves its block as it was, and its own k is
    another object. Without the folders (``size_folder=False``, the old layout) both name k
    alike: the 512-byte tier's probe finds the 256-byte object, a HIT, and its load reads
    what the object has into the first half of its block, as real NIXL's OBJ backend does,
    and answers DONE: the second half keeps what it held. The tier sees the block's end still
    as it marked it before the load, and fails the load, saying the object is short, rather
    than publish those bytes as a success; the mark is taken off again."""
    wide = torch.arange(4 * 128, dtype=torch.float32).neg().view(4, 128)  # 512-byte blocks

    def tiers(size_folder: bool) -> tuple[ObjectStoreTier, ObjectStoreTier]:
        """The 256-byte tier and the 512-byte one, on the agent's objects, prefix "kv/"."""
        def tier(cache: torch.Tensor) -> ObjectStoreTier:
            probe = FakeNixlAgent(f"probe-{cache[0].nbytes}", objects=agent.objects)
            return ObjectStoreTier(cache, agent=agent, key_prefix="kv/",
                                   size_folder=size_folder, probe_agent=probe)
        return tier(primary), tier(wide)

    small, large = tiers(size_folder=True)
    try:
        small.submit_store(TransferJob(1, ["k"], [1]))
        assert [r.success for r in results_until_idle(small)] == [True]
        assert agent.objects == {"kv/256-bytes/k": primary[1].numpy().tobytes()}

        assert wait_for_verdict(large, "k") is Lookup.MISS
        before = wide.clone()
        large.submit_load(TransferJob(2, ["k"], [2], is_promotion=True))
        assert [r.success for r in results_until_idle(large)] == [False]
        assert torch.equal(wide, before), "no byte of the 256-byte block landed"

        large.submit_store(TransferJob(3, ["k"], [0]))  # its own k, beside the other's
        assert [r.success for r in results_until_idle(large)] == [True]
        assert sorted(agent.objects) == ["kv/256-bytes/k", "kv/512-bytes/k"]
        small.submit_load(TransferJob(4, ["k"], [5], is_promotion=True))
        assert [r.success for r in results_until_idle(small)] == [True]
        assert torch.equal(primary[5], primary[1])
    finally:
        small.shutdown(timeout=5)
        large.shutdown(timeout=5)

    agent.objects.clear()
    small, large = tiers(size_folder=False)  # the old layout: one name for both sizes
    try:
        small.submit_store(TransferJob(5, ["k"], [1]))
        assert [r.success for r in results_until_idle(small)] == [True]
        assert agent.objects == {"kv/k": primary[1].numpy().tobytes()}

        assert wait_for_verdict(large, "k") is Lookup.HIT, "the other size's object"
        before = wide.clone()
        large.submit_load(TransferJob(6, ["k"], [2], is_promotion=True))
        [result] = results_until_idle(large)
        assert not result.success
        assert result.reason is not None and result.reason.call == "landed"
        assert result.reason.error.startswith(
            "ShortObjectError: 1 object(s) shorter than a block of 512 bytes: 'kv/k'")
        assert wide[2, :64].numpy().tobytes() == primary[1].numpy().tobytes()
        assert torch.equal(wide[2, 64:], before[2, 64:]), "the rest is what it held"
    finally:
        small.shutdown(timeout=5)
        large.shutdown(timeout=5)


def test_a_machine_that_acts_on_proc_gets_every_proc_answer_fired(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """The PROC fast path applies only where the table declares PROC a stay."""
    polls: list[int] = []
    transitions = [
        {**t, "after": "note_poll"} if (t["source"], t["trigger"], t.get("conditions")) == (
            TransferState.PROCESSING, "poll", "running") else t
        for t in TRANSITIONS]
    counting = Declaration(
        "counting", states=TransferState, initial=TransferState.SUBMITTED, answers=ANSWERS,
        guards=GUARDS, transitions=transitions,
        actions={**ACTIONS, "note_poll": lambda t, answer, detail: polls.append(t.job_id)},
        final=TRANSFER_MACHINE.final, failure_states=TRANSFER_MACHINE.failure_states,
        effects=TRANSFER_MACHINE.effects, running=TRANSFER_MACHINE.running)
    tier = ObjectStoreTier(primary, agent=agent, machine=counting)
    agent.inject("check_xfer_state", StayProc(3))
    tier.submit_store(store(1, 0))
    assert results_until_idle(tier)[0].success
    assert polls == [1, 1, 1]
    assert agent.call_count("check_xfer_state") == 4, "one check per poll round, no more"
    tier.shutdown()


class InterruptedAfterPost(FakeNixlAgent):
    """The fake agent, with the post numbered ``armed`` cut short by a KeyboardInterrupt right
    after NIXL took it (a signal handled as the call returned)."""

    armed = 0

    def transfer(self, *args: Any, **kwargs: Any) -> str:
        status = super().transfer(*args, **kwargs)
        if self.call_count("transfer") == self.armed:
            raise KeyboardInterrupt
        return status


@pytest.mark.parametrize("cut", [1, 2])
def test_a_job_whose_posts_an_interrupt_cut_short_fails_and_holds_nothing(
    primary: torch.Tensor, cut: int,
) -> None:
    """The interrupt lands after block ``cut - 1``'s post: the blocks after it were never
    posted, so the job fails (it once published success, with their objects never written),
    once the posted ones are over; each handle is released once."""
    agent = InterruptedAfterPost("interrupted")
    agent.armed = cut
    tier = ObjectStoreTier(primary, agent=agent)
    with pytest.raises(KeyboardInterrupt):
        tier.submit_store(store(1, 0, 1, 2))
    assert tier.owes(1)
    (result,) = results_until_idle(tier)
    assert result.success is False
    assert sorted(agent.objects) == [tier.object_key(f"key-{b}") for b in range(cut)], (
        "only those posted")
    assert agent.call_count("release_xfer_handle") == 3
    tier.shutdown(timeout=5)
    assert_nothing_held_but_recorded_leaks(tier, agent)
    assert agent.misuses == []
    agent.close()


class SecondBlocksRunOn(FakeNixlAgent):
    """The fake agent, whose transfers of a job's second block keep running while ``hold``."""

    hold = True
    held = 0

    def __init__(self) -> None:
        super().__init__("second-blocks")
        self.slow: set[int] = set()

    def make_prepped_xfer(self, operation: str, local: Any, local_indices: Any, remote: Any,
                          remote_indices: Any, *args: Any) -> Any:
        handle = super().make_prepped_xfer(operation, local, local_indices, remote,
                                           remote_indices, *args)
        if list(remote_indices) == [1]:
            self.slow.add(id(handle))
        return handle

    def check_xfer_state(self, handle: Any) -> str:
        if self.hold and id(handle) in self.slow:
            self.held += 1
            return "PROC"
        return super().check_xfer_state(handle)


def test_a_job_whose_first_block_is_over_is_asked_through_a_block_still_running() -> None:
    """200 jobs of two blocks, each first block over at its first check, each second one
    running on. A job's first transfer would answer DONE at every poll: the oldest-first
    checks took each as ended and walked all 200 jobs, asking both handles of each (400 checks
    a poll). The one still running takes the first's place, answers PROC, and a poll asks
    about what the schedule picks."""
    agent = SecondBlocksRunOn()
    # (the sweep's share of checks grows with the time between polls: an hour's turn keeps it
    # near none, however slowly the code runs)
    tier = ObjectStoreTier(torch.zeros(400, 8), agent=agent,
                           policy=RetryPolicy(max_unpolled=3600.0))
    for job_id in range(200):
        tier.submit_store(store(job_id, 2 * job_id, 2 * job_id + 1))
    assert tier.get_finished_jobs() == []  # each first block over, each second running

    def checks() -> int:
        return agent.call_count("check_xfer_state") + agent.held

    before = checks()
    assert tier.get_finished_jobs() == []
    assert checks() - before <= 2 * FRONT_BATCH, "the oldest-first checks stop at PROC"
    agent.hold = False
    results = results_until_idle(tier, polls=200)
    assert sorted(r.job_id for r in results if r.success) == list(range(200))
    assert agent.call_count("release_xfer_handle") == 400
    tier.shutdown(timeout=5)
    assert agent.misuses == []
    agent.close()


# -- object names NIXL sends as they are ---------------------------------------------------------

def _sent_as_it_is(text: str) -> bool:
    """The definition: not empty, no leading "%", no line feed, no empty, "." or ".." part
    between slashes (one trailing "/" is sent as it is)."""
    parts = text.split("/")
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()
    return (bool(text) and text[0] != "%" and "\n" not in text
            and all(part not in ("", ".", "..") for part in parts))


def test_the_one_call_that_tells_plain_object_names_agrees_with_their_definition() -> None:
    """Every text of up to six characters over the ones that matter: the name is the text
    itself exactly when NIXL sends it as it is, and otherwise starts with "%" and holds no
    "/"; no two texts share a name."""
    from itertools import product  # noqa: PLC0415

    from kvfsm.tiers.object_store import _plain, object_text  # noqa: PLC0415

    names: dict[str, str] = {}
    for length in range(1, 7):
        for chars in product("a./%\n", repeat=length):
            text = "".join(chars)
            assert (_plain(text) is not None) is _sent_as_it_is(text), text
            name = object_text(text)
            if _sent_as_it_is(text):
                assert name == text
            else:
                assert name.startswith("%") and "/" not in name, (text, name)
            assert names.setdefault(name, text) == text, f"{text!r} and {names[name]!r}"
    assert len(names) == sum(5 ** n for n in range(1, 7))


def test_a_key_or_a_prefix_no_object_name_can_hold_is_refused_naming_it() -> None:
    """A key with a lone surrogate (bytes decoded with ``surrogateescape``) has no UTF-8: a
    store of it was taken, and failed once NIXL was asked to cast the name. It is refused at
    submit, naming the key and where the surrogate is, nothing registered; so is a key prefix
    holding one, or a line feed (a key with a line feed is quoted: the store test on real
    NIXL stores and loads one)."""
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(torch.zeros(4, 16), agent=agent)
    registered = agent.call_count("register_memory")
    with pytest.raises(InvalidJobError, match=re.escape(
            "job 1: keys[1]: key 'a\\udcffb' holds a lone surrogate at position 1 "
            "('\\udcff'): it is not UTF-8 text")):
        tier.submit_store(TransferJob(1, ["k", "a\udcffb"], [0, 1]))
    assert agent.call_count("register_memory") == registered and not tier.has_pending_work()
    assert tier.remote_name("a\nb") == "64-bytes/%a%0Ab"
    for prefix, why in (("kv\n/", "holds a line feed"), ("kv\ud800/", "lone surrogate")):
        with pytest.raises(ValueError, match=f"key_prefix {re.escape(repr(prefix))} .*{why}"):
            ObjectStoreTier(torch.zeros(4, 16), agent=FakeNixlAgent(), key_prefix=prefix)
    tier.submit_store(TransferJob(1, ["k"], [0]))  # the job id was not taken
    tier.drain_jobs(5)
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    tier.shutdown(5)


def test_a_bucket_check_that_could_not_start_leaves_the_next_failure_its_own(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The bucket check after a failure NIXL's OBJ backend tells nothing of was switched off
    for good when its thread could not start (no thread to be had, or a Ctrl-C in its start):
    the next failure now checks again."""
    import threading  # noqa: PLC0415
    import types  # noqa: PLC0415

    from kvfsm.nixl_agents import StoreConfig  # noqa: PLC0415
    from kvfsm.tiers import object_store  # noqa: PLC0415
    from kvfsm.transfer import FailureKind, FailureReason  # noqa: PLC0415

    def failed(job_id: int) -> Any:  # (what the book reads of a transfer real NIXL failed)
        return types.SimpleNamespace(
            job_id=job_id, job=types.SimpleNamespace(is_promotion=True),
            reason=FailureReason(FailureKind.RAISED, "check_xfer_state",
                                 "nixlBackendError: NIXL_ERR_BACKEND", "nixlBackendError"))

    monkeypatch.setattr(object_store, "EXPLAIN_EVERY", 0.0)  # (a check after each failure)
    explainer = object_store._Explainer(StoreConfig("b", endpoint="http://127.0.0.1:9"))
    checked: list[int] = []
    monkeypatch.setattr(explainer, "_check_bucket", lambda job_id, kind: checked.append(job_id))

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", no_thread)
        first = failed(1)
        explainer(first)  # logged, not raised: the job goes on with its explained reason
    assert "a request to bucket 'b' at http://127.0.0.1:9" in first.reason.error
    assert "the bucket check after job 1's failure could not start: RuntimeError" in caplog.text
    explainer(failed(2))
    deadline = time.monotonic() + 10
    while not checked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert checked == [2]
