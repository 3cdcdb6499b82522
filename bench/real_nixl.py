"""kvfsm on real NIXL against a bare script making the same NIXL calls.

Two workloads, each a 256 x 64 KiB KV cache (16 MiB) stored out and loaded back in jobs of 16
blocks (and, for files, of 1 block too, where per-transfer cost weighs most):

* files: :class:`kvfsm.tiers.FileTier` (``durable=False``, as ``kvfsm demo`` runs it) on NIXL's
  POSIX backend, in a directory on ``/dev/shm`` (a tmpfs) when there is one, against a bare
  script that opens the same temporary files, makes the same NIXL calls (register, prep, make,
  post, poll, release, release the list, deregister), renames each finished store into place
  and closes the files;
* object store: :class:`kvfsm.tiers.ObjectStoreTier` on NIXL's OBJ backend against an S3 server
  (moto) this script starts on a free 127.0.0.1 port and stops at the end, against the bare
  script's OBJ calls, and the hand-written loop (``handloop.py``) on the same agent.

The one-block file jobs run once more with each contender on an agent whose lifecycle calls
(register to deregister) are timed: how much of each phase is NIXL's, how much the rest (Python,
and the file calls both contenders make), and what the rest of kvfsm's could be a transfer for
kvfsm to be 0.95x the bare script.

Every contender submits all jobs of a phase, then polls until every job finished, sleeping the
tier's ``poll_interval`` (0.5 ms) between polls; a poll asks NIXL about every pending transfer
first and then finishes those that are done, as the tiers do. The loads are checked byte for
byte (untimed).
The inputs are built before the clock starts: the bare script's block lists, and the tiers'
``TransferJob`` requests (an engine has them before it calls a tier). Before each timed phase
the script calls ``os.sync()``, so that no contender's stores wait for the kernel to write back
the dirty pages of the run before it (without it, file stores varied by up to 3x between
contenders making the same calls).
Runs alternate between contenders so drift hits all alike, and between runs the garbage
collector is run (untimed): a tier and its driver are in reference cycles, so a dropped NIXL
agent is torn down by the collector, and a teardown that lands in the next contender's timed
phase cost it up to 65 ms (the bare script's 16-block file stores measured 47 ms instead of
12). Prints the median throughput of each phase and the ratio to the bare script.

Usage: ``.venv/bin/python bench/real_nixl.py [--quick]``
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, machine, median, print_machine, ratio, table
from handloop import HandTier

from kvfsm.agent import LOCAL_AGENT
from kvfsm.nixl_agents import StoreConfig, make_agent, nixl_available
from kvfsm.tiers import FileTier, ObjectStoreTier
from kvfsm.transfer import TransferJob

BLOCK_BYTES = 64 * 1024
POLL_INTERVAL = 0.0005
#: where the file workload's blocks go: a tmpfs when there is one, so that what is measured is
#: kvfsm and NIXL, not the machine's disk (on this VM's disk, identical 16 MiB stores took
#: anywhere from 11 to 70 ms as the kernel wrote dirty pages back)
FILES_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
ACCESS_KEY, SECRET_KEY = "bench-access", "bench-secret"
_names = itertools.count()


def _agent_name(what: str) -> str:
    return f"bench-{what}-{os.getpid()}-{next(_names)}"


def groups(blocks: int, per_job: int) -> list[list[int]]:
    return [list(range(s, min(s + per_job, blocks))) for s in range(0, blocks, per_job)]


# -- the bare scripts: the NIXL calls a transfer needs, and nothing else -----------------------

class BareFiles:
    """Files: the same files, NIXL calls and renames as the file tier, without the tier."""

    def __init__(self, cache: torch.Tensor, root: Path, agent: Any) -> None:
        self.cache, self.root, self.agent = cache, root, agent
        self.directory = os.path.join(root, "")
        blocks, size = cache.shape[0], cache[0].nbytes
        base = cache.data_ptr()
        self.size = size
        self.dram = agent.register_memory([(base, blocks * size, 0, "")], "DRAM")
        self.local = agent.prep_xfer_dlist(
            LOCAL_AGENT, [(base + i * size, size, 0) for i in range(blocks)], "DRAM")

    mem_type = "FILE"

    def remote(self, blocks: list[int], load: bool
               ) -> tuple[list[tuple[int, int, int, str]], list[int], list[tuple[str, str]]]:
        """A job's remote descriptors, the files opened for them, and the renames of a store."""
        fds, renames = [], []
        for block in blocks:
            final = f"{self.directory}block-{block}"  # text, not pathlib: ~1 us a file less
            if load:
                fds.append(os.open(final, os.O_RDONLY | os.O_CLOEXEC))
            else:
                partial = final + ".partial"
                fds.append(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                                   | os.O_CLOEXEC, 0o644))
                renames.append((partial, final))
        return [(0, self.size, fd, "") for fd in fds], fds, renames

    def phase(self, jobs: list[list[int]], load: bool) -> None:
        agent = self.agent
        pending = []
        for blocks in jobs:
            descs, fds, renames = self.remote(blocks, load)
            files = agent.register_memory(descs, self.mem_type)
            remote = agent.prep_xfer_dlist(agent.name, files.trim())
            xfer = agent.make_prepped_xfer("READ" if load else "WRITE", self.local, blocks,
                                           remote, list(range(len(blocks))))
            status = agent.transfer(xfer)
            if status not in ("PROC", "DONE"):
                raise RuntimeError(f"transfer() answered {status}")
            pending.append((xfer, remote, files, fds, renames))
        while pending:
            answers = [agent.check_xfer_state(entry[0]) for entry in pending]  # all, then finish
            still = []
            for entry, status in zip(pending, answers, strict=True):
                xfer, remote, files, fds, renames = entry
                if status == "PROC":
                    still.append(entry)
                    continue
                if status != "DONE":
                    raise RuntimeError(f"check_xfer_state answered {status}")
                for partial, final in renames:
                    os.replace(partial, final)
                agent.release_xfer_handle(xfer)
                agent.release_dlist_handle(remote)
                agent.deregister_memory(files)
                for fd in fds:
                    os.close(fd)
            pending = still
            if pending:
                time.sleep(POLL_INTERVAL)

    def close(self) -> None:
        self.agent.release_dlist_handle(self.local)
        self.agent.deregister_memory(self.dram)


class BareObjects(BareFiles):
    """Objects: the object tier's NIXL calls, without the tier."""

    mem_type = "OBJ"

    def __init__(self, cache: torch.Tensor, agent: Any, prefix: str) -> None:
        super().__init__(cache, Path(), agent)
        self.prefix = prefix
        self.dev_ids = itertools.count(1 << 30)  # apart from the tiers' ids

    def remote(self, blocks: list[int], load: bool
               ) -> tuple[list[tuple[int, int, int, str]], list[int], list[tuple[str, str]]]:
        """One object per block; nothing opened, nothing to rename."""
        return ([(0, self.size, next(self.dev_ids), f"{self.prefix}block-{b}") for b in blocks],
                [], [])


# -- the tiers, driven the way an engine drives them -------------------------------------------

def tier_phase(tier: Any, jobs: list[list[int]], load: bool,
               first_id: int) -> Callable[[], None]:
    """The phase, ready to run: its jobs are the engine's input, built before the clock starts
    (as the bare script's block lists are)."""
    submit = tier.submit_load if load else tier.submit_store
    requests = [TransferJob(first_id + offset, [f"block-{b}" for b in blocks], blocks,
                            is_promotion=load) for offset, blocks in enumerate(jobs)]

    def run() -> None:
        for request in requests:
            submit(request)
        published = 0
        while True:
            results = tier.get_finished_jobs()
            for result in results:
                if not result.success:
                    raise RuntimeError(f"job {result.job_id} failed")
            published += len(results)
            if published == len(jobs):
                return
            time.sleep(POLL_INTERVAL)

    return run


def bare_phase(bare: BareFiles) -> Phase:
    return lambda jobs, load: lambda: bare.phase(jobs, load)


# -- one run: store, wipe, load, verify --------------------------------------------------------

#: makes a phase ready to run: (jobs, load) -> run
Phase = Callable[[list[list[int]], bool], Callable[[], None]]


def one_run(cache: torch.Tensor, original: torch.Tensor, jobs: list[list[int]],
            phase: Phase) -> tuple[float, float]:
    """Seconds to store every block and to load every block back (verified)."""
    cache.copy_(original)
    run = phase(jobs, False)
    os.sync()  # untimed: no phase waits on another one's dirty pages being written back
    started = time.perf_counter()
    run()
    stored = time.perf_counter() - started
    cache.zero_()
    run = phase(list(reversed(jobs)), True)
    os.sync()
    started = time.perf_counter()
    run()
    loaded = time.perf_counter() - started
    if not torch.equal(cache, original):
        raise RuntimeError("loaded blocks differ from the stored ones")
    return stored, loaded


def run_files(blocks: int, per_job: int, repeats: int,
              timed: bool = False) -> dict[str, list[tuple[float, ...]]]:
    """Per run and contender: (store seconds, load seconds); with ``timed``, each contender's
    agent times its lifecycle calls: (store seconds, of which in NIXL's calls, load seconds,
    of which in NIXL's calls)."""
    cache = torch.zeros(blocks, BLOCK_BYTES, dtype=torch.uint8)
    original = torch.randint(0, 256, cache.shape, dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(1))
    jobs = groups(blocks, per_job)
    samples: dict[str, list[tuple[float, ...]]] = {"kvfsm FileTier": [], "bare script": []}
    for repeat in range(repeats):
        order = list(samples) if repeat % 2 == 0 else list(reversed(samples))
        for name in order:
            with tempfile.TemporaryDirectory(prefix="kvfsm-bench-", dir=FILES_DIR) as root:
                samples[name].append(_files_run(name, cache, original, jobs, root, timed))
            gc.collect()  # a dropped agent is torn down now, not in another contender's phase
    return samples


def _files_run(name: str, cache: torch.Tensor, original: torch.Tensor, jobs: list[list[int]],
               root: str, timed: bool) -> tuple[float, ...]:
    agent = make_agent(_agent_name("posix"), "POSIX")
    clock = TimedAgent(agent) if timed else None
    agent = clock or agent
    contender = (BareFiles(cache, Path(root), agent) if name == "bare script"
                 else FileTier(cache, root, agent=agent, durable=False))
    return _measure(contender, cache, original, jobs, clock)


def _measure(contender: Any, cache: torch.Tensor, original: torch.Tensor,
             jobs: list[list[int]], clock: TimedAgent | None = None) -> tuple[float, ...]:
    """One run of a bare script or a tier; closes it (shuts the tier down) after. With the
    timed agent ``clock``, each phase's seconds in NIXL's calls follow its seconds."""
    bare = isinstance(contender, BareFiles)
    phase = bare_phase(contender) if bare else _tier_phases(contender)
    in_nixl: list[float] = []
    if clock is not None:
        phase = _nixl_seconds(phase, clock, in_nixl)
    stored, loaded = one_run(cache, original, jobs, phase)
    if bare:
        contender.close()
    else:
        contender.shutdown()
    if clock is None:
        return stored, loaded
    store_nixl, load_nixl = in_nixl
    return stored, store_nixl, loaded, load_nixl


def _nixl_seconds(phase: Phase, clock: TimedAgent, into: list[float]) -> Phase:
    """``phase``, each run of it appending to ``into`` the seconds it spent in NIXL's calls."""
    def ready(jobs: list[list[int]], load: bool) -> Callable[[], None]:
        run = phase(jobs, load)

        def timed() -> None:
            clock.seconds = 0.0
            run()
            into.append(clock.seconds)
        return timed
    return ready


class S3Server:
    """A moto S3 server on a free 127.0.0.1 port, started and stopped by this script."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.process.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto server did not listen within 30 s") from None
                time.sleep(0.05)

    def new_bucket(self) -> str:
        import boto3  # noqa: PLC0415 - only this workload needs it

        bucket = f"kvfsm-bench-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                     aws_secret_access_key=SECRET_KEY,
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        return bucket

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


def run_objects(blocks: int, per_job: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    cache = torch.zeros(blocks, BLOCK_BYTES, dtype=torch.uint8)
    original = torch.randint(0, 256, cache.shape, dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(2))
    jobs = groups(blocks, per_job)
    samples: dict[str, list[tuple[float, float]]] = {
        "kvfsm ObjectStoreTier": [], "hand-written loop (b)": [], "bare script": []}
    server = S3Server()
    try:
        store = StoreConfig(server.new_bucket(), endpoint=server.endpoint,
                            access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        for repeat in range(repeats):
            order = list(samples)[repeat % 3:] + list(samples)[:repeat % 3]
            for name in order:
                prefix = f"r{repeat}/{name.split()[0]}/"
                samples[name].append(_objects_run(name, cache, original, jobs, store, prefix))
                gc.collect()  # as for files: agents are torn down between runs, untimed
    finally:
        server.stop()
    return samples


def _objects_run(name: str, cache: torch.Tensor, original: torch.Tensor,
                 jobs: list[list[int]], store: StoreConfig, prefix: str) -> tuple[float, float]:
    agent = make_agent(_agent_name("obj"), "OBJ", store.backend_params())
    contender: Any = (
        BareObjects(cache, agent, prefix) if name == "bare script"
        else ObjectStoreTier(cache, agent=agent, key_prefix=prefix) if name.startswith("kvfsm")
        else HandTier(cache, agent=agent, key_prefix=prefix))
    return _measure(contender, cache, original, jobs)


# -- where a one-block file transfer's time goes: NIXL's calls, and the rest ---------------------

class TimedAgent:
    """A NIXL agent whose calls of a transfer's lifecycle are timed: ``seconds`` sums them."""

    CALLS = ("register_memory", "prep_xfer_dlist", "make_prepped_xfer", "transfer",
             "check_xfer_state", "release_xfer_handle", "release_dlist_handle",
             "deregister_memory")

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.seconds = 0.0
        for name in self.CALLS:
            setattr(self, name, self._timed(getattr(agent, name)))

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += clock() - start
        return timed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


def _tier_phases(tier: Any) -> Phase:
    """Makes a tier's phases ready to run, each with job ids of its own."""
    ids = itertools.count()
    return lambda jobs, load: tier_phase(tier, jobs, load, next(ids) * len(jobs))


def summarize_split(title: str, jobs: int, samples: dict[str, list[tuple[float, ...]]]) -> str:
    rows = []
    medians = {name: [median([run[i] for run in runs]) for i in range(4)]
               for name, runs in samples.items()}
    bare = medians["bare script"]
    for name, figures in medians.items():
        for offset, what in ((0, "store"), (2, "load")):
            total, nixl = figures[offset], figures[offset + 1]
            # kvfsm at 0.95x the bare script, its NIXL calls as they are: what is left for
            # the rest (its Python, its file calls) a transfer
            allowed = (bare[offset] / 0.95 - nixl) / jobs
            rows.append([name, what, f"{total * 1e3:.1f}", f"{nixl * 1e3:.1f}",
                         f"{(total - nixl) * 1e3:.1f}", f"{(total - nixl) / jobs * 1e6:.1f}",
                         f"{nixl / total:.0%}", f"{allowed * 1e6:.1f}"])
    return table(["contender", "phase", "ms", "in NIXL's calls ms", "the rest ms",
                  "the rest a transfer us", "NIXL's share", "the rest at 0.95x us"],
                 rows, title)


def summarize(title: str, nbytes: int, samples: dict[str, list[tuple[float, float]]]) -> str:
    mib = nbytes / 2**20
    medians = {name: (median([s for s, _ in runs]), median([ld for _, ld in runs]))
               for name, runs in samples.items()}
    bare = medians["bare script"]
    rows = []
    for name, (stored, loaded) in medians.items():
        rows.append([name, f"{mib / stored:,.0f}", ratio(bare[0], stored), f"{mib / loaded:,.0f}",
                     ratio(bare[1], loaded), f"{stored * 1e3:,.1f}", f"{loaded * 1e3:,.1f}",
                     str(len(samples[name]))])
    return table(["contender", "store MiB/s", "vs bare", "load MiB/s", "vs bare", "store ms",
                  "load ms", "runs"], rows, title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run of seconds: fewer blocks "
                        "and repeats (writes *-quick files)")
    args = parser.parse_args()
    logging.getLogger("kvfsm").setLevel(logging.ERROR)
    if not nixl_available():
        print("NIXL is not installed (scripts/setup installs nixl-cu12==1.5.1)", file=sys.stderr)
        return 2
    info = machine()
    print_machine(info)
    blocks = 256
    file_repeats, object_repeats, object_blocks = (3, 1, 32) if args.quick else (15, 5, 256)
    suffix = "-quick" if args.quick else ""
    out = ["machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), ""]
    raw: dict[str, Any] = {"machine": info}
    for per_job in (16, 1):
        samples = run_files(blocks, per_job, file_repeats)
        title = (f"Files, NIXL POSIX, in {FILES_DIR or tempfile.gettempdir()}: {blocks} x "
                 f"64 KiB in jobs of {per_job} block(s), store then load (medians)")
        out.append(summarize(title, blocks * BLOCK_BYTES, samples))
        raw[f"files_{per_job}"] = samples
        print(out[-1], flush=True)
    split = run_files(blocks, 1, file_repeats, timed=True)
    title = (f"One-block file jobs ({blocks} x 64 KiB, in {FILES_DIR or tempfile.gettempdir()}), "
             "NIXL's calls timed inside each contender (medians; the rest: Python, and the "
             "file calls both make; the last column: the rest a transfer kvfsm could spend and "
             "still be 0.95x the bare script)")
    out.append(summarize_split(title, blocks, split))
    raw["files_1_split"] = split
    print(out[-1], flush=True)
    samples = run_objects(object_blocks, 16, object_repeats)
    title = (f"Object store, NIXL OBJ on a local S3 server (moto): {object_blocks} x 64 KiB in "
             "jobs of 16 blocks (medians)")
    out.append(summarize(title, object_blocks * BLOCK_BYTES, samples))
    raw["objects_16"] = samples
    print(out[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"real_nixl{suffix}.md").write_text("\n".join(out))
    (RESULTS / f"real_nixl{suffix}.json").write_text(json.dumps(raw, indent=1))
    print(f"wrote {RESULTS / f'real_nixl{suffix}.md'} and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
