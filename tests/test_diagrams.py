"""The diagrams say what the declarations say, the same bytes each time, and CI notices drift.

The DOT text is read back with a small parser written here, independently of the generator, and
compared with the declared tables themselves (the ``transitions`` dicts a machine was declared
with), for kvfsm's own machines and for machines a user declares.
"""

from __future__ import annotations

import enum
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
from kvfsm.diagrams import MACHINES, load_declaration, to_dot
from kvfsm.lifecycle import TRANSFER_MACHINE, Answer

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


def read_edge(tail: str, head: str, attrs: dict[str, str]) -> tuple[DrawnEdge, bool]:
    """The edge's table entry, and whether its label calls it a retry."""
    first, *rest = label_lines(attrs["label"])
    match = re.fullmatch(r"(retry: )?(\S+?)(?: #(\d+))?", first)
    assert match is not None, first
    conditions: list[str] = []
    unless: list[str] = []
    actions: tuple[str, ...] = ()
    for line in rest:
        if line.startswith("[") and line.endswith("]"):
            for guard in line[1:-1].split(" && "):
                (unless if guard.startswith("!") else conditions).append(guard.lstrip("!"))
        else:
            assert line.startswith("/ "), line
            actions = tuple(line[2:].split(", "))
    order = int(match[3]) if match[3] else None
    return DrawnEdge(tail, head, match[2], order, tuple(conditions), tuple(unless),
                     actions), bool(match[1])


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


def declared_table(declaration: Declaration[Any, Any]) -> list[DrawnEdge]:
    """The machine's table as declared: one entry per (source, transition dict)."""
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
        table.append(DrawnEdge(source, dest, event, order, conditions, unless, actions))
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
    }
    spec.update(overrides)
    return Declaration("door", **spec)


EVERY_MACHINE = {**{spec: load_declaration(spec) for spec in MACHINES}, "user:door": door()}


@pytest.fixture(params=sorted(EVERY_MACHINE))
def machine(request: pytest.FixtureRequest) -> Declaration[Any, Any]:
    """Every machine kvfsm declares, and a user's."""
    declared: Declaration[Any, Any] = EVERY_MACHINE[request.param]
    return declared


# -- what the drawing says -----------------------------------------------------------------

def test_kvfsm_draws_the_transfer_machine_under_its_own_name() -> None:
    assert "kvfsm.lifecycle:TRANSFER_MACHINE" in MACHINES
    assert load_declaration("kvfsm.lifecycle:TRANSFER_MACHINE") is TRANSFER_MACHINE
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
        ("CANCELLING", "poll", 2, ("finished",), (), "FAILED"),
        ("CANCELLING", "poll", 3, ("errored",), ("note_error",), "FAILED"),
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
        ("CLEANED", "publish", None, (), (), "PUBLISHED"),
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


def test_a_self_loop_that_runs_an_action_is_drawn_and_labelled_as_a_retry(
    machine: Declaration[Any, Any],
) -> None:
    for edge, retry, attrs in drawn_edges(parse_dot(to_dot(machine))):
        assert retry == (edge.source == edge.dest and bool(edge.actions)), edge
        assert (attrs.get("style") == "dotted") == retry, edge


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
        ("CLEANED", "PUBLISHED", "publish", ()): "success",
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
    assert labels["CLOSED", "OPEN"] == ["push #1", "[gentle && !hard]"]
    assert labels["JAMMED", "FORCED"] == ["push #1", "[hard]", "/ note_jam, call_smith"]
    assert labels["LOCKED", "CLOSED"] == ["push #1", "[!nothing]"]


def test_the_legend_explains_every_kind_of_edge_drawn() -> None:
    legend = " ".join(label_lines(parse_dot(to_dot(TRANSFER_MACHINE)).graph["label"]))
    for words in ("where a record starts", "final state", "failure state", "success path",
                  "failure paths", "retry", "order guards are tried", "event #n [guards]"):
        assert words in legend


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


def test_the_check_fails_naming_the_machine_whose_files_are_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diagrams", "--check", "--out", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert f"machine 'transfer': {tmp_path / 'nowhere' / 'transfer.dot'} is missing" in err
    assert f"machine 'transfer': {tmp_path / 'nowhere' / 'transfer.svg'} is missing" in err


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
    answers={{"push": [Push.GENTLE]}}, guards={{}}, actions={{}},
    transitions=[{{"trigger": "push", "source": Door.CLOSED, "dest": Door.{dest}}}],
    final=[Door.OPEN])
"""


def kvfsm(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfsm", "diagrams", *args], cwd=cwd,
                          capture_output=True, text=True, check=False, timeout=120)


def test_a_users_machine_named_on_the_command_line_is_drawn_and_checked(tmp_path: Path) -> None:
    require_dot()
    (tmp_path / "door_machine.py").write_text(textwrap.dedent(DOOR_MODULE).format(dest="OPEN"))
    drawn = kvfsm(tmp_path, "--out", "pictures", "door_machine:DOOR")
    assert drawn.returncode == 0, drawn.stderr
    assert sorted(p.name for p in (tmp_path / "pictures").iterdir()) == [
        "door.dot", "door.svg", "peer_link.dot", "peer_link.svg", "peer_receive.dot",
        "peer_receive.svg", "transfer.dot", "transfer.svg"]
    checked = kvfsm(tmp_path, "--check", "--out", "pictures", "door_machine:DOOR")
    assert checked.returncode == 0, checked.stderr
    assert "transfer, peer_receive, peer_link, door up to date in pictures/" in checked.stdout

    # the user changes the machine and forgets to redraw it
    (tmp_path / "door_machine.py").write_text(textwrap.dedent(DOOR_MODULE).format(dest="CLOSED"))
    stale = kvfsm(tmp_path, "--check", "--out", "pictures", "door_machine:DOOR")
    assert stale.returncode == 1
    assert "machine 'door': pictures/door.dot differs from the declaration" in stale.stderr
    assert "machine 'transfer'" not in stale.stderr
    assert "run `kvfsm diagrams --out pictures door_machine:DOOR`" in stale.stderr


def test_only_draws_just_the_machines_named(tmp_path: Path) -> None:
    require_dot()
    (tmp_path / "door_machine.py").write_text(textwrap.dedent(DOOR_MODULE).format(dest="OPEN"))
    drawn = kvfsm(tmp_path, "--only", "door_machine:DOOR")
    assert drawn.returncode == 0, drawn.stderr
    assert sorted(p.name for p in (tmp_path / "diagrams").iterdir()) == ["door.dot", "door.svg"]
    assert kvfsm(tmp_path, "--check", "--only", "door_machine:DOOR").returncode == 0


@pytest.mark.parametrize(("args", "message"), [
    (["door"], "'door': name a machine as module:ATTRIBUTE"),
    (["kvfsm.lifecycle:NOPE"], "kvfsm.lifecycle has no attribute 'NOPE'"),
    (["kvfsm.lifecycle:TransferState"], "is not a kvfsm Declaration (found EnumType)"),
    (["no_such_module_kvfsm:X"], "cannot import 'no_such_module_kvfsm'"),
    (["tests.test_diagrams:RENAMED"], "are both named 'transfer'"),
    (["tests.test_diagrams:BADLY_NAMED"], "machine name 'a door/b' cannot name a file"),
    (["--only"], "no machine to draw"),
])
def test_machines_that_cannot_be_drawn_are_named(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diagrams", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


#: a different machine under kvfsm's own machine's name, and one whose name is no file name
RENAMED = door(final=[Door.OPEN])
RENAMED.name = "transfer"
BADLY_NAMED = door()
BADLY_NAMED.name = "a door/b"


# -- rendering ----------------------------------------------------------------------------------

def test_without_dot_the_dot_files_are_written_and_the_missing_program_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "drawn"
    assert main(["diagrams", "--out", str(out)]) == 1
    assert "`dot` program is not installed" in capsys.readouterr().err
    assert (out / "transfer.dot").read_text() == to_dot(TRANSFER_MACHINE)
    assert not (out / "transfer.svg").exists()


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
        if title is not None and group.get("class") in ("node", "edge"):
            titles[str(group.get("class"))].append(title.text)
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
