"""``kvfsm demo``: store a torch KV cache, wipe it, load it back and verify every byte.

By default it runs on real NIXL with the file tier in a temporary directory, so it needs no
server; ``--dir DIR`` keeps the files in DIR, ``--s3-endpoint URL --bucket B`` runs the
object-store tier against an S3 server, and ``--fake`` runs the object-store tier on
:class:`kvfsm.testing.FakeNixlAgent` (one of the three). Faults given with ``--inject-faults``
are injected into the agent's calls (the real agent through :class:`kvfsm.testing.FaultyAgent`),
so a user can watch transfers retry and still publish once.

A job that fails says why (:class:`kvfsm.transfer.JobResult`'s ``reason``): the demo prints the
failures grouped by cause, with a count and one example job each, and tells the causes it
injected from the others. A load of blocks whose store failed fails because of that store.

Exit status: 0 when every block verified, or every failure came from the injected faults; 1
when a byte mismatched, a result was duplicated, a job failed for a reason that was not
injected (a directory that takes no new file, a store that refused the credentials...), or a
phase did not finish by ``--timeout``; 2 for bad options (a ``--dir`` on a read-only file
system, an S3 server and no credentials for it); 130 on Ctrl-C, once the tier is shut down.
Transfers NIXL still runs past ``--timeout`` (or past the shutdown after a Ctrl-C) keep the
process up to 60 s more as it exits (``kvfsm.tiers.base.EXIT_WAIT_SECONDS``: a process must
not exit with one in flight), said on stderr; a second Ctrl-C stops that wait.

Progress bars (rate and time left) go to stderr, for each phase and while a release that keeps
raising is waited out up to the retry bound; they are on when stderr is a terminal, or with
``--progress``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfsm.machines.transfer import FailureKind, FailureReason
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, Fault, FaultyAgent, Raise, ReturnErr, StayProc
from kvfsm.testing.faults import FAULTABLE_CALLS, STATUS_CALLS
from kvfsm.tiers import DrainTimeout, FileTier, ObjectStoreTier, SecondaryTier
from kvfsm.tiers.file import RootNotWritableError
from kvfsm.trace import TraceRecorder
from kvfsm.transfer import JobResult, TransferJob

__all__ = ["FaultSpec", "add_arguments", "parse_fault_spec", "progress_bar", "run"]

_SPEC_ITEM = re.compile(
    r"^(?P<call>[A-Za-z_]+):(?P<kind>raise|err|proc=(?P<polls>\d+))"
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
            if int(match["polls"]) < 1:
                raise ValueError(f"bad fault {item!r}: proc=N keeps a transfer running for N "
                                 "polls, N from 1")
            fault = StayProc(int(match["polls"]))
        at = int(match["at"]) if match["at"] else None
        times = int(match["times"]) if match["times"] else 1
        if at == 0 or times == 0:
            raise ValueError(f"bad fault {item!r}: @AT and *TIMES count from 1")
        faults.append(FaultSpec(match["call"], fault, at, times))
    return faults


#: the NIXL calls the demo's tier makes (it looks nothing up: no query_memory)
DEMO_CALLS = FAULTABLE_CALLS - {"query_memory"}
#: the calls a tier makes once as it starts (registering the primary cache) before any job's
_STARTING_CALLS = ("register_memory", "prep_xfer_dlist")


def _check_faults(faults: list[FaultSpec]) -> None:
    """Refuse, in the CLI's words and before the demo begins, a fault the demo's agent cannot
    inject: a call it cannot fail, or err or proc=N for a call that only takes raise."""
    for fault in faults:
        if fault.call not in FAULTABLE_CALLS:
            hint = (f" (NIXL's calls are lowercase: {fault.call.lower()!r})"
                    if fault.call.lower() in FAULTABLE_CALLS else "")
            raise ValueError(f"bad fault for {fault.call!r}: not a NIXL call kvfsm can fail{hint}; "
                             f"one of {', '.join(sorted(FAULTABLE_CALLS))}")
        if fault.call not in DEMO_CALLS:
            raise ValueError(f"bad fault for {fault.call!r}: the demo never calls it (it makes "
                             "no lookup), so the fault would never fire; one of "
                             f"{', '.join(sorted(DEMO_CALLS))}")
        if not isinstance(fault.fault, Raise) and fault.call not in STATUS_CALLS:
            kind = "err" if isinstance(fault.fault, ReturnErr) else "proc"
            raise ValueError(f"bad fault for {fault.call!r}: {kind} only applies to "
                             f"{' and '.join(sorted(STATUS_CALLS))}; other calls take raise")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options."""
    parser.add_argument("--blocks", type=int, default=256, help="blocks in the cache (256)")
    parser.add_argument("--block-kib", type=int, default=64, help="KiB per block (64)")
    parser.add_argument("--blocks-per-job", type=int, default=16, help="blocks per job (16)")
    where = parser.add_argument_group("where the blocks go (one of these; default: files in a "
                                      "temporary directory, through real NIXL)")
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
    parser.add_argument("--retry-seconds", type=float, default=RetryPolicy().max_seconds,
                        metavar="S", help="retry a release that raises for S seconds after its "
                        "transfer ended, then quarantine it (the tier's RetryPolicy; "
                        f"{RetryPolicy().max_seconds:g})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bars on stderr (default: when stderr is a terminal)")
    parser.set_defaults(check_arguments=functools.partial(_check_arguments, parser))


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, as a usage error, options for another place than the one the demo runs on:
    ignoring them would run the demo somewhere the user did not ask for."""
    for option, what in (("dir", "a directory's path"), ("trace", "a file's path"),
                         ("s3_endpoint", "a URL"), ("bucket", "a bucket's name")):
        if getattr(args, option) == "":  # (read as not given: the default, not what was asked)
            parser.error(f"--{option.replace('_', '-')} needs {what}, got ''")
    s3 = [f"--{name.replace('_', '-')}" for name in ("s3_endpoint", "bucket")
          if getattr(args, name)]
    if args.fake and (s3 or args.dir):
        given = " and ".join([*s3, *(["--dir"] if args.dir else [])])
        parser.error(f"--fake runs on kvfsm's in-memory store; {given} would be ignored: "
                     "give one place for the blocks")
    if args.dir and s3:
        parser.error(f"--dir keeps the blocks in files, {' and '.join(s3)} in S3: give one "
                     "place for the blocks")


def progress_bar(total: float | None, desc: str, *, enabled: bool, unit: str = "B",
                 leave: bool = False, **options: Any) -> Any:
    """A tqdm bar on stderr with its rate and time left (``unit="B"``: bytes, shown in KiB,
    MiB...); does nothing unless ``enabled`` (or with nothing to count). ``options`` go to
    tqdm."""
    from tqdm import tqdm  # noqa: PLC0415 - only when progress is asked for

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                file=sys.stderr, disable=not enabled or total == 0, leave=leave,
                dynamic_ncols=True, mininterval=0.2, **options)


#: odd, so ``block * _MIX`` differs for every block (mod 2**64): the golden-ratio constant
_MIX = 0x9E3779B97F4A7C15
#: bytes a chunk of the cache is filled and checked in (a bound on the temporary memory)
_CHUNK_BYTES = 64 << 20


class _Pattern:
    """The demo's KV data: block ``b`` is one random block (from the seed) with every 8-byte
    word XORed with ``b * _MIX``, so every block differs from every other in every word, and a
    block loaded into the wrong place, a zeroed one or a shuffled one never verifies.

    Made and checked at memory speed, a chunk at a time, with no copy of the cache kept:
    ``torch.randint`` over 2 GiB takes some 20 s, a clone to check against 2 GiB more.
    """

    def __init__(self, seed: int, block_bytes: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.base = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8,
                                  generator=generator).view(torch.int64)
        self.rows = max(1, _CHUNK_BYTES // block_bytes)  # blocks per chunk

    def expected(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks ``start`` to ``stop`` as they must be, as int64 words."""
        keys = torch.tensor([_signed(b * _MIX) for b in range(start, stop)], dtype=torch.int64)
        words = out[:stop - start] if out is not None else None
        return torch.bitwise_xor(self.base, keys[:, None], out=words)

    def fill(self, cache: torch.Tensor, bar: Any) -> None:
        """Write every block of ``cache`` (blocks of this pattern's size)."""
        words = cache.view(cache.shape[0], -1).view(torch.int64)
        for start in range(0, words.shape[0], self.rows):
            stop = min(start + self.rows, words.shape[0])
            self.expected(start, stop, out=words[start:stop])
            bar.update((stop - start) * words.shape[1] * 8)

    def mismatched(self, cache: torch.Tensor, loaded: torch.Tensor, bar: Any) -> list[int]:
        """The loaded blocks (``loaded``: a bool per block) whose bytes are not the pattern's,
        in order: whole chunks compared at once, and a chunk's rows only when it differs."""
        words = cache.view(cache.shape[0], -1).view(torch.int64)
        scratch = torch.empty((min(self.rows, words.shape[0]), words.shape[1]),
                              dtype=torch.int64)
        bad: list[int] = []
        for start in range(0, words.shape[0], self.rows):
            stop = min(start + self.rows, words.shape[0])
            wanted = loaded[start:stop]
            if bool(wanted.any()):
                expected = self.expected(start, stop, out=scratch)
                got = words[start:stop]
                if not torch.equal(got, expected):
                    rows = (got != expected).any(dim=1) & wanted
                    bad += [start + int(row) for row in rows.nonzero().flatten()]
                bar.update(int(wanted.sum()) * words.shape[1] * 8)
        return bad


def _signed(word: int) -> int:
    """``word`` mod 2**64 as a signed 64-bit integer."""
    word &= (1 << 64) - 1
    return word - (1 << 64) if word >> 63 else word


def _collect(tier: SecondaryTier, sizes: dict[int, int], label: str, timeout: float,
             progress: bool) -> tuple[dict[int, JobResult], int]:
    """Poll until every job has a result; count duplicates (there must be none).

    ``sizes`` is each job's bytes; the bar counts the bytes of jobs with a result. While
    releases that raise are retried, a second bar counts down to the retry bound, when they
    are quarantined (their jobs then fail).
    """
    results: dict[int, JobResult] = {}
    duplicates = 0
    waiting = _RetryWait(tier, enabled=progress)
    with progress_bar(sum(sizes.values()), label, enabled=progress, leave=True) as bar:
        try:
            deadline = time.monotonic() + timeout
            while len(results) < len(sizes):
                for result in tier.get_finished_jobs():
                    duplicates += result.job_id in results
                    if result.job_id not in results:
                        bar.update(sizes.get(result.job_id, 0))
                    results[result.job_id] = result
                if len(results) < len(sizes):
                    waiting.show()
                    if time.monotonic() > deadline:
                        raise DrainTimeout(f"{label} phase", tier.unpublished())
                    time.sleep(tier.poll_interval)
        finally:
            waiting.close()
        failed = sum(not r.success for r in results.values())
        if failed:
            bar.set_postfix_str(f"{failed} failed", refresh=True)
    return results, duplicates


class _RetryWait:
    """A bar for transfers whose release keeps raising: seconds since the oldest of them ended,
    out of the retry policy's ``max_seconds`` (its bound: quarantined then); looked at a few
    times a second, not every poll."""

    def __init__(self, tier: SecondaryTier, *, enabled: bool) -> None:
        self.tier, self.enabled = tier, enabled
        self.bar: Any = None
        self.next_look = 0.0

    def show(self) -> None:
        now = time.monotonic()
        if not self.enabled or now < self.next_look:
            return
        self.next_look = now + 0.2
        retrying = [t for t in self.tier.unpublished() if t.attempts]  # a call to try again
        if not retrying:
            self.close()
            return
        bound = self.tier.policy.max_seconds
        if self.bar is None:
            self.bar = progress_bar(
                bound, "waiting out release retries", unit="s", enabled=True,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s "
                           "[{elapsed}<{remaining}{postfix}]" if bound else None)
        waited = now - min(t.finished_at for t in retrying)
        self.bar.n = min(waited, bound) if bound else waited
        self.bar.set_postfix_str(
            f"{len(retrying)} job(s) retried up to {max(t.retries for t in retrying)} times, "
            f"last error: {retrying[0].error}; quarantined at the bound", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@contextlib.contextmanager
def _open_tier(args: argparse.Namespace, cache: torch.Tensor,
               faults: list[FaultSpec]) -> Iterator[tuple[SecondaryTier, str]]:
    """The tier the options ask for, and a line saying what it is."""
    agent: Any
    policy = RetryPolicy(max_seconds=args.retry_seconds)
    if args.fake:
        agent = FakeNixlAgent(name="kvfsm-demo")
        for fault in faults:
            agent.inject(fault.call, fault.fault, at=fault.at, times=fault.times)
        yield _made(lambda: ObjectStoreTier(cache, agent=agent, key_prefix="demo/",
                                            policy=policy), faults, agent), \
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
                            access_key=os.environ.get("AWS_ACCESS_KEY_ID") or None,
                            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY") or None,
                            key_prefix="kvfsm-demo/")
        from kvfsm.nixl_agents import NO_CREDENTIALS, check_bucket, credentials_found  # noqa: PLC0415

        check_bucket(store)
        if not credentials_found(store):  # every transfer would fail, naming no cause
            raise ValueError(f"{NO_CREDENTIALS}; the demo needs them for {args.s3_endpoint}")
        agent = faulty(make_agent("kvfsm-demo-obj", "OBJ", store.backend_params()))
        yield _made(lambda: ObjectStoreTier(cache, agent=agent, key_prefix=store.key_prefix,
                                            policy=policy), faults, agent), \
            f"object-store tier on real NIXL (OBJ), bucket {args.bucket} at {args.s3_endpoint}"
        return

    with contextlib.ExitStack() as stack:
        root = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfsm-demo-"))
        if args.dir:
            _make_dir(root)
        agent = faulty(make_agent("kvfsm-demo-posix", "POSIX"))
        try:
            tier = _made(lambda: FileTier(cache, root, agent=agent, durable=False,
                                          policy=policy), faults, agent)
        except RootNotWritableError:
            raise ValueError(f"--dir {root}: cannot be written to (a read-only file system or "
                             "no permission); the demo stores its blocks there") from None
        yield tier, \
            f"file tier on real NIXL (POSIX), files in {root}"


def _make_dir(root: str) -> None:
    """``--dir``, made if it is missing (as the file tier would), or refused naming the option:
    a path that is not a directory, or one that cannot be created (a read-only parent)."""
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--dir {root}: exists and is not a directory (the demo stores its "
                         "blocks in one)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--dir {root}: cannot be created ({error.strerror or error}); the "
                         "demo stores its blocks there") from None


def _made(make: Callable[[], SecondaryTier], faults: list[FaultSpec],
          agent: Any) -> SecondaryTier:
    """The tier ``make`` makes on ``agent``; a fault injected into the calls it makes as it
    starts (the first ``register_memory`` or ``prep_xfer_dlist``: the primary cache's
    registration) that fired and stopped it is refused, naming the fault, where the demo
    ended with the bare error. Any other error is the tier's own, as it is."""
    try:
        return make()
    except Exception as error:
        armed = {(call, number) for call, number, _ in agent.faults.pending()} if faults else {}
        hit = [f for f in faults if f.call in _STARTING_CALLS and (f.at or 1) == 1
               and agent.call_count(f.call) >= 1 and (f.call, 1) not in armed]
        if not hit:
            raise
        raise ValueError(
            f"the tier could not start: {type(error).__name__}: {error}, the injected fault "
            f"{hit[0].call}@1: a tier's first {hit[0].call} is the primary cache's, made as it "
            f"starts, before any job; inject it @2 or later to fail a job's") from None


def _memory_bytes() -> int | None:
    """The machine's physical memory, or None where it does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_trace(path: str) -> None:
    """Refuse a ``--trace`` file the demo could not write, before it begins: a directory, one
    in no directory, one it cannot open for writing. A file that exists and is no regular
    file (a pipe a reader waits on) is only checked for permission: opening and closing it
    here would end its reader."""
    trace = Path(path)
    if trace.is_dir():
        raise ValueError(f"--trace {path}: is a directory; name a file to write")
    if not trace.parent.is_dir():
        raise ValueError(f"--trace {path}: there is no directory {str(trace.parent)!r} to write "
                         "it in")
    if not trace.exists() or trace.is_file():
        try:  # (opened as the recorder will open it, without emptying it yet)
            trace.open("a", encoding="utf-8").close()
        except OSError as error:
            raise ValueError(f"--trace {path}: cannot write it ({error.strerror})") from None
    elif not os.access(trace, os.W_OK):
        raise ValueError(f"--trace {path}: cannot write it (no permission)")


def run(args: argparse.Namespace) -> int:
    """Store every block, wipe the cache, load it back and verify every byte."""
    _check_numbers(args)
    faults = parse_fault_spec(args.inject_faults)
    _check_faults(faults)
    if args.trace:  # refused now, not once the demo has filled its cache
        _check_trace(args.trace)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    block_bytes = args.block_kib * 1024
    groups = [list(range(start, min(start + args.blocks_per_job, args.blocks)))
              for start in range(0, args.blocks, args.blocks_per_job)]
    print(f"kvfsm demo: {args.blocks} blocks x {args.block_kib} KiB "
          f"({args.blocks * block_bytes / 2**20:.1f} MiB) in {len(groups)} jobs per phase",
          flush=True)
    asked = f"--blocks {args.blocks} x --block-kib {args.block_kib}: a cache of " \
            f"{args.blocks * block_bytes / 2**20:,.0f} MiB"
    memory = _memory_bytes()
    if memory is not None and (args.blocks + 1) * block_bytes > memory:  # (+ the pattern's)
        raise ValueError(f"{asked} is more than this machine's memory "
                         f"({memory / 2**20:,.0f} MiB)")
    try:
        pattern = _Pattern(args.seed, block_bytes)
        cache = torch.empty((args.blocks, block_bytes), dtype=torch.uint8)
    except RuntimeError as error:  # (torch's allocator says it in its own words)
        raise ValueError(f"{asked} cannot be allocated here "
                         f"({str(error).splitlines()[0]})") from None
    with progress_bar(cache.nbytes, "fill", enabled=progress) as bar:
        pattern.fill(cache, bar)

    with _open_tier(args, cache, faults) as (tier, what), contextlib.ExitStack() as traces:
        if args.trace:
            tier.on_published.append(traces.enter_context(TraceRecorder(args.trace)))
        traces.push(_on_interrupt(tier, args.timeout))  # (first out: the traces still open)
        print(f"  {what}", flush=True)
        started = time.perf_counter()
        stored_of = dict(enumerate(groups))
        _submit(tier, stored_of, block_bytes, "store", load=False, progress=progress)
        sizes = {job_id: len(blocks) * block_bytes for job_id, blocks in stored_of.items()}
        stores, duplicates = _collect(tier, sizes, "store", args.timeout, progress)
        stored_in = time.perf_counter() - started

        cache.zero_()
        started = time.perf_counter()
        loads_of = dict(enumerate(reversed(groups), start=len(groups)))
        _submit(tier, loads_of, block_bytes, "load", load=True, progress=progress)
        sizes = {job_id: len(blocks) * block_bytes for job_id, blocks in loads_of.items()}
        loads, more = _collect(tier, sizes, "load", args.timeout, progress)
        duplicates += more
        loaded_in = time.perf_counter() - started
        tier.shutdown(timeout=args.timeout)

    _report(tier, stores, loads, duplicates, stored_in, loaded_in)
    status = _verify(args, cache, pattern, (stored_of, stores), (loads_of, loads), duplicates,
                     faults, progress)
    with _interrupts_held():  # the tier, and its NIXL agent with it, torn down
        del tier
    return status


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold a Ctrl-C back until the block ends, then let it through as an interrupt of the
    demo: one landing in a NIXL agent's teardown (its ``__del__``) is printed by Python as
    ignored, and the demo exits 0. On the main thread of a POSIX process; elsewhere, as is."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
            signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:  # (one that came meanwhile is delivered now, and raised as the demo's)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _check_numbers(args: argparse.Namespace) -> None:
    """Refuse, naming the option, a number the demo cannot run with."""
    for name in ("blocks", "block_kib", "blocks_per_job"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if bool(args.s3_endpoint) != bool(args.bucket):
        raise ValueError("--s3-endpoint and --bucket go together")
    if not args.retry_seconds > 0:
        raise ValueError("--retry-seconds must be positive")
    if not 0 < args.timeout < math.inf:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")


def _on_interrupt(tier: SecondaryTier, timeout: float) -> Callable[..., bool]:
    """What leaving the demo's phases does: after an interrupt (Ctrl-C) the tier, which may
    have transfers running, is shut down, waiting for NIXL, before the process exits (an exit
    under a running transfer can abort it); the interrupt then goes on."""
    def leaving(kind: type[BaseException] | None, *_: object) -> bool:
        if kind is not None and issubclass(kind, KeyboardInterrupt) and not tier.closed:
            print("kvfsm demo: interrupted; shutting the tier down (waiting for NIXL)",
                  file=sys.stderr, flush=True)
            try:
                tier.shutdown(timeout=timeout)
            except DrainTimeout as error:  # said, and the interrupt goes on (exit 130)
                print(f"kvfsm demo: {error}", file=sys.stderr, flush=True)
        return False
    return leaving


def _verify(args: argparse.Namespace, cache: torch.Tensor, pattern: _Pattern,
            stored: tuple[dict[int, list[int]], dict[int, JobResult]],
            loaded_by: tuple[dict[int, list[int]], dict[int, JobResult]], duplicates: int,
            faults: Sequence[FaultSpec], progress: bool) -> int:
    """Verify every block that loaded, say why the others did not, and give the exit status."""
    (stored_of, stores), (loads_of, loads) = stored, loaded_by
    block_bytes = cache.shape[1]
    loaded = torch.zeros(args.blocks, dtype=torch.bool)
    for job_id, blocks in loads_of.items():
        if loads[job_id].success:
            loaded[blocks] = True
    count = int(loaded.sum())
    with progress_bar(count * block_bytes, "verify", enabled=progress, leave=True) as bar:
        mismatched = pattern.mismatched(cache, loaded, bar)
    print(f"verified {count} of {args.blocks} blocks byte for byte, "
          f"{len(mismatched)} mismatched"
          + (f" (the first: block {mismatched[0]})" if mismatched else ""))
    failures = _failures(stores, loads, stored_of, loads_of, faults)
    if failures:
        _print_failures(failures)
    not_injected = [f for f in failures if not f.injected]
    if not_injected:
        first = not_injected[0]
        print(f"kvfsm demo: {len(not_injected)} job(s) failed for a reason that was not "
              f"injected (job {first.result.job_id}: {first.result.reason}): exit 1")
    if mismatched or duplicates or not_injected:
        return 1
    if count == args.blocks:
        print("every byte verified")
    else:
        print(f"{args.blocks - count} block(s) not verified: their store or load failed from "
              "the injected faults; every block that loaded matches")
    return 0


def _submit(tier: SecondaryTier, jobs: dict[int, list[int]], block_bytes: int, label: str, *,
            load: bool, progress: bool) -> None:
    """Submit every job of a phase (a store, or a load, of its blocks)."""
    submit = tier.submit_load if load else tier.submit_store
    total = sum(len(blocks) for blocks in jobs.values()) * block_bytes
    with progress_bar(total, f"{label} submit", enabled=progress) as bar:
        for job_id, blocks in jobs.items():
            submit(TransferJob(job_id, [f"block-{b}" for b in blocks], blocks,
                               is_promotion=load))
            bar.update(len(blocks) * block_bytes)


@dataclass(frozen=True, slots=True)
class _Failure:
    """A failed job, with the cause the demo groups it under."""

    result: JobResult
    load: bool
    #: the reason, without what differs between jobs (file names), or what the failure
    #: follows from
    cause: str
    injected: bool
    #: the failed store a failed load follows from
    store: int | None = None


#: an OSError's file names (``: '/x/y'``, ``: '/x' -> '/y'``) at the end of its text
_FILE_NAMES = re.compile(r": '[^']*'(?: -> '[^']*')?$")


def _failures(stores: dict[int, JobResult], loads: dict[int, JobResult],
              stored_of: dict[int, list[int]], loads_of: dict[int, list[int]],
              faults: Sequence[FaultSpec]) -> list[_Failure]:
    """Every failed job, in job order, with its cause: a load of blocks whose store failed,
    refused (the tier forgot them: ``ForgottenKeyError``) or failed moving its bytes (a call
    raised or answered an error), failed because of that store (injected when the store's
    failure was). A load cancelled or quarantined (its release kept failing, NIXL ran it past the
    bound) failed for its own reason, whatever its store did: its own reason is its cause."""
    failed_store: dict[int, _Failure] = {}
    failures: list[_Failure] = []
    for job_id, result in sorted(stores.items()):
        if not result.success:
            failure = _Failure(result, False, _cause(result.reason),
                               _injected(result.reason, faults))
            failures.append(failure)
            failed_store.update(dict.fromkeys(stored_of.get(job_id, ()), failure))
    for job_id, result in sorted(loads.items()):
        if result.success:
            continue
        store = next((failed_store[b] for b in loads_of.get(job_id, ())
                      if b in failed_store), None) if _moving_bytes(result.reason) else None
        if store is not None:
            failures.append(_Failure(result, True, "the store of its blocks failed",
                                     store.injected, store.result.job_id))
        else:
            failures.append(_Failure(result, True, _cause(result.reason),
                                     _injected(result.reason, faults)))
    return failures


def _moving_bytes(reason: FailureReason | None) -> bool:
    """True when a job failed on a call that raised or answered an error, as a load of an
    object or file its store never left does; not when it was cancelled or quarantined."""
    return reason is not None and reason.kind in (FailureKind.RAISED, FailureKind.ERR)


def _cause(reason: FailureReason | None) -> str:
    return _FILE_NAMES.sub("", str(reason)) if reason is not None else "no reason given"


def _injected(reason: FailureReason | None, faults: Sequence[FaultSpec]) -> bool:
    """True when ``reason`` is what an injected fault makes its call do: raise
    ``FakeNixlError`` with the fault's code (also as a quarantined release's last error), or
    answer "ERR"."""
    if reason is None:
        return False
    for spec in faults:
        if spec.call != reason.call:
            continue
        if isinstance(spec.fault, Raise) and reason.error.endswith(
                f"FakeNixlError: {spec.fault.code}"):
            return True
        if isinstance(spec.fault, ReturnErr) and reason.kind is FailureKind.ERR:
            return True
    return False


def _print_failures(failures: list[_Failure]) -> None:
    """The failed jobs grouped by cause: how many, whether injected, and one example."""
    groups: dict[tuple[bool, str, bool], list[_Failure]] = {}
    for failure in failures:
        groups.setdefault((failure.load, failure.cause, failure.injected), []).append(failure)
    print("failed jobs by cause:")
    for (load, cause, injected), members in groups.items():
        example = members[0]
        kind = "load" if load else "store"
        print(f"  {len(members):>5} {kind}{'s' if len(members) > 1 else ''}: {cause} "
              f"({'injected' if injected else 'NOT injected'})")
        after = f" (after store job {example.store})" if example.store is not None else ""
        print(f"        e.g. job {example.result.job_id}{after}: {example.result.reason}")


def _report(tier: SecondaryTier, stores: dict[int, JobResult], loads: dict[int, JobResult],
            duplicates: int, stored_in: float, loaded_in: float) -> None:
    counts = tier.machine.transition_counts()
    declaration = tier.machine.declaration
    entered = dict.fromkeys((s.name for s in declaration.states), 0)
    entered[declaration.initial.name] = len(stores) + len(loads)
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
