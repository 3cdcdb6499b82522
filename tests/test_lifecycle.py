"""The transfer lifecycle table: every state against every event, and its invariants."""

from __future__ import annotations

import itertools

import pytest

from kvfsm import (
    TRANSFER_MACHINE,
    Answer,
    InvalidTransition,
    Leak,
    Transfer,
    TransferEvent,
    TransferJob,
    TransferState,
)
from kvfsm.lifecycle import OutcomeAlreadyLatched
from kvfsm.machines.transfer import FailureKind
from kvfsm.policy import RetryPolicy
from kvfsm.runner import Outcome, Runner

S, E, A = TransferState, TransferEvent, Answer

#: the whole table, written out independently of the declaration: (state, event, answer) -> dest
EXPECTED: dict[tuple[TransferState, TransferEvent, Answer], TransferState] = {
    (S.SUBMITTED, E.POST, A.PROC): S.PROCESSING,
    (S.SUBMITTED, E.POST, A.DONE): S.DONE,
    (S.SUBMITTED, E.POST, A.ERR): S.FAILED,
    (S.SUBMITTED, E.POST, A.RAISED): S.FAILED,
    (S.PROCESSING, E.POLL, A.PROC): S.PROCESSING,
    (S.PROCESSING, E.POLL, A.DONE): S.DONE,
    (S.PROCESSING, E.POLL, A.ERR): S.FAILED,
    (S.PROCESSING, E.POLL, A.RAISED): S.FAILED,
    (S.PROCESSING, E.POLL, A.EXHAUSTED): S.QUARANTINED,
    (S.PROCESSING, E.CANCEL, A.OK): S.CANCELLING,
    (S.CANCELLING, E.POLL, A.PROC): S.CANCELLING,
    (S.CANCELLING, E.POLL, A.DONE): S.FAILED,
    (S.CANCELLING, E.POLL, A.ERR): S.FAILED,
    (S.CANCELLING, E.POLL, A.RAISED): S.FAILED,
    (S.CANCELLING, E.POLL, A.EXHAUSTED): S.QUARANTINED,
    (S.CANCELLING, E.CANCEL, A.OK): S.CANCELLING,
    (S.DONE, E.RELEASE, A.EXHAUSTED): S.QUARANTINED,
    (S.DONE, E.CANCEL, A.OK): S.DONE,
    (S.FAILED, E.RELEASE, A.EXHAUSTED): S.QUARANTINED,
    (S.FAILED, E.CANCEL, A.OK): S.FAILED,
    (S.DONE, E.RELEASE, A.OK): S.XFER_RELEASED,
    (S.DONE, E.RELEASE, A.RAISED): S.DONE,
    (S.FAILED, E.RELEASE, A.OK): S.XFER_RELEASED,
    (S.FAILED, E.RELEASE, A.RAISED): S.FAILED,
    (S.XFER_RELEASED, E.CLEAN, A.OK): S.CLEANED,
    (S.XFER_RELEASED, E.CLEAN, A.LEAKED): S.CLEANED,
    (S.XFER_RELEASED, E.CANCEL, A.OK): S.XFER_RELEASED,  # over: the outcome is kept
    (S.CLEANED, E.PUBLISH, A.OK): S.PUBLISHED,
    (S.CLEANED, E.CANCEL, A.OK): S.CLEANED,
}


def transfer_in(state: TransferState) -> Transfer:
    transfer = Transfer(TransferJob(7, ["k"], [0]), nbytes=64, started_at=0.0)
    transfer.state = state
    return transfer


def test_the_states_are_exactly_the_lifecycle() -> None:
    assert [s.name for s in TransferState] == [
        "SUBMITTED", "PROCESSING", "DONE", "FAILED", "XFER_RELEASED", "CLEANED", "PUBLISHED",
        "CANCELLING", "QUARANTINED"]


@pytest.mark.parametrize(("state", "event", "answer"), [
    (state, event, answer)
    for state, event, answer in itertools.product(TransferState, TransferEvent, Answer)
])
def test_every_state_against_every_event_and_answer(
    state: TransferState, event: TransferEvent, answer: Answer
) -> None:
    machine = TRANSFER_MACHINE.compile(listen=False)
    transfer = transfer_in(state)
    expected = EXPECTED.get((state, event, answer))
    if expected is None:
        with pytest.raises(InvalidTransition) as raised:
            machine.fire(transfer, event, answer)
        assert state.name in str(raised.value)
        assert repr(str(event)) in str(raised.value)
        assert transfer.state is state, "a refused event changes nothing"
        assert transfer.success is None and transfer.retries == 0
    else:
        detail = (Leak("deregister_memory", "x"),) if event is E.CLEAN else RuntimeError("boom")
        machine.fire(transfer, event, answer, detail)
        assert transfer.state is expected


def test_the_declared_table_is_exactly_the_expected_one() -> None:
    machine = TRANSFER_MACHINE.compile(listen=False)
    compiled = {(step.source, TransferEvent(step.edge.event), step.answer): step.dest
                for step in machine.steps()}
    assert compiled == EXPECTED


def test_published_is_reachable_only_through_xfer_released() -> None:
    """F2: no path from SUBMITTED to PUBLISHED avoids XFER_RELEASED."""
    edges = {(step.source, step.dest) for step in TRANSFER_MACHINE.compile(listen=False).steps()}
    reachable, frontier = {S.SUBMITTED}, [S.SUBMITTED]
    while frontier:
        here = frontier.pop()
        for source, dest in edges:
            if source is here and dest is not S.XFER_RELEASED and dest not in reachable:
                reachable.add(dest)
                frontier.append(dest)
    assert S.PUBLISHED not in reachable
    assert S.CLEANED not in reachable, "descriptors are torn down only after release (F8)"


def test_every_state_reaches_published() -> None:
    """No dead end: from every state but the other final one, QUARANTINED, some answers lead
    to PUBLISHED (F5, F6)."""
    edges = {(step.source, step.dest) for step in TRANSFER_MACHINE.compile(listen=False).steps()}
    for start in set(TransferState) - {S.QUARANTINED}:
        reachable, frontier = {start}, [start]
        while frontier:
            here = frontier.pop()
            for source, dest in edges:
                if source is here and dest not in reachable:
                    reachable.add(dest)
                    frontier.append(dest)
        assert S.PUBLISHED in reachable, start


def test_published_and_quarantined_are_terminal() -> None:
    machine = TRANSFER_MACHINE.compile(listen=False)
    assert S.PUBLISHED not in machine.table
    assert S.QUARANTINED not in machine.table
    assert TRANSFER_MACHINE.final == {S.PUBLISHED, S.QUARANTINED}


def test_a_cancelled_transfer_fails_and_still_waits_for_nixl_before_release() -> None:
    """F10 and the crash class: cancel latches failure, but only NIXL ends the transfer."""
    machine = TRANSFER_MACHINE.compile(listen=False)
    transfer = transfer_in(S.PROCESSING)
    machine.fire(transfer, E.CANCEL, A.OK)
    assert (transfer.state, transfer.success, transfer.error) == (S.CANCELLING, False, "cancelled")
    with pytest.raises(InvalidTransition, match="'release' is not declared in state CANCELLING"):
        machine.fire(transfer, E.RELEASE, A.OK)
    machine.fire(transfer, E.POLL, A.PROC)
    machine.fire(transfer, E.POLL, A.DONE)
    assert (transfer.state, transfer.success) == (S.FAILED, False), "DONE after cancel: failure"


def test_quarantine_keeps_a_finished_outcome_but_publishes_failure() -> None:
    machine = TRANSFER_MACHINE.compile(listen=False)
    transfer = transfer_in(S.PROCESSING)
    transfer.xfer = "its transfer handle"
    machine.fire(transfer, E.POLL, A.DONE)
    machine.fire(transfer, E.RELEASE, A.EXHAUSTED, RuntimeError("NIXL_ERR_BACKEND"))
    assert transfer.state is S.QUARANTINED
    assert transfer.success is True, "the latched outcome is never recomputed (F3)"
    assert transfer.reason is not None and transfer.reason.kind is FailureKind.QUARANTINED
    books = Runner(machine, RetryPolicy())  # publishing it, as a tier does
    books.records[transfer.job_id] = transfer
    books.take(transfer, E.POLL, Outcome(None))
    assert books.take_results()[0].success is False, "but a quarantined job publishes failure"
    assert books.quarantined == [transfer], "its handle held for good"


def test_the_outcome_latches_once_and_release_retries_do_not_touch_it() -> None:
    """F3: a DONE transfer stays a success through any number of failed releases."""
    machine = TRANSFER_MACHINE.compile(listen=False)
    transfer = transfer_in(S.PROCESSING)
    machine.fire(transfer, E.POLL, A.DONE)
    for _ in range(3):
        machine.fire(transfer, E.RELEASE, A.RAISED, RuntimeError("busy"))
    assert transfer.state is S.DONE
    assert transfer.success is True
    assert transfer.retries == 3
    assert transfer.error == "RuntimeError: busy"
    machine.fire(transfer, E.RELEASE, A.OK)
    assert transfer.success is True


def test_latching_an_outcome_twice_is_an_invariant_violation() -> None:
    machine = TRANSFER_MACHINE.compile(listen=False)
    transfer = transfer_in(S.PROCESSING)
    transfer.success = True  # as if a broken machine had already latched it
    with pytest.raises(OutcomeAlreadyLatched):
        machine.fire(transfer, E.POLL, A.ERR)


def test_a_failure_keeps_nixls_error_text() -> None:
    machine = TRANSFER_MACHINE.compile(listen=False)
    transfer = transfer_in(S.PROCESSING)
    machine.fire(transfer, E.POLL, A.RAISED, RuntimeError("NIXL_ERR_BACKEND"))
    assert transfer.success is False
    assert transfer.error == "RuntimeError: NIXL_ERR_BACKEND"
