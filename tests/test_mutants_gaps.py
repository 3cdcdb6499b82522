"""The four gaps docs/testing.md left open after mutation testing, each closed by a scenario.

* ``Runner.give_up``: what the books say once a transfer is given up (the running bound or the
  shutdown deadline), for one NIXL may still run and for one waiting on a user's step: it
  leaves the running or waiting list, is published once, is held in ``quarantined`` with its
  handle, a running one is remembered in ``may_run``, a step's give-up names the
  step as the call it waited on, and the error logged says where it was and why;
* ``Declaration._check_effects``: a final or an unreachable state listed in the Enum before a
  state that waits on nothing (a ``continue`` made ``break`` stops checking there), a state
  with an effect that declares no event at all, and two states both running and final;
* ``Declaration.extend`` of a machine that names states ``unreachable`` (the extension keeps
  them so) and with ``running=`` states of its own (the runner polls them);
* ``Declaration._read_edges`` on a stay declared with ``dest: None``, read back with its source
  as its destination.

Mutant numbers are mutmut's (``cd build/mutation && ../../.venv/bin/mutmut show NAME``).
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import pytest

from kvfsm import TRANSFER_MACHINE, Declaration
from kvfsm.driver import check_runnable
from kvfsm.engine import DeclarationError
from kvfsm.lifecycle import Answer, TransferState
from kvfsm.machines.transfer import FailureKind, FailureReason
from kvfsm.policy import RetryPolicy
from kvfsm.runner import END, Outcome, Runner
from kvfsm.transfer import Transfer

from .test_engine import Door, DoorRecord, Push, door_declaration, jammed_unreachable
from .test_runner import CLEAN_OK, OK, runner, submitted, verify_pending

S = TransferState

# -- Runner.give_up -------------------------------------------------------------------------


def without_latency(counts: dict[str, Any]) -> dict[str, Any]:
    """``counts()`` but the latencies (their values are times)."""
    assert set(counts["latency"]) <= {"p50", "p90", "p99"}
    return {name: value for name, value in counts.items() if name != "latency"}


def test_a_running_transfer_given_up_is_published_once_held_and_remembered_as_may_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The running bound gives up a transfer NIXL still runs: it leaves the running list (its
    handle is no longer checked), is published once as QUARANTINED on the state check, is held
    with its handle, and it is in ``may_run`` (mutant 4 added None there); the error
    logged names the job, the state it was given up in and why (mutants 22, 30), with the
    structured fields of the transfer (mutants 24, 29 dropped them)."""
    books = runner()
    published: list[int] = []
    books.on_published.append(lambda transfer: published.append(transfer.job_id))
    first, second = submitted(books, 1), submitted(books, 2)
    for transfer in (first, second):
        books.take(transfer, "post", Outcome(Answer.PROC))
    assert books.handles == ["handle-1", "handle-2"]
    caplog.set_level(logging.ERROR, logger="kvfsm")

    books.give_up(first, "still running after 5.0 s")

    assert first.state is S.QUARANTINED
    assert books.handles == ["handle-2"] and books.running.transfers == [second]
    assert first.slot == -1 and first.filed is None
    assert books.waiting == {}
    assert books.in_state[S.PROCESSING] == 1 and books.in_state[S.QUARANTINED] == 0
    assert list(books.records) == [2]
    assert books.quarantined == [first] and first.xfer == "handle-1", "its handle is held"
    assert books.may_run == {first}
    assert published == [1]
    [result] = books.take_results()
    assert result.job_id == 1 and not result.success and result.transfer_size == 0
    assert result.reason == FailureReason(FailureKind.QUARANTINED, "check_xfer_state",
                                          "still running after 5.0 s", None)
    assert without_latency(books.counts()) == {
        "in_flight": {"PROCESSING": 1}, "published": 1, "failed": 1, "retries": 0,
        "leaks": 0, "leaked": [], "quarantined": 1, "quarantined_running": 1}
    [logged] = caplog.records
    assert (logged.levelno, logged.getMessage()) == (
        logging.ERROR, "job 1 quarantined in PROCESSING: still running after 5.0 s")
    fields = ("kvfsm_job_id", "kvfsm_state", "kvfsm_nixl_error")
    assert [getattr(logged, field, None) for field in fields] == [
        1, "QUARANTINED", "still running after 5.0 s"], "the structured fields of the line"

    # the other one goes on as if nothing happened, and is not counted as possibly running
    books.take_checks(["DONE"])
    books.take(second, "poll", Outcome(Answer.DONE))
    books.take(second, END, (OK, CLEAN_OK))
    [result] = books.take_results()
    assert result.job_id == 2 and result.success
    assert published == [1, 2] and books.take_results() == []
    assert books.may_run == {first} and books.quarantined == [first]


def test_a_transfer_waiting_on_a_user_step_given_up_fails_naming_the_step() -> None:
    """The shutdown deadline gives up a transfer waiting on a step of the user's: the give-up
    is fired with ``CallFailed(step, why)``, so the reason names the step as the call it waited
    on and says why (mutants 14, 16, 17, 18, 19 gave the bare text, no step, no why, or a
    ``CallFailed`` without one of its fields). NIXL runs nothing for it: ``may_run`` stays
    empty, and it leaves the waiting list, not the running one."""
    books = Runner(verify_pending().compile(listen=False), RetryPolicy())
    states = books.machine.declaration.states
    running = submitted(books, 1)
    books.take(running, "post", Outcome(Answer.PROC))
    waiting = submitted(books, 2)
    books.take(waiting, "post", Outcome(Answer.DONE))
    assert waiting.state is states.VERIFYING and list(books.waiting) == [2]
    assert books.handles == ["handle-1"]

    books.give_up(waiting, "shutdown deadline passed")

    assert waiting.state is states.QUARANTINED
    assert books.waiting == {} and books.handles == ["handle-1"]
    assert books.in_state[states.VERIFYING] == 0 and books.in_state[states.PROCESSING] == 1
    assert books.quarantined == [waiting] and waiting.xfer == "handle-2"
    assert books.may_run == set()
    [result] = books.take_results()
    assert result.job_id == 2 and not result.success
    assert result.reason == FailureReason(FailureKind.QUARANTINED, "verify",
                                          "shutdown deadline passed", None)
    assert str(result.reason) == "quarantined waiting on verify: shutdown deadline passed"
    assert without_latency(books.counts()) == {
        "in_flight": {"PROCESSING": 1}, "published": 1, "failed": 1, "retries": 0,
        "leaks": 0, "leaked": [], "quarantined": 1, "quarantined_running": 0}


# -- Declaration._check_effects -------------------------------------------------------------


class Turn(enum.Enum):
    OK = "OK"
    BAD = "BAD"


class FinalFirst(enum.Enum):
    """A final state listed before a state that waits on nothing."""

    IDLE = 1
    SHUT = 2
    WORKING = 3


class SpareFirst(enum.Enum):
    """An unreachable state listed before a state that waits on nothing."""

    IDLE = 1
    SPARE = 2
    WORKING = 3
    SHUT = 4


def tap(states: type[enum.Enum], **more: Any) -> Declaration[Any, Any]:
    """IDLE -turn-> WORKING -turn-> SHUT (final); any other state unreachable."""
    spec: dict[str, Any] = {
        "states": states, "initial": states["IDLE"],
        "answers": {"turn": [Turn.OK]}, "guards": {}, "actions": {},
        "transitions": [
            {"trigger": "turn", "source": states["IDLE"], "dest": states["WORKING"]},
            {"trigger": "turn", "source": states["WORKING"], "dest": states["SHUT"]}],
        "final": [states["SHUT"]],
        "unreachable": [s for s in states if s.name not in {"IDLE", "WORKING", "SHUT"}],
    }
    spec.update(more)
    return Declaration("tap", **spec)


@pytest.mark.parametrize("states", [FinalFirst, SpareFirst], ids=["final", "unreachable"])
def test_a_state_after_a_final_or_unreachable_one_is_still_checked(
    states: type[enum.Enum],
) -> None:
    """The Enum lists a final (mutant 14) or an unreachable (mutant 17) state before WORKING,
    which waits on nothing: a ``break`` there instead of ``continue`` would stop checking
    before WORKING and accept the declaration."""
    assert tap(states, effects={states["IDLE"]: "turn", states["WORKING"]: "turn"}).effects == {
        states["IDLE"]: "turn", states["WORKING"]: "turn"}
    with pytest.raises(DeclarationError) as refused:
        tap(states, effects={states["IDLE"]: "turn"})
    assert str(refused.value) == (
        "tap: state WORKING waits on no effect; name the effect it waits on (the event that "
        "effect fires) in effects=")


class Wedge(enum.Enum):
    IDLE = 1
    WEDGED = 2


def test_a_state_waiting_on_an_effect_but_declaring_no_event_at_all_is_refused() -> None:
    """WEDGED declares no event whatever (it has no row in the table): refused with the same
    line as a state declaring other events, not a ``TypeError`` from looking the effect up in
    None (mutants 23, 25)."""
    with pytest.raises(DeclarationError) as refused:
        Declaration("wedge", states=Wedge, initial=Wedge.IDLE, answers={"turn": [Turn.OK]},
                    guards={}, actions={},
                    transitions=[{"trigger": "turn", "source": Wedge.IDLE,
                                  "dest": Wedge.WEDGED}],
                    effects={Wedge.IDLE: "turn", Wedge.WEDGED: "turn"})
    assert str(refused.value) == (
        "wedge: state WEDGED waits on effect 'turn', but declares no event 'turn': what the "
        "effect answers could not be fired")


class TwoEnds(enum.Enum):
    IDLE = 1
    SHUT = 2
    LOST = 3


def test_several_states_both_running_and_final_are_named_comma_separated() -> None:
    """Two states both running and final are named in one line, sorted, joined by ", "
    (mutant 30 changed the separator)."""
    with pytest.raises(DeclarationError) as refused:
        Declaration("ends", states=TwoEnds, initial=TwoEnds.IDLE,
                    answers={"turn": list(Turn)}, guards={"ok": [Turn.OK], "bad": [Turn.BAD]},
                    actions={},
                    transitions=[
                        {"trigger": "turn", "source": TwoEnds.IDLE, "dest": TwoEnds.SHUT,
                         "conditions": "ok"},
                        {"trigger": "turn", "source": TwoEnds.IDLE, "dest": TwoEnds.LOST,
                         "conditions": "bad"}],
                    final=[TwoEnds.SHUT, TwoEnds.LOST], running=[TwoEnds.SHUT, TwoEnds.LOST],
                    effects={TwoEnds.IDLE: "turn"})
    assert str(refused.value) == "ends: state(s) LOST, SHUT are both running and final"


# -- Declaration.extend ---------------------------------------------------------------------


def test_an_extension_keeps_the_unreachable_states_of_the_machine_it_extends() -> None:
    """A variant leaving JAMMED unused names it unreachable; its extension (a bell that rings
    from CLOSED) names the same state of its own Enum so, and still refuses an edge into it
    as a stale name. docs/testing.md's mutants 101 and 129 (122 and 150 in the numbering of
    the current engine.py): the argument dropped (JAMMED refused as unreached) or mapped with
    None (a ``TypeError``)."""
    variant = door_declaration(transitions=jammed_unreachable(), unreachable=[Door.JAMMED])
    bell = variant.extend(
        "bell", states=["RINGING"], answers={"ring": [Push.NONE]},
        transitions=[{"trigger": "ring", "source": "CLOSED", "dest": "RINGING"},
                     {"trigger": "ring", "source": "RINGING", "dest": Door.CLOSED}])
    states = bell.states
    assert bell.unreachable == {states.JAMMED}
    assert [s.name for s in states] == ["CLOSED", "OPEN", "JAMMED", "GONE", "RINGING"]
    door = DoorRecord()
    door.state = states.CLOSED
    machine = bell.compile(listen=False)
    assert machine.fire(door, "ring", Push.NONE) is states.RINGING
    assert machine.fire(door, "ring", Push.NONE) is states.CLOSED
    assert machine.fire(door, "push", Push.HARD) is states.CLOSED, "JAMMED stays unentered"

    with pytest.raises(DeclarationError) as refused:
        variant.extend("bell", transitions=[
            {"trigger": "push", "source": "OPEN", "dest": "JAMMED", "conditions": "hard"},
            {"trigger": "push", "source": "OPEN", "dest": "OPEN", "unless": "hard"}])
    assert str(refused.value) == (
        "bell: state(s) JAMMED are named in unreachable= but can be reached from the initial "
        "state CLOSED")


def settling() -> Declaration[Any, Any]:
    """The lifecycle with a second running state: after NIXL's DONE, SETTLING waits on the
    state check again until it answers DONE once more."""
    return TRANSFER_MACHINE.extend(
        "settling", states=["SETTLING"],
        replace={("PROCESSING", "poll", "finished"): {"dest": "SETTLING", "after": []}},
        transitions=[
            {"trigger": "poll", "source": "SETTLING", "dest": "SETTLING",
             "conditions": "running"},
            {"trigger": "poll", "source": "SETTLING", "dest": "DONE", "conditions": "finished",
             "after": "latch_success"},
            {"trigger": "poll", "source": "SETTLING", "dest": "FAILED", "conditions": "errored",
             "after": "latch_failure"},
            {"trigger": "poll", "source": "SETTLING", "dest": "QUARANTINED",
             "conditions": "exhausted", "after": "quarantine"},
            {"trigger": "cancel", "source": "SETTLING", "dest": "CANCELLING",
             "after": "latch_cancelled"}],
        effects={"SETTLING": "poll"},
        running=["SETTLING"])


def test_running_states_an_extension_adds_are_running_for_the_runner() -> None:
    """``running=["SETTLING"]`` is added to the base's running states, as a member of the new
    Enum; a tier accepts the machine, and the runner keeps a transfer in SETTLING in its
    running list, polls its handle, counts its PROC as a stay and never calls anything else
    for it. docs/testing.md's mutant 139 (160 in the numbering of the current engine.py):
    the added names mapped with None (a ``TypeError``)."""
    machine = settling()
    states = machine.states
    assert machine.running == {states.PROCESSING, states.CANCELLING, states.SETTLING}
    check_runnable(machine, {}, RetryPolicy(max_running_seconds=60.0))

    books = Runner(machine.compile(listen=False), RetryPolicy())
    transfer: Transfer = submitted(books, 1)
    books.take(transfer, "post", Outcome(Answer.PROC))
    assert books.take_checks(["DONE"]) == [(transfer, "DONE")]
    books.take(transfer, "poll", Outcome(Answer.DONE))
    assert transfer.state is states.SETTLING
    assert books.handles == ["handle-1"] and books.waiting == {}
    assert books.in_state[states.SETTLING] == 1 and books.in_state[states.PROCESSING] == 0
    assert list(books.due()) == [], "a running transfer waits on NIXL, not on a call"
    assert books.take_checks(["PROC"]) == []
    assert books.table[states.SETTLING]["poll"][Answer.PROC].taken == 1
    assert books.counts()["in_flight"] == {"SETTLING": 1}

    assert books.take_checks(["DONE"]) == [(transfer, "DONE")]
    books.take(transfer, "poll", Outcome(Answer.DONE))
    assert transfer.state is states.DONE and books.handles == [] and list(books.waiting) == [1]
    assert [effect for _, effect in books.due()] == [END]
    books.take(transfer, END, (OK, CLEAN_OK))
    [result] = books.take_results()
    assert result.success and books.counts()["in_flight"] == {}


# -- Declaration._read_edges ----------------------------------------------------------------


def test_a_stay_declared_with_dest_none_is_read_back_with_its_source_as_destination() -> None:
    """``"dest": None`` (an internal transition in ``transitions``' terms) is a stay: read back
    as an edge whose destination is its source, a loop, the same edges as when the
    destination is named (mutant 19 read None back, refused as an unknown state)."""
    named = door_declaration()
    transitions = [{**t, "dest": None} if t["dest"] is t["source"] else t
                   for t in named.transitions]
    assert sum(t["dest"] is None for t in transitions) == 2
    stays = door_declaration(transitions=transitions)
    assert stays.edges == named.edges
    [closed] = [e for e in stays.edges_from(Door.CLOSED, "push") if e.conditions == ("nothing",)]
    assert (closed.source, closed.dest, closed.order, closed.is_loop) == (
        "CLOSED", "CLOSED", 2, True)
    [jammed] = [e for e in stays.edges_from(Door.JAMMED, "push") if e.conditions]
    assert (jammed.source, jammed.dest, jammed.is_loop) == ("JAMMED", "JAMMED", True)
    step = stays.compile(listen=False).step(Door.CLOSED, "push", Push.NONE)
    assert step.dest is Door.CLOSED and step.is_stay


def test_an_extension_that_leaves_a_state_unentered_can_say_so() -> None:
    """The refusal of a state no edge enters any more advises ``unreachable=``; an extension
    can follow it."""
    from kvfsm.engine import DeclarationError  # noqa: PLC0415
    from kvfsm.lifecycle import TRANSFER_MACHINE  # noqa: PLC0415

    straight = {("PROCESSING", "cancel", ""): {"dest": "FAILED", "after": "latch_failure"}}
    with pytest.raises(DeclarationError, match=r"CANCELLING cannot be reached .* unreachable="):
        TRANSFER_MACHINE.extend("no_cancelling", replace=straight)
    machine = TRANSFER_MACHINE.extend("no_cancelling", replace=straight,
                                      unreachable=["CANCELLING"])
    assert {state.name for state in machine.unreachable} == {"CANCELLING"}
