"""``kvfsm diagrams``: draw declared machines for review, and check the drawings are current.

A diagram is drawn from a :class:`~kvfsm.engine.Declaration` alone, never from a running machine,
so it cannot depend on any record's current state. The DOT text is deterministic byte for byte
(states in their Enum's order, edges in declaration order, fixed attributes); it is what gets
committed and compared. The SVG is rendered from that DOT text by graphviz's ``dot`` program and
carries the SHA-256 of the DOT it was rendered from, so a check can tell a stale picture too
without running ``dot``.

What the drawing says, beyond what ``transitions``' own drawing shows:

* every edge is labelled ``event #n [guards] / actions``. ``#n`` appears where one (state, event)
  has several edges: it is the order their guards are tried in (:attr:`Edge.order`, from 1);
* a self-loop that runs an action is a *retry*: labelled ``retry: event ...`` and drawn dotted
  in orange. A self-loop with no action is a plain *stay* (waiting), drawn in grey;
* the initial state is entered from a small black entry point; final states are double circles;
  failure states (``Declaration.failure_states``) are filled red;
* the success path is bold green and failure paths are dashed red, by this rule, which holds for
  any declared machine:

  - an edge is on the **success path** when it lies on some path from the initial state to a
    final state (to any state, when no final state is declared) that enters no failure state;
  - otherwise it is on a **failure path** when it can be reached from the initial state and it
    enters a failure state, or its source is a failure state or reachable from one;
  - a machine that declares no failure states has no success path singled out: its edges are
    drawn plain, and so is an edge on neither kind of path (say, one that cannot be reached).

  In the transfer machine the failure path is every edge into FAILED and FAILED's release; the
  tail XFER_RELEASED -> CLEANED -> PUBLISHED is shared, and is drawn as part of the success path.

Which machines are drawn: kvfsm's own, listed in :data:`MACHINES` (one line each), and any
``module:ATTRIBUTE`` named on the command line (``--only`` leaves kvfsm's own out). Each goes to
``DIR/NAME.dot`` and ``DIR/NAME.svg``, ``NAME`` being the declaration's ``name``.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import hashlib
import html
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfsm.engine import Declaration, Edge
from kvfsm.machines import KVFSM_MACHINES, load_machine

__all__ = [
    "MACHINES",
    "DiagramError",
    "EdgeKind",
    "Problem",
    "add_arguments",
    "check",
    "dot_available",
    "edge_kinds",
    "edge_label",
    "load_declaration",
    "render_svg",
    "run",
    "svg_is_current",
    "to_dot",
    "write",
]

#: kvfsm's own machines, as ``module:ATTRIBUTE`` (from :data:`kvfsm.machines.KVFSM_MACHINES`)
MACHINES: tuple[str, ...] = tuple(KVFSM_MACHINES.values())

#: the node standing for "where a record starts"; Enum member names can never be dunders
ENTRY_NODE = "__initial__"

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SVG_STAMP = re.compile(r"<!-- kvfsm diagrams: rendered from (\S+), sha256 ([0-9a-f]{64}) -->")


class DiagramError(ValueError):
    """A machine could not be found or drawn: a bad name, an import error, no ``dot``."""


class EdgeKind(enum.Enum):
    """How an edge is drawn."""

    #: on a path from the initial state to a final state that enters no failure state
    SUCCESS = "success"
    #: enters a failure state, or follows one
    FAILURE = "failure"
    #: a self-loop that runs an action: the event is tried again from the same state
    RETRY = "retry"
    #: a self-loop with no action: the machine waits where it is
    STAY = "stay"
    #: neither: the machine declares no failure states, or the edge cannot be reached
    PLAIN = "plain"


#: edge attributes per kind, in the order they are written
_EDGE_STYLE: dict[EdgeKind, tuple[tuple[str, str], ...]] = {
    EdgeKind.SUCCESS: (("color", "#1a7f37"), ("fontcolor", "#1a7f37"), ("penwidth", "2.5"),
                       ("weight", "4")),
    EdgeKind.FAILURE: (("color", "#c62828"), ("fontcolor", "#c62828"), ("style", "dashed")),
    EdgeKind.RETRY: (("color", "#d9730d"), ("fontcolor", "#b35900"), ("style", "dotted"),
                     ("penwidth", "2")),
    EdgeKind.STAY: (("color", "#666666"), ("fontcolor", "#555555")),
    EdgeKind.PLAIN: (),
}

_LEGEND: dict[EdgeKind, str] = {
    EdgeKind.SUCCESS: "bold green: the success path",
    EdgeKind.FAILURE: "dashed red: failure paths",
    EdgeKind.RETRY: "dotted orange: retry (stays, runs its action, tried again)",
    EdgeKind.STAY: "grey loop: stays and waits",
}


@dataclass(frozen=True, slots=True)
class Problem:
    """Why a committed drawing does not match its machine's declaration."""

    machine: str
    path: Path
    reason: str
    diff: str = ""

    def __str__(self) -> str:
        text = f"machine {self.machine!r}: {self.path} {self.reason}"
        return f"{text}\n{self.diff}" if self.diff else text


# -- what the drawing says ----------------------------------------------------------------------

def edge_kinds(declaration: Declaration[Any, Any]) -> dict[Edge, EdgeKind]:
    """How each declared edge is drawn, by the rule in this module's docstring."""
    failure = {_state_name(declaration, s, "failure_states") for s in declaration.failure_states}
    final = {_state_name(declaration, s, "final") for s in declaration.final}
    initial = declaration.initial.name
    moves = [e for e in declaration.edges if not e.is_loop]
    safe = [e for e in moves if e.source not in failure and e.dest not in failure]
    from_start = _reachable({initial} - failure, safe, forward=True)
    to_end = _reachable((final or {s.name for s in declaration.states}) - failure, safe,
                        forward=False)
    anywhere = _reachable({initial}, moves, forward=True)
    after_failure = _reachable(failure, moves, forward=True)
    kinds: dict[Edge, EdgeKind] = {}
    for edge in declaration.edges:
        if edge.is_loop:
            kinds[edge] = EdgeKind.RETRY if edge.actions else EdgeKind.STAY
        elif not failure or edge.source not in anywhere:
            kinds[edge] = EdgeKind.PLAIN
        elif edge in safe and edge.source in from_start and edge.dest in to_end:
            kinds[edge] = EdgeKind.SUCCESS
        elif edge.dest in failure or edge.source in after_failure:
            kinds[edge] = EdgeKind.FAILURE
        else:
            kinds[edge] = EdgeKind.PLAIN
    return kinds


def edge_label(declaration: Declaration[Any, Any], edge: Edge, kind: EdgeKind) -> list[str]:
    """The lines an edge is labelled with: ``[retry: ]event[ #n]``, ``[guards]``, ``/ actions``."""
    head = edge.event
    if len(declaration.edges_from(declaration.states[edge.source], edge.event)) > 1:
        head += f" #{edge.order + 1}"
    if kind is EdgeKind.RETRY:
        head = f"retry: {head}"
    lines = [head]
    if edge.guard_label:
        lines.append(f"[{edge.guard_label}]")
    if edge.actions:
        lines.append("/ " + ", ".join(edge.actions))
    return lines


def to_dot(declaration: Declaration[Any, Any]) -> str:
    """The machine's diagram as DOT text; the same declaration always gives the same bytes."""
    _check_name(declaration.name)
    kinds = edge_kinds(declaration)
    final = {s.name for s in declaration.final}
    failure = {s.name for s in declaration.failure_states}
    used = [kind for kind in _LEGEND if kind in kinds.values()]
    legend = [f"machine {declaration.name}, drawn from its declaration by kvfsm diagrams",
              "black dot: where a record starts; double circle: a final state"
              + ("; red: a failure state" if failure else ""),
              "edge label: event #n [guards] / actions",
              "#n: the order guards are tried in, where one state has several edges on one event",
              *(_LEGEND[kind] for kind in used)]
    ink = ["#000000"] * 4 + [dict(_EDGE_STYLE[kind])["fontcolor"] for kind in used]
    lines = [
        f"// {declaration.name}: generated by `kvfsm diagrams` from its Declaration; do not edit",
        f"digraph {_quote(declaration.name)} {{",
        "  graph [rankdir=TB, nodesep=0.6, ranksep=0.5, fontname=\"Helvetica\", fontsize=10,"
        f" labelloc=b, labeljust=l, label={_html_label(legend, padding=1, colors=ink)}];",
        "  node [shape=ellipse, style=filled, fillcolor=\"#f4f6f8\", color=\"#333333\","
        " fontname=\"Helvetica\", fontsize=11, margin=\"0.12,0.04\"];",
        "  edge [fontname=\"Helvetica\", fontsize=9, arrowsize=0.7];",
        f"  {_quote(ENTRY_NODE)} [shape=point, width=0.16, fillcolor=\"#000000\", label=\"\"];",
    ]
    for state in declaration.states:
        attrs: list[tuple[str, str]] = []
        if state.name in final:
            attrs += [("shape", "doublecircle"), ("margin", "0.02")]
        if state.name in failure:
            attrs += [("fillcolor", "#fbe3e1"), ("color", "#c62828"), ("fontcolor", "#8e1b1b")]
        if state is declaration.initial:
            attrs.append(("penwidth", "2"))
        lines.append(f"  {_quote(state.name)}{_attrs(attrs)};")
    lines.append(f"  {_quote(ENTRY_NODE)} -> {_quote(declaration.initial.name)}"
                 f" [penwidth=1.5, weight=4];")
    for edge in declaration.edges:
        kind = kinds[edge]
        attrs = [("label", _html_label(edge_label(declaration, edge, kind), padding=4)),
                 *_EDGE_STYLE[kind]]
        lines.append(f"  {_quote(edge.source)} -> {_quote(edge.dest)}{_attrs(attrs, raw=1)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- rendering and checking -------------------------------------------------------------------

def dot_available() -> bool:
    """True when graphviz's ``dot`` program is on the PATH."""
    return shutil.which("dot") is not None


def render_svg(dot_text: str, source_name: str = "diagram.dot") -> str:
    """Render DOT text to SVG with ``dot``; the SVG records the hash of the DOT it came from.

    Raises:
        DiagramError: ``dot`` is not installed, or failed.
    """
    program = shutil.which("dot")
    if program is None:
        raise DiagramError("graphviz's `dot` program is not installed (Debian package "
                           "graphviz: apt-get install graphviz); cannot render SVG")
    done = subprocess.run([program, "-Tsvg"], input=dot_text.encode(), capture_output=True,
                          check=False, timeout=60)
    if done.returncode != 0:
        raise DiagramError(f"dot failed on {source_name}: {done.stderr.decode().strip()}")
    svg = done.stdout.decode()
    at = svg.find("<svg")
    if at < 0:
        raise DiagramError(f"dot gave no <svg> element for {source_name}")
    return f"{svg[:at]}{_svg_stamp(source_name, dot_text)}\n{svg[at:]}"


def svg_is_current(svg_text: str, dot_text: str) -> bool:
    """True when ``svg_text`` was rendered (by :func:`render_svg`) from exactly ``dot_text``."""
    match = _SVG_STAMP.search(svg_text)
    return match is not None and match[2] == _sha256(dot_text)


def write(declarations: Iterable[Declaration[Any, Any]], out: Path) -> list[Path]:
    """Write each machine's DOT, and render its SVG unless the SVG already shows that DOT.

    Returns the files that changed. Raises :class:`DiagramError` when an SVG needs rendering
    and ``dot`` is missing (the DOT files are written first).
    """
    drawn = [(d.name, to_dot(d)) for d in declarations]
    out.mkdir(parents=True, exist_ok=True)
    changed: list[Path] = []
    for name, dot_text in drawn:
        path = out / f"{name}.dot"
        if _read(path) != dot_text:
            path.write_text(dot_text, encoding="utf-8")
            changed.append(path)
    for name, dot_text in drawn:
        path = out / f"{name}.svg"
        current = _read(path)
        if current is None or not svg_is_current(current, dot_text):
            path.write_text(render_svg(dot_text, f"{name}.dot"), encoding="utf-8")
            changed.append(path)
    return changed


def check(declarations: Iterable[Declaration[Any, Any]], out: Path) -> list[Problem]:
    """What is missing or stale in ``out``: DOT text compared, SVG hash checked; no ``dot``."""
    problems: list[Problem] = []
    for declaration in declarations:
        name = declaration.name
        dot_text = to_dot(declaration)
        dot_path, svg_path = out / f"{name}.dot", out / f"{name}.svg"
        committed = _read(dot_path)
        if committed is None:
            problems.append(Problem(name, dot_path, "is missing"))
        elif committed != dot_text:
            diff = "".join(list(difflib.unified_diff(
                committed.splitlines(keepends=True), dot_text.splitlines(keepends=True),
                f"{dot_path} (committed)", f"{dot_path} (from the declaration)"))[:60])
            problems.append(Problem(name, dot_path, "differs from the declaration", diff))
        svg = _read(svg_path)
        if svg is None:
            problems.append(Problem(name, svg_path, "is missing"))
        elif not svg_is_current(svg, dot_text):
            problems.append(Problem(name, svg_path,
                                    "was not rendered from the declaration's current DOT"))
    return problems


# -- naming machines ----------------------------------------------------------------------------

def load_declaration(spec: str) -> Declaration[Any, Any]:
    """The Declaration named by ``module:ATTRIBUTE`` (:func:`kvfsm.machines.load_machine`)."""
    try:
        return load_machine(spec)
    except ValueError as error:
        raise DiagramError(str(error)) from None


# -- the command --------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvfsm diagrams`` options."""
    parser.add_argument("machines", nargs="*", metavar="module:ATTRIBUTE",
                        help="a Declaration of your own to draw as well, e.g. "
                             "myproject.machines:DOOR (named by its Declaration.name)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each machine whose DOT or SVG in "
                             "DIR is missing or stale (needs no dot program)")
    parser.add_argument("--out", metavar="DIR", default="diagrams",
                        help="where NAME.dot and NAME.svg go (default: diagrams)")
    parser.add_argument("--only", action="store_true",
                        help="draw only the machines named here, not kvfsm's own")


def run(args: argparse.Namespace) -> int:
    """Draw (or with ``--check``, check) every machine; returns the exit status."""
    specs = [*([] if args.only else MACHINES), *args.machines]
    if not specs:
        print("kvfsm diagrams: no machine to draw (--only needs module:ATTRIBUTE names)",
              file=sys.stderr)
        return 2
    try:
        declarations = _unique([load_declaration(spec) for spec in specs], specs)
    except DiagramError as error:
        print(f"kvfsm diagrams: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    names = ", ".join(d.name for d in declarations)
    try:
        if args.check:
            return _report(check(declarations, out), out, names, _command(args))
        changed = write(declarations, out)
    except DiagramError as error:
        print(f"kvfsm diagrams: {error}", file=sys.stderr)
        return 1
    for path in changed:
        print(f"wrote {path}")
    if not changed:
        print(f"kvfsm diagrams: {names} up to date in {out}/")
    return 0


# -- internals ----------------------------------------------------------------------------------

def _report(problems: Sequence[Problem], out: Path, names: str, command: str) -> int:
    for problem in problems:
        print(f"kvfsm diagrams --check: {problem}", file=sys.stderr)
    if problems:
        print(f"kvfsm diagrams --check: run `{command}` and commit {out}/", file=sys.stderr)
        return 1
    print(f"kvfsm diagrams: {names} up to date in {out}/")
    return 0


def _reachable(start: Iterable[str], edges: Sequence[Edge], *, forward: bool) -> set[str]:
    seen = set(start)
    frontier = list(seen)
    while frontier:
        state = frontier.pop()
        for edge in edges:
            here, there = (edge.source, edge.dest) if forward else (edge.dest, edge.source)
            if here == state and there not in seen:
                seen.add(there)
                frontier.append(there)
    return seen


def _state_name(declaration: Declaration[Any, Any], state: Any, field: str) -> str:
    if not isinstance(state, declaration.states):
        raise DiagramError(f"machine {declaration.name!r}: {field} holds {state!r}, which is "
                           f"not a {declaration.states.__name__}")
    return str(state.name)


def _check_name(name: str) -> None:
    if not _SAFE_NAME.fullmatch(name):
        raise DiagramError(f"machine name {name!r} cannot name a file; use letters, digits, "
                           "'_', '.' and '-'")


def _unique(declarations: list[Declaration[Any, Any]],
            specs: Sequence[str]) -> list[Declaration[Any, Any]]:
    """Drop a machine named twice; refuse two different machines with one name."""
    kept: dict[str, tuple[Declaration[Any, Any], str]] = {}
    for declaration, spec in zip(declarations, specs, strict=True):
        _check_name(declaration.name)
        seen = kept.get(declaration.name)
        if seen is None:
            kept[declaration.name] = (declaration, spec)
        elif seen[0] is not declaration:
            raise DiagramError(f"{seen[1]} and {spec} are both named {declaration.name!r}; "
                               "each machine needs its own name")
    return [declaration for declaration, _ in kept.values()]


def _command(args: argparse.Namespace) -> str:
    words = ["kvfsm", "diagrams"]
    if args.out != "diagrams":
        words += ["--out", args.out]
    if args.only:
        words.append("--only")
    return " ".join([*words, *args.machines])


def _quote(text: str) -> str:
    """A DOT double-quoted string: backslashes and quotes escaped, nothing else touched."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _html_label(lines: Sequence[str], *, padding: int, colors: Sequence[str] = ()) -> str:
    """A graphviz HTML-like label: lines left-aligned in one padded cell, the first in bold.

    Padding is geometry, so it sets a label off its edge in every SVG renderer (plain leading
    spaces are dropped by some). ``colors`` gives lines their own colour, in order.
    """
    rows = []
    for index, line in enumerate(lines):
        text = html.escape(line)
        if index == 0:
            text = f"<b>{text}</b>"
        if index < len(colors):
            text = f'<font color="{colors[index]}">{text}</font>'
        rows.append(text)
    return (f'<<table border="0" cellborder="0" cellspacing="0" cellpadding="{padding}">'
            f'<tr><td align="left" balign="left">{"<br/>".join(rows)}</td></tr></table>>')


def _attrs(attrs: Sequence[tuple[str, str]], raw: int = 0) -> str:
    """``[key=value, ...]``; the first ``raw`` values are already quoted."""
    if not attrs:
        return ""
    parts = [f"{key}={value if i < raw else _quote(value)}"
             for i, (key, value) in enumerate(attrs)]
    return " [" + ", ".join(parts) + "]"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _svg_stamp(source_name: str, dot_text: str) -> str:
    return f"<!-- kvfsm diagrams: rendered from {source_name}, sha256 {_sha256(dot_text)} -->"


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
