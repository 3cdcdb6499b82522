"""``kvfsm demo``: store a torch KV cache, wipe it, load it back and verify every byte.

By default it runs on real NIXL with the file tier in a temporary directory, so it needs no
server; ``--s3-endpoint URL --bucket B`` runs the object-store tier against an S3 server, and
``--fake`` runs the object-store tier on :class:`kvfsm.testing.FakeNixlAgent`. Faults given with
``--inject-faults`` are injected into the agent's calls (the real agent through
:class:`kvfsm.testing.FaultyAgent`), so a user can watch transfers retry and still publish once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from kvfsm.lifecycle import TransferState
from kvfsm.testing import FakeNixlAgent, Fault, FaultyAgent, Raise, ReturnErr, StayProc
from kvfsm.tiers import DrainTimeout, FileTier, ObjectStoreTier, SecondaryTier
from kvfsm.trace import TraceRecorder
from kvfsm.transfer import JobResult, TransferJob

__all__ = ["FaultSpec", "add_arguments", "parse_fault_spec", "run"]

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options."""
    parser.add_argument("--blocks", type=int, default=256, help="blocks in the cache (256)")
    parser.add_argument("--block-kib", type=int, default=64, help="KiB per block (64)")
    parser.add_argument("--blocks-per-job", type=int, default=16, help="blocks per job (16)")
    where = parser.add_argument_group("where the blocks go (default: files in a temporary "
                                      "directory, through real NIXL)")
    where.add_argument("--dir", help="keep the block files in this directory")
    where.add_argument("--s3-endpoint", metavar="URL", help="an S3 server, e.g. "
                       "http://127.0.0.1:9000 (with --bucket)")
    where.add_argument("--bucket", help="the S3 bucket (with --s3-endpoint)")
    where.add_argument("--fake", action="store_true",
                       help="kvfsm's fake agent and an in-memory object store; no NIXL")
    parser.add_argument("--inject-faults", metavar="SPEC", default="",
                        help="CALL:raise|err|proc=N[@AT][*TIMES],... e.g. "
                             "release_xfer_handle:raise*3,check_xfer_state:err@2")
    parser.add_argument("--trace", metavar="FILE",
                        help="write every transfer's trace to FILE (JSON lines; "
                             "kvfsm replay FILE checks it against the lifecycle)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for all results of a phase (120)")
    parser.add_argument("--seed", type=int, default=0)


class _Progress:
    """A one-line progress bar on a terminal; silent elsewhere."""

    def __init__(self, total: int, label: str, stream: TextIO = sys.stderr) -> None:
        self.total, self.label, self.stream = total, label, stream
        self.enabled = stream.isatty() and total >= 64
        self.shown = -1

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * done // self.total
        if filled != self.shown:
            self.shown = filled
            self.stream.write(f"\r  {self.label:<5} [{'#' * filled}{'.' * (width - filled)}] "
                              f"{done}/{self.total}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 60 + "\r")
            self.stream.flush()


def _collect(tier: SecondaryTier, jobs: int, blocks: int, label: str,
             timeout: float) -> tuple[dict[int, JobResult], int]:
    """Poll until every job has a result; count duplicates (there must be none)."""
    results: dict[int, JobResult] = {}
    duplicates = 0
    progress = _Progress(blocks, label)
    try:
        deadline = time.monotonic() + timeout
        while len(results) < jobs:
            for result in tier.get_finished_jobs():
                duplicates += result.job_id in results
                results[result.job_id] = result
            progress.update(blocks * len(results) // jobs)
            if len(results) < jobs:
                if time.monotonic() > deadline:
                    raise DrainTimeout(f"{label} phase", tier.unpublished())
                time.sleep(tier.poll_interval)
    finally:
        progress.close()
    return results, duplicates


@contextlib.contextmanager
def _open_tier(args: argparse.Namespace, cache: torch.Tensor,
               faults: list[FaultSpec]) -> Iterator[tuple[SecondaryTier, str]]:
    """The tier the options ask for, and a line saying what it is."""
    agent: Any
    if args.fake:
        agent = FakeNixlAgent(name="kvfsm-demo")
        for fault in faults:
            agent.inject(fault.call, fault.fault, at=fault.at, times=fault.times)
        yield ObjectStoreTier(cache, agent=agent, key_prefix="demo/"), \
            "object-store tier on kvfsm's fake NIXL agent (in memory)"
        return

    from kvfsm.nixl_agents import StoreConfig, make_agent  # noqa: PLC0415 - NIXL is optional

    def faulty(agent: Any) -> Any:
        if not faults:
            return agent
        wrapped = FaultyAgent(agent)
        for fault in faults:
            wrapped.inject(fault.call, fault.fault, at=fault.at, times=fault.times)
        return wrapped

    if args.s3_endpoint:
        store = StoreConfig(args.bucket, endpoint=args.s3_endpoint,
                            access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
                            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
                            key_prefix="kvfsm-demo/")
        from kvfsm.nixl_agents import check_bucket  # noqa: PLC0415

        check_bucket(store)
        agent = faulty(make_agent("kvfsm-demo-obj", "OBJ", store.backend_params()))
        yield ObjectStoreTier(cache, agent=agent, key_prefix=store.key_prefix), \
            f"object-store tier on real NIXL (OBJ), bucket {args.bucket} at {args.s3_endpoint}"
        return

    with contextlib.ExitStack() as stack:
        root = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfsm-demo-"))
        agent = faulty(make_agent("kvfsm-demo-posix", "POSIX"))
        yield FileTier(cache, root, agent=agent, durable=False), \
            f"file tier on real NIXL (POSIX), files in {root}"


def run(args: argparse.Namespace) -> int:
    """Store every block, wipe the cache, load it back and verify every byte."""
    for name in ("blocks", "block_kib", "blocks_per_job"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if bool(args.s3_endpoint) != bool(args.bucket):
        raise ValueError("--s3-endpoint and --bucket go together")
    faults = parse_fault_spec(args.inject_faults)
    block_bytes = args.block_kib * 1024
    generator = torch.Generator().manual_seed(args.seed)
    cache = torch.randint(0, 256, (args.blocks, block_bytes), dtype=torch.uint8,
                          generator=generator)
    original = cache.clone()
    groups = [list(range(start, min(start + args.blocks_per_job, args.blocks)))
              for start in range(0, args.blocks, args.blocks_per_job)]

    with _open_tier(args, cache, faults) as (tier, what), contextlib.ExitStack() as traces:
        if args.trace:
            tier.on_published.append(traces.enter_context(TraceRecorder(args.trace)))
        print(f"kvfsm demo: {args.blocks} blocks x {args.block_kib} KiB "
              f"({args.blocks * block_bytes / 2**20:.1f} MiB) in {len(groups)} jobs per phase")
        print(f"  {what}")
        started = time.perf_counter()
        for job_id, blocks in enumerate(groups):
            tier.submit_store(TransferJob(job_id, [f"block-{b}" for b in blocks], blocks))
        stores, duplicates = _collect(tier, len(groups), args.blocks, "store", args.timeout)
        stored_in = time.perf_counter() - started

        cache.zero_()
        started = time.perf_counter()
        loads_of: dict[int, list[int]] = {}
        for job_id, blocks in enumerate(reversed(groups), start=len(groups)):
            loads_of[job_id] = blocks
            tier.submit_load(TransferJob(job_id, [f"block-{b}" for b in blocks], blocks,
                                         is_promotion=True))
        loads, more = _collect(tier, len(groups), args.blocks, "load", args.timeout)
        duplicates += more
        loaded_in = time.perf_counter() - started
        tier.shutdown(timeout=args.timeout)

    _report(tier, stores, loads, duplicates, stored_in, loaded_in)
    loaded = [b for job_id, blocks in loads_of.items() if loads[job_id].success for b in blocks]
    mismatched = [b for b in loaded if not torch.equal(cache[b], original[b])]
    print(f"verified {len(loaded)} of {args.blocks} blocks byte for byte, "
          f"{len(mismatched)} mismatched")
    if mismatched or duplicates:
        return 1
    if len(loaded) == args.blocks:
        print("every byte verified")
    else:
        print(f"{args.blocks - len(loaded)} block(s) not verified: their store or load "
              "published a failure (injected faults); every block that loaded matches")
    return 0


def _report(tier: SecondaryTier, stores: dict[int, JobResult], loads: dict[int, JobResult],
            duplicates: int, stored_in: float, loaded_in: float) -> None:
    counts = tier.driver.machine.transition_counts()
    entered = dict.fromkeys((s.name for s in TransferState), 0)
    entered[TransferState.SUBMITTED.name] = len(stores) + len(loads)
    for edge, count in counts.items():
        if not edge.is_loop:
            entered[edge.dest] += count
    print("\nstates entered:  " + ", ".join(f"{name} {n}" for name, n in entered.items()))
    print("transitions taken:")
    for edge, count in counts.items():
        if count:
            label = f"{edge.event} [{edge.guard_label}]" if edge.guard_label else edge.event
            print(f"  {edge.source:>13} --{label:<26}--> {edge.dest:<13} {count:>7}")
    stats = tier.stats()
    failed_stores = sum(not r.success for r in stores.values())
    failed_loads = sum(not r.success for r in loads.values())
    print(f"results: {len(stores)} stores ({failed_stores} failed), {len(loads)} loads "
          f"({failed_loads} failed), {duplicates} duplicated, 0 lost")
    print(f"retries: {stats['retries']} failed release(s) retried; "
          f"leaks: {stats['leaks']} cleanup call(s) failed")
    moved = sum(r.transfer_size for r in (*stores.values(), *loads.values()))
    print(f"moved {moved / 2**20:.1f} MiB: store {stored_in * 1e3:.1f} ms "
          f"({_rate(moved / 2, stored_in)}), load {loaded_in * 1e3:.1f} ms "
          f"({_rate(moved / 2, loaded_in)})")


def _rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / 2**20 / max(seconds, 1e-9):.0f} MiB/s"
