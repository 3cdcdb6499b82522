"""kvfsm's object-store tier against vLLM's own OBJ tier, both under vLLM 0.33's real manager.

Both tiers are built the way vLLM builds them (``OffloadingConfig`` ->
``TieringOffloadingSpec(...).get_manager()``, tests/vllm_engine.py's ``Engine``), with the same
manager configuration, and driven the way vLLM's scheduler-side connector drives the manager:

* (a) kvfsm: ``{"type": "ObjectStoreTier", "module_path": "kvfsm.vllm", ...}``, driving a
  NIXL agent the bench made (``agent=``), with a real agent of its own for lookups
  (``probe_agent=``);
* (b) vLLM: ``{"type": "obj", "prefix": ..., "store_config": {...}}``, whose NIXL agent
  (``tier._agent``, also what its async lookup thread queries through) is replaced by the
  bench's wrapper once the manager is built.

Both talk to a local moto S3 server this script starts and stops (a new bucket per run), with
4 OBJ I/O threads each (vLLM's default). Otherwise each agent keeps its tier's own settings:
vLLM's has NIXL's progress thread and telemetry on, kvfsm's (``make_agent``) no progress
thread and ``req_checksum=required``. kvfsm's tier gets ``retry={"max_seconds": 5}``: its
default bound on a release that keeps failing (60 s) is longer than this bench's 20 s limit.
The agent each tier drives is wrapped in :class:`kvfsm.testing.FaultyAgent` (which injects the
faults), extended to count the handles NIXL really made and released, and the transfer handles
released while NIXL had not yet said their transfer was over.

Fault table (4 KiB chunks, a 4-chunk primary): per scenario and tier, one process forked from
this one (vLLM is imported once, before the forks), killed if it runs past its limit, so a
hang or a crash of NIXL is a result, not the end of the bench. In each: 6 rounds of 4 stores of
2 blocks (each evicting older blocks from the primary; each store's job waited for up to 1 s)
and 2 promotions of the round's evicted blocks (looked up for up to 5 s; every block read back
is compared with what was stored), the faults armed on the tier's agent before the first
round; then steps until every job came back or 20 s passed (jobs not back then are lost;
chunks pinned are counted then); then ``reset_cache()`` (10 s at most) and ``shutdown()`` (40 s
at most, past kvfsm's own 30 s bound), each on a thread so that a hang is reported with where
it hung; then 2 s before the process exits, so that a crash of a NIXL thread after shutdown
shows in its exit status. The S3 scenario kills the server (SIGKILL) right after a round's
stores were submitted and goes on stepping (no restart). An extra scenario, not in issue 17's
list, calls ``shutdown()`` right after two stores were submitted, with no step between.

Throughput (no faults; 256 KiB chunks, a 16-chunk primary, 4 MiB): both tiers in one process,
repetitions interleaved (the order alternating); in each, two store phases of 8 jobs of 2 chunks
(the second evicts the first from the primary) and a load phase promoting the first phase's 16
blocks in 8 requests; bytes checked. Store and load are timed from a phase's first submit to
its last job's result (the bench's wrapper sees both), fetch from the first lookup to the bytes
in hand (vLLM's tier answers RETRY until its lookup thread asked S3). Best of the repetitions,
medians beside them.

Usage: ``.venv/bin/python bench/vllm_tiers.py [--reps N] [--only TEXT] [--no-faults]
[--no-throughput]``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, print_machine, ratio, table
from kvfsm.nixl_agents import StoreConfig, make_agent, nixl_available
from kvfsm.testing import FaultyAgent, Raise, ReturnErr
from kvfsm.testing.faults import Fault
from tests import vllm_engine
from tests.real_nixl import ACCESS_KEY, SECRET_KEY, S3Server, free_port

# vLLM's import chain warns about torch APIs it uses; importing it here, once, lets every
# scenario's process (forked from this one) start without the ~12 s import
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import vllm.v1.kv_offload.tiering.obj.manager
    import vllm.v1.kv_offload.tiering.spec  # noqa: F401 - what the Engine builds with
    from vllm.v1.kv_offload.base import (
        LookupResult,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )

    import kvfsm.vllm  # noqa: F401 - the tier vLLM loads by module path

KVFSM, VLLM = "kvfsm", "vLLM obj"
IO_THREADS = 4  # vLLM's OBJ tier's default (its io_threads); kvfsm's agent gets the same
#: kvfsm's retry policy (the tier's ``retry`` setting); None: its default
KVFSM_RETRY: dict[str, Any] | None = {"max_seconds": 5.0}

FAULT_CHUNK, FAULT_PRIMARY = 4096, 4
ROUNDS = 6  # per round: 4 stores of 2 blocks, 2 promotions of 2 blocks
KILL_ROUND = 2  # the S3 scenario kills the server after this round's second store is submitted
STEP = 0.001  # seconds between two scheduler steps
WAIT_STORE = 1.0  # seconds a store's job is waited for before the workload goes on
LOOKUP_LIMIT = 5.0  # seconds a fetch looks its keys up before it takes what it has
SETTLE_LIMIT = 20.0  # seconds after the workload for every job to come back
RESET_LIMIT = 10.0  # seconds reset_cache() gets
#: seconds shutdown() gets: past kvfsm's own bound (the adapter's shutdown_timeout, 30 s)
SHUTDOWN_LIMIT = 40.0
RUN_LIMIT = 150.0  # the whole run's process is killed past this

THROUGHPUT_CHUNK, THROUGHPUT_PRIMARY = 256 * 1024, 16
PER_REQUEST = 2  # blocks per request: one job each

FOREVER = 10**9
SCENARIOS: list[tuple[str, list[tuple[str, Fault, int]]]] = [
    ("no fault", []),
    ("release_xfer_handle raises x3", [("release_xfer_handle", Raise(), 3)]),
    ("release_xfer_handle raises forever", [("release_xfer_handle", Raise(), FOREVER)]),
    ("check_xfer_state raises x3", [("check_xfer_state", Raise(), 3)]),
    ("check_xfer_state answers ERR x3", [("check_xfer_state", ReturnErr(), 3)]),
    ("make_prepped_xfer raises x3", [("make_prepped_xfer", Raise(), 3)]),
    ("transfer raises x3", [("transfer", Raise(), 3)]),
    ("register_memory raises x3", [("register_memory", Raise(), 3)]),
    ("release_dlist_handle + deregister_memory raise x3",
     [("release_dlist_handle", Raise(), 3), ("deregister_memory", Raise(), 3)]),
    ("S3 server killed mid-run", []),
    ("(extra) shutdown() with 2 stores in flight, no step", []),
]
KILL = "S3 server killed mid-run"
IN_FLIGHT = SCENARIOS[-1][0]
LINGER = 2.0  # seconds a run waits after shutdown() before it exits (a late crash shows)


# -- the agent each tier drives: faults, and the handles NIXL really made and released ------------

class CountingAgent(FaultyAgent):
    """A FaultyAgent that also counts the calls that succeeded, and transfer handles released
    while NIXL had not yet said their transfer was over."""

    def __init__(self, agent: Any, made_before: dict[str, int] | None = None) -> None:
        super().__init__(agent)
        #: successful calls (and handles made before the wrap, for vLLM's tier)
        self.ok: Counter[str] = Counter(made_before or {})
        self._posted: set[int] = set()
        self._ended: set[int] = set()
        self.released_running = 0

    def _counted(self, call: str, result: Any) -> Any:
        if call == "deregister_memory" or result is not None:  # a make: a handle came back
            self.ok[call] += 1
        return result

    def register_memory(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted("register_memory", super().register_memory(*args, **kwargs))

    def deregister_memory(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted("deregister_memory", super().deregister_memory(*args, **kwargs))

    def prep_xfer_dlist(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted("prep_xfer_dlist", super().prep_xfer_dlist(*args, **kwargs))

    def release_dlist_handle(self, handle: Any) -> None:
        super().release_dlist_handle(handle)
        self.ok["release_dlist_handle"] += 1

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted("make_prepped_xfer", super().make_prepped_xfer(*args, **kwargs))

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> str:
        status = super().transfer(handle, *args, **kwargs)
        if status in ("PROC", "DONE"):
            self._posted.add(id(handle))
            if status == "DONE":
                self._ended.add(id(handle))
        return status

    def check_xfer_state(self, handle: Any) -> str:
        try:
            status = super().check_xfer_state(handle)
        except Exception:
            self._ended.add(id(handle))  # FaultyAgent raises only once NIXL answered
            raise
        if status != "PROC":
            self._ended.add(id(handle))
        return status

    def release_xfer_handle(self, handle: Any) -> None:
        key = id(handle)
        running = key in self._posted and key not in self._ended
        super().release_xfer_handle(handle)
        self.ok["release_xfer_handle"] += 1
        self.released_running += running
        self._posted.discard(key)
        self._ended.discard(key)

    def leaks(self) -> dict[str, int]:
        ok = self.ok
        return {"xfer": ok["make_prepped_xfer"] - ok["release_xfer_handle"],
                "dlist": ok["prep_xfer_dlist"] - ok["release_dlist_handle"],
                "reg": ok["register_memory"] - ok["deregister_memory"],
                "released_running": self.released_running}


# -- what the tier was given and what it answered -----------------------------------------------

@dataclass
class Record:
    """Jobs the manager gave the tier and the results the tier handed back (seen by wrappers
    around the tier's own methods), and what escaped the manager's calls."""

    chunk: int
    kinds: dict[int, str] = field(default_factory=dict)
    submitted_at: dict[int, float] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    reports: Counter[int] = field(default_factory=Counter)
    reported_at: dict[int, float] = field(default_factory=dict)
    success: dict[int, bool] = field(default_factory=dict)
    escaped: list[str] = field(default_factory=list)

    def submit(self, job: Any, kind: str) -> None:
        self.kinds[job.job_id] = kind
        self.submitted_at[job.job_id] = time.perf_counter()
        self.sizes[job.job_id] = len(job.chunk_ids) * self.chunk

    def report(self, results: Iterable[Any]) -> None:
        now = time.perf_counter()
        for result in results:
            self.reports[result.job_id] += 1
            self.reported_at.setdefault(result.job_id, now)
            self.success[result.job_id] = bool(result.success)

    def escape(self, call: str, error: BaseException) -> None:
        self.escaped.append(f"{call}: {describe(error)}")

    def done(self, ids: Iterable[int]) -> bool:
        return all(job_id in self.reports for job_id in ids)

    def counts(self) -> dict[str, Any]:
        submitted = set(self.kinds)
        duplicated = sum(n - 1 for n in self.reports.values()) + sum(
            1 for job_id in self.reports if job_id not in submitted)
        return {"submitted": len(submitted),
                "reported": sum(1 for job_id in submitted if job_id in self.reports),
                "failed": sum(1 for job_id in submitted if self.success.get(job_id) is False),
                "lost": sum(1 for job_id in submitted if job_id not in self.reports),
                "duplicated": duplicated, "escaped": len(self.escaped),
                "first_escape": self.escaped[0] if self.escaped else ""}


def instrument(tier: Any, record: Record) -> None:
    """Record every job the manager submits to ``tier`` and every result it hands back."""
    store, load, finished = tier.submit_store, tier.submit_load, tier.get_finished_jobs

    def submit_store(job: Any) -> None:
        record.submit(job, "store")
        store(job)

    def submit_load(job: Any) -> None:
        record.submit(job, "load")
        load(job)

    def get_finished_jobs() -> list[Any]:
        results = list(finished())
        record.report(results)
        return results

    tier.submit_store, tier.submit_load = submit_store, submit_load
    tier.get_finished_jobs = get_finished_jobs


# -- building the manager ------------------------------------------------------------------------

def build(kind: str, endpoint: str, chunk: int, primary: int) -> tuple[Any, CountingAgent]:
    """vLLM's manager with one secondary tier of ``kind`` (in a new bucket); the agent it
    drives."""
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    _client(endpoint).create_bucket(Bucket=bucket)
    vllm_engine.CHUNK_BYTES = chunk  # the Engine reads it for the chunk size
    if kind == KVFSM:
        store = StoreConfig(bucket, endpoint=endpoint, access_key=ACCESS_KEY,
                            secret_key=SECRET_KEY, io_threads=IO_THREADS)
        name = f"bench-kvfsm-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        agent = CountingAgent(make_agent(name, "OBJ", store.backend_params()))
        probe = make_agent(name + "-probe", "OBJ", store.backend_params())
        entry: dict[str, Any] = {
            "type": "ObjectStoreTier", "module_path": "kvfsm.vllm", "bucket": bucket,
            "endpoint": endpoint, "access_key": ACCESS_KEY, "secret_key": SECRET_KEY,
            "agent": agent, "probe_agent": probe}
        if KVFSM_RETRY is not None:
            entry["retry"] = KVFSM_RETRY
        engine = vllm_engine.Engine([entry], primary_chunks=primary)
        return engine, agent
    entry = {"type": "obj", "prefix": "bench", "io_threads": IO_THREADS,
             "store_config": {"bucket": bucket, "endpoint_override": endpoint,
                              "access_key": ACCESS_KEY, "secret_key": SECRET_KEY,
                              "region": "us-east-1", "scheme": "http"}}
    engine = vllm_engine.Engine([entry], primary_chunks=primary)
    (tier,) = engine.tier_objects
    # the constructor registered the primary and prepped its list on the bare agent
    made = {"register_memory": int(tier._primary_reg is not None),
            "prep_xfer_dlist": int(tier._dram_prepped_handle is not None)}
    agent = CountingAgent(tier._agent, made)
    tier._agent = agent  # its lookup thread queries through tier._agent too
    return engine, agent


def _client(endpoint: str) -> Any:
    server = S3Server(int(endpoint.rsplit(":", 1)[1]))
    return server.client()


# -- the scheduler, played -----------------------------------------------------------------------

class Driver:
    """Plays vLLM's connector on one manager: every call under the manager's lock, and an
    exception out of a call recorded (what would reach vLLM's scheduler) instead of raised."""

    def __init__(self, engine: Any, record: Record, chunk: int) -> None:
        self.engine, self.manager, self.record, self.chunk = engine, engine.manager, record, chunk
        self.new: list[str] = []
        #: keys a fetch still had no HIT or MISS for at its limit
        self.unsettled = 0

    def call(self, what: str, function: Callable[..., Any], *args: Any) -> Any:
        with self.manager.lock:
            try:
                return function(*args)
            except Exception as error:
                self.record.escape(what, error)
                return None

    def end_step(self) -> None:
        context = ScheduleEndContext(new_req_ids=list(self.new), preempted_req_ids=[])
        self.new = []
        self.call("on_schedule_end", self.manager.on_schedule_end, context)
        self.call("take_events", lambda: list(self.manager.take_events()))

    def request(self, req_id: str) -> Any:
        context = ReqContext(req_id=req_id)
        self.call("on_new_request", self.manager.on_new_request, context)
        self.new.append(req_id)
        return context

    def offload(self, requests: dict[str, dict[bytes, bytes]], *, lookup: bool = True
                ) -> list[int]:
        """Requests whose blocks the worker computed: stored in two steps (the second cascades
        them to the tier); the ids of the jobs the tier was given."""
        manager, before = self.manager, set(self.record.kinds)
        stored: dict[str, tuple[Any, list[bytes]]] = {}
        for req_id, blocks in requests.items():
            context = self.request(req_id)
            keys = list(blocks)
            if lookup:
                for key in keys:
                    self.call("lookup", manager.lookup, key, context)
            prepared = self.call("prepare_store", manager.prepare_store, keys, context)
            taken = [] if prepared is None else list(prepared.keys_to_store)
            if taken:
                view = self.engine.view
                for key, chunk_id in zip(taken, prepared.store_spec.chunk_ids, strict=True):
                    start = int(chunk_id) * self.chunk
                    view[start:start + self.chunk] = blocks[key]
                del view
            stored[req_id] = (context, taken)
        self.end_step()
        for context, taken in stored.values():
            if taken:
                self.call("complete_store", manager.complete_store, set(taken), context)
            self.call("on_request_finished", manager.on_request_finished, context)
        self.end_step()
        return [job_id for job_id in self.record.kinds if job_id not in before]

    def wait(self, ids: Iterable[int], limit: float) -> bool:
        """Step until the tier reported every job of ``ids``; False at the limit."""
        ids = list(ids)
        deadline = time.monotonic() + limit
        while not self.record.done(ids):
            if time.monotonic() >= deadline:
                return False
            self.end_step()
            time.sleep(STEP)
        return True

    def fetch(self, requests: dict[str, list[bytes]], limit: float) -> dict[bytes, bytes | None]:
        """Requests that need blocks: each looks its keys up every step until each is HIT or
        MISS (a tier HIT is promoted meanwhile), or until the limit; then loads its HITs.
        Each key's bytes, None when not loaded."""
        manager = self.manager
        contexts = {req_id: self.request(req_id) for req_id in requests}
        answers: dict[str, list[Any]] = {}
        pending = dict(requests)
        deadline = time.monotonic() + limit
        while pending:
            for req_id, keys in list(pending.items()):
                answers[req_id] = [self.call("lookup", manager.lookup, key, contexts[req_id])
                                   for key in keys]
                if all(a in (LookupResult.HIT, LookupResult.MISS) for a in answers[req_id]):
                    del pending[req_id]
            self.end_step()
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(STEP)
        found: dict[bytes, bytes | None] = {}
        self.unsettled += sum(len(keys) for keys in pending.values())
        for req_id, keys in requests.items():
            found.update(dict.fromkeys(keys))
            hits = [k for k, a in zip(keys, answers[req_id], strict=True)
                    if a is LookupResult.HIT]
            spec = self.call("prepare_load", manager.prepare_load, hits, contexts[req_id]) \
                if hits else None
            if spec is not None:
                view = self.engine.view
                for key, chunk_id in zip(hits, spec.chunk_ids, strict=True):
                    start = int(chunk_id) * self.chunk
                    found[key] = bytes(view[start:start + self.chunk])
                del view
                self.call("complete_load", manager.complete_load, hits, contexts[req_id])
            self.call("on_request_finished", manager.on_request_finished, contexts[req_id])
        self.end_step()
        return found


def key_of(seed: int) -> bytes:
    return make_offload_key(seed.to_bytes(32, "big"), 0)


def data(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


def timed(function: Callable[[], Any], limit: float) -> tuple[str, str]:
    """Run ``function`` on a thread for up to ``limit`` seconds: "ok", what it raised, or that
    it hung (the thread is left running); and, when it hung, where it was then."""
    box: dict[str, str] = {}

    started = time.monotonic()

    def run() -> None:
        try:
            function()
            took = time.monotonic() - started
            box["outcome"] = "ok" if took < 1 else f"ok after {took:.0f} s"
        except BaseException as error:
            box["outcome"] = f"raised {describe(error)}"

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if "outcome" in box:
        return box["outcome"], ""
    frame = sys._current_frames().get(thread.ident or -1)
    where = "" if frame is None else " < ".join(
        f"{Path(f.filename).name}:{f.lineno} {f.name}"
        for f in reversed(traceback.extract_stack(frame)[-4:]))
    return f"hung (> {limit:.0f} s)", where


def describe(error: BaseException) -> str:
    """The error's type and message; where it was raised when it has no message (a bare
    ``assert``)."""
    text = str(error)
    if not text:
        frames = traceback.extract_tb(error.__traceback__)
        if frames:
            text = f"at {Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].line}"
    return f"{type(error).__name__}: {_short(text, 70)}"


def _short(text: str, size: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= size else text[:size - 3] + "..."


# -- one fault scenario, in a process of its own -------------------------------------------------

class Checkpoints:
    """What a run saw, written to a file after each phase (a hang or a crash keeps the last).
    The job counts are those at the end of the settling; jobs reported later (while
    reset_cache or shutdown ran) are counted apart."""

    def __init__(self, path: str, record: Record) -> None:
        self.path, self.record = path, record
        self.agent: CountingAgent | None = None
        self.out: dict[str, Any] = {"phase": "build"}
        self.frozen = False
        self.save()

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as file:
            json.dump(self.out, file)
        os.replace(self.path + ".tmp", self.path)

    def freeze(self) -> None:
        self.out.update(self.record.counts())
        self.frozen = True

    def __call__(self, phase: str) -> None:
        out = self.out
        if not self.frozen:
            out.update(self.record.counts())
        else:
            out["late"] = self.record.counts()["reported"] - out["reported"]
        if self.agent is not None:
            out.update(self.agent.leaks())
        out["phase"] = phase
        self.save()


def fault_run(kind: str, scenario: str, endpoint: str, kill_pid: int | None,
              out_path: str) -> None:
    """The child's body: build, arm the faults, run the workload, settle, reset, shut down;
    what it saw goes to ``out_path`` (:class:`Checkpoints`)."""
    record = Record(FAULT_CHUNK)
    checkpoint = Checkpoints(out_path, record)
    out = checkpoint.out
    engine, agent = build(kind, endpoint, FAULT_CHUNK, FAULT_PRIMARY)
    checkpoint.agent = agent
    out["engine_id"] = engine.engine_id
    (tier,) = engine.tier_objects
    instrument(tier, record)
    faults = dict(SCENARIOS)[scenario]
    armed_at = {call: agent.call_count(call) for call, _, _ in faults}
    for call, fault, times in faults:
        agent.inject(call, fault, times=times)
    driver = Driver(engine, record, FAULT_CHUNK)
    checkpoint("workload")

    def kill() -> None:
        if kill_pid is not None:
            os.kill(kill_pid, signal.SIGKILL)
            out["killed_after_jobs"] = len(record.kinds)

    def round_done(round_: int, reads: Counter[str]) -> None:
        out["reads"] = dict(reads)
        out["unsettled"] = driver.unsettled
        checkpoint(f"workload round {round_ + 1}")

    started = time.monotonic()
    if scenario == IN_FLIGHT:  # two stores submitted, and shutdown() at once: no steps
        driver.offload({f"A{i}": {key_of(s): data(s, FAULT_CHUNK) for s in (2 * i, 2 * i + 1)}
                        for i in range(2)}, lookup=False)
    else:
        workload(driver, kill if scenario == KILL else None, round_done)
        driver.wait(list(record.kinds), SETTLE_LIMIT)
    checkpoint.freeze()
    out["settled_in"] = round(time.monotonic() - started, 2)
    out.update(settled(engine, agent, faults, armed_at))
    if scenario == IN_FLIGHT:
        out["reset"] = "not called"
    else:
        checkpoint("reset_cache")
        out["reset"], out["reset_where"] = timed(engine.reset_cache, RESET_LIMIT)
    checkpoint("shutdown")
    out["shutdown"], out["shutdown_where"] = timed(engine.shutdown, SHUTDOWN_LIMIT)
    checkpoint("done")
    time.sleep(LINGER)  # a NIXL thread left using released memory crashes about now
    checkpoint("exit")


def settled(engine: Any, agent: CountingAgent, faults: list[tuple[str, Fault, int]],
            armed_at: dict[str, int]) -> dict[str, Any]:
    """Primary chunks still pinned, how many faulted calls were made, misuses caught."""
    try:
        pinned: object = engine.pinned_chunks()
    except Exception as error:
        pinned = f"? {type(error).__name__}"
    fired = sum(min(times, agent.call_count(call) - armed_at[call]) for call, _, times in faults)
    return {"pinned": pinned, "fired": fired, "misuses": len(agent.misuses)}


def workload(driver: Driver, kill: Callable[[], None] | None,
             round_done: Callable[[int, Counter[str]], None]) -> None:
    """Rounds of 4 stores of 2 blocks (a 4-chunk primary: each store evicts older blocks)
    and 2 promotions of the round's evicted blocks, each read back and compared."""
    reads = Counter[str]()
    for round_ in range(ROUNDS):
        seeds = range(round_ * 8, round_ * 8 + 8)
        blocks = {key_of(s): data(s, FAULT_CHUNK) for s in seeds}
        keys = list(blocks)
        for pair in range(0, 8, 2):
            ids = driver.offload({f"S{round_}.{pair}": {k: blocks[k]
                                                        for k in keys[pair:pair + 2]}})
            if kill is not None and round_ == KILL_ROUND and pair == 2:
                kill()  # transfers just submitted: NIXL runs them now
            driver.wait(ids, WAIT_STORE)
        for half in (0, 2):
            found = driver.fetch({f"L{round_}.{half}": keys[half:half + 2]}, LOOKUP_LIMIT)
            for key, got in found.items():
                reads["asked"] += 1
                reads["ok" if got == blocks[key] else "missed" if got is None else "wrong"] += 1
        round_done(round_, reads)


# -- throughput, both tiers in one process ---------------------------------------------------------

def throughput_run(endpoint: str, reps: int, out_path: str) -> None:
    """Both tiers side by side, repetitions interleaved; per repetition and tier the store,
    load and fetch phases' seconds, bytes and jobs."""
    chunk = THROUGHPUT_CHUNK
    setups = {}
    for kind in (KVFSM, VLLM):
        engine, _ = build(kind, endpoint, chunk, THROUGHPUT_PRIMARY)
        record = Record(chunk)
        instrument(engine.tier_objects[0], record)
        setups[kind] = (engine, record, Driver(engine, record, chunk))
    with open(out_path + ".engines", "w") as file:  # for the parent to clean /dev/shm up
        json.dump([engine.engine_id for engine, _, _ in setups.values()], file)
    samples: dict[str, dict[str, list[Any]]] = {
        kind: {"store": [], "load": [], "fetch": [], "wrong": [], "failed": []}
        for kind in setups}
    blocks_per_phase = THROUGHPUT_PRIMARY
    for rep in range(reps):
        order = [KVFSM, VLLM] if rep % 2 == 0 else [VLLM, KVFSM]
        for kind in order:
            gc.collect()
            engine, record, driver = setups[kind]
            base = 100_000 * (rep + 1)
            first = {key_of(base + i): data(base + i, chunk) for i in range(blocks_per_phase)}
            second = {key_of(base + 50_000 + i): data(base + 50_000 + i, chunk)
                      for i in range(blocks_per_phase)}
            for phase, blocks in enumerate((first, second)):
                keys = list(blocks)
                requests = {f"T{rep}.{phase}.{i}":
                            {k: blocks[k] for k in keys[i:i + PER_REQUEST]}
                            for i in range(0, len(keys), PER_REQUEST)}
                ids = driver.offload(requests, lookup=False)
                driver.wait(ids, 60.0)
                samples[kind]["store"].append(_phase(record, ids))
            keys = list(first)
            wanted = {f"F{rep}.{i}": keys[i:i + PER_REQUEST]
                      for i in range(0, len(keys), PER_REQUEST)}
            before = set(record.kinds)
            started = time.perf_counter()
            found = driver.fetch(wanted, 60.0)
            elapsed = time.perf_counter() - started
            loads = [job_id for job_id in record.kinds if job_id not in before]
            driver.wait(loads, 60.0)
            samples[kind]["load"].append(_phase(record, loads))
            moved = sum(chunk for key, got in found.items() if got is not None)
            samples[kind]["fetch"].append({"seconds": elapsed, "bytes": moved,
                                           "jobs": len(loads)})
            samples[kind]["wrong"].append(sum(1 for key, got in found.items()
                                              if got is not None and got != first[key]))
            samples[kind]["failed"].append(sum(1 for key, got in found.items() if got is None))
        with open(out_path, "w") as file:
            json.dump(samples, file)
    for engine, _, _ in setups.values():
        with contextlib.suppress(Exception):
            engine.reset_cache()
        with contextlib.suppress(Exception):
            engine.shutdown()


def _phase(record: Record, ids: list[int]) -> dict[str, Any]:
    """A phase's seconds from its first submit to its last result, bytes, jobs."""
    if not ids or not record.done(ids):
        return {"seconds": None, "bytes": 0, "jobs": len(ids)}
    start = min(record.submitted_at[i] for i in ids)
    end = max(record.reported_at[i] for i in ids)
    good = [i for i in ids if record.success.get(i)]
    return {"seconds": end - start, "bytes": sum(record.sizes[i] for i in good),
            "jobs": len(good), "failed": len(ids) - len(good)}


# -- the parent: one process per run ---------------------------------------------------------------

def in_child(target: Callable[..., None], args: tuple[Any, ...], log: Path,
             limit: float) -> str:
    """Run ``target(*args)`` in a forked process whose output goes to ``log``; how it ended."""
    context = multiprocessing.get_context("fork")

    def body() -> None:
        with open(log, "w") as file:
            os.dup2(file.fileno(), 1)
            os.dup2(file.fileno(), 2)
        code = 0
        try:
            target(*args)
        except BaseException:
            traceback.print_exc()
            code = 3
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: a hung call's thread may still run

    process = context.Process(target=body)
    process.start()
    process.join(limit)
    if process.is_alive():
        process.kill()
        process.join()
        return f"killed at {limit:.0f} s"
    code = process.exitcode
    if code is None or code == 0:
        return "exit 0"
    if code < 0:
        return f"{signal.Signals(-code).name} (crashed)"
    return f"exit {code}"


def run_faults(server: S3Server, only: str | None, logs: Path
               ) -> tuple[list[list[object]], list[str]]:
    """Every scenario, each tier in a process of its own: the table's rows, and notes (where
    each hung call was when its time was up)."""
    rows: list[list[object]] = []
    notes: list[str] = []
    for scenario, _ in SCENARIOS:
        if only and only.lower() not in scenario.lower():
            continue
        for kind in (KVFSM, VLLM):
            started = time.monotonic()
            slug = "".join(c if c.isalnum() else "-"
                           for c in f"{scenario}-{kind}").lower().strip("-")
            out_path = str(logs / f"{slug}.json")
            own: S3Server | None = None
            endpoint, kill_pid = server.endpoint, None
            if scenario == KILL:  # a server of its own, which the run kills
                own = S3Server(free_port())
                own.start()
                endpoint = own.endpoint
                assert own.process is not None
                kill_pid = own.process.pid
            try:
                ended = in_child(fault_run, (kind, scenario, endpoint, kill_pid, out_path),
                                 logs / f"{slug}.log", RUN_LIMIT)
            finally:
                if own is not None:
                    own.stop()
            try:
                with open(out_path) as file:
                    out = json.load(file)
            except (OSError, ValueError):
                out = {"phase": "nothing written"}
            out["shm_left"] = remove_region(out.get("engine_id"))
            rows.append(fault_row(scenario, kind, out, ended))
            if scenario == IN_FLIGHT and kind == VLLM:
                notes.append(f"{IN_FLIGHT}: jobs lost and chunks pinned are expected for both "
                             "tiers (no step polls between the submits and shutdown(), and "
                             "nothing polls after it); what differs is the handles released "
                             "while NIXL still ran the transfer, and the process's end")
            for call in ("reset", "shutdown"):
                if out.get(f"{call}_where"):
                    notes.append(f"{scenario} / {kind}: {call} hung in "
                                 f"{out[f'{call}_where']}")
            print(f"  {scenario} / {kind}: {ended}, {time.monotonic() - started:.1f} s, "
                  f"last phase {out.get('phase')}", flush=True)
    return rows, notes


def remove_region(engine_id: str | None) -> str:
    """Whether the run left its primary's shared-memory file behind (vLLM unlinks it only when
    every tier's shutdown returned); removed here either way."""
    if engine_id is None:
        return "?"
    left = [name for name in os.listdir("/dev/shm") if engine_id in name]
    for name in left:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", name))
    return "left" if left else "no"


def fault_row(scenario: str, kind: str, out: dict[str, Any], ended: str) -> list[object]:
    def get(name: str) -> object:
        return out.get(name, "-")

    escaped = out.get("escaped", 0)
    first = _short(out.get("first_escape", ""), 60)
    reads = out.get("reads", {})
    not_reached = f"not reached ({out.get('phase')})"
    leaks = "-" if "dlist" not in out else f"{out['dlist']}/{out['reg']}"
    lost = get("lost")
    if out.get("late"):
        lost = f"{lost} ({out['late']} reported later, in reset_cache/shutdown)"
    return [scenario, kind, get("fired"), get("submitted"), get("reported"), get("failed"),
            lost, get("duplicated"), get("pinned"),
            f"{escaped}: {first}" if escaped else escaped,
            get("xfer"), leaks, get("released_running"),
            out.get("reset", not_reached), out.get("shutdown", not_reached), get("shm_left"),
            reads.get("wrong", 0) if reads else "-",
            f"{reads.get('ok', 0)}/{reads.get('asked', 0)}",
            get("unsettled"), ended]


FAULT_HEADERS = ["scenario", "tier", "faults fired", "jobs submitted", "reported",
                 "of which failed", "lost", "duplicated", "pinned chunks", "escaped into manager",
                 "xfer handles leaked", "dlists/regs leaked", "released while running",
                 "reset_cache()", "shutdown()", "/dev/shm region", "wrong bytes",
                 "blocks read ok/asked",
                 f"keys still RETRY at {LOOKUP_LIMIT:.0f} s", "process"]


def summarize_throughput(samples: dict[str, dict[str, list[Any]]]) -> str:
    mib = 1024 * 1024
    rows: list[list[object]] = []

    def rates(kind: str, phase: str) -> tuple[list[float], list[float]]:
        good = [s for s in samples[kind][phase] if s.get("seconds")]
        return ([s["bytes"] / mib / s["seconds"] for s in good],
                [s["jobs"] / s["seconds"] for s in good])

    for phase, label in (("store", "store (submit to result)"),
                         ("load", "load (submit to result)"),
                         ("fetch", "fetch (first lookup to bytes)")):
        (k_mb, k_jobs), (v_mb, v_jobs) = rates(KVFSM, phase), rates(VLLM, phase)
        units = [("MB/s", k_mb, v_mb), ("jobs/s", k_jobs, v_jobs)]
        for unit, k, v in units[:1] if phase == "fetch" else units:
            best_k, best_v = max(k, default=None), max(v, default=None)
            rows.append([f"{label}, {unit}", _num(best_k), _num(best_v), ratio(best_k, best_v),
                         _num(statistics.median(k) if k else None),
                         _num(statistics.median(v) if v else None), f"{len(k)}/{len(v)}"])
    checks = {kind: (sum(samples[kind]["wrong"]), sum(samples[kind]["failed"]))
              for kind in samples}
    text = table(["what", "kvfsm best", "vLLM obj best", "kvfsm/vLLM", "kvfsm median",
                  "vLLM obj median", "samples"], rows)
    return text + "\n" + "; ".join(
        f"{kind}: {wrong} blocks read wrong, {failed} not loaded" for kind, (wrong, failed)
        in checks.items())


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="throughput repetitions per tier")
    parser.add_argument("--only", help="run only the fault scenarios whose name contains this")
    parser.add_argument("--no-faults", action="store_true", help="skip the fault table")
    parser.add_argument("--no-throughput", action="store_true", help="skip the throughput")
    args = parser.parse_args()
    if not nixl_available():
        print("NIXL is not installed (scripts/setup installs nixl-cu12==1.5.1)", file=sys.stderr)
        return 2
    started = time.monotonic()
    print_machine(machine())
    print(f"vllm {importlib.metadata.version('vllm')}; kvfsm retry "
          f"{KVFSM_RETRY or 'default'}; {IO_THREADS} OBJ I/O threads each", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="kvfsm-bench-vllm-tiers-"))
    server = S3Server(free_port())
    server.start()
    try:
        if not args.no_faults:
            print(f"\nfault scenarios ({FAULT_CHUNK} B chunks, {FAULT_PRIMARY}-chunk primary, "
                  f"{ROUNDS} rounds; settle {SETTLE_LIMIT:.0f} s, reset_cache "
                  f"{RESET_LIMIT:.0f} s, shutdown {SHUTDOWN_LIMIT:.0f} s, process "
                  f"{RUN_LIMIT:.0f} s):", flush=True)
            rows, notes = run_faults(server, args.only, logs)
            print()
            print(table(FAULT_HEADERS, rows, "Faults under vLLM's TieringOffloadingManager"))
            print("\n".join(f"- {note}" for note in notes))
        if not args.no_throughput:
            out_path = str(logs / "throughput.json")
            ended = in_child(throughput_run, (server.endpoint, args.reps, out_path),
                             logs / "throughput.log", 300.0)
            try:
                with open(out_path) as file:
                    samples = json.load(file)
            except (OSError, ValueError):
                samples = None
            with contextlib.suppress(OSError, ValueError), open(out_path + ".engines") as file:
                left = [engine_id for engine_id in json.load(file)
                        if remove_region(engine_id) == "left"]
                if left:
                    print(f"(the throughput run left {len(left)} /dev/shm region(s); removed)")
            title = (f"Throughput, no faults ({THROUGHPUT_CHUNK // 1024} KiB chunks, "
                     f"{THROUGHPUT_PRIMARY}-chunk primary, jobs of {PER_REQUEST} chunks, "
                     f"{args.reps} interleaved repetitions; process {ended})")
            print(title + "\n")
            print(summarize_throughput(samples) if samples else "no samples written")
    finally:
        server.stop()
    print(f"\nlogs: {logs}; {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
