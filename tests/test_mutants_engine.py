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
from transitions import Machine

from kvfsm import TRANSFER_MACHINE
from kvfsm.engine import CompiledMachine, DeclarationError, InvalidTransition
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
    LOUD = 3


def test_a_guard_accepting_a_foreign_answer_is_named_with_both_answer_sets() -> None:
    transitions = [
        {"trigger": "push", "source": Door.CLOSED, "dest": Door.OPEN, "conditions": "wrong"},
        {"trigger": "remove", "source": Door.OPEN, "dest": Door.GONE}]
    with pytest.raises(DeclarationError) as refused:
        door_declaration(guards={"wrong": [Other.LOUD, Other.HARD]}, transitions=transitions)
    assert str(refused.value) == (
        "door: guard 'wrong' (in conditions of CLOSED -push-> OPEN) accepts Other.HARD, "
        "Other.LOUD, which event 'push' never carries; its answers are Push.GENTLE, "
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


# -- the second run (mutmut 3.8.1 over engine.py and machines/transfer.py) ---------------------
# Each test below names the mutants of kvfsm/engine.py it kills (as `function: numbers`).

TABLE: list[dict[str, Any]] = [
    {"trigger": "push", "source": Door.CLOSED, "dest": Door.OPEN, "conditions": "gentle"},
    {"trigger": "push", "source": Door.CLOSED, "dest": Door.JAMMED, "conditions": "hard",
     "after": "note_jam"},
    {"trigger": "push", "source": Door.CLOSED, "dest": Door.CLOSED, "conditions": "nothing"},
    {"trigger": "push", "source": Door.JAMMED, "dest": Door.CLOSED, "unless": "nothing"},
    {"trigger": "push", "source": Door.JAMMED, "dest": Door.JAMMED, "conditions": "nothing"},
    {"trigger": "remove", "source": [Door.OPEN, Door.JAMMED], "dest": Door.GONE}]


def refusal(**overrides: Any) -> str:
    with pytest.raises(DeclarationError) as refused:
        door_declaration(**overrides)
    return str(refused.value)


class Stranger(enum.Enum):
    CLOSED = 1


def test_a_state_that_is_not_a_member_is_refused_naming_the_field_it_was_given_in() -> None:
    """_check_states: 2, 3 (``initial``), 8, 9 (``unreachable``), 10, 11 (``effects``), 17,
    18, 19 (the initial state named unreachable)."""
    assert refusal(initial=Stranger.CLOSED) == (
        "door: initial names <Stranger.CLOSED: 1>, which is not a member of Door; give "
        "Door.CLOSED (the member of the states' Enum) or its name 'CLOSED'")
    assert refusal(unreachable=["GONER"]) == (
        "door: unreachable names 'GONER', which is not a state of Door (its states: CLOSED, "
        "OPEN, JAMMED, GONE)")
    assert refusal(effects={"SHUT": "push"}) == (
        "door: effects names 'SHUT', which is not a state of Door (its states: CLOSED, OPEN, "
        "JAMMED, GONE)")
    assert refusal(unreachable=[Door.CLOSED]) == (
        "door: the initial state CLOSED is named in unreachable")


def test_several_unreached_states_are_all_named() -> None:
    """_check_reachable: 21, 29 (the separator between the states named)."""
    round_trip = [{"trigger": "push", "source": Door.CLOSED, "dest": Door.OPEN},
                  {"trigger": "push", "source": Door.OPEN, "dest": Door.CLOSED}]
    assert refusal(transitions=round_trip) == (
        "door: state(s) JAMMED, GONE cannot be reached from the initial state CLOSED; add an "
        "edge into them, or name them in unreachable= if leaving them unused is deliberate")
    assert refusal(unreachable=[Door.OPEN, Door.JAMMED]) == (
        "door: state(s) OPEN, JAMMED are named in unreachable= but can be reached from the "
        "initial state CLOSED")


def test_two_final_states_that_declare_events_are_named_with_every_move() -> None:
    """_check_final: 9, 11 (the separators between states and between moves)."""
    more = [{"trigger": "push", "source": Door.GONE, "dest": Door.GONE},
            {"trigger": "push", "source": Door.OPEN, "dest": Door.OPEN}]
    assert refusal(transitions=TABLE + more, final=[Door.GONE, Door.OPEN]) == (
        "door: final state(s) GONE, OPEN declare events (GONE -push-> GONE, OPEN -push-> OPEN, "
        "OPEN -remove-> GONE); a record leaves the table in a final state, so no event may "
        "follow it")


def test_an_unsupported_key_is_refused_saying_where_guards_and_actions_go() -> None:
    """_check_transition: 21, 22 (the hint after the transition)."""
    edge = {"trigger": "push", "source": Door.GONE, "dest": Door.GONE, "before": "x"}
    assert refusal(transitions=[*TABLE, edge]) == (
        f"door: unsupported key 'before' in {edge} (guards go in conditions/unless, actions "
        "in after)")


def test_a_stray_guard_on_an_edge_with_two_sources_or_two_destinations_says_so() -> None:
    """_check_guard_answers: the separator between sources (an edge without a source, or
    with two destinations, is refused before, naming what is wrong)."""
    guards = {"gentle": [Push.GENTLE], "hard": [Push.HARD], "nothing": [Push.NONE],
              "wrong": [Stranger.CLOSED]}
    assert refusal(guards=guards, transitions=[
        {"trigger": "push", "dest": Door.OPEN, "conditions": "wrong"}]) == (
        "door: transitions[0] has no 'source': {'trigger': 'push', 'dest': <Door.OPEN: 2>, "
        "'conditions': 'wrong'}")
    assert refusal(guards=guards, transitions=[
        {"trigger": "push", "source": [Door.CLOSED, Door.JAMMED], "dest": Door.OPEN,
         "conditions": "wrong"}]) == (
        "door: guard 'wrong' (in conditions of CLOSED, JAMMED -push-> OPEN) accepts "
        "Stranger.CLOSED, which event 'push' never carries; its answers are Push.GENTLE, "
        "Push.HARD, Push.NONE")
    assert refusal(guards=guards, transitions=[
        {"trigger": "push", "source": Door.CLOSED, "dest": [Door.OPEN, Door.JAMMED],
         "conditions": "wrong"}]) == (  # (two destinations: refused before the guard)
        "door: transitions[0] has dest [<Door.OPEN: 2>, <Door.JAMMED: 3>]: one state (its "
        "name or member; None for a stay)")


def test_overlapping_guards_are_refused_naming_every_edge_that_takes_the_answer() -> None:
    """_resolve: 31 (the separator between the overlapping edges)."""
    assert refusal(guards={"gentle": [Push.GENTLE], "hard": [Push.HARD, Push.GENTLE],
                           "nothing": [Push.NONE]}) == (
        "door: in state CLOSED, event 'push' with answer GENTLE matches 2 edges (guards "
        "overlap): -> OPEN [gentle], -> JAMMED [hard]")


def test_a_refused_event_says_why_and_carries_what_was_fired_where() -> None:
    """InvalidTransition.__init__: 1, 2, 3, 4 (the attributes); CompiledMachine.step: 3 (the
    answer refused); _refusal: 15 (the separator of the answers carried), 18 (the machine's
    name), 19, 20, 21 (the attributes)."""
    machine = door_declaration().compile(listen=False)
    with pytest.raises(InvalidTransition) as refused:
        machine.step(Door.CLOSED, "push", Stranger.CLOSED)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "door: event 'push' in state CLOSED carries one of GENTLE, HARD, NONE, not "
        "<Stranger.CLOSED: 1>")
    error = refused.value
    assert (error.machine, error.state, error.event, error.answer) == (
        "door", Door.CLOSED, "push", Stranger.CLOSED)
    record = DoorRecord()
    record.state = Door.OPEN
    with pytest.raises(InvalidTransition) as refused:
        machine.fire(record, "push", Push.GENTLE)
    assert str(refused.value) == "door: event 'push' is not declared in state OPEN"
    error = refused.value
    assert (error.machine, error.state, error.event, error.answer) == (
        "door", Door.OPEN, "push", Push.GENTLE)
    assert record.state is Door.OPEN


def test_a_chain_run_in_the_wrong_state_is_refused_naming_both_states() -> None:
    """CompiledMachine.run: 2, 3, 4, 5 (the machine, state, event and answer of the refusal);
    CompiledMachine.chain: 2 (the message of an empty chain)."""
    machine = door_declaration().compile(listen=False)
    chain = machine.chain(Door.CLOSED, [("push", Push.HARD, None)])
    record = DoorRecord()
    record.state = Door.OPEN
    with pytest.raises(InvalidTransition) as refused:
        machine.run(record, chain)
    assert str(refused.value) == "door: a chain from CLOSED cannot run in state OPEN"
    error = refused.value
    assert (error.machine, error.state, error.event, error.answer) == (
        "door", Door.OPEN, "push", Push.HARD)
    assert record.state is Door.OPEN and record.jams == 0
    with pytest.raises(ValueError) as refused_empty:
        machine.chain(Door.CLOSED, [])
    assert str(refused_empty.value) == "door: a chain needs at least one move"


def test_asking_twice_for_a_chain_gives_the_same_chain_and_other_events_another() -> None:
    """CompiledMachine.chain: 6, 7 (a chain asked again is built anew: its steps then belong
    to two chains), 5 (the key forgets the events: a chain of other events with the same
    answers is taken for the first)."""
    machine = door_declaration().compile(listen=False)
    stay = machine.chain(Door.JAMMED, [("push", Push.NONE, None)])
    assert machine.chain(Door.JAMMED, [("push", Push.NONE, None)]) is stay
    assert stay.steps[0].chains == (stay,)
    leave = machine.chain(Door.JAMMED, [("remove", Push.NONE, None)])
    assert leave is not stay and leave.dest is Door.GONE
    record = DoorRecord()
    record.state = Door.JAMMED
    assert machine.run(record, leave) is Door.GONE


def test_a_chain_passes_each_move_its_detail_and_an_untraced_machine_keeps_no_trace() -> None:
    """CompiledMachine.run: 20 (the detail of a move reaches its actions), 35 (a machine
    compiled without trace leaves the record's trace alone; the record here has none)."""
    seen: list[Any] = []
    machine = door_declaration(
        actions={"note_jam": lambda record, answer, detail: seen.append((answer, detail))}
    ).compile(listen=False)
    chain = machine.chain(Door.CLOSED, [("push", Push.HARD, "kicked"),
                                        ("push", Push.GENTLE, "eased")])
    record = DoorRecord()
    assert machine.run(record, chain) is Door.CLOSED
    assert seen == [(Push.HARD, "kicked")]
    assert not hasattr(record, "trace")


def test_a_compiled_machine_made_directly_does_not_trace() -> None:
    """CompiledMachine.__init__: 1 (``trace`` defaults to False)."""
    declaration = door_declaration()
    table = declaration.compile(listen=False).table
    machine = CompiledMachine(declaration, table)
    assert machine.trace is False
    record = DoorRecord()  # no trace list: a traced machine would need one
    assert machine.fire(record, "push", Push.GENTLE) is Door.OPEN


def test_build_machine_makes_the_class_asked_for_with_the_options_given() -> None:
    """build_machine: 2, 6, 7 (``machine_class`` not taken out of the options: ``transitions``
    refuses it), 21 (the other options dropped)."""

    class Queued(Machine):
        pass

    class Model:
        pass

    machine = door_declaration().build_machine(Model(), machine_class=Queued, queued=True)
    assert type(machine) is Queued
    assert machine.has_queue is True
    assert door_declaration().build_machine(Model()).has_queue is False


def test_an_action_declared_under_two_names_is_named_by_both() -> None:
    """_blame: 25, 26 (the separator between the names of one function)."""
    machine = door_declaration(
        actions={"note_jam": raising, "log": raising},
        transitions=[{**TABLE[0], "after": ["log", "note_jam"]}, *TABLE[1:]],
    ).compile(listen=False)
    with pytest.raises(Hinge) as raised:
        machine.fire(DoorRecord(), "push", Push.GENTLE)
    assert raised.value.__notes__ == [
        "kvfsm: raised by action 'log' or 'note_jam' of machine 'door', firing CLOSED "
        "-push(GENTLE)-> OPEN; the record is in OPEN (actions run after the state changed)"]


def test_an_action_that_takes_the_state_away_and_raises_keeps_its_error() -> None:
    """_blame: 15 (a record left without a state: the note says so, and the action's own
    error, not an AttributeError of the note, reaches the caller)."""

    def tear_down(record: Any, answer: Any, detail: Any) -> None:
        del record.state
        raise Hinge("torn down")

    machine = door_declaration(actions={"note_jam": tear_down}).compile(listen=False)
    with pytest.raises(Hinge) as raised:
        machine.fire(DoorRecord(), "push", Push.HARD)
    assert raised.value.__notes__ == [
        "kvfsm: raised by action 'note_jam' of machine 'door', firing CLOSED -push(HARD)-> "
        "JAMMED; the record is in None (actions run after the state changed)"]


class Refusing(DoorRecord):
    """A record whose state store refuses one state (a slot setter, a property of the user's)."""

    def __init__(self, refused: Door) -> None:
        super().__init__()
        self.refused = refused

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and value is getattr(self, "refused", None):
            raise Hinge(f"no {value.name} here")
        super().__setattr__(name, value)


def test_a_state_store_that_raises_in_a_chain_is_blamed_on_the_store_not_an_action() -> None:
    """_blame: 31, and what it found: a chain whose record refused its state at the first step
    with actions raised UnboundLocalError (no action had run), and at a later one blamed the
    last action of the step before. The record's own error reaches the caller, with a note
    naming the store and the step."""
    machine = door_declaration(
        transitions=[*TABLE[:3], {**TABLE[3], "after": "note_jam"}, *TABLE[4:]],
    ).compile(listen=False)
    chain = machine.chain(Door.CLOSED, [("push", Push.HARD, None), ("push", Push.GENTLE, None)])

    with pytest.raises(Hinge, match="no JAMMED here") as first:
        machine.run(Refusing(Door.JAMMED), chain)
    assert first.value.__notes__ == [
        "kvfsm: raised by the record's state store of machine 'door', firing CLOSED "
        "-push(HARD)-> JAMMED, before its actions; the record is in CLOSED"]

    record = Refusing(Door.CLOSED)
    with pytest.raises(Hinge, match="no CLOSED here") as later:
        machine.run(record, chain)
    assert later.value.__notes__ == [
        "kvfsm: raised by the record's state store of machine 'door', firing JAMMED "
        "-push(GENTLE)-> CLOSED, before its actions; the record is in JAMMED"]
    assert record.jams == 1  # the first step's action ran, the second's did not


def test_an_extension_naming_a_new_state_twice_is_refused_naming_the_old_states() -> None:
    """extend: 11, 13 (a state named twice among the new ones: the Enum would refuse it with a
    TypeError), 16 (the separator of the old states)."""
    with pytest.raises(DeclarationError) as refused:
        door_declaration().extend("door_ajar", states=["AJAR", "AJAR"])
    assert str(refused.value) == (
        "door_ajar: states ['AJAR'] are named twice (states of 'door': CLOSED, OPEN, JAMMED, "
        "GONE)")


def test_an_extension_keeps_an_edge_whose_guards_are_a_list() -> None:
    """extend: 83, 84 (the key of an edge whose ``conditions`` is a list, matched against
    ``replace``: a list is unhashable, ``tuple(None)`` raises)."""
    listed = [{**TABLE[0], "conditions": ["gentle"]}, *TABLE[1:]]
    extended = door_declaration(transitions=listed).extend(
        "door_ajar", states=["AJAR"],
        replace={(Door.CLOSED, "push", "nothing"): {"dest": "AJAR"}},  # type: ignore[dict-item]
        transitions=[{"trigger": "push", "source": "AJAR", "dest": "OPEN"}])
    assert [s.name for s in extended.states] == ["CLOSED", "OPEN", "JAMMED", "GONE", "AJAR"]
    (edge,) = [e for e in extended.edges if e.source == "CLOSED" and e.dest == "OPEN"]
    assert edge.conditions == ("gentle",)
    machine, ajar = extended.compile(listen=False), extended.states
    assert machine.step(ajar.CLOSED, "push", Push.GENTLE).dest is ajar.OPEN
    assert machine.step(ajar.CLOSED, "push", Push.NONE).dest is ajar.AJAR


def test_an_extensions_enum_is_made_in_the_module_that_asked_for_it() -> None:
    """extend: 20, 23, 34, 37, 38 (the Enum made in kvfsm.engine, where pickle would look for
    it in vain). Under mutmut a trampoline calls ``extend``, and is then the caller."""
    states = door_declaration().extend("door_ajar", states=["AJAR"],
                                       unreachable=["AJAR"]).states
    assert states.__module__ in {__name__, "mutmut.mutation.trampoline"}
