"""The secondary-tier contract, run on the transfer lifecycle.

A :class:`SecondaryTier` owns the primary KV cache's NIXL registration and a table of in-flight
transfers, keyed by job id. ``submit_*`` validates the job, makes the submit calls and leaves the
transfer where the machine put it; ``get_finished_jobs`` asks NIXL about the running transfers
the poll schedule picks (every one, while few run), advances each transfer with a call due as
far as NIXL's answers allow, and hands out the results of those that reached PUBLISHED. A
transfer leaves the table only on PUBLISHED, so no result is ever lost or handed out twice.

Subclasses say how a block key names a remote block (:meth:`SecondaryTier.remote_name`), give
the driver their remote side, and probe for blocks they were not told about (:meth:`_probe`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import enum
import functools
import logging
import math
import operator
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch

from kvfsm.agent import LOCAL_AGENT, NixlAgent
from kvfsm.contract import (
    DrainTimeout,
    JobSide,
    check_interval,
    check_timeout,
    handing_out,
    marked_results,
    seconds_left,
    take,
)
from kvfsm.driver import (
    _CUT_SHORT,
    _CUT_SHORT_KEEPING_FILES,
    CLEANED,
    DONE,
    RELEASED,
    RemoteSide,
    StepFunction,
    TransferDriver,
    check_runnable,
)
from kvfsm.engine import CompiledMachine, Declaration
from kvfsm.machines.transfer import (
    TRANSFER_MACHINE,
    Answer,
    CallFailed,
    PostInterrupted,
    TransferEvent,
)
from kvfsm.policy import InFlightLimit, RetryPolicy
from kvfsm.runner import END, NIXL_RUNNING, Outcome, Runner
from kvfsm.tiers.holdings import (
    HoldingEvent,
    Holdings,
    Remove,
    TierFullError,
    check_capacity,
    check_remove,
)
from kvfsm.transfer import JobResult, Leak, Transfer, TransferJob

__all__ = [
    "DrainTimeout",
    "ForgottenKeyError",
    "HoldingEvent",
    "InvalidJobError",
    "Lookup",
    "RemovalInFlightError",
    "SecondaryTier",
    "TierBusyError",
    "TierClosedError",
    "TierFullError",
    "TierSaturatedError",
    "UnknownJobError",
    "key_text",
]

#: the most state checks of the poll schedule one poll of the progress thread makes under the
#: tier's lock (about a millisecond of NIXL's checks): the sweep's turns left due are the first
#: its next one takes, made after :data:`BEHIND_PAUSE` instead of ``progress_interval``. So a
#: submit waits for that many checks, not for a round of everything in flight, however tight
#: ``max_unpolled`` is (``check_all_below`` set above it is the caller's choice: every running
#: transfer, every poll)
PROGRESS_SLICE = 1024
#: how long the progress thread lets go of the tier's lock between two polls while turns it
#: did not take are due (or ``progress_interval``, if shorter): a submit waiting on the lock
#: then has the chance to take it (Python's locks are not handed over in order, so a chance)
BEHIND_PAUSE = 0.00005


def shown_keys(keys: Sequence[Any]) -> str:
    """The first three of ``keys``, and how many more: keys as a message names them."""
    shown = ", ".join(map(repr, keys[:3]))
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


class ForgottenKeyError(Exception):
    """Why a load of keys the tier forgot fails: a store of them failed, or the tier was told
    to forget them (:meth:`SecondaryTier.forget`), so whatever it holds under them is not the
    caller's bytes. The load is not made (no NIXL call); its job fails with this as the
    reason's error, the call being ``open``. A store of them that succeeds makes them
    loadable again."""

    def __init__(self, keys: Sequence[bytes | str], distrusted: str | None = None) -> None:
        shown = shown_keys(keys)
        if distrusted is not None:  # (KnownNames.distrusted: it vouches for no key any more)
            super().__init__(f"the tier vouches for no key any more ({distrusted}): what it "
                             f"holds under {shown}, if anything, may not be the "
                             "caller's bytes; a new tier (a restart) trusts its store again")
        else:
            super().__init__(f"the tier forgot {shown} (a store failed, or it was told "
                             "to forget, or two stores of a key ran at once): what it holds "
                             "there, if anything, is not known to be the caller's bytes; a "
                             "store that succeeds alone makes a key loadable again")
        #: the job's keys the tier forgot
        self.keys = tuple(keys)


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


class TierBusyError(RuntimeError):
    """The tier cannot take this store now, for a reason that passes; nothing was registered
    and no result will come: the caller keeps its blocks, to store later or elsewhere
    (:class:`~kvfsm.tiering.TieringManager` skips the tier for that store)."""


class TierSaturatedError(TierBusyError):
    """A store would take the tier past its bound on jobs or bytes in flight
    (:class:`~kvfsm.policy.InFlightLimit`); nothing was registered and no result will come."""


class RemovalInFlightError(TierBusyError):
    """A store names a block whose stored copy the tier is removing at this moment (evicted a
    moment ago, its delete sent and not yet answered): written now, the block could be removed
    after it, and the tier would answer HIT for a block that is gone. Nothing was registered
    and no result will come; the block stays a MISS, and a store of it is taken once the
    delete is answered (:meth:`~kvfsm.tiers.ObjectStoreTier.wait_for_removals`)."""


class KnownNames:
    """What a tier knows of the most recent ``limit`` remote names it saw: HIT or MISS.

    Each verdict recorded makes its name the most recent; once more than ``limit`` are known,
    the oldest are forgotten, so the cache stays bounded however many keys a tier ever
    stored. A forgotten name is only asked about again (a probe), never answered wrongly. A
    probe's answer never replaces a verdict recorded meanwhile (:meth:`offer`), and a MISS a
    probe found may be given an age past which it is asked again: another process sharing
    the store may write the block meanwhile.

    A name the caller made the tier forget (:meth:`forget`: its blocks hold other bytes now
    than the tier's copy) is MISS, whatever a probe finds, until a store of it succeeds: it
    is kept apart from the verdicts, so other names' verdicts do not push it out; only the
    last ``limit`` names forgotten are kept so.

    One thread records (under the tier's lock) while a probe thread offers and lookups read
    without it: the writes (and the removal of an expired MISS) take a lock of the cache's
    own, so none of them can undo another's newer verdict; a read of a live verdict takes none.
    """

    __slots__ = ("_doubted", "_forgotten", "_lock", "_more", "_names", "_overlapped",
                 "distrusted", "doubting", "failed_load_miss", "limit", "storing")

    def __init__(self, limit: int) -> None:
        if type(limit) is not int or limit < 1:
            raise ValueError(f"the lookup cache needs a limit of at least 1, got {limit!r}")
        self.limit = limit
        #: seconds a failed load's MISS lasts (None: until a store of its name succeeds); a
        #: tier that never stores sets it (a read-only :class:`~kvfsm.tiers.FileTier`): its
        #: names are stored again by others only, so one failed load must not be a MISS for
        #: good
        self.failed_load_miss: float | None = None
        self._lock = threading.Lock()
        #: a verdict, or (for a probed MISS with an age) the monotonic time it expires; oldest
        #: first. (An OrderedDict: a plain dict whose oldest are deleted one by one makes each
        #: next deletion scan the holes left before it, quadratic once the limit is reached.)
        self._names: collections.OrderedDict[str, Lookup | float] = collections.OrderedDict()
        #: the names forgotten (:meth:`forget`) and not stored since, oldest first
        self._forgotten: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: why the cache vouches for no name any more (None: it does): a forget that raised
        #: may have left a name vouched for whose copy is not the caller's bytes, and which
        #: it is cannot be told, so every name answers MISS and every load is refused
        self.distrusted: str | None = None
        #: the names of stores NIXL may still run though they failed, by store (a token of
        #: the caller's: :meth:`doubt`), and how many such stores hold each name
        self.doubting: dict[object, tuple[str, ...]] = {}
        self._doubted: dict[str, int] = {}
        #: for each name unpublished stores write (:meth:`storing_begins`): the primary block
        #: they read (-1 once two read other blocks), and how many more than one there are
        #: (of the few names with more); and the names two stores from other blocks wrote at
        #: once, until none does: their copy may be a mix
        self.storing: dict[str, int] = {}
        self._more: dict[str, int] = {}
        self._overlapped: set[str] = set()

    def get(self, name: str) -> Lookup | None:
        """The verdict on ``name``, or None when it is not known (any more)."""
        if self.distrusted is not None:
            return Lookup.MISS
        verdict = self._names.get(name)
        if type(verdict) is not float:
            if verdict is None and (name in self._forgotten or name in self._doubted):
                return Lookup.MISS  # (its verdict went, the copy it forgot may still be there)
            return verdict  # type: ignore[return-value]
        if time.monotonic() < verdict:
            return Lookup.MISS
        with self._lock:  # expired: ask again (unless a verdict was recorded meanwhile)
            if self._names.get(name) == verdict:
                del self._names[name]
        return Lookup.MISS if name in self._forgotten or name in self._doubted else None

    def record(self, names: Sequence[str], verdict: Lookup, *, load: bool = False) -> None:
        """A transfer's outcome: ``verdict`` on each of ``names``, now the most recent. A
        store's HIT makes a forgotten name the tier's again; a load's (``load``) does not: it
        read the copy the caller made the tier forget, which stays MISS. A failed load's MISS
        lasts :attr:`failed_load_miss` seconds, when that is set (then the name is looked for
        again, as a probed MISS with an age is)."""
        known = self._names
        kept: Lookup | float = verdict
        if load and verdict is Lookup.MISS and self.failed_load_miss is not None:
            kept = time.monotonic() + self.failed_load_miss
        with self._lock:
            forgotten, doubted = self._forgotten, self._doubted
            if (forgotten or doubted) and verdict is Lookup.HIT:
                if load or doubted:  # (doubted: forgotten while a store of it may land, and
                    # kept so past the limit on the forgotten)
                    names = [name for name in names if name not in doubted
                             and (not load or name not in forgotten)]
                if not load:
                    for name in names:
                        forgotten.pop(name, None)
            for name in names:
                known[name] = kept
                known.move_to_end(name)
            if len(known) > self.limit:
                self._forget_oldest()

    def forget(self, names: Sequence[str]) -> None:
        """The caller's blocks under ``names`` hold other bytes than the tier's copy: MISS, a
        probe's HIT included, until a store of them succeeds (the last :attr:`limit` names
        forgotten). An ordinary exception raised meanwhile (no memory left) may leave some
        vouched for: the cache then vouches for none (:attr:`distrusted`), and it goes on."""
        try:
            self._forget(names)
        except Exception as error:
            self.distrusted = "a forget raised"  # first: the text below needs memory too
            with contextlib.suppress(Exception):
                self.distrusted = (f"forgetting {len(names)} name(s) raised "
                                   f"{type(error).__name__}: {error}")
                logger.error("the tier vouches for no key any more (%s): every lookup answers "
                             "MISS and every load is refused until a new tier is made",
                             self.distrusted)
            raise

    def _forget(self, names: Sequence[str]) -> None:
        with self._lock:
            forgotten, known = self._forgotten, self._names
            for name in names:
                known[name] = Lookup.MISS
                known.move_to_end(name)
                forgotten[name] = None
                forgotten.move_to_end(name)
            while len(forgotten) > self.limit:
                forgotten.popitem(last=False)
            if len(known) > self.limit:
                self._forget_oldest()

    def doubt(self, store: object, names: Sequence[str]) -> None:
        """A store of ``names`` (``store``: a token of it, its transfer) failed while NIXL may
        still run it (cancelled, or given up), and land its bytes whole after a later store of
        them: until :meth:`undoubt` (it is over), no store's HIT makes them the tier's again;
        they stay forgotten (MISS). Told again of the same store, it changes nothing."""
        with self._lock:
            if store in self.doubting:
                return
            self.doubting[store] = tuple(names)
            doubted = self._doubted
            for name in names:
                doubted[name] = doubted.get(name, 0) + 1

    def recount_doubts(self, live: Collection[object]) -> None:
        """(After an interrupt.) Drop the doubts of stores not in ``live`` (they ended, and
        their :meth:`undoubt` was cut short, or never made), and count each name's doubts again
        from those kept (a :meth:`doubt` or an :meth:`undoubt` cut short between two names)."""
        with self._lock:
            kept = {store: names for store, names in self.doubting.items() if store in live}
            self.doubting = kept
            self._doubted = dict(collections.Counter(
                name for names in kept.values() for name in names))

    def undoubt(self, store: object) -> None:
        """The store :meth:`doubt` named is over: its names may be vouched for again (by the
        next store of them that succeeds)."""
        with self._lock:
            names = self.doubting.pop(store, ())
            doubted = self._doubted
            for name in names:
                left = doubted.pop(name, 1) - 1
                if left:
                    doubted[name] = left

    def storing_begins(self, names: Sequence[str], blocks: Sequence[int]) -> None:
        """A store of ``names`` from the primary's ``blocks`` was taken. A name another
        unpublished store writes already from another block is forgotten, and neither store,
        nor any other that writes it before none does, vouches for it when it ends
        (:meth:`store_ended`): their blocks land in any order, so what the name holds once
        they are over may be the older store's bytes, though the newer was published last. A
        store that writes it alone, later, does. (Two from one block carry the same bytes: the
        caller does not write a block while a store of it is unpublished.) The counts are the
        tier's thread's, under the tier's lock, as every store's submit and end are: no lock
        of the cache's."""
        storing = self.storing
        clash = None
        for name, block in zip(names, blocks, strict=False):  # (as many: checked at submit)
            held = storing.get(name)
            if held is None:
                storing[name] = block
                continue
            more = self._more
            more[name] = more.get(name, 0) + 1
            if held != block:
                storing[name] = -1
                clash = [name] if clash is None else [*clash, name]
        if clash is not None:
            self._overlapped.update(clash)
            with contextlib.suppress(Exception):  # (a forget that raised left the cache
                self.forget(clash)  # vouching for no name: the store goes on, as taken)

    def store_ended(self, names: Sequence[str]) -> Sequence[str]:
        """A store :meth:`storing_begins` took is over: the names its success may vouch for
        (:meth:`record`), all but those another store wrote at the same time."""
        storing, more, overlapped = self.storing, self._more, self._overlapped
        vouched = [name for name in names if name not in overlapped] if overlapped else names
        for name in names:
            if more and name in more:
                left = more[name] - 1
                if left:
                    more[name] = left
                else:
                    del more[name]
            else:
                storing.pop(name, None)
                if overlapped:
                    overlapped.discard(name)
        return vouched

    def recount_storing(self, stores: Iterable[tuple[Sequence[str], Sequence[int]]]) -> None:
        """The unpublished stores' names and blocks, counted again from ``stores`` (an
        interrupt may have cut a count short, :meth:`~kvfsm.runner.Runner.mend`); a name two
        of them write from other blocks is forgotten and overlapped, as
        :meth:`storing_begins` has it. (An interrupt in this is mended by calling it again.)"""
        stores = list(stores)
        written = {name for names, _ in stores for name in names}
        self.storing, self._more = {}, {}
        self._overlapped = self._overlapped.intersection(written)  # (still written: kept)
        for names, blocks in stores:
            self.storing_begins(names, blocks)

    def stale(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` forgotten (:meth:`forget`) and not stored since (all of them once
        the cache vouches for none: :attr:`distrusted`)."""
        forgotten, doubted = self._forgotten, self._doubted
        if self.distrusted is not None:
            return list(names)
        if doubted:
            return [name for name in names if name in forgotten or name in doubted]
        return [name for name in names if name in forgotten] if forgotten else []

    def offer(self, name: str, verdict: Lookup, miss_for: float | None = None) -> None:
        """A probe's answer: kept unless a verdict on ``name`` is known already; a MISS only
        for ``miss_for`` seconds when that is given; a HIT on a forgotten name is none."""
        with self._lock:
            if verdict is Lookup.HIT and (name in self._forgotten or name in self._doubted):
                return
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
            known.popitem(last=False)


#: a state check's answers saying NIXL's transfer is over (a per-block job's: every block's)
_NIXL_OVER = frozenset({Answer.DONE, Answer.ERR, Answer.RAISED})


class SecondaryTier(JobSide):
    """A tier that copies primary KV blocks out and back with NIXL, one machine per transfer.

    Args:
        primary: the primary KV cache, a contiguous CPU tensor whose first dimension indexes
            blocks. Its memory must stay where it is while the tier lives (NIXL copies to and
            from the memory registered here): once it moved (``share_memory_()``,
            ``resize_()``, ``.data`` set), jobs are refused and those unpublished are cancelled.
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
        capacity_bytes: the most bytes of blocks the tier keeps stored (None: no bound); past
            it a store first removes the least recently used blocks no transfer uses
            (:mod:`kvfsm.tiers.holdings`), or is refused with :class:`TierFullError`.
        record_events: keep what the tier stored and removed for :meth:`take_events` (with
            ``capacity_bytes`` only).
        remove: how the subclass removes stored blocks by name (needed with a capacity).
        in_flight: back-pressure, a bound on the jobs and bytes in flight past which a store
            is refused (:class:`~kvfsm.policy.InFlightLimit`; by default none).

    Raises:
        MachineRefused: the machine cannot run in a tier (:func:`~kvfsm.driver.check_runnable`
            says what is missing); raised before any NIXL call.

    A tier on a real NIXL agent is held by kvfsm while it has jobs unpublished (or a transfer
    given up while NIXL may run it): dropped with transfers in flight, it would tear its agent
    down under them. At the interpreter's exit, one not shut down with jobs unpublished is
    drained and shut down, waiting for NIXL to end them, within :data:`EXIT_WAIT_SECONDS`.

    Bounded memory: the lookup cache keeps the verdicts on the last :attr:`known_names`
    names (and, apart, the last :attr:`known_names` names :meth:`forget` was told), and
    :meth:`stats` lists the last :attr:`leak_record` leaks (and counts them all).
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
                 steps: Mapping[str, StepFunction] | None = None,
                 capacity_bytes: int | None = None, record_events: bool = False,
                 remove: Remove | None = None, in_flight: InFlightLimit | None = None) -> None:
        _check_primary(primary)
        check_in_flight(in_flight)
        #: the bound on jobs and bytes in flight past which a store is refused
        self.in_flight = in_flight or InFlightLimit()
        self._stores_refused = 0
        self.primary = primary
        self.agent = agent
        self.num_blocks = int(primary.shape[0])
        self.block_bytes = int(primary[0].nbytes)
        self.poll_interval = check_interval("poll_interval", poll_interval)
        self.policy = policy if policy is not None else RetryPolicy()
        declaration = machine or TRANSFER_MACHINE
        check_runnable(declaration, steps or {}, self.policy)  # before any NIXL call
        #: the compiled lifecycle the tier runs (its steps count this tier's transitions)
        self.machine: CompiledMachine[Any, Any] = declaration.compile(trace=True)
        #: what the tier knows of recent remote names: set by results, filled in by probes
        self._known = KnownNames(self.known_names)
        #: what the tier stored, within its capacity (None: no capacity, nothing tracked)
        self._holdings = _holdings(self._known, self.block_bytes, capacity_bytes,
                                   record_events, remove)
        #: what is due and what was published: the books, no I/O (:class:`~kvfsm.runner.Runner`)
        #: (what it calls back holds no reference to the tier: no cycle keeps a tier alive)
        self._runner = self._books = runner = Runner(self.machine, self.policy)
        runner.on_final.append(functools.partial(
            _record_verdicts, self._known, self._holdings, runner.may_run))
        runner.leaks = collections.deque(maxlen=self.leak_record)
        runner.on_failed.append(functools.partial(
            _forget_failed_store, self._known, runner.running_states, runner.may_run))
        runner.on_mend.append(functools.partial(_recount_storing, self._known, runner.may_run))
        #: the calls, and what they answered (:class:`~kvfsm.driver.TransferDriver`)
        self._driver = TransferDriver(agent, remote, declaration, _bind(steps or {}, primary))
        if hasattr(remote, "commit_over"):  # a commit it says is over is checked at once
            # (the queue's append alone: a flush under way keeps nothing else alive)
            remote.commit_over = self._runner.commits_over.append
        self._makers = self._driver.makers()
        #: called with each transfer as it is published (a trace recorder, for one)
        self.on_published: list[Callable[[Transfer], None]] = self._runner.on_published
        self._closed = False
        self._closing = False
        #: when shutdown() must return by (None: no deadline); background work is not waited
        #: for past it
        self._stop_by: float | None = None
        self._lock = threading.RLock()
        #: the progress thread while one runs (policy.progress_interval), and what it did
        self._progress_thread: threading.Thread | None = None
        self._progress_last: threading.Thread | None = None  # shutdown joins it
        self._progress_polls = 0
        self._progress_error: str | None = None
        #: shutdown's and the exit's wake of the progress thread (:meth:`_wake_progress`):
        #: a queue, whose put takes no lock an interrupt could leave held (an Event's does)
        self._progress_wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._progress_woken = False  # woken for good: it pauses no more
        #: shutdown's wait for the background work: one at a time, and once it is done
        self._stop_lock = threading.RLock()
        self._background_stopped = False
        base = primary.data_ptr()
        #: where the primary cache's memory was when NIXL registered it: a cache whose memory
        #: moved since (share_memory_(), resize_(), .data set) is no longer what NIXL copies
        #: to and from, so no job may use it (:meth:`_moved`)
        self._primary_at = base
        self._moved_cancelled = False
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
        #: on a real NIXL agent: held by kvfsm (``_live_tiers``) while jobs are unpublished
        self._on_nixl = _runs_nixl(agent)
        if self._on_nixl:
            _nixl_tiers.add(self)  # (closed to new jobs as the interpreter exits)
        self._kept = False

    # -- the contract -----------------------------------------------------------------------

    def submit_store(self, job: TransferJob) -> None:
        """Copy the job's primary blocks out to the tier; the result comes later.

        The job's keys and block ids are read during this call only: the caller may reuse
        its lists as soon as it returns."""
        self._submit_locked(job, load=False)

    def submit_load(self, job: TransferJob) -> None:
        """Fill the job's (allocated) primary blocks from the tier; the result comes later
        (its lists are read during this call only, as :meth:`submit_store`'s are)."""
        self._submit_locked(job, load=True)

    def get_finished_jobs(self) -> list[JobResult]:
        """Advance the jobs once (a tier checks those its poll schedule picks:
        :class:`~kvfsm.policy.RetryPolicy`); return each result published since the last call.

        While a progress thread runs (``RetryPolicy.progress_interval``) that thread polls, and
        this only hands out what it published: no NIXL call, no wait for the tier's lock.
        (While another thread's submit is starting the progress thread, this polls, once
        that submit let go of the lock.)
        """
        if handing_out(self):
            return marked_results(self._books)
        if self._thread_polls():
            return self._books.take_results()
        return super().get_finished_jobs()

    _drained_hand_out = get_finished_jobs  # (JobSide._drain_poll)

    def _thread_polls(self) -> bool:
        """Whether the progress thread polls for the caller: one runs (one recorded that never
        started polls nothing), and the books need no mending (that is made under the lock,
        by the caller's poll)."""
        progress = self._progress_thread
        return progress is not None and progress.ident is not None and not self._runner.damaged

    def cancel(self, job_id: int) -> None:
        """Cancel a job: it publishes a failure. A transfer NIXL still runs is waited for (to
        DONE or its error, in CANCELLING) before its handles are released; one that already
        ended keeps its outcome (it is never recomputed, F3) and is released as usual. A
        store's keys are MISS from this call on (NIXL may still land its bytes whole): a load
        of them fails until a store of them succeeds.

        Raises:
            InvalidJobError: ``job_id`` is not an int (``cancel(True)`` does not cancel job 1);
                nothing changed.
            UnknownJobError: no unpublished job has that id; nothing changed.
        """
        runner = self._runner
        with self._lock, runner.guarded:
            transfer = runner.records.get(_job_id(job_id))
            if transfer is None:
                raise UnknownJobError(f"job {job_id} is not in flight on this tier "
                                      "(never submitted, or already published)")
            runner.cancel(transfer)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Cancel every unfinished job, wait for NIXL, release everything. Idempotent.

        Every unfinished job publishes exactly one failure (F10), available from
        :meth:`get_finished_jobs` afterwards; a job whose transfer had already ended keeps its
        outcome. New submits are refused from the start. Transfers NIXL still runs are waited
        for up to ``timeout`` seconds (None: as long as it takes), never released while
        running. At the deadline, a transfer that is over gets one last try of the call it
        waits on, its release or a step (a retry backing off is not waited for); one that still
        stays is given up (its effect's EXHAUSTED edge), and from where that leads the same
        way, until it is published: a release given up is quarantined, it is over, so its
        failure is published and only its handles (and the primary cache's registration they
        refer to) stay held.

        Returns by the deadline, plus the poll under way at it, one last try for each
        transfer that is over (one for each state its give-ups lead it through), and the
        release of the tier's own registration of the primary cache (two NIXL calls, made
        once every job is published); waiting for another thread's call to let go of the
        tier's lock counts against it. The tier's background threads (a
        lookup probe, the deletes of evicted objects, a flush of a store already published) are
        waited for until the deadline too, once the tier is closed and its lock let go: calls
        on other threads are refused at once meanwhile.

        Raises:
            DrainTimeout: transfers NIXL still ran at the deadline, or another thread's call
                held the tier's lock past it. They are not published, so their blocks are not
                reused under a running transfer, and the tier stays open: call shutdown again
                to go on waiting.
            ValueError: ``timeout`` is not None nor a number of seconds (NaN, a str...);
                nothing changed. (Infinity is no bound, as None.)
        """
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if not take(self._lock, deadline):
            raise DrainTimeout("shutdown (another thread held the tier's lock past the "
                               "deadline; call shutdown again)", self.unpublished())
        try:
            closed = self._closed
            if not closed:
                self._closing = True  # the progress thread ends now, not after its pause
                self._wake_progress()
                progress = self._progress_last
                self._cancel_all()
            elif not (self._runner.quarantined or self._runner.may_run):
                self._release_primary()  # (the rest of one an interrupt cut short, if any)
        finally:
            self._lock.release()
        if closed:  # (an earlier shutdown's wait for the background work may be under way, or
            self._stop_background(deadline)  # cut short by an interrupt: it is finished here)
            return
        try:
            self.drain_jobs(_left(deadline))  # takes the lock a poll at a time
            if (progress is not None and progress.ident is not None
                    and progress is not threading.current_thread()):
                # nothing is unpublished: it ends at once, if not yet (a listener's shutdown on
                # the progress thread itself: it ends once that poll returns)
                progress.join(_left(deadline))
        except DrainTimeout:
            self._last_tries(deadline)
        if not take(self._lock, deadline):
            raise DrainTimeout("shutdown (every job is published, but another thread held the "
                               "tier's lock past the deadline; call shutdown again)", [])
        try:
            if not self._closed:
                self._signal_stop()  # no background call starts from now on
                self._close()
        finally:
            self._lock.release()
        # waited for without the tier's lock: its calls on other threads are refused at once
        self._stop_background(deadline)

    def _cancel_all(self) -> None:
        """Shutdown's cancel of every unfinished job (under the tier's lock), once the books
        are mended if an interrupt went through a call before."""
        with self._runner.guarded:
            self._cancel_each(self.unpublished(), "cancelled by shutdown()")

    def _cancel_each(self, transfers: Sequence[Transfer], why: str) -> None:
        """Cancel each of ``transfers`` still unpublished, saying ``why`` (under the tier's
        lock and the runner's guard)."""
        runner = self._runner
        for transfer in transfers:
            if transfer.job_id in runner.records:  # (not published by a listener meanwhile)
                runner.cancel(transfer, why)

    def _stop_background(self, deadline: float | None) -> None:
        """Wait for the tier's background work (:meth:`_stop_probes`) until ``deadline``, once:
        a shutdown that finds another at it waits for it until its own deadline; one that
        finds it cut short (an interrupt) does it again."""
        if self._background_stopped:
            return
        if not take(self._stop_lock, deadline):
            return  # another shutdown is waiting for it, past this one's deadline
        try:
            if not self._background_stopped:
                self._stop_by = deadline
                self._stop_probes()
                self._background_stopped = True
        finally:
            self._stop_lock.release()

    def _last_tries(self, deadline: float | None) -> None:
        """Shutdown's deadline passed with jobs unpublished: a transfer that is over gets one
        last try of the call it waits on (its release, a step), and is given up if it stays
        (the give-up edge: quarantined, or wherever the lifecycle's leads, and from there on
        the same way, as far as the lifecycle has states); raise DrainTimeout naming those
        NIXL still runs (and all of them if another thread's call holds the tier's lock)."""
        if not take(self._lock, deadline):  # past it: only if no other call holds the lock
            raise DrainTimeout("shutdown (NIXL still runs these, or a store's commit, such as "
                               "a durable file tier's flush, or another thread held the "
                               "tier's lock; call shutdown again to wait longer)",
                               self.unpublished()) from None
        runner = self._runner
        try:
            with runner.guarded:
                for transfer in self.unpublished():
                    # (a give-up may lead to another wait: as many rounds as states)
                    for _ in range(len(runner.in_state)):
                        if not self._waits(transfer):
                            break  # published, or NIXL runs it
                        runner.retry_now(transfer)  # in the rounds, if interrupted
                        self._advance((transfer,))
                        if self._waits(transfer):
                            runner.give_up(transfer, "shutdown deadline passed")
            running = self.unpublished()
            if running:
                raise DrainTimeout("shutdown (NIXL still runs these, or a store's commit, "
                                   "such as a durable file tier's flush; call shutdown again "
                                   "to wait longer)", running) from None
        finally:
            self._lock.release()

    def _waits(self, transfer: Transfer) -> bool:
        """Whether ``transfer`` is unpublished and waits on a call or a step (not on NIXL)."""
        runner = self._runner
        return (runner.records.get(transfer.job_id) is transfer
                and transfer.state not in runner.running_states)

    def _close(self) -> None:
        """Close the tier (under its lock; shutdown then stops its background work)."""
        self._closed = True
        runner = self._runner
        if not runner.may_run:  # (a transfer given up while NIXL may run it keeps it held)
            self._kept = False
            _live_tiers.discard(self)
        if runner.quarantined or runner.may_run:  # their handles refer to the registration
            logger.error("shutdown: %d quarantined transfer(s) hold their handles (%d may still "
                         "run); the primary cache stays registered", len(runner.quarantined),
                         len(runner.may_run))
            return
        self._release_primary()  # nothing runs any more

    def _release_primary(self) -> None:
        """Release the tier's registration of the primary cache, its descriptor list first,
        best effort (a call that raises is a leak). Each handle is taken before its call, so
        none is handed to NIXL twice: a call an interrupt cut short (as it started, or as it
        returned: NIXL may have released it) is a leak, never made again, and so is the
        registration under a descriptor list so cut short, which is kept. A shutdown cut
        short before these calls leaves them to the next one. (Each handle is taken with a
        plain attribute store right before the ``try``, and what became of it is kept without
        a call in between, nor in the handler, which adds leaks made beforehand: an interrupt
        never lands where a handle is taken and nothing says so, a second one neither.)"""
        runner = self._runner
        counted = runner.leak_count
        local = self._local
        if local is not None:
            self._local = None
            try:
                try:
                    self.agent.release_dlist_handle(local)
                except Exception as error:
                    runner.record_leaks(-1, (Leak("release_dlist_handle",
                                                  f"{type(error).__name__}: {error}"),))
            except BaseException:
                if runner.leak_count == counted:  # (its end not kept yet)
                    self._dram = None  # (the list may still hold it)
                    runner.leaks += _PRIMARY_CUT_SHORT_KEEPING
                    runner.leak_count += 2  # (its two leaks: no call here, len() neither)
                raise
        counted = runner.leak_count
        dram = self._dram
        if dram is not None:
            self._dram = None
            try:
                try:
                    self.agent.deregister_memory(dram)
                except Exception as error:
                    runner.record_leaks(-1, (Leak("deregister_memory",
                                                  f"{type(error).__name__}: {error}"),))
            except BaseException:
                if runner.leak_count == counted:
                    runner.leaks += _PRIMARY_CUT_SHORT
                    runner.leak_count += 1
                raise

    def saturated(self, nbytes: int = 0) -> bool:
        """True when a store of ``nbytes`` bytes submitted now would be refused for the
        tier's :class:`~kvfsm.policy.InFlightLimit` (never, without one). Reads the books
        without the lock: a poll on another thread may make room meanwhile.

        Raises:
            ValueError: ``nbytes`` is not an int >= 0.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"saturated: nbytes must be an int >= 0, got {nbytes!r}")
        return not self.in_flight.admits(*self._in_flight(), nbytes)

    def lookup(self, key: bytes | str) -> Lookup:
        """HIT, MISS, or RETRY while the answer is being found out; never blocks on I/O.

        A finished store makes its keys HIT; a failed job, store or load, makes them MISS: the
        tier cannot vouch for what it holds under a name whose transfer failed (a store NIXL
        reported as failed may have landed anyway), and a failed load is not retried again and
        again (F11). A later successful store makes them HIT again. After a failed store they
        stay MISS until then, whatever a probe finds (:meth:`forget`).

        Raises:
            TierClosedError: the tier was shut down (it knows nothing any more).
            ValueError: ``key`` is not a non-empty str or bytes.
        """
        if self._closed:
            raise TierClosedError(f"{type(self).__name__} is shut down; lookup({key!r}) refused")
        name = self.remote_name(key)
        known = self._known.get(name)
        if known is None:
            return self._probe(name)
        if known is Lookup.HIT and self._holdings is not None:
            self._holdings.use(name)
        return known

    def holds(self, key: bytes | str) -> bool:
        """True when the tier knows it holds block ``key``: a store or load of it succeeded,
        or a probe found it, or (with a capacity) the tier stored it and still keeps it; and
        nothing failed or removed it since. Never probes.

        Raises:
            ValueError: ``key`` is not a non-empty str or bytes.
        """
        return self.verdict(key) is Lookup.HIT

    def verdict(self, key: bytes | str) -> Lookup | None:
        """What the tier knows of block ``key`` without asking the store: HIT, MISS (it was
        removed, or its last transfer failed), or None (not known: a lookup would probe).

        Raises:
            ValueError: ``key`` is not a non-empty str or bytes.
        """
        name = self.remote_name(key)
        known = self._known.get(name)
        if known is None and self._holdings is not None and self._holdings.holds(name):
            return Lookup.HIT  # the lookup cache forgot it; the capacity still counts it
        return known

    def touch(self, keys: Sequence[bytes | str]) -> None:
        """Count blocks as used now (the last the most recent): they are removed last when
        the tier needs room. Keys the tier does not hold are ignored. Never waits for the
        tier's lock (an engine touches blocks on its lookup path): while another thread's call
        holds it (a poll on the progress thread), the blocks are noted, as a lookup's HIT is,
        and counted as used by the next call that takes the lock, before it removes any.

        Raises:
            ValueError: a key is not a non-empty str or bytes; nothing was counted.
        """
        holdings = self._holdings
        keys = _key_list(keys, "touch")
        if holdings is None:  # (a bad key is refused all the same: a type and a length each)
            for key in keys:
                if ((type(key) is not str and type(key) is not bytes) or not key
                        or (type(key) is str and not key.isascii())):
                    key_text(key)  # (raises, naming what is wrong: a lone surrogate too)
            return
        names = self._remote_names(keys)
        lock = self._lock
        if not take(lock, 0.0):  # (a deadline passed: only if it is free)
            for name in names:
                holdings.use(name)
            return
        try:
            holdings.touch(names)
        finally:
            lock.release()

    def forget(self, keys: Sequence[bytes | str]) -> None:
        """The tier no longer vouches for what it holds under ``keys``: they answer MISS, as
        after a failed store, until a store of them succeeds. For a caller whose blocks under
        those keys now hold other bytes that this tier did not store (the tiering manager
        skipped it, saturated or busy): a load from here would bring the old ones back. The
        old copy stays where it is until a store replaces it or the capacity removes it, and
        a probe that finds it answers MISS all the same; a load of them submitted from now on
        fails without a NIXL call (:class:`ForgottenKeyError`), and one already in flight that
        succeeds (it read the old copy) leaves them MISS. The tier keeps the last
        :attr:`known_names` keys forgotten so, apart from its lookup cache: a key forgotten
        before those is probed again as any (name blocks by their content, as vLLM does,
        and there is nothing to forget).

        Raises:
            ValueError: a key is not a non-empty str or bytes; nothing was forgotten.
        """
        self._known.forget(self._remote_names(_key_list(keys, "forget")))

    def take_events(self) -> list[HoldingEvent]:
        """What the tier stored and removed since the last call, oldest first (kept only when
        built with ``record_events=True``)."""
        holdings = self._holdings
        return [] if holdings is None else holdings.take_events()

    def state_of(self, job_id: int) -> Any:
        """The state of a job's transfer, or None when it is published or unknown.

        Raises:
            InvalidJobError: ``job_id`` is not an int (a bool or a float is not taken as one).
        """
        transfer = self._runner.records.get(_job_id(job_id))
        return None if transfer is None else transfer.state

    def owes(self, job_id: int) -> bool:
        """True while a result for ``job_id`` is still to come from :meth:`get_finished_jobs`
        (its job in flight, or published and not yet handed out): after a submit that an
        interrupt cut short, whether the tier took the job.

        Raises:
            InvalidJobError: ``job_id`` is not an int.
        """
        job_id = _job_id(job_id)
        runner = self._runner
        return job_id in runner.records or job_id in runner.unreported

    def transfer_of(self, job_id: int) -> Transfer | None:
        """The in-flight transfer record of a job (retries, leaks, last error), or None.

        Raises:
            InvalidJobError: ``job_id`` is not an int.
        """
        return self._runner.records.get(_job_id(job_id))

    def stats(self) -> dict[str, Any]:
        """What the tier did: transfers in flight per state, results published (and how many
        failed), release retries, leaks (all counted, the last :attr:`leak_record` kept), and
        the latency of recent transfers (seconds from submit to finished, percentiles over the
        last 4096); ``distrusted``, why the tier vouches for no key any more (a forget raised:
        every lookup answers MISS and every load is refused until a new tier is made), or None.

        Its cost does not grow with the transfers in flight or the jobs ever run: the counts
        are kept as transfers move, and what is listed is bounded. It never waits for the
        tier's lock (a monitoring thread is not held up behind a poll): what it returns is read
        while other threads may go on, so two figures may be one call apart.
        """
        stats = self._runner.counts()
        stats["lookup_cache"] = len(self._known)
        #: why the tier vouches for no key any more (None: it does): :class:`KnownNames`
        stats["distrusted"] = self._known.distrusted
        if self.policy.progress_interval is not None:
            stats["progress"] = {"running": self._progress_thread is not None,
                                 "polls": self._progress_polls, "error": self._progress_error}
        limit = self.in_flight
        stats["in_flight_limit"] = {
            **self.in_flight_figures(), "max_jobs": limit.jobs, "max_bytes": limit.bytes}
        if self._holdings is not None:
            stats["holdings"] = self._holdings.stats()
        return stats

    def in_flight_figures(self) -> dict[str, int]:
        """The jobs and bytes in flight (the unpublished transfers, and those published as
        given up while NIXL ran them: :meth:`_in_flight`) and the stores refused past
        :attr:`in_flight`, without the rest of :meth:`stats` (and, like it, without the
        tier's lock)."""
        jobs, nbytes = self._in_flight()
        return {"jobs": jobs, "bytes": nbytes, "stores_refused": self._stores_refused}

    def _in_flight(self) -> tuple[int, int]:
        """The jobs and bytes :attr:`in_flight` bounds: the unpublished transfers, and those
        published as given up while NIXL ran them (the running bound's) that NIXL may run
        still (``may_run``: until its state check says it is over), which hold what they took
        (a file tier's open files, the blocks)."""
        runner = self._runner
        jobs, nbytes = len(runner.records), runner.bytes_in_flight
        records = runner.records
        for transfer in list(runner.may_run) if runner.may_run else ():
            if records.get(transfer.job_id) is not transfer:  # (published: not counted above)
                jobs, nbytes = jobs + 1, nbytes + transfer.nbytes
        return jobs, nbytes

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

    def _signal_stop(self) -> None:
        """Tell the background work to stop, waiting for nothing (under the tier's lock, as
        shutdown closes the tier): a probe not yet made is not made."""

    def _stop_probes(self) -> None:
        """Stop any background probing, waiting until ``_stop_by`` at most (shutdown calls it
        without the tier's lock, once the tier is closed; again if an interrupt cut it short).
        """

    def _take_back(self, names: Sequence[str]) -> Sequence[str]:
        """A store of ``names`` is about to be admitted within the capacity (under the tier's
        lock): take those of them waiting to be removed out of the removals, and return them.

        Raises:
            RemovalInFlightError: one of them is being removed now; nothing changed.
        """
        return ()

    def _give_back(self, names: Sequence[str]) -> None:
        """The store :meth:`_take_back` took ``names`` back for was not admitted: remove them
        after all."""

    def _removing(self, names: Sequence[str]) -> tuple[str, ...]:
        """Those of ``names`` the tier is removing (evicted, not yet removed): a load of them
        that succeeds does not make them a HIT again."""
        return ()

    # -- internals --------------------------------------------------------------------------

    def _submit_locked(self, job: TransferJob, *, load: bool) -> None:
        """A submit under the tier's lock; then the progress thread, if the policy asks for
        one (whatever the submit did: an interrupt may leave its job in flight)."""
        if self._closed or self._closing:  # refused at once, not behind a shutdown's lock
            raise TierClosedError(f"{type(self).__name__} is shut down; job "
                                  f"{getattr(job, 'job_id', job)!r} refused")
        with self._lock:
            try:
                self._submit(job, load=load)
            except BaseException as error:  # (Runner.guarded, inline on this hot path)
                if not isinstance(error, Exception):  # an interrupt: it may have cut the
                    self._runner.damaged = True  # filing of its transfer short
                raise
            finally:
                if self._on_nixl and not self._kept and self._runner.records:
                    self._kept = True  # dropped now, it would tear its NIXL agent down
                    _live_tiers.add(self)  # under the transfers: held until they are over
                if self.policy.progress_interval is not None:
                    self._start_progress(self.policy.progress_interval)

    def _start_progress(self, interval: float) -> None:
        """Start the progress thread if jobs are unpublished and none runs (under the tier's
        lock: the thread ends under it too, so one runs at most)."""
        progress = self._progress_thread
        if progress is not None and progress.ident is None and not started(progress):
            self._progress_thread = progress = None  # never started (interrupts cut its
            # start short, and the check after it): dropped, once it had time to say it runs
        if (progress is not None or self._progress_error is not None
                or self._closing or not self._runner.records):
            return
        thread = threading.Thread(target=self._progress_loop, args=(interval,),
                                  name=f"kvfsm-progress-{type(self).__name__}")
        last = self._progress_last
        try:  # recorded before it starts: an interrupt inside start() may leave it running,
            # and a thread the tier does not know of would be woken by no shutdown nor exit
            self._progress_thread = self._progress_last = thread
            _progress_tiers.add(self)
            thread.start()
        except BaseException as error:
            if not started(thread, 0.5 if not isinstance(error, Exception) else 0.0):
                self._progress_thread, self._progress_last = None, last
            if not isinstance(error, Exception):
                raise
            # no thread to be had: the caller's steps poll, as without
            self._progress_error = f"not started: {type(error).__name__}: {error}"
            logger.error("%s: the progress thread could not start (%s); get_finished_jobs "
                         "polls on the caller's thread", type(self).__name__, error)

    def _wake_progress(self) -> None:
        """End the progress thread's pause, and every later one: it polls at once, then ends
        if the tier is closing (or goes on polling while the process exits)."""
        self._progress_woken = True
        self._progress_wake.put(None)

    def _progress_loop(self, interval: float) -> None:
        """Poll every ``interval`` seconds while jobs are unpublished and the tier is open (at
        once, after :data:`BEHIND_PAUSE`, while the last poll left turns due it did not take)."""
        lock, records, wake = self._lock, self._runner.records, self._progress_wake
        main, until = threading.main_thread(), math.inf
        try:
            runner, pause = self._runner, min(interval, BEHIND_PAUSE)
            while True:
                if not self._progress_woken:
                    with contextlib.suppress(queue.Empty):  # (the pause ran out)
                        wake.get(timeout=pause if runner.behind
                                 else min(interval, EXIT_SLICE) if _exiting else interval)
                with lock:
                    if until == math.inf and not main.is_alive() and _only_ours_left(main):
                        # the process exits: the interpreter waits for this thread, and the
                        until = _exit_deadline()  # exit's wait after it, within one bound
                    if not records or self._closing or time.monotonic() >= until:
                        if self._progress_thread is threading.current_thread():
                            self._progress_thread = None  # (past its bound, what is left is
                        return  # the exit's, and threads still running poll on their own)
                    self._poll(limit=PROGRESS_SLICE)
                    self._progress_polls += 1
        except BaseException as error:
            try:
                logger.exception("%s: the progress thread's poll raised; get_finished_jobs "
                                 "polls on the caller's thread from now on",
                                 type(self).__name__)
            finally:  # after the log line (whoever sees the error finds it), even if it raised
                with lock:
                    if self._progress_thread is threading.current_thread():
                        self._progress_thread = None
                    self._progress_error = f"{type(error).__name__}: {error}"

    def _submit(self, job: TransferJob, *, load: bool) -> None:
        if self._closed or self._closing:
            raise TierClosedError(f"{type(self).__name__} is shut down; job {job.job_id} refused")
        names, block_ids = self._validate(job, load=load)
        if self.primary.data_ptr() != self._primary_at:
            raise InvalidJobError(f"job {job.job_id} refused: {self._moved()}; nothing was "
                                  "registered, and no result will come")
        if type(job.keys) is not tuple or job.block_ids is not block_ids:  # the job as it is
            # now, for the transfer: the caller may reuse its lists once this call returns
            job = (TransferJob(job.job_id, tuple(job.keys), block_ids, job.is_promotion)
                   if type(job) is TransferJob else _job_copy(job, block_ids))
        runner = self._runner
        if runner.damaged:  # (an interrupt went through a call: a failure it latched may not
            runner.mend()  # have forgotten its keys yet, which this load must find forgotten)
        nbytes = len(block_ids) * self.block_bytes
        limit = self.in_flight
        if (not load and (limit.jobs is not None or limit.bytes is not None)
                and not limit.admits(*self._in_flight(), nbytes)):
            self._stores_refused += 1
            jobs, held = self._in_flight()
            raise TierSaturatedError(
                f"{type(self).__name__}: store job {job.job_id} ({nbytes} bytes) refused: "
                f"{jobs} job(s) and {held} bytes in flight, "
                f"bound {limit.jobs} job(s) and {limit.bytes} bytes (InFlightLimit); nothing "
                "was registered, and no result will come")
        transfer = Transfer(job, nbytes, time.monotonic(), runner.initial)
        transfer.names = names
        if self._holdings is not None:  # a store past the capacity is refused: nothing changed
            self._hold(transfer, load=load)
        outcome: Outcome | None = None
        try:
            runner.add(transfer)
            if not load:  # (counted again from the records if an interrupt cuts it short)
                self._known.storing_begins(names, block_ids)
            stale = load and self._known.stale(names)
            outcome = (self._driver.post(transfer, self._local, block_ids) if not stale
                       else _stale(job, names, stale, self._known.distrusted))
        finally:
            if outcome is None:  # an interrupt before the post answered: once it has a
                # handle NIXL may run it (a poll says), else nothing runs
                outcome = Outcome(Answer.PROC if transfer.xfer is not None else Answer.RAISED,
                                  CallFailed("post", PostInterrupted()))
            if transfer.job_id in runner.records:
                self._file_post(transfer, outcome)

    def _file_post(self, transfer: Transfer, outcome: Outcome) -> None:
        """(submit) Fire what the post answered, and make the calls due if that ended the
        transfer (DONE or FAILED). The job is taken from the first: an action of the
        lifecycle that raises here is logged, not raised (:func:`_action_raised`)."""
        try:
            self._runner.take(transfer, TransferEvent.POST, outcome)
        except Exception:  # (filed all the same)
            _action_raised(transfer, "its post")
            return
        if transfer.slot < 0:  # over at once: DONE or FAILED
            try:
                self._advance((transfer,))
            except Exception:  # (the next poll goes on with it)
                _action_raised(transfer, "the calls due as its post answered")

    def _hold(self, transfer: Transfer, *, load: bool) -> None:
        """(submit, with a capacity) A load pins its names, and notes those being removed; a
        store is taken back from the removals first, so none is sent meanwhile, and then
        reserves its room (refused past the capacity, as it was: nothing changed)."""
        holdings, names = self._holdings, transfer.names
        assert holdings is not None
        if load:
            holdings.pin(names)
            transfer.doomed = self._removing(names)
            return
        taken: Sequence[str] = ()
        try:
            taken = self._take_back(names)
            holdings.reserve(names, transfer.job.keys)
        except BaseException:
            self._give_back(taken)
            raise

    def _poll(self, everything: bool = False, limit: int | None = None) -> None:
        """Advance the unpublished transfers once: the one poll path.

        First the state checks of the running transfers the poll schedule picks (every one
        with ``everything``, as a drain asks, or with few running; else those likely to have
        ended and the sweep's share: :meth:`~kvfsm.runner.Runner.check_round`), in batches
        (:meth:`~kvfsm.driver.TransferDriver.check`): a transfer NIXL still runs costs its call
        and nothing else, because the table declares that answer a stay (counted, not fired);
        each other answer is fired and its transfer taken as far as it goes this round. Then
        the running bound, if the policy sets one; then every transfer that was waiting (a
        release to retry, a step of the user's), but those backing off whose try is not due
        (:meth:`~kvfsm.runner.Runner.waiting_now`: they cost nothing until then). ``limit``
        bounds the schedule's state checks (the progress thread's :data:`PROGRESS_SLICE`).

        An interrupt (a signal handler's, which may land between any two statements) that went
        through a call of the tier marks its runner damaged: the next poll first files every
        unpublished transfer afresh (:meth:`~kvfsm.runner.Runner.mend`), so none is lost to a
        filing it cut short.
        """
        runner, driver = self._runner, self._driver
        with runner.guarded:
            if self.primary.data_ptr() != self._primary_at and not self._moved_cancelled:
                self._cancel_moved()
            waiting = runner.waiting_now()  # those in it now, not backing off: one round each
            answered = runner.check_round(driver.check, everything, limit, driver.check_all)
            if answered:
                self._take_polls(answered)
            overdue = runner.overdue()
            if overdue:
                self._advance(overdue)
            if waiting:
                self._advance(waiting)
        if self._kept and not runner.records and not runner.may_run:  # nothing unpublished:
            self._kept = False  # it may be dropped
            _live_tiers.discard(self)

    def _moved(self) -> str:
        """What is wrong with a primary cache whose memory moved since the tier was made."""
        return (f"the primary cache's memory moved since this {type(self).__name__} was made "
                f"(from {self._primary_at:#x} to {self.primary.data_ptr():#x}: share_memory_(),"
                " resize_() or setting .data moves it), and NIXL copies to and from the memory "
                "registered then; move the cache before making its tiers, and make a new tier "
                "now")

    def _cancel_moved(self) -> None:
        """(a poll, under the tier's lock) The primary cache's memory moved while jobs were
        unpublished: each is cancelled, once (a transfer NIXL runs fails when it ends; one
        over keeps its outcome, as :meth:`cancel` says), and an error says so."""
        unpublished = self.unpublished()
        if unpublished:
            logger.error("%s: %s; its %d unpublished job(s) are cancelled (those NIXL ran "
                         "copied to or from the memory the cache left)", type(self).__name__,
                         self._moved(), len(unpublished))
        self._cancel_each(unpublished, f"cancelled: {self._moved()}")
        self._moved_cancelled = True

    def _take_polls(self, answered: list[tuple[Transfer, Any]]) -> None:
        """Fire each state check's answer; then take each transfer that is no longer running
        as far as it goes, in order (every answer is fired before any release is made: a
        listener of the first job published finds the others over already).

        A transfer NIXL's DONE took out of the running states is filed as its calls are made,
        not before: in the common case, a state whose ending is declared (release, clean,
        publish) and calls that answer OK, it is then filed once, as final, instead of among
        those waiting first and then again (what the first filing writes, the second undoes).
        Until then it stays where it was filed, in :attr:`~kvfsm.runner.Runner.unfiled`,
        which a call into the books that comes in between (a listener's) files first. An
        interrupt leaves the runner damaged, and the next round files every transfer afresh
        from its state."""
        runner, driver = self._runner, self._driver
        records, running = runner.records, runner.running_states
        take, polled, file = runner.take, driver.polled, runner.file
        fire, poll, done = runner.machine.fire, TransferEvent.POLL, Answer.DONE
        may_run = runner.may_run
        outer = runner.unfiled  # (a listener's round inside this one: its own, then this's)
        over: list[Transfer] = []  # no longer running: their calls are due this round
        runner.unfiled, runner.round_thread = over, threading.get_ident()
        try:
            for transfer, status in answered:
                if records.get(transfer.job_id) is not transfer or transfer.state not in running:
                    continue  # moved meanwhile (a listener polled again)
                outcome = polled(transfer, status)
                if may_run and outcome.answer in _NIXL_OVER:  # one given up, NIXL says it is
                    may_run.discard(transfer)  # over: it runs no more, whatever comes of it
                if outcome is DONE:  # (a state check's answer is never a retry: fired as is)
                    fire(transfer, poll, done)
                    if transfer.state not in running:
                        over.append(transfer)  # filed as its calls are made (_end)
                        continue
                    file(transfer)
                else:
                    take(transfer, poll, outcome)
                if transfer.slot < 0:
                    over.append(transfer)
            if over:
                self._end(over)
        except Exception:  # an action that raised: each transfer this round left unfiled
            # is filed where its state says, and the next round goes on with it (after an
            # interrupt, the next round files every transfer afresh: Runner.mend)
            runner.file_unfiled()
            runner.file_unfiled(transfer for transfer, _ in answered)  # (the one it was)
            raise
        finally:
            runner.unfiled = outer

    def _end(self, transfers: Sequence[Transfer]) -> None:
        """Make every call due for ``transfers`` now, as :meth:`_advance` does, one at a time
        and in order; one waiting on its release (the common case: NIXL answered DONE or
        ERR) has its release and cleanup made at once, the ending run as one chain when both
        answered OK (and the transfer filed, as final), :meth:`_advance` going on with it
        only when they moved it on without publishing it."""
        runner = self._runner
        records, ending, take, end = runner.records, runner.ending, runner.take, self._driver.end
        run, file = runner.machine.run, runner.file
        for transfer in transfers:
            state = transfer.state
            if records.get(transfer.job_id) is not transfer:
                continue  # published meanwhile (a listener polled again)
            if state in ending and not transfer.retry_at:
                released, cleaned = outcome = end(transfer)
                if released is RELEASED and cleaned is CLEANED:
                    try:
                        run(transfer, ending[state])
                    finally:  # final, and published (an action that raised: where it is)
                        file(transfer)
                    continue
                file(transfer)  # (unfiled: among those waiting, before the answers fire)
                take(transfer, END, outcome)
                if transfer.state is not state and records.get(transfer.job_id) is transfer:
                    self._advance((transfer,), moved=True)
            else:
                file(transfer)  # (unfiled: among those waiting, before their calls are made)
                self._advance((transfer,))

    def _advance(self, transfers: Sequence[Transfer], moved: bool = False) -> None:
        """Make every call due for ``transfers`` now, as far as each goes this round (``moved``:
        an effect moved each on this round already, :meth:`~kvfsm.runner.Runner.due`)."""
        runner, makers = self._runner, self._makers
        take = runner.take
        for transfer, effect in runner.due(transfers, moved):
            take(transfer, effect, makers[effect](transfer))

    def _validate(self, job: Any, *, load: bool) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Check a job against this tier; returns its remote names and block ids.

        Raises:
            InvalidJobError: names what is wrong with the job; nothing was registered.
        """
        job_id = self._check_job_id(job)
        if job.is_promotion is not load and job.is_promotion != load:
            if load:  # (submit_store would overwrite the stored blocks with these)
                raise InvalidJobError(f"job {job_id} has is_promotion={job.is_promotion}: a "
                                      "load is a TransferJob with is_promotion=True")
            raise InvalidJobError(f"job {job_id} has is_promotion={job.is_promotion}: a load, "
                                  "submit it with submit_load (a store has "
                                  "is_promotion=False)")
        keys, raw_ids = job.keys, job.block_ids
        if ((type(keys) is not list and type(keys) is not tuple)
                or (type(raw_ids) is not list and type(raw_ids) is not tuple)):
            for field, value in (("keys", keys), ("block_ids", raw_ids)):  # (other sequences)
                if isinstance(value, str | bytes) or not isinstance(value, Sequence):
                    raise InvalidJobError(f"job {job_id}: {field} must be a list or tuple, "
                                          f"got {type(value).__name__} {value!r}")
        if len(keys) != len(raw_ids):
            raise InvalidJobError(f"job {job_id} has {len(keys)} keys but "
                                  f"{len(raw_ids)} block ids")
        try:
            names = self._remote_names(keys)
        except ValueError:
            names = ()
        if len(names) != len(keys) or (len(names) > 1 and len(set(names)) != len(names)):
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
        records = self._runner.records
        if job_id in records:
            raise InvalidJobError(f"job {job_id} is already in flight "
                                  f"({records[job_id].state.name})")
        if job_id in self._runner.unreported:
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

logger = logging.getLogger("kvfsm")

#: the tiers on real NIXL agents with jobs unpublished (from a submit until a poll finds none,
#: or shutdown), or a transfer given up while NIXL may still run it (for good), held here: one
#: dropped with transfers in flight would tear its NIXL agent down under them (a process
#: crashed so, in the collector, 1 of 4 times); at the interpreter's exit they are drained and
#: shut down (:func:`_wait_at_exit`)
_live_tiers: set[SecondaryTier] = set()

#: every tier on a real NIXL agent: refused new jobs as the interpreter exits
_nixl_tiers: weakref.WeakSet[SecondaryTier] = weakref.WeakSet()

#: how long the interpreter's exit waits, at most, for NIXL to end what the tiers it finds
#: still run (:func:`_wait_at_exit`); past it, an error names them and the exit goes on
EXIT_WAIT_SECONDS = 60.0


def _runs_nixl(agent: Any) -> bool:
    """Whether ``agent`` is NIXL's own ``nixl_agent``, or a wrapper around one (``wrapped``,
    as :class:`kvfsm.testing.FaultyAgent`'s): its transfers run outside the interpreter."""
    for _ in range(8):  # (a wrapper of a wrapper...: a few levels at most)
        if type(agent).__module__.partition(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13"):
            return True
        agent = getattr(agent, "__dict__", {}).get("wrapped")  # (not through __getattr__)
        if agent is None:
            return False
    return False


#: when the interpreter's exit stops waiting for NIXL: :data:`EXIT_WAIT_SECONDS` from when the
#: first to see the process exit (the main thread returned, and no thread still runs but
#: daemons and kvfsm's own) looked: a progress thread then, else :func:`_wait_at_exit`. The
#: progress threads' polls and the exit's wait after them share it
_exit_by: list[float] = []


def _action_raised(transfer: Transfer, what: str) -> None:
    """A submit took its job, and an action of the lifecycle raised as ``what`` was filed:
    the submit does not raise (a submit that raises has taken nothing, the contract says, and
    the caller would reuse blocks NIXL may be moving); the error is logged, and the job goes
    on, its result to come from ``get_finished_jobs`` (the next poll goes on with it, as after
    an action that raised in a poll)."""
    logger.exception("job %d: an action of the lifecycle raised as %s was filed; the job is "
                     "taken (NIXL may be moving its blocks), and its result comes from "
                     "get_finished_jobs", transfer.job_id, what)


def _exit_deadline() -> float:
    """The exit's deadline: :data:`EXIT_WAIT_SECONDS` from the first call."""
    if not _exit_by:
        _exit_by.append(time.monotonic() + EXIT_WAIT_SECONDS)
    return _exit_by[0]


#: the tiers that started a progress thread: the interpreter's exit wakes them
_progress_tiers: weakref.WeakSet[SecondaryTier] = weakref.WeakSet()
#: the longest a progress thread pauses once the process exits, to see whether the caller's
#: threads have all ended (it may then have to wait for NIXL, within EXIT_WAIT_SECONDS)
EXIT_SLICE = 0.1
#: not empty once the interpreter's exit began (the main thread returned): _wake_at_exit
_exiting: list[bool] = []


def _wake_at_exit() -> None:
    """As the main thread returns, before the interpreter joins the other threads: every
    progress thread ends its pause, and pauses at most :data:`EXIT_SLICE` from now on, so that
    it sees the exit at once (once the caller's threads ended) instead of after a whole
    ``progress_interval``, and the exit keeps its bound (:data:`EXIT_WAIT_SECONDS`)."""
    _exiting.append(True)
    for tier in list(_progress_tiers):
        tier._progress_wake.put(None)


# (run by the threading module before it joins the threads; an atexit handler runs after)
getattr(threading, "_register_atexit", lambda _: None)(_wake_at_exit)


def started(thread: threading.Thread, wait: float = 0.5) -> bool:
    """Whether ``thread``, whose ``start`` raised, runs all the same (an interrupt landed once
    the thread was made, as ``start`` waited for it to say it runs): it says so within
    ``wait`` seconds, or it was never made."""
    deadline = time.monotonic() + wait
    while not thread.is_alive() and thread.ident is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return thread.is_alive() or thread.ident is not None


def _only_ours_left(main: threading.Thread) -> bool:
    """Whether every thread still running but ``main`` (which returned) is a daemon or kvfsm's
    own (named ``kvfsm-...``): none of the caller's threads may still use a tier."""
    return all(thread.daemon or thread.name.startswith("kvfsm-")
               for thread in threading.enumerate() if thread is not main)


def _wait_at_exit() -> None:
    """At the interpreter's exit, once it joined its threads (an ``atexit`` handler): a process
    must not exit with a NIXL transfer in flight (with an object store's requests under way
    it crashed, SIGSEGV, 7 of 8 runs of 16 jobs left in flight).

    Every tier on real NIXL refuses new jobs from now on (a daemon thread may still submit);
    one held (:data:`_live_tiers`) that was not shut down, with jobs unpublished, is drained
    and shut down; then what NIXL may still run of its transfers (those still running, and
    those given up while it ran them) is asked about until NIXL says it is over. All of it
    within :data:`EXIT_WAIT_SECONDS`: past it (a transfer NIXL never ends, a peer's write whose
    receiver in this process no one polls any more), an error names what still runs, and the
    exit goes on. Threads still running when the main thread returned are not disturbed: the
    interpreter joins them first, and their tiers keep working until then; the bound counts
    from when they had all ended, and covers the progress threads' polls after that too."""
    deadline = _exit_deadline()
    for tier in list(_nixl_tiers):
        tier._closing = True  # submits refused from now on (read before the lock is taken)
        tier._wake_progress()
    try:
        for tier in list(_live_tiers):
            try:
                _finish_at_exit(tier, deadline)
            except Exception:
                logger.exception("interpreter exit: %s raised while its transfers were waited "
                                 "for", type(tier).__name__)
    except KeyboardInterrupt:  # a second Ctrl-C: the user stops the wait (no traceback)
        logger.error("interpreter exit: interrupted while waiting for NIXL to end its "
                     "transfers; exiting with those it still runs in flight")


#: in a forked child, the sets of tiers the parent held: kept for good (freed in the child, a
#: tier the parent had dropped would tear the child's copy of its NIXL agent down)
_inherited: list[Any] = []


def _forget_after_fork() -> None:
    """In a forked child: the parent's tiers are the parent's (their transfers run in its NIXL),
    so the child's exit leaves them alone, and they are kept, never freed, in the child."""
    global _live_tiers, _nixl_tiers
    _inherited.append((_live_tiers, list(_nixl_tiers)))
    _live_tiers, _nixl_tiers = set(), weakref.WeakSet()
    _exit_by.clear()  # (a child forked as the parent exits has its own exit)
    _exiting.clear()


def _finish_at_exit(tier: SecondaryTier, deadline: float) -> None:
    """Drain and shut ``tier`` down by ``deadline`` if it has jobs unpublished (a poll that
    raises does not stop it); then ask NIXL about what it may still run of its transfers until
    it says each is over."""
    name = type(tier).__name__
    said = not tier.closed and bool(tier.unpublished())
    if said:
        logger.warning("interpreter exit: %s was not shut down (or its shutdown timed out), "
                       "with %d job(s) unpublished; waiting up to %.3g s for NIXL to end their "
                       "transfers", name, len(tier.unpublished()), _left(deadline))
        for end in (tier.drain_jobs, tier.shutdown):
            try:
                end(_left(deadline))
            except DrainTimeout:
                pass
            except Exception:
                logger.exception("interpreter exit: %s: %s raised", name, end.__name__)
    running: list[tuple[int, Any]] = []
    while take(tier._lock, deadline):  # (past the deadline: once more, if the lock is free;
        try:  # a daemon thread may still poll: the handles are read, and asked about, under it)
            running = _may_run(tier)
            answers = tier._driver.check([handle for _, handle in running])  # (never raises:
            running = [entry for entry, answer in zip(running, answers, strict=True)  # one
                       if answer == NIXL_RUNNING]  # that raised answers what it raised)
        finally:
            tier._lock.release()
        if not running or time.monotonic() >= deadline:
            break
        if not said:
            said = True
            logger.warning("interpreter exit: %s: NIXL still runs %d transfer(s) (jobs %s); "
                           "waiting up to %.3g s for it to end them (a process must not exit "
                           "with one in flight)", name, len(running),
                           sorted({job_id for job_id, _ in running}), _left(deadline))
        time.sleep(0.01)
    if running:
        logger.error("interpreter exit: %s: NIXL still runs %d transfer(s) (jobs %s) at the "
                     "exit's deadline (EXIT_WAIT_SECONDS, %g s); exiting with them in flight",
                     name, len(running), sorted({job_id for job_id, _ in running}),
                     EXIT_WAIT_SECONDS)


def _may_run(tier: SecondaryTier) -> list[tuple[int, Any]]:
    """(Under the tier's lock.) The handles NIXL may still run of ``tier``'s transfers, by job:
    those of transfers in a running state, and of those given up while NIXL ran them."""
    runner = tier._runner
    return ([(t.job_id, handle) for t in runner.records.values()
             if t.state in runner.running_states for handle in _handles(t)]
            + [(t.job_id, handle) for t in runner.quarantined if t in runner.may_run
               for handle in _handles(t)])


def _job_copy(job: TransferJob, block_ids: tuple[int, ...]) -> TransferJob:
    """A job of a subclass of TransferJob (an engine's own), copied whole with its keys and
    ``block_ids`` as tuples: its class, and what its instances hold of their own (in slots of
    its classes, or in its ``__dict__``) kept. (``copy.copy`` keeps only the dataclass's
    fields: the frozen dataclass's ``__getstate__`` says no more.)"""
    cls = type(job)
    copied = object.__new__(cls)
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for declared in (slots,) if isinstance(slots, str) else slots:
            slot = (f"_{klass.__name__.lstrip('_')}{declared}"  # a private one's name
                    if declared.startswith("__") and not declared.endswith("__") else declared)
            if slot not in ("__dict__", "__weakref__") and hasattr(job, slot):
                object.__setattr__(copied, slot, object.__getattribute__(job, slot))
    if hasattr(job, "__dict__"):
        copied.__dict__.update(job.__dict__)
    object.__setattr__(copied, "keys", tuple(job.keys))  # (frozen: as its __init__ sets them)
    object.__setattr__(copied, "block_ids", block_ids)
    return copied


def _stale(job: TransferJob, names: Sequence[str], stale: Sequence[str],
           distrusted: str | None) -> Outcome:
    """The post's answer for a load of names the tier forgot (or of any, once it vouches for
    none: ``distrusted`` says why): it raised, at ``open``, naming the job's keys."""
    forgotten = set(stale)
    keys = [key for key, name in zip(job.keys, names, strict=True) if name in forgotten]
    return Outcome(Answer.RAISED, CallFailed("open", ForgottenKeyError(keys, distrusted)))


def _handles(transfer: Transfer) -> list[Any]:
    """The transfer handles of ``transfer`` NIXL may still run: its own, and those of a job
    made one per block that were posted and not found over."""
    split = transfer.split
    others = [] if split is None else split.handles[split.done:split.posted]
    return ([] if transfer.xfer is None else [transfer.xfer]) + others


atexit.register(_wait_at_exit)  # (after the interpreter joined its threads)
os.register_at_fork(after_in_child=_forget_after_fork)


#: the leaks of the primary cache's release calls an interrupt cut short, made beforehand
#: (the driver's, as the tier's own: job -1)
_PRIMARY_CUT_SHORT_KEEPING = tuple((-1, leak) for leak in _CUT_SHORT_KEEPING_FILES)
_PRIMARY_CUT_SHORT = tuple((-1, leak) for leak in _CUT_SHORT["deregister_memory"])


def _record_verdicts(known: KnownNames, holdings: Holdings | None, may_run: Collection[Transfer],
                     transfer: Transfer, result: JobResult) -> None:
    """A finished store or load shows the blocks are there; after a failed load the tier
    cannot vouch for them, and a failed load is not made again and again (F11). (A failed
    store forgot its names before its result was queued: :func:`_forget_failed_store`.) The
    holdings unpin them, whatever the verdicts' recording raised (an unpin skipped would hold
    the blocks' room for good)."""
    try:
        if known.doubting and transfer not in may_run:  # (a store cancelled while NIXL
            known.undoubt(transfer)  # ran it is over; one given up never is)
        if transfer.job.is_promotion:
            known.record(transfer.names, Lookup.HIT if result.success else Lookup.MISS,
                         load=True)
        else:
            vouched = known.store_ended(transfer.names)
            if result.success:
                known.record(vouched, Lookup.HIT)
        if transfer.doomed and result.success:  # read before their removal: gone by now,
            # unless a store took one back meanwhile (the tier holds it again)
            gone = [name for name in transfer.doomed
                    if holdings is None or not holdings.holds(name)]
            known.record(gone, Lookup.MISS)
    finally:
        if holdings is not None:
            holdings.finished(transfer.names, transfer.job.keys,
                              load=transfer.job.is_promotion, success=result.success,
                              landed=transfer.landed)


def _recount_storing(known: KnownNames, may_run: Collection[Transfer],
                     transfers: Collection[Transfer]) -> None:
    """(after a mend) The unpublished stores' names counted again, and the doubts: an
    interrupt may have cut :meth:`KnownNames.storing_begins`, :meth:`~KnownNames.store_ended`,
    a doubt, or a store's end short (its books not written, as
    :meth:`~kvfsm.runner.Runner.mend` has it: each at most once)."""
    known.recount_storing([(transfer.names, transfer.job.block_ids) for transfer in transfers
                           if not transfer.job.is_promotion])
    known.recount_doubts({*transfers, *may_run})


def _forget_failed_store(known: KnownNames, running: Collection[Any],
                         may_run: Collection[Transfer],
                         transfer: Transfer) -> None:
    """A store that failed forgets its names (:meth:`KnownNames.forget`), as soon as its
    failure is latched and again before its result is queued: the engine's blocks under those
    keys may hold other bytes than whatever copy the store left (a store cancelled while NIXL
    runs it may still land whole), so a probe finding that copy is not taken, and a load of
    them is refused, until a store of them succeeds. (Made again if an interrupt cut the
    first short.) One NIXL may still run (cancelled while running, or given up by the running
    bound) holds them MISS whatever succeeds meanwhile: until it is over, or for good."""
    if not transfer.job.is_promotion:
        known.forget(transfer.names)
        if transfer.state in running or transfer in may_run:
            known.doubt(transfer, transfer.names)


def check_capacity_options(capacity_bytes: object, block_bytes: int,
                           record_events: object) -> None:
    """Refuse a ``capacity_bytes`` that is neither None nor an int of at least one block, and
    ``record_events`` that is not a bool or comes without a capacity, naming what was
    given."""
    if type(record_events) is not bool:
        raise ValueError(f"record_events must be True or False, got {record_events!r}")
    if capacity_bytes is None:
        if record_events:
            raise ValueError("record_events=True needs capacity_bytes: a tier keeps track of "
                             "what it stored only within a capacity")
    else:
        check_capacity(capacity_bytes, block_bytes)


def _holdings(known: KnownNames, block_bytes: int, capacity_bytes: int | None,
              record_events: bool, remove: Remove | None) -> Holdings | None:
    check_capacity_options(capacity_bytes, block_bytes, record_events)
    if capacity_bytes is None:
        return None
    if remove is None:
        raise ValueError("capacity_bytes needs a way to remove blocks (remove=)")
    check_remove(remove, capacity_bytes)
    return Holdings(capacity_bytes, block_bytes, functools.partial(_forget, known, remove),
                    record_events=record_events)


def _forget(known: KnownNames, remove: Remove, names: Sequence[str]) -> int | None:
    """Removed blocks are MISS from now on, then removed."""
    known.record(names, Lookup.MISS)
    return remove(names)


def _bind(steps: Mapping[str, StepFunction], primary: torch.Tensor,
          ) -> dict[str, Callable[[Transfer], Any]]:
    """The user's steps, each given the primary cache (and no reference to the tier)."""
    return {name: functools.partial(_call_step, step, primary) for name, step in steps.items()}


def _call_step(step: StepFunction, primary: torch.Tensor, transfer: Transfer) -> Any:
    return step(transfer, primary)


def key_text(key: object) -> str:
    """A block key as text: a str as it is, bytes in hex.

    Both kinds share one namespace (``"6b"`` and ``b"k"`` name the same block), so a tier's
    users should stick to one kind (a :class:`~kvfsm.tiering.TieringManager` over such tiers
    refuses to mix bytes keys with str keys that are hex).

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
    if not text.isascii():
        check_text("key", text)
    return text


def check_text(what: str, text: str) -> None:
    """Refuse ``text`` that is not Unicode text a name can hold: a lone surrogate (from
    bytes decoded with ``surrogateescape``, say) has no UTF-8, so no file or object name.

    Raises:
        ValueError: names ``what``, the text, and where the surrogate is.
    """
    try:
        text.encode()
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} {text!r} holds a lone surrogate at position {error.start} "
                         f"({text[error.start]!r}): it is not UTF-8 text, and no file or "
                         "object name can hold it") from None


def _left(deadline: float | None) -> float | None:
    """:func:`~kvfsm.contract.seconds_left`, or None for no deadline (a timeout's None)."""
    return None if deadline is None else seconds_left(deadline)


def _key_list(keys: object, call: str) -> Any:
    """``keys`` if it is a collection of keys; ValueError naming it if it is one key (a str
    would be taken letter by letter) or no collection at all."""
    if isinstance(keys, str | bytes | bytearray) or not isinstance(keys, Iterable):
        raise ValueError(f"{call}: keys must be a list or tuple of keys (str or bytes), got "
                         f"{type(keys).__name__} {keys!r:.80}; nothing changed")
    return keys


def _job_id(job_id: object) -> int:
    """``job_id`` if it is an int (not a bool); else InvalidJobError naming it."""
    if type(job_id) is int:
        return job_id
    if isinstance(job_id, int) and not isinstance(job_id, bool):
        return int(job_id)  # an int subclass (a numpy integer is not one): its value
    raise InvalidJobError(f"a job id is an int, got {type(job_id).__name__} {job_id!r}")


#: the calls a tier makes of its NIXL agent
AGENT_CALLS = ("register_memory", "prep_xfer_dlist", "make_prepped_xfer", "transfer",
               "check_xfer_state", "release_xfer_handle", "release_dlist_handle",
               "deregister_memory")


def check_agent(agent: object, calls: Sequence[str] = AGENT_CALLS,
                kinds: str = "nixl_agent, or kvfsm.testing.FakeNixlAgent") -> None:
    """Refuse, naming what it lacks, an ``agent`` that is not a NIXL agent (one of ``kinds``,
    or a wrapper with their calls): one without each of ``calls``."""
    missing = [name for name in calls if not callable(getattr(agent, name, None))]
    if missing:
        raise ValueError(f"agent must be a NIXL agent ({kinds}), got {type(agent).__name__} "
                         f"{agent!r}, which has no {', '.join(missing)}")


#: what a storage tier's agent needs a backend for, by the memory type of its blocks there
_BACKEND_FOR = {"FILE": "POSIX (kvfsm.nixl_agents.make_agent(name, 'POSIX'))",
                "OBJ": "OBJ with the store's parameters (ObjectStoreTier(primary, "
                       "store=StoreConfig(...)) makes one)"}


def check_backend(agent: object, mem_type: str, tier: str) -> None:
    """Refuse, naming its backends, a real NIXL agent none of whose backends moves blocks to
    ``mem_type`` memory (a POSIX agent given to an object store tier): every job would fail
    with a bare NIXL_ERR_NOT_FOUND. An agent that does not say (a wrapper, a fake without
    ``get_backend_mem_types``) is taken as it is."""
    backends, mem_types = getattr(agent, "backends", None), getattr(
        agent, "get_backend_mem_types", None)
    if not isinstance(backends, Mapping) or not callable(mem_types):
        return
    served = {name: [str(t).removesuffix("_SEG") for t in mem_types(name)] for name in backends}
    if any(mem_type in types for types in served.values()):
        return
    has = "; ".join(f"{name}: {', '.join(types)}" for name, types in served.items()) or "none"
    raise ValueError(f"{tier}: agent {getattr(agent, 'name', agent)!r} has no backend for "
                     f"{mem_type} memory (its backends and what they move: {has}); it needs "
                     f"{_BACKEND_FOR.get(mem_type, 'one')}")


def check_tier_options(primary: object, *, agent: object,
                       machine: Declaration[Any, Any] | None,
                       steps: Mapping[str, StepFunction] | None, policy: RetryPolicy | None,
                       in_flight: object, capacity_bytes: object, record_events: object,
                       mem_type: str | None = None, tier: str = "tier") -> None:
    """What a tier's constructor refuses before it makes anything (an agent, a root, a
    thread): a machine the tier cannot run, then its other arguments, each by name; with
    ``mem_type`` (the memory its blocks go to), an agent without a backend for it."""
    check_runnable(machine or TRANSFER_MACHINE, steps or {}, policy or RetryPolicy())
    check_in_flight(in_flight)
    _check_primary(primary)
    check_capacity_options(capacity_bytes, int(primary[0].nbytes),  # type: ignore[index]
                           record_events)
    if agent is not None:
        check_agent(agent)
        if mem_type is not None:
            check_backend(agent, mem_type, tier)


def check_in_flight(in_flight: object) -> None:
    """Refuse an ``in_flight=`` that is not an :class:`~kvfsm.policy.InFlightLimit` or None
    (a subclass calls it before it makes any agent)."""
    if in_flight is not None and not isinstance(in_flight, InFlightLimit):
        raise ValueError(f"in_flight must be an InFlightLimit or None, got "
                         f"{type(in_flight).__name__} {in_flight!r}")


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
