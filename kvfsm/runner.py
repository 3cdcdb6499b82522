"""The runner: the records of one lifecycle's transfers, and what is due for each. No I/O.

A :class:`Runner` knows nothing of NIXL. It keeps every unpublished transfer filed where its
state says: in the *running* list (the declaration's running states, whose effect is the state
check; their transfer handles kept side by side, so a poll round is one batch of calls) or in
the *waiting* list (a release to retry, a step of the user's). From the declaration alone it
says what is due: the handles whose state must be checked (:attr:`Runner.handles`), then, one
transfer at a time, the effect each waiting transfer waits on (:meth:`Runner.due`). Whoever
makes those calls (:class:`~kvfsm.driver.TransferDriver`, the I/O part) hands back what each
answered as an :class:`Outcome`, and :meth:`Runner.take` fires it, files the transfer again, and
publishes it once it is final.

What the runner decides itself, each once and from the table:

* a stay: NIXL answering PROC for a running transfer whose table declares that answer a
  self-loop without actions is counted, never fired (the hot path);
* a retry: an effect whose answer leaves the transfer where it was (a release that raised, a
  user step answering "not yet") is tried again on a later round after the policy's backoff
  (a transfer backing off is out of the rounds until then: :meth:`Runner.waiting_now`), and
  once the :class:`~kvfsm.policy.RetryPolicy` bound is spent the answer becomes EXHAUSTED, the
  declared give-up edge;
* a poll schedule: with few transfers running, a poll checks each; with many, the stores
  whose commit was said to be over, the oldest first while they are found ended (a store
  waiting on its commit left out), then a share of the rest in turn, each at least once
  every ``max_unpolled`` seconds (:meth:`Runner.check_round`): a poll costs what ended, plus
  a share that grows with the time since the last poll (a progress thread's poll, at most a
  slice of checks: the sweep's turns past it are taken first next time, and once they are
  a bound late the commits told over and the oldest first get half of it at most);
* a running bound: a transfer still running ``max_running_seconds`` after submit gives up
  (EXHAUSTED on the state check), found in submit order at a cost of the transfers it finds;
* the end of a transfer: from a state whose effect is the release, release, clean and publish
  are one :class:`~kvfsm.engine.Chain` when each answers OK (read from the table; a machine that
  leads elsewhere runs step by step). The tier makes those calls for a transfer a state check
  found over without asking :meth:`Runner.due` (its states in :attr:`Runner.ending` say it is
  due), and asks it only about one they moved on without publishing it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import itertools
import logging
import math
import operator
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any

from kvfsm.contract import Books
from kvfsm.engine import Chain, CompiledMachine
from kvfsm.machines.transfer import (
    Answer,
    CallFailed,
    FailureKind,
    FailureReason,
    PostInterrupted,
    TransferEvent,
    _keep_error,
)
from kvfsm.policy import RetryPolicy
from kvfsm.transfer import JobResult, Leak, Transfer

__all__ = ["END", "NIXL_RUNNING", "Outcome", "Runner"]

#: what NIXL's state check answers while a transfer runs (compared in bulk on the hot path)
NIXL_RUNNING = "PROC"
#: the effect of a transfer that is over: its release and then its cleanup calls, made one after
#: the other (:meth:`kvfsm.driver.TransferDriver.end`), taken as one chain when both answer OK
END = "release+clean"  # not an identifier: no event of a machine can be named so
logger = logging.getLogger("kvfsm")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an effect answered, as the machine hears it.

    ``answer`` is one of the event's answers (None: no call was made); ``detail`` goes to the
    step's actions (a :class:`~kvfsm.machines.transfer.CallFailed`, leaks); ``interrupt`` is a
    ``KeyboardInterrupt`` or the like that arrived during the calls: the answer is taken first,
    then the interrupt raised again, so the transfer is filed where its answer took it.
    """

    answer: Any
    detail: Any = None
    interrupt: BaseException | None = None


#: the outcome of a store NIXL finished whose commit (a flush) is not over: PROC for the machine
COMMITTING = "committing"

#: what a transfer is filed under while :meth:`Runner._finish` writes its books
_FINISHING = "finishing"
#: the oldest running transfers are checked in batches of this many, for as long as a batch
#: finds one that ended
FRONT_BATCH = 16
#: the bits of Transfer.queued: an entry in the oldest-first queue, one in the sweep
_IN_FRONT, _IN_SWEEP = 1, 2
_STATE = operator.attrgetter("state")
_FIRST = operator.itemgetter(0)


#: the NIXL call behind each effect whose give-up the transfer machine's quarantine names by
#: itself (any other effect is named as it is: a user's step)
_NIXL_WAITS: dict[str, str] = {TransferEvent.POLL: "check_xfer_state",
                               TransferEvent.RELEASE: "release_xfer_handle"}


def _alone(detail: Any) -> bool:
    """Whether a call's answer came without a why: none (a NIXL wait's answer), or a step's
    answer given alone (the driver names the step with an empty why)."""
    return not detail or (isinstance(detail, CallFailed) and detail.error == "")


class Runner(Books):
    """The books of one lifecycle's transfers: where each is, what is due, what was published.

    Args:
        machine: the compiled lifecycle (its declaration says effects, running and final
            states); the tier checked it can run it (:func:`kvfsm.driver.check_runnable`).
        policy: the retry and running bounds.
        on_final: called with each transfer that reached a final state and its result, after
            the runner's books and before logging and listeners (the tier records what its
            keys hold here); more may be appended to :attr:`on_final`. An ordinary exception
            one raises is logged, and the others and the filing go on: the job is published
            and its record goes.
    """

    #: an interrupt (a signal handler's exception, raised between any two statements) may
    #: have cut the filing of a transfer short: :meth:`mend` files them all afresh
    damaged = False
    #: called with each transfer that failed, before its result is queued: what a caller who
    #: reads the failure must find done (the tier forgets a failed store's keys: a key left
    #: vouched for would let a load read an old copy as the new bytes, or the failed store's
    #: bytes as a success). A transfer whose failure is latched while it has calls to make
    #: still (cancelled while NIXL runs it, a release to retry) has them called then too,
    #: once, so that none of that waits for its result. An interrupt in them
    #: leaves the transfer unpublished, and :meth:`mend` finishes it, calling them again; an
    #: ordinary exception one raises is logged, and the others and the filing go on (the
    #: tier's own books leave it safe: a forget that raised makes the tier vouch for nothing)
    on_failed: list[Callable[[Transfer], None]]
    #: called with each transfer as it is published, after the books (best effort)
    on_published: list[Callable[[Transfer], None]]
    #: called at the end of :meth:`mend` with the unpublished transfers: books of the tier's
    #: own an interrupt may have cut short are counted again from them
    on_mend: list[Callable[[Collection[Transfer]], None]]
    _committing: set[int]
    #: the running transfers a give-up was begun for, and the state it began in: one still
    #: there at a mend was never given up (an interrupt came before its EXHAUSTED fired)
    _giving_up: dict[Transfer, Any]
    _failing_told: set[int]
    #: transfers a round fired out of the running states and files as it makes their calls
    #: (the tier's ``_take_polls``): a call into the books that comes in between (a
    #: listener's) files them first (:attr:`guarded`), so that it finds each where its state
    #: says; none between rounds
    unfiled: Sequence[Transfer] = ()
    #: the thread of the round :attr:`unfiled` is of (other threads read the books as filed)
    round_thread = 0

    @functools.cached_property
    def guarded(self) -> _Guarded:
        """``with runner.guarded:`` around a call over the books: :meth:`mend` first if an
        interrupt went through a call before, and this one's noted (:attr:`damaged`)."""
        return _Guarded(self)

    def __init__(self, machine: CompiledMachine[Any, Any], policy: RetryPolicy,
                 on_final: Callable[[Transfer, JobResult], None] | None = None) -> None:
        super().__init__()
        declaration = machine.declaration
        self.machine = machine
        self.policy = policy
        self.effects = declaration.effects
        self.running_states = declaration.running
        #: the most effects a round makes for one transfer: a path through every state once
        #: (a lifecycle whose own steps go round in a circle goes on in the next round)
        self._max_moves = len(declaration.states.__members__)
        self.final = declaration.final
        #: final failure states: a transfer ending in one fails, whatever it latched, and is
        #: held for good (quarantined) if it still holds its transfer handle there
        self.failed_final = declaration.final & declaration.failure_states
        self.initial = declaration.initial
        table = machine.table
        self.table = table
        #: where a posted transfer NIXL runs waits (post answering PROC leads there)
        self.posted = table[declaration.initial][TransferEvent.POST][Answer.PROC].dest
        #: per running state, the step NIXL's PROC takes there
        self._proc = {state: table[state][TransferEvent.POLL][Answer.PROC]
                      for state in declaration.running}
        #: True when every one of them is a stay: PROC answers are then only counted
        self._proc_stays = all(step.is_stay for step in self._proc.values())
        #: the name a give-up or a retry says the transfer waited on, per effect a state waits
        #: on (every retry's effect is one)
        self._call_of = {str(effect): _NIXL_WAITS.get(effect, str(effect))
                         for effect in self.effects.values()}
        #: per state whose effect is the release: the chain of its ending, when declared so
        self._ending: dict[Any, Chain[Any]] = {}
        for state, effect in self.effects.items():
            if effect == TransferEvent.RELEASE:
                chain = self._ending_chain(state)
                if chain is not None:
                    self._ending[state] = chain
        #: the steps a retry takes (a self-loop of an effect other than the state check):
        #: their counts are the retries stats() reports
        self._retry_steps = [step for state, effect in self.effects.items()
                             if effect not in (TransferEvent.POLL, TransferEvent.POST)
                             for step in table.get(state, {}).get(effect, {}).values()
                             if step.dest is state]
        #: (state, effect, answer) of each retry, for the policy to bound
        self._retries = {(step.source, step.edge.event, step.answer)
                         for step in self._retry_steps}
        #: the answers any retry carries (most answers are none of them: one lookup says so)
        self._retry_answers = {answer for _, _, answer in self._retries}
        #: called with each transfer that reached a final state, once the books are written
        self.on_final: list[Callable[[Transfer, JobResult], None]] = (
            [] if on_final is None else [on_final])
        self.on_failed, self.on_published, self.on_mend = [], [], []
        self.running = _Running()  # those in a running state, and their handles
        #: the poll schedule (check_round): the running transfers oldest first; the sweep's
        #: batches (due, transfers) in the order of their turn; those that started running
        #: since the last round, and when the first of them did. Each may still hold some that
        #: left the running states (skipped, and dropped when met or compacted)
        self._front: collections.deque[Transfer] = collections.deque()
        self._sweep: collections.deque[tuple[float, list[Transfer]]] = collections.deque()
        self._joined: list[Transfer] = []
        self._joined_at = 0.0
        self._swept_at = time.monotonic()
        #: the last sweep left turns due it did not take (its round's slice was spent)
        self.behind = False
        self.waiting: dict[int, Transfer] = {}  # the others
        #: those of them a round goes on with (:meth:`waiting_now`): all but those backing off
        self._ready: dict[int, Transfer] = {}
        #: those backing off, as a heap of (retry_at, count, transfer): each left the ready
        #: list with its entry, and joins it again once the entry comes due, if still waiting
        #: (an entry whose transfer moved on, or was published, is dropped then)
        self._backing_off: list[tuple[float, int, Transfer]] = []
        self._entries = itertools.count()
        #: how many unpublished transfers are in each state
        self.in_state: dict[Any, int] = {state: 0 for state in declaration.states}
        #: stores NIXL finished whose commit is not over; the failed transfers whose
        #: on_failed books ran when their failure was latched (file)
        self._committing, self._failing_told, self._giving_up = set(), set(), {}
        #: those of them whose remote side said their commit is over, appended from any thread
        #: (the tier wires a remote side's ``commit_over`` to its ``append``): the next round
        #: checks them first. A store told twice is checked once; one told after it was
        #: published is dropped by the next round (each stays here until a round takes it)
        self.commits_over: collections.deque[Transfer] = collections.deque()
        limit = policy.max_running_seconds
        #: transfers in submit order, for the running bound (None: no bound)
        self._by_start: collections.deque[Transfer] | None = (
            None if limit is None else collections.deque())
        #: the bytes of the unpublished transfers (their jobs' blocks)
        self.bytes_in_flight = 0
        self.published = 0
        self.failed = 0
        self.latencies: collections.deque[float] = collections.deque(maxlen=4096)
        self.quarantined: list[Transfer] = []
        #: the quarantined transfers NIXL may still run (given up while it ran them)
        self.may_run: set[Transfer] = set()
        self.leaks: collections.deque[tuple[int, Leak]] = collections.deque(maxlen=256)
        self.leak_count = 0

    # -- what is due -------------------------------------------------------------------------

    @property
    def ending(self) -> dict[Any, Chain[Any]]:
        """The states whose effect is the release with the ending chain declared from them
        (their effect is :data:`END`: the release and cleanup calls, then the chain)."""
        return self._ending

    @property
    def handles(self) -> list[Any]:
        """The transfer handles to check this round, one per running transfer (in the order
        :meth:`take_checks` expects their answers)."""
        return self.running.handles

    def take_checks(self, statuses: Sequence[str | Exception]) -> list[tuple[Transfer, Any]]:
        """What the state checks of :attr:`handles` answered (a status, or what the call
        raised), in order: the answers PROC are counted where they are stays; the transfers
        whose answer must be fired come back with it (each stays in the running list until
        :meth:`take` files it where its new state says)."""
        running = self.running
        if self._proc_stays:
            answered = running.answered(statuses)
            if len(answered) < len(statuses):
                self._count_stays(answered)
        else:  # a machine with actions on PROC: every answer is fired
            answered = list(zip(running.transfers, statuses, strict=True))
        return answered

    def check_round(self, check: Callable[[list[Any]], list[str | Exception]],
                    everything: bool = False, limit: int | None = None,
                    check_all: Callable[[list[Any]], list[str | Exception]] | None = None,
                    ) -> list[tuple[Transfer, Any]]:
        """This round's state checks, made with ``check`` (the driver's batch call, given a
        list of handles, answering a status or an exception for each); returns, as
        :meth:`take_checks` does, the transfers whose answer must be fired.

        With ``everything`` (a drain) or at most ``policy.check_all_below`` running, every
        running transfer is checked, with ``check_all`` when given (the driver's, which may ask
        again those before a check that raised in a large batch; see
        :meth:`~kvfsm.driver.TransferDriver.check_all`). Else the schedule picks: first the
        stores whose commit their remote side said is over (:attr:`commits_over`); then the
        oldest, in batches of :data:`FRONT_BATCH`, until a batch finds none that ended (a store
        waiting on its commit is not among them: NIXL answers DONE for it until the commit is
        over, so it would be asked about every round); then the sweep, which checks each
        transfer whose turn is due (every running transfer's comes at most
        ``policy.max_unpolled`` seconds after its last, or after it started running) and, to
        spread the checks evenly, a share of the others in turn: ``max_unpolled`` split over
        the running transfers, for the time since the last round. A transfer is checked at
        most once a round: one the oldest-first checks asked about is left out of the sweep's
        (its turn is taken all the same).

        ``limit`` bounds the schedule's checks this round (the progress thread's slice, so
        that its hold of the tier's lock stays short): the commits over and the oldest-first
        checks go first, the sweep takes what is left; the sweep's turns it leaves due keep
        their place, first in its queue, and are the first the next round's sweep takes
        (:attr:`behind` says there are); once a turn is due for longer than ``max_unpolled``,
        the commits over and the oldest-first checks take at most half the slice together (a
        burst of either, or transfers ending in posting order batch after batch, would take all
        of it). It does not bound a round that checks everything.

        A round whose checks raise (an interrupt) leaves the commits told over to the next; an
        interrupt once they are answered, while the caller fires the answers, leaves those not
        yet fired to their turns in the sweep. Commits told over past the slice leave the
        thread :attr:`behind`, as the sweep's turns left due do.
        """
        running = self.running
        if everything or len(running.transfers) <= self.policy.check_all_below:
            self._swept_at = time.monotonic()
            self.behind = False  # every turn is taken
            queued = len(self.commits_over)  # checked now: their commits were over before
            answers = (check_all or check)(running.handles)
            for _ in range(queued):
                self.commits_over.popleft()
            return self.take_checks(answers)
        if limit is not None and limit < 1:
            raise ValueError(f"a round's limit is at least one check, not {limit!r}")
        cap = front = sys.maxsize if limit is None else limit
        sweep = self._sweep
        if (limit is not None and sweep
                and sweep[0][0] <= time.monotonic() - self.policy.max_unpolled):
            front = limit // 2  # the sweep is a bound late: the rest get half together
        told = self._take_commits_over(front)
        try:
            picked = told[:]
            statuses = check([transfer.xfer for transfer in told]) if told else []
            oldest, answers = self._check_front(check, front - len(told))
            picked += oldest
            statuses += answers
            self._check_sweep(check, cap, picked, statuses)
        except BaseException:  # the round's answers are lost: the tellings are taken again
            self.commits_over.extendleft(reversed(told))
            raise
        if self.commits_over and limit is not None:
            self.behind = True  # tellings past the slice: the next poll comes soon
        if not self._proc_stays:  # a machine with actions on PROC: every answer is fired
            return list(zip(picked, statuses, strict=True))
        answered = list(compress(zip(picked, statuses, strict=True),
                                 map(operator.ne, statuses, repeat(NIXL_RUNNING))))
        if len(answered) < len(picked):  # the others answered PROC: a stay each, counted
            stays = collections.Counter(map(_STATE, picked))
            stays.subtract(map(_STATE, map(_FIRST, answered)))
            for state, count in stays.items():
                if count:
                    self._proc[state].taken += count
        return answered

    def _check_sweep(self, check: Callable[[list[Any]], list[str | Exception]], cap: int,
                     picked: list[Transfer], statuses: list[str | Exception]) -> None:
        """The sweep's share of the round (:meth:`_sweep_share`), up to ``cap`` checks with
        those ``picked`` already; those asked about already are not asked again. Its checks
        and their answers are added to ``picked`` and ``statuses``."""
        swept = self._sweep_share(cap - len(picked))
        if not swept:
            return
        asking = swept
        if picked:  # those the round asked about already are not asked again
            asked = set(map(id, picked))
            asking = [transfer for transfer in swept if id(transfer) not in asked]
        if asking:
            try:
                answers = check([transfer.xfer for transfer in asking])
            except BaseException:  # not asked: their turn is due again at once
                self._sweep_undo(swept)
                raise
            picked += asking
            statuses += answers

    def _take_commits_over(self, cap: int) -> list[Transfer]:
        """The transfers whose commit their remote side said is over, at most ``cap`` of them
        (the rest stay queued for the next round), leaving out any no longer waiting on it
        (and any told twice: checked once)."""
        woken = self.commits_over
        if not woken:
            return []
        committing, records = self._committing, self.records
        taken: list[Transfer] = []
        seen: set[int] = set()
        while woken and len(taken) < cap:
            transfer = woken.popleft()
            job_id = transfer.job_id
            if job_id in committing and records.get(job_id) is transfer and job_id not in seen:
                seen.add(job_id)
                taken.append(transfer)
        return taken

    def _check_front(self, check: Callable[[list[Any]], list[str | Exception]], cap: int,
                     ) -> tuple[list[Transfer], list[str | Exception]]:
        """Check the oldest running transfers in batches, until a batch finds none ended (or
        ``cap`` were checked); the entries walked past that no longer run, or that wait on
        their commit, are dropped (so each is walked past once, whatever stays running before
        it). A store that waits on its commit (a file tier's flush: NIXL answers DONE until the
        commit is over) is left to :attr:`commits_over`, and to its turns in the sweep."""
        picked: list[Transfer] = []
        statuses: list[str | Exception] = []
        batch: list[Transfer] = []
        walked = dead = 0
        size = min(FRONT_BATCH, cap)
        if size <= 0:
            return picked, statuses
        committing = self._committing
        for transfer in self._front:  # check() touches no queue: the deque stays as it is
            walked += 1
            if transfer.slot < 0 or (committing and transfer.job_id in committing):
                dead += 1
                continue
            batch.append(transfer)
            if len(batch) == size:
                answers = check([t.xfer for t in batch])
                picked += batch
                statuses += answers
                batch = []
                if answers.count(NIXL_RUNNING) == len(answers):
                    break  # none ended: those behind wait for their turn
                size = min(FRONT_BATCH, cap - len(picked))
                if size <= 0:
                    break  # the slice is spent: those behind wait for the next round
        if batch:  # the last, short batch (none is left after a break)
            answers = check([t.xfer for t in batch])
            picked += batch
            statuses += answers
        if dead:
            self._drop_dead_front(walked)
        return picked, statuses

    def _drop_dead_front(self, walked: int) -> None:
        """Drop the transfers no longer running, or waiting on their commit, from the first
        ``walked`` entries."""
        front, committing = self._front, self._committing
        kept = []
        for _ in range(walked):
            transfer = front.popleft()
            if transfer.slot >= 0 and transfer.job_id not in committing:
                kept.append(transfer)
            else:
                transfer.queued &= ~_IN_FRONT
        front.extendleft(reversed(kept))

    def _sweep_share(self, cap: int = sys.maxsize) -> list[Transfer]:
        """The running transfers whose turn in the sweep is due, and the share of the others
        for the time since the last round, oldest turn first, at most ``cap`` of them; they are
        queued again, due in ``max_unpolled`` seconds (the due turns past ``cap`` keep their
        place, first in the queue).

        The sweep is a queue of batches ``(due, transfers)``, due times increasing: those that
        started running since the last round are one batch, due ``max_unpolled`` after the
        first of them started; those picked in a round are another. A transfer no longer
        running is dropped from it when met."""
        now = time.monotonic()
        limit = self.policy.max_unpolled
        share = math.ceil(len(self.running.transfers)
                          * min(1.0, (now - self._swept_at) / limit))
        self._swept_at = now
        sweep = self._sweep
        if self._joined:
            sweep.append((self._joined_at + limit, self._joined))
            self._joined = []
        picked: list[Transfer] = []
        share = min(share, cap)
        while sweep and len(picked) < cap and (len(picked) < share or sweep[0][0] <= now):
            due, batch = sweep[0]
            wanted = (cap if due <= now else share) - len(picked)
            if len(batch) <= wanted:
                sweep.popleft()
                taken = batch
            else:  # a share of a batch not due yet: the rest keeps its place
                taken = batch[:wanted]
                del batch[:wanted]
            live = [t for t in taken if t.slot >= 0]
            if len(live) < len(taken):
                for transfer in taken:
                    if transfer.slot < 0:
                        transfer.queued &= ~_IN_SWEEP
            picked += live
        self.behind = bool(sweep) and sweep[0][0] <= now
        if picked:
            sweep.append((now + limit, picked))
        return picked

    def _sweep_undo(self, picked: list[Transfer]) -> None:
        """A share that was not asked about (the check raised): :meth:`_sweep_share` queued it
        last; it is queued first instead, due at once."""
        self._sweep.pop()
        self._sweep.appendleft((-math.inf, picked))
        self.behind = True

    def _schedule(self, transfer: Transfer) -> None:
        """A transfer started running: the oldest-first queue and the sweep take it (its turn
        due in ``max_unpolled`` seconds), unless they still hold it from when it ran before
        (a lifecycle that goes back to a running state): its entries are then live again."""
        queued = transfer.queued
        if queued != _IN_FRONT | _IN_SWEEP:
            if not queued & _IN_FRONT:
                self._front.append(transfer)
            if not queued & _IN_SWEEP:
                if not self._joined:
                    self._joined_at = time.monotonic()
                self._joined.append(transfer)
            transfer.queued = _IN_FRONT | _IN_SWEEP
        if len(self._front) > 2 * len(self.running.transfers) + 64:
            self._compact_schedule()

    def _compact_schedule(self) -> None:
        """Drop from the queues the transfers no longer running: done when the oldest-first
        queue holds over twice as many as run (plus 64), so each is dropped once, and the
        queues stay within that bound whenever a transfer starts running."""
        def running(transfer: Transfer) -> bool:
            if transfer.slot >= 0:
                return True
            transfer.queued = 0  # every entry of it goes
            return False

        self._front = collections.deque(filter(running, self._front))
        self._joined = list(filter(running, self._joined))
        sweep: collections.deque[tuple[float, list[Transfer]]] = collections.deque()
        for due, batch in self._sweep:
            kept = list(filter(running, batch))
            if kept:
                sweep.append((due, kept))
        self._sweep = sweep

    def _count_stays(self, answered: list[tuple[Transfer, Any]]) -> None:
        """Count the PROC stay of every running transfer not in ``answered``."""
        left = collections.Counter(t.state for t, _ in answered)
        for state, step in self._proc.items():
            step.taken += self.in_state[state] - left[state]

    def overdue(self) -> list[Transfer]:
        """Take the running bound: a transfer still running ``max_running_seconds`` after
        submit is given up (EXHAUSTED on its state check, published); a store NIXL finished
        whose commit is not over fails as a commit that raised (its handle is then released:
        NIXL no longer runs it). Returns those now waiting on their release, for this round.

        Costs the transfers submitted too long ago, not those in flight. Each is taken off the
        submit-order queue only once it was handled and filed (an interrupt leaves the rest
        queued for the next round)."""
        by_start = self._by_start
        if not by_start:
            return []
        limit = self.policy.max_running_seconds
        cutoff = time.monotonic() - limit  # type: ignore[operator]
        moved: list[Transfer] = []
        while by_start and by_start[0].started_at <= cutoff:
            transfer = by_start[0]
            if (self.records.get(transfer.job_id) is transfer
                    and transfer.state in self.running_states):
                if transfer.job_id in self._committing:
                    self.take(transfer, TransferEvent.POLL, Outcome(
                        Answer.RAISED, CallFailed("commit", TimeoutError(
                            f"not committed {limit} s after submit (max_running_seconds)"))))
                    moved.append(transfer)
                else:
                    self.give_up(transfer, f"still running after {limit} s")
            by_start.popleft()
        return moved

    def due(self, transfers: Iterable[Transfer] | None = None,
            moved: bool = False) -> Iterator[tuple[Transfer, str]]:
        """Yield (transfer, effect) for each call to make now, and again for the same transfer
        after :meth:`take` moved it on, until it waits on NIXL (running: a transfer an effect
        moved back into a running state gets one state check first), is published, stays where
        it was (a retry: the next round tries again) or backs off.

        At most as many calls for one transfer as the lifecycle has states: one whose own
        steps send it round in a circle goes on in the next round, and a round stays bounded.

        ``transfers`` (by default the waiting list as it is now) are gone through in order;
        the effect ``END`` stands for the release and cleanup calls of a transfer that is over.
        With ``moved``, each of ``transfers`` was moved on by an effect made this round (the
        tier's ending of a transfer a state check found over): one moved back into a running
        state gets its check.
        """
        records, final, running = self.records, self.final, self.running_states
        effects, ending, most = self.effects, self._ending, self._max_moves
        batch = list(self.waiting.values()) if transfers is None else transfers
        for transfer in batch:
            made, checked, moves = moved, False, 0
            while records.get(transfer.job_id) is transfer and moves < most:
                moves += 1
                state = transfer.state
                if state in final:
                    break
                if state in running:  # one an effect moved back into a running state is
                    if made and not checked:  # checked this round too, then waits for the next
                        checked = True
                        yield transfer, TransferEvent.POLL
                        continue
                    break
                if transfer.retry_at and time.monotonic() < transfer.retry_at:
                    break  # backing off: no call this round
                effect = END if state in ending else effects[state]
                if effect == TransferEvent.POST:
                    break  # posted once, at submit
                made = True
                yield transfer, effect
                if transfer.state is state:
                    break  # stayed (a retry, or backing off): a later round goes on

    def waiting_now(self) -> list[Transfer]:
        """The waiting transfers a round goes on with, in the order they joined: every one but
        those backing off whose next try is not due yet (one whose backoff is over joins the
        end). Costs the transfers it returns, plus a heap's pop for each backoff that came
        due: transfers backing off cost nothing until their try is due."""
        backing_off = self._backing_off
        if backing_off and backing_off[0][0] <= time.monotonic():
            self._wake()
        ready = self._ready
        return list(ready.values()) if ready else []

    def retry_now(self, transfer: Transfer) -> None:
        """Let a transfer backing off try again at its next round, its backoff cut short (a
        shutdown's last try at its deadline): it joins the waiting transfers a round goes
        through, where it stays until it moves on, however that try ends."""
        transfer.retry_at = 0.0
        if self.waiting.get(transfer.job_id) is transfer:
            self._ready[transfer.job_id] = transfer

    def _wake(self) -> None:
        """Move each transfer whose backoff is over back to the ready list (still waiting)."""
        backing_off, waiting, ready = self._backing_off, self.waiting, self._ready
        now = time.monotonic()
        while backing_off and backing_off[0][0] <= now:
            transfer = backing_off[0][2]
            if waiting.get(transfer.job_id) is transfer and transfer.retry_at <= now:
                ready[transfer.job_id] = transfer  # else: moved on, or backs off again (a
                # later entry of its own brings it back)
            heapq.heappop(backing_off)

    # -- the answers -------------------------------------------------------------------------

    def add(self, transfer: Transfer) -> None:
        """A new transfer, in its initial state, before its post is made."""
        self.records[transfer.job_id] = transfer
        self.bytes_in_flight += transfer.nbytes
        if self._by_start is not None:
            self._by_start.append(transfer)

    def take(self, transfer: Transfer, effect: str,
             outcome: Outcome | tuple[Outcome, Outcome]) -> None:
        """Fire what ``effect`` answered for ``transfer``, file it where its state says (or
        publish it), then raise the outcome's interrupt, if any."""
        try:
            if effect == END:  # the release's outcome, then the cleanup's
                self._take_end(transfer, outcome[0], outcome[1])  # type: ignore[index]
            else:
                answer, detail = outcome.answer, outcome.detail  # type: ignore[union-attr]
                interrupt = outcome.interrupt  # type: ignore[union-attr]
                if answer is not None:  # None: no call was made
                    self._fire(transfer, effect, answer, detail)
                if detail is COMMITTING:
                    self._committing.add(transfer.job_id)
                if interrupt is not None:
                    raise interrupt
        finally:  # an interrupt or an action that raised: the transfer is filed all the same
            self.file(transfer)

    def give_up(self, transfer: Transfer, why: str) -> None:
        """The policy's bound is spent for a transfer waiting on its effect (the shutdown
        deadline, the running bound): fire that effect's EXHAUSTED; it is published."""
        was = transfer.state
        effect = self.effects[was]
        if was in self.running_states:  # (before the fire: NIXL may run it from then on)
            self._giving_up[transfer] = was
            self.may_run.add(transfer)
        try:
            self.machine.fire(transfer, effect, Answer.EXHAUSTED,
                              why if effect in _NIXL_WAITS else CallFailed(effect, why))
            self._giving_up.pop(transfer, None)
            logger.error("job %d %s in %s: %s", transfer.job_id, self._gave_up(transfer),
                         was.name, why, extra=transfer.log_fields())
        finally:
            self.file(transfer)

    def cancel(self, transfer: Transfer, why: str | None = None) -> None:
        """The caller cancelled the job: fire ``cancel`` (with ``why``, what cancelled it, as
        its detail); the table says what that means in the transfer's state (a running one
        latches failure, one that is over keeps its outcome). Every state a transfer waits in
        declares it (:func:`~kvfsm.driver.check_runnable`)."""
        try:
            if transfer.state is self.initial:  # an interrupt came before its post answered:
                # NIXL may run it once it has a handle (a poll says), else nothing runs
                self.machine.fire(transfer, TransferEvent.POST,
                                  Answer.PROC if transfer.xfer is not None else Answer.RAISED,
                                  CallFailed("post", PostInterrupted()))
            self.machine.fire(transfer, TransferEvent.CANCEL, Answer.OK, why)
        finally:
            self.file(transfer)

    def _fire(self, transfer: Transfer, effect: str, answer: Any, detail: Any) -> None:
        """Fire one answer (a retry bounded by the policy, as :meth:`_retry` says)."""
        if answer in self._retry_answers and (transfer.state, effect, answer) in self._retries:
            self._retry(transfer, effect, answer, detail)
            return
        self.machine.fire(transfer, effect, answer, detail)

    def _retry(self, transfer: Transfer, effect: str, answer: Any, detail: Any) -> None:
        """An answer that keeps the transfer where it is, to try again: bounded by the policy,
        it is EXHAUSTED (the give-up edge) once the bound is spent, else fired, and the next
        try waits for the backoff."""
        now = time.monotonic()
        failures = transfer.attempts + 1
        if failures == 1 and transfer.success is None:  # a step before the outcome is
            # latched (its latch comes after it): the bound counts from now, when NIXL's end
            # was heard, not from the submit (the latch stamps the end again)
            transfer.finished_at = now
        if self.policy.spent(failures, transfer.finished_at, now):
            if effect not in _NIXL_WAITS:  # name the step, what it answered last and why
                why = detail.error if isinstance(detail, CallFailed) else detail
                if not isinstance(why, BaseException):  # (a step that raised: as it raised)
                    tries = "1 try" if failures == 1 else f"{failures} tries"
                    detail = CallFailed(effect, f"gave up after {tries}, the last "
                                                f"answered {getattr(answer, 'name', answer)}"
                                                + ("" if _alone(detail) else f": {why}"))
            self.machine.fire(transfer, effect, Answer.EXHAUSTED, detail)
            logger.error("job %d %s after %d failed %s(s): %s", transfer.job_id,
                         self._gave_up(transfer), failures, self._call_of[effect],
                         transfer.error, extra=transfer.log_fields())
            return
        self.machine.fire(transfer, effect, answer, detail)
        if effect not in _NIXL_WAITS and not _alone(detail):  # a step's error, kept (its
            _keep_error(transfer, answer, detail)  # edge may keep none) for the logs to say
        transfer.attempts = failures
        retry_at = transfer.retry_at = self.policy.next_attempt(failures, now,
                                                                transfer.finished_at)
        if retry_at:  # backing off: out of the rounds until its entry comes due
            heapq.heappush(self._backing_off, (retry_at, next(self._entries), transfer))
            self._ready.pop(transfer.job_id, None)
        if failures & (failures - 1) == 0:  # the 1st, 2nd, 4th, 8th... retry: not every round
            logger.warning("job %d: %s failed (retry %d): %s", transfer.job_id,
                           self._call_of[effect], failures,
                           f"answered {getattr(answer, 'name', answer)}"  # (a "not yet")
                           if _alone(detail) else transfer.error,
                           extra=transfer.log_fields())

    def _gave_up(self, transfer: Transfer) -> str:
        """How a log line says where a give-up (EXHAUSTED) took ``transfer``: quarantined (a
        final failure state, its transfer handle held), else given up, and where to."""
        if transfer.state in self.failed_final and transfer.xfer is not None:
            return "quarantined"
        return f"given up (now {transfer.state.name})"

    def _take_end(self, transfer: Transfer, released: Outcome, cleaned: Outcome) -> None:
        """The release and cleanup of a transfer that is over: one chain when both answered
        OK, else each fired as it answered, in the same order (a cleanup that was cut short
        by an interrupt fires nothing: it goes on from where it stopped next round)."""
        if released.answer is Answer.OK:
            if cleaned.answer is Answer.OK and cleaned.interrupt is None:
                self.machine.run(transfer, self._ending[transfer.state])
                return
            self.machine.fire(transfer, TransferEvent.RELEASE, Answer.OK)
            if cleaned.answer is not None:
                self.machine.fire(transfer, TransferEvent.CLEAN, cleaned.answer, cleaned.detail)
            if cleaned.interrupt is not None:
                raise cleaned.interrupt
        elif released.answer is not None:  # None: backing off, no call this round
            self._fire(transfer, TransferEvent.RELEASE, released.answer, released.detail)

    # -- filing ------------------------------------------------------------------------------

    def file_unfiled(self, transfers: Iterable[Transfer] | None = None) -> None:
        """File each of ``transfers`` (:attr:`unfiled` by default: the list stays, the round
        that made it goes on appending to it) that a round fired out of a running state and
        did not file yet, final or not."""
        running = self.running_states  # (filed elsewhere: an interrupted finish, mend's)
        for transfer in self.unfiled if transfers is None else transfers:
            if transfer.filed is not transfer.state and transfer.filed in running:
                self.file(transfer)

    def file(self, transfer: Transfer) -> None:
        """Keep a transfer in the list its state says, counted under its state; hand its one
        result out once it is final."""
        if self.records.get(transfer.job_id) is not transfer:
            return  # published already (a listener that polled again got there first)
        state = transfer.state
        filed = transfer.filed
        if filed is state:  # where it was: in the list its state says already (its handle
            if transfer.slot >= 0:  # may have changed: a job made per block, driver.Split)
                self.running.handles[transfer.slot] = transfer.xfer
            return
        if state in self.final:
            self._finish(transfer)
            return
        if transfer.success is False and transfer.job_id not in self._failing_told:
            self._failing(transfer, latched=True)  # before its calls are over
        if transfer.attempts or transfer.retry_at:  # moved on (however: an answer, a cancel,
            # a give-up): the next effect's count is fresh, and it is tried at once
            transfer.attempts, transfer.retry_at = 0, 0.0
        in_state = self.in_state
        if filed is not None:
            in_state[filed] -= 1
        in_state[state] += 1
        transfer.filed = state
        if state in self.running_states:
            if filed is not None and filed not in self.running_states:
                del self.waiting[transfer.job_id]
                self._ready.pop(transfer.job_id, None)
            if transfer.slot < 0:
                self.running.add(transfer)
                self._schedule(transfer)
        else:
            if transfer.slot >= 0:
                self.running.discard(transfer)
                self._committing.discard(transfer.job_id)
            self.waiting[transfer.job_id] = transfer
            self._ready[transfer.job_id] = transfer  # a move starts afresh: none backs off

    def _finish(self, transfer: Transfer, published: bool = False) -> None:
        """A transfer reached a final state: its one result (unless ``published`` already: a
        finish an interrupt cut short, :meth:`mend`), and the books, then listeners."""
        job_id = transfer.job_id
        held = transfer.state in self.failed_final and self._settle_failed(transfer)
        if not transfer.success and not published:  # (published: they were, before it)
            self._failing(transfer)
        result = self._held_result(transfer) if held else self._free_result(transfer)
        # the result is queued before the record goes: a progress thread publishes while the
        # caller may be taking results (Books) or asking has_pending_work, which must never
        # see neither the record nor the result
        if not published:
            self.publish(result)
        self.bytes_in_flight -= transfer.nbytes
        if transfer.slot >= 0:
            self.running.discard(transfer)
        filed = transfer.filed
        if filed is not None:
            if filed not in self.running_states:
                del self.waiting[job_id]
                self._ready.pop(job_id, None)
            self.in_state[filed] -= 1
        # from here each book is written once, and the record goes last: an interrupt before
        # it leaves the record, and mend() takes it out without writing them again. The books
        # that must not be lost first: a quarantined transfer uncounted would have shutdown
        # release the registration its handles use; the tier's verdicts and holdings next
        transfer.filed = _FINISHING
        if held:
            self.quarantined.append(transfer)
        for book in self.on_final:
            try:
                book(transfer, result)
            except Exception:  # the filing goes on: its record must go, its result stands
                _book_raised(transfer, book)
        self.published += 1
        self.latencies.append(result.transfer_time)
        if transfer.leaks:
            self.record_leaks(job_id, transfer.leaks)
        self.failed += not result.success
        self._committing.discard(job_id)
        del self.records[job_id]
        transfer.filed = None
        if self._by_start is not None and len(self._by_start) > 2 * len(self.records) + 64:
            self._compact()
        if self._backing_off and len(self._backing_off) > 2 * len(self.waiting) + 64:
            self._compact_backoffs()
        if not result.success or transfer.leaks or self.on_published:
            self._announce(transfer, result)

    def _free_result(self, transfer: Transfer) -> JobResult:
        """The result of a transfer that ended holding no transfer handle: one given up while
        NIXL ran it, in a lifecycle whose give-up waited for NIXL's end and then released it,
        is no longer among those NIXL may run."""
        if self.may_run and transfer.xfer is None and transfer.split is None:
            self.may_run.discard(transfer)
        return transfer.result()

    def _held_result(self, transfer: Transfer) -> JobResult:
        """The result of a transfer that ended holding its transfer handle: one given up while
        NIXL ran it says NIXL may still move its blocks (``blocks_in_use``)."""
        result = transfer.result()
        if transfer in self.may_run:
            return dataclasses.replace(result, blocks_in_use=True)
        return result

    def _failing(self, transfer: Transfer, latched: bool = False) -> None:
        """A transfer that failed, before its result is queued, or (``latched``) once its
        failure is latched while it has calls to make still: :attr:`on_failed` (one that
        raises an ordinary exception is logged, and the others and the filing go on)."""
        if not latched:
            self._failing_told.discard(transfer.job_id)
        for book in self.on_failed:
            try:
                book(transfer)
            except Exception:
                _book_raised(transfer, book)
        if latched:  # (after them: an interrupt before has mend call them again)
            self._failing_told.add(transfer.job_id)

    @staticmethod
    def _settle_failed(transfer: Transfer) -> bool:
        """A transfer ended in a final failure state: its record says it failed, whatever it
        latched, and why (its last error, or the state it ended in); True when it still holds
        its transfer handle (NIXL may run it, or its release was given up): it is held for
        good (quarantined)."""
        held = transfer.xfer is not None
        transfer.success = False
        if transfer.reason is None:
            ended = f"ended in {transfer.state.name}, a failure state"
            transfer.reason = FailureReason(
                FailureKind.QUARANTINED if held else FailureKind.UNKNOWN, None,
                f"{ended}; last error: {transfer.error}" if transfer.error else ended)
        return held

    def _announce(self, transfer: Transfer, result: JobResult) -> None:
        """Once the books are written: the log lines of a failure and its leaks, then the
        listeners (best effort: a listener never costs a result, F7)."""
        job_id = transfer.job_id
        if not result.success:
            _log_failure(transfer)
        for leak in transfer.leaks:
            logger.warning("job %d leaked: %s raised %s", job_id, leak.call,
                           leak.error, extra=transfer.log_fields(leak.error))
        for listener in self.on_published:
            try:
                listener(transfer)
            except Exception:
                logger.exception("job %d: an on_published listener raised", job_id,
                                 extra=transfer.log_fields())

    def mend(self) -> None:
        """File every unpublished transfer afresh from its state, and count the books again.

        An interrupt raised between two statements of the runner's filing (a signal handler's
        ``KeyboardInterrupt`` lands at any line) can leave a transfer in no list a round reads,
        in the wrong one, in a final state unpublished, or counted where it no longer is: a
        drain then waits for it for ever, and a shutdown refuses it. The tier calls this before
        its next poll or shutdown once an interrupt went through it. A transfer in a final
        state is finished (its result published, unless it is already, its books written,
        its listeners told; one whose books the interrupt found being written has its record
        taken out, each book written at most once); every other goes where its state says,
        its turns in the poll schedule kept (one the interrupt left out of the schedule's
        queues is queued, its turn due a ``max_unpolled`` from now). An interrupt inside this
        is an interrupt too: it is called again.
        """
        now = time.monotonic()
        transfers = list(self.records.values())
        # one still in the state its give-up began in was never given up (an interrupt came
        # before its EXHAUSTED fired; a give-up edge always leaves its state)
        giving_up, self._giving_up = self._giving_up, {}
        self.may_run.difference_update([transfer for transfer, was in giving_up.items()
                                        if transfer.state is was])
        running, waiting, ready = _Running(), {}, {}
        backing: list[tuple[float, int, Transfer]] = []
        in_state = dict.fromkeys(self.in_state, 0)
        over: list[tuple[Transfer, bool]] = []
        self._mend_posts(transfers)
        for transfer in transfers:
            transfer.slot = -1
            state = transfer.state
            if state in self.final:  # (its books being written already, or not)
                over.append((transfer, transfer.filed is _FINISHING))
                transfer.filed = None
                continue
            transfer.filed = state
            in_state[state] += 1
            if state in self.running_states:
                running.add(transfer)
            else:
                waiting[transfer.job_id] = transfer
                if transfer.retry_at > now:
                    backing.append((transfer.retry_at, next(self._entries), transfer))
                else:
                    ready[transfer.job_id] = transfer
        heapq.heapify(backing)
        self.running, self.waiting, self._ready, self._backing_off = (
            running, waiting, ready, backing)
        self.in_state = in_state
        for transfer in running.transfers:  # the poll schedule's turns kept: its queues skip
            self._schedule(transfer)  # those not running, and take those it lost
        self._committing.intersection_update(t.job_id for t in running.transfers)
        self.bytes_in_flight = sum(transfer.nbytes for transfer in transfers)
        queued = {result.job_id for result in tuple(self.results)}  # (published, not taken)
        for transfer, finishing in over:
            if transfer.job_id not in self.records:
                continue  # (published by a listener meanwhile)
            if finishing:  # its result and books written, at most once: the record goes
                self.bytes_in_flight -= transfer.nbytes
                del self.records[transfer.job_id]
            else:
                self._finish(transfer, published=transfer.job_id in queued)
        self._mend_failing()
        for book in self.on_mend:
            book(self.records.values())
        self.damaged = False

    def _mend_failing(self) -> None:
        """(mend) Call the books of each failure latched whose call :meth:`file` made an
        interrupt cut short (a failed store that vouched for its keys until it ended)."""
        told = self._failing_told
        told.intersection_update(self.records)
        for transfer in list(self.records.values()):
            if transfer.success is False and transfer.job_id not in told:
                self._failing(transfer, latched=True)

    def _mend_posts(self, transfers: Sequence[Transfer]) -> None:
        """(mend) A transfer still in its initial state: its submit was cut short, before or
        after its post answered; as :meth:`cancel` takes it, running if it has a handle."""
        for transfer in transfers:
            if transfer.state is self.initial:
                self.machine.fire(transfer, TransferEvent.POST,
                                  Answer.PROC if transfer.xfer is not None else Answer.RAISED,
                                  CallFailed("post", PostInterrupted()))

    def _compact(self) -> None:
        """Keep in the submit-order queue only the transfers the running bound may still
        apply to (the unpublished): done when it holds over twice as many, so each published
        transfer is dropped once, and the queue stays bounded by what is in flight."""
        records = self.records
        self._by_start = collections.deque(
            t for t in self._by_start or () if records.get(t.job_id) is t)

    def _compact_backoffs(self) -> None:
        """Keep in the backoff heap only the entries of transfers still waiting: done when it
        holds over twice as many as wait (plus 64), so that transfers published while backing
        off (a shutdown's give-up, a cancel) are not kept until their try would have come."""
        waiting = self.waiting
        self._backing_off = [entry for entry in self._backing_off
                             if waiting.get(entry[2].job_id) is entry[2]]
        heapq.heapify(self._backing_off)

    def record_leaks(self, job_id: int, leaks: Sequence[Leak]) -> None:
        """Count ``leaks`` and keep the most recent ones (job -1: the tier's own). The entries
        and the count change with no call between them, so an interrupt finds both changed
        or neither (a count that moved says the leaks are kept: the tier's release of the
        primary cache reads it)."""
        count, entries = len(leaks), tuple((job_id, leak) for leak in leaks)
        self.leaks += entries
        self.leak_count += count

    # -- reading -----------------------------------------------------------------------------

    def counts(self) -> dict[str, Any]:
        """The books as figures (no lock: each read is one operation CPython does whole)."""
        in_state = dict(self.in_state)
        if self.unfiled and self.round_thread == threading.get_ident():  # asked from inside
            running, final = self.running_states, self.final  # a round (a listener): each
            for transfer in self.unfiled:  # counted where it is, not where it was filed
                filed, state = transfer.filed, transfer.state
                if filed is not state and filed in running and state not in final:
                    in_state[filed] -= 1
                    in_state[state] += 1
        latencies = sorted(self.latencies.copy())
        return {
            "in_flight": {state.name: count for state, count in in_state.items() if count},
            "published": self.published,
            "failed": self.failed,
            "retries": sum(step.count for step in self._retry_steps),
            "leaks": self.leak_count,
            "leaked": list(self.leaks.copy()),
            "quarantined": len(self.quarantined),
            "quarantined_running": len(self.may_run),
            "latency": {name: latencies[min(len(latencies) - 1, int(q * len(latencies)))]
                        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
            if latencies else {},
        }

    def _ending_chain(self, state: Any) -> Chain[Any] | None:
        """Release, clean and publish, each answering OK, from ``state``: the chain, when the
        table leads them through states waiting on exactly those effects, to a final state."""
        moves = ((TransferEvent.RELEASE, None), (TransferEvent.CLEAN, ()),
                 (TransferEvent.PUBLISH, None))
        at = state
        for event, _ in moves:
            step = self.table.get(at, {}).get(event, {}).get(Answer.OK)
            if self.effects.get(at) != event or step is None or step.dest is at:
                return None
            at = step.dest
        if at not in self.final:
            return None
        return self.machine.chain(state, [(event, Answer.OK, detail) for event, detail in moves])


def _book_raised(transfer: Transfer, book: Callable[..., None]) -> None:
    """A book (:attr:`Runner.on_final`, :attr:`Runner.on_failed`) raised an ordinary exception
    (a bug, or the interpreter out of memory): logged at ERROR with its traceback, naming the
    book and the job, whose filing goes on, so that it is published once and its record goes
    (a book left half-written held the tier's drain and shutdown for ever). Raising it instead
    would reach the caller from a submit that ended a job at once, or kill a progress thread;
    the tier's own books leave it safe when they raise (:func:`kvfsm.tiers.base.
    _forget_failed_store`)."""
    name = getattr(book, "__qualname__", None) or getattr(
        getattr(book, "func", None), "__qualname__", repr(book))
    logger.exception("job %d: the tier's book %s raised as the job ended; the job is published "
                     "with its result as it was, and what that book keeps for its keys may be "
                     "out of date", transfer.job_id, name, extra=transfer.log_fields())


class _Guarded:
    """:attr:`Runner.guarded`."""

    __slots__ = ("runner",)

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def __enter__(self) -> None:
        runner = self.runner
        if runner.damaged:
            runner.mend()
        if runner.unfiled:  # a call from inside a round (a listener's): see Runner.unfiled
            runner.file_unfiled()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: Any) -> None:
        if kind is not None and not issubclass(kind, Exception):  # an interrupt: it may
            self.runner.damaged = True  # have cut a filing short


class _Running:
    """The transfers in a running state and their handles, in two parallel lists.

    A poll round is then one ``map`` of the state check over the handles, a loop in C, and a
    count of the answers that are still PROC: nothing else is touched for a transfer whose
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

    def answered(self, statuses: Sequence[Any]) -> list[tuple[Transfer, Any]]:
        """The transfers whose answer was not PROC, with it, in the order they are kept."""
        if statuses.count(NIXL_RUNNING) == len(statuses):
            return []
        return list(compress(zip(self.transfers, statuses, strict=True),
                             map(operator.ne, statuses, repeat(NIXL_RUNNING))))


def _log_failure(transfer: Transfer) -> None:
    job = transfer.job
    logger.warning("job %d: %s of %d block(s) failed: %s", job.job_id,
                   "load" if job.is_promotion else "store", len(transfer.names),
                   transfer.reason or transfer.error, extra=transfer.log_fields())
