"""The lifecycle's actions and reasons where mutmut found them untested (docs/testing.md,
"Mutation testing"), and a user step's answers as the driver takes them.

* ``FailureReason.from_dict`` refuses each malformed field on its own (mutants that join the
  three checks with ``and`` or invert the test of ``call``), and says what it wants;
* ``note_error``, run when NIXL answers ERR for a transfer cancelled while it ran, keeps what
  NIXL said and nothing when it said nothing (mutants that invert the test or drop the detail);
* a step that answers what its event does not carry fails its job with a ``TypeError`` naming
  the step and the answer (mutants that weaken the check or lose the message), and a step's
  plain answer carries no reason (a mutant that always wraps one).
"""

from __future__ import annotations

import enum
from typing import Any

import pytest
import torch

from kvfsm import TRANSFER_MACHINE, FailureKind, FailureReason, Transfer, TransferJob
from kvfsm.lifecycle import Answer, TransferEvent, TransferState
from kvfsm.machines.transfer import CallFailed, OutcomeAlreadyLatched
from kvfsm.testing import FakeNixlAgent
from kvfsm.tiers import ObjectStoreTier

from .test_mutants_extend import Checked, verify_like

S, E, A = TransferState, TransferEvent, Answer

GOOD = {"kind": "err", "call": "check_xfer_state", "error": "answered 'ERR'"}


@pytest.mark.parametrize("field", [
    {"kind": "nope"}, {"error": 5}, {"error": None}, {"call": 5}, {"call": b"x"}])
def test_each_malformed_field_of_a_reason_alone_is_refused(field: dict[str, Any]) -> None:
    data = {**GOOD, **field}
    with pytest.raises(ValueError) as refused:
        FailureReason.from_dict(data)
    assert str(refused.value) == (
        "a reason has a kind (raised, err, cancelled, quarantined, unknown), a call (text or "
        f"null) and an error (text), got {data!r}")


def test_a_reason_without_a_call_is_read_back() -> None:
    assert FailureReason.from_dict({**GOOD, "call": None}) == FailureReason(
        FailureKind.ERR, None, "answered 'ERR'")
    assert FailureReason.from_dict(GOOD) == FailureReason(FailureKind.ERR, "check_xfer_state",
                                                          "answered 'ERR'")


def test_a_reason_that_is_no_mapping_says_what_it_got() -> None:
    with pytest.raises(ValueError) as refused:
        FailureReason.from_dict(["err"])
    assert str(refused.value) == "a reason is a mapping, got ['err']"


def cancelled_transfer() -> tuple[Any, Transfer]:
    machine = TRANSFER_MACHINE.compile(listen=False)
    transfer = Transfer(TransferJob(7, ["k"], [0]), nbytes=64, started_at=0.0)
    transfer.state = S.PROCESSING
    machine.fire(transfer, E.CANCEL, A.OK)
    assert transfer.state is S.CANCELLING and transfer.error == "cancelled"
    return machine, transfer


def test_an_error_answered_while_cancelling_is_kept_beside_the_cancelled_reason() -> None:
    machine, transfer = cancelled_transfer()
    machine.fire(transfer, E.POLL, A.ERR, CallFailed("check_xfer_state", "ERR"))
    assert transfer.state is S.FAILED
    assert transfer.error == "check_xfer_state answered 'ERR'"
    assert transfer.reason is not None and transfer.reason.kind is FailureKind.CANCELLED


def test_an_error_answered_with_nothing_said_while_cancelling_keeps_the_error_there_was() -> None:
    machine, transfer = cancelled_transfer()
    machine.fire(transfer, E.POLL, A.ERR)
    assert transfer.state is S.FAILED
    assert transfer.error == "cancelled"


class Stranger(enum.Enum):
    GOOD = "GOOD"


def run_one_store(step: Any) -> Any:
    agent = FakeNixlAgent(name="steps")
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent, machine=verify_like(),
                           steps={"verify": step})
    tier.submit_store(TransferJob(1, ["a"], [0]))
    results: list[Any] = []
    for _ in range(1000):
        results += tier.get_finished_jobs()
        if results:
            break
    tier.shutdown(timeout=5)
    assert agent.misuses == []
    (result,) = results
    return result


_NOT_CARRIED = "which is not one of its event's answers (Checked.BAD, Checked.GOOD)"


@pytest.mark.parametrize(("answered", "message"), [
    (Stranger.GOOD, f"tests.test_mutants_lifecycle.Stranger.GOOD, {_NOT_CARRIED}"),
    ((Stranger.GOOD, "why"), f"tests.test_mutants_lifecycle.Stranger.GOOD, {_NOT_CARRIED}"),
    (Answer.RAISED, "Answer.RAISED, which a step answers by raising an exception, not by "
                    "returning it; it returns one of Checked.BAD, Checked.GOOD"),
    ("GOOD", f"str 'GOOD', {_NOT_CARRIED}; answer the member Checked.GOOD, not its name")])
def test_a_step_answering_what_its_event_does_not_carry_fails_its_job_naming_it(
        answered: Any, message: str) -> None:
    result = run_one_store(lambda transfer, primary: answered)
    assert not result.success
    assert result.reason == FailureReason(FailureKind.ERR, "verify", f"answered {message}")
    assert str(result.reason) == f"verify answered {message}", "it returned, it did not raise"


def test_a_step_answering_plainly_or_with_a_reason_is_named_in_the_failure() -> None:
    """A failing answer given alone names the step and what it answered (it used to be an
    UNKNOWN reason, "failed: BAD", naming no step); one given with a why says that too."""
    assert run_one_store(lambda transfer, primary: Checked.GOOD).success
    failed = run_one_store(lambda transfer, primary: Checked.BAD)
    assert failed.reason == FailureReason(FailureKind.ERR, "verify", "answered BAD")
    assert str(failed.reason) == "verify answered BAD"
    said = run_one_store(lambda transfer, primary: (Checked.BAD, "block 0 differs"))
    assert said.reason == FailureReason(FailureKind.ERR, "verify",
                                        "answered BAD: block 0 differs")


def transfer_in(state: TransferState, *, success: bool | None = None,
                error: str | None = None, error_type: str | None = None) -> Transfer:
    transfer = Transfer(TransferJob(7, ["k"], [0]), nbytes=64, started_at=0.0)
    transfer.state, transfer.success = state, success
    transfer.error, transfer.error_type = error, error_type
    return transfer


def test_a_running_transfer_given_up_fails_as_quarantined_on_its_state_check() -> None:
    """``quarantine`` latches failure on a transfer that still ran, and names the call it
    waited on; the last error NIXL gave, and its type, are kept in the reason."""
    machine = TRANSFER_MACHINE.compile(listen=False)
    plain = transfer_in(S.PROCESSING)
    machine.fire(plain, E.POLL, A.EXHAUSTED)
    assert plain.state is S.QUARANTINED and plain.success is False
    assert plain.error == "retry bound spent"
    assert plain.reason == FailureReason(FailureKind.QUARANTINED, "check_xfer_state",
                                         "retry bound spent")
    slow = transfer_in(S.PROCESSING, error="check_xfer_state answered 'ERR'",
                       error_type="nixlBackendError")
    machine.fire(slow, E.POLL, A.EXHAUSTED, "running for more than 5 s")
    assert slow.success is False
    assert slow.reason == FailureReason(
        FailureKind.QUARANTINED, "check_xfer_state",
        "running for more than 5 s; last error: check_xfer_state answered 'ERR'",
        "nixlBackendError")
    assert slow.reason is not None and slow.reason.error_type == "nixlBackendError"


def test_a_finished_transfer_whose_release_kept_raising_is_quarantined_naming_the_call() -> None:
    machine = TRANSFER_MACHINE.compile(listen=False)
    done = transfer_in(S.DONE, success=True)
    machine.fire(done, E.RELEASE, A.EXHAUSTED,
                 CallFailed("release_xfer_handle", RuntimeError("busy")))
    assert done.state is S.QUARANTINED and done.success is True
    assert done.reason == FailureReason(
        FailureKind.QUARANTINED, "release_xfer_handle",
        "retry bound spent; last error: RuntimeError: busy", "RuntimeError")
    assert done.reason is not None and done.reason.error_type == "RuntimeError"
    deadline = transfer_in(S.DONE, success=True)
    machine.fire(deadline, E.RELEASE, A.EXHAUSTED)
    assert deadline.reason == FailureReason(FailureKind.QUARANTINED, "release_xfer_handle",
                                            "retry bound spent")


def test_a_failed_transfer_quarantined_keeps_the_reason_it_failed_for() -> None:
    machine = TRANSFER_MACHINE.compile(listen=False)
    failed = transfer_in(S.PROCESSING)
    machine.fire(failed, E.POLL, A.ERR, CallFailed("check_xfer_state", "ERR"))
    reason = failed.reason
    machine.fire(failed, E.RELEASE, A.RAISED, CallFailed("release_xfer_handle",
                                                         RuntimeError("busy")))
    assert failed.retries == 1 and failed.error == "RuntimeError: busy"
    machine.fire(failed, E.RELEASE, A.RAISED)  # nothing said: the answer is the error
    assert failed.retries == 2 and failed.error == "RAISED"
    machine.fire(failed, E.RELEASE, A.EXHAUSTED)
    assert failed.state is S.QUARANTINED and failed.reason == reason
    assert failed.error == "retry bound spent"


# -- the second run (mutmut 3.8.1 over engine.py and machines/transfer.py) ---------------------
# Each test below names the mutants of kvfsm/machines/transfer.py it kills.

def test_a_reason_reads_as_one_line_with_or_without_its_call() -> None:
    """FailureReason.__str__: 3, 4 (``a call`` said of a reason without one), 8 (a cancelled
    reason reads as what it is, not as ``failed: cancelled``)."""
    assert str(FailureReason(FailureKind.RAISED, None, "OSError: gone")) == (
        "a call raised OSError: gone")
    assert str(FailureReason(FailureKind.ERR, None, "answered 'ERR'")) == "a call answered 'ERR'"
    assert str(FailureReason(FailureKind.QUARANTINED, None, "retry bound spent")) == (
        "quarantined waiting on a call: retry bound spent")
    assert str(FailureReason(FailureKind.CANCELLED, None, "cancelled")) == "cancelled"
    assert str(FailureReason(FailureKind.UNKNOWN, None, "BAD")) == "failed: BAD"
    assert str(FailureReason(FailureKind.RAISED, "transfer", "OSError: gone")) == (
        "transfer raised OSError: gone")


def test_an_outcome_latched_twice_is_refused_naming_the_job() -> None:
    """latch_success: 2, latch_failure: 2 (the message of ``OutcomeAlreadyLatched``)."""
    machine = TRANSFER_MACHINE.compile(listen=False)
    for answer in (A.DONE, A.ERR):
        transfer = transfer_in(S.PROCESSING, success=True)
        with pytest.raises(OutcomeAlreadyLatched) as refused:
            machine.fire(transfer, E.POLL, answer)
        assert str(refused.value) == "job 7: outcome already latched"
        assert transfer.success is True


def test_a_cancel_that_names_who_cancelled_keeps_it_as_the_error_and_fails_as_cancelled() -> None:
    """latch_cancelled: 2 (the answer passed on: without it a call's text detail reads as a
    user step's answer, which has a name, and the action raises)."""
    machine = TRANSFER_MACHINE.compile(listen=False)
    transfer = transfer_in(S.PROCESSING)
    machine.fire(transfer, E.CANCEL, A.OK, CallFailed("shutdown", "deadline passed"))
    assert transfer.state is S.CANCELLING and transfer.success is False
    assert transfer.error == "shutdown answered 'deadline passed'"
    assert transfer.reason == FailureReason(FailureKind.CANCELLED, None, "cancelled")


class Bare:
    """A record of another machine sharing the transfer's actions: no place for a reason or
    an error type (``_keep_error`` and ``_set_reason`` leave them out)."""

    __slots__ = ("error", "finished_at", "job", "retries", "state", "success")

    def __init__(self, state: TransferState) -> None:
        self.job = TransferJob(7, ["k"], [0])
        self.state, self.success, self.error = state, None, None
        self.finished_at, self.retries = 0.0, 0


def test_a_record_without_a_reason_or_error_type_fails_and_is_quarantined_all_the_same() -> None:
    """_set_reason: 1 (the record's missing ``reason`` is not suppressed), quarantine: 11
    (its missing ``error_type`` is read without a default)."""
    machine = TRANSFER_MACHINE.compile(listen=False)
    failed = Bare(S.PROCESSING)
    machine.fire(failed, E.POLL, A.RAISED, CallFailed("check_xfer_state", OSError("gone")))
    assert failed.state is S.FAILED and failed.success is False
    assert failed.error == "OSError: gone"
    machine.fire(failed, E.RELEASE, A.EXHAUSTED)
    assert failed.state is S.QUARANTINED and failed.error == "retry bound spent"
    running = Bare(S.PROCESSING)
    machine.fire(running, E.POLL, A.EXHAUSTED, "running for more than 5 s")
    assert running.state is S.QUARANTINED and running.success is False
    assert running.error == "running for more than 5 s"


def test_a_step_given_up_keeps_why_as_the_error_and_names_the_step_in_the_reason() -> None:
    """quarantine: 23 (a call given up with a text: that text is the error, not ``call
    answered 'text'``), as the runner gives up a user step (``CallFailed(step, why)``)."""
    machine = TRANSFER_MACHINE.compile(listen=False)
    transfer = transfer_in(S.PROCESSING)
    machine.fire(transfer, E.POLL, A.EXHAUSTED, CallFailed("verify", "running for more than 5 s"))
    assert transfer.state is S.QUARANTINED and transfer.success is False
    assert transfer.error == "running for more than 5 s"
    assert transfer.reason == FailureReason(FailureKind.QUARANTINED, "verify",
                                            "running for more than 5 s")


def test_a_step_answering_alone_into_a_quarantine_says_what_it_answered() -> None:
    """A user's edge that quarantines on a step's answer given alone (the driver names the
    step with an empty why): the reason says what the step answered, not an empty text."""
    machine = TRANSFER_MACHINE.compile(listen=False)
    transfer = transfer_in(S.PROCESSING)
    machine.fire(transfer, E.POLL, A.EXHAUSTED, CallFailed("verify", ""))
    assert transfer.error == "answered EXHAUSTED"
    assert transfer.reason == FailureReason(FailureKind.QUARANTINED, "verify",
                                            "answered EXHAUSTED")


def test_what_a_call_raised_is_kept_by_its_type_and_what_it_answered_has_none() -> None:
    """_keep_error: 7, 8 (``error_type`` not kept), _error_type: 3 (a bare exception's type
    lost), 5 (a status answered given the type ``str``)."""
    machine = TRANSFER_MACHINE.compile(listen=False)
    raised = transfer_in(S.PROCESSING)
    machine.fire(raised, E.POLL, A.RAISED, CallFailed("check_xfer_state", OSError("gone")))
    assert raised.error_type == "OSError"
    bare = transfer_in(S.PROCESSING)
    machine.fire(bare, E.POLL, A.RAISED, TimeoutError("slow"))
    assert bare.error == "TimeoutError: slow" and bare.error_type == "TimeoutError"
    answered = transfer_in(S.PROCESSING)
    machine.fire(answered, E.POLL, A.ERR, CallFailed("check_xfer_state", "ERR"))
    assert answered.error == "check_xfer_state answered 'ERR'" and answered.error_type is None
    retried = transfer_in(S.DONE, success=True, error="x", error_type="OSError")
    machine.fire(retried, E.RELEASE, A.RAISED, CallFailed("release_xfer_handle",
                                                          RuntimeError("busy")))
    assert retried.error_type == "RuntimeError"
    machine.fire(retried, E.RELEASE, A.RAISED, "busy again")
    assert retried.error == "busy again" and retried.error_type is None


def test_an_err_answer_says_what_was_answered_with_or_without_a_call() -> None:
    """_failure: 26, 27, 28, 31 (ERR with nothing said reads ``answered 'ERR'``), 25, 32 (a
    message given alone is the error as it is), and the status a call answered is quoted."""
    machine = TRANSFER_MACHINE.compile(listen=False)
    silent = transfer_in(S.PROCESSING)
    machine.fire(silent, E.POLL, A.ERR)
    assert silent.reason == FailureReason(FailureKind.ERR, None, "answered 'ERR'")
    said = transfer_in(S.PROCESSING)
    machine.fire(said, E.POLL, A.ERR, "the peer said no")
    assert said.reason == FailureReason(FailureKind.ERR, None, "the peer said no")
    status = transfer_in(S.PROCESSING)
    machine.fire(status, E.POLL, A.ERR, CallFailed("check_xfer_state", "NIXL_ERR_REMOTE"))
    assert status.reason == FailureReason(FailureKind.ERR, "check_xfer_state",
                                          "answered 'NIXL_ERR_REMOTE'")
    assert str(status.reason) == "check_xfer_state answered 'NIXL_ERR_REMOTE'"


def test_a_step_answering_a_failure_with_an_empty_reason_says_only_its_answer() -> None:
    """_failure: 44, 45 (an empty reason adds nothing after the answer's name)."""
    failed = run_one_store(lambda transfer, primary: (Checked.BAD, ""))
    assert failed.reason == FailureReason(FailureKind.ERR, "verify", "answered BAD")


def test_a_failure_whose_call_said_something_keeps_the_call_in_its_reason() -> None:
    """_failure: 47 (the call of a failure that neither raised nor answered ERR)."""
    machine = TRANSFER_MACHINE.compile(listen=False)
    transfer = transfer_in(S.SUBMITTED)
    machine.fire(transfer, E.POST, A.RAISED, CallFailed("register_memory", "refused"))
    assert transfer.reason == FailureReason(FailureKind.UNKNOWN, "register_memory",
                                            "register_memory answered 'refused'")
