"""Taking a finish as one chain changes nothing but the cost: the same NIXL calls, results and
steps as firing each step on its own, under random faults."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvfsm import TransferJob
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent
from kvfsm.tiers import ObjectStoreTier
from kvfsm.trace import trace_steps


def run(seed: int, *, chained: bool) -> dict[str, Any]:
    """Stores, then loads of half of them, under chaos; everything that can be observed."""
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(torch.arange(64 * 8, dtype=torch.float32).view(64, 8), agent=agent,
                           policy=RetryPolicy(max_attempts=2, max_seconds=None))
    agent.faults.chaos(0.12, seed=seed)  # the transfers' calls fail at random from here
    if not chained:  # the same tier with its chains taken away: every step fired on its own
        tier._runner._ending.clear()
    steps: dict[int, list[tuple[str, ...]]] = {}

    def keep_steps(transfer: Any) -> None:
        steps[transfer.job_id] = [tuple(map(str, row[:4])) for row in trace_steps(transfer)]

    tier.on_published.append(keep_steps)
    rounds: list[list[tuple[int, bool]]] = []

    def poll() -> None:
        rounds.append(sorted((r.job_id, r.success) for r in tier.get_finished_jobs()))

    for job_id in range(24):
        tier.submit_store(TransferJob(job_id, [f"k{job_id}"], [job_id]))
        if job_id % 5 == 4:
            poll()
    for job_id in range(24, 36):
        tier.submit_load(TransferJob(job_id, [f"k{job_id - 24}"], [job_id],
                                     is_promotion=True))
    for _ in range(50):
        if not tier.has_pending_work():
            break
        poll()
    assert not tier.has_pending_work(), f"seed {seed}: still {tier.unpublished()}"
    stats = tier.stats()
    tier.shutdown()
    counts = {(e.source, e.event, e.dest, e.guard_label): n
              for e, n in tier.machine.transition_counts().items()}
    return {"calls": list(agent.calls), "rounds": rounds, "steps": steps, "counts": counts,
            "misuses": list(agent.misuses), "retries": stats["retries"],
            "leaks": stats["leaked"], "quarantined": stats["quarantined"]}


@pytest.mark.parametrize("seed", range(40))
def test_chains_make_the_same_calls_and_publish_the_same_results_as_single_steps(
    seed: int,
) -> None:
    chained, single = run(seed, chained=True), run(seed, chained=False)
    assert chained == single
    assert chained["misuses"] == []


def test_the_runs_compared_do_take_chains_and_do_meet_faults() -> None:
    """The comparison above is not vacuous: chains run, and faults land on the finish calls."""
    observed = [run(seed, chained=True) for seed in range(40)]
    finishes = sum(o["counts"][("CLEANED", "publish", "PUBLISHED", "")] for o in observed)
    assert finishes > 40 * 30
    assert sum(len(o["leaks"]) for o in observed) > 0
    assert sum(o["retries"] for o in observed) > 0
    assert any(o["quarantined"] for o in observed)
