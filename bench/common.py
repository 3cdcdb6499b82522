"""What the benchmarks share: the machine they ran on, medians, tables, commits to compare."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def machine() -> dict[str, str]:
    """nproc, CPU model, Python, torch, NIXL and transitions versions, kvfsm's commit."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "?"

    dirty = git("status", "--porcelain", "--", "kvfsm")
    return {
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "python": f"{platform.python_implementation()} {sys.version.split()[0]}",
        "torch": version("torch"),
        "nixl": f"nixl-cu12 {version('nixl-cu12')}",
        "transitions": version("transitions"),
        "kvfsm": git("rev-parse", "--short", "HEAD") + (" + uncommitted changes in kvfsm/"
                                                         if dirty else ""),
    }


def print_machine(info: dict[str, str]) -> None:
    print("machine: " + ", ".join(f"{key} {value}" for key, value in info.items()))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> str:
    """A markdown table (also readable on a terminal); numbers right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    numeric = [all(_is_number(r[i]) for r in cells) and bool(cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        padded = (v.rjust(w) if numeric[i] else v.ljust(w)
                  for i, (v, w) in enumerate(zip(values, widths, strict=True)))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if numeric[i] else "-" * (w + 2)
                          for i, w in enumerate(widths)) + "|"
    out = [line(headers), rule, *(line(r) for r in cells)]
    return (f"{title}\n\n" if title else "") + "\n".join(out) + "\n"


def _is_number(text: str) -> bool:
    stripped = text.replace(",", "").replace("x", "").replace("%", "").strip()
    if stripped in {"-", "n/a", ""}:
        return True
    try:
        float(stripped)
    except ValueError:
        return False
    return True


def ratio(value: float | None, reference: float | None) -> str:
    if value is None or reference is None or reference == 0:
        return "-"
    return f"{value / reference:.2f}x"


@contextlib.contextmanager
def worktrees(commits: Sequence[str], prefix: str) -> Iterator[dict[str, str]]:
    """A git worktree of each commit (detached, in a temporary directory), by commit; removed
    on the way out, whatever happened (and git told to forget any it could not remove)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        trees: dict[str, str] = {}
        try:
            for commit in commits:
                tree = os.path.join(scratch, commit.replace("/", "-"))
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach",
                                tree, commit], check=True)
                trees[commit] = tree
            yield trees
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tree],
                               check=False)
            subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
