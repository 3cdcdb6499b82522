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
from kvfsm.machines.transfer import CallFailed
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


@pytest.mark.parametrize("answered", [Stranger.GOOD, (Stranger.GOOD, "why"), Answer.RAISED,
                                      "GOOD"])
def test_a_step_answering_what_its_event_does_not_carry_fails_its_job_naming_it(
        answered: Any) -> None:
    result = run_one_store(lambda transfer, primary: answered)
    assert not result.success
    assert result.reason == FailureReason(
        FailureKind.RAISED, "verify",
        f"TypeError: step 'verify' answered {answered!r}, not one of its event's answers")


def test_a_step_answering_plainly_gives_no_reason_and_with_a_reason_gives_it() -> None:
    assert run_one_store(lambda transfer, primary: Checked.GOOD).success
    failed = run_one_store(lambda transfer, primary: Checked.BAD)
    assert failed.reason == FailureReason(FailureKind.UNKNOWN, None, "BAD")
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
