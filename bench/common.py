"""What the benchmarks share: the machine they ran on, medians, tables, commits to compare."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

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


def run_in_tree(tree: str, code: str, what: str, timeout: float = 900) -> Any:
    """Run ``code`` in a process of its own whose ``kvfsm`` is ``tree``'s; the JSON its last
    line of output holds. Raises RuntimeError naming ``what`` with the end of its stderr."""
    env = {**os.environ, "PYTHONPATH": tree}
    # run in the tree: "-c" puts the working directory first on the path, before PYTHONPATH
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode:
        raise RuntimeError(f"{what} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


Samples = dict[tuple[str, int], list[dict[str, float]]]


def rounds_by_commit(commits: Sequence[str], prefix: str, sizes: Sequence[int], rounds: int,
                     measure: Callable[[str, int], dict[str, float]]) -> Samples:
    """``measure(tree, size)`` for each size and commit (a worktree each), every contender once
    a round, ``rounds`` times: the figures of each run, by (commit, size)."""
    samples: Samples = {}
    with worktrees(commits, prefix) as trees:
        for round_ in range(rounds):
            for size in sizes:
                for commit, tree in trees.items():
                    samples.setdefault((commit, size), []).append(measure(tree, size))
            print(f"round {round_ + 1} of {rounds}", flush=True)
    return samples


def median_of(runs: Sequence[dict[str, float]], key: str) -> float:
    """The median of one figure over the runs."""
    return statistics.median(run[key] for run in runs)


class _Commits(argparse.Action):
    """The commits to compare, oldest first: each named once (a worktree each, named after
    it)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        seen: set[str] = set()
        for commit in values:
            if commit.replace("/", "-") in seen:
                parser.error(f"commit {commit!r} is named twice: name each commit once")
            seen.add(commit.replace("/", "-"))
        setattr(namespace, self.dest, values)


def add_commits(parser: argparse.ArgumentParser) -> None:
    """The positional commits of a benchmark comparing commits, oldest first, each once."""
    parser.add_argument("commits", nargs="+", action=_Commits, help="commits, oldest first")


def commits_parser(doc: str, stores: Sequence[int], stores_help: str,
                   quick_help: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark comparing commits: the commits, oldest first, the sizes
    (``--stores``), ``--rounds`` and ``--quick``."""
    parser = argparse.ArgumentParser(description=doc.split("\n", maxsplit=1)[0])
    add_commits(parser)
    parser.add_argument("--stores", type=int, nargs="+", default=list(stores), help=stores_help)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def write_by_commit(name: str, out: str, samples: Samples, **figures: object) -> None:
    """Write a comparison of commits to ``bench/results/``: its table as ``name``.md, and
    every run's figures (with ``figures``: the machine, the commits, the rounds...) as
    ``name``.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(out + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(
        {**figures, "samples": [{"commit": commit, "stores": n, "runs": runs}
                                for (commit, n), runs in samples.items()]}, indent=1))

