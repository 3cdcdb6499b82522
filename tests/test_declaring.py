"""Declaring a machine of one's own, as a newcomer does: from scratch with ``Declaration``, or
from the shipped one with ``TRANSFER_MACHINE.extend``.

A state is named the same way wherever a declaration names one: as a member of the machine's
states Enum, or by its name, as a transition's ``source`` and ``dest`` are. A declaration of
the wrong shape (a transition without its dest, one dict where a list of them goes, None where
a dict goes, an event nobody declared the answers of) is refused with a ``DeclarationError``
saying what was wrong and what to give, never a ``KeyError`` or ``TypeError`` from inside, and
the machine extended is left as it was. An extension takes a name of its own.
"""

from __future__ import annotations

import copy
import enum
from typing import Any

import pytest

from kvfsm import TRANSFER_MACHINE, Declaration
from kvfsm.engine import DeclarationError
from kvfsm.lifecycle import Answer


class Door(enum.Enum):
    OPEN = 1
    CLOSED = 2
    BROKEN = 3
    GONE = 4


class Push(enum.Enum):
    OK = 1
    JAM = 2


class Lookalike(enum.Enum):
    """Another Enum with a member named like one of the door's states."""

    BROKEN = 3


def declare(**changes: Any) -> Declaration[Any, Any]:
    """A door that opens, or jams and breaks, and closes again; GONE is left unused."""
    arguments: dict[str, Any] = {
        "states": Door, "initial": Door.CLOSED,
        "answers": {"open": (Push.OK, Push.JAM), "close": (Push.OK,)},
        "guards": {"ok": (Push.OK,), "jam": (Push.JAM,)}, "actions": {},
        "transitions": [
            {"trigger": "open", "source": "CLOSED", "dest": "OPEN", "conditions": "ok"},
            {"trigger": "open", "source": "CLOSED", "dest": "BROKEN", "conditions": "jam"},
            {"trigger": "close", "source": "OPEN", "dest": "CLOSED"}],
        "final": [Door.BROKEN], "unreachable": [Door.GONE]}
    return Declaration("door", **{**arguments, **changes})


def refusal(**changes: Any) -> str:
    with pytest.raises(DeclarationError) as refused:
        declare(**changes)
    return str(refused.value)


# -- a state is given as a member or by its name, wherever one is named ------------------------

def test_states_are_named_by_their_names_as_transitions_name_them() -> None:
    by_name = declare(initial="CLOSED", final=["BROKEN"], failure_states=["BROKEN"],
                      unreachable=["GONE"], effects={"CLOSED": "open", "OPEN": "close"},
                      running=["OPEN"])
    by_member = declare(initial=Door.CLOSED, final=[Door.BROKEN], failure_states=[Door.BROKEN],
                        unreachable=[Door.GONE],
                        effects={Door.CLOSED: "open", Door.OPEN: "close"}, running=[Door.OPEN])
    for declaration in (by_name, by_member):
        assert declaration.initial is Door.CLOSED
        assert declaration.final == declaration.failure_states == {Door.BROKEN}
        assert declaration.unreachable == {Door.GONE}
        assert declaration.effects == {Door.CLOSED: "open", Door.OPEN: "close"}
        assert declaration.running == {Door.OPEN}
    assert by_name.edges == by_member.edges


def test_a_name_that_is_no_state_is_refused_listing_the_states() -> None:
    assert refusal(final=["BROKE"]) == (
        "door: final names 'BROKE', which is not a state of Door (its states: OPEN, CLOSED, "
        "BROKEN, GONE)")
    assert refusal(initial="closed") == (
        "door: initial names 'closed', which is not a state of Door (its states: OPEN, CLOSED, "
        "BROKEN, GONE)")


def test_a_member_of_another_enum_is_refused_saying_which_member_to_give() -> None:
    assert refusal(final=[Lookalike.BROKEN]) == (
        "door: final names <Lookalike.BROKEN: 3>, which is not a member of Door; give "
        "Door.BROKEN (the member of the states' Enum) or its name 'BROKEN'")
    assert refusal(failure_states=[Push.JAM]) == (
        "door: failure_states names <Push.JAM: 2>, which is not a member of Door; give a "
        "member of Door or its name (its states: OPEN, CLOSED, BROKEN, GONE)")


def test_a_state_given_twice_in_effects_by_member_and_by_name_is_refused() -> None:
    assert refusal(effects={"CLOSED": "open", Door.CLOSED: "open", "OPEN": "close"}) == (
        "door: effects names state CLOSED twice")


def test_an_extension_giving_a_state_twice_in_effects_is_refused_as_a_declaration_is() -> None:
    """extend kept the last of the two silently: CLOSED waited on whichever came second."""
    door = declare()
    with pytest.raises(DeclarationError) as refused:
        door.extend("door_ext", effects={Door.CLOSED: "close", "CLOSED": "open", "OPEN": "close"})
    assert str(refused.value) == "door_ext: effects names state CLOSED twice"
    assert door.effects == {}
    extended = door.extend("door_ext", effects={Door.CLOSED: "open", "OPEN": "close"})
    assert {state.name: effect for state, effect in extended.effects.items()} == {
        "CLOSED": "open", "OPEN": "close"}


# -- a declaration of the wrong shape is a DeclarationError saying what to give ----------------

def test_an_event_without_answers_is_refused_saying_to_declare_them() -> None:
    assert refusal(answers={"close": (Push.OK,)}) == (
        "door: transition {'trigger': 'open', 'source': 'CLOSED', 'dest': 'OPEN', "
        "'conditions': 'ok'} has trigger 'open', an event answers= does not declare; declare "
        "the answers it carries: answers={'open': [Answer.X, ...]} (events declared: close)")


@pytest.mark.parametrize(("changes", "message"), [
    ({"actions": None}, "door: actions must be a dict ({'name': function}), got NoneType None; "
                        "give {} for none"),
    ({"calls": ["open"]}, "door: calls must be a dict ({'event': 'call'}), got list ['open']"),
    ({"calls": {"open": 5}}, "door: the calls of 'open' must be names (str), got 5"),
    ({"effects": ["CLOSED"]}, "door: effects must be a dict ({State.X: 'event'} or "
                              "{'X': 'event'}), got list ['CLOSED']"),
    ({"transitions": [{"trigger": ["open"], "source": "CLOSED", "dest": "OPEN"}]},
     "door: transition {'trigger': ['open'], 'source': 'CLOSED', 'dest': 'OPEN'} has trigger "
     "['open']; a trigger is an event's name (str)"),
], ids=["actions None", "calls a list", "a call not named", "effects a list", "trigger a list"])
def test_a_part_of_the_wrong_shape_is_named_with_what_to_give(changes: dict[str, Any],
                                                             message: str) -> None:
    assert refusal(**changes) == message


def test_a_machine_without_a_name_is_refused() -> None:
    with pytest.raises(DeclarationError) as refused:
        Declaration(None, states=Door, initial=Door.CLOSED, answers={}, guards={},  # type: ignore[arg-type]
                    actions={}, transitions=[])
    assert str(refused.value) == "a machine's name must be a non-empty str, got NoneType None"


def _shipped() -> tuple[Any, ...]:
    """Everything the shipped machine declares, copied to compare with later."""
    shipped = TRANSFER_MACHINE
    declared = (shipped.name, shipped.answers, shipped.guards, shipped.transitions,
                shipped.final, shipped.failure_states, shipped.effects, shipped.running,
                shipped.calls, shipped.edges)
    return (*copy.deepcopy(declared), dict(shipped.actions))


@pytest.mark.parametrize(("changes", "message"), [
    ({"transitions": [{"trigger": "cancel", "source": "AJAR"}]},
     "ajar: transitions[0] has no 'dest': {'trigger': 'cancel', 'source': 'AJAR'}"),
    ({"transitions": {"trigger": "cancel", "source": "AJAR", "dest": "AJAR"}},
     "ajar: transitions must be a list of dicts, one a transition, got one dict "
     "{'trigger': 'cancel', 'source': 'AJAR', 'dest': 'AJAR'}"),
    ({"answers": [("verify", ())]},
     "ajar: answers must be a dict ({'event': [Answer.X, ...]}), got list [('verify', ())]"),
    ({"effects": ["AJAR"]}, "ajar: effects must be a dict ({'STATE': 'event'}), got list "
                            "['AJAR']"),
    ({"final": None},
     "ajar: final must be a collection of state names (['VERIFYING']), got NoneType None"),
    ({"states": ["AJAR", 2]},
     "ajar: states names the new states by their names (identifiers, such as 'VERIFYING', "
     "neither _X_ nor __X__ nor one of Enum's own attributes), got 2"),
    ({"transitions": [{"trigger": "shut", "source": "AJAR", "dest": "AJAR"}]},
     "ajar: transition {'trigger': 'shut', 'source': <AjarState.AJAR: 10>, 'dest': "
     "<AjarState.AJAR: 10>} has trigger 'shut', an event answers= does not declare; declare "
     "the answers it carries: answers={'shut': [Answer.X, ...]} (events declared: post, poll, "
     "release, clean, publish, cancel)"),
], ids=["no dest", "one dict", "answers a list", "effects a list", "final None",
        "a state not named", "an event without answers"])
def test_an_extension_of_the_wrong_shape_is_refused_and_changes_nothing(
        changes: dict[str, Any], message: str) -> None:
    before = _shipped()
    with pytest.raises(DeclarationError) as refused:
        TRANSFER_MACHINE.extend("ajar", **{"states": ["AJAR"], **changes})
    assert str(refused.value) == message
    assert _shipped() == before


def test_an_extension_named_like_the_machine_it_extends_is_refused() -> None:
    before = _shipped()
    with pytest.raises(DeclarationError) as refused:
        TRANSFER_MACHINE.extend("transfer", states=["AJAR"], unreachable=["AJAR"])
    assert str(refused.value) == (
        "transfer: extend names the new machine 'transfer', the name of the machine it "
        "extends; give your machine a name of its own (diagrams, coverage and traces tell "
        "machines apart by name)")
    assert _shipped() == before
    assert TRANSFER_MACHINE.extend("ajar", states=["AJAR"], unreachable=["AJAR"]).name == "ajar"


@pytest.mark.parametrize(("transition", "message"), [
    ({"trigger": "open", "source": {"CLOSED"}, "dest": "OPEN"},
     "door: transitions[0] has source {'CLOSED'}: a state (its name or member), a list of "
     "states, or the states' Enum (every state)"),
    ({"trigger": "open", "source": [], "dest": "OPEN"},
     "door: transitions[0] has source []: a state (its name or member), a list of states, or "
     "the states' Enum (every state)"),
    ({"trigger": "open", "source": "CLOSED", "dest": ["OPEN"]},
     "door: transitions[0] has dest ['OPEN']: one state (its name or member; None for a "
     "stay)"),
], ids=["a set of sources", "no source", "a list for a dest"])
def test_a_transitions_ends_of_the_wrong_kind_are_named(transition: dict[str, Any],
                                                       message: str) -> None:
    """A set where a list of states goes, or a list where one state goes, is named, not a
    TypeError from inside transitions."""
    assert refusal(transitions=[transition]) == message


@pytest.mark.parametrize("state", ["_ignore_", "_X_", "__init__", "__X__", "mro"])
def test_an_extension_refuses_a_state_name_an_enum_keeps_for_itself(state: str) -> None:
    """Names with a leading underscore, or Enum's own attributes, would not make a state (or
    fail inside Enum): each is refused naming it, and the shipped machine is unchanged."""
    before = _shipped()
    with pytest.raises(DeclarationError, match=f"got {state!r}"):
        TRANSFER_MACHINE.extend("mine", states=[state], unreachable=[state])
    assert _shipped() == before


@pytest.mark.parametrize("replace", [
    {("DONE", "release", ("released",)): {}},
    {("DONE", None, "released"): {}},
], ids=["a tuple for a guard", "no trigger"])
def test_an_extensions_replace_key_of_the_wrong_kind_is_named(replace: Any) -> None:
    before = _shipped()
    with pytest.raises(DeclarationError, match="its trigger and guard must be names"):
        TRANSFER_MACHINE.extend("mine", replace=replace)
    assert _shipped() == before


def test_an_extensions_source_given_as_a_set_is_named() -> None:
    with pytest.raises(DeclarationError) as refused:
        TRANSFER_MACHINE.extend("mine", transitions=[
            {"trigger": "cancel", "source": {"DONE"}, "dest": "DONE"}])
    assert str(refused.value) == ("mine: transitions[0] has source {'DONE'}: a state (its name "
                                  "or member), a list of states, or the states' Enum (every "
                                  "state)")


def test_compile_given_its_replacements_as_a_list_names_what_to_give() -> None:
    with pytest.raises(DeclarationError, match="compile's actions must be a dict of an "
                                               "action's name to its replacement, got list"):
        TRANSFER_MACHINE.compile(["latch_success"], listen=False)  # type: ignore[arg-type]


def test_a_state_with_a_leading_underscore_is_a_state_as_any() -> None:
    """Only _X_ and __X__ names are Enum's own: ``_VERIFYING`` and ``__HELD`` are states."""
    mine = TRANSFER_MACHINE.extend("mine", states=["_VERIFYING", "__HELD"],
                                   unreachable=["_VERIFYING", "__HELD"])
    assert {"_VERIFYING", "__HELD"} <= {state.name for state in mine.states}


def test_a_transitions_source_given_as_the_states_enum_is_every_state() -> None:
    """As ``transitions`` reads it: the edge leaves every state."""
    door = declare(transitions=[
        {"trigger": "open", "source": "CLOSED", "dest": "OPEN", "conditions": "ok"},
        {"trigger": "open", "source": "CLOSED", "dest": "BROKEN", "conditions": "jam"},
        {"trigger": "close", "source": Door, "dest": "CLOSED"}],
        final=[], unreachable=[Door.GONE])
    assert sorted(edge.source for edge in door.edges if edge.event == "close") == [
        "BROKEN", "CLOSED", "GONE", "OPEN"]


def test_a_declaration_whose_source_is_the_states_enum_can_be_extended() -> None:
    """Declaration accepts source=Door (every state); extending it must not fail on it."""
    door = declare(transitions=[
        {"trigger": "open", "source": "CLOSED", "dest": "OPEN", "conditions": "ok"},
        {"trigger": "open", "source": "CLOSED", "dest": "BROKEN", "conditions": "jam"},
        {"trigger": "close", "source": Door, "dest": "CLOSED"}],
        final=[], unreachable=[Door.GONE])
    ajar = door.extend("ajar", states=["AJAR"], unreachable=["AJAR"])
    assert sorted(edge.source for edge in ajar.edges if edge.event == "close") == [
        "BROKEN", "CLOSED", "GONE", "OPEN"]


def test_an_extension_given_the_states_enum_as_a_source_is_read_as_every_state() -> None:
    """The machine's states' Enum as a source is every one of its states, in an extension
    as in a declaration: here refused for what that edge does to those states, not as "no
    state <enum 'TransferState'>"."""
    with pytest.raises(DeclarationError) as refused:  # (a final state would get a way out)
        TRANSFER_MACHINE.extend("mine", transitions=[
            {"trigger": "cancel", "source": TRANSFER_MACHINE.states, "dest": "DONE"}])
    assert "no state <enum" not in str(refused.value)
    assert "PROCESSING" in str(refused.value) or "PUBLISHED" in str(refused.value)


def test_an_extension_state_named_as_its_enums_private_name_is_refused_by_name() -> None:
    """'_MineState__x' passes the name check (no _X_, no __X__) but Enum (3.11) makes no
    member of a private name: it fails later as "no state '_MineState__x'"."""
    with pytest.raises(DeclarationError, match="states names the new states by their names"):
        TRANSFER_MACHINE.extend("mine", states=["_MineState__x"], unreachable=["_MineState__x"])


def test_a_guard_named_like_one_of_the_machine_it_extends_is_said_to_replace_it() -> None:
    """A user's guard named ``errored``, as one of the shipped lifecycle's, takes its place on
    the shipped edges too: refused, the error says so, where it named only an edge the user
    never wrote."""
    from examples.verify_lifecycle import Verified  # noqa: PLC0415

    with pytest.raises(DeclarationError, match="guard 'errored'") as refused:
        TRANSFER_MACHINE.extend("clash", guards={"errored": (Verified.MISMATCH, Answer.RAISED)})
    assert refused.value.__notes__ == [
        "guard 'errored' given to extend() take(s) the place of machine 'transfer''s own of "
        "that name, on its edges too"]


def test_a_malformed_guard_named_like_one_of_the_machine_it_extends_is_said_malformed() -> None:
    """The note naming a replaced guard is made only of what the refusal names: a guard given
    as one answer, not a collection, is refused as such (the note's making raised TypeError
    over it)."""
    with pytest.raises(DeclarationError, match=r"guards\['errored'\] must be a collection"):
        TRANSFER_MACHINE.extend("malformed", guards={"errored": Answer.RAISED})
