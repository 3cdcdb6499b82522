"""A scheduler step against the transfers in flight (issue 18): what one ``get_finished_jobs()``
costs the caller's thread with N transfers in flight and 1 % of them finishing per step, and how
long a transfer NIXL finished waits for its result to be handed out.

The agent is the zero-cost one (``bench/zero_agent.py``) with two changes: a state check costs
what real NIXL's costs on this machine (measured first, on a finished POSIX transfer in
/dev/shm, and spun for that long), and a transfer answers PROC until the benchmark marks it done
(the oldest 1 % each step), then DONE. Per N, after a warm-up, it records for each step the
caller-thread time of ``get_finished_jobs()`` and, for each result, the time and the number of
steps from the moment its transfer was marked done to the step that handed its result out.

    .venv/bin/python bench/step.py            # N = 1,000 / 10,000 / 100,000 (~2 min)
    .venv/bin/python bench/step.py --quick    # N = 1,000 / 10,000, fewer steps
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, machine, print_machine
from bench.zero_agent import ZeroAgent
from kvfsm import TransferJob
from kvfsm.tiers import ObjectStoreTier

FINISHING = 0.01  # of those in flight, per step


class Handle:
    """A transfer handle: done (and since when) once the benchmark says so."""

    __slots__ = ("done_at",)

    def __init__(self) -> None:
        self.done_at: float | None = None


class PacedAgent(ZeroAgent):
    """The zero-cost agent with a state check that costs ``check_ns`` and answers DONE only
    for transfers marked done."""

    def __init__(self, check_ns: int) -> None:
        super().__init__("paced")
        self.check_ns = check_ns
        self.running: collections.deque[Handle] = collections.deque()  # oldest first
        self.checks = 0

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Handle:  # type: ignore[override]
        handle = Handle()
        self.running.append(handle)
        return handle

    def check_xfer_state(self, handle: Any) -> str:
        self.checks += 1
        start = time.perf_counter_ns()
        cost = self.check_ns
        while time.perf_counter_ns() - start < cost:
            pass
        return "PROC" if handle.done_at is None else "DONE"

    def finish_oldest(self, count: int, now: float) -> list[Handle]:
        done = []
        for _ in range(min(count, len(self.running))):
            handle = self.running.popleft()
            handle.done_at = now
            done.append(handle)
        return done


def real_check_ns() -> int:
    """What real NIXL's ``check_xfer_state`` costs here: a finished POSIX transfer's handle,
    checked 20,000 times (the median of 5 runs), in ns."""
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    agent = make_agent("step-bench-check", "POSIX")
    block = torch.zeros(4096, dtype=torch.uint8)
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as file:
        file.write(b"\0" * 4096)
        file.flush()
        dram = agent.register_memory([(block.data_ptr(), 4096, 0, "")], "DRAM")
        fd = file.fileno()
        files = agent.register_memory([(0, 4096, fd, "")], "FILE")
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(block.data_ptr(), 4096, 0)], "DRAM")
        remote = agent.prep_xfer_dlist(agent.name, files.trim())
        handle = agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        runs = []
        for _ in range(5):
            start = time.perf_counter_ns()
            for _ in range(20_000):
                agent.check_xfer_state(handle)
            runs.append((time.perf_counter_ns() - start) / 20_000)
        agent.release_xfer_handle(handle)
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(remote)
        agent.deregister_memory(files)
        agent.deregister_memory(dram)
    return round(statistics.median(runs))


def run(n: int, steps: int, check_ns: int) -> dict[str, Any]:
    """N in flight; ``steps`` measured steps after a warm-up of 20."""
    agent = PacedAgent(check_ns)
    primary = torch.zeros((1024, 16), dtype=torch.float32)
    tier = ObjectStoreTier(primary, agent=agent)
    job_ids = iter(range(1 << 62))
    handle_of: dict[int, Handle] = {}

    def submit(count: int) -> None:
        for _ in range(count):
            job_id = next(job_ids)
            tier.submit_store(TransferJob(job_id, [f"k{job_id}"], [job_id % 1024]))
            handle_of[job_id] = agent.running[-1]

    submit(n)
    per_step = max(1, int(n * FINISHING))
    step_seconds: list[float] = []
    latencies: list[float] = []
    latency_steps: list[int] = []
    done_step: dict[int, int] = {}
    for step in range(20 + steps):
        now = time.perf_counter()
        for handle in agent.finish_oldest(per_step, now):
            done_step[id(handle)] = step
        start = time.perf_counter()
        results = tier.get_finished_jobs()
        spent = time.perf_counter() - start
        end = time.perf_counter()
        if step >= 20:
            step_seconds.append(spent)
            for result in results:
                handle = handle_of[result.job_id]
                assert handle.done_at is not None
                latencies.append(end - handle.done_at)
                latency_steps.append(step - done_step[id(handle)])
        for result in results:
            handle = handle_of.pop(result.job_id)
            done_step.pop(id(handle), None)
        submit(len(results))
    for handle in agent.running:  # let every transfer end, and shut the tier down
        handle.done_at = time.perf_counter()
    agent.running.clear()
    tier.shutdown(timeout=60)

    def pct(samples: list[float], q: float) -> float:
        ordered = sorted(samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": n, "steps": steps, "finishing_per_step": per_step,
        "step_ms": {"median": statistics.median(step_seconds) * 1e3,
                    "p99": pct(step_seconds, 0.99) * 1e3, "max": max(step_seconds) * 1e3},
        "done_to_result_ms": {"median": statistics.median(latencies) * 1e3,
                              "p99": pct(latencies, 0.99) * 1e3,
                              "max": max(latencies) * 1e3},
        "done_to_result_steps": {"median": statistics.median(latency_steps),
                                 "p99": pct([float(s) for s in latency_steps], 0.99),
                                 "max": max(latency_steps)},
        "checks_per_step": agent.checks / (20 + steps),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N up to 10,000, fewer steps")
    args = parser.parse_args()
    info = machine()
    print_machine(info)
    check_ns = real_check_ns()
    print(f"real NIXL check_xfer_state (POSIX, a finished transfer): {check_ns} ns a call; "
          "the paced agent spins that long")
    sizes = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)
    steps = 30 if args.quick else 100
    rows = [run(n, steps, check_ns) for n in sizes]
    print()
    print("| N in flight | finishing a step | caller time a step, median / p99 (ms) | "
          "DONE to result, median / p99 / max (ms) | DONE to result (steps), median / p99 / "
          "max | state checks a step |")
    print("|---:|---:|---|---|---|---:|")
    for row in rows:
        step, lat, lst = row["step_ms"], row["done_to_result_ms"], row["done_to_result_steps"]
        print(f"| {row['n']:,} | {row['finishing_per_step']:,} | "
              f"{step['median']:.3f} / {step['p99']:.3f} | "
              f"{lat['median']:.3f} / {lat['p99']:.3f} / {lat['max']:.3f} | "
              f"{lst['median']:g} / {lst['p99']:g} / {lst['max']:g} | "
              f"{row['checks_per_step']:,.0f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("step-quick.json" if args.quick else "step.json")
    out.write_text(json.dumps({"machine": info, "check_ns": check_ns, "rows": rows}, indent=2))
    print(f"\nraw figures: {out.relative_to(RESULTS.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
