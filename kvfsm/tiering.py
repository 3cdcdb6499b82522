"""The parent of the tiers: a CPU primary tier with pinned blocks, and a manager that runs jobs.

An offload manager keeps KV blocks in host memory (the *primary* tier) and copies them out to
secondary tiers (object store, files, a user's own) and back. This module is that parent:

* :class:`CPUPrimaryTier` owns the KV cache, a torch CPU tensor with blocks on its first
  dimension, and one reference count per block: -1 while the block is being written, 0 once it
  is ready (and evictable), n > 0 while n transfers read it, -2 once retired (a load given up
  while NIXL ran it may still write it). A block with a count other than 0 is never evicted.
* :class:`TieringManager` turns stores and loads into jobs for the secondary tiers, keeps
  ``job_id -> job`` for every job it handed out, and finalizes the primary on each job's result:
  a store's pin is dropped whether it succeeded or not; a load's block becomes readable, or is
  freed when the load failed. A failure that says NIXL may still move the job's blocks (its
  transfer was given up while it ran: ``JobResult.blocks_in_use``) keeps a store's pins, and
  retires a load's blocks, for good.

So the guarantees of the tiers (one result per job, never before NIXL let go of the memory, or
else saying it did not) carry over to the primary: no block is reused while a transfer still
reads or writes it, no block stays pinned once its jobs have results but those NIXL may still
move (held for good, counted in :meth:`TieringManager.stats` as ``blocks_held``), and the
manager has pending work exactly as long as some job has no result.

Both classes are driven from one thread (an engine's scheduler); neither is thread safe. Every
call returns quickly except :meth:`TieringManager.drain` and :meth:`TieringManager.shutdown`.

Example::

    primary = CPUPrimaryTier(256, (2, 16, 128), dtype=torch.float16)
    manager = TieringManager(primary, {
        "s3": ObjectStoreTier(primary.cache, store=config),
        "disk": FileTier(primary.cache, "/var/cache/kv"),
    })
    (block,) = primary.allocate(["seq0/blk0"])   # count -1: the engine writes the block
    primary.cache[block] = kv
    primary.complete_write([block], success=True)  # count 0: ready
    manager.store([block])                       # pinned once per tier until each result
    for done in manager.step():                  # once per scheduler step
        ...
"""

from __future__ import annotations

import collections
import heapq
import inspect
import itertools
import logging
import numbers
import operator
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

import torch

from kvfsm.contract import JobSide, check_interval, check_timeout
from kvfsm.machines.transfer import FailureReason
from kvfsm.tiers.base import Lookup, TierBusyError
from kvfsm.transfer import JobResult, TransferJob

logger = logging.getLogger("kvfsm")

__all__ = [
    "BlockStateError",
    "BookkeepingError",
    "BookkeepingIssue",
    "CPUPrimaryTier",
    "DuplicateKeyError",
    "Finalized",
    "ManagerClosedError",
    "OffloadTier",
    "OutOfBlocksError",
    "PrimaryTierError",
    "Submitted",
    "TierInputRefusedError",
    "TierSubmitError",
    "TieringDrainTimeout",
    "TieringInputError",
    "TieringManager",
    "UnknownBlockError",
]

#: a block key: what a tier stores a block under
Key: TypeAlias = bytes | str

#: reference count of a block being written
WRITING = -1
#: reference count of a retired block: a load given up while NIXL ran it may still write it
RETIRED = -2


# -- errors ----------------------------------------------------------------------------------------

class PrimaryTierError(ValueError):
    """Bad input to the primary tier; the call changed nothing."""


class UnknownBlockError(PrimaryTierError):
    """A block id that is not an int in ``[0, num_blocks)``."""


class BlockStateError(PrimaryTierError):
    """An operation on a block in the wrong state (e.g. unpinning a block nobody pinned)."""


class DuplicateKeyError(PrimaryTierError):
    """A key the primary tier already holds, or the same key twice in one call."""


class OutOfBlocksError(RuntimeError):
    """Not enough free or evictable blocks for an allocation; nothing was evicted."""


class TieringInputError(ValueError):
    """Bad input to the manager (an empty job, an unknown tier name, a key a tier cannot name);
    nothing changed."""


class ManagerClosedError(RuntimeError):
    """The manager was shut down and takes no more jobs."""


@dataclass(frozen=True, slots=True)
class BookkeepingIssue:
    """Something a tier reported that does not match the manager's books."""

    #: the job id the tier reported (None when the tier's poll itself raised)
    job_id: int | None
    #: the name of the tier that reported it
    tier: str
    #: what is wrong
    problem: str

    def __str__(self) -> str:
        job = "poll" if self.job_id is None else f"job {self.job_id}"
        return f"{job} from tier {self.tier!r}: {self.problem}"


class BookkeepingError(RuntimeError):
    """A step found results that match no outstanding job (or a tier whose poll raised).

    Raised by :meth:`TieringManager.step` after every other result of the step was finalized;
    the issues are also kept in :attr:`TieringManager.bookkeeping_errors`. The manager's books
    stay consistent, so stepping may go on.
    """

    def __init__(self, issues: Sequence[BookkeepingIssue],
                 finalized: Sequence[Finalized]) -> None:
        self.issues = tuple(issues)
        #: the jobs the step finalized anyway, which :meth:`TieringManager.step` would have
        #: returned
        self.finalized = tuple(finalized)
        super().__init__(f"{len(self.issues)} bookkeeping error(s):\n  "
                         + "\n  ".join(str(issue) for issue in self.issues))


class TierSubmitError(RuntimeError):
    """A tier's submit raised: it refused the job, which the manager then forgot.

    The pins the job took were dropped (a load's block freed) and the job id is unknown to the
    manager; a tier that kept the job anyway would report a :class:`BookkeepingError` later.
    Jobs other tiers accepted are in flight (:attr:`submitted`). The first refusal's exception
    is the ``__cause__``.
    """

    def __init__(self, refusals: Sequence[tuple[str, int, BaseException]],
                 submitted: Sequence[int]) -> None:
        self.refusals = tuple(refusals)
        #: the job ids other tiers accepted, in flight
        self.submitted = tuple(submitted)
        lines = [f"tier {tier!r} refused job {job_id}: {type(error).__name__}: {error}"
                 for tier, job_id, error in self.refusals]
        super().__init__("\n".join(lines))


class TierInputRefusedError(TierSubmitError, TieringInputError):
    """Every tier the call submitted to refused its job as malformed (its submit raised a
    ``ValueError``, such as :class:`~kvfsm.tiers.InvalidJobError`); the manager took back all
    it did for the call.

    The manager checks what it can before any change (keys against each tier's
    ``remote_name``), so this is what a tier found beyond that, e.g. a job id it already has
    from another user of the tier. Taken back are pins, a load's allocation and the job's
    registration; what that allocation evicted stays evicted, which is why the checks come
    first. It is a :class:`TierSubmitError` (the refusals, nothing
    :attr:`~TierSubmitError.submitted`) and a ``ValueError`` naming each tier and its reason. A
    store that another tier accepted raises a plain :class:`TierSubmitError` instead: that job
    is in flight and cannot be taken back.
    """


class TieringDrainTimeout(TimeoutError):
    """Jobs were still outstanding at the deadline. A drain's stay outstanding, untouched; a
    shutdown's are those whose transfers NIXL still ran once their tiers' shutdowns had
    cancelled them: each gets its failure once NIXL is over."""

    def __init__(self, what: str, outstanding: Sequence[Submitted],
                 finalized: Sequence[Finalized], busy: Sequence[str] = ()) -> None:
        self.outstanding = tuple(outstanding)
        #: the jobs finalized before the deadline
        self.finalized = tuple(finalized)
        #: what each tier that still had work in flight said of it (its jobs' states and
        #: last errors, for kvfsm's tiers)
        self.busy = tuple(busy)
        lines = [str(job) for job in self.outstanding] + list(self.busy)
        super().__init__(f"{what}: {len(self.outstanding)} job(s) without a result\n  "
                         + "\n  ".join(lines))


# -- the primary tier ------------------------------------------------------------------------------

class CPUPrimaryTier:
    """The KV cache in host memory: blocks, their keys, reference counts, and eviction.

    A block is *free* (holds no key), or holds one key with a reference count: -1 while being
    written (allocated by :meth:`allocate`, until :meth:`complete_write`), 0 when ready, n > 0
    while n transfers read it (:meth:`pin` ... :meth:`complete_read`). :meth:`allocate` takes free
    blocks first (lowest first), then evicts ready blocks with count 0, least recently used
    first. A block being written or pinned is never evicted. A block being written that NIXL
    may go on writing after its load was given up is *retired* (:meth:`retire`, count -2): it
    holds no key and is never handed out again.

    Every method that takes blocks checks all of them before changing anything: bad input raises
    a :class:`PrimaryTierError` (a ``ValueError``) naming what was wrong, and changes nothing.

    Args:
        num_blocks: how many blocks the cache holds.
        block_shape: the shape of one block (an int for a flat block).
        dtype: the element type.
        pin_memory: allocate page-locked memory (for fast copies to a GPU); by default, when
            CUDA is available.
    """

    def __init__(
        self,
        num_blocks: int,
        block_shape: int | Sequence[int],
        dtype: torch.dtype = torch.float16,
        *,
        pin_memory: bool | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        shape = ((block_shape,) if isinstance(block_shape, numbers.Integral)
                 else tuple(block_shape) if isinstance(block_shape, Sequence) else ())
        if not shape or isinstance(block_shape, str | bytes) or any(
                isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1
                for d in shape):  # (numpy's ints are ints: torch takes them)
            raise ValueError(f"block_shape must be ints >= 1, got {block_shape!r}")
        shape = tuple(map(int, shape))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype (such as torch.float16), got "
                             f"{type(dtype).__name__} {dtype!r}")
        if pin_memory is not None and type(pin_memory) is not bool:
            raise ValueError(f"pin_memory must be True, False or None, got {pin_memory!r}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        #: the KV cache; block ``b`` is ``cache[b]``
        self.cache = torch.zeros((num_blocks, *shape), dtype=dtype, pin_memory=pin_memory)
        self.num_blocks = num_blocks
        self.block_bytes = int(self.cache[0].nbytes)
        self._counts: dict[int, int] = {}  # held blocks only: block -> reference count
        self._keys: dict[int, Key] = {}  # held blocks only: block -> key
        self._blocks: dict[Key, int] = {}  # key -> block
        self._free: list[int] = list(range(num_blocks))  # a heap: the lowest block goes first
        self._lru: OrderedDict[int, None] = OrderedDict()  # ready blocks, least recent first
        self.evictions = 0

    # -- what blocks hold ----------------------------------------------------------------------

    def pin_count(self, block_id: int) -> int:
        """The reference count of a block: -1 being written, 0 ready (or free), n > 0 read by n,
        -2 retired.

        Raises:
            UnknownBlockError: not a block of this cache.
        """
        return self._counts.get(self._block_id(block_id), 0)

    def key_of(self, block_id: int) -> Key | None:
        """The key a block holds, or None when it is free or retired.

        Raises:
            UnknownBlockError: not a block of this cache.
        """
        return self._keys.get(self._block_id(block_id))

    def block_of(self, key: Key) -> int | None:
        """The block holding ``key`` (being written, ready or pinned), or None.

        Raises:
            PrimaryTierError: ``key`` is not a non-empty str or bytes (so a typo such as a list
                is not taken for a key nobody holds).
        """
        if not isinstance(key, str | bytes) or not key:
            raise PrimaryTierError(f"a key must be a non-empty str or bytes, got {key!r}")
        return self._blocks.get(key)

    def is_ready(self, block_id: int) -> bool:
        """True when a block holds a key and is not being written."""
        return self._counts.get(self._block_id(block_id), WRITING) >= 0

    @property
    def free_blocks(self) -> int:
        """Blocks that hold no key."""
        return len(self._free)

    def evictable(self) -> list[int]:
        """The blocks :meth:`allocate` may evict (ready, count 0), least recently used first."""
        counts = self._counts
        return [block for block in self._lru if counts[block] == 0]

    def stats(self) -> dict[str, int]:
        """How many blocks are free, being written, ready, pinned, retired; evictions so far."""
        counts = list(self._counts.values())
        return {
            "free": len(self._free),
            "writing": counts.count(WRITING),
            "ready": counts.count(0),
            "pinned": sum(1 for count in counts if count > 0),
            "retired": counts.count(RETIRED),
            "evictions": self.evictions,
        }

    def check_new_keys(self, keys: Sequence[Key]) -> tuple[Key, ...]:
        """Check that ``keys`` may be allocated: non-empty str or bytes, distinct, not held.

        Raises:
            PrimaryTierError: ``keys`` is not a list or tuple, or a key is malformed.
            DuplicateKeyError: a key appears twice, or a block already holds it.
        """
        if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
            raise PrimaryTierError(f"keys must be a list or tuple, got "
                                   f"{type(keys).__name__} {keys!r}")
        checked = tuple(keys)
        seen: set[Key] = set()
        for index, key in enumerate(checked):
            if not isinstance(key, str | bytes) or not key:
                raise PrimaryTierError(f"keys[{index}] must be a non-empty str or bytes, "
                                       f"got {key!r}")
            if key in seen:
                raise DuplicateKeyError(f"key {key!r} appears twice")
            seen.add(key)
            held = self._blocks.get(key)
            if held is not None:
                raise DuplicateKeyError(f"key {key!r} is already held by block {held} "
                                        f"({self._describe(held)})")
        return checked

    def readable_keys(self, block_ids: Iterable[int]) -> list[Key]:
        """The keys of blocks that may be pinned (ready or pinned), in order.

        Raises:
            UnknownBlockError, BlockStateError: as :meth:`pin` would.
        """
        return [self._keys[block] for block in self._check(block_ids, self._readable)]

    # -- writing -------------------------------------------------------------------------------

    def allocate(self, keys: Sequence[Key]) -> list[int]:
        """Take one block per key, to be written (count -1); evicts LRU ready blocks if needed.

        Returns:
            the blocks, in the order of ``keys``.

        Raises:
            PrimaryTierError: as :meth:`check_new_keys`.
            OutOfBlocksError: fewer free and evictable blocks than keys (nothing was evicted).
            KeyboardInterrupt: (or any interrupt) no block is taken; those evicted stay so.
        """
        checked = self.check_new_keys(keys)
        missing = len(checked) - len(self._free)
        victims: list[int] = []
        if missing > 0:  # the least recent ready blocks nobody reads, as many as it takes
            # (a walk past the pinned ones at the front only: not every block held)
            counts = self._counts
            for block in self._lru:
                if counts[block] == 0:
                    victims.append(block)
                    if len(victims) == missing:
                        break
            else:
                stats = self.stats()
                raise OutOfBlocksError(
                    f"{len(checked)} block(s) wanted, {stats['free']} free and "
                    f"{len(victims)} evictable ({stats['pinned']} pinned, {stats['writing']} "
                    f"being written, {stats['retired']} retired)")
        blocks: list[int] = []
        try:
            for block in victims:
                self._drop(block)
                self.evictions += 1
            free = self._free
            for key in checked:
                block = free[0]  # held before it leaves the free heap: a signal, handled as a
                self._counts[block] = WRITING  # C call returns or between blocks, finds it in
                self._keys[block] = key  # one or the other (no call between the two)
                self._blocks[key] = block
                heapq.heappop(free)
                blocks.append(block)
        except BaseException:  # an interrupt: the allocation is taken back whole (the blocks
            self._take_back(checked)  # it evicted stay evicted: each went whole)
            raise
        return blocks

    def complete_write(self, block_ids: Iterable[int], success: bool) -> None:
        """End the writes of blocks: ready (most recently used) on success, else freed.

        Raises:
            PrimaryTierError: ``success`` is not a bool (a truthy ``"False"`` would otherwise
                make a failed write's block ready).
            UnknownBlockError: not a block of this cache.
            BlockStateError: a block that is not being written; or the same block twice.
        """
        if not isinstance(success, bool):
            raise PrimaryTierError(f"success must be a bool, got {type(success).__name__} "
                                   f"{success!r}")
        blocks = self._check(block_ids, self._writing)
        for block in blocks:
            if success:
                self._counts[block] = 0
                self._lru[block] = None
            else:
                self._drop(block)

    def retire(self, block_ids: Iterable[int]) -> None:
        """Take blocks being written out of use for good: their keys are dropped (a key may be
        allocated again, in another block) and the blocks are never handed out again. For a
        load given up while NIXL still ran it (:attr:`kvfsm.transfer.JobResult.blocks_in_use`):
        NIXL may write them at any time from now on.

        Raises:
            UnknownBlockError: not a block of this cache.
            BlockStateError: a block that is not being written; or the same block twice.
        """
        blocks = self._check(block_ids, self._writing)
        counts, keys, held = self._counts, self._keys, self._blocks
        for block in blocks:  # (no call within a block's change: an interrupt between two
            key = keys[block]  # blocks leaves the rest being written, never handed out)
            del held[key]
            del keys[block]
            counts[block] = RETIRED

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop the keys of ready blocks nobody reads (count 0), making the blocks free.

        Raises:
            UnknownBlockError: not a block of this cache.
            BlockStateError: a block that is free, being written or pinned; or the same block
                twice.
        """
        for block in self._check(block_ids, self._idle):
            self._drop(block)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Mark ready blocks as just used, so eviction takes them last.

        Raises:
            UnknownBlockError, BlockStateError: as :meth:`pin` would.
        """
        for block in self._check(block_ids, self._readable):
            self._lru.move_to_end(block)

    # -- reading -------------------------------------------------------------------------------

    def pin(self, block_ids: Iterable[int]) -> None:
        """Count one more transfer reading each block; pinned blocks are never evicted.

        Raises:
            UnknownBlockError: not a block of this cache.
            BlockStateError: a block that is free or being written; or the same block twice.
        """
        counts = self._counts
        before = {block: counts[block] for block in self._check(block_ids, self._readable)}
        counted = {block: count + 1 for block, count in before.items()}
        try:
            counts.update(counted)  # (one call: every block or none)
        except BaseException:  # an interrupt as it returned: a pin that raises pins nothing
            if counted.items() <= counts.items():  # (compared in C: no signal handled)
                counts.update(before)
            raise

    def complete_read(self, block_ids: Iterable[int]) -> None:
        """Drop one pin of each block (a transfer finished reading it, well or not).

        Raises:
            UnknownBlockError: not a block of this cache.
            BlockStateError: a block that is not pinned; or the same block twice.
        """
        counts = self._counts
        counted = {block: counts[block] - 1 for block in self._check(block_ids, self._pinned)}
        counts.update(counted)  # (one call: an interrupt unpins every block or none)

    # -- internals -----------------------------------------------------------------------------

    def _block_id(self, block_id: object) -> int:
        if isinstance(block_id, bool):
            raise UnknownBlockError(f"block id {block_id!r} is not an int")
        try:
            value = operator.index(block_id)  # type: ignore[arg-type]
        except TypeError:
            raise UnknownBlockError(f"block id {block_id!r} is not an int") from None
        if not 0 <= value < self.num_blocks:
            raise UnknownBlockError(f"block {value} is out of range [0, {self.num_blocks})")
        return value

    def _check(self, block_ids: Iterable[int],
               wanted: Callable[[int], str | None]) -> list[int]:
        """Every block valid, distinct and in the wanted state, or an error and no change."""
        if isinstance(block_ids, str | bytes) or not isinstance(block_ids, Iterable):
            raise UnknownBlockError(f"block ids must be a list or tuple of ints, got "
                                    f"{type(block_ids).__name__} {block_ids!r}")
        blocks = [self._block_id(block) for block in block_ids]
        seen: set[int] = set()
        for block in blocks:
            if block in seen:
                raise BlockStateError(f"block {block} appears twice")
            seen.add(block)
            problem = wanted(block)
            if problem is not None:
                raise BlockStateError(f"block {block} {problem} ({self._describe(block)})")
        return blocks

    def _readable(self, block: int) -> str | None:
        return None if self._counts.get(block, WRITING) >= 0 else "is not readable"

    def _writing(self, block: int) -> str | None:
        return None if self._counts.get(block) == WRITING else "is not being written"

    def _pinned(self, block: int) -> str | None:
        return None if self._counts.get(block, 0) > 0 else "is not pinned"

    def _idle(self, block: int) -> str | None:
        return None if self._counts.get(block) == 0 else "cannot be freed"

    def _describe(self, block: int) -> str:
        count = self._counts.get(block)
        if count is None:
            return "it is free"
        if count == RETIRED:
            return "it is retired: NIXL may still write it"
        key = self._keys[block]
        if count == WRITING:
            return f"it is being written with key {key!r}"
        if count == 0:
            return f"it is ready with key {key!r}"
        return f"it holds key {key!r}, pinned by {count}"

    def _drop(self, block: int) -> None:
        # no call before the block is free: a signal is handled as a C call returns
        key = self._keys[block]
        del self._blocks[key]
        del self._keys[block]
        del self._counts[block]
        if block in self._lru:
            del self._lru[block]
        heapq.heappush(self._free, block)

    def _take_back(self, keys: Sequence[Key]) -> None:
        """Undo what an interrupted :meth:`allocate` held of ``keys`` (none was held before
        it): each block taken is free again. (A second interrupt here stops it part way.)"""
        held = self._blocks
        for key in keys:
            if key in held:
                block = held[key]
                del held[key]
                del self._keys[block]
                del self._counts[block]
                if block not in self._free:  # (taken off the heap: the last step of a block)
                    heapq.heappush(self._free, block)


# -- the manager -----------------------------------------------------------------------------------

@runtime_checkable
class OffloadTier(Protocol):
    """What :class:`TieringManager` needs of a secondary tier: the offload-manager contract.

    :class:`kvfsm.tiers.ObjectStoreTier` and :class:`kvfsm.tiers.FileTier` have it; so may a
    user's own tier. Every call must return quickly. A submit either accepts the job, which
    then has exactly one result from :meth:`get_finished_jobs`, or raises having taken nothing
    (a ``ValueError`` when the job itself is malformed). The manager drains a tier by stepping
    it, so ``drain_jobs`` is not needed here.

    A tier may also have ``remote_name(key) -> str``, as kvfsm's tiers do: the name it stores a
    block under, raising ``ValueError`` for a key it cannot name. The manager then checks every
    job's keys with it before changing anything (a load's allocation may evict blocks, which
    cannot be undone when the tier refuses the job afterwards). And it may have
    ``owes(job_id) -> bool``, as kvfsm's tiers do: whether a result for the job is still to
    come. After a submit that an interrupt (``KeyboardInterrupt``) cut short, the manager keeps
    a job its tier owes, with its pins or its allocated blocks, until the result comes: NIXL may
    be moving those blocks. A tier without it took nothing when its submit raised.
    """

    def submit_store(self, job: TransferJob) -> None:
        """Copy the job's (pinned) primary blocks out to the tier; the result comes later."""

    def submit_load(self, job: TransferJob) -> None:
        """Fill the job's (allocated) primary blocks from the tier; the result comes later."""

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every result since the last call: exactly one per submitted job, ever."""

    def has_pending_work(self) -> bool:
        """True while a submitted job has no result handed out yet."""

    def lookup(self, key: bytes | str) -> Lookup:
        """HIT, MISS, or RETRY (ask again later); never blocks."""

    def shutdown(self) -> None:
        """Release everything; idempotent. (One that takes ``timeout``, as kvfsm's tiers do, is
        given what is left of :meth:`TieringManager.shutdown`'s.)"""


def _forget(tier: OffloadTier, name: str, keys: Sequence[Key]) -> None:
    """A store skipped ``tier`` (or it refused its job): it forgets ``keys``, so a copy it
    holds from before the blocks were written again is not loaded as theirs. A tier without
    ``forget`` keeps what it knew; one whose ``forget`` raises is logged, and the store goes
    on to the other tiers (the jobs they took are the caller's to see)."""
    forget = getattr(tier, "forget", None)
    if forget is None:
        return
    try:
        forget(keys)
    except Exception:
        logger.exception("tier %s: forget() raised after its store was skipped; a copy it held "
                         "under these keys may be loaded as theirs, unless the tier then vouches "
                         "for no key (kvfsm's tiers do: stats()['distrusted'])", name)


def _took(tier: OffloadTier, job_id: int) -> bool:
    """Whether ``tier`` took the job of a submit an interrupt cut short (NIXL may be moving
    its blocks): its ``owes`` says, if it has one (kvfsm's tiers do). An ``owes`` that raises
    says nothing: the job is kept (its blocks are not reused under a transfer that may run).
    Without one, the submit that raised is taken to have taken nothing, and a warning says
    the manager could not tell."""
    owes = getattr(tier, "owes", None)
    if owes is None:
        logger.warning("job %d: an interrupt cut its submit short, and the tier has no owes() "
                       "to say whether it took the job; its pins or blocks are taken back, so "
                       "a tier that did take it may move them while they are reused", job_id)
        return False
    try:
        return bool(owes(job_id))
    except Exception:
        logger.exception("job %d: an interrupt cut its submit short, and the tier's owes() "
                         "raised; the job is kept, its pins or blocks held until its result",
                         job_id)
        return True


_CONTRACT = ("submit_store", "submit_load", "get_finished_jobs", "has_pending_work", "lookup",
             "shutdown")


@dataclass(frozen=True, slots=True)
class Submitted:
    """A job the manager handed to a tier and has no result for yet."""

    job: TransferJob
    tier: str

    @property
    def job_id(self) -> int:
        """The job's id."""
        return self.job.job_id

    def __str__(self) -> str:
        kind = "load" if self.job.is_promotion else "store"
        return (f"job {self.job.job_id}: {kind} of blocks {list(self.job.block_ids)} "
                f"on tier {self.tier!r}")


@dataclass(frozen=True, slots=True)
class Finalized:
    """A job whose result arrived and whose primary blocks were finalized; a failed one says
    why (:attr:`kvfsm.transfer.JobResult.reason`, when its tier gave one), and whether its
    blocks were kept out of use for good because NIXL may still move them
    (:attr:`kvfsm.transfer.JobResult.blocks_in_use`: a store's pins kept, a load's blocks
    retired)."""

    job: TransferJob
    tier: str
    success: bool
    reason: FailureReason | None = None
    blocks_in_use: bool = False

    @property
    def job_id(self) -> int:
        """The job's id."""
        return self.job.job_id


class TieringManager:
    """Runs stores and loads between a :class:`CPUPrimaryTier` and secondary tiers.

    * :meth:`store` cascades ready primary blocks to every secondary tier: one job per tier,
      each pinning the blocks before its submit; each job's result drops its pin, whether the
      store succeeded or not.
    * :meth:`load` promotes keys from a tier that holds them (its ``lookup`` says HIT): it
      allocates blocks being written and submits one job; the result makes the blocks readable,
      or frees them when the load failed.
    * A failed result whose ``blocks_in_use`` is True (its transfer was given up while NIXL
      still ran it: :attr:`~kvfsm.policy.RetryPolicy.max_running_seconds`) says NIXL may go on
      reading or writing the job's blocks: a store's pins stay, so the block is never
      evicted or written again and whatever NIXL copies from it is its bytes; a load's blocks
      are retired (:meth:`CPUPrimaryTier.retire`: their keys may be loaded again elsewhere,
      the blocks never handed out). :meth:`stats` counts them (``blocks_held``).
    * :meth:`step` collects results from every tier once and finalizes each job exactly once.

    Job ids are the manager's, unique across its tiers. The books are checked on every result: a
    result for a job id the manager does not have outstanding on that tier (never submitted,
    already finalized, or submitted to another tier) is a :class:`BookkeepingError` naming the
    job id and the tier, raised by :meth:`step` once everything else was finalized, and kept in
    :attr:`bookkeeping_errors`; it is never dropped silently.

    Bad input to the manager (unknown or unready blocks, keys already held, a key a tier cannot
    name or two keys it names alike, an unknown tier) raises a ``ValueError`` naming what was
    wrong before anything changed: no block is evicted, allocated or pinned, no job id is used
    and no tier sees a job. Only then are blocks allocated (evicting if need be) or pinned.

    Keys are str or bytes. Where a tier names a bytes key as the str key of its hex, as kvfsm's
    file and object tiers do (``b"k"`` as ``"6b"``), the primary holds the two apart and the
    tier in one place, so once both were stored a load of one would publish the other's bytes.
    Such a manager therefore refuses a bytes key beside a str key of its length that is hex
    (in one call, or once it stored or loaded one of them, in any later call), naming it (a
    :class:`TieringInputError`). Other str keys go with either.

    When a tier's submit raises all the same (the tier refused the job: it is shut down, or it
    found the job malformed in a way the manager could not check), the manager takes back what
    it did for that job (drops its pins, frees a load's blocks), forgets its id, and raises
    :class:`TierSubmitError` naming the tier and job id; a store still cascades to the other
    tiers first. When every tier refused with a ``ValueError`` and none took a job, that is a
    :class:`TierInputRefusedError`, a ``ValueError`` too. An interrupt that cuts a submit short
    once the tier took the job (its ``owes`` says so, see :class:`OffloadTier`) leaves the job
    outstanding, its pins or blocks held until its result comes, and is raised as it is.

    Args:
        primary: the primary tier; every secondary tier must copy to and from ``primary.cache``.
        secondaries: the secondary tiers in order of preference for loads, as a sequence (named
            ``"ObjectStoreTier[0]"`` etc.) or a mapping of names to tiers.
        poll_interval: seconds :meth:`drain` sleeps between steps (a number >= 0).
    """

    def __init__(
        self,
        primary: CPUPrimaryTier,
        secondaries: Sequence[OffloadTier] | Mapping[str, OffloadTier],
        *,
        poll_interval: float = 0.0005,
    ) -> None:
        if not isinstance(primary, CPUPrimaryTier):
            raise TypeError(f"primary must be a CPUPrimaryTier, got {type(primary).__name__}")
        # checked now: time.sleep would refuse it only in drain, after a step had finalized jobs
        try:
            poll_interval = check_interval("poll_interval", poll_interval)
        except ValueError as error:
            raise TieringInputError(str(error)) from None
        if isinstance(secondaries, Mapping):
            named = dict(secondaries)
        elif isinstance(secondaries, str | bytes) or not isinstance(secondaries, Iterable):
            raise TieringInputError(f"secondaries must be a list of tiers or a dict of names to "
                                    f"tiers, got {type(secondaries).__name__}")
        else:
            named = {f"{type(tier).__name__}[{index}]": tier
                     for index, tier in enumerate(secondaries)}
        if not named:
            raise TieringInputError("a TieringManager needs at least one secondary tier")
        seen: dict[int, str] = {}
        for name, tier in named.items():
            if not isinstance(name, str) or not name:
                raise TieringInputError(f"tier names must be non-empty str, got {name!r}")
            missing = [call for call in _CONTRACT if not callable(getattr(tier, call, None))]
            if missing:
                raise TypeError(f"tier {name!r} ({type(tier).__name__}) lacks the secondary-tier "
                                f"contract: no {', '.join(missing)}")
            if id(tier) in seen:
                raise TieringInputError(f"tiers {seen[id(tier)]!r} and {name!r} are the same "
                                        "object")
            seen[id(tier)] = name
            _check_same_cache(name, tier, primary.cache)
        self.primary = primary
        self.poll_interval = poll_interval
        self._tiers: dict[str, OffloadTier] = named
        self._jobs: dict[int, Submitted] = {}
        #: results taken from the tiers and not yet finalized (a step an interrupt cut short
        #: leaves them to the next)
        self._taken: collections.deque[tuple[str, JobResult]] = collections.deque()
        #: jobs finalized since a step last returned them
        self._done: list[Finalized] = []
        #: by tier, what it handed out that a Ctrl-C kept from being queued: the next step
        #: queues it (:meth:`_step`)
        self._unqueued: dict[str, Any] = {}
        #: the queue entry (tier, result) being finalized, or last finalized: marked as its
        #: Finalized and issues are kept, so a step an interrupt cut short skips it
        self._finalizing: tuple[str, JobResult] | None = None
        self._ids = itertools.count(1)
        self._closed = False
        #: a shutdown began shutting the tiers down: no new job (its tiers refuse them)
        self._closing = False
        #: every bookkeeping issue found so far (each was raised once, by step); and those
        #: found since a step last raised them (a step an interrupt cut short leaves them)
        self.bookkeeping_errors: list[BookkeepingIssue] = []
        self._issues: list[BookkeepingIssue] = []
        self._counts = {"stores_ok": 0, "stores_failed": 0, "loads_ok": 0, "loads_failed": 0,
                        "blocks_held": 0}
        #: stores not cascaded to a saturated or busy tier, per tier
        self._skipped = dict.fromkeys(named, 0)
        self._block_bytes = int(primary.cache[0].nbytes)
        #: the tiers that name a bytes key as the str key of its hex (kvfsm's file and object
        #: tiers: ``b"k"`` as ``"6b"``); with any, the manager keeps such keys apart
        #: (:meth:`_check_kind`)
        self._hex_named = [name for name, tier in named.items() if _names_bytes_as_hex(tier)]
        #: the kinds of key that could share a name the manager has stored or loaded, with
        #: their length in bytes: bytes, and str keys that are the hex of some (_check_kind)
        self._kinds: set[tuple[type, int]] = set()

    @property
    def tiers(self) -> Mapping[str, OffloadTier]:
        """The secondary tiers by name, in order of preference for loads."""
        return dict(self._tiers)

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` shut every tier down."""
        return self._closed

    # -- submitting ------------------------------------------------------------------------------

    def store(self, block_ids: Sequence[int]) -> list[int]:
        """Copy ready primary blocks to every secondary tier: one job per tier.

        A tier that only loads (its ``read_only`` is True: a :class:`~kvfsm.tiers.FileTier`
        over a directory other engines store to) gets no job, and is not counted as skipped;
        it forgets the keys, as a tier skipped does (an engine that wrote new bytes under a
        key another engine stored there must not load that engine's copy as them). A tier
        that says it is saturated (its ``saturated(nbytes)``, when it has one, answers
        True: kvfsm's tiers past their :class:`~kvfsm.policy.InFlightLimit`) is skipped: no
        job, no pin, counted in :meth:`stats` as ``stores_skipped``; so is a tier whose submit
        refuses the job as busy (:class:`~kvfsm.tiers.TierBusyError`: saturated since it was
        asked, or a delete of one of the blocks in flight). A tier skipped, or one that
        refused its job, forgets the keys (its ``forget``, when it has one): an older copy it
        holds under a key written again since is not loaded as these blocks' bytes.

        Returns:
            the job ids, one per tier that took the job, in tier order (empty when every tier
            was saturated, busy or read-only).

        Raises:
            ManagerClosedError: after :meth:`shutdown`, or one that did not finish.
            TieringInputError: no blocks; a block whose key a tier cannot name, or two whose
                keys it names alike; nothing was pinned or submitted.
            UnknownBlockError, BlockStateError: a block that is unknown, free or being written;
                nothing was pinned or submitted.
            TierInputRefusedError: every tier refused its job as malformed; nothing changed.
            TierSubmitError: a tier refused its job (see the class docstring).
        """
        self._check_open()
        listed = _block_list(block_ids)
        keys = self.primary.readable_keys(listed)  # checks before any change
        kinds = self._check_names(keys, self._tiers)  # every tier gets every key
        blocks = [operator.index(block) for block in listed]
        submitted: list[int] = []
        refusals: list[tuple[str, int, BaseException]] = []
        try:
            self._cascade(blocks, keys, kinds, submitted, refusals)
        except BaseException as error:  # an interrupt, or a tier's call that raised, left
            # the cascade: every tier without its job forgets the keys, as a tier skipped does
            # (the ones not reached yet would otherwise vouch for an older copy of them)
            took = {job.tier for job in map(self._jobs.get, submitted) if job is not None}
            going: BaseException = error
            for name, tier in self._tiers.items():
                if name not in took:
                    try:  # (_forget logs an Exception: what comes here is an interrupt)
                        _forget(tier, name, keys)
                    except BaseException as late:  # it goes on after the others forgot, if
                        if isinstance(going, Exception):  # what left was an error; an
                            going = late  # interrupt that left stays the one that goes on
            if going is error:
                raise
            raise going from error
        if refusals:
            raise _refused(refusals, submitted) from refusals[0][2]
        return submitted

    def _cascade(self, blocks: list[int], keys: Sequence[Key], kinds: dict[tuple[type, int], int],
                 submitted: list[int], refusals: list[tuple[str, int, BaseException]]) -> None:
        """:meth:`store`'s job for each tier in turn, noting each job taken (``submitted``,
        the one an interrupt cut short included) and each refusal as it comes."""
        nbytes = len(blocks) * self._block_bytes
        for name, tier in self._tiers.items():
            if getattr(tier, "read_only", False) is True:  # it only loads what others store:
                _forget(tier, name, keys)  # no job; what it holds is not these blocks' bytes
                continue
            saturated = getattr(tier, "saturated", None)
            if saturated is not None and saturated(nbytes):  # back-pressure: no job, no pin
                self._skipped[name] += 1
                _forget(tier, name, keys)
                continue
            job = TransferJob(next(self._ids), list(keys), list(blocks))
            self._jobs[job.job_id] = Submitted(job, name)
            pinned = False
            try:
                self.primary.pin(blocks)
                pinned = True
                tier.submit_store(job)
            except BaseException as error:
                if pinned and not isinstance(error, Exception) and _took(tier, job.job_id):
                    submitted.append(job.job_id)
                    self._took_kinds(kinds)
                    raise  # an interrupt once the tier took the job: it keeps its pin
                del self._jobs[job.job_id]
                if not pinned:  # the pin failed, or an interrupt came before it: no tier's
                    raise  # doing, and nothing pinned (pin changes nothing when it raises)
                self.primary.complete_read(blocks)
                if not isinstance(error, Exception):
                    raise
                _forget(tier, name, keys)
                if isinstance(error, TierBusyError):  # saturated since it was asked, or
                    # removing one of the blocks: nothing registered, a later store is taken
                    self._skipped[name] += 1
                    continue
                refusals.append((name, job.job_id, error))
                continue
            submitted.append(job.job_id)
            self._took_kinds(kinds)  # (at once: an interrupt may follow)

    def find(self, keys: Sequence[Key]) -> str | None:
        """The first tier whose ``lookup`` answers HIT for every key, or None (yet).

        Raises:
            TieringInputError: ``keys`` is not a non-empty list or tuple of non-empty str or
                bytes (an empty one would be "found" in the first tier, a str looked up letter
                by letter), or a tier cannot name a key; no tier was asked.
        """
        checked = _key_list(keys, "find")
        self._check_names(checked, self._tiers, distinct=False)
        return self._find(checked)

    def lookup(self, key: Key) -> Lookup:
        """Across the secondary tiers: HIT if one holds ``key``, RETRY if one does not know yet,
        else MISS.

        Raises:
            TieringInputError: ``key`` is not a non-empty str or bytes, or a tier cannot name
                it; no tier was asked.
        """
        if not isinstance(key, str | bytes) or not key:
            raise TieringInputError(f"lookup: a key must be a non-empty str or bytes, got "
                                    f"{key!r}")
        self._check_names((key,), self._tiers, distinct=False)
        answers = {tier.lookup(key) for tier in self._tiers.values()}
        for answer in (Lookup.HIT, Lookup.RETRY):
            if answer in answers:
                return answer
        return Lookup.MISS

    def load(self, keys: Sequence[Key], *, tier: str | None = None) -> int | None:
        """Promote ``keys`` into newly allocated primary blocks, from one tier.

        Args:
            keys: the blocks to load; none may be held by the primary tier, and the tier loaded
                from (every tier, when ``tier`` is None) must name each one, no two alike.
            tier: the tier to load from; by default the first that answers HIT for every key.
                One named here is not asked: it loads what it holds under the keys, but for
                a key it was made to forget (a store the manager skipped or that failed): the
                job then fails, its result's reason a :class:`~kvfsm.tiers.ForgottenKeyError`.

        Returns:
            the job id; or None, with nothing changed, when no tier answers HIT for every key
            (some may answer RETRY: ask again on a later step, or see :meth:`lookup`).

        Raises:
            ManagerClosedError: after :meth:`shutdown`, or one that did not finish.
            TieringInputError: no keys, an unknown tier name, a key the tier cannot name or two
                it names alike; nothing was evicted or allocated.
            PrimaryTierError: a malformed key, or one the primary tier already holds.
            OutOfBlocksError: not enough free or evictable blocks (nothing was evicted).
            TierInputRefusedError: the tier refused the job as malformed all the same; its
                blocks were freed (what their allocation evicted stays evicted).
            TierSubmitError: the tier refused the job; its blocks were freed.
        """
        self._check_open()
        checked = self.primary.check_new_keys(keys)
        if not checked:
            raise TieringInputError("a load needs at least one key")
        if tier is None:
            kinds = self._check_names(checked, self._tiers)  # before any lookup: each may raise
            tier = self._find(checked)
            if tier is None:
                return None
        elif not isinstance(tier, str) or tier not in self._tiers:
            raise TieringInputError(f"no tier named {tier!r}; tiers: {list(self._tiers)}")
        else:
            kinds = self._check_names(checked, (tier,))
        # everything is checked: the allocation is the first change, and may evict
        blocks: list[int] | None = None
        job: TransferJob | None = None
        try:
            blocks = self.primary.allocate(checked)
            job = TransferJob(next(self._ids), list(checked), blocks, is_promotion=True)
            self._jobs[job.job_id] = Submitted(job, tier)
            self._tiers[tier].submit_load(job)
            self._took_kinds(kinds)
        except BaseException as error:
            if blocks is None:  # allocate raised (having changed nothing), or an interrupt
                raise  # came before it or in it (which took its allocation back)
            if (job is not None and not isinstance(error, Exception)
                    and _took(self._tiers[tier], job.job_id)):
                self._took_kinds(kinds)
                raise  # an interrupt once the tier took the job: its blocks wait for it
            if job is not None:
                self._jobs.pop(job.job_id, None)
            self.primary.complete_write(blocks, success=False)
            if job is None or not isinstance(error, Exception):
                raise
            raise _refused([(tier, job.job_id, error)], []) from error
        return job.job_id

    # -- results ---------------------------------------------------------------------------------

    def step(self) -> list[Finalized]:
        """Collect results from every tier once; finalize each job's primary blocks.

        Returns:
            the jobs finalized, in the order their results came.

        Raises:
            BookkeepingError: a result matched no job outstanding on its tier, or a tier's
                ``get_finished_jobs`` raised; every other result was finalized first (they are
                in the error's ``finalized``).
        """
        return self._step(None, draining=False)

    def _step(self, deadline: float | None, *, draining: bool) -> list[Finalized]:
        """:meth:`step`; or (``draining``) a step of :meth:`drain`: each kvfsm tier makes a
        drain's poll on this thread (every running transfer checked, as its ``drain_jobs``
        does, a progress thread or not: the caller is waiting), its lock waited for until
        ``deadline`` at most (None: as long as it takes), past which it hands out only what
        it had published.

        A tier hands each result out once, so every result is queued as it comes
        (:attr:`_taken`) and leaves the queue as it is finalized, and every job finalized is
        kept (:attr:`_done`) until a step returns it: an interrupt in a step loses neither
        the results not yet finalized nor the jobs finalized, the next step goes on with
        them, and a result whose finalizing had begun (:attr:`_finalizing`) is not finalized
        twice. What is left of a hand-out an interrupt caught before it was queued whole (one
        landing as its ``zip`` returns, or in the tier's code as its items are taken) is kept
        (:attr:`_unqueued`), and queued by the next step before it polls that tier. (A
        generator an interrupt went through keeps nothing: what it held is lost, as when it
        raises.) (One window stays: a result is marked
        finalized, and its Finalized kept, before its primary call (``complete_read``,
        ``complete_write``, a held load's ``retire``, a held store's check of its pins), so a
        Ctrl-C from the marking until that call's change is made leaves that one job's blocks
        pinned or being written, never unpinned or completed twice; and a Ctrl-C there keeps
        no issue of that call.)"""
        issues = self._issues
        taken = self._taken
        unqueued = self._unqueued
        for name, tier in self._tiers.items():
            kept: Any = unqueued.get(name)  # (what a Ctrl-C kept from being queued)
            for polling in (False, True):  # what was kept first, then the tier's poll
                if not polling and kept is None:
                    continue
                got: Any = None
                left: Any = None
                try:  # (queued in one call, each as it comes: a generator that raises keeps
                    # those before, and a Ctrl-C does not land between two of a list's)
                    if polling:
                        got = (tier._drain_poll(deadline)
                               if draining and isinstance(tier, JobSide)
                               else tier.get_finished_jobs())
                    else:
                        got = kept
                        del unqueued[name]
                    left = iter(got)  # (where it stopped says what is left)
                    taken.extend(zip(itertools.repeat(name), left))
                except Exception as error:
                    issues.append(BookkeepingIssue(
                        None, name, f"get_finished_jobs raised {type(error).__name__}: {error}"))
                except BaseException:  # a Ctrl-C as a call returned, or in the tier's code as
                    # its items were taken: what is left of the hand-out is kept, untouched (no
                    # code of the tier's runs while the Ctrl-C waits), for the next step
                    if left is None:  # (no call before it is kept: a second Ctrl-C lands
                        left = got  # after; before the iterator, nothing was queued)
                    if left is not None:
                        unqueued[name] = left
                    raise
            while taken:
                self._finalize(taken[0], self._done)  # (its issues kept in _issues)
                taken.popleft()
                self._finalizing = None  # (the same result handed out again is an issue)
        if issues:  # the error made first: from there on, no signal is checked until raised
            raised = BookkeepingError(issues, self._done)
            self._done, self._issues = [], []
            self.bookkeeping_errors += issues
            raise raised
        done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        """True while a job has no result, or a tier still has work in flight."""
        return (bool(self._jobs) or bool(self._taken) or bool(self._done)
                or bool(self._unqueued)
                or any(tier.has_pending_work() for tier in self._tiers.values()))

    def _busy(self) -> list[str]:
        """A line for each tier with work in flight: its unpublished jobs' states and last
        errors (a kvfsm tier's), those of the manager's own or another caller's alike."""
        lines = []
        for name, tier in self._tiers.items():
            if not tier.has_pending_work():
                continue
            busy = f"tier {name!r} has work in flight"
            if not isinstance(tier, JobSide):  # (a user's tier says no more)
                lines.append(busy)
                continue
            records = tier.unpublished()
            if not records:
                lines.append(f"{busy} (results not yet handed out)")
                continue
            said = "; ".join(f"job {r.job_id}: {r.state.name}, last error: {r.error}"
                             for r in records[:8])
            more = f" and {len(records) - 8} more" if len(records) > 8 else ""
            lines.append(f"{busy}: {said}{more}")
        return lines

    def outstanding(self) -> list[Submitted]:
        """The jobs without a result, in submission order."""
        return list(self._jobs.values())

    def drain(self, timeout: float | None = None) -> list[Finalized]:
        """Step until nothing is pending; never aborts a transfer.

        Returns or raises by the deadline, or once the step under way at it is over: at most
        one poll of each tier past it (``drain(0)`` is one step), so a tier's finished jobs
        are found however short the bound. Waiting for another thread's call to let go of a
        kvfsm tier's lock counts against the deadline (past it, that tier hands out only what
        it had published). A tier of the user's own is stepped as it is: its
        ``get_finished_jobs`` keeps whatever bound it keeps.

        Returns:
            every job finalized meanwhile.

        Raises:
            TieringInputError: ``timeout`` is neither None nor a number >= 0 (NaN would never
                pass); nothing was stepped.
            TieringDrainTimeout: ``timeout`` seconds passed with jobs outstanding; they stay
                outstanding and later steps go on with them.
            BookkeepingError: as :meth:`step` (its ``finalized`` covers the whole drain).
        """
        seconds = _timeout(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        done: list[Finalized] = []
        while True:
            try:
                done += self._step(deadline, draining=True)
                if not self.has_pending_work():
                    return done
                if deadline is not None and time.monotonic() >= deadline:
                    raise TieringDrainTimeout("drain", self.outstanding(), done, self._busy())
                time.sleep(self.poll_interval if deadline is None else  # (never past it)
                           min(self.poll_interval, max(0.0, deadline - time.monotonic())))
            except BookkeepingError as error:  # (no call here: a Ctrl-C would lose it)
                error.finalized = (*done, *error.finalized)
                raise
            except TieringDrainTimeout:  # (it carries them)
                raise
            except BaseException:  # (an interrupt, as it sleeps too): the next step returns
                self._done[:0] = done  # them all the same
                raise

    def shutdown(self, timeout: float | None = 30.0) -> list[Finalized]:
        """Drain every job, then shut every tier down, each within what is left of ``timeout``
        (a tier whose ``shutdown`` takes one). Idempotent.

        Jobs still outstanding at the deadline are left to the tiers' shutdowns, as a tier's
        own ``shutdown`` would leave them: each cancels what NIXL still runs and gives up what
        is over (a release that keeps raising: one last try, then quarantined), so every such
        job gets one failure, finalized here, while a transfer NIXL still runs is waited for
        and never given up. So a shutdown returns by the deadline, plus the drain's step under
        way at it, plus what each tier's shutdown takes past it (its one last try of each
        transfer that is over, and the release of its registrations).

        Returns:
            the jobs finalized while draining and shutting down.

        Raises:
            TieringInputError: ``timeout`` as :meth:`drain`; nothing was drained or shut down.
            TieringDrainTimeout: jobs whose transfers NIXL still ran at the deadline (their
                blocks stay pinned or being written; what a tier's shutdown raised is in its
                notes and its cause); the jobs finalized before are in its ``finalized``. The
                manager takes no new job from then on (:class:`ManagerClosedError`), but
                steps, and shutdown can be called again to wait longer (each tier's
                shutdown, likewise, goes on where it left off).
            Exception: the first error a tier's shutdown raised, after every other tier was
                shut down; the manager is not closed, and takes no new job, but shutdown can
                be called again (tiers' shutdowns are idempotent), and the jobs finalized are
                returned by the next :meth:`step` or shutdown.
        """
        seconds = _timeout(timeout)
        if self._closed:
            return []
        deadline = None if seconds is None else time.monotonic() + seconds
        done: list[Finalized] = []
        drained = False
        try:
            done = self.drain(seconds)
            drained = True
        except TieringDrainTimeout as timed_out:  # the tiers' shutdowns end what they can
            done = [*timed_out.finalized]  # (no call: a Ctrl-C loses none of them)
        errors: list[Exception] = []
        timed_out_now: TieringDrainTimeout | None = None
        try:
            self._shut_tiers(deadline, errors)
            if not drained:  # the failures the tiers' shutdowns published
                done += self._step(deadline, draining=False)
                if self.has_pending_work():
                    timed_out_now = TieringDrainTimeout(
                        "shutdown", self.outstanding(), done, self._busy())
                    for error in errors:  # (what a tier's shutdown said of them)
                        timed_out_now.add_note(f"{type(error).__name__}: {error}; "
                                               + "; ".join(getattr(error, "__notes__", ())))
        except BookkeepingError as error:
            error.finalized = (*done, *error.finalized)
            raise
        except BaseException:  # (an interrupt): the next step returns them
            self._done[:0] = done
            raise
        if timed_out_now is not None:  # (it carries the jobs finalized)
            raise timed_out_now from (errors[0] if errors else None)
        if errors:  # the jobs finalized are the next step's (or shutdown's) to return
            self._done[:0] = done
            raise errors[0]
        self._closed = True
        return done

    def _shut_tiers(self, deadline: float | None, errors: list[Exception]) -> None:
        """Shut every tier down within what is left of ``deadline`` (None: no bound for the
        tier either), keeping what each raised in ``errors``; no new job from here on."""
        self._closing = True
        for name, tier in self._tiers.items():
            try:
                if not _takes_timeout(tier.shutdown):
                    tier.shutdown()
                else:
                    shutdown: Callable[..., None] = tier.shutdown
                    shutdown(timeout=None if deadline is None
                             else max(0.0, deadline - time.monotonic()))
            except Exception as error:
                error.add_note(f"raised by the shutdown of tier {name!r}")
                errors.append(error)

    def stats(self) -> dict[str, Any]:
        """Outstanding jobs per tier; stores and loads finalized, by outcome; the blocks kept
        out of use for good because NIXL may still move them (``blocks_held``: a store's pins
        kept, a load's blocks retired, counted once per job); stores not cascaded to a
        saturated tier, per tier; bookkeeping."""
        per_tier = dict.fromkeys(self._tiers, 0)
        for submitted in self._jobs.values():
            per_tier[submitted.tier] += 1
        return {"outstanding": per_tier, **self._counts,
                "stores_skipped": dict(self._skipped),
                "bookkeeping_errors": len(self.bookkeeping_errors)}

    # -- internals ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("the TieringManager is shut down")
        if self._closing:
            raise ManagerClosedError("the TieringManager is shutting down (a shutdown did not "
                                     "finish: call shutdown again)")

    def _find(self, keys: Sequence[Key]) -> str | None:
        for name, tier in self._tiers.items():
            if all(tier.lookup(key) is Lookup.HIT for key in keys):
                return name
        return None

    def _check_names(self, keys: Sequence[Key], tiers: Iterable[str], *,
                     distinct: bool = True) -> dict[tuple[type, int], int]:
        """Each tier that names its blocks (``remote_name``) can name every key, and (with
        ``distinct``) names no two alike, or a TieringInputError naming tier and keys; returns
        the keys' kinds (:meth:`_check_kind`).

        The primary tells keys apart by value, a tier by name: ``"6b"`` and ``b"k"`` are two
        keys but one object (bytes are named in hex), so such a job would be refused by the
        tier only after the manager had evicted, allocated or pinned for it.
        """
        for tier_name in tiers:
            remote_name = getattr(self._tiers[tier_name], "remote_name", None)
            if not callable(remote_name):
                continue
            seen: dict[str, int] = {}
            for index, key in enumerate(keys):
                try:
                    name = remote_name(key)
                except ValueError as error:
                    raise TieringInputError(f"tier {tier_name!r} cannot name keys[{index}] = "
                                            f"{key!r}: {error}") from None
                first = seen.setdefault(name, index) if distinct else index
                if first != index:
                    raise TieringInputError(
                        f"keys[{first}] = {keys[first]!r} and keys[{index}] = {key!r} name "
                        f"the same block {name!r} in tier {tier_name!r}")
        if self._hex_named:
            return self._check_kind(keys)
        return {}

    def _check_kind(self, keys: Sequence[Key]) -> dict[tuple[type, int], int]:
        """No bytes key beside a str key that is its hex (``b"k"`` and ``"6b"``), in this call
        or beside the keys stored or loaded before, while a tier names a bytes key as its hex:
        the primary holds the two apart, the tier in one file, so once both were stored a load
        of one would publish the other's bytes. Kept by kind and length (``"6b"`` can only be
        a 1-byte key's name): other str keys, and keys of other lengths, go with either.
        Returns the kinds seen: a store or load that a tier took remembers them
        (:meth:`_took_kinds`); one that changed nothing, or a lookup, does not."""
        kinds = self._kinds
        seen: dict[tuple[type, int], int] = {}
        for index, key in enumerate(keys):
            if isinstance(key, bytes):
                kind: tuple[type, int] = (bytes, len(key))
            elif isinstance(key, str) and _HEX_TEXT(key) is not None:
                kind = (str, len(key) // 2)
            else:
                continue
            other = (str if kind[0] is bytes else bytes, kind[1])
            if other in kinds or other in seen:
                given = (f"keys[{seen[other]}] = {keys[seen[other]]!r}" if other in seen
                         else "the " + ("bytes keys" if other[0] is bytes else "hex str keys")
                         + " of its length it stored or loaded before")
                raise TieringInputError(
                    f"keys[{index}] = {key!r} would share blocks with {given}: tier "
                    f"{self._hex_named[0]!r} names a bytes key as the str key of its hex "
                    "(b'k' as '6b'), where this manager holds them apart; give it bytes keys "
                    "or str keys that are no hex, not both")
            seen.setdefault(kind, index)
        return seen

    def _took_kinds(self, kinds: Iterable[tuple[type, int]]) -> None:
        """A tier took a store or a load of keys of these kinds (:meth:`_check_kind`)."""
        self._kinds.update(kinds)

    def _finalize(self, entry: tuple[str, JobResult], finalized: list[Finalized]) -> None:
        """Finalize one result a tier handed out (``entry``: the tier's name and the result,
        as queued): its job's Finalized kept in ``finalized``, its issues in :attr:`_issues`.
        The entry is marked (:attr:`_finalizing`) as what it leaves is kept, with no signal
        check in between (no call: in-place adds), so a step an interrupt cut short neither
        loses nor repeats it; each hand-out is an entry of its own, so a result handed out
        twice is still reported."""
        if entry is self._finalizing:
            return  # finalized by a step an interrupt cut short (see _step)
        name, result = entry
        raw_id = getattr(result, "job_id", None)
        # True == 1 and hashes alike: a bool must not finalize job 1
        job_id = raw_id if isinstance(raw_id, int) and not isinstance(raw_id, bool) else None
        submitted = None if job_id is None else self._jobs.get(job_id)
        if submitted is None or submitted.tier != name:
            stray = BookkeepingIssue(
                job_id, name, f"result {result!r} is for no outstanding job (never submitted, "
                "or already finalized)" if submitted is None
                else f"the job was submitted to tier {submitted.tier!r}")
            self._finalizing = entry
            self._issues += (stray,)
            return
        job = submitted.job
        ok, in_use, odd = _read(result)
        issue = (None if odd is None  # (the tier did finish the job: it is finalized)
                 else BookkeepingIssue(job_id, name, f"result {result!r} has {odd}"))
        reason = None if ok else getattr(result, "reason", None)
        done = Finalized(job, name, ok, reason if isinstance(reason, FailureReason) else None,
                         in_use)
        counted = f"{'loads' if job.is_promotion else 'stores'}_{'ok' if ok else 'failed'}"
        held = len(job.block_ids) if in_use else 0
        # marked finalized, and its Finalized kept, before its blocks are: an interrupt from
        # here on never has them unpinned or completed twice (nor the job lost)
        key = submitted.job_id  # (a property: read before the mark, where no call may come)
        self._finalizing = entry
        del self._jobs[key]
        self._counts[counted] += 1
        self._counts["blocks_held"] += held
        finalized += (done,)
        if issue is not None:
            self._issues += (issue,)
        try:
            if in_use:  # NIXL may still move them: a store's pins stay, a load's blocks go
                if job.is_promotion:
                    self.primary.retire(job.block_ids)
                else:  # (the pins it keeps must be there: not dropped behind its back)
                    self.primary._check(job.block_ids, self.primary._pinned)
            elif job.is_promotion:
                self.primary.complete_write(job.block_ids, ok)
            else:
                self.primary.complete_read(job.block_ids)
        except PrimaryTierError as error:  # the primary was changed behind the manager's back
            # the issue kept first, then the job taken back (each step's own: no later step
            # finalizes it again); a Ctrl-C as the issue is made reports the job finalized
            self._issues += (BookkeepingIssue(
                job_id, name, f"finalizing the primary failed: {error}" + (
                    f"; its result said blocks_in_use: NIXL may still "
                    f"{'write' if job.is_promotion else 'read'} its blocks "
                    f"{list(job.block_ids)}" if in_use else "")),)
            self._counts[counted] -= 1
            self._counts["blocks_held"] -= held
            if finalized and finalized[-1] is done:
                finalized.pop()


def _read(result: object) -> tuple[bool, bool, str | None]:
    """How the manager reads a result a tier handed out: whether the job succeeded, whether
    NIXL may still move its blocks (:func:`_in_use`), and what was odd about it and how it
    was read, or None. A job succeeded when it says ``success`` True and not that its blocks
    are in use; a ``success`` that is no bool is a failure, and said so."""
    success = getattr(result, "success", None)
    in_use, odd = _in_use(result, success)
    problems = [] if isinstance(success, bool) else [f"success={success!r}, not a bool"]
    if odd is not None:
        problems.append(odd)
    ok = success is True and not in_use
    if not problems:
        return ok, in_use, None
    if in_use:
        problems.append("its blocks held for good")
    elif odd is not None:
        problems.append("taken as False")
    if not ok and success is not False:  # (a failure of the manager's reading, not the tier's)
        problems.append("finalized as failed")
    return ok, in_use, "; ".join(problems)


def _in_use(result: object, success: object) -> tuple[bool, str | None]:
    """Whether ``result`` says NIXL may still move its job's blocks (``blocks_in_use``; a
    result without it says no), and what is wrong with how it says it, to be reported: a
    value other than True or False is read by its truth (``numpy.False_`` is False, ``1``
    True), and True on a success is taken as in use, the safe side (blocks held for good
    rather than reused under NIXL)."""
    said = getattr(result, "blocks_in_use", False)
    if said is False:
        return False, None
    if said is not True:
        try:
            truth = bool(said)
        except Exception:  # (no truth at all: the safe side)
            truth = True
        return truth, f"blocks_in_use={said!r}, not a bool"
    return True, "blocks_in_use=True on a success" if success is True else None


def _block_list(block_ids: Sequence[int]) -> list[int]:
    if isinstance(block_ids, str | bytes) or not isinstance(block_ids, Sequence):
        raise TieringInputError(f"block ids must be a list or tuple, got "
                                f"{type(block_ids).__name__} {block_ids!r}")
    if not block_ids:
        raise TieringInputError("a store needs at least one block")
    return list(block_ids)


def _key_list(keys: Sequence[Key], call: str) -> tuple[Key, ...]:
    """``keys`` as a tuple, or a TieringInputError: a non-empty list or tuple of non-empty str or
    bytes."""
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise TieringInputError(f"{call}: keys must be a list or tuple, got "
                                f"{type(keys).__name__} {keys!r}")
    checked = tuple(keys)
    if not checked:
        raise TieringInputError(f"{call} needs at least one key")
    for index, key in enumerate(checked):
        if not isinstance(key, str | bytes) or not key:
            raise TieringInputError(f"{call}: keys[{index}] must be a non-empty str or bytes, "
                                    f"got {key!r}")
    return checked


def _takes_timeout(call: Callable[..., Any]) -> bool:
    """Whether ``call`` takes a ``timeout`` argument (False when Python cannot say)."""
    try:
        return "timeout" in inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False


def _timeout(value: object) -> float | None:
    """A drain's or a shutdown's timeout in seconds; None (no bound) for None, infinity, or a
    wait longer than any the platform can make (``threading.TIMEOUT_MAX``).

    Raises:
        TieringInputError: not None nor a number >= 0 (a bool, a str, NaN, -1), naming it.
    """
    try:
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ValueError  # (the tiers take it as "at once": the manager refuses it)
        return check_timeout(value)
    except ValueError:
        raise TieringInputError(f"timeout must be a number of seconds >= 0, got {value!r}") \
            from None


def _refused(refusals: Sequence[tuple[str, int, BaseException]],
             submitted: Sequence[int]) -> TierSubmitError:
    """The error for tiers' refusals: a ValueError too when each refused the job as malformed
    and none took one, so the call changed nothing."""
    if not submitted and all(isinstance(error, ValueError) for _, _, error in refusals):
        return TierInputRefusedError(refusals, submitted)
    return TierSubmitError(refusals, submitted)


#: a str key that is the hex of some bytes key (``bytes.hex()`` writes lower case)
_HEX_TEXT = re.compile(r"(?:[0-9a-f]{2})+").fullmatch


def _names_bytes_as_hex(tier: Any) -> bool:
    """Whether ``tier`` names a bytes key as the str key of its hex (``b"k"`` as ``"6b"``)."""
    remote_name = getattr(tier, "remote_name", None)
    if not callable(remote_name):
        return False
    try:
        return bool(remote_name(b"k") == remote_name("6b"))
    except Exception:  # a tier of the user's that names neither: it cannot mix them up
        return False


def _check_same_cache(name: str, tier: object, cache: torch.Tensor) -> None:
    """A kvfsm tier (it has ``primary``) must copy to and from the manager's primary cache,
    cut into the same blocks: block ``i`` is the same bytes to both."""
    theirs = getattr(tier, "primary", None)
    if not isinstance(theirs, torch.Tensor):
        return
    if theirs.data_ptr() != cache.data_ptr() or theirs.nbytes != cache.nbytes:
        raise TieringInputError(f"tier {name!r} copies to and from another tensor than the "
                                "primary tier's cache")
    if theirs.shape[0] != cache.shape[0]:
        raise TieringInputError(
            f"tier {name!r} cuts the primary tier's cache into {theirs.shape[0]} blocks of "
            f"{theirs[0].nbytes} bytes, the primary tier into {cache.shape[0]} of "
            f"{cache[0].nbytes}: a block id would name other bytes in each")
