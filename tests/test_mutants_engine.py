"""The engine's error messages and its small readers, pinned down (docs/testing.md, "Mutation
testing").

mutmut left these mutants of kvfsm/engine.py alive: the words of a ``DeclarationError`` or of
the note an action's exception gets (a separator, a fallback such as ``"(unchanged)"``, a name
taken from the wrong value), ``Chain.__repr__`` and ``Declaration.edges_from``, which no test
called. A user reads these messages to find the mistake in a declaration, so the exact text is
behaviour: each test below states one message whole.
"""

from __future__ import annotations

import enum
from typing import Any

import pytest

from kvfsm import TRANSFER_MACHINE
from kvfsm.engine import DeclarationError
from kvfsm.lifecycle import Answer, TransferEvent, TransferState

from .test_engine import Door, DoorRecord, Push, door_declaration

S, E, A = TransferState, TransferEvent, Answer


def test_a_chain_shows_its_steps_in_order() -> None:
    machine = TRANSFER_MACHINE.compile(listen=False)
    chain = machine.chain(S.DONE, [(E.RELEASE, A.OK, None), (E.CLEAN, A.OK, None),
                                   (E.PUBLISH, A.OK, None)])
    assert repr(chain) == ("<Chain -release(OK)-> XFER_RELEASED -clean(OK)-> CLEANED "
                           "-publish(OK)-> PUBLISHED>")


def test_edges_from_are_the_edges_of_one_state_on_one_event_in_guard_order() -> None:
    edges = TRANSFER_MACHINE.edges_from(S.PROCESSING, E.POLL)
    assert [(e.source, e.dest, e.conditions, e.order) for e in edges] == [
        ("PROCESSING", "PROCESSING", ("running",), 0),
        ("PROCESSING", "DONE", ("finished",), 1),
        ("PROCESSING", "FAILED", ("errored",), 2),
        ("PROCESSING", "QUARANTINED", ("exhausted",), 3)]
    assert [e.dest for e in TRANSFER_MACHINE.edges_from(S.DONE, E.CANCEL)] == ["DONE"]


class Hinge(Exception):
    pass


def raising(record: Any, answer: Any, detail: Any) -> None:
    raise Hinge("broke")


class Untyped:
    """A record whose state is not one of the machine's members (a tool's own record)."""

    def __init__(self) -> None:
        self.state: Any = Door.CLOSED


def test_the_note_names_the_action_when_the_record_is_not_an_enum_state() -> None:
    """The record's state is shown by ``repr`` when it is not an Enum member."""
    record = Untyped()

    def set_odd_state(record: Any, answer: Any, detail: Any) -> None:
        record.state = "somewhere"
        raise Hinge("broke")

    odd = door_declaration(actions={"note_jam": set_odd_state}).compile(listen=False)
    with pytest.raises(Hinge) as raised:
        odd.fire(record, "push", Push.HARD)
    assert raised.value.__notes__ == [
        "kvfsm: raised by action 'note_jam' of machine 'door', firing CLOSED -push(HARD)-> "
        "JAMMED; the record is in 'somewhere' (actions run after the state changed)"]
    # two actions on one edge: the one that raised is named
    two = door_declaration(
        actions={"note_jam": raising, "log": lambda record, answer, detail: None},
        transitions=[
            {"trigger": "push", "source": Door.CLOSED, "dest": Door.OPEN,
             "conditions": "gentle", "after": ["log", "note_jam"]},
            {"trigger": "push", "source": Door.CLOSED, "dest": Door.JAMMED,
             "conditions": "hard"},
            {"trigger": "push", "source": Door.CLOSED, "dest": Door.CLOSED,
             "conditions": "nothing"},
            {"trigger": "push", "source": Door.JAMMED, "dest": Door.CLOSED, "unless": "nothing"},
            {"trigger": "push", "source": Door.JAMMED, "dest": Door.JAMMED,
             "conditions": "nothing"},
            {"trigger": "remove", "source": [Door.OPEN, Door.JAMMED], "dest": Door.GONE}],
    ).compile(listen=False)
    with pytest.raises(Hinge) as raised:
        two.fire(DoorRecord(), "push", Push.GENTLE)
    assert raised.value.__notes__ == [
        "kvfsm: raised by action 'note_jam' of machine 'door', firing CLOSED -push(GENTLE)-> "
        "OPEN; the record is in OPEN (actions run after the state changed)"]


class Other(enum.Enum):
    HARD = 2


def test_a_guard_accepting_a_foreign_answer_is_named_with_both_answer_sets() -> None:
    transitions = [
        {"trigger": "push", "source": Door.CLOSED, "dest": Door.OPEN, "conditions": "wrong"},
        {"trigger": "remove", "source": Door.OPEN, "dest": Door.GONE}]
    with pytest.raises(DeclarationError) as refused:
        door_declaration(guards={"wrong": [Other.HARD, "loud"]}, transitions=transitions)
    assert str(refused.value) == (
        "door: guard 'wrong' (in conditions of CLOSED -push-> OPEN) accepts 'loud', "
        "Other.HARD, which event 'push' never carries; its answers are Push.GENTLE, "
        "Push.HARD, Push.NONE")


def test_a_guard_on_a_stay_names_the_destination_as_unchanged() -> None:
    """An edge without ``dest`` (a stay, in ``transitions``' terms) is shown as such."""
    transitions = [
        {"trigger": "push", "source": [Door.CLOSED, "OPEN"], "dest": None,
         "conditions": "wrong"},
        {"trigger": "push", "source": Door.CLOSED, "dest": Door.OPEN, "conditions": "gentle"},
        {"trigger": "remove", "source": Door.OPEN, "dest": Door.GONE}]
    with pytest.raises(DeclarationError) as refused:
        door_declaration(guards={"gentle": [Push.GENTLE], "wrong": [Other.HARD]},
                         transitions=transitions)
    assert str(refused.value) == (
        "door: guard 'wrong' (in conditions of CLOSED, OPEN -push-> (unchanged)) accepts "
        "Other.HARD, which event 'push' never carries; its answers are Push.GENTLE, "
        "Push.HARD, Push.NONE")


DOOR_EFFECTS: dict[Any, str] = {Door.CLOSED: "push", Door.OPEN: "remove",
                                Door.JAMMED: "push"}


def test_a_declaration_with_effects_is_checked_state_by_state() -> None:
    """Every state is checked, not only those before the first final or unreachable one."""
    assert door_declaration(effects=DOOR_EFFECTS, final=[Door.GONE]).effects == DOOR_EFFECTS
    # GONE (final) comes before no state here; a state after it that waits on nothing
    missing = {Door.CLOSED: "push", Door.OPEN: "remove"}
    with pytest.raises(DeclarationError) as refused:
        door_declaration(effects=missing, final=[Door.GONE])
    assert str(refused.value) == (
        "door: state JAMMED waits on no effect; name the effect it waits on (the event that "
        "effect fires) in effects=")
    wrong = {**DOOR_EFFECTS, Door.JAMMED: "remove", Door.OPEN: "push"}
    with pytest.raises(DeclarationError) as refused:
        door_declaration(effects=wrong, final=[Door.GONE])
    assert str(refused.value) == (
        "door: state OPEN waits on effect 'push', but declares no event 'push': what the "
        "effect answers could not be fired")


def test_running_states_alone_are_checked_too() -> None:
    """A declaration naming running states but no effects is checked (and refused)."""
    with pytest.raises(DeclarationError, match="state CLOSED waits on no effect"):
        door_declaration(running=[Door.JAMMED], final=[Door.GONE])


def test_a_state_both_running_and_final_is_named_alone() -> None:
    with pytest.raises(DeclarationError) as refused:
        door_declaration(effects=DOOR_EFFECTS, final=[Door.GONE],
                         running=[Door.JAMMED, Door.GONE])
    assert str(refused.value) == "door: state(s) GONE are both running and final"


def test_running_states_waiting_on_two_effects_are_refused_naming_both() -> None:
    effects = {Door.CLOSED: "push", Door.OPEN: "remove", Door.JAMMED: "push"}
    with pytest.raises(DeclarationError) as refused:
        door_declaration(effects=effects, final=[Door.GONE], running=[Door.CLOSED, Door.OPEN])
    assert str(refused.value) == (
        "door: running states wait on one effect (the check of running work), not on push, "
        "remove")


def test_the_names_of_calls_and_guards_are_checked_with_one_line_each() -> None:
    with pytest.raises(DeclarationError) as refused:
        door_declaration(guards={"gentle": [Push.GENTLE], "hard": [Push.HARD], "nothing": []})
    assert str(refused.value) == "door: guard 'nothing' accepts no answer"
    with pytest.raises(DeclarationError) as refused:
        door_declaration(calls={"open": "handle"})
    assert str(refused.value) == "door: calls names 'open', which is not one of its events"
    for named in (["handle", ""], [], ["handle", 3]):
        with pytest.raises(DeclarationError) as refused:
            door_declaration(calls={"push": named})
        assert str(refused.value) == (
            f"door: the calls of 'push' must be names (str), got {tuple(named)!r}")
    assert door_declaration(calls={"push": ["handle", "lever"]}).calls == {
        "push": ("handle", "lever")}
