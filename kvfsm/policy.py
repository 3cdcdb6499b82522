"""How long a tier keeps trying: the retry policy behind the QUARANTINED state.

A release that raises is retried on later polls (the transfer stays in DONE or FAILED, F1). Kept
up forever, one stuck release keeps the engine stepping forever and ``drain_jobs`` waiting
forever (F9). A :class:`RetryPolicy` bounds it: the release that fails for the
``max_attempts``-th time, or the first to fail ``max_seconds`` or more after the transfer ended,
answers EXHAUSTED and the transfer moves to QUARANTINED, publishing a failure.

What the bound means for memory: a quarantined transfer *had ended* (NIXL answered DONE or an
error) before its release was retried, so the memory it read or wrote is no longer in use and
the failure result lets the engine reuse it safely; only the transfer handle (and its
descriptors) stay held for good. ``max_running_seconds`` is different: it quarantines a transfer
NIXL still reports as running. Its handles are never released, and its failure result says so
(``JobResult.blocks_in_use``): NIXL may go on reading (a store) or writing (a load) the job's
blocks, so they must never be reused. :class:`~kvfsm.tiering.TieringManager` keeps such a
store's pins for good (the block is never evicted or written again, so whatever NIXL copies is
its bytes) and retires such a load's blocks (never handed out again); vLLM's manager reuses
chunks on any result, so the vLLM tiers refuse the bound. A parent of the user's own that
reuses the blocks all the same lets a load land in a block reused since, and a store land an
object holding part of what the block held later: the tier itself never vouches for a given-up
store's keys again (they stay MISS, whatever store of them succeeds later), but another process
sharing the bucket finds that object and loads it as a success. (A file tier's given-up store
is not renamed into place, unless its renames had begun, once NIXL had written every block
whole.) So ``max_running_seconds`` is off by default, and an object-store tier built with it
logs a warning; set it only where a stuck transfer is worse than a block held for good, and
never below the longest time a transfer can take.

The poll schedule: which running transfers a poll asks NIXL about. With ``check_all_below``
or fewer running, every one, every poll. With more, a poll checks the stores whose remote
side said their commit is over (a durable file tier's flusher does), then the oldest, in
batches, for as long as a batch finds one that ended (transfers mostly end in the order they
were posted, so this finds them at a cost of what ended; a store waiting on its commit is
walked past), and then a share of the rest in
turn, so that each running transfer is checked at least once every ``max_unpolled`` seconds
while polls come: a transfer that ends out of order waits at most that long for its result,
plus the longest gap between two polls (a poll held up holds up every check due in it). A
transfer is checked at most once a poll.
The share costs the caller about ``N / max_unpolled`` state checks a second with N running
(``docs/performance.md`` has the figures). ``drain_jobs`` and ``shutdown`` check every
running transfer on every poll: the caller is waiting for them.

The progress thread (``progress_interval``): the poll, the same one, made by a thread of the
tier every ``progress_interval`` seconds instead of by ``get_finished_jobs``, so a scheduler
step costs the results it takes and nothing else, whatever is in flight. The thread takes the
tier's lock for each poll, as every call of the tier does, so one thread at a time drives the
NIXL agent; a submit waits for one poll of it at most (the lock is not handed over in order, so
that is the rule, not a promise). A poll of the thread makes at most ``PROGRESS_SLICE`` (1,024)
state checks of the schedule, one a job (a job made a NIXL transfer per block adds one for each
next transfer of it while they are found over), half of them at most for the commits over and
the oldest while a turn of the sweep is a bound late: the sweep's turns due past them are the
first its next poll takes, which it makes after letting go of the lock for 50 us. So however
many run and however tight ``max_unpolled`` is, the poll a submit waits for is that many checks,
the endings of what they found and the retries due; when the turns due outrun the thread, the
bound above stretches to the time the thread needs to go round them. It runs while jobs are
unpublished and ends when none are (it is started again by the next submit); it is not a daemon,
so a process that forgot ``shutdown`` waits for it, once the main thread has returned, and then
for the interpreter's exit to drain a tier not shut down and wait for NIXL to end its transfers,
both within one ``kvfsm.tiers.base.EXIT_WAIT_SECONDS``, counted from when no thread of the
caller's runs any more (the main thread returned, the others ended). Its work still takes the
interpreter's lock, so the scheduler's own Python work shares a core with it
(``docs/performance.md`` measures what that costs). Should a poll raise, the thread logs it and
stops, and ``get_finished_jobs`` polls on the caller's thread again, as without it (the tier's
``stats()["progress"]`` says why).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from kvfsm.contract import MAX_INTERVAL

__all__ = ["InFlightLimit", "RetryPolicy"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounds on retrying a failed release, and on waiting for a running transfer.

    Args:
        max_attempts: release calls at most: the ``max_attempts``-th to fail quarantines
            (1: the first failure does; None: no bound).
        max_seconds: seconds after the transfer ended after which a failed release quarantines
            (None: no bound); the backoff never puts a try past it, so one comes at that bound.
        backoff: seconds to wait before retrying the first failed release; doubled after each
            further failure up to ``max_backoff``. 0 retries on every poll.
        max_backoff: the longest wait between two attempts.
        max_running_seconds: a transfer NIXL still answers PROC for this long after submit is
            quarantined (None: waits as long as NIXL runs it; see the module's notes first).
        max_unpolled: the longest a running transfer goes without a state check, once more
            than ``check_all_below`` run, plus the longest gap between two polls: a check due
            while no poll runs is made by the next (the module's notes: the poll schedule; on
            a progress thread that cannot go round them that fast, the time it takes).
        check_all_below: with this many running transfers or fewer, a poll checks each.
        progress_interval: with a number of seconds, a tier polls on a progress thread of its
            own every that many seconds while it has jobs unpublished, and
            ``get_finished_jobs`` only hands out what that thread published: no NIXL call and
            no wait for the tier's lock on the caller's thread (but a peer sender's settles its
            link under the lock; the module's notes: the progress thread). None (the
            default): ``get_finished_jobs`` polls on the caller's thread.

    Raises:
        ValueError: a field is not what it says, naming the field and the value. Every field
            is checked at construction, so a bad policy never reaches a tier: a bool is not a
            number; ``max_attempts`` is an int; NaN is refused everywhere (every comparison
            with it is false, so a NaN bound would silently never be reached); an infinite
            ``max_seconds`` or ``max_running_seconds`` means no bound and is kept as None (one
            spelling, and the tier's fast path); a ``backoff`` or ``max_backoff`` above 1e9
            seconds (infinity too) is refused (a release would never be tried again, so no
            bound would be reached);
            ``max_unpolled`` is a positive number of seconds of at most 1e9 (a wait longer
            than that fails), ``check_all_below`` an int of at least 0, ``progress_interval``
            a positive number of seconds of at most 1e9 or None.
    """

    max_attempts: int | None = None
    max_seconds: float | None = 60.0
    backoff: float = 0.0
    max_backoff: float = 1.0
    max_running_seconds: float | None = None
    max_unpolled: float = 1.0
    check_all_below: int = 64
    progress_interval: float | None = None

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if attempts is not None:
            if isinstance(attempts, bool) or not isinstance(attempts, numbers.Integral):
                raise ValueError(f"RetryPolicy.max_attempts must be an int or None, got "
                                 f"{_shown(attempts)}")
            if attempts <= 0:
                raise ValueError(f"RetryPolicy.max_attempts must be positive or None, got "
                                 f"{attempts!r}")
        for name in ("max_seconds", "max_running_seconds"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_seconds(name, value, "or None")
            if value <= 0:
                raise ValueError(f"RetryPolicy.{name} must be positive or None, got {value!r}")
            if math.isinf(value):  # no bound: None's meaning, kept as None
                object.__setattr__(self, name, None)
        for name in ("backoff", "max_backoff"):
            value = getattr(self, name)
            _check_seconds(name, value, "")
            if not value <= MAX_INTERVAL:
                raise ValueError(f"RetryPolicy.{name} must be at most {MAX_INTERVAL:.0e} "
                                 f"seconds, got {value!r} (a wait that long never retries, so "
                                 "no bound is ever reached)")
        _check_period("max_unpolled", self.max_unpolled, "")
        if self.progress_interval is not None:
            _check_period("progress_interval", self.progress_interval, " or None")
        below = self.check_all_below
        if isinstance(below, bool) or not isinstance(below, numbers.Integral) or below < 0:
            raise ValueError(f"RetryPolicy.check_all_below must be an int of at least 0, got "
                             f"{_shown(below)}")
        if self.backoff < 0 or self.max_backoff < self.backoff:
            raise ValueError(f"RetryPolicy: need 0 <= backoff <= max_backoff, got "
                             f"{self.backoff} and {self.max_backoff}")

    def spent(self, failures: int, ended_at: float, now: float) -> bool:
        """True when a release that just failed for the ``failures``-th time must not be retried."""
        if self.max_attempts is not None and failures >= self.max_attempts:
            return True
        return self.max_seconds is not None and now - ended_at >= self.max_seconds

    def next_attempt(self, failures: int, now: float, ended_at: float | None = None) -> float:
        """When to try again after the ``failures``-th failed release (0.0: at once); with
        ``ended_at``, when the transfer ended, never past ``max_seconds`` after it, so that a
        release that keeps failing quarantines at that bound, not a backoff later."""
        if not self.backoff:
            return 0.0
        # the exponent is capped where 2.0 ** n is still a float: past 1024 failures (an
        # unbounded policy) it would raise OverflowError; the wait is max_backoff long before
        doubled = self.backoff * 2.0 ** min(failures - 1, 1023)
        at = now + float(min(self.max_backoff, doubled))
        if ended_at is not None and self.max_seconds is not None:
            at = min(at, ended_at + self.max_seconds)
        return at


@dataclass(frozen=True, slots=True)
class InFlightLimit:
    """Back-pressure: a bound on a tier's stores and loads in flight, in jobs and in bytes: its
    unpublished transfers (submitted, not yet published; a job that failed at submit is
    published at once), and those the running bound gave up while NIXL ran them: published,
    they may still run and hold what they took, so they count for as long as the tier lives.

    Past it, what happens is declared here, and is the same on every tier: a store that would
    take the tier past either bound is refused at submit with
    :class:`~kvfsm.tiers.TierSaturatedError` (nothing registered, no result: the caller keeps
    its block and may store it later or elsewhere), and counted in the tier's stats. A load is
    never refused for it: loads go first, since the engine waits for the blocks they fill; a
    load counts against the bounds like a store, so stores are refused while loads use the
    room. :meth:`~kvfsm.tiers.SecondaryTier.saturated` says beforehand whether a store would be
    refused, and :class:`~kvfsm.tiering.TieringManager` asks it before it pins a block for a
    tier: it does not cascade to a saturated tier.

    Args:
        jobs: the most jobs in flight a store is admitted at (None: no bound).
        bytes: the most bytes in flight, the store's own included (None: no bound); a store
            larger than this is refused even on an idle tier.

    Raises:
        ValueError: a bound that is not a positive int or None, naming it.
    """

    jobs: int | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("jobs", "bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"InFlightLimit.{name} must be a positive int or None, got "
                                 f"{_shown(value)}")

    def admits(self, jobs: int, nbytes: int, more: int) -> bool:
        """True when a store of ``more`` bytes fits beside ``jobs`` jobs and ``nbytes`` bytes
        in flight."""
        if self.jobs is not None and jobs >= self.jobs:
            return False
        return self.bytes is None or nbytes + more <= self.bytes


def _check_seconds(name: str, value: Any, alternative: str) -> None:
    """``value`` is a real number of seconds (not a bool, not NaN)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or math.isnan(value)):
        what = f"a number of seconds {alternative}".rstrip()
        raise ValueError(f"RetryPolicy.{name} must be {what}, got {_shown(value)}")


def _check_period(name: str, value: Any, alternative: str) -> None:
    """``value`` is a positive number of seconds, at most :data:`~kvfsm.contract.MAX_INTERVAL`
    (a thread's wait of more fails: past what the clock counts in)."""
    _check_seconds(name, value, alternative.strip())
    if not 0 < value <= MAX_INTERVAL:
        raise ValueError(f"RetryPolicy.{name} must be a positive number of seconds, at most "
                         f"{MAX_INTERVAL:.0e}{alternative}, got {value!r}")


def _shown(value: Any) -> str:
    """The value as the error shows it: its repr, and its type when that is not a number's."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return repr(value)
    return f"{value!r} ({type(value).__name__})"
