"""An object-store secondary tier: one object per KV block, over NIXL's OBJ backend."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import math
import os
import re
import threading
import time
import urllib.parse
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvfsm.agent import NixlAgent
from kvfsm.contract import check_interval, check_timeout
from kvfsm.driver import StepFunction, StorageSide
from kvfsm.engine import Declaration
from kvfsm.policy import InFlightLimit, RetryPolicy
from kvfsm.tiers.base import (
    KnownNames,
    Lookup,
    RemovalInFlightError,
    SecondaryTier,
    check_backend,
    check_text,
    check_tier_options,
    key_text,
    logger,
)
from kvfsm.tiers.holdings import check_remove, removal_failures
from kvfsm.transfer import FailureKind, Leak, Transfer

__all__ = ["ObjectStoreTier", "ShortObjectError", "s3_deleter"]

# NIXL's OBJ backend maps a descriptor's device id to its object key, so every descriptor
# registered at the same time, by any tier of the process, needs its own id; they are reused
# only after 2**31 registrations.
_DEV_ID_SPACE = 2**31
_dev_ids = itertools.count()

#: the most names a prober keeps waiting to be asked about
MAX_WANTED = 4096

#: seconds a probe agent is kept after NIXL gave up a query of it, before it is let go of:
#: the query's HTTP request may still run, and tearing the agent down waits for it holding the
#: interpreter's lock (measured against a frozen store: some 29 s after NIXL's 30 s give-up,
#: during which no thread of the process ran)
SETTLE_SECONDS = 45.0

#: probers and removers whose thread may still run; told to stop when the interpreter exits
_live_probers: weakref.WeakSet[_Prober] = weakref.WeakSet()
_live_removers: weakref.WeakSet[_Remover] = weakref.WeakSet()


def _stop_all_probers() -> None:
    """At interpreter exit, before it waits for threads: drop every name not yet asked (and
    every object not yet deleted), so it waits only for the calls in flight."""
    for prober in list(_live_probers):
        prober.stop(0.0)
    for remover in list(_live_removers):
        remover.drop()


# runs before the interpreter joins its non-daemon threads (atexit handlers run after that)
getattr(threading, "_register_atexit", lambda _: None)(_stop_all_probers)


def _let_go(agent: Any, gave_up_at: float | None, settle: float) -> None:
    """Let go of a probe ``agent`` (the caller drops its own reference once this returns):
    at once, unless NIXL gave up a query of it less than ``settle`` seconds ago
    (:data:`SETTLE_SECONDS` for an agent the tier made); then a thread of its own holds it
    until that much time passed, sleeping, not a daemon (an exit waits for it, as for a query
    in flight; a shutdown does not: the probe's thread, which it joins, ends at once). With no
    thread to be had, it is kept for the process's life. The wait releases the interpreter's
    lock, as the agent's teardown would not."""
    wait = 0.0 if gave_up_at is None else gave_up_at + settle - time.monotonic()
    if agent is None or wait <= 0:  # (none: the probe's thread has it, and lets go of it)
        return
    try:
        threading.Thread(target=_hold, args=(agent, wait),
                         name="kvfsm-probe-agent-settle").start()
    except RuntimeError:  # no thread to be had: kept rather than waited for here (a
        _unsettled.append(agent)  # shutdown's thread, a collection's: their caller's)


#: the probe agents no settle thread could be started for: never let go of in this process
_unsettled: list[Any] = []


def _hold(agent: Any, wait: float) -> None:
    """A settle thread: holds ``agent`` (its arguments) ``wait`` seconds, then lets go of it."""
    time.sleep(wait)


class ShortObjectError(Exception):
    """A load found an object shorter than a block: NIXL's OBJ backend read what it had into
    the start of the block and answered DONE, leaving the rest of the block as it was."""


#: the bytes at the end of a load's block marked before NIXL reads into it (see _Objects)
MARK_BYTES = 8


class _Objects(StorageSide):
    """The remote side: one object descriptor per block, nothing to open or close; a NIXL
    transfer per block (the OBJ backend answers a failed request's error while the job's other
    requests still run: :class:`~kvfsm.driver.Split`).

    NIXL's OBJ backend reads what an object has and answers DONE, so an object shorter than a
    block would fill the start of it and leave the rest as the engine had it, published as a
    success. So before a load the last :data:`MARK_BYTES` bytes of each of its blocks are set
    to a mark (random, the tier's own), and once NIXL answers DONE a block that still ends in
    the mark was not filled: the load fails (:class:`ShortObjectError`, its call ``landed``).
    An object the size of a block overwrites the mark unless its own last 8 bytes are the mark
    (one chance in 2**64). What this cannot see: an object shorter by less than 8 bytes whose
    bytes overwrite a part of the mark (the rest of the mark stays in the block, published),
    and an object longer than a block (its first block's worth is read); blocks of fewer than
    8 bytes are not marked. A quarantined load keeps its marks (NIXL may still write), as does
    one whose cleanup an interrupt cut short."""

    mem_type = "OBJ"
    transfer_per_block = True
    closes_opened_only = True  # (a store keeps nothing: its cleanup makes no call here)

    def __init__(self, primary: torch.Tensor) -> None:
        self.primary = primary
        self.block_bytes = size = int(primary[0].nbytes)
        self.base = primary.data_ptr()  # where NIXL registers it (the tier checks it stays)
        self.mark = os.urandom(MARK_BYTES)
        self._ends = self.base + size - MARK_BYTES  # block 0's mark; block b's b blocks on
        #: an object shorter than a block can be seen (see above)
        self.marks = size >= MARK_BYTES

    def open(self, transfer: Transfer) -> list[tuple[int, int, int, str]]:
        size, dev_ids = self.block_bytes, _dev_ids
        if transfer.job.is_promotion and self.marks and self._in_place():
            mark, ends = self.mark, self._ends
            tails = [ctypes.string_at(ends + block * size, MARK_BYTES)
                     for block in transfer.job.block_ids]
            transfer.opened = tails  # put back if the load fails (close)
            for block in transfer.job.block_ids:
                ctypes.memmove(ends + block * size, mark, MARK_BYTES)
        return [(0, size, next(dev_ids) % _DEV_ID_SPACE, name) for name in transfer.names]

    def close(self, transfer: Transfer) -> list[Leak]:
        """A load NIXL let go of that did not succeed (failed, or its outcome not latched: an
        interrupt cut the latch short, and it fails): each block that still ends in the mark
        gets back the bytes the mark covered."""
        tails = transfer.opened
        if tails is not None and transfer.success is not True and self._in_place():
            size, ends = self.block_bytes, self._ends
            for block, tail in zip(transfer.job.block_ids, tails, strict=True):
                if ctypes.string_at(ends + block * size, MARK_BYTES) == self.mark:
                    ctypes.memmove(ends + block * size, tail, MARK_BYTES)
        return []

    def landed(self, transfer: Transfer) -> None:
        """Raises :class:`ShortObjectError` naming each object of the load shorter than a
        block (its block still ends in the mark :meth:`open` set)."""
        if not self.marks or not self._in_place():
            return
        size, mark, ends = self.block_bytes, self.mark, self._ends
        short = [name for name, block in zip(transfer.names, transfer.job.block_ids, strict=True)
                 if ctypes.string_at(ends + block * size, MARK_BYTES) == mark]
        if short:
            raise ShortObjectError(
                f"{len(short)} object(s) shorter than a block of {size} bytes: "
                f"{', '.join(repr(name) for name in short[:3])}"
                f"{' and more' if len(short) > 3 else ''}; NIXL's OBJ backend read what each "
                "had into the start of its block and left the rest as it was")

    def _in_place(self) -> bool:
        """The primary cache is still where NIXL registered it (a tier refuses jobs once it
        moved, and fails those it has: its old memory is not read or written here)."""
        return self.primary.data_ptr() == self.base


#: the calls that carry an OBJ request's outcome: a failure there is the store's answer
_OBJ_REQUESTS = frozenset({"transfer", "check_xfer_state"})
#: seconds between two bucket checks after failed requests (one at a time)
EXPLAIN_EVERY = 10.0
#: how long a bucket check after a failed request waits for the store's answer
EXPLAIN_TIMEOUT = 5.0
_SAYS_NO_MORE = "NIXL's OBJ backend says no more"


class _Explainer:
    """A job real NIXL's OBJ backend failed: NIXL says ``nixlBackendError: NIXL_ERR_BACKEND``
    whatever the store answered (an object that is not there, a bucket that is not, refused
    credentials, a server error), so the job's reason also says what it may have been, and
    where the request went (the bucket and the endpoint, for a tier built from a
    :class:`StoreConfig`; in the same words for every job of a kind, so failures group by
    them); for such a tier a check of the bucket, on a thread of its own (one at a time, at
    most one every :data:`EXPLAIN_EVERY` seconds, each within :data:`EXPLAIN_TIMEOUT`), logs
    what the store answers. Holds no reference to its tier (a book of the tier's runner: no
    cycle keeps a tier alive)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.endpoint = (None if store is None else
                         store.endpoint or f"https://s3.{store.region}.amazonaws.com")
        self.where = ("" if store is None
                      else f"a request to bucket {store.bucket!r} at {self.endpoint}; ")
        self._lock = threading.Lock()
        self._next_at = 0.0
        self._started = False  # a check's thread runs

    def __call__(self, transfer: Transfer) -> None:
        reason = transfer.reason
        if (reason is None or reason.kind is not FailureKind.RAISED
                or reason.call not in _OBJ_REQUESTS
                or reason.error_type != "nixlBackendError"
                or _SAYS_NO_MORE in reason.error):  # (told already: books run twice)
            return
        load = transfer.job.is_promotion  # (the same words for every job of a kind: failures
        transfer.reason = dataclasses.replace(reason, error=(  # are told apart by them)
            f"{reason.error} ({self.where}{_SAYS_NO_MORE}: "
            + ("an object may not be there, " if load else "")
            + "the bucket may be missing or unreachable, or the credentials refused"
            + ("; the tier checks the bucket, and logs what it answers)" if self.store
               else ")")))
        if self.store is not None:
            self._check(transfer.job_id, "load" if load else "store")

    def _check(self, job_id: int, kind: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next_at:
                return
            self._next_at = math.inf  # until the check is over, then EXPLAIN_EVERY more
        try:
            threading.Thread(target=self._check_bucket, args=(job_id, kind),
                             name="kvfsm-obj-explain", daemon=True).start()
        except BaseException as error:  # (no thread to be had, or an interrupt in its start:
            with self._lock:  # a later failure checks again, unless the thread runs after all)
                if self._next_at == math.inf and not self._started:
                    self._next_at = time.monotonic() + EXPLAIN_EVERY
            if not isinstance(error, Exception):
                raise
            logger.warning("ObjectStoreTier: the bucket check after job %d's failure could "
                           "not start: %s: %s", job_id, type(error).__name__, error)

    def _check_bucket(self, job_id: int, kind: str) -> None:
        from kvfsm.nixl_agents import BucketUnreachable, check_bucket  # noqa: PLC0415

        with self._lock:
            self._started = True
        try:
            check_bucket(self.store, EXPLAIN_TIMEOUT)
        except BucketUnreachable as error:
            logger.error("ObjectStoreTier: the %s of job %d failed with NIXL_ERR_BACKEND; "
                         "the bucket check after it: %s", kind, job_id, error)
        except Exception as error:
            logger.warning("ObjectStoreTier: the %s of job %d failed with NIXL_ERR_BACKEND; "
                           "the bucket check after it raised %s: %s", kind, job_id,
                           type(error).__name__, error)
        else:
            logger.warning("ObjectStoreTier: the %s of job %d failed with NIXL_ERR_BACKEND; "
                           "the bucket check after it: bucket %r at %s answers (it is there),"
                           " so the store refused the request itself (%s)", kind, job_id,
                           self.store.bucket, self.endpoint,
                           "its object may not be there, or the credentials were refused"
                           if kind == "load" else "the credentials, or a server error")
        finally:
            with self._lock:
                self._next_at = time.monotonic() + EXPLAIN_EVERY
                self._started = False


class _Prober:
    """Answers lookups off the caller's thread: batches of ``query_memory``.

    On an agent of its own it runs freely; on the tier's agent (``shared``, a lock) each query
    holds the tier's lock, because a NIXL agent is driven by one thread at a time.

    Its thread runs only while names wait to be probed, and is not a daemon: NIXL's OBJ backend
    aborts the process (``terminate called without an active exception``) when the interpreter
    exits under a daemon thread that is inside ``query_memory``, so an exit waits for the query
    in flight instead. That wait is bounded by the batch: against a server that accepts
    connections but never answers, NIXL 1.5.1 gives up on a batch's keys one after the other,
    30 s each (measured: 1 key 30 s, 3 keys 90 s), so ``batch`` keys cost at most ``batch`` x
    30 s. :meth:`stop`, interpreter exit and a dropped tier all drop the names still waiting,
    so nothing past the query in flight is waited for.
    """

    def __init__(self, agent: Any, known: KnownNames, batch: int,
                 shared: threading.RLock | None, miss_for: float,
                 removing: Callable[[Sequence[str]], tuple[str, ...]] | None = None) -> None:
        self._agent = agent
        self._pid = os.getpid()  # (a forked child leaves the parent's prober alone)
        self._shared = shared
        self._known = known
        #: the names the tier is deleting: found or not, a probe answers MISS for them
        self._removing = removing
        self._batch = batch
        self.miss_for = miss_for
        self._wanted: dict[str, None] = {}  # insertion-ordered set of names to probe
        #: names whose last query failed (the store did not answer), oldest first, at most
        #: MAX_WANTED: asked about again, they answer MISS meanwhile (:meth:`failed_before`)
        self._unanswered: dict[str, None] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.errors = 0
        #: when NIXL last gave up a query (None: never), and how long the agent is kept after
        #: it before it is let go of (:data:`SETTLE_SECONDS` for an agent the tier made, whose
        #: last reference is the tier's; 0 for one it was given)
        self._gave_up_at: float | None = None
        self.settle_seconds = 0.0
        _live_probers.add(self)

    def want(self, name: str) -> None:
        """Ask about ``name`` soon; ignored while :data:`MAX_WANTED` names wait already (a
        store that answers slowly must not grow the queue without end: a later lookup asks
        again)."""
        with self._lock:
            if self._stopping or name in self._wanted or len(self._wanted) >= MAX_WANTED:
                return
            self._wanted[name] = None
            if self._thread is None:  # none running: start one, which ends once all answered
                thread = threading.Thread(target=self._run, name="kvfsm-object-probe")
                try:
                    thread.start()
                except RuntimeError:  # out of threads: nothing waits, a later lookup asks again
                    self._wanted.pop(name, None)
                    self.errors += 1
                    logger.warning("lookup probe not started (no thread): %r answers RETRY",
                                   name)
                    return
                self._thread = thread

    def signal_stop(self) -> None:
        """Drop the names not yet asked; no query starts from now on (one in flight goes on)."""
        with self._lock:
            self._stopping = True
            self._wanted.clear()

    def stop(self, timeout: float | None = None) -> bool:
        """Drop the names not yet asked and wait up to ``timeout`` seconds (None: as long as
        it takes) for the query in flight; True when no query runs any more. In a forked
        child, nothing: the prober and its NIXL agent are the parent's (dropping the child's
        copy of the agent never returned)."""
        if os.getpid() != self._pid:
            return True
        self.signal_stop()
        agent = None
        with self._lock:
            thread = self._thread
            if thread is None:
                agent, self._agent = self._agent, None
        _let_go(agent, self._gave_up_at, self.settle_seconds)
        del agent  # (let go of here, unless a settle thread holds it)
        _live_probers.discard(self)
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def failed_before(self, name: str) -> bool:
        """True when the last query about ``name`` failed: a store that does not answer
        answers it MISS, however long the next query waits (NIXL gives a query against a
        frozen store up after 30 s)."""
        return name in self._unanswered

    def __len__(self) -> int:
        return len(self._wanted)

    @property
    def unanswered(self) -> int:
        """How many names' last query failed (at most :data:`MAX_WANTED`)."""
        return len(self._unanswered)

    @property
    def busy(self) -> bool:
        """True while a query may be in flight."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _run(self) -> None:
        agent = None
        try:
            while True:
                with self._lock:  # the check for work and the thread's end are one step
                    if self._stopping or not self._wanted:
                        self._thread = None
                        if self._stopping:  # stopped: the agent goes with the tier
                            agent, self._agent = self._agent, None
                        break
                    names = list(itertools.islice(self._wanted, self._batch))
                if not self._query(names):
                    with self._lock:
                        self._thread = None
                        agent, self._agent = self._agent, None
                        break
        except BaseException:  # an unforeseen error: a later want() starts a thread again
            with self._lock:
                self._thread = None
            raise
        if agent is not None:  # (a settle thread holds it while a query given up may run)
            _let_go(agent, self._gave_up_at, self.settle_seconds)

    def _query(self, names: list[str]) -> bool:
        """Ask for ``names``; False when stopped while waiting for the tier's lock."""
        shared = self._shared
        if shared is not None:
            # wait for the tier's lock, but never past stop(): shutdown may hold it
            while not shared.acquire(timeout=0.05):
                if self._stopping:
                    return False
            if self._stopping:  # stopped while it waited: the tier may be closed by now
                shared.release()
                return False
        removing = self._removing
        doomed = set(removing(names)) if removing is not None else set()
        try:
            answers = self._agent.query_memory([(0, 1, 0, name) for name in names],
                                               "OBJ", "OBJ")
        except Exception as error:  # the store did not answer: MISS for now (below)
            self._gave_up_at = time.monotonic()  # (its request may still run: _let_go)
            self.errors += 1
            answers = None
            if self.errors & (self.errors - 1) == 0:  # the 1st, 2nd, 4th... not every batch
                logger.warning("lookup probe failed (%d so far): %s: %s; its %d name(s) "
                               "answer MISS for %s s, then are asked again", self.errors,
                               type(error).__name__, str(error), len(names), self.miss_for)
                # (as text: a record a handler keeps would keep the error, its traceback,
                # and through it the agent, whose teardown must wait: _let_go)
        finally:
            if shared is not None:
                shared.release()
        if answers is not None and len(answers) != len(names):  # not an answer per name
            self.errors += 1
            answers = None
        if answers is not None and removing is not None:  # (deleted before, or during, it)
            doomed.update(removing(names))
        self._record(names, answers, doomed)
        return True

    def _record(self, names: list[str], answers: list[Any] | None, doomed: set[str]) -> None:
        """What a query answered for ``names`` (None: it failed), as the lookups' verdicts."""
        with self._lock:
            unanswered = self._unanswered
            for index, name in enumerate(names):
                self._wanted.pop(name, None)
                if answers is None:
                    unanswered[name] = None
                    if len(unanswered) > MAX_WANTED:
                        del unanswered[next(iter(unanswered))]
                else:
                    unanswered.pop(name, None)
                # a result the tier recorded meanwhile is newer than this probe; a query that
                # failed (a dead or frozen store) answers MISS until it is asked again, where
                # RETRY for ever would hold the engine's request back for ever
                self._known.offer(
                    name, Lookup.MISS if answers is None or answers[index] is None
                    or name in doomed else Lookup.HIT, self.miss_for)


class _Remover:
    """Deletes objects on a thread of its own, in batches, so that an eviction never waits
    for the store: the tier forgets a block at once (its lookups answer MISS), and its object
    goes a little later. A store of a name still waiting to be deleted takes it back
    (:meth:`take_back`): its delete is not sent. A store of a name whose delete was sent and
    not yet answered is refused (:class:`~kvfsm.tiers.RemovalInFlightError`): the delete
    could land after the new object, which the tier would then hold as stored. (A delete that
    raised, a timeout say, is taken as answered: should the store still carry it out later,
    the block's next load fails and the block is a MISS from then on; bytes are never wrong.)

    Its thread runs only while names wait, and is not a daemon (a delete in flight is waited
    for at exit, as a probe is).
    """

    def __init__(self, delete: Callable[[list[str]], int | None], batch: int = 1000) -> None:
        self._delete = delete
        self._batch = batch
        self._waiting: dict[str, None] = {}
        #: the names of the delete sent and not yet answered
        self._sending: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        #: objects whose delete failed or was never sent (they stay in the store)
        self.errors = 0
        #: objects deleted
        self.deleted = 0
        #: stores refused while a delete of one of their names was in flight
        self.stores_refused = 0
        _live_removers.add(self)

    def drop(self) -> None:
        """Send no more deletes (those waiting stay in the store, counted as errors); the one
        in flight ends by itself."""
        with self._lock:
            self._stopping = True
            self.errors += len(self._waiting)
            self._waiting.clear()

    def __call__(self, names: Sequence[str]) -> int:
        with self._lock:
            if self._stopping:
                self.errors += len(names)
                return 0
            self._waiting.update(dict.fromkeys(names))
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="kvfsm-object-remove")
                try:
                    thread.start()
                except RuntimeError:  # out of threads: not sent, counted (they stay stored)
                    logger.warning("%d evicted object(s) not deleted: no thread to send the "
                                   "delete", len(self._waiting))
                    self.errors += len(self._waiting)
                    self._waiting.clear()
                    return 0
                self._thread = thread
        return 0

    def take_back(self, names: Sequence[str]) -> list[str]:
        """``names`` are about to be stored again: those waiting are not deleted; returns them.

        Raises:
            RemovalInFlightError: the delete of one of them is sent and not yet answered;
                nothing was taken back.
        """
        with self._lock:
            sending = self._sending
            if sending and not sending.isdisjoint(names):
                self.stores_refused += 1
                raise RemovalInFlightError(
                    f"store of {', '.join(n for n in names if n in sending)} refused: the "
                    "object is being deleted (evicted a moment ago; the delete is sent, not "
                    "yet answered), and could be deleted after a new write; nothing was "
                    "registered and no result will come")
            waiting = self._waiting
            taken = [name for name in names if name in waiting] if waiting else []
            for name in taken:
                del waiting[name]
            return taken

    def removing(self, names: Sequence[str]) -> tuple[str, ...]:
        """Those of ``names`` waiting to be deleted or being deleted."""
        with self._lock:
            waiting, sending = self._waiting, self._sending
            if not waiting and not sending:
                return ()
            return tuple(name for name in names if name in waiting or name in sending)

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def sending(self) -> int:
        """How many names the delete in flight carries."""
        return len(self._sending)

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds until no delete waits or runs; True when none does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            thread = self._thread
            if thread is None:
                return True
            if thread is threading.current_thread():
                return False  # asked from inside a delete: it cannot wait for itself
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False

    def stop(self, timeout: float | None) -> bool:
        """Send what waits, then stop; wait up to ``timeout`` seconds (None: as long as it
        takes). True when no delete runs any more, or when asked from the deletes' own thread
        (a ``remove=`` that shuts its tier down): that one goes on with what waits once the
        call returns, then ends; nothing is left unsent."""
        with self._lock:
            self._stopping = True
            thread = self._thread
        if thread is None:
            return True
        if thread is threading.current_thread():  # asked from inside a delete (its tier shut
            return True  # down there): it sends what waits once that returns, then ends
        thread.join(timeout)
        if thread.is_alive():
            with self._lock:  # not sent: left in the store
                self.errors += len(self._waiting)
                self._waiting.clear()
            return False
        return True

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._waiting:
                        self._thread = None
                        return
                    names = list(itertools.islice(self._waiting, self._batch))
                    for name in names:
                        del self._waiting[name]
                    self._sending = frozenset(names)
                failed = len(names)  # unless the delete answers
                try:
                    failed = removal_failures(self._delete, names)
                finally:
                    with self._lock:  # answered (or given up): the names may be stored again
                        self._sending = frozenset()
                        self.errors += failed
                        self.deleted += len(names) - failed
        finally:  # a remove= that ended the thread (SystemExit, say): what waits is not
            with self._lock:  # sent (left in the store), the next names start another thread
                if self._thread is threading.current_thread():
                    self._thread = None
                    if self._waiting:
                        logger.warning("%d evicted object(s) not deleted: the delete ended its "
                                       "thread", len(self._waiting))
                        self.errors += len(self._waiting)
                        self._waiting.clear()


def s3_deleter(store: Any) -> Callable[[list[str]], int]:
    """Deletes objects of ``store`` (a :class:`~kvfsm.nixl_agents.StoreConfig`) with an S3
    client (boto3; NIXL's OBJ backend can write, read and query objects, not delete them);
    the function returns how many deletes failed.

    Raises:
        ValueError: boto3 is not installed.
    """
    try:
        import boto3  # noqa: PLC0415 - needed only by tiers with a capacity
        from botocore.config import Config  # noqa: PLC0415
    except ImportError as error:
        raise ValueError("an ObjectStoreTier with capacity_bytes deletes objects with boto3: "
                         f"pip install boto3, or pass remove= ({error})") from None
    client = boto3.client(
        "s3", endpoint_url=store.endpoint, region_name=store.region,
        aws_access_key_id=store.access_key, aws_secret_access_key=store.secret_key,
        config=Config(s3={"addressing_style": "virtual" if store.use_virtual_addressing
                          else "path"},
                      connect_timeout=5, read_timeout=30, retries={"max_attempts": 3}))
    bucket = store.bucket

    def delete(names: list[str]) -> int:
        answer = client.delete_objects(
            Bucket=bucket, Delete={"Objects": [{"Key": name} for name in names], "Quiet": True})
        errors = answer.get("Errors", ())
        if errors:
            first = errors[0]
            logger.warning("%d of %d evicted object(s) not deleted from bucket %s, left there; "
                           "the first: %s: %s %s", len(errors), len(names), bucket,
                           first.get("Key"), first.get("Code"), first.get("Message"))
        return len(errors)

    return delete


#: whether NIXL sends the object name ``text`` as it is: not empty, no empty, ``.`` or ``..``
#: part between its slashes (one trailing ``/`` is sent as it is), no line feed (NIXL's
#: request for such a name fails) and no lone surrogate (not UTF-8: NIXL cannot take it), and
#: (so that quoted names stay apart) no leading ``%``; one C call a key
#: (``tests/test_object_store_tier.py`` checks it against that definition, part by part)
_plain = re.compile(r"(?!%)(?!\.{1,2}(?:/|\Z))[^/\n\ud800-\udfff]+"
                    r"(?:/(?!\.{1,2}(?:/|\Z))[^/\n\ud800-\udfff]+)*/?").fullmatch


def object_text(text: str) -> str:
    """The part of an object's name that names key text ``text`` (not empty): ``text`` itself
    when NIXL sends it as it is (``_plain``), else ``%`` and ``text`` percent-quoted whole
    (no ``/`` is left in it, and every ``%`` of it is quoted)."""
    return text if _plain(text) is not None else "%" + urllib.parse.quote(text, safe="")


def check_key_prefix(prefix: object, name: str = "key_prefix") -> None:
    """Refuse a key prefix NIXL would not send as it is (a leading ``/``, ``//``, a ``.`` or
    ``..`` segment before its last ``/``): two prefixes, or a prefix and a key, could then
    name one object; and one no object name can hold (a line feed, a lone surrogate).

    Raises:
        ValueError: names the prefix (as ``name``) and what is wrong with it.
    """
    if not isinstance(prefix, str):
        raise ValueError(f"{name} must be a str, got {type(prefix).__name__} {prefix!r}")
    if "\n" in prefix:
        raise ValueError(f"{name} {prefix!r} holds a line feed: NIXL's request for an "
                         "object so named fails")
    check_text(name, prefix)
    *folders, _ = prefix.split("/")  # the last part is joined to the key's first
    for folder in folders:
        if folder in ("", ".", ".."):
            raise ValueError(
                f"{name} {prefix!r} has an empty, '.' or '..' part before its last '/': "
                "NIXL's S3 client collapses those, so its objects could be another prefix's "
                "(write it without a leading '/', '//', './' or '../')")


class ObjectStoreTier(SecondaryTier):
    """Stores each block as one object, named ``key_prefix``, the block size's folder, then the
    block key: ``<key_prefix><block bytes>-bytes/<key>``.

    Built with ``agent=`` it drives that agent (a ``nixl_agent`` with the OBJ backend, or a
    :class:`kvfsm.testing.FakeNixlAgent`). Built with ``store=`` it creates its own real agents
    from the :class:`~kvfsm.nixl_agents.StoreConfig`, checks that the bucket is reachable, and
    releases them in :meth:`shutdown`.

    A block a probe found absent, or could not ask about (the store did not answer the query),
    is looked for again once the MISS is :attr:`probed_miss_seconds` old, so a block another
    process (or tier) stores into the same bucket is found; a name whose query failed answers
    MISS until a query about it is answered, so an engine is told RETRY for a store that is
    down only until its first query about a name gives up (NIXL: some 25 s a name against a
    server that refuses connections, its HTTP client retrying, 30 s against a frozen one); one
    whose load failed stays a MISS (F11) until newer
    names push it out of the lookup cache. A process sees an object only once its upload
    completed: S3 makes a PUT visible whole or not at all.

    Args:
        primary: the primary KV cache (contiguous CPU tensor, blocks on the first dimension).
        agent: the NIXL agent to drive; or None with ``store``.
        store: where to create real agents, when ``agent`` is None.
        key_prefix: prepended to every object name (``store.key_prefix`` when built from it).
        size_folder: keep the objects in a folder named by the block size in bytes, after
            ``key_prefix`` (default): a tier of another block size sharing the prefix then
            finds none of them, where it would load a part of one, or fill a part of its block,
            as a success. False only where ``key_prefix`` already tells block sizes apart
            (:mod:`kvfsm.vllm`'s folders do). With it, ``key_prefix`` may not end in a digit
            (``"1"`` and 2,048-byte blocks would name ``"12048-bytes/k"``, as ``""`` and
            12,048-byte blocks do), nor hold a size's folder (``"kv/4096-bytes/"`` and 8 KiB
            blocks name key ``"k"`` as ``"kv/"`` and 4 KiB blocks name ``"8192-bytes/k"``).
        probe_agent: the agent lookups query from a background thread; by default a second
            real agent when built from ``store``, else ``agent`` itself, whose queries then
            hold the tier's lock (give real OBJ agents a probe agent of their own: a query of
            many keys takes a while, and would hold up submits and polls meanwhile).
        probe_batch: at most this many keys per ``query_memory`` call. NIXL asks for a
            batch's keys one after the other and, against a server that never answers, gives
            each up after 30 s: a query in flight holds up the process's exit by up to
            ``probe_batch`` x 30 s (shutdown does not wait for it past its deadline).
        poll_interval: seconds :meth:`drain_jobs` sleeps between polls.
        machine: the lifecycle to run (see :class:`~kvfsm.tiers.base.SecondaryTier`).
        policy: retry bounds (:class:`~kvfsm.policy.RetryPolicy`).
        steps: the functions behind the machine's own effects (see
            :class:`~kvfsm.tiers.base.SecondaryTier`).
        capacity_bytes: the most bytes of objects the tier keeps (None: no bound); past it a
            store first deletes the least recently used objects no transfer uses
            (:mod:`kvfsm.tiers.holdings`), on a thread of the tier's own. Objects it did not
            store itself are not counted.
        record_events: keep what the tier stored and removed for
            :meth:`~kvfsm.tiers.base.SecondaryTier.take_events`.
        remove: deletes objects by name, returning how many it could not (with
            ``capacity_bytes``): by default :func:`s3_deleter` of ``store``; needed with
            ``agent=`` (a :class:`~kvfsm.testing.FakeNixlAgent`'s ``remove_objects``).
        in_flight: back-pressure, the bound on jobs and bytes in flight past which a store is
            refused (:class:`~kvfsm.policy.InFlightLimit`).
    """

    def __init__(
        self,
        primary: torch.Tensor,
        *,
        agent: NixlAgent | None = None,
        store: Any = None,
        key_prefix: str | None = None,
        size_folder: bool = True,
        probe_agent: Any = None,
        probe_batch: int = 16,
        poll_interval: float = 0.0005,
        machine: Declaration[Any, Any] | None = None,
        policy: RetryPolicy | None = None,
        steps: Mapping[str, StepFunction] | None = None,
        capacity_bytes: int | None = None,
        record_events: bool = False,
        remove: Callable[[list[str]], int | None] | None = None,
        in_flight: InFlightLimit | None = None,
    ) -> None:
        _check_store(store, needed=False)  # (before anything reads it)
        check_tier_options(primary, agent=agent, machine=machine, steps=steps, policy=policy,
                           in_flight=in_flight, capacity_bytes=capacity_bytes,
                           record_events=record_events,
                           mem_type="OBJ", tier="ObjectStoreTier")
        if probe_agent is not None and not callable(getattr(probe_agent, "query_memory", None)):
            raise ValueError(f"probe_agent must be a NIXL agent with the OBJ backend (it asks "
                             f"query_memory), got {type(probe_agent).__name__} {probe_agent!r}")
        if probe_agent is not None:
            check_backend(probe_agent, "OBJ", "ObjectStoreTier's probe_agent")
        if key_prefix is None:
            key_prefix = store.key_prefix if store is not None else ""
        check_key_prefix(key_prefix)
        if type(size_folder) is not bool:
            raise ValueError(f"size_folder must be True or False, got {size_folder!r}")
        if size_folder and key_prefix[-1:] in tuple("0123456789"):
            # "1" + "2048-bytes/" is "" + "12048-bytes/": tiers of two block sizes would
            # share objects, each loading a part of the other's blocks as a success
            raise ValueError(
                f"key_prefix {key_prefix!r} ends in a digit, which runs into the block size's "
                f"folder ({key_prefix + str(int(primary[0].nbytes))}-bytes/...): another "
                "prefix and block size could name the same objects; end it with '/' or '-'")
        folder = _SIZE_FOLDER_IN(key_prefix) if size_folder else None
        if folder is not None:
            # "kv/" + "4096-bytes/" + key "8192-bytes/k" is "kv/4096-bytes/" + "8192-bytes/"
            # + key "k": a tier of 8 KiB blocks would load half of a 4 KiB tier's object
            raise ValueError(
                f"key_prefix {key_prefix!r} holds a block size's folder "
                f"({folder[0]!r}): a tier on a shorter prefix names its "
                "objects under it too, so a key of that tier and one of this could name the "
                "same object at two block sizes; name the folder otherwise")
        self.key_prefix = key_prefix
        #: what every object name of the tier starts with: ``key_prefix``, then the folder of
        #: the block size (``"65536-bytes/"``) unless ``size_folder`` is False
        self.name_prefix = key_prefix + (f"{int(primary[0].nbytes)}-bytes/" if size_folder
                                         else "")
        if type(probe_batch) is not int or probe_batch < 1:  # (before anything is registered)
            raise ValueError(f"probe_batch must be an int of at least 1, got {probe_batch!r}")
        check_interval("poll_interval", poll_interval)
        if agent is None and store is None:
            raise ValueError("ObjectStoreTier needs agent= (a NIXL agent) or store= "
                             "(a kvfsm.nixl_agents.StoreConfig)")
        self._remover: _Remover | None = None
        check_remove(remove, capacity_bytes)
        if capacity_bytes is not None:
            if remove is None:
                if store is None:
                    raise ValueError("an ObjectStoreTier built with agent= and capacity_bytes "
                                     "needs remove= (NIXL cannot delete objects)")
                remove = s3_deleter(store)
            self._remover = _Remover(remove)
        made_probe = agent is None and probe_agent is None  # (its last reference the tier's)
        if agent is None:
            agent, probe_agent = _agents_for(store, probe_agent)
        super().__init__(primary, agent=agent, remote=_Objects(primary),
                         poll_interval=poll_interval,
                         machine=machine, policy=policy, steps=steps,
                         capacity_bytes=capacity_bytes, record_events=record_events,
                         remove=self._remover, in_flight=in_flight)
        self._prober = _Prober(probe_agent if probe_agent is not None else agent, self._known,
                               probe_batch, None if probe_agent is not None else self._lock,
                               self.probed_miss_seconds,
                               None if self._remover is None else self._remover.removing)
        self._prober.settle_seconds = SETTLE_SECONDS if made_probe else 0.0
        # a tier dropped without shutdown() stops its prober (never waiting for it)
        weakref.finalize(self, self._prober.stop, 0.0)
        # explains the failures of requests NIXL's OBJ backend tells nothing of: real NIXL's
        self._runner.on_failed += [_Explainer(store)] if self._on_nixl else []
        _warn_of_the_running_bound(self.policy)

    #: seconds a MISS found by a probe is believed before the store is asked again
    probed_miss_seconds: float = 2.0

    def object_key(self, key: bytes | str) -> str:
        """The object name block ``key`` is stored under: :attr:`name_prefix` (the key prefix
        and the block size's folder), then the key as text (a str as it is, bytes in hex; see
        :func:`~kvfsm.tiers.base.key_text`). A subclass naming its blocks otherwise keeps
        :attr:`name_prefix` in its names, or tells block sizes apart itself.

        NIXL's S3 client tidies an object's path before it sends it (a leading ``/``, ``//``,
        ``/./`` and ``x/../`` collapse), so ``"/k"`` and ``"k"`` would be one object. A key
        whose text has an empty (but a trailing ``/``), ``.`` or ``..`` part between its
        slashes, or starts with ``%``, is therefore named ``%`` and its text percent-quoted
        whole (``"/k"`` is ``"%%2Fk"``): no other key's name starts with ``%``, and quoting
        keeps distinct keys apart. So is a key holding a line feed, which NIXL fails to send as
        it is; one holding a lone surrogate has no name (``ValueError``). (A key starting with
        ``%`` was stored under its text before this naming: such blocks are not found again.)
        """
        return self.name_prefix + object_text(key_text(key))

    def remote_name(self, key: bytes | str) -> str:
        """The object name of block ``key``: :meth:`object_key`, which a subclass may name
        its blocks by (transfers, lookups and removals all use it)."""
        return self.object_key(key)

    def _remote_names(self, keys: Sequence[Any]) -> tuple[str, ...]:
        cls = type(self)
        if (cls.object_key is not _OBJECT_KEY or cls.remote_name is not _REMOTE_NAME
                or "object_key" in self.__dict__ or "remote_name" in self.__dict__):
            # other names: a subclass's, an instance's
            return super()._remote_names(keys)
        prefix = self.name_prefix  # a plain str key is its own text: no call for it
        return tuple([prefix + key if type(key) is str and _plain(key) is not None
                      else prefix + object_text(key_text(key)) for key in keys])

    def stats(self) -> dict[str, Any]:
        """The tier's stats, how many names wait for a probe, and how many answer MISS because
        their last probe failed (each at most :data:`MAX_WANTED`)."""
        stats = super().stats()
        stats["probes_waiting"] = len(self._prober)
        stats["probes_unanswered"] = self._prober.unanswered
        remover = self._remover
        if remover is not None:
            holdings = stats["holdings"]
            holdings["removes_waiting"] = len(remover)
            holdings["removes_sending"] = remover.sending
            holdings["stores_refused_removing"] = remover.stores_refused
            holdings["removed"] = remover.deleted
            holdings["remove_errors"] += remover.errors
        return stats

    def wait_for_removals(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: as long as it takes) until every object this
        tier evicted was deleted (or its delete failed); True when none is left to send.

        Raises:
            ValueError: ``timeout`` is not None nor a number of seconds (NaN, a str...).
        """
        timeout = check_timeout(timeout)
        remover = self._remover
        return remover is None or remover.wait(timeout)

    def _take_back(self, names: Sequence[str]) -> Sequence[str]:
        remover = self._remover
        return () if remover is None else remover.take_back(names)

    def _give_back(self, names: Sequence[str]) -> None:
        remover = self._remover
        if remover is not None and names:
            remover(names)

    def _removing(self, names: Sequence[str]) -> tuple[str, ...]:
        remover = self._remover
        return () if remover is None else remover.removing(names)

    @property
    def probe_errors(self) -> int:
        """How many background ``query_memory`` calls raised (their keys answer MISS, asked
        again once the MISS is :attr:`probed_miss_seconds` old)."""
        return self._prober.errors

    def _probe(self, name: str) -> Lookup:
        prober = self._prober
        prober.want(name)
        return Lookup.MISS if prober.failed_before(name) else Lookup.RETRY

    def _signal_stop(self) -> None:
        self._prober.signal_stop()

    def _stop_probes(self) -> None:
        deadline = self._stop_by
        if not self._prober.stop(None if deadline is None
                                 else max(0.0, deadline - time.monotonic())):
            logger.warning("shutdown: a lookup probe is still waiting for the object store; "
                           "its agent is dropped when NIXL answers or gives up")
        remover = self._remover
        if remover is not None and not remover.stop(
                None if deadline is None else max(0.0, deadline - time.monotonic())):
            logger.warning("shutdown: deleting evicted objects did not finish by the deadline: "
                           "a delete of %d object(s) is still waiting for the store, and %d "
                           "more wait to be sent after it (it goes on after shutdown returns); "
                           "%d failed or were never sent before, and stay in the store",
                           remover.sending, len(remover), remover.errors)


#: a block size's folder inside a key prefix (as its tier's names have one after the prefix)
_SIZE_FOLDER_IN = re.compile(r"[0-9]+-bytes/").search

#: the class's own naming: a tier that names keys with these takes the fast path
_OBJECT_KEY, _REMOTE_NAME = ObjectStoreTier.object_key, ObjectStoreTier.remote_name


def _warn_of_the_running_bound(policy: RetryPolicy) -> None:
    """Say, once a tier, what ``max_running_seconds`` risks on a shared bucket."""
    if policy.max_running_seconds is not None:
        logger.warning(
            "ObjectStoreTier: max_running_seconds=%s gives up stores NIXL still runs; their "
            "failed results say blocks_in_use=True, and their blocks must then never be reused "
            "(a TieringManager keeps them pinned): a block reused while the PUT reads it may "
            "land an object holding part of what the block held later, which another process "
            "sharing the bucket finds and loads as a success", policy.max_running_seconds)


def _check_store(store: object, *, needed: bool = True) -> None:
    """ValueError naming ``store`` unless it is a :class:`~kvfsm.nixl_agents.StoreConfig`
    (or, not ``needed``, None)."""
    from kvfsm.nixl_agents import StoreConfig  # noqa: PLC0415

    if not isinstance(store, StoreConfig) and (needed or store is not None):
        raise ValueError(f"store must be a kvfsm.nixl_agents.StoreConfig (the bucket, its "
                         f"endpoint and credentials), got {type(store).__name__} {store!r:.80}")


def _agents_for(store: Any, probe_agent: Any) -> tuple[Any, Any]:
    from kvfsm.nixl_agents import (  # noqa: PLC0415
        NO_CREDENTIALS,
        NoCredentialsWarning,
        check_bucket,
        credentials_found,
        make_agent,
    )

    _check_store(store)
    check_bucket(store)
    if not credentials_found(store):  # (an instance role may still answer, on AWS itself)
        # a Python warning, shown once where no logging is set up (kvfsm's logger has none)
        warnings.warn(f"ObjectStoreTier: {NO_CREDENTIALS}; unless this machine's instance "
                      "role answers, every transfer will fail with NIXL_ERR_BACKEND",
                      NoCredentialsWarning, stacklevel=3)
    threads = store.io_threads or 0
    agent = make_agent(f"kvfsm-obj-{id(store):x}", "OBJ", store.backend_params(), threads)
    if probe_agent is None:
        probe_agent = make_agent(f"kvfsm-obj-probe-{id(store):x}", "OBJ",
                                 store.backend_params(), threads)
    return agent, probe_agent
