"""The full lifecycle, commit by commit: where a rise against the hand-written loop came from.

For each commit named, a git worktree of it (in a temporary directory, removed at the end) is
put first on ``PYTHONPATH``, and one process measures its ``ObjectStoreTier`` on the zero-cost
agent of this tree: 1,000 one-block stores per cycle (submit with NIXL answering PROC, then
DONE and one ``get_finished_jobs()`` round), the median of 25 cycles per transfer. The
hand-written loop (b) of this tree runs beside them. Every contender runs once a round, the
rounds repeat, and each keeps its minimum (the guest's noise between rounds is large).

    .venv/bin/python bench/by_commit.py 4c07c8c edee8a0 744a5af HEAD --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
N, CYCLES = 1_000, 25

ONE = """
import gc, json, statistics, sys, time
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
samples = []
for cycle in range({cycles} + 1):
    agent.answer = "PROC"
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
print(json.dumps(statistics.median(samples) * 1e6))
"""


def measure(tree: str, hand: bool) -> float:
    """One process: microseconds a transfer, the median of the cycles."""
    code = ONE.format(bench=str(BENCH), hand=hand, tree=tree, n=N, cycles=CYCLES)
    env = {**os.environ, "PYTHONPATH": tree}
    # run in the tree: "-c" puts the working directory first on the path, before PYTHONPATH
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree,
                          capture_output=True, text=True, timeout=600, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("commits", nargs="+", help="commits, oldest first")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvfsm-by-commit-") as scratch:
        trees: dict[str, str] = {}
        try:
            for commit in args.commits:
                tree = os.path.join(scratch, commit.replace("/", "-"))
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach",
                                tree, commit], check=True)
                trees[commit] = tree
            samples: dict[str, list[float]] = {"(b) hand-written": []}
            samples.update({commit: [] for commit in args.commits})
            for round_ in range(args.rounds):
                samples["(b) hand-written"].append(measure(trees[args.commits[-1]], hand=True))
                for commit, tree in trees.items():
                    samples[commit].append(measure(tree, hand=False))
                print(f"round {round_ + 1} of {args.rounds}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tree],
                               check=False)
    hand = min(samples["(b) hand-written"])
    print(f"\n| contender | us a transfer, min of {args.rounds} | median | against (b) |")
    print("|---|---:|---:|---:|")
    for name, values in samples.items():
        print(f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} | "
              f"{min(values) / hand:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
