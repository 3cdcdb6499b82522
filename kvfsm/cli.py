"""The ``kvfsm`` command: ``kvfsm demo`` runs a store / wipe / load / verify round trip."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfsm.testing import FakeNixlAgent, Fault, Raise, ReturnErr, StayProc
from kvfsm.tiers import ObjectStoreTier
from kvfsm.transfer import JobResult, TransferJob

__all__ = ["FaultSpec", "main", "parse_fault_spec"]

_SPEC_ITEM = re.compile(
    r"^(?P<call>[a-z_]+):(?P<kind>raise|err|proc=(?P<polls>\d+))"
    r"(?:@(?P<at>\d+))?(?:\*(?P<times>\d+))?$")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """A fault to inject: ``call`` answers ``fault`` from its ``at``-th call on, ``times`` times."""

    call: str
    fault: Fault
    at: int | None
    times: int


def parse_fault_spec(spec: str) -> list[FaultSpec]:
    """Parse ``CALL:KIND[@AT][*TIMES],...``; KIND is ``raise``, ``err`` or ``proc=N``.

    ``release_xfer_handle:raise*3`` makes the next three releases raise;
    ``check_xfer_state:proc=5@2`` keeps the second poll's transfer running for five polls.
    """
    faults: list[FaultSpec] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        match = _SPEC_ITEM.match(item)
        if match is None:
            raise ValueError(f"bad fault {item!r}: expected CALL:raise|err|proc=N[@AT][*TIMES]")
        kind = match["kind"]
        fault: Fault
        if kind == "raise":
            fault = Raise()
        elif kind == "err":
            fault = ReturnErr()
        else:
            fault = StayProc(int(match["polls"]))
        at = int(match["at"]) if match["at"] else None
        times = int(match["times"]) if match["times"] else 1
        if at == 0 or times == 0:
            raise ValueError(f"bad fault {item!r}: @AT and *TIMES count from 1")
        faults.append(FaultSpec(match["call"], fault, at, times))
    return faults


def _collect(tier: ObjectStoreTier, expected: int, results: dict[int, JobResult]) -> int:
    """Poll until ``expected`` results arrived; count duplicates (there must be none)."""
    duplicates = 0
    while len(results) < expected:
        for result in tier.get_finished_jobs():
            if result.job_id in results:
                duplicates += 1
            results[result.job_id] = result
        if len(results) < expected:
            time.sleep(tier.poll_interval)
    return duplicates


def run_demo(args: argparse.Namespace) -> int:
    """Store every block, wipe the cache, load it back and verify every byte."""
    agent = FakeNixlAgent(name="kvfsm-demo", complete_after_polls=args.polls)
    for fault in parse_fault_spec(args.inject_faults or ""):
        agent.inject(fault.call, fault.fault, at=fault.at, times=fault.times)
    block_bytes = args.block_kib * 1024
    generator = torch.Generator().manual_seed(args.seed)
    cache = torch.randint(0, 256, (args.blocks, block_bytes), dtype=torch.uint8,
                          generator=generator)
    original = cache.clone()
    tier = ObjectStoreTier(cache, agent=agent, key_prefix="demo/")
    per_job = args.blocks_per_job
    groups = [list(range(start, min(start + per_job, args.blocks)))
              for start in range(0, args.blocks, per_job)]

    print(f"kvfsm demo: {args.blocks} blocks x {args.block_kib} KiB "
          f"({args.blocks * block_bytes / 2**20:.1f} MiB) in {len(groups)} jobs, "
          f"agent {type(agent).__name__}")
    started = time.perf_counter()
    stores: dict[int, JobResult] = {}
    for job_id, blocks in enumerate(groups):
        tier.submit_store(TransferJob(job_id, [f"block-{b}" for b in blocks], blocks))
    duplicates = _collect(tier, len(groups), stores)
    stored_in = time.perf_counter() - started

    cache.zero_()
    started = time.perf_counter()
    loads: dict[int, JobResult] = {}
    load_ids = {}
    for job_id, blocks in enumerate(reversed(groups), start=len(groups)):
        load_ids[job_id] = blocks
        tier.submit_load(TransferJob(job_id, [f"block-{b}" for b in blocks], blocks,
                                     is_promotion=True))
    duplicates += _collect(tier, len(groups), loads)
    loaded_in = time.perf_counter() - started
    tier.shutdown()
    agent.close()

    loaded_blocks = [b for job_id, blocks in load_ids.items() if loads[job_id].success
                     for b in blocks]
    mismatched = [b for b in loaded_blocks if not torch.equal(cache[b], original[b])]
    failed_stores = sum(not r.success for r in stores.values())
    failed_loads = sum(not r.success for r in loads.values())
    moved = sum(r.transfer_size for r in (*stores.values(), *loads.values()))

    print("\ntransitions taken:")
    for edge, count in tier.driver.machine.transition_counts().items():
        if count:
            label = f"{edge.event} [{edge.guard_label}]" if edge.guard_label else edge.event
            print(f"  {edge.source:>13} --{label:<26}--> {edge.dest:<13} {count:>7}")
    print(f"\nresults: {len(stores)} stores ({failed_stores} failed), {len(loads)} loads "
          f"({failed_loads} failed), {duplicates} duplicated, "
          f"{2 * len(groups) - len(stores) - len(loads)} lost")
    stats = tier.stats()
    print(f"retries: {stats['retries']} failed release(s) retried; "
          f"leaks: {stats['leaks']} cleanup call(s) failed")
    print(f"moved {moved / 2**20:.1f} MiB: store {stored_in * 1e3:.1f} ms, "
          f"load {loaded_in * 1e3:.1f} ms "
          f"({moved / 2**20 / max(stored_in + loaded_in, 1e-9):.0f} MiB/s)")
    print(f"verified {len(loaded_blocks)} of {args.blocks} blocks byte for byte, "
          f"{len(mismatched)} mismatched")
    failed_load_blocks = sum(len(load_ids[j]) for j, r in loads.items() if not r.success)
    ok = not mismatched and duplicates == 0 and (
        len(loaded_blocks) + failed_load_blocks == args.blocks)
    if ok and len(loaded_blocks) == args.blocks:
        print("every byte verified")
    elif ok:
        print(f"{failed_load_blocks} block(s) not verified: their store or load published a "
              "failure (injected faults); every block that loaded matches")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``kvfsm`` argument parser."""
    parser = argparse.ArgumentParser(prog="kvfsm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="store, wipe, load and verify a KV cache")
    demo.add_argument("--blocks", type=int, default=256, help="blocks in the cache (256)")
    demo.add_argument("--block-kib", type=int, default=64, help="KiB per block (64)")
    demo.add_argument("--blocks-per-job", type=int, default=16, help="blocks per job (16)")
    demo.add_argument("--polls", type=int, default=1,
                      help="polls until the fake agent completes a transfer (1)")
    demo.add_argument("--inject-faults", metavar="SPEC",
                      help="CALL:raise|err|proc=N[@AT][*TIMES],... e.g. "
                           "release_xfer_handle:raise*3")
    demo.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvfsm`` command."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        for name in ("blocks", "block_kib", "blocks_per_job"):
            if getattr(args, name) < 1:
                print(f"kvfsm demo: --{name.replace('_', '-')} must be at least 1",
                      file=sys.stderr)
                return 2
        try:
            return run_demo(args)
        except ValueError as error:
            print(f"kvfsm demo: {error}", file=sys.stderr)
            return 2
    return 2
