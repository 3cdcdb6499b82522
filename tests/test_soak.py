"""The soak: thousands of jobs on real NIXL against a local S3 server that is stopped and
restarted mid-run, with faults injected at random into every NIXL call, through the tiering
manager. At the end every job has exactly one result, every pin is 0, no handle was released
twice, and the figures are printed.

``KVFSM_SOAK_JOBS`` sets the number of store jobs (1500 by default, as CI runs it);
``KVFSM_SOAK_FAULT_RATE`` the chance that any one NIXL call fails (0.02).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter

import pytest
import torch

from kvfsm.nixl_agents import make_agent
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FaultyAgent
from kvfsm.tiering import CPUPrimaryTier, Finalized, TieringManager
from kvfsm.tiers import Lookup, ObjectStoreTier

from .real_nixl import S3Server, own_s3_server

__all__ = ["own_s3_server"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(600)]

JOBS = int(os.environ.get("KVFSM_SOAK_JOBS", "1500"))
FAULT_RATE = float(os.environ.get("KVFSM_SOAK_FAULT_RATE", "0.02"))
BLOCKS, BLOCK_BYTES = 64, 16 * 1024


class Tally:
    """Every job the manager finalized, how often, and how it ended."""

    def __init__(self) -> None:
        self.finalized: Counter[int] = Counter()
        self.outcomes: Counter[str] = Counter()

    def add(self, finalized: list[Finalized]) -> None:
        for done in finalized:
            self.finalized[done.job_id] += 1
            kind = "load" if done.job.is_promotion else "store"
            self.outcomes[f"{kind} {'ok' if done.success else 'failed'}"] += 1


def store_one(primary: CPUPrimaryTier, manager: TieringManager, key: str, value: int) -> bool:
    """Write a new block and cascade it out; False when every block is pinned or being written."""
    if not (primary.free_blocks or primary.evictable()):
        return False
    (block,) = primary.allocate([key])  # evicts the least recently used ready block
    primary.cache[block] = value
    primary.complete_write([block], True)
    manager.store([block])
    return True


def load_one(primary: CPUPrimaryTier, manager: TieringManager, key: str) -> bool:
    """Bring an evicted key back from the tier; False when it cannot be now."""
    room = primary.free_blocks or primary.evictable()
    if primary.block_of(key) is not None or not room or manager.lookup(key) is not Lookup.HIT:
        return False
    return manager.load([key]) is not None


def test_soak_real_nixl_server_restart_and_random_faults(own_s3_server: S3Server) -> None:
    bucket = own_s3_server.new_bucket()
    config = own_s3_server.config(bucket, io_threads=16)
    agent = FaultyAgent(make_agent("soak", "OBJ", config.backend_params(), 16))
    # every call fails now and then; a poll, made many times a transfer, ten times less often
    agent.chaos({**dict.fromkeys(("register_memory", "prep_xfer_dlist", "make_prepped_xfer",
                                  "transfer", "release_xfer_handle", "release_dlist_handle",
                                  "deregister_memory"), FAULT_RATE),
                 "check_xfer_state": FAULT_RATE / 10}, seed=20261129)
    prober = make_agent("soak-probe", "OBJ", config.backend_params())
    primary = CPUPrimaryTier(BLOCKS, BLOCK_BYTES, torch.uint8)
    tier = ObjectStoreTier(primary.cache, agent=agent, probe_agent=prober, key_prefix="soak/",
                           policy=RetryPolicy(max_seconds=120.0))
    manager = TieringManager(primary, [tier])
    rng = random.Random(7)
    tally = Tally()
    started = time.monotonic()
    restarted_at = None
    stored = loads = 0
    while stored < JOBS:
        if restarted_at is None and stored >= JOBS // 3:
            own_s3_server.stop()  # the server dies with requests in flight...
            time.sleep(0.5)
            own_s3_server.start()  # ...and comes back empty, on the same port
            own_s3_server.client().create_bucket(Bucket=bucket)
            restarted_at = stored
        stored += store_one(primary, manager, f"k{stored}", rng.randrange(256))
        if stored > 8 and rng.random() < 0.2:  # now and then, bring an evicted key back
            loads += load_one(primary, manager, f"k{rng.randrange(stored)}")
        tally.add(manager.step())
        time.sleep(0.0002)  # a scheduler step; the local S3 server shares the two cores
    tally.add(manager.drain(timeout=300))
    elapsed = time.monotonic() - started
    stats = tier.stats()
    manager.shutdown(timeout=60)

    figures = {
        "store jobs": JOBS, "load jobs": loads, "results": sum(tally.finalized.values()),
        **dict(tally.outcomes), "faults injected": sum(agent.faults.chaos_faults.values()),
        "release retries": stats["retries"], "leaks": stats["leaks"],
        "quarantined": stats["quarantined"], "server restarted after stores": restarted_at,
        "seconds": round(elapsed, 1),
    }
    print("\nsoak figures: " + ", ".join(f"{name}: {value}" for name, value in figures.items()))

    assert set(tally.finalized.values()) == {1}, "every job finalized exactly once"
    assert len(tally.finalized) == JOBS + loads
    assert all(primary.pin_count(b) == 0 for b in range(BLOCKS)
               if primary.key_of(b) is not None), "every pin back to 0"
    assert agent.misuses == [], "no handle released twice"
    assert manager.bookkeeping_errors == []
    assert not manager.has_pending_work()
    # (the share that fails grows with the state checks a transfer takes, each of which may
    # fail, so with how fast the machine and the local S3 server are: 401 of 1500 in one run,
    # 663-758 on a slower day; what is asserted is that stores go on succeeding, not a rate)
    assert tally.outcomes["store ok"] > JOBS // 3, "stores succeed despite the faults"
    assert tally.outcomes["store failed"] > 0, "the faults and the restart did bite"
