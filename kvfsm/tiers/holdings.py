"""What a tier holds: a capacity in bytes, least recently used blocks removed first.

A tier built with ``capacity_bytes`` keeps a :class:`Holdings`: the blocks it stored, in order
of last use, and the blocks transfers in flight read or write (pinned). A store that would take
the tier past its capacity first removes the least recently used blocks nothing pins; if too few
are free, the store is refused (:class:`TierFullError`) before anything is registered. What
counts as a use: a store, a load, a lookup answered HIT, and :meth:`Holdings.touch`. A block is
never removed while a transfer or a load uses it.

What the capacity bounds is what this tier stored while it runs: blocks found in the store by a
probe (stored by an earlier process, or another) are loaded but not counted, and never removed.

The events (what was stored and what was removed, :class:`HoldingEvent`) are kept, when asked
for, until :meth:`Holdings.take_events` hands them out.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["HoldingEvent", "Holdings", "TierFullError"]

logger = logging.getLogger("kvfsm")

#: lookups' uses noted between two calls under the tier's lock (older ones are dropped)
USES_NOTED = 4096

#: removes stored blocks by their remote names (a file tier unlinks, an object store deletes);
#: returns how many it could not remove (None: all removed)
Remove = Callable[[Sequence[str]], "int | None"]


def check_remove(remove: object, capacity_bytes: object) -> None:
    """Refuse a ``remove=`` that cannot be called, or one given without a capacity (it would
    never be called), naming it."""
    if remove is None:
        return
    if not callable(remove):
        raise ValueError(f"remove must be a function taking a list of names and returning "
                         f"how many it could not remove (or None), got {remove!r}")
    if capacity_bytes is None:
        raise ValueError("remove= is given without capacity_bytes: only a tier with a "
                         "capacity removes blocks")


def removal_failures(remove: Callable[[list[str]], int | None], names: list[str]) -> int:
    """Call ``remove`` with ``names``; how many it could not remove. What it raises, or an
    answer that is no count of them, counts them all, and is logged saying what it was."""
    try:
        answer = remove(names)
    except Exception as error:
        logger.warning("%d block(s) not removed, left where they are: the remove raised "
                       "%s: %s", len(names), type(error).__name__, error)
        return len(names)
    if answer is None:
        return 0
    if type(answer) is int and 0 <= answer <= len(names):
        return answer
    logger.error("%d block(s) counted as not removed: the remove returned %r, not how many "
                 "of them it could not remove (an int from 0 to %d, or None)", len(names),
                 answer, len(names))
    return len(names)


def check_capacity(capacity_bytes: object, block_bytes: int) -> None:
    """Refuse a ``capacity_bytes`` that is not an int of at least one block, naming it."""
    if type(capacity_bytes) is not int or capacity_bytes < block_bytes:
        raise ValueError(f"capacity_bytes must be an int of at least one block "
                         f"({block_bytes} bytes), got {capacity_bytes!r}")


class TierFullError(RuntimeError):
    """A store would take the tier past its capacity and too few stored blocks are free to
    remove (transfers in flight use them, or the store names them), or the store alone is
    larger than the capacity; nothing was registered. The message says which, counting the
    blocks in the way by what keeps each."""


@dataclass(frozen=True, slots=True)
class HoldingEvent:
    """Blocks the tier stored (``removed`` False) or removed (True), by their keys."""

    keys: tuple[Any, ...]
    removed: bool


class Holdings:
    """The blocks a tier stored, least recently used first, within ``capacity_bytes``.

    Called under the tier's lock, except :meth:`use` (a lookup's HIT, which never waits for
    that lock): it only notes the name, and the next call under the lock counts it (the last
    :data:`USES_NOTED` noted, which is all a store's eviction can tell apart anyway).

    Args:
        capacity_bytes: the most bytes of blocks the tier keeps (at least one block).
        block_bytes: the size of one block.
        remove: removes blocks by name; called with the blocks evicted, never with one a
            transfer uses. An error it raises is logged and counted (``remove_errors``),
            never raised to the caller: the block is forgotten either way.
        record_events: keep :class:`HoldingEvent` records for :meth:`take_events`.
        event_limit: the most events kept between two :meth:`take_events` calls (the oldest
            are dropped past it, and counted).
    """

    def __init__(self, capacity_bytes: int, block_bytes: int, remove: Remove, *,
                 record_events: bool = False, event_limit: int = 1 << 16) -> None:
        check_capacity(capacity_bytes, block_bytes)
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        #: how many blocks fit
        self.capacity_blocks = capacity_bytes // block_bytes
        self._remove = remove
        #: stored blocks, name -> key, least recently used first
        self._held: collections.OrderedDict[str, Any] = collections.OrderedDict()
        #: how many stores in flight write each name
        self._writers: collections.Counter[str] = collections.Counter()
        #: names being written that the tier does not hold yet (counted against the capacity)
        self._fresh: set[str] = set()
        #: how many transfers in flight use each name
        self._pins: collections.Counter[str] = collections.Counter()
        #: names a failed store may have left in place, to remove once no transfer uses them
        self._owed: set[str] = set()
        #: names lookups found, not yet counted as used (appending is safe from any thread)
        self._used: collections.deque[str] = collections.deque(maxlen=USES_NOTED)
        self.record_events = record_events
        self._events: collections.deque[HoldingEvent] = collections.deque(maxlen=event_limit)
        self._lock = threading.Lock()  # between the tier's thread and take_events
        self.removed = 0
        self.remove_errors = 0
        self.events_dropped = 0

    # -- a transfer's part -------------------------------------------------------------------

    def reserve(self, names: Sequence[str], keys: Sequence[Any]) -> None:
        """Make room for a store of ``names`` and pin them; removes the least recently used
        free blocks it needs to.

        Raises:
            TierFullError: too few blocks are free to make room, or ``names`` alone are more
                than the capacity; nothing changed.
        """
        self._count_uses()
        held, writers, fresh = self._held, self._writers, self._fresh
        new = {name for name in names if name not in held and name not in writers}
        over = len(held) + len(fresh) + len(new) - self.capacity_blocks
        victims: list[str] = []
        if over > 0:
            pins, wanted = self._pins, set(names)
            for name in held:
                if not pins[name] and name not in wanted:
                    victims.append(name)
                    if len(victims) == over:
                        break
            if len(victims) < over:
                raise TierFullError(self._why_full(names, over, len(victims)))
        pins = self._pins
        for name in names:
            pins[name] += 1
            writers[name] += 1
        fresh |= new
        if victims:
            self._evict(victims)

    def _why_full(self, names: Sequence[str], over: int, free: int) -> str:
        """Why a store of ``names`` is refused: it is larger than the whole capacity, or which
        of the blocks counted against the capacity cannot be removed, and why."""
        size = (f"capacity_bytes={self.capacity_bytes} ({self.capacity_blocks} "
                f"block{'' if self.capacity_blocks == 1 else 's'})")
        if len(names) > self.capacity_blocks:
            return (f"a store of {len(names)} block(s) ({len(names) * self.block_bytes} bytes) "
                    f"is larger than {size}: it can never be stored")
        held, writers, pins, wanted = self._held, self._writers, self._pins, set(names)
        rewritten = sum(1 for name in held if writers[name])
        read = sum(1 for name in held if pins[name] and not writers[name])
        kept = sum(1 for name in held if name in wanted and not pins[name])
        parts = [f"{count} {what}" for count, what in (
            (len(self._fresh), "being written by stores in flight, not stored yet"),
            (rewritten, "stored and being written again"),
            (read, "stored and being read"),
            (kept, "stored and named by this store"),
        ) if count]
        return (f"a store of {len(names)} block(s) needs {over} block(s) removed to stay "
                f"within {size}, and only {free} can be: of the {len(held) + len(self._fresh)} "
                f"block(s) counted, {', '.join(parts)}")

    def pin(self, names: Iterable[str]) -> None:
        """A load of ``names`` starts: they count as used, and are not removed until it ends."""
        self._count_uses()
        pins, held = self._pins, self._held
        for name in names:
            pins[name] += 1
            if name in held:
                held.move_to_end(name)

    def finished(self, names: Sequence[str], keys: Sequence[Any], *, load: bool,
                 success: bool, landed: bool = True) -> None:
        """A transfer of ``names`` published its result: unpin them; a store that succeeded
        holds its blocks now. A failed store's blocks are removed unless the tier held them
        before (a failed write may have landed, and nothing vouches for it), or the store
        put none of them in place (``landed`` False: what is under their names, if anything,
        is not this tier's, another process's block, say); one another transfer still uses
        is removed when the last of them ends, whatever that one was. A failed load
        removes nothing (it may have failed for a reason that has nothing to do with the stored
        bytes: cancelled, a release that kept failing, a store that did not answer): its blocks
        stay counted, and go when their turn comes (the tier answers MISS for them meanwhile)."""
        pins, held, owed = self._pins, self._held, self._owed
        _drop_one(pins, names)
        if load:
            if owed:  # the last use of what a failed store may have left: it goes now
                free = [name for name in names if name in owed and not pins[name]]
                if free:
                    owed.difference_update(free)
                    self._call_remove(free)
            return
        writers, fresh = self._writers, self._fresh
        _drop_one(writers, names)
        stored: list[Any] = []
        dropped: list[str] = []
        for name, key in zip(names, keys, strict=True):
            if success or not writers[name]:  # held now, or no longer being written
                fresh.discard(name)
            if success:
                if name not in held:
                    stored.append(key)
                held[name] = key
                held.move_to_end(name)
                owed.discard(name)  # (its own block now: what was left is overwritten)
            elif name not in held and (landed or name in owed):
                if pins[name]:  # another transfer uses it: it goes when the last one ends
                    owed.add(name)
                else:
                    owed.discard(name)
                    dropped.append(name)
        if stored:
            self._event(HoldingEvent(tuple(stored), removed=False))
        if dropped:
            self._call_remove(dropped)

    # -- the tier's users --------------------------------------------------------------------

    def use(self, name: str) -> None:
        """``name`` was used (a lookup answered HIT for it): noted, from any thread, and made
        the most recent by the next call under the tier's lock."""
        self._used.append(name)

    def touch(self, names: Iterable[str]) -> None:
        """Count ``names`` as used now, in order (the last the most recent)."""
        self._count_uses()
        held = self._held
        for name in names:
            with contextlib.suppress(KeyError):  # not held (not this tier's, or removed)
                held.move_to_end(name)

    def _count_uses(self) -> None:
        """Make the names lookups noted the most recent, in the order they were found."""
        used, held = self._used, self._held
        while used:
            name = used.popleft()
            with contextlib.suppress(KeyError):
                held.move_to_end(name)

    def holds(self, name: str) -> bool:
        """True when this tier stored ``name`` and still keeps it."""
        return name in self._held

    def take_events(self) -> list[HoldingEvent]:
        """The events since the last call, oldest first (empty unless ``record_events``)."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events

    def stats(self) -> dict[str, int]:
        """What the tier holds and removed, in figures."""
        return {
            "capacity_bytes": self.capacity_bytes,
            "held_blocks": len(self._held),
            "held_bytes": len(self._held) * self.block_bytes,
            "writing_blocks": len(self._writers),
            # what failed stores may have left in place, removed once no transfer uses them
            "owed_blocks": len(self._owed),
            "removed": self.removed,
            "remove_errors": self.remove_errors,
            "events_dropped": self.events_dropped,
        }

    # -- internals ---------------------------------------------------------------------------

    def _evict(self, names: list[str]) -> None:
        if not names:
            return
        held = self._held
        keys = tuple(held.pop(name) for name in names)
        self._event(HoldingEvent(keys, removed=True))
        self._call_remove(names)

    def _call_remove(self, names: list[str]) -> None:
        # (one not removed stays where it is; the tier forgot it all the same)
        failed = removal_failures(self._remove, names)
        self.remove_errors += failed
        self.removed += len(names) - failed

    def _event(self, event: HoldingEvent) -> None:
        if not self.record_events:
            return
        with self._lock:
            events = self._events
            if len(events) == events.maxlen:
                self.events_dropped += 1
            events.append(event)


def _drop_one(counts: collections.Counter[str], names: Iterable[str]) -> None:
    """One use fewer of each name; a name none uses any more is forgotten."""
    for name in names:
        left = counts[name] - 1
        if left > 0:
            counts[name] = left
        else:
            del counts[name]
