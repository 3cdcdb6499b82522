"""The mutation score per module from ``mutmut results --all true`` (scripts/mutation).

Reads the lines ``    kvfsm.runner.xǁRunnerǁtake__mutmut_3: survived`` and prints, per module,
how many mutants were killed, timed out, survived, had no test, or were not checked (a run
stopped early, or restricted to some mutants), and the score: killed and timed out over the
mutants checked. Then the mutants not killed, one a line.
"""

from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict

LINE = re.compile(r"^\s*(?P<name>\S+?): (?P<status>.+?)\s*$")
KILLED = {"killed"}
TIMEOUT = {"timeout"}
SURVIVED = {"survived"}
NO_TESTS = {"no tests"}
NOT_CHECKED = {"not checked"}
COLUMNS = ("killed", "timeout", "survived", "no tests", "not checked", "other")


def module_of(name: str) -> str:
    """``kvfsm.runner.xǁRunnerǁtake__mutmut_3`` -> ``kvfsm.runner``."""
    return name.split(".x", 1)[0]


def kind(status: str) -> str:
    for column, statuses in zip(COLUMNS, (KILLED, TIMEOUT, SURVIVED, NO_TESTS, NOT_CHECKED),
                                strict=False):
        if status in statuses:
            return column
    return "other"


def main(path: str) -> int:
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    survivors = []
    with open(path, encoding="utf-8") as results:
        for line in results:
            match = LINE.match(line)
            if match is None:
                continue
            name, status = match["name"], match["status"]
            counts[module_of(name)][kind(status)] += 1
            if kind(status) in {"survived", "no tests"}:
                survivors.append(f"{name}: {status}")
    total: Counter[str] = Counter()
    print(f"{'module':24} {'mutants':>7} " + " ".join(f"{c:>11}" for c in COLUMNS) + "    score")
    for module in sorted(counts):
        total.update(counts[module])
        print(_row(module, counts[module]))
    print(_row("all", total))
    print(f"\n{len(survivors)} mutant(s) not killed:")
    print("\n".join(survivors))
    return 0


def _row(module: str, count: Counter[str]) -> str:
    mutants = sum(count.values())
    checked = mutants - count["not checked"]
    caught = count["killed"] + count["timeout"]
    score = f"{100 * caught / checked:6.1f} %" if checked else "      -"
    return (f"{module:24} {mutants:>7} " + " ".join(f"{count[c]:>11}" for c in COLUMNS)
            + f"  {score}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
