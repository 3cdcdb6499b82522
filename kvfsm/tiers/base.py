"""The secondary-tier contract, run on the transfer lifecycle.

A :class:`SecondaryTier` owns the primary KV cache's NIXL registration and a table of in-flight
transfers, keyed by job id. ``submit_*`` validates the job, makes the submit calls and leaves the
transfer where the machine put it; ``get_finished_jobs`` advances every transfer as far as NIXL's
answers allow and hands out the results of those that reached PUBLISHED. A transfer leaves the
table only on PUBLISHED, so no result is ever lost or handed out twice.

Subclasses say how a block key names a remote block (:meth:`SecondaryTier.remote_name`), give
the driver their remote side, and probe for blocks they were not told about (:meth:`_probe`).
"""

from __future__ import annotations

import collections
import enum
import functools
import logging
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import compress, islice, repeat
from typing import Any

import torch

from kvfsm.agent import LOCAL_AGENT, NixlAgent
from kvfsm.driver import NIXL_RUNNING, RemoteSide, StepFunction, TransferDriver, check_runnable
from kvfsm.engine import Declaration
from kvfsm.machines.transfer import TRANSFER_MACHINE, Answer, TransferEvent, TransferState
from kvfsm.policy import RetryPolicy
from kvfsm.transfer import JobResult, Leak, Transfer, TransferJob

__all__ = [
    "DrainTimeout",
    "InvalidJobError",
    "Lookup",
    "SecondaryTier",
    "TierClosedError",
    "UnknownJobError",
    "key_text",
]


class Lookup(enum.Enum):
    """Whether a tier holds a block."""

    #: the tier holds the block; a load may be submitted
    HIT = "hit"
    #: the tier does not hold the block (or its last load failed)
    MISS = "miss"
    #: not known yet: a probe is under way, ask again on a later step
    RETRY = "retry"


class InvalidJobError(ValueError):
    """A submitted job was malformed; nothing was registered and no result will be published."""


class UnknownJobError(ValueError):
    """No unpublished job has that id."""


class TierClosedError(RuntimeError):
    """The tier was shut down and takes no more jobs."""


class DrainTimeout(TimeoutError):
    """Transfers were still unpublished at the deadline; lists each with its state and error."""

    def __init__(self, what: str, stuck: Sequence[Transfer]) -> None:
        self.stuck = tuple(stuck)
        lines = [f"job {t.job_id}: {t.state.name}, retries={t.retries}, last error: {t.error}"
                 for t in self.stuck]
        super().__init__(f"{what}: {len(self.stuck)} transfer(s) not published\n  "
                         + "\n  ".join(lines))


class KnownNames:
    """What a tier knows of the most recent ``limit`` remote names it saw: HIT or MISS.

    Each verdict recorded makes its name the most recent; once more than ``limit`` are known,
    the oldest are forgotten, so the cache stays bounded however many keys a tier ever
    stored. A forgotten name is only asked about again (a probe), never answered wrongly. A
    probe's answer never replaces a verdict recorded meanwhile (:meth:`offer`), and a MISS a
    probe found may be given an age past which it is asked again: another process sharing
    the store may write the block meanwhile.

    One thread records (under the tier's lock) while a probe thread offers and lookups read
    without it: the writes (and the removal of an expired MISS) take a lock of the cache's
    own, so none of them can undo another's newer verdict; a read of a live verdict takes none.
    """

    __slots__ = ("_lock", "_names", "limit")

    def __init__(self, limit: int) -> None:
        if type(limit) is not int or limit < 1:
            raise ValueError(f"the lookup cache needs a limit of at least 1, got {limit!r}")
        self.limit = limit
        self._lock = threading.Lock()
        #: a verdict, or (for a probed MISS with an age) the monotonic time it expires
        self._names: dict[str, Lookup | float] = {}

    def get(self, name: str) -> Lookup | None:
        """The verdict on ``name``, or None when it is not known (any more)."""
        verdict = self._names.get(name)
        if type(verdict) is not float:
            return verdict  # type: ignore[return-value]
        if time.monotonic() < verdict:
            return Lookup.MISS
        with self._lock:  # expired: ask again (unless a verdict was recorded meanwhile)
            if self._names.get(name) == verdict:
                del self._names[name]
        return None

    def record(self, names: Sequence[str], verdict: Lookup) -> None:
        """A transfer's outcome: ``verdict`` on each of ``names``, now the most recent."""
        known = self._names
        with self._lock:
            for name in names:
                known.pop(name, None)
                known[name] = verdict
            if len(known) > self.limit:
                self._forget_oldest()

    def offer(self, name: str, verdict: Lookup, miss_for: float | None = None) -> None:
        """A probe's answer: kept unless a verdict on ``name`` is known already; a MISS only
        for ``miss_for`` seconds when that is given."""
        with self._lock:
            self._names.setdefault(name, verdict if verdict is not Lookup.MISS
                                   or miss_for is None else time.monotonic() + miss_for)
            if len(self._names) > self.limit:
                self._forget_oldest()

    def __len__(self) -> int:
        return len(self._names)

    def _forget_oldest(self) -> None:
        """Drop the oldest verdicts past the limit (the caller holds the cache's lock)."""
        known = self._names
        while len(known) > self.limit:
            del known[next(iter(known))]


class SecondaryTier:
    """A tier that copies primary KV blocks out and back with NIXL, one machine per transfer.

    Args:
        primary: the primary KV cache, a contiguous CPU tensor whose first dimension indexes
            blocks.
        agent: a NIXL agent (``nixl_agent`` or :class:`kvfsm.testing.FakeNixlAgent`).
        poll_interval: seconds :meth:`drain_jobs` sleeps between polls while transfers run.
        machine: the lifecycle to run, by default :data:`~kvfsm.machines.transfer.TRANSFER_MACHINE`
            (the explorer's tests run deliberately broken variants through the same tier).
        policy: bounds on retrying failed releases and waiting for running transfers
            (:class:`~kvfsm.policy.RetryPolicy`; by default a release is retried for 60 s).
        steps: the functions behind the machine's own effects, by name (a state that waits on
            an effect the tier does not make, such as ``verify``): each gets the transfer and
            the primary cache and answers one of its event's answers
            (:data:`~kvfsm.driver.StepFunction`).

    Raises:
        MachineRefused: the machine cannot run in a tier (:func:`~kvfsm.driver.check_runnable`
            says what is missing); raised before any NIXL call.

    Bounded memory: the lookup cache keeps the verdicts on the last :attr:`known_names`
    names, and :meth:`stats` lists the last :attr:`leak_record` leaks (and counts them all).
    Set either on the class or a subclass before a tier is made.
    """

    #: how many remote names the lookup cache keeps a verdict on (about 150 bytes each)
    known_names: int = 1 << 16
    #: how many leaks stats() lists (the count of all of them is kept)
    leak_record: int = 256

    def __init__(self, primary: torch.Tensor, *, agent: NixlAgent, remote: RemoteSide,
                 poll_interval: float = 0.0005,
                 machine: Declaration[Any, Any] | None = None,
                 policy: RetryPolicy | None = None,
                 steps: Mapping[str, StepFunction] | None = None) -> None:
        _check_primary(primary)
        self.primary = primary
        self.agent = agent
        self.num_blocks = int(primary.shape[0])
        self.block_bytes = int(primary[0].nbytes)
        self.poll_interval = poll_interval
        self.policy = policy if policy is not None else RetryPolicy()
        declaration = machine or TRANSFER_MACHINE
        check_runnable(declaration, steps or {}, self.policy)  # before any NIXL call
        self.driver = TransferDriver(agent, remote, declaration.compile(trace=True),
                                     self.policy, _bind(steps or {}, primary))
        #: the states NIXL may run a transfer in (the declaration's running states)
        self._running_states = declaration.running
        self._initial = declaration.initial
        #: a final state that is a failure: a transfer there ended without its release (held)
        self._held = declaration.final & declaration.failure_states
        #: transfers quarantined (handles held for good); ids of those that may still run
        self._quarantine: list[Transfer] = []
        self._may_run: set[int] = set()
        # the state a posted transfer NIXL runs waits in (post answering PROC leads there):
        # its transfers are polled in bulk, and a poll its machine answers with a stay (a
        # self-loop without actions) is only counted
        table = self.driver.machine.table
        self._posted = table[declaration.initial][TransferEvent.POST][Answer.PROC].dest
        step = table[self._posted][TransferEvent.POLL][Answer.PROC]
        self._proc_stay = step if step.is_stay else None
        #: called with each transfer as it is published (a trace recorder, for one)
        self.on_published: list[Callable[[Transfer], None]] = []
        #: what the tier knows of recent remote names: set by results, filled in by probes
        self._known = KnownNames(self.known_names)
        self._transfers: dict[int, Transfer] = {}  # every unpublished transfer, by job id
        self._running = _Running()  # those in PROCESSING, and their transfer handles
        self._waiting: dict[int, Transfer] = {}  # the others (a release to retry, cancelling)
        self._waiting_in: collections.Counter[TransferState] = collections.Counter()
        self._results: list[JobResult] = []
        self._unreported: set[int] = set()  # job ids published but not yet handed out
        self._closed = False
        self._closing = False
        #: when shutdown() must return by (None: no deadline); background work is not waited
        #: for past it
        self._stop_by: float | None = None
        self._published = 0
        self._failed = 0
        self._latencies: collections.deque[float] = collections.deque(maxlen=4096)
        self._lock = threading.RLock()
        #: the steps a release that raised and is retried takes (their counts are the retries)
        self._retry_steps = [answers[Answer.RAISED]
                             for events in self.driver.machine.table.values()
                             if (answers := events.get(TransferEvent.RELEASE, {})).get(
                                 Answer.RAISED) is not None]
        self._leaks: collections.deque[tuple[int, Leak]] = collections.deque(
            maxlen=self.leak_record)
        self._leak_count = 0
        base = primary.data_ptr()
        self._dram = agent.register_memory(
            [(base, self.num_blocks * self.block_bytes, 0, "")], "DRAM")
        try:
            self._local = agent.prep_xfer_dlist(
                LOCAL_AGENT,
                [(base + i * self.block_bytes, self.block_bytes, 0)
                 for i in range(self.num_blocks)],
                "DRAM")
        except BaseException:
            agent.deregister_memory(self._dram)
            raise

    # -- the contract -----------------------------------------------------------------------

    def submit_store(self, job: TransferJob) -> None:
        """Copy the job's primary blocks out to the tier; the result comes later."""
        with self._lock:
            self._submit(job, load=False)

    def submit_load(self, job: TransferJob) -> None:
        """Fill the job's (allocated) primary blocks from the tier; the result comes later."""
        with self._lock:
            self._submit(job, load=True)

    def get_finished_jobs(self) -> list[JobResult]:
        """Advance every transfer once; return each result published since the last call."""
        with self._lock:
            self._poll()
            results, self._results = self._results, []
            self._unreported.clear()
            return results

    def drain_jobs(self, timeout: float | None = None) -> None:
        """Block until every transfer is published; results surface in get_finished_jobs.

        Returns or raises by the deadline, or at most one poll after it (a poll under way at
        the deadline is finished, never cut short); waiting for another thread's call to let
        go of the tier counts against the deadline.

        Raises:
            DrainTimeout: ``timeout`` seconds passed with transfers still unpublished; they
                stay in the table, untouched, and a later poll goes on with them.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        lock = self._lock
        while True:
            # the lock is released while sleeping, so other threads can submit; waiting for it
            # (behind another thread's poll) never runs past the deadline
            if not lock.acquire(timeout=-1 if deadline is None
                                else max(0.0, deadline - time.monotonic())):
                if not self._transfers:
                    return  # another thread's poll published the last of them
                raise DrainTimeout("drain_jobs", self.unpublished())
            try:
                self._poll()
                if not self._transfers:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise DrainTimeout("drain_jobs", self.unpublished())
            finally:
                lock.release()
            time.sleep(self.poll_interval)

    def has_pending_work(self) -> bool:
        """True while a transfer is unpublished or a result is not yet handed out."""
        return bool(self._transfers) or bool(self._results)

    def cancel(self, job_id: int) -> None:
        """Cancel a job: it publishes a failure. A transfer NIXL still runs is waited for (to
        DONE or its error, in CANCELLING) before its handles are released; one that already
        ended keeps its outcome (it is never recomputed, F3) and is released as usual.

        Raises:
            InvalidJobError: ``job_id`` is not an int (``cancel(True)`` does not cancel job 1);
                nothing changed.
            UnknownJobError: no unpublished job has that id; nothing changed.
        """
        with self._lock:
            transfer = self._transfers.get(_job_id(job_id))
            if transfer is None:
                raise UnknownJobError(f"job {job_id} is not in flight on this tier "
                                      "(never submitted, or already published)")
            self.driver.cancel(transfer)
            self._refile(transfer)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Cancel every unfinished job, wait for NIXL, release everything. Idempotent.

        Every unfinished job publishes exactly one failure (F10), available from
        :meth:`get_finished_jobs` afterwards; a job whose transfer had already ended keeps its
        outcome. New submits are refused from the start. Transfers NIXL still runs are waited
        for up to ``timeout`` seconds (None: as long as it takes), never released while
        running. At the deadline, a transfer that is over gets one last release attempt (a
        retry backing off is not waited for); one whose release still fails is quarantined:
        it is over, so its failure is published and only its handles (and the primary
        cache's registration they refer to) stay held.

        Raises:
            DrainTimeout: transfers NIXL still ran at the deadline. They are not published, so
                their blocks are not reused under a running transfer, and the tier stays open:
                call shutdown again to go on waiting.
        """
        with self._lock:
            if self._closed:
                return
            self._closing = True
            self._stop_by = None if timeout is None else time.monotonic() + timeout
            for transfer in self.unpublished():
                self.driver.cancel(transfer)
                self._refile(transfer)
        try:
            self.drain_jobs(timeout)  # takes the lock a poll at a time
        except DrainTimeout:
            with self._lock:
                for transfer in self.unpublished():
                    if transfer.state not in self._running_states:  # over: a last try, give up
                        transfer.retry_at = 0.0
                        self._settle(transfer)
                        if transfer.job_id in self._transfers:
                            self._give_up(transfer, "shutdown deadline passed")
                running = self.unpublished()
                if running:
                    raise DrainTimeout("shutdown (NIXL still runs these; call shutdown again "
                                       "to wait longer)", running) from None
        with self._lock:
            if not self._closed:
                self._close()

    def _close(self) -> None:
        self._stop_probes()
        self._closed = True
        if self._quarantine or self._may_run:  # their handles refer to the registration
            logger.error("shutdown: %d quarantined transfer(s) hold their handles (%d may still "
                         "run); the primary cache stays registered", len(self._quarantine),
                         len(self._may_run))
            return
        # nothing runs any more: release the primary cache's handles, best effort
        for call, handle in (("release_dlist_handle", self._local),
                             ("deregister_memory", self._dram)):
            try:
                getattr(self.agent, call)(handle)
            except Exception as error:
                self._record_leaks(-1, (Leak(call, f"{type(error).__name__}: {error}"),))

    def lookup(self, key: bytes | str) -> Lookup:
        """HIT, MISS, or RETRY while the answer is being found out; never blocks on I/O.

        A finished store makes its keys HIT; a failed job, store or load, makes them MISS: the
        tier cannot vouch for what it holds under a name whose transfer failed (a store NIXL
        reported as failed may have landed anyway), and a failed load is not retried again and
        again (F11). A later successful store makes them HIT again.

        Raises:
            TierClosedError: the tier was shut down (it knows nothing any more).
            ValueError: ``key`` is not a non-empty str or bytes.
        """
        if self._closed:
            raise TierClosedError(f"{type(self).__name__} is shut down; lookup({key!r}) refused")
        name = self.remote_name(key)
        known = self._known.get(name)
        return known if known is not None else self._probe(name)

    def state_of(self, job_id: int) -> TransferState | None:
        """The state of a job's transfer, or None when it is published or unknown.

        Raises:
            InvalidJobError: ``job_id`` is not an int (a bool or a float is not taken as one).
        """
        transfer = self._transfers.get(_job_id(job_id))
        return None if transfer is None else transfer.state

    def unpublished(self) -> list[Transfer]:
        """The transfers not yet published, in submission order."""
        return list(self._transfers.values())

    def transfer_of(self, job_id: int) -> Transfer | None:
        """The in-flight transfer record of a job (retries, leaks, last error), or None.

        Raises:
            InvalidJobError: ``job_id`` is not an int.
        """
        return self._transfers.get(_job_id(job_id))

    def stats(self) -> dict[str, Any]:
        """What the tier did: transfers in flight per state, results published (and how many
        failed), release retries, leaks (all counted, the last :attr:`leak_record` kept), and
        the latency of recent transfers (seconds from submit to finished, percentiles over the
        last 4096).

        Its cost does not grow with the transfers in flight or the jobs ever run: the counts
        are kept as transfers move, and what is listed is bounded. It never waits for the
        tier's lock (a monitoring thread is not held up behind a poll): what it returns is read
        while other threads may go on, so two figures may be one call apart.
        """
        # each read below is one operation CPython performs whole (a copy, a len, an int)
        waiting_in = dict(self._waiting_in)
        in_flight = {state.name: count for state, count in waiting_in.items() if count}
        running = len(self._running.transfers)
        if running:
            in_flight[self._posted.name] = running
        latencies = sorted(self._latencies.copy())
        return {
            "in_flight": in_flight,
            "published": self._published,
            "failed": self._failed,
            "retries": sum(step.count for step in self._retry_steps),
            "leaks": self._leak_count,
            "leaked": list(self._leaks.copy()),
            "quarantined": len(self._quarantine),
            "lookup_cache": len(self._known),
            "quarantined_running": len(self._may_run),
            "latency": {name: latencies[min(len(latencies) - 1, int(q * len(latencies)))]
                        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
            if latencies else {},
        }

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` released the primary registration."""
        return self._closed

    # -- what a subclass provides -----------------------------------------------------------

    def remote_name(self, key: bytes | str) -> str:
        """The name block ``key`` is stored under in this tier.

        Raises:
            ValueError: ``key`` is not a non-empty str or bytes.
        """
        raise NotImplementedError

    def _probe(self, name: str) -> Lookup:
        """Answer a lookup the tier knows nothing about (without blocking the caller)."""
        raise NotImplementedError

    def _stop_probes(self) -> None:
        """Stop any background probing; called once by shutdown."""

    # -- internals --------------------------------------------------------------------------

    def _submit(self, job: TransferJob, *, load: bool) -> None:
        if self._closed or self._closing:
            raise TierClosedError(f"{type(self).__name__} is shut down; job {job.job_id} refused")
        names, block_ids = self._validate(job, load=load)
        transfer = Transfer(job, len(block_ids) * self.block_bytes, time.monotonic(),
                            self._initial)
        transfer.names = names
        self._transfers[transfer.job_id] = transfer
        try:
            self.driver.post(transfer, self._local, block_ids)
        except BaseException:  # an interrupt: the machine has the transfer's state, keep it
            self._refile(transfer)
            raise
        if transfer.state is self._posted:
            self._running.add(transfer)
        else:  # over at once: DONE or FAILED
            self._settle(transfer)

    def _validate(self, job: Any, *, load: bool) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Check a job against this tier; returns its remote names and block ids.

        Raises:
            InvalidJobError: names what is wrong with the job; nothing was registered.
        """
        job_id = self._check_job_id(job)
        if job.is_promotion is not load and job.is_promotion != load:
            wanted = "submit_load" if job.is_promotion else "submit_store"
            raise InvalidJobError(f"job {job_id} has is_promotion={job.is_promotion}; "
                                  f"submit it with {wanted}")
        keys, raw_ids = job.keys, job.block_ids
        for field, value in (("keys", keys), ("block_ids", raw_ids)):
            if type(value) is not tuple and type(value) is not list and (
                    isinstance(value, str | bytes) or not isinstance(value, Sequence)):
                raise InvalidJobError(f"job {job_id}: {field} must be a list or tuple, got "
                                      f"{type(value).__name__} {value!r}")
        if len(keys) != len(raw_ids):
            raise InvalidJobError(f"job {job_id} has {len(keys)} keys but "
                                  f"{len(raw_ids)} block ids")
        try:
            names = self._remote_names(keys)
        except ValueError:
            names = ()
        if len(names) != len(keys) or len(set(names)) != len(names):
            self._explain_keys(job_id, tuple(keys))
        block_ids = tuple(raw_ids)
        limit = self.num_blocks
        for block_id in block_ids:  # the common case: plain ints in range
            if type(block_id) is not int or not 0 <= block_id < limit:
                block_ids = tuple(self._block_id(job_id, index, b)
                                  for index, b in enumerate(raw_ids))
                break
        if load and len(set(block_ids)) != len(block_ids):
            raise InvalidJobError(f"job {job_id} loads into the same block twice")
        return names, block_ids

    def _remote_names(self, keys: Sequence[Any]) -> tuple[str, ...]:
        """The remote name of each key (:meth:`remote_name`); raises ValueError on a bad key."""
        return tuple(map(self.remote_name, keys))

    def _check_job_id(self, job: Any) -> int:
        """Raise InvalidJobError unless ``job`` is a TransferJob with a new int id."""
        if type(job) is not TransferJob and not isinstance(job, TransferJob):
            raise InvalidJobError(f"expected a TransferJob, got {type(job).__name__}")
        job_id = job.job_id
        if type(job_id) is not int and (not isinstance(job_id, int) or isinstance(job_id, bool)):
            raise InvalidJobError(f"job_id must be an int, got {job_id!r}")
        if job_id in self._transfers:
            raise InvalidJobError(f"job {job_id} is already in flight "
                                  f"({self._transfers[job_id].state.name})")
        if job_id in self._unreported:
            raise InvalidJobError(f"job {job_id} has a result not yet collected")
        return job_id

    def _explain_keys(self, job_id: int, keys: tuple[Any, ...]) -> None:
        """Raise the InvalidJobError that names the first bad or repeated key."""
        seen: dict[str, int] = {}
        for index, key in enumerate(keys):
            try:
                name = self.remote_name(key)
            except ValueError as error:
                raise InvalidJobError(f"job {job_id}: keys[{index}]: {error}") from None
            if name in seen:
                raise InvalidJobError(f"job {job_id}: keys[{seen[name]}] and keys[{index}] "
                                      f"name the same block {name!r}")
            seen[name] = index

    def _block_id(self, job_id: int, index: int, block_id: object) -> int:
        if isinstance(block_id, bool):
            raise InvalidJobError(f"job {job_id}: block_ids[{index}] is {block_id!r}, not an int")
        try:
            value = operator.index(block_id)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidJobError(f"job {job_id}: block_ids[{index}] is {block_id!r}, "
                                  "not an int") from None
        if not 0 <= value < self.num_blocks:
            raise InvalidJobError(f"job {job_id}: block_ids[{index}] = {value} is out "
                                  f"of range [0, {self.num_blocks})")
        return value

    def _give_up(self, transfer: Transfer, why: str) -> None:
        if transfer.state in self._running_states:
            self._may_run.add(transfer.job_id)
        self.driver.give_up(transfer, why)
        self._finish(transfer)

    def _settle(self, transfer: Transfer) -> None:
        """Make the calls a transfer waits on now; hand its result out once it is final, else
        keep it in the poll list its state says (an interrupt included: nothing is orphaned)."""
        try:
            final = self.driver.settle(transfer)
        except BaseException:
            self._refile(transfer)
            raise
        if final:
            self._finish(transfer)
        else:
            self._refile(transfer)

    def _answered(self, transfer: Transfer, status: str | Exception) -> None:
        """Fire what ``check_xfer_state`` answered, then make the calls that follow this round;
        a transfer still running (a stay its machine fires) waits for the next poll."""
        try:
            self.driver.polled(transfer, status)
        except BaseException:  # an interrupt: keep the transfer where its state says
            self._refile(transfer)
            raise
        if transfer.state is self._posted:
            self._refile(transfer)
        else:
            self._settle(transfer)

    def _finish(self, transfer: Transfer) -> None:
        """A transfer reached a final state: hand its one result out."""
        job_id = transfer.job_id
        if self._transfers.pop(job_id, None) is not transfer:
            return  # handed out already (a listener that polled again got there first)
        if transfer.slot >= 0:
            self._running.discard(transfer)
        if transfer.filed is not None:
            self._unfile(transfer)
        held = transfer.state in self._held
        result = transfer.result(held)
        # every change to the tier's books first, then what runs code of others (logging
        # handlers, listeners): an interrupt there must not leave a quarantined transfer
        # uncounted (shutdown would release the registration its handles use) or a verdict
        # unrecorded
        self._results.append(result)
        self._unreported.add(job_id)
        self._published += 1
        self._latencies.append(result.transfer_time)
        if held:
            self._quarantine.append(transfer)
        if transfer.leaks:
            self._record_leaks(job_id, transfer.leaks)
        # a finished store or load shows the blocks are there; after a failed one the tier
        # cannot vouch for them, and a failed load is not made again and again (F11)
        self._known.record(transfer.names, Lookup.HIT if transfer.success else Lookup.MISS)
        if not result.success:
            self._failed += 1
            _log_failure(transfer)
        for leak in transfer.leaks:
            logger.warning("job %d leaked: %s raised %s", job_id, leak.call,
                           leak.error, extra=transfer.log_fields(leak.error))
        for listener in self.on_published:  # best effort: a listener never costs a result (F7)
            try:
                listener(transfer)
            except Exception:
                logger.exception("job %d: an on_published listener raised", job_id,
                                 extra=transfer.log_fields())

    def _refile(self, transfer: Transfer) -> None:
        """Keep a transfer in the right poll list after its state changed (or drop it once
        published)."""
        if transfer.job_id not in self._transfers:
            return
        state = transfer.state
        if state is self._posted:
            self._unfile(transfer)
            if transfer.slot < 0:
                self._running.add(transfer)
        else:
            self._running.discard(transfer)
            filed = transfer.filed
            if filed is not state:  # counted under its state, for stats()
                if filed is None:
                    self._waiting[transfer.job_id] = transfer
                else:
                    self._waiting_in[filed] -= 1
                self._waiting_in[state] += 1
                transfer.filed = state

    def _unfile(self, transfer: Transfer) -> None:
        """Take a transfer out of the waiting list, if it is there."""
        filed = transfer.filed
        if filed is not None:
            del self._waiting[transfer.job_id]
            self._waiting_in[filed] -= 1
            transfer.filed = None

    def _record_leaks(self, job_id: int, leaks: Sequence[Leak]) -> None:
        self._leak_count += len(leaks)
        self._leaks.extend((job_id, leak) for leak in leaks)

    def _poll(self) -> None:
        """Advance every unpublished transfer once.

        The hot path: a transfer in PROCESSING costs its ``check_xfer_state`` call and nothing
        else while NIXL answers PROC, because the table declares that answer a stay (a
        self-loop without actions, :attr:`~kvfsm.engine.Step.is_stay`); its step is counted
        once per poll round, not fired. A user's machine that declares anything else for that
        answer, or a running bound (``max_running_seconds``), takes the general path.
        """
        stay = self._proc_stay
        if stay is None or self.policy.max_running_seconds is not None:
            self._poll_each()
            return
        running = self._running
        waiting = list(self._waiting.values())  # those in it now: one call each this round
        answered = running.check(self.agent.check_xfer_state)
        stay.taken += len(running.transfers) - len(answered)
        transfers = self._transfers
        for transfer, status in answered:
            if transfers.get(transfer.job_id) is not transfer:
                continue  # published meanwhile (a listener polled again)
            running.discard(transfer)
            self._answered(transfer, status)
        settle = self._settle
        for transfer in waiting:
            if transfers.get(transfer.job_id) is transfer:
                settle(transfer)

    def _poll_each(self) -> None:
        """The general path: every transfer through the driver and the machine, each poll."""
        check = self.agent.check_xfer_state
        posted, running = self._posted, self._running_states
        stay = self._proc_stay
        limit = self.policy.max_running_seconds
        started_after = -1.0 if limit is None else time.monotonic() - limit
        others: list[tuple[Transfer, str | Exception | None]] = []
        for transfer in list(self._transfers.values()):
            overdue = transfer.started_at <= started_after
            if transfer.state is posted:
                try:
                    status: str | Exception = check(transfer.xfer)
                except Exception as error:  # the machine hears of it: poll(RAISED)
                    status = error.with_traceback(None)  # no cycle through this frame
                if status == NIXL_RUNNING:
                    if overdue:
                        others.append((transfer, _OVERDUE))
                        continue
                    if stay is not None:
                        stay.taken += 1
                        continue
                others.append((transfer, status))
            else:  # one running past the bound in another state is bounded like a posted one
                others.append((transfer, _OVERDUE if overdue and transfer.state in running
                               else None))
        self._take_answers(others, limit, started_after)

    def _take_answers(self, others: list[tuple[Transfer, str | Exception | None]],
                      limit: float | None, started_after: float) -> None:
        """The general path's second half: what each transfer's round answered, fired."""
        posted, transfers = self._posted, self._transfers
        for transfer, answered in others:
            if transfers.get(transfer.job_id) is not transfer:
                continue  # published meanwhile (a listener polled again)
            if answered is _OVERDUE:
                self._give_up(transfer, f"still running after {limit} s")
            elif answered is None:
                self._settle(transfer)
            else:
                self._answered(transfer, answered)
                if transfer.state is posted and transfer.started_at <= started_after:
                    self._commit_overdue(transfer, limit)

    def _commit_overdue(self, transfer: Transfer, limit: float | None) -> None:
        """NIXL answered the transfer is over, but the store's commit (a flush) is not, past
        the running bound: the bound holds for it too. NIXL no longer runs it, so it fails as
        a commit that raised does (its handle released), rather than being quarantined."""
        self.driver.commit_failed(transfer, TimeoutError(
            f"not committed {limit} s after submit (max_running_seconds)"))
        self._settle(transfer)


class _Running:
    """The transfers NIXL runs (in PROCESSING) and their handles, in two parallel lists.

    A poll step is then one ``map`` of ``check_xfer_state`` over the handles, a loop in C, and
    a count of the answers that are still PROC: nothing else is touched for a transfer whose
    answer did not change. Each transfer knows its slot, and one that leaves has the last one
    moved into its place, so joining and leaving cost the same at any number in flight.
    """

    __slots__ = ("handles", "transfers")

    def __init__(self) -> None:
        self.transfers: list[Transfer] = []
        self.handles: list[Any] = []

    def add(self, transfer: Transfer) -> None:
        transfer.slot = len(self.transfers)
        self.transfers.append(transfer)
        self.handles.append(transfer.xfer)

    def discard(self, transfer: Transfer) -> None:
        slot = transfer.slot
        if slot < 0:
            return
        transfer.slot = -1
        last, handle = self.transfers.pop(), self.handles.pop()
        if last is not transfer:
            self.transfers[slot] = last
            self.handles[slot] = handle
            last.slot = slot

    def check(self, check: Callable[[Any], str]) -> list[tuple[Transfer, str | Exception]]:
        """Call ``check`` once on every handle; the transfers whose answer was not PROC (a
        status, or what the call raised), in the order they are kept."""
        handles = self.handles
        statuses: list[str | Exception] = []
        while len(statuses) < len(handles):
            try:  # CPython's list.extend keeps what map produced before a call raised
                statuses.extend(map(check, islice(handles, len(statuses), None))
                                if statuses else map(check, handles))
            except Exception as error:  # that handle's answer: the machine hears poll(RAISED)
                # (its text is what is kept; its traceback would hold the poll's frames, and
                # through them the agent, in a cycle only the garbage collector breaks)
                statuses.append(error.with_traceback(None))
                continue
            if len(statuses) < len(handles):  # a StopIteration ends map quietly: that call's
                statuses.append(RuntimeError("check_xfer_state raised StopIteration"))
        if statuses.count(NIXL_RUNNING) == len(statuses):
            return []
        return list(compress(zip(self.transfers, statuses, strict=True),
                             map(operator.ne, statuses, repeat(NIXL_RUNNING))))


logger = logging.getLogger("kvfsm")
#: what a poll that finds a running transfer past ``max_running_seconds`` answers, for itself
_OVERDUE = RuntimeError("past max_running_seconds")


def _bind(steps: Mapping[str, StepFunction], primary: torch.Tensor,
          ) -> dict[str, Callable[[Transfer], Any]]:
    """The user's steps, each given the primary cache (and no reference to the tier)."""
    return {name: functools.partial(_call_step, step, primary) for name, step in steps.items()}


def _call_step(step: StepFunction, primary: torch.Tensor, transfer: Transfer) -> Any:
    return step(transfer, primary)


def _log_failure(transfer: Transfer) -> None:
    job = transfer.job
    logger.warning("job %d: %s of %d block(s) failed: %s", job.job_id,
                   "load" if job.is_promotion else "store", len(transfer.names),
                   transfer.reason or transfer.error, extra=transfer.log_fields())


def key_text(key: object) -> str:
    """A block key as text: a str as it is, bytes in hex.

    Both kinds share one namespace (``"6b"`` and ``b"k"`` name the same block), so a tier's
    users should stick to one kind.

    Raises:
        ValueError: the key is not a non-empty str or bytes.
    """
    if isinstance(key, str):
        text = key
    elif isinstance(key, bytes):
        text = key.hex()
    else:
        raise ValueError(f"a key must be bytes or str, got {type(key).__name__} {key!r}")
    if not text:
        raise ValueError("a key must not be empty")
    return text


def _job_id(job_id: object) -> int:
    """``job_id`` if it is an int (not a bool); else InvalidJobError naming it."""
    if type(job_id) is int:
        return job_id
    if isinstance(job_id, int) and not isinstance(job_id, bool):
        return int(job_id)  # an int subclass (a numpy integer is not one): its value
    raise InvalidJobError(f"a job id is an int, got {type(job_id).__name__} {job_id!r}")


def _check_primary(primary: object) -> None:
    if not isinstance(primary, torch.Tensor):
        raise ValueError(f"primary must be a torch.Tensor, got {type(primary).__name__}")
    if primary.device.type != "cpu":
        raise ValueError(f"primary must be a CPU tensor, got device {primary.device}")
    if primary.dim() < 1 or primary.shape[0] == 0:
        raise ValueError(f"primary must have a first dimension of blocks, got shape "
                         f"{tuple(primary.shape)}")
    if not primary.is_contiguous():
        raise ValueError("primary must be contiguous (blocks must be adjacent in memory)")
    if primary.numel() == 0:
        raise ValueError(f"primary has empty blocks: shape {tuple(primary.shape)}")
