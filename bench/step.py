"""A scheduler step against the transfers in flight (issue 18): what one ``get_finished_jobs()``
costs the caller's thread with N transfers in flight and 1 % of them finishing per step, and how
long a transfer NIXL finished waits for its result to be handed out.

The agent is the zero-cost one (``bench/zero_agent.py``) with two changes: each state check
makes one real NIXL ``check_xfer_state`` call (on a finished POSIX transfer in /dev/shm, so it
costs what NIXL's call costs here, GIL and all) before it answers, and a transfer answers PROC
until the benchmark marks it done, then DONE. Each step marks 1 % of those in flight done,
either the oldest (transfers ending in the order they were posted, as a backend's queue ends
them) or a random 1 % (the worst case for a schedule that looks at the oldest first), calls
``get_finished_jobs()`` and submits as many new jobs as results came out. A step starts every
20 ms (the engine's model step runs in between), or at once when the one before ran longer.
The 1 % end just before a step (*ending before*: the worst case for a progress thread, whose
work on them then meets the step's submits) or, in posting order only, after the engine's
Python work, while its model step runs (*ending during*).

Three contenders, one tier class, side by side in one run: *every step* checks every transfer
in flight on every step (``RetryPolicy(check_all_below=...)`` above N: what kvfsm did before the
poll schedule); *schedule*, kvfsm's default poll schedule (the oldest first while they are
found ended, then the sweep's share; every transfer checked at least once every
``max_unpolled`` = 1 s); and *progress thread*, the same schedule run by the tier's own thread
every millisecond (``RetryPolicy(progress_interval=0.001)``), ``get_finished_jobs()`` only
handing out what it published. A fourth, run with transfers ending out of order only, is the
progress thread with every running transfer checked at least once a step
(``max_unpolled`` = 20 ms): what the latency goal costs when the oldest do not end first; and
a fifth, the progress thread checking every running transfer on every poll
(``check_all_below`` above N). Per
N, after a warm-up of 60 steps (past ``max_unpolled``), it
records for 100 steps the caller-thread time of ``get_finished_jobs()``, of the submits that
follow it (they take the tier's lock, so they wait for a poll the progress thread is making),
and of the engine's own Python work between two steps (a fixed loop, about 5 ms alone: what
a thread sharing the interpreter's lock costs the engine); the state checks made (on whichever
thread); and, for each transfer marked done in them, the time and the number of steps from the
moment it was marked done to the step that handed its result out (steps go on, nothing new
ending, until the last of them is out).

Then the same three contenders on real NIXL: a :class:`~kvfsm.tiers.FileTier` (POSIX backend,
``durable=False``) in a directory on ``/dev/shm``, N one-block stores of 4 KiB, 1 % of them
submitted before each ``get_finished_jobs()``, a step every 20 ms, until every result is out.
Real NIXL does not say when a transfer ended, only that it has when asked, so this part reports
the time from submit to result (an upper bound of DONE to result), with the caller-thread time
of each step and the number of steps.

Tables go to ``bench/results/step.md`` (and ``.json``, every figure), the plot to
``docs/step.png``.

    .venv/bin/python bench/step.py            # N = 1,000 / 10,000 / 100,000 (~10 min)
    .venv/bin/python bench/step.py --quick    # N = 1,000 / 10,000, fewer steps
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, ROOT, machine, print_machine, table
from bench.zero_agent import ZeroAgent
from kvfsm import TransferJob
from kvfsm.policy import RetryPolicy
from kvfsm.tiers import FileTier, ObjectStoreTier

FINISHING = 0.01  # of those in flight, per step
#: a scheduler step starts every STEP_PERIOD seconds (an engine's model step runs between
#: them), or at once when the one before took longer
STEP_PERIOD = 0.02
#: steps before the measured ones: past max_unpolled (1 s), so the measured ones see the
#: sweep's steady state rather than the first turn of those submitted at the start
WARM_UP = 60


def pace(next_at: float) -> float:
    """Sleep until the next step's start; returns it (now, if this step ran past it)."""
    next_at += STEP_PERIOD
    pause = next_at - time.perf_counter()
    if pause > 0:
        time.sleep(pause)
        return next_at
    return time.perf_counter()


class Handle:
    """A transfer handle: done (and since when) once the benchmark says so."""

    __slots__ = ("done_at",)

    def __init__(self) -> None:
        self.done_at: float | None = None


class RealCheck:
    """A real NIXL agent with one finished POSIX transfer in /dev/shm: ``check()`` makes the
    real ``check_xfer_state`` call on it."""

    def __init__(self) -> None:
        from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

        self.agent = agent = make_agent("step-bench-check", "POSIX")
        self.block = torch.zeros(4096, dtype=torch.uint8)
        self.file = tempfile.NamedTemporaryFile(dir="/dev/shm")  # noqa: SIM115
        self.file.write(b"\0" * 4096)
        self.file.flush()
        self.dram = agent.register_memory([(self.block.data_ptr(), 4096, 0, "")], "DRAM")
        self.files = agent.register_memory([(0, 4096, self.file.fileno(), "")], "FILE")
        self.local = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                           [(self.block.data_ptr(), 4096, 0)], "DRAM")
        self.remote = agent.prep_xfer_dlist(agent.name, self.files.trim())
        self.handle = agent.make_prepped_xfer("WRITE", self.local, [0], self.remote, [0])
        state = agent.transfer(self.handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(self.handle)
        self.check = lambda: agent.check_xfer_state(self.handle)

    def cost_ns(self) -> int:
        """The call's cost: 20,000 calls, the median of 5 runs, in ns."""
        runs = []
        for _ in range(5):
            start = time.perf_counter_ns()
            for _ in range(20_000):
                self.check()
            runs.append((time.perf_counter_ns() - start) / 20_000)
        return round(statistics.median(runs))

    def close(self) -> None:
        agent = self.agent
        agent.release_xfer_handle(self.handle)
        agent.release_dlist_handle(self.local)
        agent.release_dlist_handle(self.remote)
        agent.deregister_memory(self.files)
        agent.deregister_memory(self.dram)
        self.file.close()


class PacedAgent(ZeroAgent):
    """The zero-cost agent whose state check makes one real NIXL call and answers DONE only
    for transfers marked done."""

    def __init__(self, real: RealCheck) -> None:
        super().__init__("paced")
        self.real_check = real.check
        self.running: dict[Handle, None] = {}  # not yet marked done, oldest first
        self.checks = 0

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Handle:  # type: ignore[override]
        handle = Handle()
        self.running[handle] = None
        return handle

    def check_xfer_state(self, handle: Any) -> str:
        self.checks += 1
        self.real_check()
        return "PROC" if handle.done_at is None else "DONE"

    def finish(self, count: int, now: float, order: str, rng: random.Random) -> list[Handle]:
        """Mark ``count`` of those running done: the oldest, or a random choice."""
        running = self.running
        if order == "oldest":
            done = list(islice(running, count))
        else:
            done = rng.sample(list(running), min(count, len(running)))
        for handle in done:
            del running[handle]
            handle.done_at = now
        return done


CONTENDERS = {
    "every step": lambda n: RetryPolicy(check_all_below=n + 1),
    "schedule": lambda n: RetryPolicy(),
    "progress thread": lambda n: RetryPolicy(progress_interval=PROGRESS_INTERVAL),
}
#: the progress thread's contender polls (the same schedule) every millisecond
PROGRESS_INTERVAL = 0.001
#: a fourth contender, run with transfers ending out of order only: the progress thread with
#: every running transfer checked at least once a step (``max_unpolled`` = the step period),
#: which is what the latency goal asks for when the oldest are not the first to end
TIGHT = "progress thread, max_unpolled 20 ms"
#: a fifth, run with transfers ending out of order only: the progress thread checking every
#: running transfer on every poll (``check_all_below`` above N), as "every step" does on the
#: caller's thread: what the latency goal costs when each round must see every transfer
EVERYTHING = "progress thread, every transfer every poll"
POLICIES = {**CONTENDERS,
            TIGHT: lambda n: RetryPolicy(progress_interval=PROGRESS_INTERVAL,
                                         max_unpolled=STEP_PERIOD),
            EVERYTHING: lambda n: RetryPolicy(progress_interval=PROGRESS_INTERVAL,
                                              check_all_below=n + 1)}
#: the engine's own Python work between two steps (its scheduling, its model step's host side),
#: a fixed loop timed alone at about 5 ms: how long it takes beside each contender shows what a
#: progress thread's share of the interpreter's lock costs the engine
ENGINE_WORK = 60_000


def engine_work() -> float:
    """The engine's Python work between two steps; returns the seconds it took."""
    start = time.perf_counter()
    total = 0
    for i in range(ENGINE_WORK):
        total += i * i % 7
    return time.perf_counter() - start


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spread(samples: list[float], scale: float = 1.0) -> dict[str, float]:
    """Median, p99 and max of ``samples``, times ``scale``."""
    return {"median": statistics.median(samples) * scale, "p99": pct(samples, 0.99) * scale,
            "max": max(samples) * scale}


def run(real: RealCheck, contender: str, n: int, steps: int, order: str,
        collector: bool = True, ends: str = "before") -> dict[str, Any]:
    """N in flight; ``steps`` measured steps after the warm-up; 1 % marked done a step, just
    before the step (``ends="before"``) or while the engine's model step runs, after the
    engine's Python work (``"during"``). Without ``collector``, the cyclic garbage collector is
    off for the run (what its pauses cost)."""
    if not collector:
        gc.collect()
        gc.disable()
    try:
        row = _run(real, contender, n, steps, order, ends)
    finally:
        gc.enable()
    if not collector:
        row["contender"] += ", collector off"
    return row


def _run(real: RealCheck, contender: str, n: int, steps: int, order: str,
         ends: str) -> dict[str, Any]:
    paced = PacedRun(real, contender, n, order, ends)
    try:
        return paced.measure(steps)
    finally:
        paced.close()


class PacedRun:
    """One contender with N in flight on the paced agent: the steps, and what they cost."""

    def __init__(self, real: RealCheck, contender: str, n: int, order: str, ends: str) -> None:
        self.agent = PacedAgent(real)
        primary = torch.zeros((1024, 16), dtype=torch.float32)
        self.tier = ObjectStoreTier(primary, agent=self.agent,
                                    policy=POLICIES[contender](n))
        self.contender, self.n, self.order, self.ends = contender, n, order, ends
        self.rng = random.Random(18)
        self.job_ids = iter(range(1 << 62))
        self.handle_of: dict[int, Handle] = {}
        self.per_step = max(1, int(n * FINISHING))
        self.done_step: dict[Handle, int] = {}  # marked done in which step
        self.latencies: list[float] = []
        self.latency_steps: list[float] = []
        self.submit(n)

    def submit(self, count: int) -> None:
        tier, agent = self.tier, self.agent
        for _ in range(count):
            job_id = next(self.job_ids)
            tier.submit_store(TransferJob(job_id, [f"k{job_id}"], [job_id % 1024]))
            self.handle_of[job_id] = next(reversed(agent.running))

    def end_some(self, step: int, when: str) -> None:
        """1 % end, if this run has them end ``when``."""
        if when == self.ends:
            for handle in self.agent.finish(self.per_step, time.perf_counter(), self.order,
                                            self.rng):
                self.done_step[handle] = step

    def hand_out(self, results: list[Any], step: int, end: float) -> int:
        """Record the latency of each result whose transfer was marked done in a measured
        step; returns how many there were."""
        measured = 0
        for result in results:
            handle = self.handle_of.pop(result.job_id)
            assert handle.done_at is not None and result.success
            marked = self.done_step.pop(handle)
            if marked >= WARM_UP:
                self.latencies.append(end - handle.done_at)
                self.latency_steps.append(float(step - marked))
                measured += 1
        return measured

    def measure(self, steps: int) -> dict[str, Any]:
        """The warm-up, ``steps`` measured steps, then the tail: steps (nothing new ends,
        nothing new is submitted) until every transfer marked done in a measured step was
        handed out, so the slowest are counted too."""
        tier, agent = self.tier, self.agent
        timed: dict[str, list[float]] = {"step": [], "submits": [], "engine_work": []}
        checks_before = 0
        next_at = time.perf_counter()
        for step in range(WARM_UP + steps):
            self.end_some(step, "before")
            if step == WARM_UP:  # every state check from here on, on whichever thread
                checks_before = agent.checks
            start = time.perf_counter()
            results = tier.get_finished_jobs()
            end = time.perf_counter()
            self.hand_out(results, step, end)
            self.submit(len(results))
            submitted = time.perf_counter()
            work = engine_work()
            if step >= WARM_UP:
                for what, seconds in (("step", end - start), ("submits", submitted - end),
                                      ("engine_work", work)):
                    timed[what].append(seconds)
            self.end_some(step, "during")  # the model step runs: transfers end meanwhile
            next_at = pace(next_at)
        checks = agent.checks - checks_before
        owed = sum(1 for marked in self.done_step.values() if marked >= WARM_UP)
        for step in range(WARM_UP + steps, WARM_UP + steps + 10_000):
            if not owed:
                break
            owed -= self.hand_out(tier.get_finished_jobs(), step, time.perf_counter())
            next_at = pace(next_at)
        else:
            raise RuntimeError(f"{self.contender} {self.n:,} {self.order}: {owed} results "
                               "never handed out")
        return {
            "contender": self.contender, "n": self.n, "order": self.order, "ends": self.ends,
            "steps": steps, "finishing_per_step": self.per_step,
            "step_ms": spread(timed["step"], 1e3),
            "done_to_result_ms": spread(self.latencies, 1e3),
            "done_to_result_steps": spread(self.latency_steps),
            "checks_per_step": checks / steps,
            "submits_ms": spread(timed["submits"], 1e3),
            "engine_work_ms": spread(timed["engine_work"], 1e3),
        }

    def close(self) -> None:
        """Every transfer ends; the tier shuts down."""
        agent = self.agent
        agent.finish(len(agent.running), time.perf_counter(), "oldest", self.rng)
        self.tier.shutdown(timeout=600)


def run_files(contender: str, n: int) -> dict[str, Any]:
    """Real NIXL files in tmpfs: N one-block stores, 1 % submitted a step, then steps until
    every result is out."""
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    block_bytes = 4096
    primary = torch.zeros((n, block_bytes), dtype=torch.uint8)
    primary[:, 0] = 1
    jobs = [TransferJob(job_id, [f"k{job_id}"], [job_id]) for job_id in range(n)]
    per_step = max(1, int(n * FINISHING))
    agent = make_agent(f"step-bench-files-{n}-{contender.replace(' ', '-')}", "POSIX")
    with tempfile.TemporaryDirectory(prefix="kvfsm-step-", dir="/dev/shm") as root:
        tier = FileTier(primary, root, agent=agent, durable=False,
                        policy=CONTENDERS[contender](n))
        try:
            submitted: dict[int, tuple[float, int]] = {}
            step_seconds: list[float] = []
            latencies: list[float] = []
            latency_steps: list[float] = []
            out = step = 0
            start = next_at = time.perf_counter()
            while out < n:
                for job in jobs[step * per_step:(step + 1) * per_step]:
                    tier.submit_store(job)
                    submitted[job.job_id] = (time.perf_counter(), step)
                began = time.perf_counter()
                results = tier.get_finished_jobs()
                ended = time.perf_counter()
                step_seconds.append(ended - began)
                for result in results:
                    assert result.success, result
                    at, in_step = submitted[result.job_id]
                    latencies.append(ended - at)
                    latency_steps.append(float(step - in_step))
                out += len(results)
                step += 1
                next_at = pace(next_at)
                if ended - start > 120:
                    raise RuntimeError(f"files {n:,} {contender}: {out} of {n} out in 120 s")
            wall = time.perf_counter() - start
        finally:
            tier.shutdown(timeout=60)
    return {
        "contender": contender, "n": n, "submitted_per_step": per_step,
        "steps": len(step_seconds), "wall_ms": wall * 1e3,
        "step_ms": spread(step_seconds, 1e3),
        "submit_to_result_ms": spread(latencies, 1e3),
        "submit_to_result_steps": spread(latency_steps),
    }


def paced_table(rows: list[dict[str, Any]]) -> str:
    base: dict[tuple[str, int], float] = {}
    cells = []
    for row in rows:
        step, lat, lst = row["step_ms"], row["done_to_result_ms"], row["done_to_result_steps"]
        key = (row["order"], row["ends"], row["n"])
        base.setdefault(key, step["median"])
        cells.append([row["order"], row["ends"], f"{row['n']:,}",
                      f"{row['finishing_per_step']:,}",
                      row["contender"], f"{step['median']:.3f}", f"{step['p99']:.3f}",
                      f"{step['median'] / base[key]:.3f}x",
                      f"{lat['median']:.3f}", f"{lat['p99']:.3f}", f"{lat['max']:.3f}",
                      f"{lst['median']:g}", f"{lst['p99']:g}", f"{lst['max']:g}",
                      f"{row['checks_per_step']:,.0f}",
                      f"{row['submits_ms']['median']:.3f}", f"{row['submits_ms']['p99']:.3f}",
                      f"{row['engine_work_ms']['median']:.2f}",
                      f"{row['engine_work_ms']['p99']:.2f}"])
    return table(["done first", "ending", "N in flight", "finishing a step", "contender",
                  "step ms, median", "p99", "vs every step",
                  "DONE to result ms, median", "p99", "max",
                  "in steps, median", "p99", "max", "state checks a step",
                  "submits ms, median", "p99", "engine work ms, median", "p99"], cells)


def files_table(rows: list[dict[str, Any]]) -> str:
    cells = []
    for row in rows:
        step, lat, lst = row["step_ms"], row["submit_to_result_ms"], row["submit_to_result_steps"]
        cells.append([f"{row['n']:,}", f"{row['submitted_per_step']:,}", row["contender"],
                      f"{row['steps']:,}", f"{step['median']:.3f}", f"{step['p99']:.3f}",
                      f"{step['max']:.3f}", f"{lat['median']:.3f}", f"{lat['p99']:.3f}",
                      f"{lat['max']:.3f}", f"{lst['median']:g}", f"{lst['p99']:g}",
                      f"{lst['max']:g}"])
    return table(["jobs", "submitted a step", "contender", "steps", "step ms, median", "p99",
                  "max", "submit to result ms, median", "p99", "max", "in steps, median",
                  "p99", "max"], cells)


def plot(info: dict[str, str], rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only needed for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    styles = {("every step", "oldest"): ("C3", "s", "-"),
              ("every step", "random"): ("C3", "s", ":"),
              ("schedule", "oldest"): ("C0", "o", "-"),
              ("schedule", "random"): ("C0", "o", ":"),
              ("progress thread", "oldest"): ("C2", "^", "-"),
              ("progress thread", "random"): ("C2", "^", ":"),
              (TIGHT, "random"): ("C1", "v", ":"),
              (EVERYTHING, "random"): ("C4", "D", ":")}
    sizes = sorted({row["n"] for row in rows})
    for (contender, order), (color, marker, line) in styles.items():
        mine = sorted((row for row in rows if row["contender"] == contender
                       and row["order"] == order and row["ends"] == "before"),
                      key=lambda row: row["n"])
        if not mine:
            continue
        label = f"{contender}, {order} done first"
        xs = [row["n"] for row in mine]
        left.plot(xs, [row["step_ms"]["median"] for row in mine], color=color, marker=marker,
                  linestyle=line, label=label)
        right.plot(xs, [row["done_to_result_ms"]["p99"] for row in mine], color=color,
                   marker=marker, linestyle=line, label=label)
    for row in rows:
        if row["contender"].endswith("collector off"):
            label = f"{row['contender']}, {row['order']} done first"
            left.plot([row["n"]], [row["step_ms"]["median"]], color="C0", marker="*",
                      markersize=12, linestyle="none", label=label)
            right.plot([row["n"]], [row["done_to_result_ms"]["p99"]], color="C0", marker="*",
                       markersize=12, linestyle="none", label=label)
    left.axhline(1.0, color="k", linewidth=0.8, linestyle="--", label="target: 1 ms")
    left.set(xscale="log", yscale="log", xlabel="transfers in flight (N), 1 % ending a step",
             ylabel="get_finished_jobs() on the caller's thread (ms, median)",
             title="A scheduler step")
    right.set(xscale="log", yscale="log", xlabel="transfers in flight (N), 1 % ending a step",
              ylabel="NIXL's DONE to the result handed out (ms, p99)",
              title="How long a finished transfer waits")
    for axes in (left, right):
        axes.set_xticks(sizes, [f"{n:,}" for n in sizes])
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8, loc="upper left")
    figure.suptitle(f"kvfsm {info['kvfsm']}, a state check costing real NIXL's; "
                    f"{info['nproc']} x {info['cpu']}, {info['python']}", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N up to 10,000, fewer steps")
    args = parser.parse_args()
    info = machine()
    print_machine(info)
    real = RealCheck()
    check_ns = real.cost_ns()
    print(f"real NIXL check_xfer_state (POSIX, a finished transfer): {check_ns} ns a call; "
          "each state check of the paced agent makes one")
    sizes = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)
    steps = 30 if args.quick else 100
    rows = []
    for order, ends in (("oldest", "before"), ("random", "before"), ("oldest", "during")):
        for n in sizes:
            for contender in CONTENDERS:
                rows.append(run(real, contender, n, steps, order, ends=ends))
                print(f"  {order} {ends} {n:,} {contender}: "
                      f"{rows[-1]['step_ms']['median']:.3f} ms a step", flush=True)
    for contender in (TIGHT, EVERYTHING):  # out of order, every transfer checked on the
        for n in sizes:  # progress thread once a step, or on every poll
            rows.append(run(real, contender, n, steps, "random"))
            print(f"  random before {n:,} {contender}: "
                  f"{rows[-1]['step_ms']['median']:.3f} ms a step", flush=True)
    if not args.quick:  # what the collector's pauses cost the sweep's bound
        rows.append(run(real, "schedule", sizes[-1], steps, "random", collector=False))
    real.close()
    files = []
    for n in (1_000,) if args.quick else (1_000, 10_000):
        for contender in CONTENDERS:
            files.append(run_files(contender, n))
            print(f"  files {n:,} {contender}: {files[-1]['steps']} steps, "
                  f"{files[-1]['wall_ms']:.1f} ms", flush=True)
    report = "\n".join([
        "machine: " + ", ".join(f"{key} {value}" for key, value in info.items()), "",
        f"A step with N in flight, 1 % ending a step: the zero-cost agent, each state check "
        f"making one real NIXL check_xfer_state ({check_ns:,} ns a call here)", "",
        paced_table(rows),
        "Real NIXL files in /dev/shm (POSIX): one-block stores of 4 KiB, 1 % of the jobs "
        "submitted before each step, until every result is out", "",
        files_table(files)])
    print()
    print(report)
    suffix = "-quick" if args.quick else ""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"step{suffix}.md").write_text(report)
    out = RESULTS / f"step{suffix}.json"
    out.write_text(json.dumps({"machine": info, "check_ns": check_ns, "rows": rows,
                               "files": files}, indent=2))
    plot_path = RESULTS / "step-quick.png" if args.quick else ROOT / "docs" / "step.png"
    plot(info, rows, plot_path)
    print(f"\nraw figures: {out.relative_to(ROOT)}; plot: {plot_path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
