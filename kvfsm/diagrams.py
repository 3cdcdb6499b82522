"""``kvfsm diagrams``: draw declared machines for review, and check the drawings are current.

A diagram is drawn from a :class:`~kvfsm.engine.Declaration` alone, never from a running machine,
so it cannot depend on any record's current state. The DOT text is deterministic byte for byte
(states in their Enum's order, edges in declaration order, fixed attributes); it is what gets
committed and compared. The SVG is rendered from that DOT text by graphviz's ``dot`` program and
carries the SHA-256 of the DOT it was rendered from, so a check can tell a stale picture too
without running ``dot``.

What the drawing says, beyond what ``transitions``' own drawing shows:

* every edge is labelled ``event #n call() [guards] answers / actions``. ``answers`` are the
  answers of the event that take the edge (``DONE``, ``ERR | RAISED``): what its guards
  accept, so a guard whose meaning changes changes the drawing too. ``#n`` appears where one
  (state, event) has several edges: it is the order their guards are tried in
  (:attr:`Edge.order`, from 1). ``call()``, in italics, is what the event calls, in order, as
  the declaration's optional ``calls`` mapping names it (``{"poll": "check_xfer_state"}``;
  :func:`declared_calls`); an event it leaves out, or a declaration without it, shows none;
* a self-loop of the effect a state waits on (``Declaration.effects``; a release that raised,
  a step's "not yet"), but the state check's and the post's, is a *retry*, as a tier runs it
  (tried again, bounded by the retry policy): labelled ``retry: event ...`` and drawn dotted
  in orange. Any other self-loop (NIXL still running, a cancel where the outcome stands) is a
  plain *stay* (waiting), drawn in grey. In a machine that declares no effects, a self-loop
  that runs an action is a retry;
* the initial state is entered from a small black entry point; final states are double circles;
  failure states (``Declaration.failure_states``) are filled red;
* the success path is bold green and failure paths are dashed red, by this rule, which holds for
  any declared machine:

  - the **failure answers** are those the declaration itself treats as failures: each answer a
    guarded edge accepts to enter a failure state, or to retry, from a state that is not a
    failure state (:func:`failure_answers`; answers are compared as values, across events, so
    an answer such as ``RAISED`` that fails one call is a failure wherever it is answered);
  - an edge is on the **success path** when it lies on some path from the initial state to a
    final state (to any state, when no final state is declared) that enters no failure state
    and each of whose edges some answer other than a failure answer takes;
  - otherwise it is on a **failure path** when it can be reached from the initial state and it
    enters a failure state, its source is a failure state or reachable from one, or only
    failure answers take it;
  - a machine that declares no failure states has no success path singled out: its edges are
    drawn plain, and so is an edge on neither kind of path (say, one that cannot be reached).

  In the transfer machine the failure path is every edge into FAILED and FAILED's release; the
  tail XFER_RELEASED -> CLEANED -> PUBLISHED is shared, and is drawn as part of the success path.
  In the link machine a ``remove`` that raised is a failure (``RAISED`` refuses a peer's
  metadata), so its leak edges are dashed red.

How it is laid out, so that no label is crossed by a self-loop or another edge: a state's loops
leave it at the top of its right side and come back at the bottom (ports ``ne`` to ``se``), each
around the ones inside it, with a blank after each label where the next loop out turns; the
other edges leave a state that has loops at its bottom and enter it at its top. The tests check
graphviz's layout of every drawing for crossings.

Which machines are drawn: those named on the command line as ``module:ATTRIBUTE``, or, when none
is named, kvfsm's own, listed in :data:`MACHINES` (one line each). Each goes to
``DIR/NAME.dot`` and ``DIR/NAME.svg``, ``NAME`` being the declaration's ``name``; ``DIR`` is
``diagrams`` in the current directory unless ``--out`` says otherwise, for kvfsm's machines and a
user's alike. A DIR that is not a directory, or cannot be written, is refused in one line before
anything is written, and so is a machine named like one of kvfsm's own (``transfer``,
``peer_receive``, ``peer_link``) that is not that machine: its drawing would take the place of
kvfsm's.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import hashlib
import html
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
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
    "declared_calls",
    "dot_available",
    "edge_kinds",
    "edge_label",
    "failure_answers",
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

#: how many characters of calls go on one line of an edge label
_CALLS_WIDTH = 40

#: points of blank right of a self-loop's label: the next loop out turns back down there
_LOOP_SPACER = 12

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SVG_STAMP = re.compile(r"<!-- kvfsm diagrams: rendered from (\S+), sha256 ([0-9a-f]{64}), "
                        r"drawing sha256 ([0-9a-f]{64}) -->\n")


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

def failure_answers(declaration: Declaration[Any, Any]) -> frozenset[Any]:
    """The answers the declaration itself treats as failures (see this module's docstring)."""
    failure = _failure_states(declaration)
    found: set[Any] = set()
    for edge in declaration.edges:
        if edge.source in failure or not (edge.conditions or edge.unless):
            continue
        if edge.dest in failure or (edge.is_loop and edge.actions):
            found |= _accepted(declaration, edge)
    return frozenset(found)


def edge_kinds(declaration: Declaration[Any, Any]) -> dict[Edge, EdgeKind]:
    """How each declared edge is drawn, by the rule in this module's docstring."""
    failure = _failure_states(declaration)
    final = {_state_name(declaration, s, "final") for s in declaration.final}
    initial = declaration.initial.name
    failing = failure_answers(declaration)
    moves = [e for e in declaration.edges if not e.is_loop]
    safe = [e for e in moves if e.source not in failure and e.dest not in failure
            and _accepted(declaration, e) - failing]
    from_start = _reachable({initial} - failure, safe, forward=True)
    to_end = _reachable((final or {s.name for s in declaration.states}) - failure, safe,
                        forward=False)
    anywhere = _reachable({initial}, moves, forward=True)
    after_failure = _reachable(failure, moves, forward=True)
    kinds: dict[Edge, EdgeKind] = {}
    retried = {state.name: effect for state, effect in declaration.effects.items()
               if effect not in ("poll", "post")}  # (the runner's rule: Runner._retry_steps)
    for edge in declaration.edges:
        if edge.is_loop:
            retry = (retried.get(edge.source) == edge.event if declaration.effects
                     else bool(edge.actions))
            kinds[edge] = EdgeKind.RETRY if retry else EdgeKind.STAY
        elif not failure or edge.source not in anywhere:
            kinds[edge] = EdgeKind.PLAIN
        elif edge in safe and edge.source in from_start and edge.dest in to_end:
            kinds[edge] = EdgeKind.SUCCESS
        elif (edge.dest in failure or edge.source in after_failure
              or not _accepted(declaration, edge) - failing):
            kinds[edge] = EdgeKind.FAILURE
        else:
            kinds[edge] = EdgeKind.PLAIN
    return kinds


def declared_calls(declaration: Declaration[Any, Any]) -> dict[str, tuple[str, ...]]:
    """The calls each event makes, from the declaration's optional ``calls`` mapping.

    ``calls`` maps an event to the call it makes (a string) or the calls it makes, in order (a
    sequence of strings); an event it leaves out makes none worth naming. A declaration without
    ``calls`` names none.

    Raises:
        DiagramError: ``calls`` names an event the machine does not declare, or is not names.
    """
    declared = getattr(declaration, "calls", None) or {}
    if not isinstance(declared, Mapping):
        raise DiagramError(f"machine {declaration.name!r}: calls must map events to the calls "
                           f"they make, not {type(declared).__name__}")
    found: dict[str, tuple[str, ...]] = {}
    for key, named in declared.items():
        event = str(key)  # a StrEnum member reads as its trigger name
        if event not in declaration.answers:
            raise DiagramError(f"machine {declaration.name!r}: calls names {event!r}, which is "
                               "not one of its events")
        names = (named,) if isinstance(named, str) else (
            tuple(named) if isinstance(named, Iterable) else ())
        if not names or not all(isinstance(n, str) and n and n.isprintable() for n in names):
            raise DiagramError(f"machine {declaration.name!r}: the calls of {event!r} must be "
                               f"names (str), not {named!r}")
        found[event] = names
    return found


def edge_label(declaration: Declaration[Any, Any], edge: Edge, kind: EdgeKind) -> list[str]:
    """The lines an edge is labelled with: ``[retry: ]event[ #n]``, the calls its event makes
    (``call(), ...``, wrapped), ``[guards] answers`` (the answers that take the edge, in the
    order their Enum declares them), ``/ actions``."""
    head = edge.event
    if len(declaration.edges_from(declaration.states[edge.source], edge.event)) > 1:
        head += f" #{edge.order + 1}"
    if kind is EdgeKind.RETRY:
        head = f"retry: {head}"
    lines = [head, *_call_lines(declared_calls(declaration).get(edge.event, ()))]
    if edge.guard_label:
        taken = sorted(_accepted(declaration, edge), key=_answer_order)
        lines.append(f"[{edge.guard_label}] " + " | ".join(_answer_name(a) for a in taken))
    if edge.actions:
        lines.append("/ " + ", ".join(edge.actions))
    return lines


def to_dot(declaration: Declaration[Any, Any]) -> str:
    """The machine's diagram as DOT text; the same declaration always gives the same bytes."""
    _check_name(declaration.name)
    kinds = edge_kinds(declaration)
    final = {s.name for s in declaration.final}
    failure = {s.name for s in declaration.failure_states}
    calls = declared_calls(declaration)
    used = [kind for kind in _LEGEND if kind in kinds.values()]
    legend = [f"machine {declaration.name}, drawn from its declaration by kvfsm diagrams",
              "black dot: where a record starts; double circle: a final state"
              + ("; red: a failure state" if failure else ""),
              "edge label: event #n " + ("call() " if calls else "")
              + "[guards] answers / actions",
              "answers: what the event answers to take the edge (what its guards accept)",
              "#n: the order guards are tried in, where one state has several edges on one event",
              *(["call(): what the event calls, in order"] if calls else []),
              *(_LEGEND[kind] for kind in used)]
    ink = ["#000000"] * (len(legend) - len(used)) + [
        dict(_EDGE_STYLE[kind])["fontcolor"] for kind in used]
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
    looped = {edge.source for edge in declaration.edges if edge.is_loop}
    cycles = _on_cycles(declaration)
    for edge in declaration.edges:
        label = edge_label(declaration, edge, kinds[edge])
        italic = range(1, 1 + len(_call_lines(calls.get(edge.event, ()))))
        attrs = [("label", _html_label(label, padding=4, italic=italic,
                                       spacer=_LOOP_SPACER if edge.is_loop else 0)),
                 *_EDGE_STYLE[kinds[edge]], *_ports(edge, looped, cycles)]
        lines.append(f"  {_quote(edge.source)} -> {_quote(edge.dest)}{_attrs(attrs, raw=1)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- rendering and checking -------------------------------------------------------------------

def dot_available() -> bool:
    """True when graphviz's ``dot`` program is on the PATH."""
    return shutil.which("dot") is not None


def _dot_program() -> str:
    """Where graphviz's ``dot`` is; DiagramError, saying how to install it, if nowhere."""
    program = shutil.which("dot")
    if program is None:
        raise DiagramError("graphviz's `dot` program is not installed (Debian package "
                           "graphviz: apt-get install graphviz); cannot render SVG")
    return program


def render_svg(dot_text: str, source_name: str = "diagram.dot") -> str:
    """Render DOT text to SVG with ``dot``; the SVG records the hash of the DOT it came from,
    and of the drawing ``dot`` gave (the SVG but that record: one edited by hand is told).

    Raises:
        DiagramError: ``dot`` is not installed, or failed.
    """
    program = _dot_program()
    done = subprocess.run([program, "-Tsvg"], input=dot_text.encode(), capture_output=True,
                          check=False, timeout=60)
    if done.returncode != 0:
        raise DiagramError(f"dot failed on {source_name}: {done.stderr.decode().strip()}")
    svg = done.stdout.decode()
    at = svg.find("<svg")
    if at < 0:
        raise DiagramError(f"dot gave no <svg> element for {source_name}")
    return f"{svg[:at]}{_svg_stamp(source_name, dot_text, svg)}\n{svg[at:]}"


def svg_is_current(svg_text: str, dot_text: str) -> bool:
    """True when ``svg_text`` was rendered (by :func:`render_svg`) from exactly ``dot_text``,
    and is the drawing ``dot`` gave then (:func:`svg_problem`)."""
    return svg_problem(svg_text, dot_text) is None


def svg_problem(svg_text: str, dot_text: str) -> str | None:
    """What is wrong with ``svg_text`` as the drawing of ``dot_text``, or None: it records no
    rendering (or one from before the drawing's hash was), it was rendered from other DOT, or
    it was changed after it was rendered (its drawing is not the one its record hashed)."""
    match = _SVG_STAMP.search(svg_text)
    if match is None and "<!-- kvfsm diagrams: rendered from " in svg_text:
        return ("holds a record of its rendering this kvfsm does not write (an older kvfsm's, "
                "from before drawings kept their own hash, or one edited): kvfsm diagrams "
                "renders it again")
    if match is None or match[2] != _sha256(dot_text):
        return "was not rendered from the declaration's current DOT"
    if _sha256(svg_text[:match.start()] + svg_text[match.end():]) != match[3]:
        return ("was changed after it was rendered (a drawing is generated, never edited: "
                "kvfsm diagrams draws it again)")
    return None


def write(declarations: Iterable[Declaration[Any, Any]], out: Path) -> list[Path]:
    """Write each machine's DOT, and render its SVG unless the SVG already shows that DOT.

    Returns the files that changed. Raises :class:`DiagramError`, having written nothing, when
    a machine is named like one of kvfsm's own but is not it (its drawing would take the place
    of kvfsm's), or ``out`` is not a directory that can be made or written to, or an SVG needs
    rendering and ``dot`` is missing (a DOT written without its SVG would leave the old SVG
    beside it, showing another machine).
    """
    declarations = list(declarations)
    for declaration in declarations:
        _check_not_named_like_ours(declaration)
    drawn = [(d.name, to_dot(d)) for d in declarations]
    _make_directory(out)
    dots = [(out / f"{name}.dot", text) for name, text in drawn
            if _read(out / f"{name}.dot") != text]
    svgs = [(out / f"{name}.svg", text) for name, text in drawn
            if not svg_is_current(_read(out / f"{name}.svg") or "", text)]
    _check_writable(out, [path for path, _ in [*dots, *svgs]])
    if svgs:
        _dot_program()
    for path, dot_text in dots:
        _write(path, dot_text)
    for path, dot_text in svgs:
        _write(path, render_svg(dot_text, path.with_suffix(".dot").name))
    return [path for path, _ in [*dots, *svgs]]


def check(declarations: Iterable[Declaration[Any, Any]], out: Path) -> list[Problem]:
    """What is missing or stale in ``out``: DOT text compared, SVG hash checked; no ``dot``.

    Raises:
        DiagramError: ``out`` is not a directory, or a file in it cannot be read.
    """
    if out.exists() and not out.is_dir():
        raise DiagramError(f"cannot check {out}: it is not a directory")
    if not out.exists():  # (a mistyped --out: not every drawing missing, one by one)
        raise DiagramError(f"cannot check {out}: no such directory (kvfsm diagrams --out "
                           f"{out} draws the machines into it)")
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
        else:
            problem = svg_problem(svg, dot_text)
            if problem is not None:
                problems.append(Problem(name, svg_path, problem))
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
                        help="a Declaration to draw instead of kvfsm's own, e.g. "
                             "myproject.machines:DOOR (named by its Declaration.name)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each machine whose DOT or SVG in "
                             "DIR is missing or stale (needs no dot program)")
    parser.add_argument("--out", metavar="DIR", default="diagrams",
                        help="where NAME.dot and NAME.svg go, for kvfsm's machines or yours "
                             "(default: diagrams, in the current directory)")
    parser.add_argument("--only", action="store_true",
                        help="draw only the machines named here (what naming machines does "
                             "anyway; kept for scripts that pass it)")


def run(args: argparse.Namespace) -> int:
    """Draw (or with ``--check``, check) the machines named, or kvfsm's own; returns the exit
    status: 0, 1 when a drawing is stale or cannot be written, 2 when a machine cannot be
    drawn."""
    if not args.out:  # (a Path of it is the current directory: not what was asked)
        print("kvfsm diagrams: --out needs a directory's path, got ''", file=sys.stderr)
        return 2
    specs = list(args.machines) or ([] if args.only else list(MACHINES))
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
    except (DiagramError, OSError) as error:  # one line, never a traceback
        where = f"{error.filename}: " if isinstance(error, OSError) and error.filename else ""
        print(f"kvfsm diagrams: {where}{_reason(error)}", file=sys.stderr)
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


def _failure_states(declaration: Declaration[Any, Any]) -> set[str]:
    return {_state_name(declaration, s, "failure_states") for s in declaration.failure_states}


def _accepted(declaration: Declaration[Any, Any], edge: Edge) -> set[Any]:
    """The answers of its event that take ``edge``: every condition accepts, no unless does."""
    return {answer for answer in declaration.answers[edge.event]
            if all(answer in declaration.guards[g] for g in edge.conditions)
            and not any(answer in declaration.guards[g] for g in edge.unless)}


def _answer_order(answer: Any) -> tuple[str, str, int, str]:
    """An answer's place, the same in every run: by its type, then an Enum member's place in
    its Enum (a Flag's combined member after its own), then its name."""
    kind = type(answer)
    members = list(kind.__members__.values()) if isinstance(answer, enum.Enum) else []
    place = members.index(answer) if answer in members else len(members)
    return kind.__module__, kind.__qualname__, place, _answer_name(answer)


def _answer_name(answer: Any) -> str:
    name = answer.name if isinstance(answer, enum.Enum) else None
    return str(answer) if name is None else name


def _call_lines(calls: Sequence[str]) -> list[str]:
    """``call(), call()``, broken after a comma before a line grows past :data:`_CALLS_WIDTH`."""
    lines: list[str] = []
    for index, call in enumerate(calls):
        word = f"{call}()" + ("," if index < len(calls) - 1 else "")
        if lines and len(lines[-1]) + 1 + len(word) <= _CALLS_WIDTH:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _ports(edge: Edge, looped: Collection[str], cycles: Collection[Edge]) -> list[tuple[str, str]]:
    """Where an edge meets its states, so no edge crosses a self-loop or its label.

    A state's loops leave it at the top of its right side and come back at the bottom
    (``ne`` to ``se``), so each loop passes above and below the labels of the loops inside it,
    which sit at the state's height. The other edges leave a state with loops at its bottom and
    enter one at its top, away from those labels; an edge on a cycle is left free, since
    ``dot`` may draw it upwards.
    """
    if edge.is_loop:
        return [("tailport", "ne"), ("headport", "se")]
    if edge in cycles:
        return []
    return ([("tailport", "s")] if edge.source in looped else []) + (
        [("headport", "n")] if edge.dest in looped else [])


def _on_cycles(declaration: Declaration[Any, Any]) -> set[Edge]:
    """The edges between two states that each can reach the other (self-loops aside)."""
    moves = [edge for edge in declaration.edges if not edge.is_loop]
    return {edge for edge in moves
            if edge.source in _reachable({edge.dest}, moves, forward=True)}


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


def _check_not_named_like_ours(declaration: Declaration[Any, Any]) -> None:
    """A machine named like one of kvfsm's own (:data:`kvfsm.machines.KVFSM_MACHINES`) is that
    machine: another one's drawing would silently take the place of kvfsm's."""
    spec = KVFSM_MACHINES.get(declaration.name)
    if spec is not None and load_machine(spec) is not declaration:
        raise DiagramError(
            f"machine {declaration.name!r} is named like kvfsm's own machine {spec}, but is "
            f"another machine: its drawing would take the place of kvfsm's "
            f"({declaration.name}.dot, {declaration.name}.svg); give your machine a name of "
            "its own")


def _unique(declarations: list[Declaration[Any, Any]],
            specs: Sequence[str]) -> list[Declaration[Any, Any]]:
    """Drop a machine named twice; refuse two different machines with one name, and a machine
    named like one of kvfsm's own that is not it."""
    kept: dict[str, tuple[Declaration[Any, Any], str]] = {}
    for declaration, spec in zip(declarations, specs, strict=True):
        _check_name(declaration.name)
        seen = kept.get(declaration.name)
        if seen is None:
            kept[declaration.name] = (declaration, spec)
        elif seen[0] is not declaration:
            raise DiagramError(f"{seen[1]} and {spec} are both named {declaration.name!r}; "
                               "each machine needs its own name")
    for declaration, _ in kept.values():
        _check_not_named_like_ours(declaration)
    return [declaration for declaration, _ in kept.values()]


def _command(args: argparse.Namespace) -> str:
    words = ["kvfsm", "diagrams"]
    if args.out != "diagrams":
        words += ["--out", args.out]
    return " ".join([*words, *args.machines])


def _quote(text: str) -> str:
    """A DOT double-quoted string: backslashes and quotes escaped, nothing else touched."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _html_label(lines: Sequence[str], *, padding: int, colors: Sequence[str] = (),
                italic: Collection[int] = (), spacer: int = 0) -> str:
    """A graphviz HTML-like label: lines left-aligned in one padded cell, the first in bold.

    Padding is geometry, so it sets a label off its edge in every SVG renderer (plain leading
    spaces are dropped by some). ``colors`` gives lines their own colour, in order; the lines
    numbered in ``italic`` are set in italics; ``spacer`` points of blank follow the cell.
    """
    rows = []
    for index, line in enumerate(lines):
        text = html.escape(line)
        if index == 0:
            text = f"<b>{text}</b>"
        elif index in italic:
            text = f"<i>{text}</i>"
        if index < len(colors):
            text = f'<font color="{colors[index]}">{text}</font>'
        rows.append(text)
    blank = f'<td width="{spacer}"></td>' if spacer else ""
    return (f'<<table border="0" cellborder="0" cellspacing="0" cellpadding="{padding}">'
            f'<tr><td align="left" balign="left">{"<br/>".join(rows)}</td>{blank}</tr></table>>')


def _attrs(attrs: Sequence[tuple[str, str]], raw: int = 0) -> str:
    """``[key=value, ...]``; the first ``raw`` values are already quoted."""
    if not attrs:
        return ""
    parts = [f"{key}={value if i < raw else _quote(value)}"
             for i, (key, value) in enumerate(attrs)]
    return " [" + ", ".join(parts) + "]"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _svg_stamp(source_name: str, dot_text: str, svg: str) -> str:
    return (f"<!-- kvfsm diagrams: rendered from {source_name}, sha256 {_sha256(dot_text)}, "
            f"drawing sha256 {_sha256(svg)} -->")


def _read(path: Path) -> str | None:
    """The file's text; None when there is no such file."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise DiagramError(f"cannot read {path}: {_reason(error)}") from None


def _make_directory(out: Path) -> None:
    """Make ``out`` (and its parents) unless it is a directory already."""
    if out.exists() and not out.is_dir():
        raise DiagramError(f"cannot write to {out}: it is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DiagramError(f"cannot write to {out}: {_reason(error)}") from None


def _check_writable(out: Path, paths: Iterable[Path]) -> None:
    """Refuse before writing anything when one of ``paths`` could not be written."""
    for path in paths:
        if path.is_dir():
            raise DiagramError(f"cannot write {path}: it is a directory")
        if path.exists() and not os.access(path, os.W_OK):
            raise DiagramError(f"cannot write {path}: it is read-only")
        if not path.exists() and not os.access(out, os.W_OK | os.X_OK):
            raise DiagramError(f"cannot write to {out}: it is read-only")


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        raise DiagramError(f"cannot write {path}: {_reason(error)}") from None


def _reason(error: BaseException) -> str:
    """An error's message on one line: an OSError's own words (``Permission denied``)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return " ".join(str(error).split()) or type(error).__name__
