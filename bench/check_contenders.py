"""Check that the contenders behave like kvfsm before timing them.

Each contender runs the same small store-then-load workload on kvfsm's fake NIXL agent (which
moves real bytes and flags misuse), once clean and once for every fault in a list: each NIXL call
raising at its first, second or third call, status calls answering ERR, releases raising several
times in a row, transfers running longer. For every scenario the contenders must publish the
same results (job, success, bytes) in the same poll rounds, count the same release retries and
leaks, make the same NIXL calls, answer lookups alike, and leave behind only what a recorded
leak says was left. Run it alone: ``.venv/bin/python bench/check_contenders.py``.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from handloop import HandTier
from transitions_tier import TransitionsTier

from kvfsm.testing import FakeNixlAgent, Fault, Raise, ReturnErr, StayProc
from kvfsm.tiers import ObjectStoreTier, SecondaryTier
from kvfsm.transfer import TransferJob

BLOCKS, JOBS, PER_JOB = 8, 4, 2

CONTENDERS: dict[str, Callable[[torch.Tensor, Any], Any]] = {
    "kvfsm": lambda cache, agent: ObjectStoreTier(cache, agent=agent, key_prefix="kv/"),
    "hand-written": lambda cache, agent: HandTier(cache, agent=agent, key_prefix="kv/"),
    "transitions per transfer": lambda cache, agent: TransitionsTier(
        cache, agent=agent, mode="per_transfer", key_prefix="kv/"),
    "transitions add_model": lambda cache, agent: TransitionsTier(
        cache, agent=agent, mode="shared", key_prefix="kv/"),
}


def scenarios() -> list[tuple[str, list[tuple[str, Fault, int | None, int]]]]:
    """(name, [(call, fault, at, times)]) for every scenario."""
    found: list[tuple[str, list[tuple[str, Fault, int | None, int]]]] = [("clean", [])]
    for call in ("register_memory", "prep_xfer_dlist", "make_prepped_xfer", "transfer",
                 "check_xfer_state", "release_xfer_handle", "release_dlist_handle",
                 "deregister_memory"):
        for at in (1, 2, 3):
            found.append((f"{call} raises at call {at}", [(call, Raise(), at, 1)]))
    for call in ("transfer", "check_xfer_state"):
        for at in (1, 3):
            found.append((f"{call} answers ERR at call {at}", [(call, ReturnErr(), at, 1)]))
    found.append(("release raises 3 times", [("release_xfer_handle", Raise(), None, 3)]))
    found.append(("release raises, then cleanup leaks",
                  [("release_xfer_handle", Raise(), 2, 2), ("deregister_memory", Raise(), 1, 2)]))
    found.append(("a transfer runs 3 polls longer", [("check_xfer_state", StayProc(3), 2, 1)]))
    found.append(("state check raises and first release raises",
                  [("check_xfer_state", Raise(), 1, 1), ("release_xfer_handle", Raise(), 1, 1)]))
    return found


def run(make: Callable[[torch.Tensor, Any], Any],
        faults: list[tuple[str, Fault, int | None, int]]) -> dict[str, Any]:
    """Store every block, then load it back; what was published, round by round."""
    cache = torch.arange(BLOCKS * 64, dtype=torch.int32).reshape(BLOCKS, 64).clone()
    agent = FakeNixlAgent("bench-check", complete_after_polls=1)
    tier = make(cache, agent)
    for call, fault, at, times in faults:  # numbered from the first call after construction
        agent.inject(call, fault, times=times,
                     at=None if at is None else agent.call_count(call) + at)
    rounds: list[list[tuple[int, bool, int]]] = []
    for load in (False, True):
        for index in range(JOBS):
            blocks = list(range(index * PER_JOB, index * PER_JOB + PER_JOB))
            job = TransferJob(index + JOBS * load, [f"b{b}" for b in blocks], blocks,
                              is_promotion=load)
            (tier.submit_load if load else tier.submit_store)(job)
        published = 0
        for _ in range(20):
            results = sorted((r.job_id, r.success, r.transfer_size)
                             for r in tier.get_finished_jobs())
            rounds.append(results)
            published += len(results)
            if published == JOBS:
                break
    lookups = [tier.lookup(f"b{b}").name for b in range(BLOCKS)]
    tier.shutdown()
    if isinstance(tier, SecondaryTier):  # kvfsm: what its stats say
        stats = tier.stats()
        retries, leaked = stats["retries"], stats["leaked"]
    else:  # a hand-written loop keeps its own tallies
        retries, leaked = tier._retries, tier._leaks
    return {
        "rounds": rounds,
        "retries": retries,
        "leaks": sorted((job, leak.call) for job, leak in leaked),
        "calls": Counter(c for c in agent.calls if c != "query_memory"),
        "lookups": lookups,
        "misuses": list(agent.misuses),
        "left": (agent.live_xfer_handles(), agent.live_dlist_handles(),
                 agent.live_registrations(), agent.running_transfers()),
    }


def main() -> int:
    logging.getLogger("kvfsm").setLevel(logging.ERROR)  # its failure lines are expected here
    failures = 0
    checked = scenarios()
    for name, faults in checked:
        outcomes = {contender: run(make, faults) for contender, make in CONTENDERS.items()}
        reference = outcomes["kvfsm"]
        if reference["misuses"] or (reference["left"] != (0, 0, 0, 0) and not reference["leaks"]):
            print(f"{name}: kvfsm misused NIXL or left something without a leak: "
                  f"{reference['misuses']} {reference['left']}")
            failures += 1
        for contender, outcome in outcomes.items():
            differs = [key for key in reference if outcome[key] != reference[key]]
            if differs:
                failures += 1
                print(f"{name}: {contender} differs from kvfsm in {', '.join(differs)}")
                for key in differs:
                    print(f"    kvfsm:      {reference[key]}\n    {contender}: {outcome[key]}")
    print(f"{len(checked)} scenarios x {len(CONTENDERS)} contenders: "
          f"{'all behave like kvfsm' if not failures else f'{failures} difference(s)'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
