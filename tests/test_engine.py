"""The compiled engine runs exactly what ``transitions`` was declared with, for any machine."""

from __future__ import annotations

import enum
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from transitions import MachineError

from kvfsm import TRANSFER_MACHINE, Declaration, DeclarationError, InvalidTransition
from kvfsm.machines import load_machine


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


@pytest.mark.parametrize("state", ["CLOSED", None, ["CLOSED"]], ids=["a name", "None", "a list"])
def test_a_record_in_no_state_of_the_machine_is_refused_by_name_and_left_as_it_is(
        state: Any) -> None:
    """A record whose state is a state's name (as a declaration names states), None or
    anything else that is no member: an InvalidTransition saying so, from ``fire``, ``step``
    and the refusal alike, and the record unchanged."""
    machine = door_declaration().compile()
    door = DoorRecord()
    door.state = state
    with pytest.raises(InvalidTransition, match=r"door: the record is in .*, no state of this "
                                                r"machine \(a record's state is one of its "
                                                r"members: Door\.CLOSED to begin with\)"):
        machine.fire(door, "push", Push.NONE)
    assert door.state == state
    with pytest.raises(InvalidTransition, match="no state of this machine"):
        machine.step(state, "push", Push.NONE)
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
    with pytest.raises(DeclarationError, match="has trigger 'kick', an event answers= does not "
                                               r"declare; declare the answers it carries: "
                                               r"answers=\{'kick': \[Answer.X, ...\]\}"):
        door_declaration(transitions=[*base, {"trigger": "kick", "source": Door.CLOSED,
                                             "dest": Door.GONE}])
    with pytest.raises(DeclarationError, match="unsupported key 'before'"):
        door_declaration(transitions=[*base, {"trigger": "remove", "source": Door.CLOSED,
                                             "dest": Door.GONE, "before": "note_jam"}])


def test_states_that_are_no_enum_and_actions_that_are_no_function_are_refused_by_name() -> None:
    """A list of state names (as extend() takes) for a machine made from scratch, or an action
    or a compile-time replacement that cannot be called, is refused when declared, naming it,
    rather than failing in the engine, or when the edge first fires."""
    with pytest.raises(DeclarationError, match=r"door: states must be an Enum class .*got list "
                                               r"\['CLOSED', 'OPEN'\]; to add states to a machine "
                                               r"by name, use its extend\(states=\[...\]\)"):
        door_declaration(states=["CLOSED", "OPEN"])
    with pytest.raises(DeclarationError, match=r"door: action 'note_jam' must be a function "
                                               r"\(action\(record, answer, detail\)\), got int 3"):
        door_declaration(actions={"note_jam": 3})
    declaration = door_declaration()
    with pytest.raises(DeclarationError, match=r"the replacement of action 'note_jam' must be a "
                                               r"function, got str 'jam'"):
        declaration.compile({"note_jam": "jam"})  # type: ignore[dict-item]
    with pytest.raises(DeclarationError, match=r"compile replaces action 'note_jams', which is "
                                               r"not declared \(actions: note_jam\)"):
        declaration.compile({"note_jams": lambda record, answer, detail: None})


_FIRST = {"trigger": "push", "source": Door.CLOSED, "dest": Door.OPEN, "conditions": "gentle"}


@pytest.mark.parametrize(("override", "message"), [
    ({"answers": {"push": ("GENTLE", "HARD", "NONE"), "remove": [Push.NONE]}},
     r"door: answers\['push'\] holds 'GENTLE', which is not a member of an Enum: answers are "
     r"Enum members \(class Answer\(enum.Enum\)\)"),
    ({"answers": {"push": list(Push), "remove": "NONE"}},
     r"door: answers\['remove'\] must be a collection of answers \(\[Answer.OK, ...\]\), got "
     r"str 'NONE'"),
    ({"guards": {"gentle": Push.GENTLE}},
     r"door: guards\['gentle'\] must be a collection of answers .*got Push <Push.GENTLE"),
    ({"final": Door.GONE},
     r"door: final must be a collection of states \(\[Door.X\] or \['X'\]\), got Door "
     r"<Door.GONE"),
    ({"transitions": [{k: v for k, v in _FIRST.items() if k != "dest"}]},
     r"door: transitions\[0\] has no 'dest': \{'trigger': 'push'"),
    ({"transitions": [{"trigger": "push"}]},
     r"door: transitions\[0\] has no 'source' nor 'dest'"),
    ({"transitions": _FIRST},
     r"door: transitions must be a list of dicts, one a transition, got one dict"),
    ({"transitions": [_FIRST, ("push", Door.OPEN, Door.GONE)]},
     r"door: transitions\[1\] must be a dict with trigger, source, dest, got \('push'"),
])
def test_a_declaration_of_the_wrong_shape_is_refused_naming_the_part(
        override: dict[str, Any], message: str) -> None:
    """Answers given as names, a lone final state, a transition missing its dest: each failed
    inside the engine or ``transitions`` (an AttributeError on a str, "'Door' object is not
    iterable", a TypeError naming no transition), or took a str apart into its letters."""
    with pytest.raises(DeclarationError, match=message):
        door_declaration(**override)


def test_a_declaration_of_generators_and_sets_is_read_once_and_taken() -> None:
    """The shape checks read each collection, and once read a generator was empty: answers
    given as generators left edges that could never be taken, transitions as one left
    states unreachable. Each is read once now, and kept."""
    base = door_declaration()
    declared = door_declaration(
        answers={event: (a for a in answers) for event, answers in base.answers.items()},
        guards={guard: set(accepted) for guard, accepted in base.guards.items()},
        transitions=(dict(t) for t in base.transitions),
        final=(s for s in [Door.GONE]))
    assert declared.edges == base.edges
    assert declared.answers == base.answers and declared.final == frozenset({Door.GONE})


def test_an_edge_that_can_never_be_taken_is_refused() -> None:
    # "remove" only ever carries NONE, so a "remove" edge taken unless NONE is dead code
    transitions = [*door_declaration().transitions,
                   {"trigger": "remove", "source": Door.OPEN, "dest": Door.CLOSED,
                    "unless": "nothing"}]
    with pytest.raises(DeclarationError,
                       match=r"OPEN -remove-> CLOSED \[!nothing\] can never be taken"):
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


# -- bad declarations are refused at once, by name ----------------------------------------------

class Pull(enum.Enum):
    """Another Enum with a member named like one of Push's: the mistake the guard check finds."""

    NONE = 1


def test_a_guard_accepting_an_answer_its_event_never_carries_is_refused_by_name() -> None:
    # the guard meant Push.NONE; before, this read "answer NONE matches no edge", at OPEN
    guards = {**door_declaration().guards, "let_go": [Pull.NONE]}
    transitions = [{**t, "conditions": "let_go"} if t["trigger"] == "remove" else t
                   for t in door_declaration().transitions]
    with pytest.raises(DeclarationError) as refused:
        door_declaration(guards=guards, transitions=transitions)
    assert str(refused.value) == (
        "door: guard 'let_go' (in conditions of OPEN, JAMMED -remove-> GONE) accepts "
        "Pull.NONE, which event 'remove' never carries; its answers are Push.NONE")
    unless = [*door_declaration().transitions,
              {"trigger": "remove", "source": Door.CLOSED, "dest": Door.GONE, "unless": "hard"}]
    with pytest.raises(DeclarationError, match=r"guard 'hard' \(in unless of CLOSED -remove-> "
                                               r"GONE\) accepts Push.HARD, which event 'remove' "
                                               r"never carries; its answers are Push.NONE$"):
        door_declaration(transitions=unless)


def jammed_unreachable() -> list[dict[str, Any]]:
    """The door's table with a hard push from CLOSED bouncing back: nothing enters JAMMED."""
    return [{**t, "dest": Door.CLOSED, "after": []}
            if (t["source"], t.get("conditions")) == (Door.CLOSED, "hard") else t
            for t in door_declaration().transitions]


def test_a_state_the_initial_state_cannot_reach_is_refused_unless_named_unreachable() -> None:
    with pytest.raises(DeclarationError) as refused:
        door_declaration(transitions=jammed_unreachable())
    assert str(refused.value) == (
        "door: state(s) JAMMED cannot be reached from the initial state CLOSED; add an edge "
        "into them, or name them in unreachable= if leaving them unused is deliberate")
    # deliberately unused (a variant over a shared Enum): declared, and it compiles and runs
    variant = door_declaration(transitions=jammed_unreachable(), unreachable=[Door.JAMMED])
    assert variant.unreachable == {Door.JAMMED}
    door = DoorRecord()
    variant.compile(listen=False).fire(door, "push", Push.HARD)
    assert door.state is Door.CLOSED
    # a state named unreachable that is reached is a stale name: refused too
    with pytest.raises(DeclarationError, match=r"^door: state\(s\) OPEN are named in "
                                               r"unreachable= but can be reached from the "
                                               r"initial state CLOSED$"):
        door_declaration(unreachable=[Door.OPEN])


def test_a_final_state_that_declares_events_is_refused() -> None:
    with pytest.raises(DeclarationError) as refused:
        door_declaration(final=[Door.OPEN, Door.GONE])
    assert str(refused.value) == (
        "door: final state(s) OPEN declare events (OPEN -remove-> GONE); a record leaves the "
        "table in a final state, so no event may follow it")
    assert door_declaration(final=[Door.GONE]).final == {Door.GONE}


def test_named_states_are_members_of_the_states_enum_or_their_names() -> None:
    assert door_declaration(final=["GONE"]).final == {Door.GONE}
    with pytest.raises(DeclarationError, match=r"^door: final names 'GONER', which is not a "
                                               r"state of Door \(its states: "):
        door_declaration(final=["GONER"])
    with pytest.raises(DeclarationError, match=r"failure_states names <Push\.HARD: 2>, which "
                                               r"is not a member of Door; give a member of "
                                               r"Door or its name"):
        door_declaration(failure_states=[Push.HARD])


# -- an action that raises names itself and its step -------------------------------------------

class Hinge(Exception):
    """What the user's action raises."""


def broken_hinge(record: Any, answer: Any, detail: Any) -> None:
    raise Hinge(f"hinge broke on {answer.name}")


def test_an_action_that_raises_keeps_its_exception_and_names_action_and_step() -> None:
    machine = door_declaration(actions={"note_jam": broken_hinge}).compile(listen=False)
    door = DoorRecord()
    with pytest.raises(Hinge, match="hinge broke on HARD") as raised:
        machine.fire(door, "push", Push.HARD)
    assert raised.value.__notes__ == [
        "kvfsm: raised by action 'note_jam' of machine 'door', firing CLOSED -push(HARD)-> "
        "JAMMED; the record is in JAMMED (actions run after the state changed)"]
    # today's contract, kept: the state changed before the action ran, and the step counted
    assert door.state is Door.JAMMED and door.jams == 0
    assert machine.step(Door.CLOSED, "push", Push.HARD).count == 1


def test_an_action_that_raises_in_a_chain_names_its_own_step() -> None:
    machine = door_declaration(actions={"note_jam": broken_hinge}).compile(listen=False)
    chain = machine.chain(Door.CLOSED, [("push", Push.NONE, None), ("push", Push.HARD, None),
                                        ("remove", Push.NONE, None)])
    door = DoorRecord()
    with pytest.raises(Hinge, match=r"(?s)hinge broke.*action 'note_jam' of machine 'door', "
                                    r"firing CLOSED -push\(HARD\)-> JAMMED; the record is in "
                                    r"JAMMED"):
        machine.run(door, chain)
    assert door.state is Door.JAMMED, "the run stops where the action raised, as documented"
    assert chain.runs == 1


# -- module:ATTRIBUTE names a declaration, or says in one line why not -------------------------

@pytest.fixture
def importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for modules a test writes; they are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


@pytest.mark.parametrize(("spec", "module", "message"), [
    ("kvfsm.lifecycle:TRANSFER_MACHINE.nope", None,
     "'kvfsm.lifecycle:TRANSFER_MACHINE.nope': kvfsm.lifecycle:TRANSFER_MACHINE has no "
     "attribute 'nope'"),
    ("kvfsm_t14_loud:M", "raise RuntimeError('first line\\n  second line')",
     "'kvfsm_t14_loud:M': cannot import 'kvfsm_t14_loud': RuntimeError: first line second line"),
    ("kvfsm_t14_exits:M", "raise SystemExit('usage: no arguments')",
     "'kvfsm_t14_exits:M': cannot import 'kvfsm_t14_exits': SystemExit: usage: no arguments"),
    ("kvfsm_t14_lazy:M", "def __getattr__(name):\n    raise LookupError(name + ' is not ready')",
     "'kvfsm_t14_lazy:M': reading 'M' of kvfsm_t14_lazy raised LookupError: M is not ready"),
    ("kvfsm_t14_class:Door", "class Door:\n    pass",
     "'kvfsm_t14_class:Door' is not a kvfsm Declaration (found type)"),
])
def test_a_spec_that_names_no_declaration_gets_one_line_saying_why(
    importable: Path, spec: str, module: str | None, message: str,
) -> None:
    if module is not None:
        (importable / f"{spec.partition(':')[0]}.py").write_text(module + "\n")
    with pytest.raises(ValueError) as refused:
        load_machine(spec)
    assert str(refused.value) == message


def test_a_module_whose_declaration_is_refused_names_the_refusal(importable: Path) -> None:
    (importable / "kvfsm_t14_final.py").write_text(textwrap.dedent("""
        import enum
        from kvfsm import Declaration

        class Lamp(enum.Enum):
            OFF = 1
            ON = 2

        class Press(enum.Enum):
            OK = 1

        LAMP = Declaration(
            "lamp", states=Lamp, initial=Lamp.OFF, answers={"press": [Press.OK]}, guards={},
            actions={}, final=[Lamp.ON],
            transitions=[{"trigger": "press", "source": Lamp.OFF, "dest": Lamp.ON},
                         {"trigger": "press", "source": Lamp.ON, "dest": Lamp.OFF}])
        """))
    with pytest.raises(ValueError, match=r"^'kvfsm_t14_final:LAMP': cannot import "
                                         r"'kvfsm_t14_final': DeclarationError: lamp: final "
                                         r"state\(s\) ON declare events \(ON -press-> OFF\)"):
        load_machine("kvfsm_t14_final:LAMP")


def test_a_spec_that_is_not_a_str_is_refused_by_value() -> None:
    with pytest.raises(ValueError, match=r"^a machine is named by a str \(module:ATTRIBUTE, or "
                                         r"one of transfer, peer_receive, peer_link\), got None$"):
        load_machine(None)  # type: ignore[arg-type]


def test_a_give_up_that_matches_no_edge_is_told_to_go_somewhere_not_to_stay() -> None:
    """The hint said "declare the stay as a self-loop" for EXHAUSTED too, which a runner then
    refuses: a give-up that stays would be tried for ever."""
    from kvfsm.lifecycle import Answer  # noqa: PLC0415

    with pytest.raises(DeclarationError, match=r"door: in state CLOSED, event 'push' with "
                                               r"answer EXHAUSTED matches no edge; declare where "
                                               r"a give-up goes: an edge to another state"):
        door_declaration(answers={"push": [*Push, Answer.EXHAUSTED], "remove": [Push.NONE]})
