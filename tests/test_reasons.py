"""A failed job says why: the call that failed and its error, or the declared reason, in its
result and in its trace, with no logger set up."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch

from kvfsm import JobResult, TransferJob
from kvfsm.lifecycle import TRANSFER_MACHINE
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, Raise, ReturnErr, StayProc
from kvfsm.tiers import FileTier, ObjectStoreTier
from kvfsm.trace import TraceRecorder, read_traces, replay, trace_reason
from kvfsm.transfer import FailureKind, FailureReason, Transfer

from .real_nixl import require_nixl
from .test_cli import read_only_dir

BACKEND = "FakeNixlError: NIXL_ERR_BACKEND"


def store(job_id: int, *blocks: int) -> TransferJob:
    return TransferJob(job_id, [f"key-{b}" for b in blocks], list(blocks))


def results_of(tier: ObjectStoreTier | FileTier, jobs: int, polls: int = 200
               ) -> dict[int, JobResult]:
    results: dict[int, JobResult] = {}
    for _ in range(polls):
        results.update((r.job_id, r) for r in tier.get_finished_jobs())
        if len(results) == jobs:
            break
    assert len(results) == jobs, f"only {sorted(results)} published"
    return results


# -- the reason in the result ---------------------------------------------------------------------

def test_a_success_has_no_reason_and_a_failure_names_the_call_and_its_error(
    tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    tier.submit_store(store(1, 0))
    tier.submit_store(store(2, 1))
    agent.inject("check_xfer_state", Raise(), at=2)  # polled in order: job 2's first check
    results = results_of(tier, 2)
    assert results[1].success and results[1].reason is None
    assert not results[2].success
    assert results[2].reason == FailureReason(FailureKind.RAISED, "check_xfer_state", BACKEND)
    assert str(results[2].reason) == f"check_xfer_state raised {BACKEND}"


@pytest.mark.parametrize(("code", "error_type"), [
    ("NIXL_ERR_BACKEND", "FakeNixlError"),
    ("NIXL_ERR_REMOTE_DISCONNECT", "nixlRemoteDisconnectError"),  # NIXL's own type, faked
])
def test_a_reason_keeps_the_type_of_what_was_raised_beside_its_text(
    code: str, error_type: str, tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    agent.inject("transfer", Raise(code))
    tier.submit_store(store(1, 0))
    tier.submit_store(store(2, 1))
    results = results_of(tier, 2)
    assert results[1].reason is not None and results[2].reason is None
    assert results[1].reason.error_type == error_type
    assert results[1].reason.error == f"{error_type}: {code}"
    assert results[1].reason == FailureReason(FailureKind.RAISED, "transfer",
                                              f"{error_type}: {code}"), "it explains, apart"
    assert "type" not in json.dumps(results[1].reason.as_dict()), "traces read as before"


def test_a_quarantined_release_keeps_the_type_of_its_last_error(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(max_attempts=3))
    agent.inject("release_xfer_handle", Raise("NIXL_ERR_REMOTE_DISCONNECT"), times=3)
    tier.submit_store(store(7, 0))
    (result,) = results_of(tier, 1).values()
    assert result.reason is not None and result.reason.kind is FailureKind.QUARANTINED
    assert result.reason.error_type == "nixlRemoteDisconnectError"
    tier.shutdown(timeout=0)


@pytest.mark.parametrize("call", ["register_memory", "prep_xfer_dlist", "make_prepped_xfer",
                                  "transfer"])
def test_each_submit_call_that_raises_is_named(
    call: str, tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    agent.inject(call, Raise("NIXL_ERR_NOT_FOUND"))  # the next call: this job's
    tier.submit_store(store(3, 0, 1))
    (result,) = results_of(tier, 1).values()
    assert result.reason == FailureReason(FailureKind.RAISED, call,
                                          "FakeNixlError: NIXL_ERR_NOT_FOUND")


@pytest.mark.parametrize("call", ["transfer", "check_xfer_state"])
def test_a_status_call_answering_err_is_named(
    call: str, tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    agent.inject(call, ReturnErr())
    tier.submit_store(store(4, 2))
    (result,) = results_of(tier, 1).values()
    assert result.reason == FailureReason(FailureKind.ERR, call, "answered 'ERR'")
    assert str(result.reason) == f"{call} answered 'ERR'"


def test_a_load_of_a_missing_object_says_what_nixl_raised(tier: ObjectStoreTier) -> None:
    tier.submit_load(TransferJob(5, ["never-stored"], [0], is_promotion=True))
    (result,) = results_of(tier, 1).values()
    assert result.reason == FailureReason(FailureKind.RAISED, "check_xfer_state", BACKEND)


def test_a_cancelled_job_says_cancelled(tier: ObjectStoreTier, agent: FakeNixlAgent) -> None:
    agent.inject("check_xfer_state", StayProc(3))
    tier.submit_store(store(6, 0))
    tier.get_finished_jobs()
    tier.cancel(6)
    (result,) = results_of(tier, 1).values()
    assert result.reason == FailureReason(FailureKind.CANCELLED, None, "cancelled")


def test_a_release_past_its_retry_bound_is_quarantined_with_its_last_error(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(max_attempts=3))
    agent.inject("release_xfer_handle", Raise(), times=3)
    tier.submit_store(store(7, 0))
    (result,) = results_of(tier, 1).values()
    assert not result.success, "finished, but quarantined: a failure"
    assert result.reason == FailureReason(
        FailureKind.QUARANTINED, "release_xfer_handle",
        f"retry bound spent; last error: {BACKEND}")
    tier.shutdown(timeout=0)


def test_the_shutdown_deadline_is_the_reason_of_a_job_it_quarantines(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    tier = ObjectStoreTier(primary, agent=agent,
                           policy=RetryPolicy(max_seconds=None, backoff=0.01))
    agent.inject("release_xfer_handle", Raise(), times=10**6)
    tier.submit_store(store(8, 0))
    tier.get_finished_jobs()  # DONE; its release raises, and is retried
    tier.shutdown(timeout=0.05)
    (result,) = results_of(tier, 1).values()
    assert result.reason is not None
    assert (result.reason.kind, result.reason.call) == (FailureKind.QUARANTINED,
                                                       "release_xfer_handle")
    assert result.reason.error == f"shutdown deadline passed; last error: {BACKEND}"
    agent.clear_faults()


def test_a_job_that_failed_before_its_release_was_quarantined_keeps_its_first_reason(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """The reason is latched with the outcome, once: the failure it published first."""
    tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(max_attempts=2))
    agent.inject("check_xfer_state", ReturnErr())
    agent.inject("release_xfer_handle", Raise(), times=2)
    tier.submit_store(store(9, 0))
    (result,) = results_of(tier, 1).values()
    assert result.reason == FailureReason(FailureKind.ERR, "check_xfer_state", "answered 'ERR'")
    tier.shutdown(timeout=0)


def test_the_reason_takes_no_part_in_comparing_results() -> None:
    """Existing constructors and comparisons keep working: the reason defaults to None."""
    reason = FailureReason(FailureKind.RAISED, "transfer", BACKEND)
    assert JobResult(1, False) == JobResult(1, False, 0, 0.0, reason)
    assert JobResult(1, False).reason is None


def test_a_failure_no_action_explained_still_has_a_reason() -> None:
    """A lifecycle with actions of its own may latch failure without a reason: the result
    still carries one, with the last error."""
    transfer = Transfer(TransferJob(1, ["k"], [0]), nbytes=8, started_at=0.0)
    transfer.success, transfer.error = False, "RuntimeError: boom"
    assert transfer.result().reason == FailureReason(FailureKind.UNKNOWN, None,
                                                     "RuntimeError: boom")


# -- a real failure through real NIXL -------------------------------------------------------------

def test_a_store_into_a_read_only_directory_says_which_call_and_why() -> None:
    require_nixl()
    root = read_only_dir()
    tier = FileTier(torch.zeros(4, 64, dtype=torch.uint8), root, durable=False)
    try:
        tier.submit_store(TransferJob(1, ["blk"], [0]))
        (result,) = results_of(tier, 1).values()
    finally:
        tier.shutdown(timeout=5)
    assert not result.success
    assert result.reason is not None
    assert (result.reason.kind, result.reason.call) == (FailureKind.RAISED, "open")
    error_type, _, text = result.reason.error.partition(": ")
    assert issubclass(getattr(builtins, error_type), OSError), result.reason
    assert root in text, "the error names the file it could not create"


# -- the reason in traces -------------------------------------------------------------------------

def test_traces_record_why_a_job_failed_and_replay(
    tmp_path: Path, tier: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    path = tmp_path / "t.jsonl"
    with TraceRecorder(path) as recorder:
        tier.on_published.append(recorder)
        tier.submit_store(store(1, 0))
        agent.inject("transfer", Raise())
        tier.submit_store(store(2, 1))
        results_of(tier, 2)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["job_id"], line["success"], line["reason"]) for line in lines] == [
        (2, False, {"kind": "raised", "call": "transfer", "error": BACKEND}),
        (1, True, None)]
    traces = list(read_traces(path))
    assert [trace_reason(t) for t in traces] == [
        FailureReason(FailureKind.RAISED, "transfer", BACKEND), None]
    assert all(replay(TRANSFER_MACHINE, t) is None for t in traces)


def test_a_trace_written_before_reasons_were_still_replays(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    path.write_text('{"machine":"transfer","job_id":3,"steps":[["post","RAISED","SUBMITTED",'
                    '"FAILED",0.0],["release","OK","FAILED","XFER_RELEASED",0.1],["clean","OK",'
                    '"XFER_RELEASED","CLEANED",0.1],["publish","OK","CLEANED","PUBLISHED",0.1]]}\n')
    (trace,) = read_traces(path)
    assert trace_reason(trace) is None
    assert replay(TRANSFER_MACHINE, trace) is None


def test_a_trace_whose_reason_is_not_one_is_refused_by_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"machine":"transfer","job_id":1,"steps":[],"reason":null}\n'
                    '{"machine":"transfer","job_id":2,"steps":[],"reason":{"kind":"bored"}}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a trace \(a reason has a kind"):
        list(read_traces(path))


def test_the_tiering_manager_hands_the_reason_on_with_the_finalized_job(
    agent: FakeNixlAgent,
) -> None:
    from kvfsm.tiering import CPUPrimaryTier, TieringManager  # noqa: PLC0415

    primary = CPUPrimaryTier(4, 256, torch.uint8)
    tier = ObjectStoreTier(primary.cache, agent=agent)
    manager = TieringManager(primary, [tier])
    (block,) = primary.allocate(["k"])
    primary.complete_write([block], True)
    agent.inject("make_prepped_xfer", Raise())
    manager.store([block])
    finalized = manager.drain(timeout=5)
    assert [(f.success, str(f.reason)) for f in finalized] == [
        (False, f"make_prepped_xfer raised {BACKEND}")]
    manager.shutdown(timeout=5)


def test_a_job_shutdown_cancelled_says_shutdown_did(tier: ObjectStoreTier,
                                                    agent: FakeNixlAgent) -> None:
    """A job failed by shutdown() is told from one the caller cancelled: the reason's kind is
    the same (CANCELLED), its words say what cancelled it (both said "cancelled")."""
    agent.inject("check_xfer_state", StayProc(3))
    tier.submit_store(store(7, 0))
    tier.get_finished_jobs()
    tier.shutdown(timeout=5)
    (result,) = tier.get_finished_jobs()
    assert result.reason == FailureReason(FailureKind.CANCELLED, None, "cancelled by shutdown()")
    assert str(result.reason) == "cancelled by shutdown()"
