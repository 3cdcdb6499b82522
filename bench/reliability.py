"""Attacks kept as benchmarks: each prints what it measured, for docs/operations.md.

    python bench/reliability.py threads [--agent fake|posix] [--jobs N]
        8 submitter threads, a poller and a lookup/stats thread on one tier, 2 % of NIXL calls
        failing at random: every job must publish exactly once; the worst latency of each call.
    python bench/reliability.py memory [--jobs N] [--leak-rate R]
        a long run on one tier (fake agent, 1 % faults, a new key every job): RSS, the lookup
        cache and the leak record sampled as it goes; they must stay flat.
    python bench/reliability.py frozen
        an object store that stops answering (SIGSTOP) on real NIXL, with lookups pending and
        stores in flight: how long each call of the contract takes.
    python bench/reliability.py durable [--blocks N]
        a file tier on real POSIX storing N one-block jobs, durable or not: the longest poll.

Nothing here asserts a speed; the tests assert the behaviour (tests/test_bounds.py,
tests/test_frozen_store.py, tests/test_file_tier.py).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import random
import resource
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

from bench.common import machine, print_machine, table
from kvfsm import TransferJob
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, FaultyAgent
from kvfsm.tiers import DrainTimeout, FileTier, ObjectStoreTier, SecondaryTier


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 2**20


class Worst:
    """The longest and the 99th percentile of a call's durations, in milliseconds."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.lock = threading.Lock()

    def time(self, call: Any, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args)
        finally:
            elapsed = time.perf_counter() - started
            with self.lock:
                self.samples.append(elapsed)

    def row(self, name: str) -> list[object]:
        ordered = sorted(self.samples) or [0.0]
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return [name, len(self.samples), f"{p99 * 1e3:.3f}", f"{ordered[-1] * 1e3:.3f}"]


# -- threads -------------------------------------------------------------------------------------

def attack_threads(kind: str, jobs: int) -> None:  # noqa: PLR0915 - one scenario, in order
    blocks, block_bytes = 256, 4096
    cache = torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8)
    tier: SecondaryTier
    directory = None
    if kind == "fake":
        agent: Any = FakeNixlAgent(name="attack")
        agent.faults.chaos(0.02, seed=1)
        tier = ObjectStoreTier(cache, agent=agent, policy=RetryPolicy(max_seconds=10))
    else:
        from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

        agent = FaultyAgent(make_agent("attack-posix", "POSIX"))
        agent.chaos(0.02, seed=1)
        directory = tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm")
                                                else None)
        tier = FileTier(cache, directory.name, agent=agent, policy=RetryPolicy(max_seconds=10))
    submit, poll, lookup, stats = Worst(), Worst(), Worst(), Worst()
    published: Counter[int] = Counter()
    submitted = set()
    ids = itertools.count()
    in_flight = threading.Semaphore(512)
    stop = threading.Event()
    drain_overrun: list[float] = []
    rss_before = rss_mib()

    def submitter(seed: int) -> None:
        rng = random.Random(seed)
        while True:
            job_id = next(ids)
            if job_id >= jobs:
                return
            in_flight.acquire()
            block = rng.randrange(blocks)
            submit.time(tier.submit_store, TransferJob(job_id, [f"k{job_id}"], [block]))
            submitted.add(job_id)

    def poller() -> None:
        while not stop.is_set() or tier.has_pending_work():
            for result in poll.time(tier.get_finished_jobs):
                published[result.job_id] += 1
                in_flight.release()
            time.sleep(0.0002)

    def looker() -> None:
        rng = random.Random(99)
        while not stop.is_set():
            lookup.time(tier.lookup, f"k{rng.randrange(jobs)}")
            stats.time(tier.stats)
            if len(published) > jobs // 2 and not drain_overrun:
                started = time.perf_counter()
                with contextlib.suppress(DrainTimeout):
                    tier.drain_jobs(timeout=0.05)
                drain_overrun.append(time.perf_counter() - started - 0.05)
            time.sleep(0.0005)

    started = time.monotonic()
    threads = [threading.Thread(target=submitter, args=(seed,)) for seed in range(8)]
    helpers = [threading.Thread(target=poller), threading.Thread(target=looker)]
    for thread in threads + helpers:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    for thread in helpers:
        thread.join()
    elapsed = time.monotonic() - started
    shutdown = Worst()
    shutdown.time(tier.shutdown, 5.0)
    lost = len(submitted - set(published))
    twice = sum(1 for count in published.values() if count > 1)
    misuses = len(getattr(agent, "misuses", []))
    print(f"\n{kind}: {jobs} jobs in {elapsed:.1f} s from 8 threads; results {len(published)}, "
          f"lost {lost}, published twice {twice}, misuses {misuses}; faults injected "
          f"{sum(agent.faults.chaos_faults.values())}; "
          f"RSS {rss_before:.0f} -> {rss_mib():.0f} MiB; drain_jobs(timeout=0.05) returned "
          f"{drain_overrun[0] * 1e3 if drain_overrun else float('nan'):.1f} ms past its deadline")
    print(table(["call", "calls", "p99 ms", "worst ms"],
                [submit.row("submit_store"), poll.row("get_finished_jobs"),
                 lookup.row("lookup"), stats.row("stats"), shutdown.row("shutdown(timeout=5)")]))
    if directory is not None:
        directory.cleanup()


# -- memory --------------------------------------------------------------------------------------

def long_run(jobs: int, leak_rate: float) -> None:
    cache = torch.zeros(64, 64, dtype=torch.uint8)
    agent = FakeNixlAgent(name="long-run")
    agent.faults.chaos({"deregister_memory": leak_rate, "release_xfer_handle": 0.01,
                        "check_xfer_state": 0.001}, seed=3)
    tier = ObjectStoreTier(cache, agent=agent, policy=RetryPolicy(max_seconds=10))
    rows = []
    started = time.monotonic()
    for job in range(jobs):
        tier.submit_store(TransferJob(job, [f"key-{job}"], [job % 64]))
        if job % 64 == 63:
            tier.get_finished_jobs()
            agent.objects.clear()  # the bucket's own expiry: only kvfsm's memory is measured
            agent.calls.clear()  # (the fake's record of every call made, for tests)
        if (job + 1) % (jobs // 10) == 0:
            tier.drain_jobs(timeout=30)
            tier.get_finished_jobs()
            gc.collect()
            stats = tier.stats()
            cost = Worst()
            cost.time(tier.stats)
            rows.append([job + 1, f"{rss_mib():.1f}", stats["lookup_cache"], stats["leaks"],
                         len(stats["leaked"]), agent.live_registrations("OBJ"),
                         f"{cost.samples[0] * 1e6:.0f}", f"{time.monotonic() - started:.0f}"])
    tier.shutdown(timeout=10)
    print(table(["jobs", "RSS MiB", "lookup cache", "leaks counted", "leaks listed",
                 "registrations leaked", "stats() us", "seconds"], rows,
                title=f"long run: {jobs} jobs, one tier (the agent keeps what a failed "
                      "deregister_memory leaked, as NIXL does)"))


# -- frozen --------------------------------------------------------------------------------------

def frozen_store() -> None:
    from tests.real_nixl import S3Server, free_port  # noqa: PLC0415

    server = S3Server(free_port())
    server.start()
    try:
        cache = torch.zeros(64, 64 * 1024, dtype=torch.uint8)
        tier = ObjectStoreTier(cache, store=server.config(server.new_bucket()))
        tier.submit_store(TransferJob(0, ["warm"], [0]))
        tier.drain_jobs(timeout=30)
        tier.get_finished_jobs()
        server.freeze()
        rows = []
        calls = {name: Worst() for name in ("lookup", "submit_store", "get_finished_jobs",
                                            "drain_jobs(timeout=0.05)",
                                            "shutdown(timeout=0.5)")}
        for index in range(64):
            calls["lookup"].time(tier.lookup, f"unknown-{index}")
        for job in range(1, 9):
            calls["submit_store"].time(tier.submit_store, TransferJob(job, [f"k{job}"], [job]))
        for _ in range(100):
            calls["get_finished_jobs"].time(tier.get_finished_jobs)
        with contextlib.suppress(DrainTimeout):
            calls["drain_jobs(timeout=0.05)"].time(tier.drain_jobs, 0.05)
        with contextlib.suppress(DrainTimeout):
            calls["shutdown(timeout=0.5)"].time(tier.shutdown, 0.5)
        rows = [worst.row(name) for name, worst in calls.items()]
        server.thaw()
        thawed = Worst()
        thawed.time(tier.shutdown, 60.0)
        rows.append(thawed.row("shutdown(timeout=60), server back"))
        print(table(["call", "calls", "p99 ms", "worst ms"], rows,
                    title="an object store frozen (SIGSTOP) with 64 lookups pending and 8 "
                          "stores in flight"))
    finally:
        server.thaw()
        server.stop()


# -- durable -------------------------------------------------------------------------------------

def durable_writes(blocks: int) -> None:
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    cache = torch.randint(0, 256, (blocks, 64 * 1024), dtype=torch.uint8)
    rows = []
    for durable in (True, False):
        with tempfile.TemporaryDirectory(dir=os.environ.get("KVFSM_BENCH_DIR")) as directory:
            tier = FileTier(cache, directory, agent=make_agent(f"durable-{durable}", "POSIX"),
                            durable=durable)
            submit, poll = Worst(), Worst()
            started = time.perf_counter()
            for job in range(blocks):
                submit.time(tier.submit_store, TransferJob(job, [f"k{job}"], [job]))
            done = 0
            while done < blocks:
                done += len(poll.time(tier.get_finished_jobs))
                time.sleep(0.0002)
            elapsed = time.perf_counter() - started
            drain = Worst()
            tier.submit_store(TransferJob(blocks, ["last"], [0]))
            with contextlib.suppress(DrainTimeout):
                drain.time(tier.drain_jobs, 0.05)
            tier.shutdown(timeout=30)
            rows.append([f"durable={durable}", f"{elapsed * 1e3:.1f}", *submit.row("")[2:],
                         *poll.row("")[1:], f"{drain.samples[0] * 1e3:.1f}"])
    print(table(["file tier", "all published ms", "submit p99 ms", "submit worst ms",
                 "polls", "poll p99 ms", "poll worst ms", "drain(0.05) ms"], rows,
                title=f"{blocks} one-block stores of 64 KiB on real POSIX "
                      f"({os.environ.get('KVFSM_BENCH_DIR') or tempfile.gettempdir()})"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["threads", "memory", "frozen", "durable"])
    parser.add_argument("--agent", choices=["fake", "posix"], default="fake")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--leak-rate", type=float, default=0.01,
                        help="memory: the share of deregister_memory calls that fail (a leak)")
    args = parser.parse_args()
    print_machine(machine())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.what == "threads":
        attack_threads(args.agent, args.jobs or 100_000)
    elif args.what == "memory":
        long_run(args.jobs or 1_000_000, args.leak_rate)
    elif args.what == "frozen":
        frozen_store()
    else:
        durable_writes(args.blocks)


if __name__ == "__main__":
    main()
