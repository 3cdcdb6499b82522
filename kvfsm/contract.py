"""The job contract every kvfsm side that takes jobs keeps, in one place.

Tiers (:class:`~kvfsm.tiers.base.SecondaryTier` and its subclasses, the peer sender) and the
peer receiver (:class:`~kvfsm.peer.PeerReceiver`) hand results out the same way: one lock, one
book of unpublished records and published results (:class:`Books`), one
``get_finished_jobs`` (advance once, then hand out what was published since the last call),
one ``drain_jobs`` with one timeout error (:class:`DrainTimeout`), one ``has_pending_work``.
What differs is how a side advances its records once (:meth:`JobSide._poll`).
"""

from __future__ import annotations

import collections
import math
import operator
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvfsm.transfer import JobResult


def check_timeout(timeout: object) -> float | None:
    """A drain's or a shutdown's ``timeout``, as its deadline arithmetic takes it: None (no
    bound) for None, infinity or a wait longer than any the platform can make
    (``threading.TIMEOUT_MAX``, some 292 years), else the seconds (0 and below: at once).

    Raises:
        ValueError: not None nor a real number (a bool, a str, NaN), naming what was given.
    """
    if timeout is None:
        return None
    if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
            or (isinstance(timeout, float) and math.isnan(timeout))):
        raise ValueError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if timeout >= threading.TIMEOUT_MAX:
        return None
    return float(timeout) if timeout > 0 else 0.0  # (-10**400 is no float)


def seconds_left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic time), 0 once it passed, at most the longest wait
    the platform can make (``threading.TIMEOUT_MAX``): what a lock's or a join's timeout
    takes."""
    return min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX)


def take(lock: Any, deadline: float | None) -> bool:
    """``lock.acquire`` waiting until ``deadline`` at most (monotonic time; None: as long as
    it takes; past it: only if it is free): whether it was taken. Use it as
    ``if take(lock, deadline):`` then ``try: ... finally: lock.release()``.

    A signal handler's exception (a Ctrl-C's ``KeyboardInterrupt``) lands where CPython
    checks for one: as a call returns and as a Python function starts. One landing as the
    acquire returns true would leave the lock held for good by a thread that does not know
    it (every other thread's call, and the interpreter's exit, then wait for ever): here it
    is let go of before the interrupt goes on. Between this function's return and the
    caller's ``try`` there is no such check, and a ``finally`` whose first call is the
    release has none before it either; a release in a context manager's ``__exit__``
    would (it is a Python function starting).
    """
    timeout = -1 if deadline is None else seconds_left(deadline)  # (outside the try: an
    try:  # interrupt before the acquire must not let go of a hold this thread had already)
        return bool(lock.acquire(True, timeout))
    except BaseException:  # an interrupt: during the wait (not taken), or as it returned
        try:  # noqa: SIM105 (taken: let go of it; contextlib.suppress would call first)
            lock.release()
        except RuntimeError:  # not taken
            pass
        raise


#: the longest sleep between polls taken: a billion seconds (some 31 years)
MAX_INTERVAL = 1e9


def check_interval(name: str, value: object) -> float:
    """A number of seconds to sleep between polls: finite and >= 0, at most
    :data:`MAX_INTERVAL` (``time.sleep`` fails once the clock plus the wait passes what it
    counts in, some 292 years, and an int past a float's range does not even convert).

    Raises:
        ValueError: anything else, naming ``name`` and what was given.
    """
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 <= value <= MAX_INTERVAL):
        raise ValueError(f"{name} must be a finite number of seconds >= 0 (at most "
                         f"{MAX_INTERVAL:.0e}), got {value!r}")
    return float(value)

__all__ = ["Books", "DrainTimeout", "JobSide"]

#: the side a drain on this thread is handing results out through its subclass's own
#: ``get_finished_jobs`` (:meth:`JobSide._drain_poll`), if any
_HANDING_OUT = threading.local()
_JOB_ID = operator.attrgetter("job_id")


def handing_out(side: object) -> bool:
    """Whether a drain on this thread hands ``side``'s results out through its subclass's
    own ``get_finished_jobs``, the drain's poll made: kvfsm's ``get_finished_jobs`` then only
    hands out what was published (:func:`marked_results`: no poll, no lock)."""
    return getattr(_HANDING_OUT, "side", None) is side


def marked_results(books: Books) -> list[JobResult]:
    """The results published, handed out under a drain's mark (:func:`handing_out`), each
    noted there: if the subclass's method raises, the drain gives them all back."""
    taken = books.take_results()
    _HANDING_OUT.taken += taken
    return taken


class DrainTimeout(TimeoutError):
    """Jobs were still unpublished at the deadline; lists each with its state and error."""

    def __init__(self, what: str, stuck: Sequence[Any], noun: str = "transfer(s)") -> None:
        self.stuck = tuple(stuck)
        lines = [f"job {r.job_id}: {r.state.name}, retries={getattr(r, 'retries', 0)}, "
                 f"last error: {r.error}" for r in self.stuck]
        super().__init__(f"{what}: {len(self.stuck)} {noun} not published\n  "
                         + "\n  ".join(lines))


class Books:
    """Unpublished records by job id, and the results published but not yet handed out.

    One thread may hand results out (:meth:`take_results`) while another publishes under the
    side's lock (a tier's progress thread): a result is queued after its job id is marked
    unreported, and its id is unmarked only once the result was taken, so a job id is never
    free while its result waits, and no result is handed out twice or lost.
    """

    __slots__ = ("records", "results", "turn", "unreported")

    def __init__(self) -> None:
        #: every unpublished record, by job id, in submission order
        self.records: dict[int, Any] = {}
        #: results published since they were last handed out, oldest first
        self.results: collections.deque[JobResult] = collections.deque()
        #: the job ids of those results (a job id is not taken again before its result is out)
        self.unreported: set[int] = set()
        #: the takers' turn, ``{0: True}`` while no one takes results: a taker takes it by
        #: deleting the key and gives it back by setting it (a bytecode each, not a call, so
        #: a signal cannot land between taking it and the ``try`` that gives it back)
        self.turn: dict[int, bool] = {0: True}

    def publish(self, result: JobResult) -> None:
        """Keep ``result`` for the next :meth:`take_results`."""
        self.unreported.add(result.job_id)  # first: see the class's notes
        self.results.append(result)

    def take_results(self) -> list[JobResult]:
        """The results published since the last call, handed out once (safe without the
        side's lock beside a publishing thread, and beside another caller: each result goes to
        one).

        A result whose record is still kept waits for the next call: its finish is under way
        on another thread, or an interrupt cut it short (the books are mended before the next
        poll, and a result not queued then is published again: taken now, it would be handed
        out twice). Takers take turns (:attr:`turn`): one that comes while another takes
        (another thread, where no lock serializes the interpreter) gets nothing this time, as
        it would had the other come first; it could otherwise come between the other's look
        at a result's record and its taking the result, take that one and leave the next, not
        looked at, to the other. A result is kept before it leaves the queue: an interrupt as
        a call returns (where a signal is checked) never holds one that is in neither; what
        was taken goes back to the queue first, in one call, and then its job ids are marked
        again (a second interrupt between the two leaves the ids unmarked while their results
        wait: their jobs' ids are taken early, none is lost)."""
        results, turn = self.results, self.turn
        taken: list[JobResult] = []
        if not results:
            return taken
        try:
            del turn[0]  # (a bytecode: no signal between it and the try below)
        except KeyError:  # another taker's turn
            return taken
        try:
            records = self.records
            for _ in range(len(results)):
                result = results[0]
                if result.job_id in records:
                    break
                taken.append(result)
                results.popleft()
            discard = self.unreported.discard
            for result in taken:
                discard(result.job_id)
            return taken
        except BaseException:  # an interrupt: what was taken is handed out by the next call
            if taken and results and results[0] is taken[-1]:  # kept, not yet out of the queue
                del taken[-1]
            results.extendleft(taken[::-1])  # (back first, in one call: see above)
            self.unreported.update(map(_JOB_ID, taken))
            raise
        finally:
            turn[0] = True


class JobSide:
    """The contract's calls, over a side's :class:`Books`, its lock and its :meth:`_poll`.

    A subclass sets ``_books``, ``_lock`` (an ``RLock``) and ``poll_interval``, and says how its
    records advance once (:meth:`_poll`).
    """

    _books: Books
    _lock: threading.RLock
    #: seconds :meth:`drain_jobs` sleeps between polls while jobs are unpublished
    poll_interval: float
    #: what a :class:`DrainTimeout` calls the records it lists
    _noun = "transfer(s)"

    def get_finished_jobs(self) -> list[JobResult]:
        """Advance the jobs once (a tier checks those its poll schedule picks:
        :class:`~kvfsm.policy.RetryPolicy`); return each result published since the last
        call."""
        if handing_out(self):
            return marked_results(self._books)
        with self._lock:
            self._poll()
        # taken once the lock is let go of (safe without it: Books): a Ctrl-C as the lock's
        # release returns finds them still published, for the next call
        return self._books.take_results()

    #: the ``get_finished_jobs`` a drain's poll stands in for (:meth:`_drain_poll`): the
    #: class's own; a subclass that overrides it and not this has its results go through it
    _drained_hand_out = get_finished_jobs

    def _drain_poll(self, deadline: float | None) -> list[JobResult]:
        """One poll of a drain, as :meth:`drain_jobs` makes it (every unpublished job
        advanced, on the caller's thread, whatever else polls: the caller is waiting), then
        the results published; waiting for the lock until ``deadline`` at most (None: as long
        as it takes): past it, with another thread's call holding the lock, no poll, and only
        the results already published are handed out (a drain that keeps its bound).

        A subclass whose ``get_finished_jobs`` is its own (it looks at each result it hands
        out, say) has the results handed out through it, once the drain's poll is made and
        the lock let go of; kvfsm's own ``get_finished_jobs`` under it then only hands out
        (:func:`handing_out`): no second poll, no wait for the lock."""
        own = type(self).get_finished_jobs is type(self)._drained_hand_out
        if take(self._lock, deadline):  # (else past the deadline, another thread's call
            try:  # holding the lock: no poll)
                self._poll(everything=True)
                self._drained()
            finally:
                self._lock.release()
        if own:  # (taken once the lock is let go of, safe without it: Books; a Ctrl-C as
            return self._books.take_results()  # it is released finds them published)
        mark = _HANDING_OUT
        before, taken = getattr(mark, "side", None), getattr(mark, "taken", None)
        try:  # (a subclass's own, the lock free, marked; restored however it ends)
            mark.side, mark.taken = self, []
            return list(self.get_finished_jobs())  # (a generator's body runs marked too)
        except BaseException:  # what kvfsm handed it, all of it: handed out next time
            books, back = self._books, mark.taken[::-1]  # (no call before the results are
            books.results.extendleft(back)  # back: a signal lands as a call returns; one
            books.unreported.update(map(_JOB_ID, back))  # after it leaves them unmarked)
            raise
        finally:
            mark.side, mark.taken = before, taken

    def _drained(self) -> None:
        """What the side's own ``get_finished_jobs`` does after its poll, after a drain's
        (under the lock; nothing here)."""

    def has_pending_work(self) -> bool:
        """True while a job is unpublished or a result is not yet handed out."""
        books = self._books
        return bool(books.records) or bool(books.results)

    def unpublished(self) -> list[Any]:
        """The records of the jobs not yet published, in submission order."""
        return list(self._books.records.values())

    def drain_jobs(self, timeout: float | None = None,
                   step: Callable[[], Any] | None = None) -> None:
        """Block until every job is published; results surface in get_finished_jobs.

        Returns or raises by the deadline, or at most one poll after it (a poll under way at
        the deadline is finished, never cut short); waiting for another thread's call to let
        go of the lock counts against the deadline. ``step``, if given, is called before each
        poll (the other side of a link living in the same process, for one).

        Raises:
            DrainTimeout: ``timeout`` seconds passed with jobs still unpublished; they stay
                where they are, untouched, and a later poll goes on with them.
            ValueError: ``timeout`` is not None nor a number of seconds (NaN, a str...);
                nothing was polled. (Infinity is no bound, as None.)
        """
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        lock, records = self._lock, self._books.records
        if not records:
            return  # nothing to wait for (results not handed out yet stay for the next call)
        while True:
            if step is not None:
                step()
            # the lock is released while sleeping, so other threads can submit; waiting for it
            # (behind another thread's poll) never runs past the deadline
            if not take(lock, deadline):
                if not records:
                    return  # another thread's poll published the last of them
                raise DrainTimeout("drain_jobs", self.unpublished(), self._noun)
            try:
                self._poll(everything=True)
                if not records:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise DrainTimeout("drain_jobs", self.unpublished(), self._noun)
            finally:
                lock.release()
            time.sleep(self.poll_interval if deadline is None else  # (never past the deadline)
                       min(self.poll_interval, max(0.0, deadline - time.monotonic())))

    def _poll(self, everything: bool = False) -> None:
        """Advance the unpublished jobs once (the caller holds the lock); ``everything``: a
        drain waits for them all, so a side that checks only some each poll checks all."""
        raise NotImplementedError
