"""Contender (b): the object-store tier as a hand-written poll loop, as fast as plain Python goes.

It does what kvfsm's :class:`~kvfsm.tiers.ObjectStoreTier` does, without a state machine:

* validates each job exactly as the tier does (type, job id, in flight or unreported, direction,
  keys and block ids, duplicate names, range, duplicate load targets);
* makes the same NIXL calls in the same order (register, prep, make, post; poll; release the
  transfer handle; release the descriptor list; deregister);
* latches the outcome once, when NIXL answers DONE, ERR or raises (at submit or poll);
* releases the transfer handle first; a release that raises keeps the transfer, counts a retry
  and is tried again on the next poll; the result is never published before the release;
* cleans up best effort, recording each failed call as a :class:`~kvfsm.transfer.Leak`;
* publishes exactly one :class:`~kvfsm.transfer.JobResult` (same fields and values) and tells
  the lookup cache (a store's keys HIT; a failed load's keys MISS; a failed store's keys MISS,
  and a load of them failed without a NIXL call, until a store of them succeeds);
* like the tier, holds one lock around each call of the contract, keeps the latency of the last
  4096 transfers and a count of failures, and logs each failure and leak on the "kvfsm" logger.

What makes it fast: transfers NIXL still runs live in a dict keyed by their transfer handle, so
a poll step is one loop over the handles that only calls ``check_xfer_state`` and compares the
answer; nothing else about a running transfer is touched until its answer changes. A transfer's
record is a list, built with one literal.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvfsm.agent import LOCAL_AGENT
from kvfsm.tiers.base import InvalidJobError, Lookup
from kvfsm.transfer import JobResult, Leak, TransferJob

_DEV_ID_SPACE = 2**31
_dev_ids = itertools.count()

# a transfer's record: [job_id, names, nbytes, started_at, is_promotion, files, remote, xfer,
#                       success, finished_at, retries, error, others]
_JOB, _NAMES, _NBYTES, _STARTED, _LOAD, _FILES, _REMOTE, _XFER = range(8)
_SUCCESS, _FINISHED, _RETRIES, _ERROR, _OTHERS = range(8, 13)

logger = logging.getLogger("kvfsm")
_OVER_OR_RUNNING = ("PROC", "DONE")


class Others:
    """A job of several blocks makes one NIXL transfer per block (NIXL 1.5.1's OBJ backend
    answers one request's error while the job's other requests still run): the handles besides
    the first, the first ``posted`` of them posted, the first ``done`` seen DONE, and the first
    failure any of them had (a status or an exception)."""

    __slots__ = ("done", "failure", "handles", "posted")

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.posted = self.done = 0
        self.failure: Any = None


def make_and_post(agent: Any, local: Any, remote: Any, block_ids: Sequence[int], load: bool,
                  keep: Callable[[Any], None], others: Others | None) -> Any:
    """Make the job's transfer (``others``: one per block), handing each first handle to
    ``keep`` as it is made; post the first, then, if it runs, the others in order until one
    fails. Returns what the first's post answered (a make or that post may raise)."""
    operation = "READ" if load else "WRITE"
    if others is None:
        xfer = agent.make_prepped_xfer(operation, local, list(block_ids), remote,
                                       list(range(len(block_ids))))
        keep(xfer)
        return agent.transfer(xfer)
    for index, block in enumerate(block_ids):
        handle = agent.make_prepped_xfer(operation, local, [block], remote, [index])
        if index == 0:
            keep(handle)
            xfer = handle
        else:
            others.handles.append(handle)
    status = agent.transfer(xfer)
    if status not in _OVER_OR_RUNNING:
        return status
    for index, handle in enumerate(others.handles):
        others.posted = index + 1
        try:
            answered = agent.transfer(handle)
        except Exception as error:
            answered = error
        if type(answered) is not str or answered not in _OVER_OR_RUNNING:
            others.posted = index
            others.failure = answered
            break
        if answered == "DONE" and others.done == index:
            others.done = index + 1
    return status


def others_over(agent: Any, others: Others, status: Any) -> Any:
    """The first transfer of a job made per block answered ``status`` (not PROC): "PROC" while
    another posted one runs, else the job's answer, "DONE" or the first failure."""
    if status != "DONE" and others.failure is None:
        others.failure = status
    check, running = agent.check_xfer_state, False
    for index in range(others.done, others.posted):
        try:
            answered = check(others.handles[index])
        except Exception as error:
            answered = error
        if answered == "PROC":
            running = True
        elif answered == "DONE":
            if others.done == index:
                others.done = index + 1
        elif others.failure is None:
            others.failure = answered
    if running:
        return "PROC"
    return "DONE" if others.failure is None else others.failure


def release_others(agent: Any, others: Others) -> None:
    """Release the handles besides the first, the last first; one that raises is tried again
    (with those before it) on the next poll."""
    handles = others.handles
    while handles:
        agent.release_xfer_handle(handles[-1])
        handles.pop()


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class HandTier:
    """An object-store tier with the same contract and behaviour as kvfsm's, written by hand."""

    def __init__(self, primary: torch.Tensor, *, agent: Any, key_prefix: str = "") -> None:
        self.agent = agent
        self.key_prefix = key_prefix
        self.num_blocks = int(primary.shape[0])
        self.block_bytes = int(primary[0].nbytes)
        self._running: dict[Any, list[Any]] = {}  # transfer handle -> record, NIXL answered PROC
        self._ending: list[list[Any]] = []        # outcome latched, handle release to retry
        self._in_flight: set[int] = set()         # job ids not yet published
        self._unreported: set[int] = set()        # published, not handed out yet
        self._results: list[JobResult] = []
        self._known: dict[str, Lookup] = {}
        self._forgotten: set[str] = set()         # names whose store failed, not stored since
        self._published = 0
        self._failed = 0
        self._latencies: collections.deque[float] = collections.deque(maxlen=4096)
        self._lock = threading.RLock()
        self._retries = 0
        self._leaks: list[tuple[int, Leak]] = []
        base = primary.data_ptr()
        self._dram = agent.register_memory(
            [(base, self.num_blocks * self.block_bytes, 0, "")], "DRAM")
        self._local = agent.prep_xfer_dlist(
            LOCAL_AGENT, [(base + i * self.block_bytes, self.block_bytes, 0)
                          for i in range(self.num_blocks)], "DRAM")

    # -- the contract -----------------------------------------------------------------------

    def submit_store(self, job: TransferJob) -> None:
        with self._lock:
            self._submit(job, False)

    def submit_load(self, job: TransferJob) -> None:
        with self._lock:
            self._submit(job, True)

    def get_finished_jobs(self) -> list[JobResult]:
        with self._lock:
            self._poll()
            results, self._results = self._results, []
            self._unreported.clear()
            return results

    def _poll(self) -> None:
        """Retry pending releases, then poll every running transfer once."""
        if self._ending:
            ending, self._ending = self._ending, []
            for record in ending:
                self._release(record)
        check = self.agent.check_xfer_state
        over = None
        for xfer in self._running:
            try:
                status = check(xfer)
            except Exception as error:  # the transfer failed
                status = error
            if status != "PROC":
                if over is None:
                    over = [(xfer, status)]
                else:
                    over.append((xfer, status))
        if over is not None:
            self._take_over(over)

    def _take_over(self, over: list[tuple[Any, Any]]) -> None:
        """Latch, release and publish each transfer a poll found over (a job of several
        blocks: once each of its transfers is)."""
        running = self._running
        for xfer, answered in over:
            record = running[xfer]
            status = answered
            if record[_OTHERS] is not None:
                status = others_over(self.agent, record[_OTHERS], answered)
                if status == "PROC":
                    continue  # another block's transfer runs: the job goes on running
            del running[xfer]
            if status == "DONE":
                self._latch(record, True, None)
            elif isinstance(status, Exception):
                self._latch(record, False, _describe(status))
            else:
                self._latch(record, False, f"check_xfer_state answered {status!r}")
            self._release(record)

    def has_pending_work(self) -> bool:
        return bool(self._in_flight) or bool(self._results)

    def drain_jobs(self, timeout: float | None = None, interval: float = 0.0005) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                self._poll()
                if not self._in_flight:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"{len(self._in_flight)} transfer(s) not published")
            time.sleep(interval)

    def shutdown(self) -> None:
        with self._lock:
            self.drain_jobs()
            self._close()

    def _close(self) -> None:
        for call, handle in ((self.agent.release_dlist_handle, self._local),
                             (self.agent.deregister_memory, self._dram)):
            try:
                call(handle)
            except Exception as error:
                self._leaks.append((-1, Leak(call.__name__, _describe(error))))

    def lookup(self, key: bytes | str) -> Lookup:
        return self._known.get(self.key_prefix + _key_text(key), Lookup.RETRY)

    # -- internals --------------------------------------------------------------------------

    def _submit(self, job: TransferJob, load: bool) -> None:
        names, block_ids = self._validate(job, load)
        job_id = job.job_id
        self._in_flight.add(job_id)
        record = [job_id, names, len(block_ids) * self.block_bytes, time.monotonic(), load,
                  None, None, None, None, 0.0, 0, None, None]
        if load and self._forgotten and not self._forgotten.isdisjoint(names):
            self._latch(record, False, "open raised ForgottenKeyError")  # no NIXL call
            self._release(record)
            return
        if not block_ids:
            self._latch(record, True, None)
            self._release(record)
            return
        agent = self.agent
        try:
            size = self.block_bytes
            files = record[_FILES] = agent.register_memory(
                [(0, size, next(_dev_ids) % _DEV_ID_SPACE, name) for name in names], "OBJ")
            remote = record[_REMOTE] = agent.prep_xfer_dlist(agent.name, files.trim())
            others = record[_OTHERS] = Others() if len(block_ids) > 1 else None
            status = make_and_post(agent, self._local, remote, block_ids, load,
                                   lambda handle: record.__setitem__(_XFER, handle), others)
        except Exception as error:
            self._latch(record, False, _describe(error))
            self._release(record)
            return
        xfer = record[_XFER]
        if status == "DONE" and others is not None:
            status = others_over(agent, others, status)
        if status == "PROC":
            self._running[xfer] = record
            return
        if isinstance(status, Exception):
            self._latch(record, False, _describe(status))
            self._release(record)
            return
        if status == "DONE":
            self._latch(record, True, None)
        else:
            self._latch(record, False, f"transfer() answered {status!r}")
        self._release(record)

    @staticmethod
    def _latch(record: list[Any], success: bool, error: str | None) -> None:
        """The outcome, set once: the record leaves the running dict in the same step."""
        record[_SUCCESS] = success
        record[_FINISHED] = time.monotonic()
        if error is not None:
            record[_ERROR] = error

    def _release(self, record: list[Any]) -> None:
        """Release the handle (retry on the next poll if it raises), clean up, publish."""
        xfer = record[_XFER]
        if xfer is not None:
            try:
                if record[_OTHERS] is not None:
                    release_others(self.agent, record[_OTHERS])
                self.agent.release_xfer_handle(xfer)
            except Exception as error:
                record[_RETRIES] += 1
                record[_ERROR] = _describe(error)
                self._ending.append(record)
                return
            record[_XFER] = None
        leaks = None
        agent = self.agent
        if record[_REMOTE] is not None:
            try:
                agent.release_dlist_handle(record[_REMOTE])
            except Exception as error:
                leaks = [Leak("release_dlist_handle", _describe(error))]
            record[_REMOTE] = None
        if record[_FILES] is not None:
            try:
                agent.deregister_memory(record[_FILES])
            except Exception as error:
                leaks = (leaks or []) + [Leak("deregister_memory", _describe(error))]
            record[_FILES] = None
        self._publish(record, leaks)

    def _publish(self, record: list[Any], leaks: list[Leak] | None) -> None:
        """Hand the one result out and tell the lookup cache."""
        job_id = record[_JOB]
        success = record[_SUCCESS]
        transfer_time = record[_FINISHED] - record[_STARTED]
        self._results.append(JobResult(job_id, success, record[_NBYTES] if success else 0,
                                       transfer_time))
        self._in_flight.discard(job_id)
        self._unreported.add(job_id)
        self._published += 1
        self._latencies.append(transfer_time)
        self._retries += record[_RETRIES]
        if not success:
            self._failed += 1
            logger.warning("job %d: %s of %d block(s) failed: %s", job_id,
                           "load" if record[_LOAD] else "store", len(record[_NAMES]),
                           record[_ERROR])
        if leaks:
            for leak in leaks:
                logger.warning("job %d leaked: %s raised %s", job_id, leak.call, leak.error)
            self._leaks.extend((job_id, leak) for leak in leaks)
        names, known, forgotten = record[_NAMES], self._known, self._forgotten
        if success or record[_LOAD]:
            verdict = Lookup.HIT if success else Lookup.MISS
            if forgotten and success:  # a store makes them the tier's again; a load does not
                if record[_LOAD]:
                    names = [name for name in names if name not in forgotten]
                else:
                    forgotten.difference_update(names)
            for name in names:
                known[name] = verdict
        else:  # a failed store: MISS, and no load of them, until a store of them succeeds
            forgotten.update(names)
            for name in names:
                known[name] = Lookup.MISS

    def _validate(self, job: Any, load: bool) -> tuple[tuple[str, ...], tuple[int, ...]]:
        if type(job) is not TransferJob and not isinstance(job, TransferJob):
            raise InvalidJobError(f"expected a TransferJob, got {type(job).__name__}")
        job_id = job.job_id
        if type(job_id) is not int and (not isinstance(job_id, int) or isinstance(job_id, bool)):
            raise InvalidJobError(f"job_id must be an int, got {job_id!r}")
        if job_id in self._in_flight:
            raise InvalidJobError(f"job {job_id} is already in flight")
        if job_id in self._unreported:
            raise InvalidJobError(f"job {job_id} has a result not yet collected")
        if job.is_promotion != load:
            raise InvalidJobError(f"job {job_id} has is_promotion={job.is_promotion}")
        keys, raw_ids = job.keys, job.block_ids
        _check_sequence(job_id, "keys", keys)
        _check_sequence(job_id, "block_ids", raw_ids)
        if len(keys) != len(raw_ids):
            raise InvalidJobError(f"job {job_id} has {len(keys)} keys but "
                                  f"{len(raw_ids)} block ids")
        prefix = self.key_prefix
        names = tuple([prefix + key if type(key) is str and key else
                       prefix + _key_text(key) for key in keys])
        if len(set(names)) != len(names):
            raise InvalidJobError(f"job {job_id}: two keys name the same block")
        num_blocks = self.num_blocks
        block_ids = tuple(raw_ids)
        for block_id in block_ids:
            if type(block_id) is not int:
                block_ids = tuple(_block_id(job_id, b) for b in raw_ids)
                break
        for block_id in block_ids:
            if not 0 <= block_id < num_blocks:
                raise InvalidJobError(f"job {job_id}: block id {block_id} is out of range "
                                      f"[0, {num_blocks})")
        if load and len(set(block_ids)) != len(block_ids):
            raise InvalidJobError(f"job {job_id} loads into the same block twice")
        return names, block_ids


def _check_sequence(job_id: int, field: str, value: object) -> None:
    kind = type(value)
    if kind is not list and kind is not tuple and (
            isinstance(value, str | bytes) or not isinstance(value, Sequence)):
        raise InvalidJobError(f"job {job_id}: {field} must be a list or tuple, got "
                              f"{kind.__name__} {value!r}")


def _block_id(job_id: int, block_id: object) -> int:
    if isinstance(block_id, bool):
        raise InvalidJobError(f"job {job_id}: block id {block_id!r} is not an int")
    try:
        return operator.index(block_id)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidJobError(f"job {job_id}: block id {block_id!r} is not an int") from None


def _key_text(key: object) -> str:
    if isinstance(key, str):
        text = key
    elif isinstance(key, bytes):
        text = key.hex()
    else:
        raise InvalidJobError(f"a key must be bytes or str, got {type(key).__name__} {key!r}")
    if not text:
        raise InvalidJobError("a key must not be empty")
    return text
