"""The compiled engine runs exactly what ``transitions`` was declared with, for any machine."""

from __future__ import annotations

import enum
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from transitions import MachineError

from kvfsm import TRANSFER_MACHINE, Declaration, DeclarationError, InvalidTransition


class Door(enum.Enum):
    """A user's own machine: a door that may jam."""

    CLOSED = 1
    OPEN = 2
    JAMMED = 3
    GONE = 4


class Push(enum.Enum):
    GENTLE = 1
    HARD = 2
    NONE = 3


def door_declaration(**overrides: Any) -> Declaration[Door, Push]:
    spec: dict[str, Any] = {
        "states": Door,
        "initial": Door.CLOSED,
        "answers": {"push": list(Push), "remove": [Push.NONE]},
        "guards": {"gentle": [Push.GENTLE], "hard": [Push.HARD], "nothing": [Push.NONE]},
        "actions": {"note_jam": lambda record, answer, detail: setattr(record, "jams",
                                                                       record.jams + 1)},
        "transitions": [
            {"trigger": "push", "source": Door.CLOSED, "dest": Door.OPEN, "conditions": "gentle"},
            {"trigger": "push", "source": Door.CLOSED, "dest": Door.JAMMED, "conditions": "hard",
             "after": "note_jam"},
            {"trigger": "push", "source": Door.CLOSED, "dest": Door.CLOSED,
             "conditions": "nothing"},
            {"trigger": "push", "source": Door.JAMMED, "dest": Door.CLOSED,
             "unless": "nothing"},
            {"trigger": "push", "source": Door.JAMMED, "dest": Door.JAMMED,
             "conditions": "nothing"},
            {"trigger": "remove", "source": [Door.OPEN, Door.JAMMED], "dest": Door.GONE},
        ],
    }
    spec.update(overrides)
    return Declaration("door", **spec)


class DoorRecord:
    def __init__(self) -> None:
        self.state = Door.CLOSED
        self.jams = 0


class Record:
    def __init__(self, state: enum.Enum) -> None:
        self.state = state


def events_of(declaration: Declaration[Any, Any]) -> st.SearchStrategy[tuple[str, Any]]:
    return st.sampled_from(
        [(event, answer) for event, answers in declaration.answers.items()
         for answer in sorted(answers, key=lambda a: a.name)])


class BothMachines:
    """One declaration run twice: by transitions itself, and by the compiled table."""

    def __init__(self, declaration: Declaration[Any, Any]) -> None:
        self.declaration = declaration
        self.reference = declaration.reference_model()
        recorders = {name: (lambda record, answer, detail, name=name:
                            record.actions_run.append(name))
                     for name in declaration.actions}
        # the table's own tests fire every edge on purpose: not counted as transition coverage
        self.compiled = declaration.compile(recorders, listen=False)
        self.record = Record(declaration.initial)
        self.record.actions_run = []  # type: ignore[attr-defined]

    def declared_here(self) -> list[tuple[str, Any]]:
        """The (event, answer) pairs declared in the current state."""
        row = self.compiled.table.get(self.record.state, {})
        return sorted(((e, a) for e, answers in row.items() for a in answers),
                      key=lambda pair: (pair[0], pair[1].name))

    def fire(self, event: str, answer: Any) -> None:
        reference, compiled, record = self.reference, self.compiled, self.record
        try:
            reference.trigger(event, answer)
            reference_error = False
        except MachineError:
            reference_error = True
        try:
            compiled.fire(record, event, answer)
            compiled_error = False
        except InvalidTransition:
            compiled_error = True
        assert compiled_error == reference_error, (event, answer, record.state)
        assert record.state.name == reference.state.name, (event, answer)
        assert record.actions_run == reference.actions_run  # type: ignore[attr-defined]


def run_both(declaration: Declaration[Any, Any], sequence: list[tuple[str, Any]]) -> None:
    """Fire the sequence through transitions and through the compiled table; compare each step."""
    both = BothMachines(declaration)
    for name, answer in sequence:
        both.fire(name, answer)


def guided_walk(declaration: Declaration[Any, Any], data: Any, steps: int) -> BothMachines:
    """Mostly declared events (so walks go deep), sometimes any event (so refusals are hit)."""
    both = BothMachines(declaration)
    anything = events_of(declaration)
    for _ in range(steps):
        here = both.declared_here()
        if here and data.draw(st.integers(0, 9)) > 0:
            event, answer = data.draw(st.sampled_from(here))
        else:
            event, answer = data.draw(anything)
        both.fire(event, answer)
    return both


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_transfer_machine_matches_transitions_on_random_event_sequences(data: Any) -> None:
    sequence = data.draw(st.lists(events_of(TRANSFER_MACHINE), max_size=30))
    run_both(TRANSFER_MACHINE, sequence)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_transfer_machine_matches_transitions_on_walks_through_the_lifecycle(data: Any) -> None:
    both = guided_walk(TRANSFER_MACHINE, data, steps=data.draw(st.integers(1, 25)))
    # walks this long reach the end of the lifecycle most of the time; make sure some do
    event("reached PUBLISHED" if both.record.state.name == "PUBLISHED" else "stopped short")


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_users_own_machine_gets_the_same_engine(data: Any) -> None:
    declaration = door_declaration()
    sequence = data.draw(st.lists(events_of(declaration), max_size=20))
    run_both(declaration, sequence)


def test_compiled_actions_run_on_the_record_and_steps_are_counted() -> None:
    machine = door_declaration().compile()
    door = DoorRecord()
    machine.fire(door, "push", Push.HARD)
    machine.fire(door, "push", Push.GENTLE)
    machine.fire(door, "push", Push.HARD)
    assert door.state is Door.JAMMED
    assert door.jams == 2
    counts = {(e.source, e.event, e.dest, e.guard_label): n
              for e, n in machine.transition_counts().items()}
    assert counts[("CLOSED", "push", "JAMMED", "hard")] == 2
    assert counts[("JAMMED", "push", "CLOSED", "!nothing")] == 1
    assert counts[("CLOSED", "push", "OPEN", "gentle")] == 0
    assert len(counts) == len(machine.declaration.edges)


def test_a_chain_does_what_firing_its_steps_one_by_one_does() -> None:
    moves = [("push", Push.HARD, None), ("push", Push.NONE, None), ("push", Push.HARD, None),
             ("push", Push.HARD, None), ("remove", Push.NONE, None)]
    one_by_one, chained = door_declaration().compile(trace=True), door_declaration().compile(
        trace=True)
    fired, ran = DoorRecord(), DoorRecord()
    fired.trace, ran.trace = [], []  # type: ignore[attr-defined]
    for event_name, answer, detail in moves:
        one_by_one.fire(fired, event_name, answer, detail)
    chain = chained.chain(Door.CLOSED, moves)
    assert chained.run(ran, chain) is Door.GONE
    assert (ran.state, ran.jams) == (fired.state, fired.jams) == (Door.GONE, 2)
    assert [s.count for s in chained.steps()] == [s.count for s in one_by_one.steps()]
    # the stay (JAMMED, push NONE) is counted but, as when fired, not kept in the trace
    assert len(fired.trace) == 8 and ran.trace[0] is chain  # type: ignore[attr-defined]
    assert list(map(repr, chain.traced)) == list(map(repr, fired.trace[::2]))  # type: ignore


def test_a_chain_is_refused_where_it_does_not_start_and_where_it_is_not_declared() -> None:
    machine = door_declaration().compile()
    chain = machine.chain(Door.CLOSED, [("push", Push.GENTLE, None)])
    door = DoorRecord()
    door.state = Door.JAMMED
    with pytest.raises(InvalidTransition, match="from CLOSED cannot run in state JAMMED"):
        machine.run(door, chain)
    assert door.state is Door.JAMMED and all(step.count == 0 for step in machine.steps())
    with pytest.raises(InvalidTransition, match=r"'remove'.*CLOSED"):
        machine.chain(Door.CLOSED, [("push", Push.NONE, None), ("remove", Push.NONE, None)])


def test_an_undeclared_event_names_state_and_event_and_changes_nothing() -> None:
    machine = door_declaration().compile()
    door = DoorRecord()
    with pytest.raises(InvalidTransition, match=r"'remove'.*CLOSED"):
        machine.fire(door, "remove", Push.NONE)
    assert door.state is Door.CLOSED
    assert all(step.count == 0 for step in machine.steps())


def test_overlapping_guards_are_refused_at_declaration() -> None:
    transitions = [
        *door_declaration().transitions,
        {"trigger": "push", "source": Door.OPEN, "dest": Door.CLOSED, "conditions": "hard"},
        {"trigger": "push", "source": Door.OPEN, "dest": Door.JAMMED, "unless": "gentle"},
        {"trigger": "push", "source": Door.OPEN, "dest": Door.OPEN, "conditions": "gentle"},
    ]
    with pytest.raises(DeclarationError, match=r"OPEN.*'push'.*HARD.*2 edges"):
        door_declaration(transitions=transitions)


def test_an_answer_no_edge_accepts_must_be_declared_as_a_stay() -> None:
    transitions = [t for t in door_declaration().transitions
                   if not (t["source"] == Door.CLOSED and t.get("conditions") == "nothing")]
    with pytest.raises(DeclarationError, match=r"CLOSED.*'push'.*NONE.*self-loop"):
        door_declaration(transitions=transitions)


def test_unknown_guard_action_or_trigger_is_refused() -> None:
    base = door_declaration().transitions
    with pytest.raises(DeclarationError, match="unknown guard 'soft'"):
        door_declaration(transitions=[*base, {"trigger": "push", "source": Door.GONE,
                                             "dest": Door.GONE, "conditions": "soft"}])
    with pytest.raises(DeclarationError, match="unknown action 'creak'"):
        door_declaration(transitions=[*base, {"trigger": "remove", "source": Door.CLOSED,
                                             "dest": Door.GONE, "after": "creak"}])
    with pytest.raises(DeclarationError, match="undeclared trigger 'kick'"):
        door_declaration(transitions=[*base, {"trigger": "kick", "source": Door.CLOSED,
                                             "dest": Door.GONE}])
    with pytest.raises(DeclarationError, match="unsupported key 'before'"):
        door_declaration(transitions=[*base, {"trigger": "remove", "source": Door.CLOSED,
                                             "dest": Door.GONE, "before": "note_jam"}])


def test_an_edge_that_can_never_be_taken_is_refused() -> None:
    # "remove" only ever carries NONE, so a "remove" edge guarded by "hard" is dead code
    transitions = [*door_declaration().transitions,
                   {"trigger": "remove", "source": Door.OPEN, "dest": Door.CLOSED,
                    "conditions": "hard"}]
    with pytest.raises(DeclarationError, match=r"OPEN -remove-> CLOSED \[hard\] can never"):
        door_declaration(transitions=transitions)


def test_guards_and_actions_must_be_named() -> None:
    transitions = [*door_declaration().transitions,
                   {"trigger": "remove", "source": Door.CLOSED, "dest": Door.GONE,
                    "conditions": [lambda answer: True]}]
    with pytest.raises(DeclarationError, match="must be names"):
        door_declaration(transitions=transitions)


def test_an_answer_the_event_cannot_carry_is_refused_by_name() -> None:
    machine = door_declaration().compile()
    door = DoorRecord()
    with pytest.raises(InvalidTransition, match=r"'remove' is not declared in state CLOSED"):
        machine.fire(door, "remove", Push.NONE)
    door.state = Door.OPEN
    with pytest.raises(InvalidTransition, match=r"'remove' in state OPEN carries one of NONE, "
                                                r"not <Push.HARD: 2>"):
        machine.fire(door, "remove", Push.HARD)
    with pytest.raises(InvalidTransition, match="there is no event 'kick'"):
        machine.fire(door, "kick", Push.HARD)
    assert door.state is Door.OPEN


def test_unknown_states_are_refused() -> None:
    with pytest.raises(DeclarationError, match="unknown state 'AJAR'"):
        door_declaration(transitions=[{"trigger": "push", "source": "AJAR", "dest": Door.OPEN,
                                       "conditions": "gentle"}])
