"""Transition coverage, as a pytest plugin (entry point ``pytest11``: loaded with kvfsm).

With ``--kvfsm-coverage`` every machine compiled during the run is watched; at the end a table
shows, for the machines named with ``--kvfsm-machine MODULE:ATTRIBUTE`` (or a name of one of
kvfsm's own, such as ``transfer``; kvfsm's own when none is named), how often each declared
transition was taken with each answer its guards accept. With ``--kvfsm-coverage-fail`` the run
fails when one of them was never taken.

Naming a machine turns coverage on, as ``--kvfsm-coverage-fail`` does: a test author who writes
``--kvfsm-machine mine:MACHINE`` is asking for that machine's table, and a run that printed
nothing (or an error telling them to type the other option too) would only be in the way. A spec
that names no declaration is a usage error, whichever option asked for coverage.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from kvfsm.engine import COMPILE_LISTENERS, CompiledMachine, Declaration, Edge
from kvfsm.machines import kvfsm_machines, load_machine

__all__ = ["TransitionCoverage"]

#: (edge, answer name) -> times taken
Counts = Counter[tuple[Edge, str]]


class TransitionCoverage:
    """Collects the step counts of every machine compiled while it listens."""

    def __init__(self, machines: dict[str, Declaration[Any, Any]]) -> None:
        self.machines = machines
        self._compiled: list[CompiledMachine[Any, Any]] = []

    def start(self) -> None:
        """Listen to every compilation."""
        COMPILE_LISTENERS.append(self._compiled.append)

    def stop(self) -> None:
        """Stop listening."""
        if self._compiled.append in COMPILE_LISTENERS:
            COMPILE_LISTENERS.remove(self._compiled.append)

    def counts(self, declaration: Declaration[Any, Any]) -> Counts:
        """How often each (edge, answer) of ``declaration`` was taken, over all compilations."""
        counts: Counts = Counter()
        for compiled in self._compiled:
            verdict = compiled.verdict  # (an exploration that found a violation: not tested)
            if compiled.declaration is declaration and (verdict is None or verdict.counted):
                for step in compiled.steps():
                    counts[(step.edge, step.answer.name)] += step.count
        for step in declaration.compile().steps():  # every declared pair, taken or not
            counts[(step.edge, step.answer.name)] += 0
        return counts

    def missed(self, declaration: Declaration[Any, Any]) -> list[tuple[Edge, str]]:
        """The (edge, answer) pairs of ``declaration`` never taken."""
        return [pair for pair, count in self.counts(declaration).items() if count == 0]

    def table(self) -> list[str]:
        """The coverage table, one block per machine."""
        lines: list[str] = []
        for name, declaration in self.machines.items():
            counts = self.counts(declaration)
            taken = sum(1 for count in counts.values() if count)
            lines.append(f"machine {name}: {taken} of {len(counts)} transitions taken "
                         f"({100 * taken / max(len(counts), 1):.0f} %)")
            if not any(c.declaration is declaration for c in self._compiled):
                lines.append("  (never compiled in this run: a tier made in another process "
                             "is not counted, nor one built on a copy of the declaration, "
                             "such as its module imported under another name)")
            for (edge, answer), count in sorted(
                    counts.items(), key=lambda item: (item[0][0].source, item[0][0].event,
                                                      item[0][0].order, item[0][1])):
                guard = f" [{edge.guard_label}]" if edge.guard_label else ""
                label = f"-{edge.event}({answer}){guard}"
                mark = "" if count else "   <- never taken"
                lines.append(f"  {edge.source:>13} {label:<34} -> {edge.dest:<13} "
                             f"{count:>8}{mark}")
        return lines


def pytest_addoption(parser: pytest.Parser) -> None:
    """The plugin's options."""
    group = parser.getgroup("kvfsm", "kvfsm transition coverage")
    group.addoption("--kvfsm-coverage", action="store_true",
                    help="print which declared transitions the tests took")
    group.addoption("--kvfsm-coverage-fail", action="store_true",
                    help="fail the run when a declared transition was never taken "
                         "(implies --kvfsm-coverage)")
    group.addoption("--kvfsm-machine", action="append", default=[], metavar="MODULE:ATTRIBUTE",
                    help="cover this machine (repeatable; implies --kvfsm-coverage); by "
                         "default kvfsm's own machines")


_KEY = pytest.StashKey[TransitionCoverage]()


def pytest_configure(config: pytest.Config) -> None:
    """Start listening when asked to: by any of the three options."""
    named = config.getoption("kvfsm_machine")
    if not (config.getoption("kvfsm_coverage") or config.getoption("kvfsm_coverage_fail")
            or named):
        return
    try:
        loaded = {spec: load_machine(spec) for spec in named}
    except ValueError as error:
        raise pytest.UsageError(f"--kvfsm-machine: {error}") from None
    machines = kvfsm_machines() if not named else {}
    for spec, machine in loaded.items():  # (one table a name: two of one name were one)
        same = [other for other, m in loaded.items()
                if m.name == machine.name and m is not machine]
        if same:
            raise pytest.UsageError(f"--kvfsm-machine: {spec} and {same[0]} are two machines "
                                    f"named {machine.name!r}; give each a name of its own")
        machines[machine.name] = machine
    coverage = TransitionCoverage(machines)
    coverage.start()
    config.stash[_KEY] = coverage


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail a run that left a declared transition untaken, when asked to."""
    coverage = session.config.stash.get(_KEY, None)
    if coverage is None or not session.config.getoption("kvfsm_coverage_fail"):
        return
    if session.config.option.collectonly:  # (a run of some tests only, -k or --deselect,
        return  # is failed too: the table says what they left untaken)
    if any(coverage.missed(m) for m in coverage.machines.values()) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    """Print the coverage table."""
    coverage = config.stash.get(_KEY, None)
    if coverage is None:
        return
    coverage.stop()
    terminalreporter.section("kvfsm transition coverage")
    for line in coverage.table():
        terminalreporter.write_line(line)
    missed = [f"{name}: {edge.source} -{edge.event}({answer})-> {edge.dest}"
              for name, machine in coverage.machines.items()
              for edge, answer in coverage.missed(machine)]
    if missed and config.getoption("kvfsm_coverage_fail"):
        terminalreporter.write_line(f"FAILED: {len(missed)} declared transition(s) never "
                                    "taken (--kvfsm-coverage-fail)", red=True)
