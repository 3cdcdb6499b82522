"""What kvfsm costs over a hand-written loop, over ``transitions``, and over the NIXL calls alone.

Every contender drives the same agent, :class:`zero_agent.ZeroAgent`, which answers each NIXL
call at once and moves no bytes, so what is measured is each contender's own bookkeeping:

  (a)  kvfsm: ``ObjectStoreTier`` (as shipped: trace recording on);
  (a') kvfsm with the tier's compiled machine set to ``trace=False`` (what tracing costs);
  (a*) kvfsm checking every transfer on every poll (``RetryPolicy(check_all_below=...)`` above
       N): the work (b) and (d) do on a poll step; (a) checks what its poll schedule picks;
  (b)  a hand-written poll loop with the same behaviour (``handloop.py``);
  (c1) ``transitions`` with one ``Machine`` per transfer; (c2) one shared ``Machine`` and
       ``add_model``/``remove_model`` (``transitions_tier.py``);
  (d)  the limit: the NIXL calls alone (for the poll step, a loop that only calls
       ``check_xfer_state`` on every in-flight handle).

Workloads, for N = 1,000, 10,000 and 100,000 transfers in flight (one block per job):

* submit: ``submit_store`` of N jobs, NIXL answering PROC (seconds per job);
* poll step: one ``get_finished_jobs()`` while all N are still PROC;
* finish: NIXL answers DONE, one ``get_finished_jobs()`` releases, cleans and publishes all N;
* full lifecycle per transfer = (submit + finish) / N, submit to published;
* memory per in-flight transfer (tracemalloc, less what the zero agent allocated: NIXL's own
  handles) and GC-tracked objects per transfer, with 10,000 in flight.

Each (contender, N) runs several cycles; the tables show medians and the ratios to (b) and (d).
``transitions`` at large N is slow to set up: its submits may take ``--budget`` seconds (60), and
a run projected to take much longer is not started; the tables say which and why. The plot
(poll step against N, log scales) goes to ``docs/poll-step.png``; tables and raw samples to
``bench/results/``.

Usage: ``.venv/bin/python bench/overhead.py [--quick]``
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zero_agent
from common import RESULTS, ROOT, machine, median, print_machine, ratio, table
from handloop import HandTier
from transitions_tier import TransitionsTier
from zero_agent import ZeroAgent

from kvfsm.agent import LOCAL_AGENT
from kvfsm.policy import RetryPolicy
from kvfsm.tiers import ObjectStoreTier
from kvfsm.transfer import TransferJob

BLOCKS, BLOCK_BYTES = 1024, 64  # the zero agent moves nothing: the size changes nothing


class Limit:
    """(d): the NIXL calls of each transfer and nothing else (arguments built once)."""

    def __init__(self, primary: torch.Tensor, agent: ZeroAgent, blocks_per_job: int) -> None:
        self.agent = agent
        self._local = agent.prep_xfer_dlist(LOCAL_AGENT, [(0, BLOCK_BYTES, 0)] * BLOCKS, "DRAM")
        self._descs = [(0, BLOCK_BYTES, 0, "key")] * blocks_per_job
        self._indices = list(range(blocks_per_job))
        self._live: list[tuple[Any, Any, list[Any]]] = []
        self.xfers: list[Any] = []

    def submit_store(self, job: TransferJob) -> None:
        """A job's calls: of several blocks, a NIXL transfer per block, as the tiers make
        (NIXL 1.5.1's OBJ backend: docs/operations.md); the poll step checks the first."""
        agent = self.agent
        files = agent.register_memory(self._descs, "OBJ")
        remote = agent.prep_xfer_dlist(agent.name, files.trim())
        if len(job.block_ids) == 1:
            xfers = [agent.make_prepped_xfer("WRITE", self._local, job.block_ids, remote,
                                             self._indices)]
        else:
            xfers = [agent.make_prepped_xfer("WRITE", self._local, [block], remote, [index])
                     for index, block in enumerate(job.block_ids)]
        for xfer in xfers:
            agent.transfer(xfer)
        self._live.append((files, remote, xfers))
        self.xfers.append(xfers[0])

    def poll_step(self) -> None:
        check = self.agent.check_xfer_state
        for xfer in self.xfers:
            check(xfer)

    def finish(self) -> int:
        agent = self.agent
        check, release = agent.check_xfer_state, agent.release_xfer_handle
        release_dlist, deregister = agent.release_dlist_handle, agent.deregister_memory
        for files, remote, xfers in self._live:
            for xfer in xfers:
                check(xfer)
            for xfer in xfers:
                release(xfer)
            release_dlist(remote)
            deregister(files)
        finished = len(self._live)
        self._live, self.xfers = [], []
        return finished

    def close(self) -> None:
        self.agent.release_dlist_handle(self._local)


@dataclass
class Runner:
    """One contender made ready on a fresh agent: what to call for each step."""

    submit: Callable[[TransferJob], None]
    poll_step: Callable[[], Any]
    finish: Callable[[], int]
    close: Callable[[], None]


def _tier_runner(tier: Any) -> Runner:
    return Runner(tier.submit_store, tier.get_finished_jobs,
                  lambda: len(tier.get_finished_jobs()), tier.shutdown)


def _kvfsm(primary: torch.Tensor, agent: ZeroAgent, blocks_per_job: int) -> Runner:
    return _tier_runner(ObjectStoreTier(primary, agent=agent, key_prefix="kv/"))


def _kvfsm_untraced(primary: torch.Tensor, agent: ZeroAgent, blocks_per_job: int) -> Runner:
    tier = ObjectStoreTier(primary, agent=agent, key_prefix="kv/")
    tier.machine.trace = False
    return _tier_runner(tier)


def _kvfsm_every(primary: torch.Tensor, agent: ZeroAgent, blocks_per_job: int) -> Runner:
    policy = RetryPolicy(check_all_below=1 << 40)  # every transfer on every poll
    return _tier_runner(ObjectStoreTier(primary, agent=agent, key_prefix="kv/", policy=policy))


def _hand(primary: torch.Tensor, agent: ZeroAgent, blocks_per_job: int) -> Runner:
    return _tier_runner(HandTier(primary, agent=agent, key_prefix="kv/"))


def _per_transfer(primary: torch.Tensor, agent: ZeroAgent, blocks_per_job: int) -> Runner:
    return _tier_runner(TransitionsTier(primary, agent=agent, mode="per_transfer",
                                        key_prefix="kv/"))


def _shared(primary: torch.Tensor, agent: ZeroAgent, blocks_per_job: int) -> Runner:
    return _tier_runner(TransitionsTier(primary, agent=agent, mode="shared", key_prefix="kv/"))


def _limit(primary: torch.Tensor, agent: ZeroAgent, blocks_per_job: int) -> Runner:
    limit = Limit(primary, agent, blocks_per_job)
    return Runner(limit.submit_store, limit.poll_step, limit.finish, limit.close)


#: key -> (label, factory); (b) and (d) are the references
CONTENDERS: dict[str, tuple[str, Callable[[torch.Tensor, ZeroAgent, int], Runner]]] = {
    "a": ("(a) kvfsm ObjectStoreTier", _kvfsm),
    "a'": ("(a') kvfsm, trace off", _kvfsm_untraced),
    "a*": ("(a*) kvfsm, every transfer every poll", _kvfsm_every),
    "b": ("(b) hand-written loop", _hand),
    "c1": ("(c1) transitions, Machine per transfer", _per_transfer),
    "c2": ("(c2) transitions, shared Machine + add_model", _shared),
    "d": ("(d) limit: NIXL calls only", _limit),
}
SLOW = {"c1", "c2"}  # bounded by --budget


def make_jobs(count: int, blocks_per_job: int) -> list[TransferJob]:
    jobs = []
    for job_id in range(count):
        first = (job_id * blocks_per_job) % BLOCKS
        blocks = [(first + i) % BLOCKS for i in range(blocks_per_job)]
        jobs.append(TransferJob(job_id, [f"seq{job_id}/blk{i}" for i in range(blocks_per_job)],
                                blocks))
    return jobs


@dataclass
class Samples:
    """Seconds: submit and finish per job, poll step per call, lifecycle per job."""

    submit: list[float] = field(default_factory=list)
    poll: list[float] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)
    lifecycle: list[float] = field(default_factory=list)
    wall: float = 0.0
    skipped: str = ""


def run_cycles(key: str, jobs: list[TransferJob], blocks_per_job: int, cycles: int,
               polls: int, budget: float | None = None) -> Samples:
    """Submit all jobs (PROC), poll ``polls`` times, answer DONE and finish; ``cycles`` times.

    With a ``budget`` (seconds), a cycle whose submits run past it stops submitting, finishes
    what it submitted, and the run is reported as not measured.
    """
    started = time.perf_counter()
    primary = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    agent = ZeroAgent()
    runner = CONTENDERS[key][1](primary, agent, blocks_per_job)
    samples = Samples()
    count = len(jobs)
    submit = runner.submit
    try:
        warm = jobs[:1_000]  # one untimed cycle, so the first timed one is not the first run
        for job in warm:
            submit(job)
        runner.poll_step()
        agent.answer = "DONE"
        if runner.finish() != len(warm):
            raise RuntimeError(f"{key}: the warm-up cycle did not finish")
        for _ in range(cycles):
            agent.answer = "PROC"
            gc.collect()
            t0 = time.perf_counter()
            if budget is None:
                for job in jobs:
                    submit(job)
            else:
                deadline = t0 + budget
                for index, job in enumerate(jobs):
                    submit(job)
                    if index % 1000 == 999 and time.perf_counter() > deadline:
                        rate = (time.perf_counter() - t0) / (index + 1)
                        samples.skipped = (f"stopped after {budget:.0f} s with {index + 1:,} of "
                                           f"{count:,} submitted ({rate * 1e6:,.0f} us a submit "
                                           "on average, growing with N)")
                        agent.answer = "DONE"
                        runner.finish()
                        return samples
            t1 = time.perf_counter()
            for _ in range(polls):
                p0 = time.perf_counter()
                runner.poll_step()
                samples.poll.append(time.perf_counter() - p0)
            agent.answer = "DONE"
            t2 = time.perf_counter()
            finished = runner.finish()
            t3 = time.perf_counter()
            if finished != count:
                raise RuntimeError(f"{key}: {finished} of {count} transfers finished")
            samples.submit.append((t1 - t0) / count)
            samples.finish.append((t3 - t2) / count)
            samples.lifecycle.append((t1 - t0 + t3 - t2) / count)
    finally:
        runner.close()
        samples.wall = time.perf_counter() - started
    return samples


def measure_memory(key: str, count: int, blocks_per_job: int) -> dict[str, float]:
    """Bytes (tracemalloc) and GC-tracked objects per in-flight transfer, NIXL handles left out."""
    primary = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    agent = ZeroAgent()
    jobs = make_jobs(count, blocks_per_job)
    runner = CONTENDERS[key][1](primary, agent, blocks_per_job)
    handle_types = (zero_agent.ZeroHandle, zero_agent.ZeroRegDList)
    excluded = [tracemalloc.Filter(False, zero_agent.__file__),
                tracemalloc.Filter(False, tracemalloc.__file__)]

    def traced() -> int:
        snapshot = tracemalloc.take_snapshot().filter_traces(excluded)
        return sum(stat.size for stat in snapshot.statistics("filename"))

    def tracked() -> tuple[int, int]:
        objects = gc.get_objects()
        return len(objects), sum(isinstance(o, handle_types) for o in objects)

    gc.collect()
    tracemalloc.start(1)
    before = traced()
    objects_before, handles_before = tracked()
    for job in jobs:
        runner.submit(job)
    gc.collect()
    after = traced()
    objects_after, handles_after = tracked()
    tracemalloc.stop()
    agent.answer = "DONE"
    runner.finish()
    runner.close()
    return {
        "count": count,
        "bytes": (after - before) / count,
        "gc_objects": ((objects_after - objects_before) - (handles_after - handles_before))
        / count,
    }


def _projected(walls: dict[int, float], n: int) -> float:
    """Seconds a run at ``n`` should take, from the runs at smaller sizes (at least linear)."""
    sizes = sorted(walls)
    if not sizes:
        return 0.0
    last = sizes[-1]
    exponent = 1.0
    if len(sizes) >= 2:
        first = sizes[-2]
        exponent = max(1.0, math.log(walls[last] / walls[first]) / math.log(last / first))
    return walls[last] * (n / last) ** exponent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run of seconds: smaller N, "
                        "fewer repeats (writes *-quick files, not docs/poll-step.png)")
    parser.add_argument("--budget", type=float, default=60.0,
                        help="seconds the submits of one transitions cycle may take (60)")
    parser.add_argument("--plot", type=Path, help="where to draw the poll-step plot")
    args = parser.parse_args()
    logging.getLogger("kvfsm").setLevel(logging.ERROR)
    if args.quick:
        sizes, memory_count, suffix = (1_000, 10_000), 1_000, "-quick"
        plan = {1_000: (3, 5), 10_000: (2, 5)}
        slow_plan = {1_000: (1, 3), 10_000: (0, 0)}  # transitions: N=1,000 only
    else:
        sizes, memory_count, suffix = (1_000, 10_000, 100_000), 10_000, ""
        plan = {1_000: (15, 10), 10_000: (7, 5), 100_000: (3, 5)}
        slow_plan = {1_000: (3, 5), 10_000: (1, 5), 100_000: (1, 3)}
    plot_path = args.plot or (ROOT / "docs" / "poll-step.png" if not args.quick
                              else RESULTS / "poll-step-quick.png")
    info = machine()
    print_machine(info)
    results = measure_sizes(sizes, plan, slow_plan, args.budget)
    heavy, memory = measure_heavy_and_memory(args.quick, plan[1_000][0], memory_count)
    report = render(info, sizes, results, heavy, memory)
    print("\n" + report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"overhead{suffix}.md").write_text(report)
    (RESULTS / f"overhead{suffix}.json").write_text(json.dumps({
        "machine": info,
        "samples": {key: {str(n): vars(s) for n, s in per.items()}
                    for key, per in results.items()},
        "lifecycle_16_blocks": {key: vars(s) for key, s in heavy.items()},
        "memory": memory,
    }, indent=1))
    plot(info, sizes, results, plot_path)
    print(f"wrote {RESULTS / f'overhead{suffix}.md'}, .json and {plot_path}")
    return 0


def measure_sizes(sizes: tuple[int, ...], plan: dict[int, tuple[int, int]],
                  slow_plan: dict[int, tuple[int, int]],
                  budget_seconds: float) -> dict[str, dict[int, Samples]]:
    """Every contender at every N: (cycles, polls) from the plan; transitions bounded."""
    results: dict[str, dict[int, Samples]] = {key: {} for key in CONTENDERS}
    for n in sizes:
        jobs = make_jobs(n, 1)
        for key in CONTENDERS:
            label = CONTENDERS[key][0]
            cycles, polls = plan[n]
            budget = None
            if key in SLOW:
                cycles, polls = slow_plan[n]
                walls = {size: s.wall / slow_plan[size][0]
                         for size, s in results[key].items() if not s.skipped}
                one_cycle = _projected(walls, n)
                if not cycles or one_cycle > 1.5 * budget_seconds:
                    why = (f"projected {one_cycle:.0f} s for one cycle, over the budget of "
                           f"{budget_seconds:.0f} s" if cycles else "not run with --quick")
                    results[key][n] = Samples(skipped=why)
                    print(f"  N={n:>7,} {label}: skipped ({why})", flush=True)
                    continue
                budget = budget_seconds
            samples = run_cycles(key, jobs, 1, cycles, polls, budget)
            results[key][n] = samples
            if samples.skipped:
                print(f"  N={n:>7,} {label}: {samples.skipped}", flush=True)
                continue
            print(f"  N={n:>7,} {label}: lifecycle {median(samples.lifecycle) * 1e6:8.2f} us"
                  f"/transfer, poll step {median(samples.poll) * 1e3:9.3f} ms "
                  f"({len(samples.lifecycle)} cycles, {samples.wall:.1f} s)", flush=True)

    return results


def measure_heavy_and_memory(quick: bool, cycles: int, memory_count: int) -> tuple[
        dict[str, Samples], dict[str, dict[str, float]]]:
    """The full lifecycle with 16 blocks a job at N = 1,000; memory per in-flight transfer."""
    heavy: dict[str, Samples] = {}
    jobs16 = make_jobs(1_000, 16)
    for key in CONTENDERS:
        heavy[key] = run_cycles(key, jobs16, 16,
                                cycles if key not in SLOW else (1 if quick else 3), 1)
    print("  16 blocks a job: " + ", ".join(
        f"{key} {median(s.lifecycle) * 1e6:.2f} us" for key, s in heavy.items()), flush=True)
    memory: dict[str, dict[str, float]] = {}
    for key in CONTENDERS:
        count = memory_count if key != "c1" else min(memory_count, 2_000)
        memory[key] = measure_memory(key, count, 1)
        print(f"  memory {CONTENDERS[key][0]}: {memory[key]['bytes']:.0f} B, "
              f"{memory[key]['gc_objects']:.1f} GC objects per transfer", flush=True)
    return heavy, memory


def _med(samples: Samples | None, what: str) -> float | None:
    if samples is None or samples.skipped:
        return None
    return median(getattr(samples, what))


def _fmt(value: float | None, scale: float, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def render(info: dict[str, str], sizes: tuple[int, ...], results: dict[str, dict[int, Samples]],
           heavy: dict[str, Samples], memory: dict[str, dict[str, float]]) -> str:
    out = ["machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), ""]
    n0 = sizes[0]

    def lifecycle_rows(per: dict[str, Samples | None]) -> list[list[str]]:
        rows = []
        for key, (label, _) in CONTENDERS.items():
            value = _med(per.get(key), "lifecycle")
            rows.append([label, _fmt(value, 1e6), ratio(value, _med(per.get("b"), "lifecycle")),
                         ratio(value, _med(per.get("d"), "lifecycle"))])
        return rows

    headers = ["contender", "us / transfer", "vs (b)", "vs (d)"]
    out.append(table(headers, lifecycle_rows({k: results[k].get(n0) for k in CONTENDERS}),
                     f"Full lifecycle, submit to published ({n0:,} in flight, 1 block a job; "
                     "medians)"))
    out.append(table(headers, lifecycle_rows(dict(heavy.items())),
                     f"Full lifecycle with 16 blocks a job ({n0:,} in flight)"))

    rows = []
    for key, (label, _) in CONTENDERS.items():
        row = [label]
        for n in sizes:
            value = _med(results[key].get(n), "poll")
            row += [_fmt(value, 1e3, 3), ratio(value, _med(results["b"].get(n), "poll")),
                    ratio(value, _med(results["d"].get(n), "poll"))]
        rows.append(row)
    poll_headers = ["contender"]
    for n in sizes:
        poll_headers += [f"N={n:,} ms", "vs (b)", "vs (d)"]
    out.append(table(poll_headers, rows,
                     "One poll step, all N transfers still PROC (ms; medians)"))

    rows = []
    for key, (label, _) in CONTENDERS.items():
        row = [label]
        for n in sizes:
            samples = results[key].get(n)
            poll = _med(samples, "poll")
            row += [_fmt(None if poll is None else poll / n, 1e9, 0),
                    _fmt(_med(samples, "submit"), 1e6), _fmt(_med(samples, "finish"), 1e6)]
        rows.append(row)
    scale_headers = ["contender"]
    for n in sizes:
        scale_headers += [f"N={n:,} poll ns/tr", "submit us", "finish us"]
    out.append(table(scale_headers, rows,
                     "Per-call cost against N in flight: poll step per in-flight transfer (ns), "
                     "submit per job and finish (poll DONE, release, clean, publish) per job "
                     "(us)"))

    rows = []
    for key, (label, _) in CONTENDERS.items():
        m = memory[key]
        rows.append([label, f"{int(m['count']):,}", f"{m['bytes']:,.0f}",
                     f"{m['gc_objects']:.1f}"])
    out.append(table(["contender", "in flight", "bytes / transfer", "GC objects / transfer"],
                     rows, "Python memory per in-flight transfer (tracemalloc; the zero agent's "
                     "handles, i.e. NIXL's own, left out)"))
    skipped = [f"- {CONTENDERS[key][0]} at N={n:,}: {s.skipped}"
               for key, per in results.items() for n, s in per.items() if s.skipped]
    if skipped:
        out.append("Not measured:\n\n" + "\n".join(skipped) + "\n")
    return "\n".join(out)


def plot(info: dict[str, str], sizes: tuple[int, ...], results: dict[str, dict[int, Samples]],
         path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only needed for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    styles = {"a": ("C0", "o", "-"), "a'": ("C0", "o", ":"), "a*": ("C0", "o", "--"),
              "b": ("C2", "s", "-"),
              "c1": ("C3", "^", "-"), "c2": ("C1", "v", "-"), "d": ("k", "D", "--")}
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for key, (label, _) in CONTENDERS.items():
        points = [(n, _med(results[key].get(n), "poll")) for n in sizes]
        points = [(n, v) for n, v in points if v is not None]
        if not points:
            continue
        color, marker, line = styles[key]
        xs = [n for n, _ in points]
        left.plot(xs, [v * 1e3 for _, v in points], color=color, marker=marker, linestyle=line,
                  label=label)
        right.plot(xs, [v / n * 1e9 for n, v in points], color=color, marker=marker,
                   linestyle=line, label=label)
    left.set(xscale="log", yscale="log", xlabel="transfers in flight (N)",
             ylabel="one poll step (ms)", title="Poll step, all N still PROC")
    right.set(xscale="log", yscale="log", xlabel="transfers in flight (N)",
              ylabel="ns per in-flight transfer", title="Per-transfer cost of a poll step")
    for axes in (left, right):
        axes.set_xticks(list(sizes), [f"{n:,}" for n in sizes])
        axes.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8, loc="upper left")
    figure.suptitle(f"kvfsm {info['kvfsm']} on a zero-cost NIXL agent; {info['nproc']} x "
                    f"{info['cpu']}, {info['python']}", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
