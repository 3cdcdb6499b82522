"""The diagrams say what the declarations say, the same bytes each time, and CI notices drift.

The DOT text is read back with a small parser written here, independently of the generator, and
compared with the declared tables themselves (the ``transitions`` dicts a machine was declared
with), for kvfsm's own machines and for machines a user declares.
"""

from __future__ import annotations

import copy
import enum
import errno
import html
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvfsm import Declaration, Transfer, TransferJob, TransferState
from kvfsm.cli import main
from kvfsm.diagrams import (
    MACHINES,
    DiagramError,
    check,
    failure_answers,
    load_declaration,
    to_dot,
    write,
)
from kvfsm.lifecycle import TRANSFER_MACHINE, Answer
from kvfsm.peer import PeerAnswer
from kvfsm.peer_link import LinkAnswer

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "diagrams"


def require_dot() -> None:
    """Skip (or under CI=true, fail) when graphviz's ``dot`` is missing."""
    if shutil.which("dot") is not None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail("graphviz's dot is not installed, and CI must render the diagrams "
                    "(scripts/setup installs the Debian package graphviz)")
    pytest.skip("graphviz's dot is not installed")


# -- a parser for the DOT subset the diagrams use ----------------------------------------------

_SPACE = re.compile(r"(?:\s+|//[^\n]*)*")
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|->|[\[\]{};,=]|[A-Za-z0-9_.#]+')


@dataclass
class DotGraph:
    """A parsed digraph: attributes of the graph, of each node, and of each edge in order."""

    name: str
    graph: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)
    edges: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)


def _tokens(text: str) -> list[str]:
    """IDs, quoted strings, HTML-like strings (balanced ``<...>``) and punctuation."""
    tokens: list[str] = []
    at = 0
    while True:
        at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
        if at == len(text):
            return tokens
        if text[at] == "<":
            depth, end = 0, at
            while end == at or depth:
                depth += {"<": 1, ">": -1}.get(text[end], 0)
                end += 1
        else:
            match = _TOKEN.match(text, at)
            assert match is not None, f"cannot read DOT at {text[at:at + 40]!r}"
            end = match.end()
        tokens.append(text[at:end])
        at = end


def _value(token: str) -> str:
    if token.startswith('"'):
        return re.sub(r'\\(["\\])', r"\1", token[1:-1])
    return token


def parse_dot(text: str) -> DotGraph:
    """Read ``digraph NAME { ... }`` made of attribute, node and edge statements."""
    tokens = _tokens(text)
    assert tokens[0] == "digraph" and tokens[2] == "{" and tokens[-1] == "}", tokens[:3]
    graph = DotGraph(_value(tokens[1]))
    at = 3

    def attrs() -> dict[str, str]:
        nonlocal at
        found: dict[str, str] = {}
        if tokens[at] != "[":
            return found
        at += 1
        while tokens[at] != "]":
            key, equals, value = tokens[at:at + 3]
            assert equals == "=", tokens[at:at + 3]
            found[key] = _value(value)
            at += 3
            if tokens[at] == ",":
                at += 1
        at += 1
        return found

    while tokens[at] != "}":
        head = tokens[at]
        at += 1
        if head in ("graph", "node", "edge"):
            found = attrs()
            if head == "graph":
                graph.graph.update(found)
        elif tokens[at] == "->":
            tail, target = _value(head), _value(tokens[at + 1])
            at += 2
            graph.edges.append((tail, target, attrs()))
        else:
            graph.nodes[_value(head)] = attrs()
        assert tokens[at] == ";", tokens[at - 2:at + 2]
        at += 1
    for tail, target, _ in graph.edges:
        assert tail in graph.nodes and target in graph.nodes, (tail, target)
    return graph


def label_lines(label: str) -> list[str]:
    """The lines a label shows: plain (``\\n``/``\\l`` breaks) or HTML-like (``<br/>``)."""
    if label.startswith("<"):
        cell = re.search(r"<td[^>]*>(.*)</td>", label, re.S)
        assert cell is not None, label
        return [html.unescape(re.sub(r"<[^>]+>", "", line)) for line in cell[1].split("<br/>")]
    return [line for line in re.split(r"\\[nlr]", label) if line]


@dataclass(frozen=True)
class DrawnEdge:
    """What one drawn edge says."""

    source: str
    dest: str
    event: str
    order: int | None
    conditions: tuple[str, ...]
    unless: tuple[str, ...]
    actions: tuple[str, ...]
    #: what the event calls, in order (``call(), ...`` lines, in italics)
    calls: tuple[str, ...] = ()
    #: the answers that take the edge, by name, as its guards' line lists them after them
    answers: tuple[str, ...] = ()


_CALLS = re.compile(r"\w+\(\)(?:, \w+\(\))*,?")


def read_edge(tail: str, head: str, attrs: dict[str, str]) -> tuple[DrawnEdge, bool]:
    """The edge's table entry, and whether its label calls it a retry.

    The label reads, line by line: ``[retry: ]event[ #n]``, any lines of ``call(), ...``,
    ``[guards] answers``, ``/ actions``, each part in that order.
    """
    first, *rest = label_lines(attrs["label"])
    match = re.fullmatch(r"(retry: )?(\S+?)(?: #(\d+))?", first)
    assert match is not None, first
    calls: list[str] = []
    conditions: list[str] = []
    unless: list[str] = []
    actions: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()
    part, calls_continue = 0, False  # part 1: calls, 2: guards, 3: actions; never back
    for line in rest:
        guarded = re.fullmatch(r"\[(.+)\] (\w+(?: \| \w+)*)", line)
        if guarded is not None:
            part, was = 2, part
            answers = tuple(guarded[2].split(" | "))
            for guard in guarded[1].split(" && "):
                (unless if guard.startswith("!") else conditions).append(guard.lstrip("!"))
        elif line.startswith("/ "):
            part, was = 3, part
            actions = tuple(line[2:].split(", "))
        else:
            assert _CALLS.fullmatch(line), line
            part, was = 1, part
            assert not calls or calls_continue, line  # one run of lines, broken after commas
            calls += re.findall(r"(\w+)\(\)", line)
            calls_continue = line.endswith(",")
        assert was <= part and (part == 1 or was < part), (first, rest)
    order = int(match[3]) if match[3] else None
    return DrawnEdge(tail, head, match[2], order, tuple(conditions), tuple(unless),
                     actions, tuple(calls), answers), bool(match[1])


def drawn_edges(graph: DotGraph) -> list[tuple[DrawnEdge, bool, dict[str, str]]]:
    """Every edge between states (not the entry point's), read."""
    return [(*read_edge(tail, head, attrs), attrs) for tail, head, attrs in graph.edges
            if graph.nodes[tail].get("shape") != "point"]


def drawn_kind(edge: DrawnEdge, retry: bool, attrs: dict[str, str]) -> str:
    """How the edge looks: bold solid = success, dashed = failure, dotted = retry."""
    style = attrs.get("style", "solid")
    if style == "dotted":
        assert retry and edge.source == edge.dest, edge
        return "retry"
    assert not retry, edge
    if style == "dashed":
        return "failure"
    if float(attrs.get("penwidth", "1")) >= 2:
        return "success"
    return "stay" if edge.source == edge.dest else "plain"


# -- the declared tables, read straight from what each machine was declared with ---------------

def _names(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _state(value: Any) -> str:
    return str(value.name if isinstance(value, enum.Enum) else value)


def declared_calls(declaration: Declaration[Any, Any]) -> dict[str, tuple[str, ...]]:
    """What each event calls, as the declaration's optional ``calls`` mapping says."""
    calls = getattr(declaration, "calls", None) or {}
    return {str(event): (named,) if isinstance(named, str) else tuple(named)
            for event, named in calls.items()}


def declared_table(declaration: Declaration[Any, Any]) -> list[DrawnEdge]:
    """The machine's table as declared: one entry per (source, transition dict)."""
    calls = declared_calls(declaration)
    rows: list[tuple[str, str, str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = []
    for transition in declaration.transitions:
        for source in _names(transition["source"]):
            dest = transition.get("dest")
            rows.append((_state(source), _state(source if dest is None else dest),
                         str(transition["trigger"]),
                         tuple(_names(transition.get("conditions"))),
                         tuple(_names(transition.get("unless"))),
                         tuple(_names(transition.get("after")))))
    tried: Counter[tuple[str, str]] = Counter((row[0], row[2]) for row in rows)
    seen: Counter[tuple[str, str]] = Counter()
    table = []
    for source, dest, event, conditions, unless, actions in rows:
        seen[source, event] += 1
        order = seen[source, event] if tried[source, event] > 1 else None
        answers = tuple(a.name for a in sorted(  # an Enum's members, in its order
            (a for a in declaration.answers[event]
             if all(a in declaration.guards[g] for g in conditions)
             and not any(a in declaration.guards[g] for g in unless)),
            key=lambda a: list(type(a)).index(a))) if conditions or unless else ()
        table.append(DrawnEdge(source, dest, event, order, conditions, unless, actions,
                               calls.get(event, ()), answers))
    return table


# -- machines a user declares ---------------------------------------------------------------

class Door(enum.Enum):
    """A user's machine: a door that may jam, be forced, and leave."""

    CLOSED = 1
    OPEN = 2
    JAMMED = 3
    FORCED = 4
    GONE = 5
    LOCKED = 6  # nothing leads here: its edges are on no path


class Push(enum.Enum):
    GENTLE = 1
    HARD = 2
    NONE = 3


def door(**overrides: Any) -> Declaration[Door, Push]:
    spec: dict[str, Any] = {
        "states": Door,
        "initial": Door.CLOSED,
        "answers": {"push": list(Push), "remove": [Push.NONE]},
        "guards": {"gentle": [Push.GENTLE], "hard": [Push.HARD], "nothing": [Push.NONE]},
        "actions": {"note_jam": lambda record, answer, detail: None,
                    "call_smith": lambda record, answer, detail: None},
        "transitions": [
            {"trigger": "push", "source": Door.CLOSED, "dest": Door.OPEN,
             "conditions": "gentle", "unless": ["hard"]},
            {"trigger": "push", "source": Door.CLOSED, "dest": Door.JAMMED, "conditions": "hard",
             "after": "note_jam"},
            {"trigger": "push", "source": Door.CLOSED, "dest": Door.CLOSED,
             "conditions": "nothing"},
            {"trigger": "push", "source": Door.JAMMED, "dest": Door.FORCED, "conditions": "hard",
             "after": ["note_jam", "call_smith"]},
            {"trigger": "push", "source": Door.JAMMED, "dest": Door.JAMMED,
             "conditions": "gentle", "after": "note_jam"},
            {"trigger": "push", "source": Door.JAMMED, "dest": Door.JAMMED,
             "conditions": "nothing"},
            {"trigger": "remove", "source": [Door.OPEN, Door.FORCED], "dest": Door.GONE},
            {"trigger": "push", "source": Door.LOCKED, "dest": Door.CLOSED, "unless": "nothing"},
            {"trigger": "push", "source": Door.LOCKED, "dest": Door.LOCKED,
             "conditions": "nothing"},
        ],
        "final": [Door.GONE],
        "failure_states": [Door.JAMMED],
        "unreachable": [Door.LOCKED],  # on purpose: its edges are on no path
    }
    spec.update(overrides)
    return Declaration("door", **spec)


#: what the events of kvfsm's machines call, as their declarations say it (``calls=``)
CALLS: dict[str, dict[str, str | tuple[str, ...]]] = {
    "transfer": {"post": ("register_memory", "prep_xfer_dlist", "make_prepped_xfer", "transfer"),
                 "poll": "check_xfer_state", "release": "release_xfer_handle",
                 "clean": ("release_dlist_handle", "deregister_memory")},
    "peer_receive": {"notified": "get_new_notifs"},
    "peer_link": {"add": "add_remote_agent", "check": "check_remote_metadata",
                  "probe": "send_notif", "disconnected": ("transfer", "check_xfer_state"),
                  "remove": "remove_remote_agent"},
}


def with_calls(declaration: Declaration[Any, Any],
               calls: dict[str, str | tuple[str, ...]]) -> Declaration[Any, Any]:
    """A copy of ``declaration`` that names what its events call (``Declaration.calls``)."""
    named = copy.copy(declaration)
    named.calls = calls  # a field of Declaration, or (before it has one) an attribute
    return named


KVFSM_OWN = {spec: load_declaration(spec) for spec in MACHINES}
EVERY_MACHINE = {
    **KVFSM_OWN,
    **{f"calls:{d.name}": with_calls(d, CALLS[d.name]) for d in KVFSM_OWN.values()},
    "user:door": door(),
}


@pytest.fixture(params=sorted(EVERY_MACHINE))
def machine(request: pytest.FixtureRequest) -> Declaration[Any, Any]:
    """Every machine kvfsm declares, and a user's."""
    declared: Declaration[Any, Any] = EVERY_MACHINE[request.param]
    return declared


# -- what the drawing says -----------------------------------------------------------------

def test_kvfsm_draws_the_transfer_machine_under_its_own_name() -> None:
    assert "kvfsm.machines.transfer:TRANSFER_MACHINE" in MACHINES
    assert load_declaration("kvfsm.machines.transfer:TRANSFER_MACHINE") is TRANSFER_MACHINE
    assert load_declaration("kvfsm.lifecycle:TRANSFER_MACHINE") is TRANSFER_MACHINE, "old name"
    assert parse_dot(to_dot(TRANSFER_MACHINE)).name == "transfer"


def test_the_drawn_states_are_the_declared_states(machine: Declaration[Any, Any]) -> None:
    graph = parse_dot(to_dot(machine))
    states = {name for name, attrs in graph.nodes.items() if attrs.get("shape") != "point"}
    assert states == {state.name for state in machine.states}


def test_the_drawn_edges_are_the_declared_table(machine: Declaration[Any, Any]) -> None:
    drawn = Counter(edge for edge, _, _ in drawn_edges(parse_dot(to_dot(machine))))
    assert drawn == Counter(declared_table(machine))


def test_the_transfer_drawing_matches_the_table_written_out_by_hand() -> None:
    drawn = {(e.source, e.event, e.order, e.conditions, e.actions, e.dest)
             for e, _, _ in drawn_edges(parse_dot(to_dot(TRANSFER_MACHINE)))}
    assert drawn == {
        ("SUBMITTED", "post", 1, ("running",), (), "PROCESSING"),
        ("SUBMITTED", "post", 2, ("finished",), ("latch_success",), "DONE"),
        ("SUBMITTED", "post", 3, ("errored",), ("latch_failure",), "FAILED"),
        ("PROCESSING", "poll", 1, ("running",), (), "PROCESSING"),
        ("PROCESSING", "poll", 2, ("finished",), ("latch_success",), "DONE"),
        ("PROCESSING", "poll", 3, ("errored",), ("latch_failure",), "FAILED"),
        ("PROCESSING", "poll", 4, ("exhausted",), ("quarantine",), "QUARANTINED"),
        ("PROCESSING", "cancel", None, (), ("latch_cancelled",), "CANCELLING"),
        ("CANCELLING", "poll", 1, ("running",), (), "CANCELLING"),
        ("CANCELLING", "poll", 2, ("finished",), ("note_ended",), "FAILED"),
        ("CANCELLING", "poll", 3, ("errored",), ("note_ended", "note_error"), "FAILED"),
        ("CANCELLING", "poll", 4, ("exhausted",), ("quarantine",), "QUARANTINED"),
        ("CANCELLING", "cancel", None, (), (), "CANCELLING"),
        ("DONE", "release", 1, ("released",), (), "XFER_RELEASED"),
        ("DONE", "release", 2, ("release_raised",), ("count_retry",), "DONE"),
        ("DONE", "release", 3, ("exhausted",), ("quarantine",), "QUARANTINED"),
        ("DONE", "cancel", None, (), (), "DONE"),
        ("FAILED", "release", 1, ("released",), (), "XFER_RELEASED"),
        ("FAILED", "release", 2, ("release_raised",), ("count_retry",), "FAILED"),
        ("FAILED", "release", 3, ("exhausted",), ("quarantine",), "QUARANTINED"),
        ("FAILED", "cancel", None, (), (), "FAILED"),
        ("XFER_RELEASED", "clean", 1, ("cleaned",), (), "CLEANED"),
        ("XFER_RELEASED", "clean", 2, ("leaked",), ("record_leaks",), "CLEANED"),
        ("XFER_RELEASED", "cancel", None, (), (), "XFER_RELEASED"),
        ("CLEANED", "publish", None, (), (), "PUBLISHED"),
        ("CLEANED", "cancel", None, (), (), "CLEANED"),
    }


def test_the_initial_state_is_entered_from_an_entry_point_and_final_states_are_double(
    machine: Declaration[Any, Any],
) -> None:
    graph = parse_dot(to_dot(machine))
    points = [name for name, attrs in graph.nodes.items() if attrs.get("shape") == "point"]
    assert len(points) == 1
    assert [(tail, head) for tail, head, _ in graph.edges if points[0] in (tail, head)] == [
        (points[0], machine.initial.name)]
    doubled = {name for name, attrs in graph.nodes.items()
               if attrs.get("shape") == "doublecircle"}
    assert doubled == {state.name for state in machine.final}
    assert doubled  # every machine here declares a final state, and it shows


def test_failure_states_are_filled_red_and_no_other(machine: Declaration[Any, Any]) -> None:
    graph = parse_dot(to_dot(machine))
    red = {name for name, attrs in graph.nodes.items() if attrs.get("color") == "#c62828"}
    assert red == {state.name for state in machine.failure_states}


def test_edges_of_one_state_and_event_are_numbered_in_the_order_their_guards_are_tried(
    machine: Declaration[Any, Any],
) -> None:
    by_trial: dict[tuple[str, str], list[int | None]] = {}
    for edge, _, _ in drawn_edges(parse_dot(to_dot(machine))):
        by_trial.setdefault((edge.source, edge.event), []).append(edge.order)
    for (source, event), orders in by_trial.items():
        declared = machine.edges_from(machine.states[source], event)
        if len(declared) == 1:
            assert orders == [None], (source, event)
        else:  # drawn in the order transitions tries them: 1, 2, 3...
            assert orders == list(range(1, len(declared) + 1)), (source, event)


def retried_by_a_tier(machine: Declaration[Any, Any], edge: DrawnEdge) -> bool:
    """Whether a tier tries ``edge`` again, bounded by its policy: a self-loop of the effect
    its state waits on, but the state check's and the post's (a machine declaring no effects:
    a self-loop that runs an action)."""
    if edge.source != edge.dest:
        return False
    if not machine.effects:
        return bool(edge.actions)
    effect = {state.name: e for state, e in machine.effects.items()}.get(edge.source)
    return edge.event == effect and edge.event not in ("poll", "post")


def test_a_self_loop_a_tier_tries_again_is_drawn_and_labelled_as_a_retry(
    machine: Declaration[Any, Any],
) -> None:
    for edge, retry, attrs in drawn_edges(parse_dot(to_dot(machine))):
        assert retry == retried_by_a_tier(machine, edge), edge
        assert (attrs.get("style") == "dotted") == retry, edge


def test_a_steps_not_yet_is_drawn_as_the_retry_a_tier_makes_of_it_with_no_action_of_its_own(
) -> None:
    """A check's "not yet" loops back with no action: a tier tries the check again, bounded
    by its policy, and the drawing says so (it was a grey stay, "waits"); the cancel's loop
    beside it stays a stay."""
    from .test_own_lifecycles import CHECK_UNTIL_GIVEN_UP  # noqa: PLC0415

    loops = {(e.source, e.event): retry
             for e, retry, _ in drawn_edges(parse_dot(to_dot(CHECK_UNTIL_GIVEN_UP)))
             if e.source == e.dest}
    assert loops[("CHECKING", "check")] is True
    assert loops[("CHECKING", "cancel")] is False
    assert loops[("PROCESSING", "poll")] is False


def test_the_release_that_raised_is_a_retry_in_done_and_in_failed() -> None:
    retries = {(e.source, e.event, e.conditions, e.actions)
               for e, retry, _ in drawn_edges(parse_dot(to_dot(TRANSFER_MACHINE))) if retry}
    assert retries == {("DONE", "release", ("release_raised",), ("count_retry",)),
                       ("FAILED", "release", ("release_raised",), ("count_retry",))}


def test_the_success_path_avoids_failed_and_the_failure_path_goes_through_it() -> None:
    kinds = {(e.source, e.dest, e.event, e.conditions): drawn_kind(e, retry, attrs)
             for e, retry, attrs in drawn_edges(parse_dot(to_dot(TRANSFER_MACHINE)))}
    assert kinds == {
        ("SUBMITTED", "PROCESSING", "post", ("running",)): "success",
        ("SUBMITTED", "DONE", "post", ("finished",)): "success",
        ("SUBMITTED", "FAILED", "post", ("errored",)): "failure",
        ("PROCESSING", "PROCESSING", "poll", ("running",)): "stay",
        ("PROCESSING", "DONE", "poll", ("finished",)): "success",
        ("PROCESSING", "FAILED", "poll", ("errored",)): "failure",
        ("PROCESSING", "QUARANTINED", "poll", ("exhausted",)): "failure",
        ("PROCESSING", "CANCELLING", "cancel", ()): "failure",
        ("CANCELLING", "CANCELLING", "poll", ("running",)): "stay",
        ("CANCELLING", "FAILED", "poll", ("finished",)): "failure",
        ("CANCELLING", "FAILED", "poll", ("errored",)): "failure",
        ("CANCELLING", "QUARANTINED", "poll", ("exhausted",)): "failure",
        ("CANCELLING", "CANCELLING", "cancel", ()): "stay",
        ("DONE", "XFER_RELEASED", "release", ("released",)): "success",
        ("DONE", "DONE", "release", ("release_raised",)): "retry",
        ("DONE", "QUARANTINED", "release", ("exhausted",)): "failure",
        ("DONE", "DONE", "cancel", ()): "stay",
        ("FAILED", "XFER_RELEASED", "release", ("released",)): "failure",
        ("FAILED", "FAILED", "release", ("release_raised",)): "retry",
        ("FAILED", "QUARANTINED", "release", ("exhausted",)): "failure",
        ("FAILED", "FAILED", "cancel", ()): "stay",
        ("XFER_RELEASED", "CLEANED", "clean", ("cleaned",)): "success",
        ("XFER_RELEASED", "CLEANED", "clean", ("leaked",)): "success",
        ("XFER_RELEASED", "XFER_RELEASED", "cancel", ()): "stay",
        ("CLEANED", "PUBLISHED", "publish", ()): "success",
        ("CLEANED", "CLEANED", "cancel", ()): "stay",
    }


def test_a_users_machine_gets_the_same_rule_for_its_success_and_failure_paths() -> None:
    kinds = {(e.source, e.dest, e.conditions): drawn_kind(e, retry, attrs)
             for e, retry, attrs in drawn_edges(parse_dot(to_dot(door())))}
    assert kinds == {
        ("CLOSED", "OPEN", ("gentle",)): "success",
        ("CLOSED", "JAMMED", ("hard",)): "failure",      # enters the failure state
        ("CLOSED", "CLOSED", ("nothing",)): "stay",
        ("JAMMED", "FORCED", ("hard",)): "failure",      # leaves it
        ("JAMMED", "JAMMED", ("gentle",)): "retry",
        ("JAMMED", "JAMMED", ("nothing",)): "stay",
        ("OPEN", "GONE", ()): "success",
        ("FORCED", "GONE", ()): "failure",               # only reached through JAMMED
        ("LOCKED", "CLOSED", ()): "plain",               # cannot be reached at all
        ("LOCKED", "LOCKED", ("nothing",)): "stay",
    }


def test_a_machine_without_failure_states_singles_out_no_path() -> None:
    graph = parse_dot(to_dot(door(failure_states=[])))
    kinds = {drawn_kind(*edge) for edge in drawn_edges(graph)}
    assert kinds == {"plain", "stay", "retry"}
    assert "success path" not in graph.graph["label"]


def test_guards_with_unless_and_several_actions_are_spelled_out() -> None:
    graph = parse_dot(to_dot(door()))
    labels = {(tail, head): label_lines(attrs["label"]) for tail, head, attrs in graph.edges
              if attrs.get("label")}
    assert labels["CLOSED", "OPEN"] == ["push #1", "[gentle && !hard] GENTLE"]
    assert labels["JAMMED", "FORCED"] == ["push #1", "[hard] HARD", "/ note_jam, call_smith"]
    assert labels["LOCKED", "CLOSED"] == ["push #1", "[!nothing] GENTLE | HARD"]


def test_the_legend_explains_every_kind_of_edge_drawn() -> None:
    legend = " ".join(label_lines(parse_dot(to_dot(TRANSFER_MACHINE)).graph["label"]))
    for words in ("where a record starts", "final state", "failure state", "success path",
                  "failure paths", "retry", "order guards are tried", "event #n",
                  "[guards] answers / actions", "what its guards accept"):
        assert words in legend


def test_each_edge_names_what_its_event_calls(machine: Declaration[Any, Any]) -> None:
    calls = declared_calls(machine)
    graph = parse_dot(to_dot(machine))
    for edge, _, attrs in drawn_edges(graph):
        assert edge.calls == calls.get(edge.event, ()), edge
        assert ("<i>" in attrs["label"]) == bool(edge.calls), edge  # in italics
    assert ("call()" in graph.graph["label"]) == bool(calls)  # and the legend says so


def test_the_transfer_edges_name_the_nixl_calls_written_out_by_hand() -> None:
    drawn = {(e.source, e.event, e.order): e.calls for e, _, _ in drawn_edges(
        parse_dot(to_dot(with_calls(TRANSFER_MACHINE, CALLS["transfer"]))))}
    submit = ("register_memory", "prep_xfer_dlist", "make_prepped_xfer", "transfer")
    assert {drawn["SUBMITTED", "post", n] for n in (1, 2, 3)} == {submit}
    assert {drawn["PROCESSING", "poll", n] for n in (1, 2, 3, 4)} == {("check_xfer_state",)}
    assert drawn["CANCELLING", "poll", 2] == ("check_xfer_state",)
    assert {drawn[state, "release", n] for state in ("DONE", "FAILED") for n in (1, 2, 3)} == {
        ("release_xfer_handle",)}
    assert drawn["XFER_RELEASED", "clean", 2] == ("release_dlist_handle", "deregister_memory")
    assert drawn["CLEANED", "publish", None] == drawn["PROCESSING", "cancel", None] == ()


def test_calls_are_wrapped_after_a_comma_and_a_lone_name_is_one_call() -> None:
    graph = parse_dot(to_dot(with_calls(TRANSFER_MACHINE, CALLS["transfer"])))
    labels = {(tail, head, label_lines(attrs["label"])[0]): label_lines(attrs["label"])
              for tail, head, attrs in graph.edges if attrs.get("label")}
    assert labels["SUBMITTED", "PROCESSING", "post #1"] == [
        "post #1", "register_memory(), prep_xfer_dlist(),", "make_prepped_xfer(), transfer()",
        "[running] PROC"]
    assert labels["PROCESSING", "DONE", "poll #2"] == [
        "poll #2", "check_xfer_state()", "[finished] DONE", "/ latch_success"]


@pytest.mark.parametrize(("calls", "message"), [
    ({"pol": "check_xfer_state"}, "calls names 'pol', which is not one of its events"),
    ({"poll": 3}, "the calls of 'poll' must be names (str), not 3"),
    ({"poll": ()}, "the calls of 'poll' must be names (str), not ()"),
    (["poll"], "calls must map events to the calls they make, not list"),
])
def test_calls_that_name_no_event_or_no_call_are_refused(calls: Any, message: str) -> None:
    with pytest.raises(DiagramError, match=re.escape(message)):
        to_dot(with_calls(TRANSFER_MACHINE, calls))


def test_the_failure_answers_are_those_the_declaration_fails_or_retries_on() -> None:
    machines = {d.name: d for d in KVFSM_OWN.values()}
    assert failure_answers(machines["transfer"]) == {Answer.ERR, Answer.RAISED, Answer.EXHAUSTED}
    assert failure_answers(machines["peer_receive"]) == {PeerAnswer.GONE,
                                                         PeerAnswer.MISDIRECTED}
    assert failure_answers(machines["peer_link"]) == {LinkAnswer.RAISED,
                                                      LinkAnswer.DISCONNECTED}
    assert failure_answers(door()) == {Push.HARD}  # JAMMED's own retry is past the failure


def test_in_the_link_machine_only_connecting_and_closing_cleanly_is_the_success_path() -> None:
    link = next(d for d in KVFSM_OWN.values() if d.name == "peer_link")
    kinds = {(e.source, e.dest, e.event, e.conditions): drawn_kind(e, retry, attrs)
             for e, retry, attrs in drawn_edges(parse_dot(to_dot(link)))}
    assert kinds == {
        ("UNKNOWN", "CONNECTING", "add", ("ok",)): "success",
        ("UNKNOWN", "REFUSED", "add", ("raised",)): "failure",
        ("CONNECTING", "CONNECTED", "check", ("present",)): "success",
        ("CONNECTING", "CONNECTING", "check", ("absent",)): "stay",
        ("CONNECTING", "LOST", "check", ("raised",)): "failure",
        ("CONNECTING", "CLOSED", "remove", ("ok",)): "success",    # closed before it connected
        ("CONNECTING", "CLOSED", "remove", ("raised",)): "failure",  # a leak: RAISED fails
        ("CONNECTED", "CONNECTED", "probe", ("ok",)): "stay",
        ("CONNECTED", "CONNECTED", "probe", ("raised",)): "retry",
        ("CONNECTED", "LOST", "probe", ("gone",)): "failure",
        ("CONNECTED", "LOST", "disconnected", ("gone",)): "failure",
        ("CONNECTED", "CLOSED", "remove", ("ok",)): "success",
        ("CONNECTED", "CLOSED", "remove", ("raised",)): "failure",
        ("LOST", "LOST", "disconnected", ("gone",)): "stay",
        ("LOST", "CLOSED", "remove", ("ok",)): "failure",
        ("LOST", "CLOSED", "remove", ("raised",)): "failure",
    }


def test_every_green_edge_is_on_a_clean_run_from_the_initial_to_a_final_state(
    machine: Declaration[Any, Any],
) -> None:
    """Read back from the drawing: each green edge is on a path of green edges from the
    initial state to a final one, none into a failure state, each taken by some answer
    that is not a failure answer."""
    failing = failure_answers(machine)
    green = [e for e, retry, attrs in drawn_edges(parse_dot(to_dot(machine)))
             if drawn_kind(e, retry, attrs) == "success"]
    final = {s.name for s in machine.final}
    failed = {s.name for s in machine.failure_states}
    for edge in green:
        accepted = {a for a in machine.answers[edge.event]
                    if all(a in machine.guards[g] for g in edge.conditions)
                    and not any(a in machine.guards[g] for g in edge.unless)}
        assert accepted - failing and edge.dest not in failed, edge
    ahead = {machine.initial.name}
    for _ in green:
        ahead |= {e.dest for e in green if e.source in ahead}
    assert {e.source for e in green} <= ahead
    behind = set(final)
    for _ in green:
        behind |= {e.source for e in green if e.dest in behind}
    assert {e.dest for e in green} <= behind


# -- the layout: no label crossed by an edge, or on another label --------------------------------

@dataclass(frozen=True)
class Box:
    """A box in graphviz's coordinates (points, y upwards), and what is in it."""

    left: float
    bottom: float
    right: float
    top: float
    what: str

    def holds(self, x: float, y: float, margin: float = 1.0) -> bool:
        return (self.left - margin <= x <= self.right + margin
                and self.bottom - margin <= y <= self.top + margin)

    def meets(self, other: Box, margin: float = 1.0) -> bool:
        return not (self.right + margin < other.left or other.right + margin < self.left
                    or self.top + margin < other.bottom or other.top + margin < self.bottom)


def text_boxes(ops: list[dict[str, Any]], what: str) -> list[Box]:
    """The ink of each line graphviz writes: from below its baseline to its ascent."""
    size, boxes = 14.0, []
    for op in ops:
        if op["op"] == "F":
            size = op["size"]
        elif op["op"] == "T":
            (x, y), width = op["pt"], op["width"]
            left = {"l": x, "c": x - width / 2, "r": x - width}[op["align"]]
            boxes.append(Box(left, y - 0.25 * size, left + width, y + 0.8 * size,
                             f"{what} {op['text']!r}"))
    return boxes


def drawn_points(ops: list[dict[str, Any]], steps: int = 24) -> list[tuple[float, float]]:
    """Points along everything an edge draws: each Bezier piece of its spline, and the sides
    of its arrowhead."""
    points: list[tuple[float, float]] = []
    for op in ops:
        corners = [tuple(p) for p in op.get("points", [])]
        if op["op"] in ("b", "B"):
            for at in range(0, len(corners) - 3, 3):
                (x0, y0), (x1, y1), (x2, y2), (x3, y3) = corners[at:at + 4]
                for step in range(steps + 1):
                    t = step / steps
                    a, b, c, d = (1 - t) ** 3, 3 * t * (1 - t) ** 2, 3 * t * t * (1 - t), t ** 3
                    points.append((a * x0 + b * x1 + c * x2 + d * x3,
                                   a * y0 + b * y1 + c * y2 + d * y3))
        elif op["op"] in ("p", "P", "L"):
            for (x0, y0), (x1, y1) in zip(corners, [*corners[1:], corners[0]], strict=True):
                points += [(x0 + (x1 - x0) * k / 8, y0 + (y1 - y0) * k / 8) for k in range(9)]
    return points


def crossings(dot_text: str) -> list[str]:
    """What graphviz's layout of ``dot_text`` puts over a label: another edge's line or arrow,
    another label (the legend too), or a state."""
    done = subprocess.run(["dot", "-Tjson"], input=dot_text, capture_output=True, text=True,
                          check=True, timeout=60)
    layout = json.loads(done.stdout)
    names = [node["name"] for node in layout["objects"]]
    edges = {f"edge {names[e['tail']]}->{names[e['head']]} #{i}": e
             for i, e in enumerate(layout["edges"])}
    labels = {name: text_boxes(edge.get("_ldraw_", []), name) for name, edge in edges.items()}
    labels["legend"] = text_boxes(layout.get("_ldraw_", []), "legend")
    lines = {name: drawn_points([*edge.get("_draw_", []), *edge.get("_hdraw_", []),
                                 *edge.get("_tdraw_", [])]) for name, edge in edges.items()}
    states = []
    for node in layout["objects"]:
        x, y = (float(v) for v in node["pos"].split(","))
        half_width, half_height = float(node["width"]) * 36, float(node["height"]) * 36
        states.append(Box(x - half_width, y - half_height, x + half_width, y + half_height,
                          f"state {node['name']}"))
    found = []
    owners = sorted(labels)
    for index, owner in enumerate(owners):
        for box in labels[owner]:
            found += [f"{box.what} is crossed by {name}" for name, points in lines.items()
                      if name != owner and any(box.holds(x, y) for x, y in points)]
            found += [f"{box.what} meets {other.what}" for other_owner in owners[index + 1:]
                      for other in labels[other_owner] if box.meets(other)]
            found += [f"{box.what} meets {state.what}" for state in states if box.meets(state)]
    return found


LAID_OUT = {
    **{f"committed:{path.stem}": path for path in sorted(COMMITTED.glob("*.dot"))},
    **{spec: spec for spec in sorted(EVERY_MACHINE)},
}


@pytest.mark.parametrize("drawing", sorted(LAID_OUT))
def test_no_label_is_crossed_by_an_edge_or_meets_another_label_or_a_state(drawing: str) -> None:
    require_dot()
    source = LAID_OUT[drawing]
    text = source.read_text(encoding="utf-8") if isinstance(source, Path) else to_dot(
        EVERY_MACHINE[source])
    assert crossings(text) == []


def test_the_committed_drawings_are_all_laid_out_here() -> None:
    assert {name for name in LAID_OUT if name.startswith("committed:")} == {
        f"committed:{d.name}" for d in KVFSM_OWN.values()}


def test_the_crossing_check_sees_a_loop_cross_the_label_of_the_loop_inside_it() -> None:
    require_dot()
    found = crossings('digraph g { A -> A [label="aaaa\\nbbbb\\ncccc"]; '
                      'A -> A [label="dddd\\neeee\\nffff"]; A -> B [label="x"]; }')
    assert "edge A->A #0 'aaaa' is crossed by edge A->A #1" in found


# -- determinism ----------------------------------------------------------------------------

def test_drawing_twice_gives_the_same_bytes(machine: Declaration[Any, Any]) -> None:
    assert to_dot(machine).encode() == to_dot(machine).encode()


def test_the_drawing_never_depends_on_where_any_machine_currently_is() -> None:
    before = to_dot(TRANSFER_MACHINE)
    compiled = TRANSFER_MACHINE.compile()
    transfer = Transfer(TransferJob(1, ["k"], [0]), nbytes=64, started_at=0.0)
    compiled.fire(transfer, "post", Answer.PROC)
    compiled.fire(transfer, "poll", Answer.ERR)
    compiled.fire(transfer, "release", Answer.RAISED)
    assert transfer.state is TransferState.FAILED
    reference = TRANSFER_MACHINE.reference_model()  # a real transitions machine, moved along
    reference.trigger("post", Answer.DONE)
    assert reference.state is TransferState.DONE
    assert to_dot(TRANSFER_MACHINE) == before


def test_the_same_table_declared_again_is_drawn_the_same() -> None:
    again = door()
    assert again is not EVERY_MACHINE["user:door"]
    assert to_dot(again) == to_dot(EVERY_MACHINE["user:door"])


def test_the_drawing_is_the_same_in_every_process_whatever_the_hash_seed() -> None:
    program = ("import sys; from kvfsm.diagrams import to_dot; "
               "from kvfsm.lifecycle import TRANSFER_MACHINE; "
               "sys.stdout.buffer.write(to_dot(TRANSFER_MACHINE).encode())")
    outputs = set()
    for seed in ("0", "1", "12345"):
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}, timeout=120)
        outputs.add(done.stdout)
    assert outputs == {to_dot(TRANSFER_MACHINE).encode()}


# -- the committed drawings and --check --------------------------------------------------------

def test_the_committed_diagrams_pass_the_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    assert main(["diagrams", "--check"]) == 0
    assert ("transfer, peer_receive, peer_link up to date in diagrams/"
            in capsys.readouterr().out)


def test_the_committed_dot_is_what_the_declaration_gives_now() -> None:
    committed = (COMMITTED / "transfer.dot").read_text(encoding="utf-8")
    assert committed == to_dot(TRANSFER_MACHINE)


def test_the_check_needs_no_dot_program(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to run on it
    assert shutil.which("dot") is None
    assert main(["diagrams", "--check", "--out", str(COMMITTED)]) == 0


def test_the_check_fails_naming_the_machine_whose_dot_is_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(COMMITTED, tmp_path, dirs_exist_ok=True)
    stale = tmp_path / "transfer.dot"
    stale.write_text(stale.read_text().replace("latch_failure", "latch_nothing", 1))
    assert main(["diagrams", "--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"machine 'transfer': {stale} differs from the declaration" in err
    assert "-" in err and "latch_nothing" in err  # the diff shows what drifted
    assert f"run `kvfsm diagrams --out {tmp_path}`" in err


def test_the_check_fails_when_a_guard_takes_other_answers_under_its_old_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Swapping what two guards accept sends a running transfer to DONE (and a finished one
    round again) with every guard and edge named as before: the drawing says the answers."""
    shipped = TRANSFER_MACHINE
    swapped = Declaration(
        "transfer", states=shipped.states, initial=shipped.initial, answers=shipped.answers,
        guards={**shipped.guards, "running": [Answer.DONE], "finished": [Answer.PROC]},
        actions=shipped.actions, transitions=shipped.transitions, final=shipped.final,
        failure_states=shipped.failure_states, unreachable=shipped.unreachable,
        calls=shipped.calls, effects=shipped.effects, running=shipped.running)
    problems = check([swapped], COMMITTED)
    assert [str(p).splitlines()[0] for p in problems] == [
        f"machine 'transfer': {COMMITTED / 'transfer.dot'} differs from the declaration",
        f"machine 'transfer': {COMMITTED / 'transfer.svg'} was not rendered from the "
        "declaration's current DOT"]
    assert "[running] DONE" in str(problems[0]) and "[running] PROC" in str(problems[0])
    assert check([TRANSFER_MACHINE], COMMITTED) == []


def test_the_check_fails_naming_the_machine_whose_files_are_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["diagrams", "--check", "--out", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert f"machine 'transfer': {tmp_path / 'empty' / 'transfer.dot'} is missing" in err
    assert f"machine 'transfer': {tmp_path / 'empty' / 'transfer.svg'} is missing" in err


def test_the_check_of_a_directory_that_does_not_exist_says_so_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped ``--out``: one line saying there is no such directory (each drawing was
    reported missing, one by one, with the advice to draw them there)."""
    assert main(["diagrams", "--check", "--out", str(tmp_path / "nowhere")]) == 1
    assert capsys.readouterr().err == (
        f"kvfsm diagrams: cannot check {tmp_path / 'nowhere'}: no such directory (kvfsm "
        f"diagrams --out {tmp_path / 'nowhere'} draws the machines into it)\n")


def test_the_check_fails_when_the_svg_was_not_rendered_from_the_current_dot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(COMMITTED, tmp_path, dirs_exist_ok=True)
    svg = tmp_path / "transfer.svg"
    svg.write_text(re.sub(r"sha256 [0-9a-f]{64}", "sha256 " + "0" * 64, svg.read_text()))
    assert main(["diagrams", "--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"machine 'transfer': {svg} was not rendered from the declaration's current DOT" in err
    assert "transfer.dot" not in err  # the DOT itself is fine


def test_the_check_fails_when_the_svg_was_edited_after_it_was_rendered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A drawing edited by hand (a state renamed in the SVG) kept the record of the DOT it
    was rendered from, and passed the check; the record now holds the drawing's hash too."""
    shutil.copytree(COMMITTED, tmp_path, dirs_exist_ok=True)
    svg = tmp_path / "transfer.svg"
    drawn = svg.read_text()
    assert drawn.count(">VERIFYING<") == 0 and drawn.count(">PROCESSING<") > 0
    svg.write_text(drawn.replace(">PROCESSING<", ">VERIFYING<"))
    assert main(["diagrams", "--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert (f"machine 'transfer': {svg} was changed after it was rendered (a drawing is "
            "generated, never edited: kvfsm diagrams draws it again)") in err
    assert "peer_link" not in err
    svg.write_text(drawn)
    assert main(["diagrams", "--check", "--out", str(tmp_path)]) == 0
    # a drawing an older kvfsm rendered records its DOT's hash alone: said so, not "stale"
    svg.write_text(re.sub(r", drawing sha256 [0-9a-f]{64}", "", drawn))
    assert main(["diagrams", "--check", "--out", str(tmp_path)]) == 1
    assert (f"machine 'transfer': {svg} holds a record of its rendering this kvfsm does not "
            "write (an older kvfsm's") in capsys.readouterr().err


ANSWERS_MODULE = """
import enum
from kvfsm import Declaration
from kvfsm.diagrams import to_dot

class Gate(enum.Enum):
    SHUT = 1
    AJAR = 2
    GONE = 3

class Word(enum.Enum):
    OK = 1
    BAD = 2
    WORSE = 3

class Other(enum.Enum):
    TIMEOUT = 1
    LOST = 2

class Bits(enum.Flag):
    X = 1
    Y = 2

GATE = Declaration(
    "gate", states=Gate, initial=Gate.SHUT,
    answers={"go": [Word.OK, Word.BAD, Word.WORSE, Other.TIMEOUT, Other.LOST],
             "bit": [Bits.X, Bits.X | Bits.Y]},
    guards={"ok": [Word.OK], "bad": [Word.BAD, Word.WORSE, Other.TIMEOUT, Other.LOST],
            "worse": [Word.WORSE], "one": [Bits.X], "both": [Bits.X | Bits.Y]},
    actions={},
    transitions=[
        {"trigger": "go", "source": Gate.SHUT, "dest": Gate.AJAR, "conditions": "ok"},
        {"trigger": "go", "source": Gate.SHUT, "dest": Gate.GONE, "conditions": "bad",
         "unless": "worse"},
        {"trigger": "go", "source": Gate.SHUT, "dest": Gate.SHUT, "conditions": "worse"},
        {"trigger": "bit", "source": Gate.AJAR, "dest": Gate.GONE, "conditions": "both"},
        {"trigger": "bit", "source": Gate.AJAR, "dest": Gate.AJAR, "conditions": "one"}],
    final=[Gate.GONE])
print(to_dot(GATE))
"""


def test_the_answers_drawn_are_in_one_order_whatever_the_hash_seed(tmp_path: Path) -> None:
    """Answers of two Enums on one event, and a Flag's combined member: the order depends on
    neither the hash seed nor a member being missing from its Flag's list."""
    (tmp_path / "gate.py").write_text(ANSWERS_MODULE)
    drawn = set()
    for seed in ("1", "2", "3"):
        run = subprocess.run([sys.executable, str(tmp_path / "gate.py")], capture_output=True,
                             text=True, check=False, timeout=60,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert run.returncode == 0, run.stderr
        drawn.add(run.stdout)
    (dot,) = drawn
    # by type (Other before Word), then each member's place in its Enum
    assert "[bad &amp;&amp; !worse] TIMEOUT | LOST | BAD<" in dot, dot
    assert "[both] X|Y<" in dot and "[one] X<" in dot, dot


DOOR_MODULE = """
import enum
from kvfsm import Declaration

class Door(enum.Enum):
    CLOSED = 1
    OPEN = 2

class Push(enum.Enum):
    GENTLE = 1

DOOR = Declaration(
    "door", states=Door, initial=Door.CLOSED,
    answers={{"{event}": [Push.GENTLE]}}, guards={{}}, actions={{}},
    transitions=[{{"trigger": "{event}", "source": Door.CLOSED, "dest": Door.OPEN}}],
    final=[Door.OPEN])
"""


def kvfsm(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfsm", "diagrams", *args], cwd=cwd,
                          capture_output=True, text=True, check=False, timeout=120)


def test_a_users_machine_named_on_the_command_line_is_drawn_and_checked(tmp_path: Path) -> None:
    require_dot()
    (tmp_path / "door_machine.py").write_text(textwrap.dedent(DOOR_MODULE).format(event="push"))
    drawn = kvfsm(tmp_path, "--out", "pictures", "door_machine:DOOR")
    assert drawn.returncode == 0, drawn.stderr
    assert sorted(p.name for p in (tmp_path / "pictures").iterdir()) == ["door.dot", "door.svg"]
    checked = kvfsm(tmp_path, "--check", "--out", "pictures", "door_machine:DOOR")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout == "kvfsm diagrams: door up to date in pictures/\n"

    # the user changes the machine and forgets to redraw it
    (tmp_path / "door_machine.py").write_text(textwrap.dedent(DOOR_MODULE).format(event="shove"))
    stale = kvfsm(tmp_path, "--check", "--out", "pictures", "door_machine:DOOR")
    assert stale.returncode == 1
    assert "machine 'door': pictures/door.dot differs from the declaration" in stale.stderr
    assert "machine 'transfer'" not in stale.stderr
    assert "run `kvfsm diagrams --out pictures door_machine:DOOR`" in stale.stderr


def test_naming_a_machine_draws_only_it_into_diagrams_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    require_dot()
    (tmp_path / "door_drawn_here.py").write_text(
        textwrap.dedent(DOOR_MODULE).format(event="push"))
    monkeypatch.chdir(tmp_path)
    request.addfinalizer(lambda: sys.modules.pop("door_drawn_here", None))
    assert main(["diagrams", "door_drawn_here:DOOR"]) == 0
    assert sorted(p.name for p in (tmp_path / "diagrams").iterdir()) == ["door.dot", "door.svg"]
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {Path('diagrams', name)}" for name in ("door.dot", "door.svg")]
    assert main(["diagrams", "--check", "door_drawn_here:DOOR"]) == 0
    assert capsys.readouterr().out == "kvfsm diagrams: door up to date in diagrams/\n"
    # kvfsm's own are drawn beside it only when named
    assert main(["diagrams", "peer_receive", "door_drawn_here:DOOR"]) == 0
    assert sorted(p.name for p in (tmp_path / "diagrams").iterdir()) == [
        "door.dot", "door.svg", "peer_receive.dot", "peer_receive.svg"]


def test_only_draws_just_the_machines_named(tmp_path: Path) -> None:
    require_dot()
    (tmp_path / "door_machine.py").write_text(textwrap.dedent(DOOR_MODULE).format(event="push"))
    drawn = kvfsm(tmp_path, "--only", "door_machine:DOOR")
    assert drawn.returncode == 0, drawn.stderr
    assert sorted(p.name for p in (tmp_path / "diagrams").iterdir()) == ["door.dot", "door.svg"]
    assert kvfsm(tmp_path, "--check", "--only", "door_machine:DOOR").returncode == 0


@pytest.mark.parametrize(("args", "message"), [
    (["door"], "'door': name a machine as module:ATTRIBUTE"),
    (["kvfsm.lifecycle:NOPE"], "kvfsm.lifecycle has no attribute 'NOPE'"),
    (["kvfsm.lifecycle:TransferState"], "is not a kvfsm Declaration (found EnumType)"),
    (["no_such_module_kvfsm:X"], "cannot import 'no_such_module_kvfsm'"),
    (["transfer", "tests.test_diagrams:RENAMED"], "are both named 'transfer'"),
    (["tests.test_diagrams:RENAMED"],
     "machine 'transfer' is named like kvfsm's own machine "
     "kvfsm.machines.transfer:TRANSFER_MACHINE, but is another machine: its drawing would take "
     "the place of kvfsm's (transfer.dot, transfer.svg); give your machine a name of its own"),
    (["--check", "tests.test_diagrams:RENAMED"], "is named like kvfsm's own machine"),
    (["tests.test_diagrams:BADLY_NAMED"], "machine name 'a door/b' cannot name a file"),
    (["--only"], "no machine to draw"),
])
def test_machines_that_cannot_be_drawn_are_named(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diagrams", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("args", [
    ["--out", "{file}"], ["--out", "{file}/drawings"], ["--check", "--out", "{file}"],
], ids=["a file", "under a file", "checking a file"])
def test_an_out_that_is_not_a_directory_is_refused_in_one_line_and_nothing_is_written(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    taken = tmp_path / "notes.txt"
    taken.write_text("mine\n")
    assert main(["diagrams", *(arg.format(file=taken) for arg in args)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("kvfsm diagrams: cannot ") and err.count("\n") == 1, err
    assert f"{taken}" in err and ("not a directory" in err or "Not a directory" in err), err
    assert sorted(tmp_path.iterdir()) == [taken] and taken.read_text() == "mine\n"


def test_a_read_only_out_is_refused_in_one_line_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "drawings"
    out.mkdir()
    out.chmod(0o555)
    if os.access(out, os.W_OK):  # root writes into it all the same: refuse as a read-only disk
        def refuse(path: Path, *args: Any, **kwargs: Any) -> int:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        monkeypatch.setattr(Path, "write_text", refuse)
    try:
        assert main(["diagrams", "--out", str(out)]) == 1
    finally:
        out.chmod(0o755)
    printed, err = capsys.readouterr()
    assert printed == ""
    assert err.startswith("kvfsm diagrams: cannot write ") and err.count("\n") == 1, err
    assert str(out) in err and ("read-only" in err.lower()), err
    assert list(out.iterdir()) == []


#: a different machine under kvfsm's own machine's name, and one whose name is no file name
RENAMED = door(failure_states=[])
RENAMED.name = "transfer"
BADLY_NAMED = door()
BADLY_NAMED.name = "a door/b"


def test_a_machine_named_like_one_of_kvfsms_never_overwrites_kvfsms_drawing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's machine named ``transfer`` would be drawn to transfer.dot and .svg, in place of
    the drawing of kvfsm's transfer machine: refused, with nothing written; kvfsm's own machine
    is drawn under its name as before (its committed drawing is current: nothing to write)."""
    shutil.copytree(COMMITTED, tmp_path, dirs_exist_ok=True)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    with pytest.raises(DiagramError, match=r"^machine 'transfer' is named like kvfsm's own "):
        write([RENAMED], tmp_path)
    assert main(["diagrams", "--out", str(tmp_path), "tests.test_diagrams:RENAMED"]) == 2
    assert "give your machine a name of its own" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before
    assert write([TRANSFER_MACHINE], tmp_path) == []  # kvfsm's own: its drawing is current


# -- rendering ----------------------------------------------------------------------------------

def test_without_dot_nothing_is_written_and_the_missing_program_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new DOT written without its SVG left the old SVG beside it, showing another
    machine: with an SVG to render and no ``dot``, nothing is written."""
    shutil.copytree(COMMITTED, tmp_path / "drawn")
    out = tmp_path / "drawn"
    (out / "transfer.dot").write_text("an older drawing's DOT")
    (out / "transfer.svg").write_text("<svg>an older drawing</svg>")
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["diagrams", "--out", str(out)]) == 1
    assert "`dot` program is not installed" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert main(["diagrams", "--out", str(tmp_path / "new")]) == 1
    assert not (tmp_path / "new" / "transfer.dot").exists()


def test_the_svg_shows_every_state_and_edge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_dot()
    assert main(["diagrams", "--out", str(tmp_path)]) == 0
    svg = ET.parse(tmp_path / "transfer.svg").getroot()
    ns = {"svg": "http://www.w3.org/2000/svg"}
    titles: dict[str, list[str | None]] = {"node": [], "edge": []}
    for group in svg.iterfind(".//svg:g", ns):
        title = group.find("svg:title", ns)
        if title is not None and group.get("class") in ("node", "edge"):  # ports left out
            titles[str(group.get("class"))].append(re.sub(r":\w+", "", title.text or ""))
    assert sorted(titles["node"]) == sorted(["__initial__", *(s.name for s in TransferState)])
    assert Counter(titles["edge"]) == Counter(
        ["__initial__->SUBMITTED",
         *(f"{e.source}->{e.dest}" for e in declared_table(TRANSFER_MACHINE))])
    texts = " ".join(t.text or "" for t in svg.iterfind(".//svg:text", ns))
    for words in ("retry: release #2", "[release_raised]", "/ count_retry", "post #3"):
        assert words in texts
    assert main(["diagrams", "--check", "--out", str(tmp_path)]) == 0


def test_graphviz_reads_the_same_states_and_edges_as_this_parser(
    machine: Declaration[Any, Any],
) -> None:
    require_dot()
    text = to_dot(machine)
    done = subprocess.run(["dot", "-Tjson"], input=text, capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stderr == ""  # no warning about the DOT either
    drawn = json.loads(done.stdout)
    names = [node["name"] for node in drawn["objects"]]
    edges = Counter((names[e["tail"]], names[e["head"]]) for e in drawn["edges"])
    graph = parse_dot(text)
    assert set(names) == set(graph.nodes)
    assert edges == Counter((tail, head) for tail, head, _ in graph.edges)


def test_drawing_again_rewrites_nothing_and_a_stale_svg_is_rendered_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_dot()
    assert main(["diagrams", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {tmp_path / name}" for name in (
            "transfer.dot", "peer_receive.dot", "peer_link.dot", "transfer.svg",
            "peer_receive.svg", "peer_link.svg")]
    assert main(["diagrams", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out == (
        f"kvfsm diagrams: transfer, peer_receive, peer_link up to date in {tmp_path}/\n")
    (tmp_path / "transfer.svg").write_text("<svg/>")
    assert main(["diagrams", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'transfer.svg'}\n"
    assert main(["diagrams", "--check", "--out", str(tmp_path)]) == 0


# -- the theory of operation ------------------------------------------------------------------

def test_the_lifecycle_doc_embeds_the_diagram_and_explains_every_edge_and_fault() -> None:
    doc = (REPO / "docs" / "lifecycle.md").read_text(encoding="utf-8")
    assert "](../diagrams/transfer.svg)" in doc
    rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \| `(\w+)` \| (.+) \|$", doc, re.M)
    described = Counter((source, label, dest) for source, label, dest, _ in rows)
    expected = Counter()
    for edge in declared_table(TRANSFER_MACHINE):
        label = edge.event + (f" #{edge.order}" if edge.order else "")
        guards = [*edge.conditions, *(f"!{g}" for g in edge.unless)]
        label += f" [{' && '.join(guards)}]" if guards else ""
        label += f" / {', '.join(edge.actions)}" if edge.actions else ""
        expected[edge.source, label, edge.dest] += 1
    assert described == expected
    for state in TransferState:
        assert re.search(rf"^\| \*\*{state.name}\*\* \| .+ \|$", doc, re.M), state.name
    for fault in range(1, 12):
        assert re.search(rf"^\| F{fault} \| .+ \|$", doc, re.M), f"F{fault}"
