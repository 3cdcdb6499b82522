"""Declare a machine with ``transitions``; run a dispatch table compiled from it.

A :class:`Declaration` is the single source of truth for one kind of machine: its states (an
Enum), its events, the answers each event can carry, named guards over those answers, named
actions, and the transition list in ``transitions``' own dict format. Declaring builds a real
``transitions.Machine`` (which validates the states and the table) and reads the table back out of
it, so what runs is exactly what ``transitions`` was given.

Guards here are pure predicates over the *answer* an event carries (what NIXL answered: ``PROC``,
``DONE``, ``RAISED``...). Because every event has a finite answer domain, compilation evaluates
every guard for every answer up front and stores, per ``(state, event, answer)``, the one
:class:`Step` that ``transitions`` would take, trying guards in declaration order as it does.
Compilation also rejects two kinds of mistakes that ``transitions`` accepts silently:

* overlapping guards: two edges of one ``(state, event)`` that both accept the same answer, where
  declaration order would quietly decide the winner;
* undeclared stays: an answer that no edge of a declared ``(state, event)`` accepts, where
  ``transitions`` would silently refuse and leave the machine where it was. A stay must be a
  declared self-loop.

Declaring also refuses what would only show later, far from its cause: a guard on an edge that
accepts an answer its event never carries (a member of another Enum, say: the edge would then
miss the answer it was meant for), a state the initial state cannot reach (its edges are dead
code; a variant that leaves states of a shared Enum unused names them in ``unreachable``), and a
final state that declares events (a record leaves the table there: whatever followed would act
on a result already handed out).

At run time :meth:`CompiledMachine.fire` is three dict lookups, an attribute store and the
step's actions. An action that raises leaves its exception as it was (its type is what callers
catch), with a note naming the machine, the action and the step. Each step counts how often it
was taken, which gives per-transition counts and transition coverage for free. A driver that
knows which calls follow one another can also take several steps at once:
:meth:`CompiledMachine.chain` reads a :class:`Chain` out of the table (each step from where the
one before left off, so it is exactly what firing them one by one would do), and
:meth:`CompiledMachine.run` takes it with one state change, one count and one trace entry.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from transitions import Machine

__all__ = [
    "COMPILE_LISTENERS",
    "Action",
    "Chain",
    "CompiledMachine",
    "Declaration",
    "DeclarationError",
    "Edge",
    "InvalidTransition",
    "Record",
    "Step",
]

S = TypeVar("S", bound=enum.Enum)
A = TypeVar("A", bound=enum.Enum)


class Record(Protocol[S]):
    """Anything that carries a machine's current state in a ``state`` attribute."""

    state: S


#: An action runs after the state changed: ``action(record, answer, detail)``.
Action = Callable[[Any, Any, Any], None]


class DeclarationError(ValueError):
    """The declared machine is inconsistent (unknown name, overlapping guards, missing answer)."""


class InvalidTransition(RuntimeError):
    """An event was fired in a state, or with an answer, that the machine does not declare."""

    def __init__(self, machine: str, state: enum.Enum, event: str, answer: Any,
                 reason: str | None = None) -> None:
        self.machine = machine
        self.state = state
        self.event = event
        self.answer = answer
        super().__init__(
            f"{machine}: " + (reason or f"event {event!r} is not declared in state "
                                        f"{getattr(state, 'name', state)}"))


@dataclass(frozen=True, slots=True)
class Edge:
    """One declared transition, as read back from the ``transitions`` machine."""

    event: str
    source: str
    dest: str
    conditions: tuple[str, ...]
    unless: tuple[str, ...]
    actions: tuple[str, ...]
    #: position among the edges of the same (source, event): the order guards are tried in
    order: int

    @property
    def is_loop(self) -> bool:
        """True for a self-loop (the machine stays where it is)."""
        return self.source == self.dest

    @property
    def guard_label(self) -> str:
        """The guards as ``transitions`` draws them: ``a && !b``; empty when unguarded."""
        return " && ".join([*self.conditions, *(f"!{name}" for name in self.unless)])


class Step(Generic[S]):
    """What firing one event with one answer does in one state: go to ``dest``, run ``actions``."""

    __slots__ = ("actions", "answer", "chains", "dest", "edge", "is_stay", "source", "taken")

    def __init__(
        self, source: S, answer: enum.Enum, dest: S, edge: Edge, actions: tuple[Action, ...]
    ) -> None:
        self.source = source
        self.answer = answer
        self.dest = dest
        self.edge = edge
        self.actions = actions
        #: a self-loop without actions: taking it changes nothing at all
        self.is_stay = source is dest and not actions
        #: how many times this step was taken on its own (fired, or counted as a stay)
        self.taken = 0
        #: the chains this step is part of, once per time it is taken in each
        self.chains: tuple[Chain[S], ...] = ()

    @property
    def count(self) -> int:
        """How many times this step was taken since compilation: on its own or in a chain."""
        return self.taken + sum(chain.runs for chain in self.chains)

    def __repr__(self) -> str:
        return (f"<Step {self.source.name} -{self.edge.event}({self.answer.name})-> "
                f"{self.dest.name} x{self.count}>")


class Chain(Generic[S]):
    """Steps taken in one go: what firing several events in a row, each with the answer its
    call gave, does from one state. Built from the table by :meth:`CompiledMachine.chain`, so
    running it (:meth:`CompiledMachine.run`) takes the same states, actions and counts as
    firing its steps one by one, minus the lookups. A driver that made several calls and got
    the expected answer from each takes them as one chain; a trace keeps the chain, with the
    time, as it would keep one step.
    """

    __slots__ = ("acting", "dest", "moves", "runs", "source", "steps", "traced")

    def __init__(self, moves: Sequence[tuple[Step[S], Any]]) -> None:
        #: (step, the detail its actions get), in the order they are taken
        self.moves = tuple(moves)
        self.steps = tuple(step for step, _ in self.moves)
        self.source = self.steps[0].source
        self.dest = self.steps[-1].dest
        #: the moves whose steps have actions: only they need the state set on the way
        self.acting = tuple((step, detail) for step, detail in self.moves if step.actions)
        #: the steps a trace keeps (stays change nothing and are not kept)
        self.traced = tuple(step for step in self.steps if not step.is_stay)
        #: how many times the chain was run (each of its steps counts it as taken)
        self.runs = 0
        for step in self.steps:  # once per time it is taken in the chain
            step.chains += (self,)

    def __repr__(self) -> str:
        return "<Chain " + " ".join(
            f"-{step.edge.event}({step.answer.name})-> {step.dest.name}"
            for step in self.steps) + ">"


def _collection(name: str, what: str, given: object, of: str, example: str) -> tuple[Any, ...]:
    """``given`` as a tuple, or DeclarationError unless it is a collection (a lone state,
    answer or str is not: iterating it would take it apart, or fail inside the engine)."""
    if isinstance(given, str | bytes | enum.Enum) or not isinstance(given, Iterable):
        raise DeclarationError(f"{name}: {what} must be a collection of {of} ({example}), "
                               f"got {type(given).__name__} {given!r}")
    return tuple(given)


def _answer_sets(name: str, what: str, given: object) -> dict[Any, tuple[Any, ...]]:
    """``answers`` or ``guards``: each name's answers as a tuple of Enum members, or
    DeclarationError naming the first that is not."""
    if not isinstance(given, Mapping):
        raise DeclarationError(f"{name}: {what} must map names to answers, got "
                               f"{type(given).__name__} {given!r}")
    sets = {}
    for key, accepted in given.items():
        sets[key] = _collection(name, f"{what}[{key!r}]", accepted, "answers",
                                "[Answer.OK, ...]")
        for answer in sets[key]:
            if not isinstance(answer, enum.Enum):
                raise DeclarationError(
                    f"{name}: {what}[{key!r}] holds {answer!r}, which is not a member of an "
                    "Enum: answers are Enum members (class Answer(enum.Enum))")
    return sets


def _mapping(name: str, what: str, given: object, example: str, *,
             none: bool = True) -> Mapping[Any, Any]:
    """``given`` (None: empty, where ``none`` allows it), or DeclarationError unless it is a
    mapping."""
    if given is None and none:
        return {}
    if not isinstance(given, Mapping):
        empty = "" if none else "; give {} for none"
        raise DeclarationError(f"{name}: {what} must be a dict ({example}), got "
                               f"{type(given).__name__} {given!r}{empty}")
    return given


def _state(name: str, what: str, given: object, states: type[enum.Enum]) -> Any:
    """The member of ``states`` that ``given`` is, or names (as a transition's source or dest
    names one); DeclarationError naming what was given, and what to give, otherwise."""
    if isinstance(given, states):
        return given
    known = ", ".join(states.__members__)
    if isinstance(given, str) and not isinstance(given, enum.Enum):
        try:
            return states[given]
        except KeyError:
            raise DeclarationError(f"{name}: {what} names {given!r}, which is not a state of "
                                   f"{states.__name__} (its states: {known})") from None
    if isinstance(given, enum.Enum) and given.name in states.__members__:
        hint = (f"give {states.__name__}.{given.name} (the member of the states' Enum) or its "
                f"name {given.name!r}")
    else:
        hint = f"give a member of {states.__name__} or its name (its states: {known})"
    raise DeclarationError(f"{name}: {what} names {given!r}, which is not a member of "
                           f"{states.__name__}; {hint}")


#: what a transition names, each of it required
_TRANSITION_KEYS = ("trigger", "source", "dest")


def _transition_list(name: str, transitions: object) -> list[Mapping[str, Any]]:
    """``transitions`` as a list, or DeclarationError naming the first that is not a mapping
    with a trigger, a source and a dest."""
    if isinstance(transitions, Mapping):  # (iterating it would give its keys)
        raise DeclarationError(f"{name}: transitions must be a list of dicts, one a "
                               f"transition, got one dict {transitions!r}")
    listed = list(_collection(name, "transitions", transitions, "transitions",
                              "[{'trigger': ..., 'source': ..., 'dest': ...}]"))
    for index, transition in enumerate(listed):
        if not isinstance(transition, Mapping):
            raise DeclarationError(f"{name}: transitions[{index}] must be a dict with "
                                   f"{', '.join(_TRANSITION_KEYS)}, got {transition!r}")
        missing = [key for key in _TRANSITION_KEYS if key not in transition]
        if missing:
            raise DeclarationError(f"{name}: transitions[{index}] has no "
                                   f"{' nor '.join(repr(k) for k in missing)}: {transition!r}")
        source, dest = transition["source"], transition["dest"]
        if isinstance(source, enum.EnumMeta):  # every state, as transitions reads it: kept
            source = list(source)  # as the list of them (an extension maps each by name)
            listed[index] = {**transition, "source": source}
        sources = source if isinstance(source, list | tuple) else [source]
        if not sources or not all(isinstance(state, str | enum.Enum) for state in sources):
            raise DeclarationError(f"{name}: transitions[{index}] has source {source!r}: a "
                                   "state (its name or member), a list of states, or the "
                                   "states' Enum (every state)")
        if dest is not None and not isinstance(dest, str | enum.Enum):
            raise DeclarationError(f"{name}: transitions[{index}] has dest {dest!r}: one "
                                   "state (its name or member; None for a stay)")
    return listed


class Declaration(Generic[S, A]):
    """A machine declared once with ``transitions``: the source of truth for engine and diagram.

    Args:
        name: the machine's name (used in errors, diagrams and coverage).
        states: the Enum of states. Wherever a state is named (``initial``, ``final``,
            ``failure_states``, ``unreachable``, ``running``, the keys of ``effects``, and a
            transition's ``source`` and ``dest``), it is given as a member of this Enum or by
            its name (``Door.BROKEN`` or ``"BROKEN"``).
        initial: the state every record starts in.
        answers: for each event name, the answers it can carry (members of one Enum).
        guards: for each guard name, the set of answers it accepts.
        actions: for each action name, the function that performs it.
        transitions: the table, as ``transitions`` dicts (``trigger``, ``source``, ``dest``,
            optional ``conditions``, ``unless`` and ``after``), grouped by source state.
        final: the states a record leaves the table from (drawn distinct in diagrams); they
            declare no events.
        failure_states: the states that mean the run went wrong; diagrams draw the paths through
            them as failure paths and the paths that avoid them as the success path. A tier's
            job that ends in a final one fails, whatever it latched (quarantined, its handles
            held for good, if it still holds its transfer handle there).
        unreachable: states no path from ``initial`` enters, on purpose: a variant of a machine
            that leaves some states of a shared Enum unused (the explorer's broken lifecycles,
            a diagram's example of dead code). Any other state the initial state cannot reach
            is refused, and so is a state named here that it can reach.
        calls: for each event, what it calls to get the answer it carries: one name, or
            several in the order they are made (diagrams name them on the event's edges). An
            event left out calls nothing worth naming.
        effects: for each state a record waits in, the effect it waits on, named by the event
            that effect fires (a runner makes the effect, then fires its event with what it
            answered). What a runner needs to run the machine is read from here, never kept
            beside it: which call a state makes, when a record is over (a final state waits on
            nothing). When given, every state that is not final (nor named in
            ``unreachable``) has one, no final state has one, and each is an event its state
            declares.
        running: the states in which the work a record stands for may still be under way
            outside the machine (NIXL may touch memory): a runner polls them, never gives them
            up at a shutdown, and bounds how long they run. They are not final, and all wait
            on one effect (the check of running work).

    Raises:
        DeclarationError: the declaration is inconsistent; the one-line message names the
            state, edge, guard or action at fault.
    """

    def __init__(
        self,
        name: str,
        *,
        states: type[S],
        initial: S | str,
        answers: Mapping[str, Iterable[A]],
        guards: Mapping[str, Iterable[A]],
        actions: Mapping[str, Action],
        transitions: Sequence[Mapping[str, Any]],
        final: Iterable[S | str] = (),
        failure_states: Iterable[S | str] = (),
        unreachable: Iterable[S | str] = (),
        calls: Mapping[str, str | Sequence[str]] | None = None,
        effects: Mapping[S, str] | Mapping[str, str] | None = None,
        running: Iterable[S | str] = (),
    ) -> None:
        if not isinstance(name, str) or not name:
            raise DeclarationError(f"a machine's name must be a non-empty str, got "
                                   f"{type(name).__name__} {name!r}")
        if not (isinstance(states, type) and issubclass(states, enum.Enum)):
            raise DeclarationError(
                f"{name}: states must be an Enum class (class MyState(enum.Enum): ...), got "
                f"{type(states).__name__} {states!r}; to add states to a machine by name, use "
                "its extend(states=[...])")
        # each collection read once, here (a generator is used up by reading it); a state is
        # given as a member of ``states`` or by its name, as a transition's source and dest
        named: dict[str, tuple[S, ...]] = {
            what: tuple(_state(name, what, state, states) for state in _collection(
                name, what, given, "states", f"[{states.__name__}.X] or ['X']"))
            for what, given in (("final", final), ("failure_states", failure_states),
                                ("unreachable", unreachable), ("running", running))}
        start: S = _state(name, "initial", initial, states)
        waits: dict[S, Any] = {}
        for state, effect in _mapping(name, "effects", effects,
                                      "{State.X: 'event'} or {'X': 'event'}").items():
            member = _state(name, "effects", state, states)
            if member in waits:
                raise DeclarationError(f"{name}: effects names state {member.name} twice")
            waits[member] = effect
        answers, guards = (_answer_sets(name, what, given)
                           for what, given in (("answers", answers), ("guards", guards)))
        actions = _mapping(name, "actions", actions, "{'name': function}", none=False)
        calls = _mapping(name, "calls", calls, "{'event': 'call'}")
        transitions = _transition_list(name, transitions)
        self.name = name
        self.states = states
        self.initial = start
        self.answers: dict[str, frozenset[A]] = {e: frozenset(a) for e, a in answers.items()}
        self.guards: dict[str, frozenset[A]] = {g: frozenset(a) for g, a in guards.items()}
        self.actions = dict(actions)
        self.transitions = [dict(t) for t in transitions]
        self.final = frozenset(named["final"])
        self.failure_states = frozenset(named["failure_states"])
        self.unreachable = frozenset(named["unreachable"])
        self.calls: dict[str, tuple[str, ...]] = {
            str(event): (named,) if isinstance(named, str) else tuple(named)
            if isinstance(named, Iterable) else named  # (refused below)
            for event, named in calls.items()}
        #: the effect each state waits on, by the event it fires (empty: none declared)
        self.effects: dict[S, str] = {state: str(effect) for state, effect in waits.items()}
        #: the states in which the work may still be under way outside the machine
        self.running = frozenset(named["running"])
        self._check_states()
        self._check_names()
        self.edges: tuple[Edge, ...] = self._read_edges(self.build_machine(_Inert()))
        known = {state.name for state in states}
        for edge in self.edges:
            for end in (edge.source, edge.dest):
                if end not in known:
                    raise DeclarationError(f"{self.name}: edge {edge.source} -{edge.event}-> "
                                           f"{edge.dest} names an unknown state {end!r}")
        self._resolve()  # fail at declaration time, not at first use
        self._check_reachable()
        self._check_final()
        self._check_effects(waits)

    # -- the transitions machine ------------------------------------------------------------

    def build_machine(self, model: Any, **options: Any) -> Machine:
        """A fresh ``transitions`` machine for ``model`` (no auto transitions, strict triggers)."""
        machine_class = options.pop("machine_class", Machine)
        machine: Machine = machine_class(
            model=model,
            states=self.states,
            initial=self.initial,
            transitions=self.transitions,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            **options,
        )
        return machine

    def reference_model(self) -> Any:
        """A model whose guards and actions are the declared ones, for running ``transitions``.

        Guards are methods answering whether they accept the answer an event carries; actions
        record their names in ``model.actions_run`` instead of touching a real record.
        """
        namespace: dict[str, Any] = {}
        for guard, accepted in self.guards.items():
            namespace[guard] = _guard_method(accepted)
        for action in self.actions:
            namespace[action] = _action_method(action)
        model_class = type(f"{self.name}_reference_model", (), namespace)
        model = model_class()
        model.actions_run = []
        self.build_machine(model)
        return model

    # -- compilation --------------------------------------------------------------------------

    def compile(self, actions: Mapping[str, Action] | None = None, *,
                trace: bool = False, listen: bool = True) -> CompiledMachine[S, A]:
        """Compile the declaration into a dispatch table.

        Args:
            actions: replacements for any of the declared actions.
            trace: append each step taken, with the time, to the record's ``trace`` list;
                stays (self-loops without actions, such as a poll answered PROC) change
                nothing and are not kept.
            listen: tell :data:`COMPILE_LISTENERS` (transition coverage); tools that fire
                every edge on purpose (the table explorer, trace replay) pass False, so what
                they fire is not counted as tested.

        Raises:
            DeclarationError: a replacement names no declared action, or is not a function.
        """
        if actions is not None and not isinstance(actions, Mapping):
            raise DeclarationError(f"{self.name}: compile's actions must be a dict of an "
                                   f"action's name to its replacement, got "
                                   f"{type(actions).__name__} {actions!r:.80}")
        for action, function in (actions or {}).items():
            if action not in self.actions:
                raise DeclarationError(f"{self.name}: compile replaces action {action!r}, which "
                                       f"is not declared (actions: {', '.join(self.actions)})")
            if not callable(function):
                raise DeclarationError(f"{self.name}: the replacement of action {action!r} must "
                                       f"be a function, got {type(function).__name__} "
                                       f"{function!r}")
        compiled = CompiledMachine(self, self._resolve({**self.actions, **(actions or {})}),
                                   trace=trace)
        for listener in list(COMPILE_LISTENERS) if listen else ():
            listener(compiled)
        return compiled

    def extend(
        self,
        name: str,
        *,
        states: Iterable[str] = (),
        replace: Mapping[tuple[str, str, str], Mapping[str, Any]] | None = None,
        transitions: Sequence[Mapping[str, Any]] = (),
        answers: Mapping[str, Iterable[A]] | None = None,
        guards: Mapping[str, Iterable[A]] | None = None,
        actions: Mapping[str, Action] | None = None,
        calls: Mapping[str, str | Sequence[str]] | None = None,
        effects: Mapping[str, str] | None = None,
        running: Iterable[str] = (),
        final: Iterable[str] = (),
        failure_states: Iterable[str] = (),
        unreachable: Iterable[str] = (),
    ) -> Declaration[Any, A]:
        """A new machine: this one, with states, edges and effects of your own.

        The new machine's states are a new Enum (:attr:`states`): this machine's states, by
        name, then ``states``. Its table is this one's, on those states, with the edges keyed
        ``(source, trigger, conditions)`` in ``replace`` changed as given (``conditions`` is the
        guard's name, ``""`` for none; ``{"dest": "VERIFYING", "after": []}`` sends an edge
        elsewhere without its actions; an edge from several sources, or under several guards,
        is not replaced), then ``transitions`` added. ``answers``, ``guards``,
        ``actions``, ``calls`` and ``effects`` are added to (or replace by key) this machine's;
        ``running``, ``final``, ``failure_states`` and ``unreachable`` (states no edge enters
        any more once ``replace`` sent their edges elsewhere) are added to its sets. States are
        named by their names (a member of this machine's Enum is taken by its name too).

        Raises:
            DeclarationError: a state, or a replaced edge, that does not exist; a part of the
                wrong shape (a transition without its dest, one dict where a list of them goes,
                a list where a dict goes); a state given twice in ``effects`` (as a member and
                by its name); the name of the machine extended (the new machine takes a name
                of its own); or whatever the new declaration gets wrong (it is
                checked as any declaration is).
        """
        if not isinstance(name, str) or not name:
            raise DeclarationError(f"extend of {self.name!r}: the new machine's name must be a "
                                   f"non-empty str, got {type(name).__name__} {name!r}")
        if name == self.name:
            raise DeclarationError(
                f"{name}: extend names the new machine {name!r}, the name of the machine it "
                f"extends; give your machine a name of its own (diagrams, coverage and traces "
                f"tell machines apart by name)")
        names = [state.name for state in self.states]
        for field, given in (("states", states), ("running", running), ("final", final),
                             ("failure_states", failure_states), ("unreachable", unreachable)):
            if isinstance(given, str | bytes):  # (a str is iterable: one state per letter)
                raise DeclarationError(f"{name}: {field} must be a list of state names, got "
                                       f"{given!r}; write [{given!r}]")
        states, running, final, failure_states, unreachable = (
            _collection(name, field, given, "state names", "['VERIFYING']")
            for field, given in (("states", states), ("running", running), ("final", final),
                                 ("failure_states", failure_states),
                                 ("unreachable", unreachable)))
        answers, guards, actions, calls, effects = (
            _mapping(name, field, given, example) for field, given, example in (
                ("answers", answers, "{'event': [Answer.X, ...]}"),
                ("guards", guards, "{'guard': [Answer.X, ...]}"),
                ("actions", actions, "{'action': function}"),
                ("calls", calls, "{'event': 'call'}"),
                ("effects", effects, "{'STATE': 'event'}")))
        transitions = _transition_list(name, transitions)
        added = list(states)
        enum_name = name.title().replace("_", "") + "State"  # (the Enum made below)
        for state in added:
            if (not isinstance(state, str) or not state.isidentifier()
                    or (len(state) > 2 and state[0] == state[-1] == "_")
                    or state.startswith(f"_{enum_name}__")  # (its private names: no member)
                    or hasattr(enum.Enum, state)):
                # (_sunder_ and __dunder__ names, and the names an Enum has, are Enum's own:
                # no member, or Enum's own error)
                raise DeclarationError(f"{name}: states names the new states by their names "
                                       f"(identifiers, such as 'VERIFYING', neither _X_ nor "
                                       f"__X__ nor one of Enum's own attributes), got "
                                       f"{state!r}")
        clash = sorted(set(added) & set(names)) or sorted(
            {state for state in added if added.count(state) > 1})
        if clash:
            raise DeclarationError(f"{name}: states {clash} are named twice (states of "
                                   f"{self.name!r}: {', '.join(names)})")
        # made in the caller's module, so a state pickles once the caller keeps the Enum
        # under its name there (``VerifyState = VERIFY_MACHINE.states``)
        new = enum.Enum(  # type: ignore[misc]
            enum_name, [*names, *added],
            module=sys._getframe(1).f_globals.get("__name__"))
        new.__hash__ = object.__hash__  # type: ignore[method-assign]  # by identity, in C

        def ours(state: Any) -> Any:
            key = state.name if isinstance(state, enum.Enum) else state
            try:
                return new[key]
            except (KeyError, TypeError):  # (TypeError: a set, a list... named no state)
                raise DeclarationError(f"{name}: no state {key!r} (states: "
                                       f"{', '.join(new.__members__)})") from None

        def mapped(transition: Mapping[str, Any]) -> dict[str, Any]:
            edge = dict(transition)
            for end in ("source", "dest"):
                value = edge[end]
                edge[end] = ([ours(v) for v in value] if isinstance(value, list | tuple)
                             else ours(value))
            return edge

        changes = _replacements(name, replace, ours)
        table = []
        for transition in self.transitions:
            source, conditions = transition["source"], transition.get("conditions", "")
            key = (ours(source).name if not isinstance(source, list | tuple) else None,
                   str(transition["trigger"]),
                   conditions if isinstance(conditions, str) else tuple(conditions))
            change = changes.pop(key, None)
            table.append(mapped({**transition, **change} if change else transition))
        if changes:
            raise DeclarationError(f"{name}: replace names edges {self.name!r} does not have: "
                                   f"{sorted(changes)}")
        effects_now = {ours(s): e for s, e in self.effects.items()}
        waits: dict[Any, str] = {}
        for state, effect in effects.items():  # (a state given as a member and by its name
            member = ours(state)               # is refused, as Declaration refuses it)
            if member in waits:
                raise DeclarationError(f"{name}: effects names state {member.name} twice")
            waits[member] = effect
        effects_now.update(waits)
        with _noting_replaced(self, guards, actions):  # (a mistake there is said to be one)
            return Declaration(
                name,
                states=new,
                initial=ours(self.initial),
                answers={**self.answers, **answers},
                guards={**self.guards, **guards},
                actions={**self.actions, **actions},
                transitions=[*table, *map(mapped, transitions)],
                final=[*map(ours, self.final), *map(ours, final)],
                failure_states=[*map(ours, self.failure_states), *map(ours, failure_states)],
                unreachable=[*map(ours, self.unreachable), *map(ours, unreachable)],
                calls={**self.calls, **calls},
                effects=effects_now or None,
                running=[*map(ours, self.running), *map(ours, running)],
            )

    def edges_from(self, source: S, event: str) -> list[Edge]:
        """The edges leaving ``source`` on ``event``, in the order their guards are tried."""
        return [e for e in self.edges if e.source == source.name and e.event == event]

    def _check_states(self) -> None:
        """The initial state is not named unreachable (every state named is a member of
        ``states``: :func:`_state` resolved it)."""
        if self.initial in self.unreachable:
            raise DeclarationError(f"{self.name}: the initial state {self.initial.name} is "
                                   "named in unreachable")

    def _check_reachable(self) -> None:
        """Every state is entered by some path from the initial state, unless it is named in
        ``unreachable``; a state named there that is entered is refused too (the name is stale,
        and would hide the next state that really goes unreached)."""
        ahead: dict[str, set[str]] = {}
        for edge in self.edges:
            ahead.setdefault(edge.source, set()).add(edge.dest)
        reached, todo = {self.initial.name}, [self.initial.name]
        while todo:
            for dest in ahead.get(todo.pop(), ()):
                if dest not in reached:
                    reached.add(dest)
                    todo.append(dest)
        declared = {state.name for state in self.unreachable}
        unreached = [s.name for s in self.states if s.name not in reached | declared]
        if unreached:
            raise DeclarationError(
                f"{self.name}: state(s) {', '.join(unreached)} cannot be reached from the "
                f"initial state {self.initial.name}; add an edge into them, or name them in "
                "unreachable= if leaving them unused is deliberate")
        entered = [s.name for s in self.states if s.name in declared & reached]
        if entered:
            raise DeclarationError(
                f"{self.name}: state(s) {', '.join(entered)} are named in unreachable= but "
                f"can be reached from the initial state {self.initial.name}")

    def _check_final(self) -> None:
        """A final state declares no event: a record leaves the table there, its result handed
        out, so nothing may follow (F6, refused before anything runs)."""
        final = {state.name for state in self.final}
        moves = [f"{e.source} -{e.event}-> {e.dest}" for e in self.edges if e.source in final]
        if moves:
            states = sorted({e.source for e in self.edges if e.source in final})
            raise DeclarationError(
                f"{self.name}: final state(s) {', '.join(states)} declare events "
                f"({', '.join(moves)}); a record leaves the table in a final state, so no "
                "event may follow it")

    def _check_effects(self, effects: Mapping[Any, Any]) -> None:
        """Each state waits on one effect that it declares the event of; final states on none;
        running states on one and the same (see the class's docstring)."""
        for state, effect in effects.items():
            if not isinstance(effect, str) or not effect:
                raise DeclarationError(f"{self.name}: the effect of {state.name} must be an "
                                       f"event's name (str), got {effect!r}")
        if not self.effects and not self.running:
            return
        declared = self._resolve()
        for state in self.states:
            effect = self.effects.get(state)
            if state in self.final:
                if effect is not None:
                    raise DeclarationError(f"{self.name}: final state {state.name} waits on "
                                           f"effect {effect!r}; a final state waits on nothing")
                continue
            if effect is None:
                if state in self.unreachable:
                    continue
                raise DeclarationError(
                    f"{self.name}: state {state.name} waits on no effect; name the effect it "
                    "waits on (the event that effect fires) in effects=")
            if effect not in declared.get(state, {}):
                raise DeclarationError(
                    f"{self.name}: state {state.name} waits on effect {effect!r}, but declares "
                    f"no event {effect!r}: what the effect answers could not be fired")
        if self.running & self.final:
            raise DeclarationError(
                f"{self.name}: state(s) "
                f"{', '.join(sorted(s.name for s in self.running & self.final))} are both "
                "running and final")
        waited = {self.effects[state] for state in self.running if state in self.effects}
        if len(waited) > 1:
            raise DeclarationError(
                f"{self.name}: running states wait on one effect (the check of running work), "
                f"not on {', '.join(sorted(waited))}")

    def _check_names(self) -> None:
        for transition in self.transitions:
            self._check_transition(transition)
        for guard, accepted in self.guards.items():
            if not accepted:
                raise DeclarationError(f"{self.name}: guard {guard!r} accepts no answer")
        for action, function in self.actions.items():
            if not callable(function):
                raise DeclarationError(
                    f"{self.name}: action {action!r} must be a function "
                    f"(action(record, answer, detail)), got {type(function).__name__} "
                    f"{function!r}")
        for event, named in self.calls.items():
            if event not in self.answers:
                raise DeclarationError(f"{self.name}: calls names {event!r}, which is not one "
                                       "of its events")
            if not (isinstance(named, tuple) and named
                    and all(isinstance(name, str) and name for name in named)):
                raise DeclarationError(f"{self.name}: the calls of {event!r} must be names "
                                       f"(str), got {named!r}")

    def _check_transition(self, transition: Mapping[str, Any]) -> None:
        trigger = transition.get("trigger")
        if not isinstance(trigger, str):
            raise DeclarationError(f"{self.name}: transition {transition} has trigger "
                                   f"{trigger!r}; a trigger is an event's name (str)")
        if trigger not in self.answers:
            raise DeclarationError(
                f"{self.name}: transition {transition} has trigger {trigger!r}, an event "
                f"answers= does not declare; declare the answers it carries: "
                f"answers={{{str(trigger)!r}: [Answer.X, ...]}} (events declared: "
                f"{', '.join(map(str, self.answers)) or 'none'})")
        for key in transition:
            if key not in {"trigger", "source", "dest", "conditions", "unless", "after"}:
                raise DeclarationError(f"{self.name}: unsupported key {key!r} in {transition}"
                                       " (guards go in conditions/unless, actions in after)")
        known: dict[str, Mapping[str, object]] = {
            "conditions": self.guards, "unless": self.guards, "after": self.actions}
        for key, names in known.items():
            kind = "action" if key == "after" else "guard"
            for name in _names(transition.get(key)):
                if not isinstance(name, str):
                    raise DeclarationError(
                        f"{self.name}: {key} of {transition} must be names (str), got "
                        f"{name!r}; declare guards in guards= and actions in actions=")
                if name not in names:
                    raise DeclarationError(f"{self.name}: unknown {kind} {name!r} in {key} of "
                                           f"{transition}")
                if kind == "guard":
                    self._check_guard_answers(name, key, transition)

    def _check_guard_answers(self, guard: str, key: str, transition: Mapping[str, Any]) -> None:
        """A guard on an edge accepts only answers the edge's event can carry. One that names
        anything else (often a same-named member of another Enum) is a mistake that would
        otherwise surface as an answer that "matches no edge", far from the guard."""
        trigger = transition["trigger"]
        carried = self.answers[trigger]
        stray = self.guards[guard] - carried
        if stray:
            sources = ", ".join(_state_names(transition["source"]))
            raise DeclarationError(
                f"{self.name}: guard {guard!r} (in {key} of {sources} -{trigger}-> "
                f"{', '.join(_state_names(transition.get('dest')))}) accepts "
                f"{', '.join(sorted(map(_answer_name, stray)))}, which event {str(trigger)!r} "
                f"never carries; its answers are "
                f"{', '.join(sorted(map(_answer_name, carried)))}")

    def _read_edges(self, machine: Machine) -> tuple[Edge, ...]:
        edges: list[Edge] = []
        for event_name, event in machine.events.items():
            for source, declared in event.transitions.items():
                for order, transition in enumerate(declared):
                    edges.append(Edge(
                        event=event_name,
                        source=source,
                        dest=transition.dest if transition.dest is not None else source,
                        conditions=tuple(str(c.func) for c in transition.conditions if c.target),
                        unless=tuple(str(c.func) for c in transition.conditions
                                     if not c.target),
                        actions=tuple(str(a) for a in transition.after),
                        order=order,
                    ))
        return tuple(edges)

    def _accepts(self, edge: Edge, answer: A) -> bool:
        return all(answer in self.guards[g] for g in edge.conditions) and not any(
            answer in self.guards[g] for g in edge.unless
        )

    def _resolve(
        self, actions: Mapping[str, Action] | None = None
    ) -> dict[S, dict[str, dict[A, Step[S]]]]:
        actions = self.actions if actions is None else actions
        table: dict[S, dict[str, dict[A, Step[S]]]] = {}
        by_source: dict[tuple[str, str], list[Edge]] = {}
        for edge in self.edges:
            by_source.setdefault((edge.source, edge.event), []).append(edge)
        for (source_name, event), edges in by_source.items():
            source = self.states[source_name]
            row: dict[A, Step[S]] = {}
            for answer in sorted(self.answers[event], key=lambda a: a.name):
                accepting = [e for e in edges if self._accepts(e, answer)]
                if not accepting:
                    what = ("declare where a give-up goes: an edge to another state (a "
                            "failure's)" if answer.name == "EXHAUSTED"
                            else "declare the stay as a self-loop")
                    raise DeclarationError(
                        f"{self.name}: in state {source_name}, event {event!r} with answer "
                        f"{answer.name} matches no edge; {what}")
                if len(accepting) > 1:
                    raise DeclarationError(
                        f"{self.name}: in state {source_name}, event {event!r} with answer "
                        f"{answer.name} matches {len(accepting)} edges (guards overlap): "
                        + ", ".join(f"-> {e.dest} [{e.guard_label}]" for e in accepting))
                edge = accepting[0]
                row[answer] = Step(source, answer, self.states[edge.dest], edge,
                                   tuple(actions[a] for a in edge.actions))
            table.setdefault(source, {})[event] = row
        for edge in self.edges:
            if not any(self._accepts(edge, a) for a in self.answers[edge.event]):
                raise DeclarationError(f"{self.name}: edge {edge.source} -{edge.event}-> "
                                       f"{edge.dest} [{edge.guard_label}] can never be taken")
        return table


#: called with every machine compiled, e.g. by the transition-coverage plugin
COMPILE_LISTENERS: list[Callable[[CompiledMachine[Any, Any]], None]] = []


class CompiledMachine(Generic[S, A]):
    """The dispatch table compiled from a :class:`Declaration`; what runs on the hot path."""

    __slots__ = ("_chains", "declaration", "name", "table", "trace", "verdict")

    def __init__(
        self, declaration: Declaration[S, A], table: dict[S, dict[str, dict[A, Step[S]]]],
        *, trace: bool = False,
    ) -> None:
        self.declaration = declaration
        self.name = declaration.name
        self.table = table
        self.trace = trace
        self._chains: dict[tuple[Any, ...], Chain[S]] = {}
        #: set by a test tool that ran this machine (an exploration, a replay of one of its
        #: paths): whether what it took counts as tested (its ``counted``, known once the
        #: tool is over); None: a machine no such tool ran, whose steps count
        self.verdict: Any = None

    def step(self, state: S, event: str, answer: A) -> Step[S]:
        """The step firing ``event`` with ``answer`` takes in ``state``; raises if undeclared."""
        try:
            return self.table[state][event][answer]
        except (KeyError, TypeError):
            raise self._refusal(state, event, answer) from None

    def _refusal(self, state: S, event: str, answer: Any) -> InvalidTransition:
        """Say precisely why ``event`` with ``answer`` cannot be fired in ``state``."""
        event = str(event)  # a StrEnum member reads as its trigger name
        declared = self.declaration.answers.get(event)
        if not isinstance(state, self.declaration.states):
            reason = (f"the record is in {state!r}, no state of this machine (a record's "
                      f"state is one of its members: {self.declaration.states.__name__}."
                      f"{self.declaration.initial.name} to begin with)")
        elif declared is None:
            reason = f"there is no event {event!r}"
        elif event not in self.table.get(state, {}):
            reason = f"event {event!r} is not declared in state {state.name}"
        else:
            carried = ", ".join(sorted(a.name for a in declared))
            reason = (f"event {event!r} in state {state.name} carries one of {carried}, "
                      f"not {answer!r}")
        return InvalidTransition(self.name, state, event, answer, reason)

    def fire(self, record: Record[S], event: str, answer: A, detail: Any = None) -> S:
        """Move ``record`` on ``event`` carrying ``answer``; run the step's actions.

        Raises:
            InvalidTransition: the event (or that answer) is not declared in the record's state;
                the record is left unchanged.
            Exception: whatever an action raised, unchanged (callers catch it by its type), with
                a note naming the action and the step. Actions run after the state changed, so
                the record is where the step took it, counted and traced, with what the actions
                before the failing one did; the actions after it did not run.
        """
        try:
            step = self.table[record.state][event][answer]
        except (KeyError, TypeError):
            raise self._refusal(record.state, event, answer) from None
        step.taken += 1
        record.state = step.dest
        if self.trace and not step.is_stay:
            record.trace += (step, time.monotonic())  # type: ignore[attr-defined]
        try:  # free while nothing raises (3.11's zero-cost exceptions): the hot path pays nothing
            for action in step.actions:
                action(record, answer, detail)
        except BaseException as error:  # (an interrupt may land before an action is bound)
            _blame(error, self.name, step, locals().get("action"), record)
            raise
        return step.dest

    def chain(self, state: S, moves: Sequence[tuple[str, A, Any]]) -> Chain[S]:
        """The chain of steps ``moves`` (event, answer, detail for its actions) takes from
        ``state``, each from where the one before left off. Asking again for the same moves
        gives the same chain (its steps count its runs once).

        Raises:
            InvalidTransition: a move is not declared where the moves before it lead.
        """
        if not moves:
            raise ValueError(f"{self.name}: a chain needs at least one move")
        key = (state, tuple((str(event), answer, detail) for event, answer, detail in moves))
        known = self._chains.get(key)
        if known is not None:
            return known
        steps: list[tuple[Step[S], Any]] = []
        for event, answer, detail in moves:
            step = self.step(state, event, answer)
            steps.append((step, detail))
            state = step.dest
        chain = self._chains[key] = Chain(steps)
        return chain

    def run(self, record: Record[S], chain: Chain[S]) -> S:
        """Take every step of ``chain``: the same states, actions and counts as firing them one
        by one, with one trace entry (one time) for the whole chain. An action that raises
        stops the run where it is; the chain is counted as run.

        Raises:
            InvalidTransition: the record is not in the state the chain starts from; the
                record is left unchanged.
            Exception: whatever an action raised, unchanged, with a note naming the action and
                its step (as :meth:`fire`); the record is in that step's destination, and is
                not traced.
        """
        if record.state is not chain.source:
            raise InvalidTransition(self.name, record.state, chain.steps[0].edge.event,
                                    chain.steps[0].answer,
                                    f"a chain from {chain.source.name} cannot run in "
                                    f"state {record.state.name}")
        chain.runs += 1
        try:  # free while nothing raises, as in fire
            for step, detail in chain.acting:
                action = None  # the record's state store, until an action runs
                record.state = step.dest
                for action in step.actions:
                    action(record, step.answer, detail)
        except BaseException as error:  # (an interrupt may land before a step is bound)
            _blame(error, self.name, locals().get("step", chain.steps[0]),
                   locals().get("action"), record)
            raise
        record.state = chain.dest
        if self.trace and chain.traced:
            record.trace += (chain, time.monotonic())  # type: ignore[attr-defined]
        return chain.dest

    def steps(self) -> list[Step[S]]:
        """Every compiled step, in a stable order (by source, event, answer)."""
        return [
            step
            for state in self.declaration.states
            for event, row in sorted(self.table.get(state, {}).items())
            for _, step in sorted(row.items(), key=lambda item: item[0].name)
        ]

    def transition_counts(self) -> dict[Edge, int]:
        """How often each declared edge was taken, in declaration order."""
        counts = dict.fromkeys(self.declaration.edges, 0)
        for step in self.steps():
            counts[step.edge] += step.count
        return counts


def _replacements(name: str, replace: Mapping[Any, Any] | None,
                  ours: Callable[[Any], Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """``extend``'s ``replace``, keyed as the edges are looked up: each key a (source, trigger,
    guard) triple, each value a dict of what changes; anything else is refused, naming it."""
    if replace is None:
        return {}
    if not isinstance(replace, Mapping):
        raise DeclarationError(f"{name}: replace must be a dict of (source, trigger, guard) to "
                               f"the changes, got {type(replace).__name__} {replace!r}")
    changes: dict[tuple[Any, ...], dict[str, Any]] = {}
    for key, value in replace.items():
        if not isinstance(key, tuple) or len(key) != 3:
            raise DeclarationError(f"{name}: replace key {key!r} must be a (source, trigger, "
                                   "guard) triple (guard '' for an edge without conditions)")
        if not isinstance(value, Mapping):
            raise DeclarationError(f"{name}: replace[{key!r}] must be a dict of what changes "
                                   f"(such as {{'dest': ...}}), got {type(value).__name__} "
                                   f"{value!r}")
        source, trigger, conditions = key
        if not isinstance(trigger, str) or not isinstance(conditions, str):
            raise DeclarationError(f"{name}: replace key {key!r}: its trigger and guard must "
                                   "be names (str; guard '' for an edge without conditions)")
        changes[(ours(source).name, str(trigger), conditions)] = dict(value)
    return changes


class _Inert:
    """A model for the template machine that is only read, never triggered."""


def _blame(error: BaseException, machine: str, step: Step[Any], action: Action | None,
           record: Any) -> None:
    """Note on ``error`` which action of which step raised it (None: storing the record's
    state for the step raised), and where the record is.

    The exception itself is re-raised as it is: its type is what callers catch (a lifecycle's
    ``OutcomeAlreadyLatched``, an interrupt), and a wrapper would hide it from them. A note
    (PEP 678) is printed under the message in every traceback and by pytest, and matched by
    ``pytest.raises(match=...)``; an exception that passes through nested machines gets one
    note from each. Only the error path pays for it.
    """
    state = getattr(record, "state", None)
    where = state.name if isinstance(state, enum.Enum) else repr(state)
    firing = f"firing {step.source.name} -{step.edge.event}({step.answer.name})-> {step.dest.name}"
    if action is None:
        error.add_note(f"kvfsm: raised by the record's state store of machine {machine!r}, "
                       f"{firing}, before its actions; the record is in {where}")
        return
    names = [name for name, known in zip(step.edge.actions, step.actions, strict=True)
             if known is action]
    blamed = (f"action {' or '.join(map(repr, names)) or repr(action)} of machine {machine!r}, "
              f"{firing}")
    error.add_note(f"kvfsm: raised by {blamed}; the record is in {where} (actions run after the "
                   "state changed)")
    if hasattr(type(record), "action_error"):  # (a kvfsm Transfer: a failure this leaves
        # unlatched says what raised, not that no reason was recorded)
        record.action_error = f"{blamed} raised {type(error).__name__}: {error}"


@contextlib.contextmanager
def _noting_replaced(base: Declaration[Any, Any], guards: Mapping[str, Iterable[Any]],
                     actions: Mapping[str, Any]) -> Iterator[None]:
    """A declaration made by ``base.extend`` that is refused says which guards and actions
    given to it took the place of ``base``'s own of the same name (used on its edges too):
    a name taken by mistake otherwise surfaces as an error about another edge."""
    try:
        yield
    except DeclarationError as error:
        said = str(error)
        replaced = [f"{kind} {key!r}" for kind, given, have in (
            ("guard", guards, base.guards), ("action", actions, base.actions))
            for key in given if key in have and repr(key) in said]  # (the ones it names)
        if replaced:
            error.add_note(f"{', '.join(replaced)} given to extend() take(s) the place of "
                           f"machine {base.name!r}'s own of that name, on its edges too")
        raise


def _state_names(value: Any) -> list[str]:
    if value is None:
        return ["(unchanged)"]
    return [v.name if isinstance(v, enum.Enum) else str(v) for v in _names(value)]


def _answer_name(answer: Any) -> str:
    if isinstance(answer, enum.Enum):
        return f"{type(answer).__name__}.{answer.name}"
    return repr(answer)


def _names(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def _guard_method(accepted: frozenset[Any]) -> Callable[[Any, Any], bool]:
    def guard(self: Any, answer: Any, detail: Any = None) -> bool:
        return answer in accepted

    return guard


def _action_method(name: str) -> Callable[[Any, Any, Any], None]:
    def action(self: Any, answer: Any, detail: Any = None) -> None:
        self.actions_run.append(name)

    return action
