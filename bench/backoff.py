"""Releases backing off: what a scheduler step costs while N transfers wait out the backoff of
a release that raised, commit by commit.

For each commit named, a git worktree of it (as ``bench/by_commit.py`` makes them) is put first
on ``PYTHONPATH`` and one process measures its ``ObjectStoreTier`` on the fake NIXL agent
(``kvfsm.testing.FakeNixlAgent``: a release that raises is a fault only the fake can inject on
demand), with ``RetryPolicy(backoff=60, max_backoff=60)`` and no bound on the tries: N one-block
stores are submitted, NIXL finishes each, its release raises, and each waits a minute for its
next try. Then, on the caller's thread, ``get_finished_jobs()`` is called back to back (the
tries are a minute away: no release is due in the window): the time each step took (median,
p99, max) and how many release calls the steps made (none is due: 0).

Every contender runs once a round, the rounds repeat, and each figure is the median over the
rounds.

    .venv/bin/python bench/backoff.py 7703073 HEAD
    .venv/bin/python bench/backoff.py 7703073 HEAD --quick
"""

from __future__ import annotations

import sys
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

ONE = """
import gc, json, statistics, time
import torch
import kvfsm
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, Raise
from kvfsm.tiers import ObjectStoreTier
from kvfsm.transfer import TransferJob
assert kvfsm.__file__.startswith({tree!r}), kvfsm.__file__

stores, steps_wanted = {stores}, {steps}
agent = FakeNixlAgent()
agent.inject("release_xfer_handle", Raise("NIXL_ERR_BACKEND"), times=10**9)
primary = torch.zeros((stores, 16), dtype=torch.float32)
tier = ObjectStoreTier(primary, agent=agent, policy=RetryPolicy(
    max_attempts=None, max_seconds=None, backoff=60, max_backoff=60))
for job in range(stores):
    tier.submit_store(TransferJob(job, ["block-" + str(job)], [job]))
while agent.call_count("release_xfer_handle") < stores:  # each release raised once
    assert tier.get_finished_jobs() == []
releases = agent.call_count("release_xfer_handle")
gc.collect()
steps = []
for _ in range(steps_wanted):
    started = time.perf_counter()
    out = tier.get_finished_jobs()
    steps.append(time.perf_counter() - started)
    assert out == []
made = agent.call_count("release_xfer_handle") - releases
agent.clear_faults()
tier.shutdown(timeout=30)  # the last try of each release, now answering
steps.sort()
print(json.dumps({{"step_ms": statistics.median(steps) * 1e3,
                  "step_p99_ms": steps[int(0.99 * len(steps))] * 1e3,
                  "step_max_ms": steps[-1] * 1e3, "releases": made}}))
"""


def measure(tree: str, stores: int, steps: int) -> dict[str, float]:
    """One process of ``tree``'s kvfsm with ``stores`` releases backing off."""
    code = ONE.format(tree=tree, stores=stores, steps=steps)
    figures: dict[str, float] = run_in_tree(tree, code, f"{tree} with {stores} stores")
    return figures


def main() -> int:
    parser = commits_parser(__doc__, [1_000, 10_000, 100_000], "stores whose release backs off",
                            "1,000 stores, one round")
    parser.add_argument("--steps", type=int, default=500, help="steps measured a process")
    args = parser.parse_args()
    stores, rounds = ([1_000], 1) if args.quick else (args.stores, args.rounds)
    info = machine()
    print_machine(info)
    samples = rounds_by_commit(args.commits, "kvfsm-backoff-trees-", stores, rounds,
                               lambda tree, n: measure(tree, n, args.steps))
    mid = median_of

    rows: list[list[Any]] = []
    for (commit, n), runs in samples.items():
        rows.append([commit, f"{n:,}", f"{mid(runs, 'step_ms'):.4f}",
                     f"{mid(runs, 'step_p99_ms'):.4f}", f"{mid(runs, 'step_max_ms'):.3f}",
                     f"{mid(runs, 'releases'):.0f}"])
    out = table(["kvfsm", "releases backing off", "step ms", "p99", "max",
                 "release calls in the steps"], rows,
                title=f"A step with releases backing off (a minute each): ObjectStoreTier on "
                      f"the fake agent, {args.steps} steps back to back (medians of {rounds} "
                      f"round(s))")
    print(out)
    write_by_commit("backoff-quick" if args.quick else "backoff", out, samples, machine=info,
                    commits=args.commits, rounds=rounds, steps=args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
