"""How the fake NIXL agent's cost scales: per job after many jobs, per poll with many in flight.

``kvfsm.testing.FakeNixlAgent`` stands in for NIXL in every test and in ``kvfsm demo --fake``, so
its cost should not depend on what ran before, or on how much is in flight. This measures, in one
run and side by side:

* per job: the NIXL calls of one object-store job, as the tier makes them (register the object
  descriptor, prep it, make, post, one poll answering DONE, release the transfer handle, release
  the list, deregister), after 0, 1,000, 10,000 and 100,000 jobs already ran on the same agent;
* per poll round, with 1,000, 10,000 and 100,000 transfers in flight: one ``check_xfer_state``
  on each while all still run (PROC); the round that completes them all (DONE, the bytes move);
  and the finish of them all (release the handle, release the list, deregister), which is what a
  tier's poll does next for each transfer that answered DONE.

Every time is a median over several batches (per job: 15 batches of 100 jobs, taking turns
across the prior counts; per round: three agents), in microseconds per job or per transfer; the
ratio column divides it by the first row's (0 prior jobs, 1,000 in flight): 1.0 means the cost
does not grow. Times on a shared machine wander (and a working set of 100,000 transfers misses
caches more than one of 1,000), so next to them is a count that does not: the lines of the
fake's code one job, or one transfer's checks and finish, run (``sys.settrace``, outside the
timed loops). ``--compare FILE`` measures another version of ``fake_agent.py`` in the same run
(e.g. ``git show HEAD~1:kvfsm/testing/fake_agent.py > /tmp/old_fake.py``), at the sizes
``--compare-max`` allows: an agent that keeps everything it ever made gets slower per call as it
goes, and quadratically so per round.

Usage: ``.venv/bin/python bench/fake_agent_scale.py [--quick] [--compare FILE]``
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_machine, table

from kvfsm.testing import fake_agent, faults

LOCAL = "NIXL_INIT_AGENT"
BLOCKS = 64
BLOCK_BYTES = 256
KEYS = 1024  # object keys cycle, so the object store does not grow with the job count


class Setup:
    """An agent with a registered, prepped primary cache, as a tier has it."""

    def __init__(self, module: ModuleType, complete_after_polls: int) -> None:
        self.agent: Any = module.FakeNixlAgent("scale", complete_after_polls=complete_after_polls)
        self.cache = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
        base = self.cache.data_ptr()
        self.agent.register_memory([(base, self.cache.nbytes, 0, "")], "DRAM")
        self.local = self.agent.prep_xfer_dlist(
            LOCAL, [(base + i * BLOCK_BYTES, BLOCK_BYTES, 0) for i in range(BLOCKS)], "DRAM")
        self.dev_ids = itertools.count(1)
        self.jobs = 0

    def post(self) -> tuple[Any, Any, Any]:
        """Register, prep, make and post one job's transfer: (registration, list, handle)."""
        agent, n = self.agent, self.jobs
        self.jobs += 1
        files = agent.register_memory(
            [(0, BLOCK_BYTES, next(self.dev_ids), f"blk{n % KEYS}")], "OBJ")
        remote = agent.prep_xfer_dlist(agent.name, files.trim())
        xfer = agent.make_prepped_xfer("WRITE", self.local, [n % BLOCKS], remote, [0])
        agent.transfer(xfer)
        return files, remote, xfer

    def finish(self, job: tuple[Any, Any, Any]) -> None:
        """Release and clean up after a transfer that is over."""
        files, remote, xfer = job
        self.agent.release_xfer_handle(xfer)
        self.agent.release_dlist_handle(remote)
        self.agent.deregister_memory(files)

    def job(self) -> None:
        """One whole job: post, one poll (DONE), finish."""
        posted = self.post()
        self.agent.check_xfer_state(posted[2])
        self.finish(posted)


def lines(module: ModuleType, call: Callable[[], object]) -> int:
    """Lines of the fake's code (its module, the fault schedule, the ``__init__`` dataclasses
    generate) that ``call`` runs: the same count on any machine, under any load."""
    files = {module.__file__, faults.__file__, "<string>"}
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if frame.f_code.co_filename not in files:
            return None
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def per_job(module: ModuleType, priors: list[int], batch: int,
            repeats: int) -> list[tuple[float, int]]:
    """Microseconds per whole job after each number of prior jobs on one agent (median of
    ``repeats`` batches of ``batch`` jobs), and the lines of the fake's code one job runs there.

    The batches of every prior count take turns, so whatever else the machine runs meanwhile
    lands on all of them alike. An agent is used until the jobs measured on it would take its
    count more than a tenth (or one batch) past the one it stands for; then a new one is aged.
    """
    warm = Setup(module, complete_after_polls=1)  # a throwaway agent warms the interpreter up
    for _ in range(batch):
        warm.job()
    agents: dict[int, Setup] = {}
    samples: dict[int, list[float]] = {prior: [] for prior in priors}
    counted: dict[int, int] = {}
    for _ in range(repeats):
        for prior in priors:
            setup = agents.get(prior)
            if setup is None or setup.jobs + batch > prior + max(prior // 10, batch):
                setup = agents[prior] = Setup(module, complete_after_polls=1)
                while setup.jobs < prior:
                    setup.job()
                gc.collect()
            if prior not in counted:
                counted[prior] = lines(module, setup.job)
            start = time.perf_counter()
            for _ in range(batch):
                setup.job()
            samples[prior].append((time.perf_counter() - start) / batch * 1e6)
    return [(statistics.median(samples[prior]), counted[prior]) for prior in priors]


def rounds(module: ModuleType, in_flight: int,
           repeats: int) -> tuple[float, float, float, tuple[int, int, int]]:
    """Microseconds per transfer of a PROC round, the completing round and the finish, with
    ``in_flight`` transfers posted (median over ``repeats`` fresh agents); and the lines of the
    fake's code that one more transfer's PROC check, DONE check and finish run among them."""
    proc, done, finish = [], [], []
    counted = (0, 0, 0)
    for repeat in range(repeats):
        setup = Setup(module, complete_after_polls=2)
        jobs = [setup.post() for _ in range(in_flight)]
        check = setup.agent.check_xfer_state
        if not repeat:
            extra = setup.post()
            one_check = functools.partial(check, extra[2])
            counted = (lines(module, one_check), lines(module, one_check),
                       lines(module, functools.partial(setup.finish, extra)))
        gc.collect()
        for samples in (proc, done):
            start = time.perf_counter()
            for _, _, xfer in jobs:
                check(xfer)
            samples.append((time.perf_counter() - start) / in_flight * 1e6)
        start = time.perf_counter()
        for posted in jobs:
            setup.finish(posted)
        finish.append((time.perf_counter() - start) / in_flight * 1e6)
        assert setup.agent.live_xfer_handles() == 0 and setup.agent.running_transfers() == 0
        del jobs, setup
    return statistics.median(proc), statistics.median(done), statistics.median(finish), counted


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("fake_agent_compared", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def report(name: str, module: ModuleType, priors: list[int], sizes: list[int],
           batch: int, repeats: int, big: int) -> None:
    """Both tables for one version of the fake; rounds over more than ``big`` transfers are
    measured on one agent, smaller ones on three."""
    start = time.perf_counter()
    jobs = per_job(module, priors, batch, repeats)
    (us0, lines0) = jobs[0]
    print(table(["prior jobs", "us per job", "ratio", "lines per job", "ratio"],
                [[f"{p:,}", f"{us:.1f}", f"{us / us0:.2f}", f"{n:,}", f"{n / lines0:.2f}"]
                 for p, (us, n) in zip(priors, jobs, strict=True)],
                f"{name}: one job's NIXL calls after N jobs on the same agent"))
    measured = [rounds(module, n, repeats=3 if n <= big else 1) for n in sizes]
    base = measured[0]
    print(table(["in flight", "PROC round us/xfer", "ratio", "DONE round us/xfer", "ratio",
                 "finish us/xfer", "ratio", "round total s", "lines PROC/DONE/finish"],
                [[f"{n:,}", f"{p:.2f}", f"{p / base[0]:.2f}", f"{d:.2f}", f"{d / base[1]:.2f}",
                  f"{f:.2f}", f"{f / base[2]:.2f}", f"{(p + d + f) * n / 1e6:.3f}",
                  "/".join(f"{c:,}" for c in counted)]
                 for n, (p, d, f, counted) in zip(sizes, measured, strict=True)],
                f"{name}: one poll round over N transfers in flight"))
    print(f"({name}: measured in {time.perf_counter() - start:.1f} s)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="up to 10,000 only")
    parser.add_argument("--compare", metavar="FILE",
                        help="another fake_agent.py to measure in the same run")
    parser.add_argument("--compare-max", type=int, default=10_000, metavar="N",
                        help="largest prior-job count and in-flight count for --compare (10,000)")
    args = parser.parse_args()
    print_machine(machine())
    top = 10_000 if args.quick else 100_000
    priors = [p for p in (0, 1_000, 10_000, 100_000) if p <= top]
    sizes = [n for n in (1_000, 10_000, 100_000) if n <= top]
    print()
    report("kvfsm.testing.fake_agent", fake_agent, priors, sizes, batch=100, repeats=15,
           big=100_000)
    if args.compare:
        cap = args.compare_max
        report(args.compare, load(args.compare), [p for p in priors if p <= cap],
               [n for n in sizes if n <= cap], batch=100, repeats=5, big=1_000)


if __name__ == "__main__":
    main()
