"""A load's blocks in a full primary cache: what ``CPUPrimaryTier.allocate`` costs against the
blocks the cache holds, commit by commit.

For each commit named, a git worktree of it (as ``bench/by_commit.py`` makes them) is put first
on ``PYTHONPATH`` and one process fills a ``CPUPrimaryTier`` of N blocks with ready blocks (all
but 64 of them), as a serving engine's cache is once it has run a while. Then one block is
allocated and its write completed, again and again, as a load's blocks are: the first 64 take
free blocks, the rest evict the least recently used. It reports the time an allocate and its
write took (median, p99), and the ratio to the first commit's at the same N.

Every contender runs once a round, the rounds repeat, and each figure is the median over the
rounds.

    .venv/bin/python bench/primary_allocate.py e66999e HEAD
    .venv/bin/python bench/primary_allocate.py e66999e HEAD --quick
"""

from __future__ import annotations

import sys
from typing import Any

from common import (
    commits_parser,
    machine,
    median_of,
    print_machine,
    ratio,
    rounds_by_commit,
    run_in_tree,
    table,
    write_by_commit,
)

ONE = """
import gc, json, statistics, time
import torch
import kvfsm
from kvfsm.tiering import CPUPrimaryTier
assert kvfsm.__file__.startswith({tree!r}), kvfsm.__file__

blocks, allocates = {blocks}, {allocates}
primary = CPUPrimaryTier(blocks, 16, torch.uint8, pin_memory=False)
held = primary.allocate(["held-" + str(i) for i in range(blocks - 64)])
primary.complete_write(held, success=True)
gc.collect()
took = []
for i in range(allocates):
    started = time.perf_counter()
    (block,) = primary.allocate(["new-" + str(i)])
    primary.complete_write([block], success=True)
    took.append(time.perf_counter() - started)
assert primary.evictions == allocates - 64, primary.evictions
took.sort()
print(json.dumps({{"us": statistics.median(took) * 1e6,
                  "p99_us": took[int(0.99 * len(took))] * 1e6}}))
"""


def measure(tree: str, blocks: int, allocates: int) -> dict[str, float]:
    """One process of ``tree``'s kvfsm with a cache of ``blocks`` blocks."""
    code = ONE.format(tree=tree, blocks=blocks, allocates=allocates)
    figures: dict[str, float] = run_in_tree(tree, code, f"{tree} with {blocks} blocks")
    return figures


def main() -> int:
    parser = commits_parser(__doc__, [1_000, 10_000, 100_000], "blocks in the primary cache",
                            "1,000 and 10,000 blocks, one round")
    parser.add_argument("--allocates", type=int, default=1_000,
                        help="allocates measured a process")
    args = parser.parse_args()
    sizes, rounds = ([1_000, 10_000], 1) if args.quick else (args.stores, args.rounds)
    info = machine()
    print_machine(info)
    samples = rounds_by_commit(args.commits, "kvfsm-allocate-trees-", sizes, rounds,
                               lambda tree, n: measure(tree, n, args.allocates))
    mid = median_of

    rows: list[list[Any]] = []
    for (commit, n), runs in samples.items():
        first = samples[(args.commits[0], n)]
        rows.append([commit, f"{n:,}", f"{mid(runs, 'us'):.1f}", f"{mid(runs, 'p99_us'):.1f}",
                     ratio(mid(runs, "us"), mid(first, "us"))])
    out = table(["kvfsm", "blocks cached", "allocate + write us", "p99",
                 f"against {args.commits[0]}"], rows,
                title=f"One block allocated and written in a full CPUPrimaryTier, "
                      f"{args.allocates} times (medians of {rounds} round(s))")
    print(out)
    write_by_commit("primary_allocate-quick" if args.quick else "primary_allocate", out,
                    samples, machine=info, commits=args.commits, rounds=rounds,
                    allocates=args.allocates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
