"""The full lifecycle, commit by commit: where a rise against the hand-written loop came from.

For each commit named, a git worktree of it (in a temporary directory, removed at the end) is
put first on ``PYTHONPATH``, and one process measures its ``ObjectStoreTier`` on the zero-cost
agent of this tree: 1,000 one-block stores per cycle (submit with NIXL answering PROC, then
DONE and one ``get_finished_jobs()`` round), the median of 25 cycles per transfer. The
hand-written loop (b) of this tree runs beside them. Every contender runs once a round, the
rounds repeat, and each keeps its minimum (the guest's noise between rounds is large).

With ``--instructions``, each contender instead runs under valgrind's callgrind, which counts
the instructions executed, whatever else the machine does: the same process with one cycle
and with five, the difference over the 4,000 transfers of the four extra cycles (imports and
set-up cancel out). The cycles then skip the full collection each timed cycle starts with: it
walks every live object, torch's included, about half the count, and varies between
processes; the collector's own collections, which the transfers' allocations set off, stay
in, and every process gets the same hash seed. The way to see a change of a few percent on a
guest whose timings wander by tens of percent; about a minute a process.

With ``--bytecodes``, each contender instead counts the Python bytecodes it executes (a trace
function that sees every one: ``sys.settrace`` with ``f_trace_opcodes``), by phase (the
submits; the ``get_finished_jobs()`` rounds that hand every result out, each traced in a cycle
of its own after three untraced ones) and by function. It takes seconds, and varies by a few
bytecodes a transfer between runs (the poll schedule's share of state checks grows with the
time since the last poll); it leaves out the work done in C (dicts, allocations, NIXL's calls),
which ``--instructions`` counts. ``--by-function`` prints, for the last commit and for (b), where
each phase's bytecodes go.

    .venv/bin/python bench/by_commit.py 4c07c8c edee8a0 744a5af HEAD --rounds 8
    .venv/bin/python bench/by_commit.py 98bc95f HEAD --instructions
    .venv/bin/python bench/by_commit.py HEAD --bytecodes --by-function
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import add_commits, run_in_tree, worktrees

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
N, CYCLES = 1_000, 25

#: what every measuring process starts with: the contender's tier on the zero-cost agent, and
#: the jobs of a cycle
SETUP = """
sys.path.insert(0, {bench!r})
import torch
from zero_agent import ZeroAgent
import kvfsm
from kvfsm.tiers import ObjectStoreTier
from kvfsm.transfer import TransferJob
primary = torch.zeros(1024, 64, dtype=torch.uint8)
agent = ZeroAgent()
if {hand!r}:
    from handloop import HandTier
    tier = HandTier(primary, agent=agent)
else:
    assert kvfsm.__file__.startswith({tree!r}), kvfsm.__file__
    tier = ObjectStoreTier(primary, agent=agent)
jobs = [TransferJob(i, [f"k{{i}}"], [i % 1024]) for i in range({n})]
"""

ONE = """
import gc, json, statistics, sys, time
""" + SETUP + """samples = []
for cycle in range({cycles} + 1):
    agent.answer = "PROC"
    if {collect!r}:  # (timed: each cycle starts clean; counted: a full collection is noise)
        gc.collect()
    t0 = time.perf_counter()
    for job in jobs:
        tier.submit_store(job)
    t1 = time.perf_counter()
    agent.answer = "DONE"
    t2 = time.perf_counter()
    out = 0
    while out < {n}:
        out += len(tier.get_finished_jobs())
    t3 = time.perf_counter()
    if cycle:
        samples.append((t1 - t0 + t3 - t2) / {n})
print(json.dumps(statistics.median(samples) * 1e6 if samples else 0.0))
"""


BYTECODES = """
import collections, json, os, sys
""" + SETUP + """
def submit_all():
    agent.answer = "PROC"
    for job in jobs:
        tier.submit_store(job)

def finish_all():
    agent.answer = "DONE"
    out = 0
    while out < {n}:
        out += len(tier.get_finished_jobs())

for _ in range(3):  # untraced: the caches, the schedule's queues and the books at their size
    submit_all()
    finish_all()
counts = collections.Counter()
roots = (os.path.dirname(os.path.dirname(kvfsm.__file__)), {bench!r})

def where(code):
    path = code.co_filename
    for root in roots:
        if path.startswith(root + os.sep):
            path = os.path.relpath(path, os.path.dirname(root) if root == {bench!r} else root)
    return path + ":" + code.co_qualname

def tracer(frame, event, arg):
    frame.f_trace_opcodes = True
    if event == "opcode" and frame.f_code.co_name not in ("submit_all", "finish_all"):
        counts[phase, where(frame.f_code)] += 1
    return tracer

for phase in ("submit", "finish"):  # each traced in a cycle of its own, the other not: the
    # poll schedule's share grows with the time since the last poll, which tracing stretches
    for run in (submit_all, finish_all):
        if run.__name__.startswith(phase):
            sys.settrace(tracer)
        run()
        sys.settrace(None)
print(json.dumps([[phase, name, count / {n}] for (phase, name), count in counts.items()]))
"""
PHASES = ("submit", "finish")


def measure(tree: str, hand: bool) -> float:
    """One process: microseconds a transfer, the median of the cycles."""
    code = ONE.format(bench=str(BENCH), hand=hand, tree=tree, n=N, cycles=CYCLES, collect=True)
    return float(run_in_tree(tree, code, f"{tree} ({'hand' if hand else 'kvfsm'})", 600))


def instructions(tree: str, hand: bool) -> float:
    """Instructions a transfer, counted by callgrind: one process with one cycle, one with
    five; the difference over the four extra cycles' transfers."""
    # one hash seed for every process: str hashes (the job keys') set the dicts' and sets'
    # probing, which otherwise moves the count by a few percent between processes
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONHASHSEED": "0"}
    counts = []
    for cycles in (0, 4):
        code = ONE.format(bench=str(BENCH), hand=hand, tree=tree, n=N, cycles=cycles,
                          collect=False)
        done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                               sys.executable, "-c", code], env=env, cwd=tree,
                              capture_output=True, text=True, timeout=1800, check=True)
        found = re.search(r"Collected : (\d+)", done.stderr)
        if found is None:
            raise RuntimeError(f"callgrind printed no count: {done.stderr[-500:]}")
        counts.append(int(found.group(1)))
    return (counts[1] - counts[0]) / (4 * N)


def bytecodes(tree: str, hand: bool) -> dict[tuple[str, str], float]:
    """Bytecodes a transfer, by (phase, function): one traced cycle in a process of its own."""
    code = BYTECODES.format(bench=str(BENCH), hand=hand, tree=tree, n=N)
    counted = run_in_tree(tree, code, f"{tree} ({'hand' if hand else 'kvfsm'})", 600)
    return {(phase, name): count for phase, name, count in counted}


def by_phase(counts: dict[tuple[str, str], float]) -> dict[str, float]:
    return {phase: sum(c for (p, _), c in counts.items() if p == phase) for phase in PHASES}


def report_bytecodes(counted: dict[str, dict[tuple[str, str], float]], last: str,
                     by_function: bool) -> None:
    """The bytecodes a transfer of each contender, by phase; with ``by_function``, where the
    last commit's and (b)'s go (the functions with at least one a transfer)."""
    hand = by_phase(counted[HAND])
    total = sum(hand.values())
    print("\n| contender | submit | finish | bytecodes a transfer | against (b) |")
    print("|---|---:|---:|---:|---:|")
    for name, counts in counted.items():
        phases = by_phase(counts)
        print(f"| {name} | {phases['submit']:,.0f} | {phases['finish']:,.0f} | "
              f"{sum(phases.values()):,.0f} | {sum(phases.values()) / total:.2f}x |")
    if not by_function:
        return
    for name in (last, HAND):
        for phase in PHASES:
            rows = sorted(((c, fn) for (p, fn), c in counted[name].items()
                           if p == phase and c >= 1), reverse=True)
            print(f"\n{name}, {phase}: bytecodes a transfer by function\n")
            print("| function | bytecodes |")
            print("|---|---:|")
            for count, function in rows:
                print(f"| `{function}` | {count:,.1f} |")


HAND = "(b) hand-written"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_commits(parser)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions a transfer with callgrind (one round: "
                             "--rounds is not used)")
    parser.add_argument("--bytecodes", action="store_true",
                        help="count the Python bytecodes a transfer executes, by phase (one "
                             "round: --rounds is not used)")
    parser.add_argument("--by-function", action="store_true",
                        help="with --bytecodes: where the last commit's and (b)'s go")
    args = parser.parse_args()
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions needs valgrind (Debian package valgrind)")
    if args.by_function and not args.bytecodes:
        parser.error("--by-function goes with --bytecodes")
    if args.bytecodes:
        if args.instructions:
            parser.error("--bytecodes and --instructions count different things: one at a time")
        with worktrees(args.commits, "kvfsm-by-commit-") as trees:
            counted = {HAND: bytecodes(trees[args.commits[-1]], hand=True)}
            counted.update({commit: bytecodes(tree, hand=False)
                            for commit, tree in trees.items()})
        report_bytecodes(counted, args.commits[-1], args.by_function)
        return 0
    measure_one = instructions if args.instructions else measure
    rounds = 1 if args.instructions else args.rounds
    samples: dict[str, list[float]] = {HAND: []}
    samples.update({commit: [] for commit in args.commits})
    with worktrees(args.commits, "kvfsm-by-commit-") as trees:
        for round_ in range(rounds):
            samples[HAND].append(measure_one(trees[args.commits[-1]], hand=True))
            for commit, tree in trees.items():
                samples[commit].append(measure_one(tree, hand=False))
            print(f"round {round_ + 1} of {rounds}", flush=True)
    hand = min(samples[HAND])
    if args.instructions:
        print("\n| contender | instructions a transfer | against (b) |")
        print("|---|---:|---:|")
        for name, values in samples.items():
            print(f"| {name} | {values[0]:,.0f} | {values[0] / hand:.2f}x |")
        return 0
    print(f"\n| contender | us a transfer, min of {rounds} | median | against (b) |")
    print("|---|---:|---:|---:|")
    for name, values in samples.items():
        print(f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} | "
              f"{min(values) / hand:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
