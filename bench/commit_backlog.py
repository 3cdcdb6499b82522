"""A durable file tier whose disk falls behind its stores: what a scheduler step costs with
stores waiting on their flush, commit by commit.

For each commit named, a git worktree of it (as ``bench/by_commit.py`` makes them) is put first
on ``PYTHONPATH`` and one process measures its ``FileTier`` (durable, the default) on real NIXL's
POSIX backend, in ``/dev/shm``: N one-block stores of 4 KiB are submitted, NIXL finishes them,
and each waits on its flush, which is held (``os.fsync`` on the flusher's thread waits until the
process lets it go: a disk that fell behind). Then, on the caller's thread:

* **a step with the backlog**: ``get_finished_jobs()`` every 1 ms for 1.5 s, past
  ``max_unpolled`` (1 s), so that the sweep's first turn of the N stores, still waiting on their
  flush, falls in the window: the time each step took (median, p99, max) and the
  ``check_xfer_state`` calls it made (median, max);
* **the flushes over**: the fsyncs are let go, and ``get_finished_jobs()`` is called every 1 ms
  until every result is out: how long from the release, and how many polls.

The default ``RetryPolicy`` in both (``max_unpolled`` 1 s: the sweep's share is about N / 1,000
checks a poll here, and the turns of stores that started running together come due together).
A full collection of the garbage collector runs before the window (the collector stays on
within it, as in an engine). Every contender runs once a round, the rounds repeat, and each
figure is the median over the rounds.

    .venv/bin/python bench/commit_backlog.py e1dc3ae HEAD
    .venv/bin/python bench/commit_backlog.py e1dc3ae HEAD --quick
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import (
    commits_parser,
    machine,
    median_of,
    print_machine,
    rounds_by_commit,
    run_in_tree,
    table,
    write_by_commit,
)

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
#: where the files go: a tmpfs, so that the disk held is the only slow one
FILES_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None

ONE = """
import gc, json, os, statistics, sys, threading, time
import torch
import kvfsm
from kvfsm.nixl_agents import make_agent
from kvfsm.tiers import FileTier
from kvfsm.transfer import TransferJob
assert kvfsm.__file__.startswith({tree!r}), kvfsm.__file__

caller, gate, real_fsync = threading.get_ident(), threading.Event(), os.fsync
def fsync(fd):  # the flusher's waits until the disk "catches up"
    if threading.get_ident() != caller:
        gate.wait()
    real_fsync(fd)
os.fsync = fsync

class Counting:
    \"\"\"The real agent, its state checks counted.\"\"\"
    def __init__(self, agent):
        self.wrapped, self.checks = agent, 0
    def check_xfer_state(self, handle):
        self.checks += 1
        return self.wrapped.check_xfer_state(handle)
    def __getattr__(self, name):
        return getattr(self.wrapped, name)

stores = {stores}
agent = Counting(make_agent("backlog-" + str(os.getpid()), "POSIX"))
cache = torch.randint(0, 256, (stores, 4096), dtype=torch.uint8)
tier = FileTier(cache, {directory!r}, agent=agent)
for job in range(stores):
    tier.submit_store(TransferJob(job, ["block-" + str(job)], [job]))
deadline = time.monotonic() + 120
while len(tier._runner._committing) < stores:  # NIXL finishes each; its flush is held
    assert time.monotonic() < deadline, "the stores never all waited on their flush"
    assert tier.get_finished_jobs() == []
    time.sleep(0.001)
steps, checks = [], []
gc.collect()
window = time.monotonic() + 1.5
while time.monotonic() < window:
    time.sleep(0.001)
    before = agent.checks
    started = time.perf_counter()
    out = tier.get_finished_jobs()
    steps.append(time.perf_counter() - started)
    checks.append(agent.checks - before)
    assert out == []
time.sleep(0.001)
gate.set()
released, polls, published = time.perf_counter(), 0, 0
while published < stores:
    polls += 1
    results = tier.get_finished_jobs()
    assert all(result.success for result in results)
    published += len(results)
    if published < stores:
        time.sleep(0.001)
over = time.perf_counter() - released
tier.shutdown(timeout=30)
steps.sort()
print(json.dumps({{"step_ms": statistics.median(steps) * 1e3,
                  "step_p99_ms": steps[int(0.99 * len(steps))] * 1e3,
                  "step_max_ms": steps[-1] * 1e3, "steps": len(steps),
                  "checks": statistics.median(checks), "checks_max": max(checks),
                  "over_ms": over * 1e3, "polls": polls}}))
"""


def measure(tree: str, stores: int) -> dict[str, float]:
    """One process of ``tree``'s kvfsm with ``stores`` stores waiting on their flush."""
    with tempfile.TemporaryDirectory(prefix="kvfsm-backlog-", dir=FILES_DIR) as directory:
        code = ONE.format(tree=tree, stores=stores, directory=directory)
        figures: dict[str, float] = run_in_tree(tree, code, f"{tree} with {stores} stores")
    return figures


def main() -> int:
    parser = commits_parser(__doc__, [1_000, 5_000],
                            "stores waiting on their flush (two descriptors each)",
                            "300 stores, one round")
    args = parser.parse_args()
    stores, rounds = ([300], 1) if args.quick else (args.stores, args.rounds)
    info = machine()
    print_machine(info)
    samples = rounds_by_commit(args.commits, "kvfsm-backlog-trees-", stores, rounds, measure)
    mid = median_of

    rows: list[list[Any]] = []
    for (commit, n), runs in samples.items():
        rows.append([commit, f"{n:,}", f"{mid(runs, 'steps'):,.0f}",
                     f"{mid(runs, 'step_ms'):.3f}", f"{mid(runs, 'step_p99_ms'):.3f}",
                     f"{mid(runs, 'step_max_ms'):.3f}", f"{mid(runs, 'checks'):,.0f}",
                     f"{mid(runs, 'checks_max'):,.0f}",
                     f"{mid(runs, 'over_ms'):.1f}", f"{mid(runs, 'polls'):.0f}"])
    out = table(["kvfsm", "stores waiting on their flush", "steps in 1.5 s", "step ms",
                 "p99", "max", "state checks a step", "max", "flushes over: all out ms",
                 "polls"], rows,
                title=f"A step of a durable file tier with its flushes held: one-block stores "
                      f"of 4 KiB on real NIXL POSIX (medians of {rounds} round(s))")
    print(out)
    write_by_commit("commit_backlog-quick" if args.quick else "commit_backlog", out, samples,
                    machine=info, commits=args.commits, rounds=rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
