"""The explorer: every NIXL call failing at every step, and the invariants checked on every path.

A *path* is one run of a scenario (a few stores and a load in flight together, polled to the
end) on :class:`~kvfsm.testing.FakeNixlAgent`, with a set of faults injected into numbered calls:
a call that raises, a status call that answers "ERR", or one that answers "PROC" k more times;
a state check after which the tier's clock has passed its running bound
(``max_running_seconds``), so that every transfer NIXL still runs is given up (``late``); a
poll round before which every job not yet published is cancelled (``round:cancel@N``: the
rounds are counted among the calls); and a call, NIXL's or a user step's, cut short by a
Ctrl-C as it starts (``release_dlist_handle:interrupt@N``, ``verify:interrupt@N``), after
which the job waits where the call left it (in the step's state, say) for the next poll
(not with ``parent``).
The explorer runs the scenario with no fault, then with every single fault at every call that
run made, then every pair, and so on up to a bound, in order of the number of faults (so the
first violation found is a shortest one). The real tier and driver run every path, with the
lifecycle under test (the shipped one, or a user's own declaration). The report names the
declared transitions no path took, of which nothing was checked; and a path whose run makes
other calls before its fault than the run it came from stops the exploration
(:class:`NotRepeatable`: a step answering otherwise from run to run).

Checked on every path (:class:`Invariant`):

* every submitted job publishes exactly one result, and only after its transfer handle was
  released; with finitely many faults every job publishes in the end (liveness);
* a transfer handle is released at most once, never while its transfer may still run, and the
  remote descriptors are released and deregistered only after it;
* a job whose transfer finished (DONE) publishes success; one that failed publishes failure;
* no NIXL misuse the fake agent detects, and no exception escapes the tier.

A lifecycle with steps of its own (an effect such as ``verify``, made by a function the tier is
given: ``explore(machine, steps={...})``) runs them on every path, and each step call is a call
like NIXL's: it raises at every step too (``verify:raise@1``). A step that raises, or gives an
answer that decides its job fails (its edge runs one of kvfsm's actions latching failure, or,
latching no success itself, enters a state named a failure state from which the job can take no
step running kvfsm's ``latch_success``: not an answer into a state that checks again and may
match; an action of the user's own that latches is not seen), makes its job's expected outcome a
failure (the report names the jobs failing so on the path with no fault), unless the outcome was
latched before the step (a best-effort step after it decides nothing) or the answer's edge
retries the step in place; a step whose tries are given up (EXHAUSTED) makes it a failure too. A
step returning what the tier refuses as an answer (what its event does not carry: the driver's
own check, in its words) is a violation on any path (the tier takes it as RAISED); one raising
by itself on the path with no fault injected, where that decides its job's outcome (at once, or
as it keeps raising until its tries are given up), is one there (a step broken, or given
wrongly: a class where its instance belongs); a raise retried in place, or a best-effort step's
after the outcome was latched, decides nothing and is none. A step answering a failure on
purpose is none, but :meth:`Exploration.report` names each job that failed on that path, with
its reason (:attr:`Exploration.fault_free`). A violation about a failure a job published carries
the reason it published (:attr:`Violation.reason`).

A violating path prints as a fault spec (``mode=1;check_xfer_state:raise@1,...``) that
:func:`replay` runs again, step by step.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import enum
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvfsm.driver import MachineRefused, StepFunction, _step_answer, check_runnable
from kvfsm.engine import COMPILE_LISTENERS, CompiledMachine, Declaration, Edge
from kvfsm.lifecycle import TRANSFER_MACHINE, Answer, TransferEvent
from kvfsm.machines.transfer import latch_cancelled, latch_failure, latch_success, quarantine
from kvfsm.policy import RetryPolicy
from kvfsm.testing.fake_agent import FakeNixlAgent
from kvfsm.testing.faults import (
    FAULTABLE_CALLS,
    STATUS_CALLS,
    FakeNixlError,
    Fault,
    Raise,
    ReturnErr,
    StayProc,
    fault_kind,
)
from kvfsm.tiers.base import SecondaryTier
from kvfsm.tiers.object_store import ObjectStoreTier
from kvfsm.trace import BareRecord, trace_steps
from kvfsm.transfer import NO_REASON, FailureKind, JobResult, TransferJob

__all__ = [
    "CancelAll",
    "Choice",
    "Exploration",
    "FaultFree",
    "Interrupt",
    "Invariant",
    "Late",
    "NotRepeatable",
    "Path",
    "Violation",
    "explore",
    "explore_table",
    "parse_path",
    "replay",
]


class Invariant(enum.Enum):
    """What must hold on every path; the value is how a violation reads."""

    ONE_RESULT = "a job published more than one result"
    LIVENESS = "a job never published a result although the faults ran out"
    RELEASE_BEFORE_PUBLISH = "a job published before its transfer handle was released"
    RELEASE_ONCE = "a transfer handle was released twice"
    RELEASE_WHEN_OVER = "a transfer handle was released while its transfer may still run"
    RELEASE_BEFORE_CLEANUP = "descriptors were released before the transfer handle"
    HANDLE_LEAK = "a transfer handle was never released"
    DESCRIPTOR_LEAK = ("descriptors or registrations were still held after shutdown that no "
                       "recorded leak accounts for")
    OUTCOME = "a job published a result other than its transfer's outcome"
    REASON = "a failed job published no reason (nothing latched why it failed, nor an error)"
    NO_MISUSE = "the agent saw a call that would crash real NIXL"
    NO_ESCAPE = "an exception escaped the tier"
    PINS = ("a primary block was left pinned, half-written or retired, other than for a job "
            "whose transfer NIXL may still run (with the parent)")
    BLOCKS_IN_USE = ("a job's result said blocks_in_use other than exactly when NIXL may still "
                     "run its transfer (a failure letting the blocks be reused under it)")
    ACTION_RAISED = "an action raised while firing a declared event"
    STEP_RAISED = ("a step of the machine's own raised by itself on the path with no fault "
                   "injected (a step broken, or given wrongly)")
    STEP_ANSWER = ("a step of the machine's own answered what its event does not carry (the "
                   "tier takes it as RAISED)")
    DEAD_END = "a reachable state from which no final state can be reached"


@dataclass(frozen=True, slots=True)
class Late:
    """A state check answers "PROC", and by the next poll the tier's clock has passed its
    running bound (``max_running_seconds``): every transfer NIXL still runs is then given up
    (EXHAUSTED on its state check), as a tier gives up a transfer stuck for that long. Written
    ``check_xfer_state:late@N`` in a path."""


@dataclass(frozen=True, slots=True)
class CancelAll:
    """As a poll round begins, every job not yet published is cancelled (``cancel()``, as an
    engine aborting its requests does), wherever each is. The rounds are counted among the
    calls, as ``round``: written ``round:cancel@N`` in a path."""


@dataclass(frozen=True, slots=True)
class Interrupt:
    """A call, NIXL's or one of the machine's own steps, is cut short by a Ctrl-C as it
    starts: KeyboardInterrupt is raised before it does anything, as a signal handler's would
    be, out of the tier's call that made it (a submit, a poll, a shutdown); the next call of
    the tier mends its books and makes the call again, or asks NIXL where the transfer is.
    Written ``release_dlist_handle:interrupt@N`` or ``verify:interrupt@N`` (not with
    ``parent``)."""


@dataclass(frozen=True, slots=True)
class Choice:
    """One injected fault: the ``occurrence``-th call of ``call`` answers ``fault``."""

    call: str
    occurrence: int
    fault: Fault | Late | CancelAll | Interrupt

    def __str__(self) -> str:
        kind = ("late" if isinstance(self.fault, Late) else "cancel"
                if isinstance(self.fault, CancelAll) else "interrupt"
                if isinstance(self.fault, Interrupt) else fault_kind(self.fault))
        return f"{self.call}:{kind}@{self.occurrence}"


@dataclass(frozen=True, slots=True)
class Path:
    """A run: the agent's mode (polls until a transfer completes; 0: at once) and its faults."""

    polls: int
    choices: tuple[Choice, ...] = ()

    def __str__(self) -> str:
        return f"mode={self.polls};" + ",".join(str(c) for c in self.choices)


@dataclass(frozen=True, slots=True)
class Violation:
    """An invariant that failed on a path."""

    invariant: Invariant
    job_id: int | None
    detail: str
    #: the reason the job published with its failure (``str(JobResult.reason)``), when the
    #: violation concerns a failure it published: what the tier said went wrong
    reason: str | None = None

    def __str__(self) -> str:
        job = f" (job {self.job_id})" if self.job_id is not None else ""
        why = f" (its reason: {self.reason})" if self.reason is not None else ""
        return f"{self.invariant.name}{job}: {self.invariant.value}: {self.detail}{why}"


@dataclass
class _Xfer:
    """What the explorer saw NIXL do with one transfer handle of a job (an object-store job
    makes one per block)."""

    posted: bool = False  # transfer() was called with it
    status: str | None = None  # the last status NIXL answered for it: PROC, DONE, FAILED
    released: bool = False

    @property
    def may_run(self) -> bool:
        """NIXL may be running it: posted and not said to be over since, or said to run (a
        stall answers PROC for a transfer whose post a Ctrl-C cut short, too)."""
        return self.status == "PROC" or (self.posted and self.status is None)


@dataclass
class _Job:
    """What the explorer saw NIXL do for one job."""

    #: its transfer handles, by id, in the order they were made
    xfers: dict[int, _Xfer] = field(default_factory=dict)
    remote: Any = None
    files: Any = None
    failed: bool = False  # a call of its own failed (a registration, a post, a state check)
    outcome: bool | None = None  # the first end NIXL answered: True DONE, False failed
    results: list[JobResult] = field(default_factory=list)
    #: cancelled while NIXL still ran it: its outcome must be failure
    cancelled_running: bool = False
    #: cancelled once NIXL had said its transfer ended: its outcome stands (a cancel of a
    #: transfer that ended keeps its outcome, as the tier's cancel promises)
    cancelled_over: bool = False
    #: given up by the running bound while NIXL ran it (its state check's EXHAUSTED): its
    #: outcome must be failure, whatever NIXL said after (a lifecycle may wait for NIXL's end)
    given_up_running: bool = False
    #: the final state it was published from (PUBLISHED, or QUARANTINED)
    final: Any = None
    #: published from a final failure state: its outcome must be failure
    failed_final: bool = False
    #: published from a final failure state with a transfer handle never released
    #: (quarantined): its handles are held for good
    held: bool = False
    #: a step of the machine's own raised, or gave an answer that decides the job fails
    #: (:func:`_fails`): the job must fail
    step_failed: bool = False
    #: the steps of the machine's own made before its outcome was latched (those whose
    #: give-up, EXHAUSTED, decides it)
    deciding: set[str] = field(default_factory=set)
    #: by step, what it raised by itself since it last answered, where the raise decided
    #: nothing (retried in place, or after the outcome was latched): a violation on the path
    #: with no fault injected only if those tries are given up (:func:`_final`)
    raising: dict[str, list[str]] = field(default_factory=dict)
    #: submitted before a ``late`` check: past the running bound, NIXL may still run it when
    #: it is given up
    past_bound: bool = False
    #: NIXL answered its state in a call of the tier that a Ctrl-C then cut short: the tier
    #: may not have heard the answer (it asks again on its next poll)
    unheard: bool = False

    @property
    def status(self) -> str | None:
        """PROC while one of its transfers may run (its last answer PROC), else FAILED once
        a call of its own failed, DONE once each of its transfers answered DONE; else None."""
        statuses = [xfer.status for xfer in self.xfers.values()]
        if "PROC" in statuses:
            return "PROC"
        if self.failed:
            return "FAILED"
        return "DONE" if statuses and all(s == "DONE" for s in statuses) else None

    @property
    def released(self) -> bool:
        """Every transfer handle it made was released."""
        return all(xfer.released for xfer in self.xfers.values())

    @property
    def may_run(self) -> bool:
        """A transfer of it was posted, NIXL never said it is over, and its handle is held:
        NIXL may still move its blocks."""
        return any(xfer.may_run and not xfer.released for xfer in self.xfers.values())


class _WatchedAgent(FakeNixlAgent):
    """The fake agent, watching which job each handle belongs to and checking call order."""

    def __init__(self, polls: int) -> None:
        super().__init__(name="explorer", complete_after_polls=polls)
        self.jobs: dict[int, _Job] = {}
        self.current: int | None = None  # the job being submitted
        self.violations: list[Violation] = []
        self._by_handle: dict[int, int] = {}
        #: the state checks (by number) after which the clock passes the running bound
        self.late: set[int] = set()
        #: the poll rounds (by number) before which every unpublished job is cancelled
        self.cancel_rounds: set[int] = set()
        #: the NIXL calls (name, number) a Ctrl-C cuts short as they start
        self.interrupted: set[tuple[str, int]] = set()
        #: the jobs whose state NIXL answered since the tier's call under way began, with
        #: what the explorer knew of their end before (failed, outcome)
        self.answered: dict[int, tuple[bool, bool | None]] = {}
        self._rounds = 0
        self.tier: SecondaryTier | None = None
        self._checks = 0
        #: the calls of the machine's own steps that raised by themselves (no fault injected
        #: into them) and so decided their job's outcome, at once or when their tries were
        #: given up (EXHAUSTED): (job id, what it raised)
        self.step_errors: list[tuple[int | None, str]] = []

    def next_round(self) -> bool:
        """A poll round begins: counted among the calls (``round``); True when the path
        cancels every unpublished job before it."""
        self.calls.append(ROUND)
        self._rounds += 1
        return self._rounds in self.cancel_rounds

    def _enter(self, call: str) -> Any:
        fault = super()._enter(call)
        if self.interrupted and (call, self.faults.count(call)) in self.interrupted:
            raise KeyboardInterrupt  # as the call starts: it did nothing
        return fault

    def cut_short(self) -> None:
        """A Ctrl-C cut the tier's call short: what NIXL answered in it may be unheard. The
        tier heard a job's end if its record left the running states; if not, the end NIXL
        answered is not the job's outcome yet: the answer the tier hears when it asks again
        is (F3: the first it hears)."""
        tier = self.tier
        running = () if tier is None else tier._runner.running_states
        for job_id, (failed, outcome) in self.answered.items():
            job = self.jobs[job_id]
            job.unheard = True
            if tier is not None and tier.state_of(job_id) in running:
                transfer = tier.transfer_of(job_id)
                split = None if transfer is None else transfer.split
                if split is None or split.failure is None:  # (a block's failure is kept)
                    job.failed, job.outcome = failed, outcome
        self.answered.clear()

    def job_of(self, handle: Any) -> _Job | None:
        job_id = self._by_handle.get(id(handle))
        return None if job_id is None else self.jobs[job_id]

    def _violation(self, invariant: Invariant, job: int | None, detail: str) -> None:
        self.violations.append(Violation(invariant, job, detail))

    def _submitting(self) -> _Job | None:
        return None if self.current is None else self.jobs[self.current]

    def _own(self, handle: Any) -> None:
        if self.current is not None:
            self._by_handle[id(handle)] = self.current

    def _failed(self, job: _Job | None) -> None:
        if job is not None:
            job.failed = True
            if job.outcome is None:
                job.outcome = False

    def register_memory(self, reg_list: Any, mem_type: str | None = None,
                        backends: Sequence[str] = ()) -> Any:
        job = self._submitting()
        try:
            files = super().register_memory(reg_list, mem_type, backends)
        except Exception:
            self._failed(job)
            raise
        if job is not None and mem_type == "OBJ":
            job.files = files
            self._own(files)
        return files

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: str | None = None,
                        backends: Sequence[str] = ()) -> Any:
        job = self._submitting()
        try:
            handle = super().prep_xfer_dlist(agent_name, xfer_list, mem_type, backends)
        except Exception:
            self._failed(job)
            raise
        if job is not None and agent_name == self.name:
            job.remote = handle
            self._own(handle)
        return handle

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        job = self._submitting()
        try:
            handle = super().make_prepped_xfer(*args, **kwargs)
        except Exception:
            self._failed(job)
            raise
        if job is not None:
            job.xfers[id(handle)] = _Xfer()
            self._own(handle)
        return handle

    def transfer(self, handle: Any, notif_msg: bytes | str = b"") -> str:
        job = self.job_of(handle)
        seen = None if job is None else job.xfers.get(id(handle))
        if seen is not None:
            seen.posted = True
        try:
            return self._status(handle,
                                lambda: super(_WatchedAgent, self).transfer(handle, notif_msg))
        except KeyboardInterrupt:  # (the fake posts nothing a Ctrl-C cuts short)
            if seen is not None:
                seen.posted = False
            raise

    def check_xfer_state(self, handle: Any) -> str:
        self._checks += 1
        if self._checks in self.late and self.tier is not None:
            _pass_running_bound(self.tier)
            for job in self.jobs.values():  # those submitted so far, not those to come
                job.past_bound = True
        return self._status(handle, lambda: super(_WatchedAgent, self).check_xfer_state(handle))

    def _status(self, handle: Any, call: Callable[[], str]) -> str:
        job = self.job_of(handle)
        seen = None if job is None else job.xfers.get(id(handle))
        if job is not None and seen is not None:  # (what the explorer expected before it)
            self.answered.setdefault(self._by_handle[id(handle)], (job.failed, job.outcome))
        try:
            status = call()
        except Exception:
            if seen is not None:
                seen.status = "FAILED"
            self._failed(job)
            raise
        if job is not None and seen is not None:
            seen.status = status if status in {"DONE", "PROC"} else "FAILED"
            if seen.status == "FAILED":
                self._failed(job)
            elif job.status == "DONE" and job.outcome is None:  # the job's every transfer
                job.outcome = True
        return status

    def release_xfer_handle(self, handle: Any) -> None:
        job = self.job_of(handle)
        seen = None if job is None else job.xfers.get(id(handle))
        if job is not None and seen is not None:
            if seen.released:
                self._violation(Invariant.RELEASE_ONCE, self._by_handle[id(handle)],
                                "release_xfer_handle after it had succeeded")
            if seen.may_run:
                self._violation(Invariant.RELEASE_WHEN_OVER, self._by_handle[id(handle)],
                                f"NIXL's last answer for the transfer was {seen.status}")
        super().release_xfer_handle(handle)
        if seen is not None:
            seen.released = True

    def release_dlist_handle(self, handle: Any) -> None:
        self._check_cleanup("release_dlist_handle", handle)
        super().release_dlist_handle(handle)

    def deregister_memory(self, dereg_list: Any, backends: Sequence[str] = ()) -> None:
        self._check_cleanup("deregister_memory", dereg_list)
        super().deregister_memory(dereg_list, backends)

    def _check_cleanup(self, call: str, handle: Any) -> None:
        job = self.job_of(handle)
        if job is not None and job.xfers and not job.released:
            self._violation(Invariant.RELEASE_BEFORE_CLEANUP, self._by_handle[id(handle)],
                            f"{call} while the transfer handle was still held")


#: the scenario's jobs: (job id, keys, block ids, is a load), submitted in this order, with a
#: poll of every transfer between the stores and the load
_SCENARIO: tuple[tuple[int, tuple[str, ...], tuple[int, ...], bool], ...] = (
    (0, ("a", "b"), (0, 1), False),
    (1, ("c",), (2,), False),
    (2, ("a",), (3,), True),
)


def _with_stalls(path: Path, max_polls: int) -> int:
    """The polls a run of ``path`` gets before a job without a result is a liveness violation:
    ``max_polls``, and as many more as its stalls hold answers (a stall of more polls than a
    run has is no violation: the transfer still runs)."""
    return max_polls + sum(choice.fault.polls for choice in path.choices
                           if isinstance(choice.fault, StayProc))


def _run(path: Path, machine: Declaration[Any, Any], max_polls: int,
         steps: dict[str, StepFunction] | None = None,
         ) -> tuple[list[str], list[Violation], SecondaryTier, dict[int, _Job]]:
    """Run the scenario on ``path``; returns the calls made, the violations seen, the tier,
    and what the explorer saw of each job."""
    max_polls = _with_stalls(path, max_polls)
    agent = _WatchedAgent(path.polls)
    watched = _inject(agent, path, machine, steps or {})
    cache = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
    tier = ObjectStoreTier(cache, agent=agent, machine=machine, probe_agent=_NoProbes(),
                           policy=_POLICY, steps=watched)
    agent.tier = tier
    tier.on_published.append(lambda transfer: _final(agent, transfer, machine))
    violations = agent.violations

    def collect() -> None:
        agent.answered.clear()
        try:
            results = tier.get_finished_jobs()
        except KeyboardInterrupt:  # (a Ctrl-C the path made: the next round goes on)
            agent.cut_short()
            return
        except Exception as error:
            violations.append(Violation(Invariant.NO_ESCAPE, None,
                                        f"get_finished_jobs raised {_described(error)}"))
            return
        for result in results:
            _published(agent, result, violations)

    for index, (job_id, keys, blocks, load) in enumerate(_SCENARIO):
        if load and index:
            collect()
            _cancel(agent, tier, 1)  # a job cancelled while the others go on
        agent.jobs[job_id] = _Job()
        agent.current = job_id
        agent.answered.clear()
        try:
            submitted = TransferJob(job_id, keys, blocks, is_promotion=load)
            (tier.submit_load if load else tier.submit_store)(submitted)
        except KeyboardInterrupt:  # a Ctrl-C in a call the submit made: the job is in if
            agent.cut_short()
            if not tier.owes(job_id):  # the tier owes it a result
                agent.jobs[job_id].results.append(JobResult(job_id, False))  # none is due
        except Exception as error:
            violations.append(Violation(Invariant.NO_ESCAPE, job_id,
                                        f"submit raised {_described(error)}"))
            agent.jobs[job_id].results.append(JobResult(job_id, False))  # no result is due
        finally:
            agent.current = None
    for _ in range(max_polls):
        if not tier.has_pending_work():
            break
        if agent.next_round():
            for job_id in sorted(agent.jobs):
                _cancel(agent, tier, job_id)
        collect()
    _check_end(agent, tier, max_polls, busy=tier.has_pending_work(), fault_free=not path.choices)
    return list(agent.calls), violations, tier, agent.jobs


#: a running bound no path reaches but through a ``late`` check
_RUNNING_BOUND = 3600.0
#: a finite retry bound, so that paths reach QUARANTINED too; and a running bound
_POLICY = RetryPolicy(max_attempts=2, max_seconds=None, max_running_seconds=_RUNNING_BOUND)


def _pass_running_bound(tier: SecondaryTier) -> None:
    """The tier's clock passes its running bound for every transfer submitted so far: each
    started as long before as the bound (the order it keeps them in stays as it was)."""
    runner = tier._runner
    started = {id(t): t for t in (*runner.records.values(), *(runner._by_start or ()))}
    for transfer in started.values():
        transfer.started_at -= _RUNNING_BOUND


def _arm(agent: _WatchedAgent, path: Path, steps: dict[str, StepFunction], machine: str,
         ) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """(:func:`_inject`) Arm the path's faults in NIXL's calls and its rounds; returns the
    step calls (name, number) that raise and those a Ctrl-C cuts short."""
    armed = {(c.call, c.occurrence) for c in path.choices
             if c.call in steps and not isinstance(c.fault, Interrupt)}
    interrupted = {(c.call, c.occurrence) for c in path.choices if isinstance(c.fault, Interrupt)}
    for choice in path.choices:
        if isinstance(choice.fault, Late):  # a check that answers PROC, then the bound
            agent.late.add(choice.occurrence)
            agent.inject(choice.call, StayProc(1), at=choice.occurrence)
        elif isinstance(choice.fault, CancelAll):
            agent.cancel_rounds.add(choice.occurrence)
        elif isinstance(choice.fault, Interrupt):
            if choice.call not in steps and choice.call not in agent.faults.faultable:
                raise ValueError(f"{choice}: a Ctrl-C cuts short a NIXL call or a step of "
                                 f"the machine's own (its steps: "
                                 f"{', '.join(sorted(steps)) or 'none'})")
            if choice.call not in steps:
                agent.interrupted.add((choice.call, choice.occurrence))
        elif choice.call not in steps:
            if choice.call not in agent.faults.faultable:  # (a step's name, say, of a machine
                # not given: --replay without --machine and --steps)
                raise ValueError(f"{choice}: {choice.call!r} is neither a NIXL call (one of "
                                 f"{', '.join(sorted(agent.faults.faultable))}) nor a step of "
                                 f"machine {machine!r} (its steps: "
                                 f"{', '.join(sorted(steps)) or 'none'}); a path of another "
                                 "machine replays with its --machine and --steps")
            agent.inject(choice.call, choice.fault, at=choice.occurrence)
    return armed, interrupted


def _inject(agent: _WatchedAgent, path: Path, machine: Declaration[Any, Any],
            steps: dict[str, StepFunction]) -> dict[str, StepFunction]:
    """Arm the path's faults: NIXL's in the agent, the steps' in the steps, which are
    returned watched (each call recorded and numbered among the agent's calls), a fresh copy
    of them all: what a step keeps (a checksum it recorded) stays on its path, so a path
    replays as it ran, and the step objects given are never called themselves (steps that
    cannot be copied are shared, as given)."""
    steps = _fresh(steps)
    table = machine.compile(listen=False).table
    armed, interrupted = _arm(agent, path, steps, machine.name)
    counts = dict.fromkeys(steps, 0)

    def decides(transfer: Any, name: str, answer: Any) -> bool:
        """Whether this answer of step ``name`` decides the job's outcome as a failure: the
        outcome is not latched yet (a step after it, a best-effort notice say, cannot change
        it), and the answer's edge is no retry (a loop back to where the step is made again:
        only the give-up, EXHAUSTED, ends the tries: :func:`_final`)."""
        if transfer.success is not None:
            return False
        taken = table.get(transfer.state, {}).get(name, {}).get(answer)
        return taken is None or taken.dest is not transfer.state

    def into_failure(transfer: Any, name: str, answer: Any) -> bool:
        """Whether this answer of step ``name`` decides its job fails (:func:`_fails`)."""
        taken = table.get(transfer.state, {}).get(name, {}).get(answer)
        return taken is not None and _fails(taken, machine, table)

    def watched(name: str, step: StepFunction) -> StepFunction:
        def run(transfer: Any, primary: Any) -> Any:
            agent.calls.append(name)
            counts[name] += 1
            seen = agent.jobs.get(transfer.job_id)
            if seen is not None and transfer.success is None:
                seen.deciding.add(name)  # (its give-up then decides the outcome: _final)
            if (name, counts[name]) in interrupted:
                raise KeyboardInterrupt  # (before the step: it answered nothing)
            injected = (name, counts[name]) in armed
            try:
                if injected:
                    raise FakeNixlError(Raise().code)
                answered = step(transfer, primary)
            except Exception as error:
                deciding = decides(transfer, name, Answer.RAISED)
                if not injected:  # raised by itself: a violation on the path with no fault
                    # injected if it decides the outcome, now or when its tries are given up
                    what = f"{name} raised {_described(error)}"
                    if deciding or seen is None:
                        agent.step_errors.append((transfer.job_id, what))
                    else:  # absorbed: retried in place, or after the outcome was latched
                        seen.raising.setdefault(name, []).append(what)
                if seen is not None and deciding:
                    seen.step_failed = True
                raise
            if seen is not None:
                seen.raising.pop(name, None)  # it answered: its raises before were retried
            try:  # the driver's own reading of what a step returned (TransferDriver.step)
                answer, _ = _step_answer(name, answered, machine.answers.get(name, ()))
            except Exception as error:  # StepMisanswered: the tier takes it as RAISED, so
                # does the job's expected outcome; the step is wrong on whatever path it does
                agent._violation(Invariant.STEP_ANSWER, transfer.job_id,
                                 str(error) if isinstance(error, TypeError)
                                 else f"{name} returned what the tier cannot read: "
                                      f"{_described(error)}")
                answer = Answer.RAISED
            if seen is not None and (answer is Answer.RAISED
                                     or into_failure(transfer, name, answer)) \
                    and decides(transfer, name, answer):
                seen.step_failed = True
            return answered

        return run

    return {name: watched(name, step) for name, step in steps.items()}


def _fails(step: Any, machine: Declaration[Any, Any], table: Any) -> bool:
    """Whether taking ``step`` (``table``'s) decides that a job whose outcome is not latched
    yet fails: its edge runs one of kvfsm's actions that latch failure (under any name the
    machine gives it); or it latches no success itself, and enters a state the machine names a
    failure state from which the job can take no step running kvfsm's ``latch_success``. So an
    answer into a state that checks again, and may match, decides nothing, wherever it starts;
    a failure latched on a later edge (the release out of the state it led to) counts. Read
    from the table alone: no action of the user's runs for it (one of the user's own that
    latches, a wrapper of kvfsm's say, is not seen, nor an outcome an action decides from what
    it kept elsewhere)."""
    if any(action in _LATCHING_FAILURE for action in step.actions):
        return True
    if latch_success in step.actions or step.dest not in machine.failure_states:
        return False
    seen, queue = {step.dest}, [step.dest]
    while queue:
        for row in table.get(queue.pop(), {}).values():
            for after in row.values():
                if latch_success in after.actions:
                    return False  # (the job may yet succeed)
                if after.dest not in seen:
                    seen.add(after.dest)
                    queue.append(after.dest)
    return True


#: kvfsm's actions that latch failure (those of the shipped lifecycle)
_LATCHING_FAILURE = frozenset({latch_failure, latch_cancelled, quarantine})


def _fresh(steps: dict[str, StepFunction]) -> dict[str, StepFunction]:
    """A copy of the steps and what they keep, made as one (steps sharing an object share its
    copy), or the steps themselves if they cannot be copied."""
    try:
        return copy.deepcopy(steps)
    except Exception:  # (a lock, a file it holds open): shared across paths, as given
        return steps


def _final(agent: _WatchedAgent, transfer: Any, machine: Declaration[Any, Any]) -> None:
    seen = agent.jobs.get(transfer.job_id)
    if seen is not None:
        seen.final = transfer.state
        # held for good: published from a final failure state with a handle NIXL saw made
        # and never released (one published from any other state so is a release skipped)
        seen.failed_final = transfer.state in machine.final & machine.failure_states
        seen.held = seen.failed_final and bool(seen.xfers) and not seen.released
        seen.given_up_running = any(
            event == TransferEvent.POLL and answer == Answer.EXHAUSTED.name
            for event, answer, *_ in trace_steps(transfer))
        if seen.deciding:  # a deciding step's tries given up: it decides the outcome, and
            # the raises that spent them count as deciding (STEP_RAISED: _check_end)
            given_up = {event for event, answer, *_ in trace_steps(transfer)
                        if event in seen.deciding and answer == Answer.EXHAUSTED.name}
            seen.step_failed = seen.step_failed or bool(given_up)
            agent.step_errors += [(transfer.job_id, what) for event in sorted(given_up)
                                  for what in seen.raising.get(event, ())]


def _cancel(agent: _WatchedAgent, tier: SecondaryTier, job_id: int) -> None:
    if tier.state_of(job_id) is None:
        return  # published already: nothing to cancel
    seen = agent.jobs[job_id]
    seen.cancelled_running = seen.cancelled_running or (  # (a cancel before stands)
        seen.status in {None, "PROC"} and seen.outcome is None) or (
        # NIXL said it is over, and a Ctrl-C cut short the poll that heard it: to the tier
        # it still runs (it asks again); a cancel now is of a running transfer
        seen.unheard and tier.state_of(job_id) in tier._runner.running_states) or (
        # NIXL is over, but a step of the lifecycle's own decides the outcome after it (a
        # checksum's), and the declared cancel there fails the job: the outcome a cancel
        # keeps is one latched, and none is yet
        _cancel_latches(tier, job_id))
    seen.cancelled_over = seen.cancelled_over or not seen.cancelled_running
    try:
        tier.cancel(job_id)
    except Exception as error:
        agent.violations.append(Violation(Invariant.NO_ESCAPE, job_id,
                                          f"cancel raised {_described(error)}"))


def _cancel_latches(tier: SecondaryTier, job_id: int) -> bool:
    """A cancel now latches the job's outcome, a failure: none is latched yet, and the
    lifecycle's cancel edge from the job's state runs one of kvfsm's latches of a failure."""
    record = tier._runner.records.get(job_id)
    if record is None or record.success is not None:
        return False
    step = tier._runner.table.get(record.state, {}).get(TransferEvent.CANCEL, {}).get(Answer.OK)
    return step is not None and any(action in (latch_failure, latch_cancelled)
                                    for action in step.actions)


def _state(tier: SecondaryTier, job_id: int) -> str:
    state = tier.state_of(job_id)
    return "unknown to the tier" if state is None else f"in {state.name}"


def _published(agent: _WatchedAgent, result: JobResult, violations: list[Violation]) -> None:
    job = agent.jobs.get(result.job_id)
    if job is None:
        violations.append(Violation(Invariant.ONE_RESULT, result.job_id, "never submitted"))
        return
    job.results.append(result)
    why = _why(result)
    if len(job.results) > 1:
        violations.append(Violation(Invariant.ONE_RESULT, result.job_id,
                                    f"{len(job.results)} results: " + ", ".join(
                                        f"success={r.success}" for r in job.results), why))
    # quarantined, its handle is held for good: once NIXL said the transfer is over, or, past
    # the running bound, while NIXL may still run it (the bound's give-up)
    quarantined = job.held and (not job.may_run or job.past_bound)
    if job.xfers and not job.released and not quarantined:
        violations.append(Violation(Invariant.RELEASE_BEFORE_PUBLISH, result.job_id,
                                    f"it published success={result.success} while its "
                                    "transfer handle was still held", why))
    expected = (bool(job.outcome) and not job.cancelled_running and not job.failed_final
                and not job.step_failed and not job.given_up_running)
    if result.success != expected:
        what = {True: "NIXL said the transfer finished (DONE)", False: "NIXL said the "
                "transfer failed", None: "NIXL had not said the transfer ended"}[job.outcome]
        if job.cancelled_running:
            what += ", after it was cancelled while running"
        elif job.cancelled_over and job.outcome and not result.success:
            what += (", then it was cancelled, which keeps the outcome of a transfer that "
                     "ended (the tier's cancel: it is never recomputed)")
        if job.given_up_running:
            what += ", after the running bound gave it up"
        if job.held:
            what += ", then it was quarantined"
        elif job.failed_final:
            what += f", then it ended in {job.final.name}, a failure state"
        if job.step_failed:
            what += ", then a step failed it"
        violations.append(Violation(
            Invariant.OUTCOME, result.job_id,
            f"{what}, so the job must publish success={expected}; it published "
            f"success={result.success}", why))
    if not result.success and (result.reason is None or (
            result.reason.kind is FailureKind.UNKNOWN and result.reason.error == NO_REASON)):
        violations.append(Violation(Invariant.REASON, result.job_id,
                                    f"its failure says {result.reason}"))
    in_use = job.may_run
    if result.blocks_in_use is not in_use:
        violations.append(Violation(
            Invariant.BLOCKS_IN_USE, result.job_id,
            f"it published blocks_in_use={result.blocks_in_use!r} while NIXL "
            + ("may still run its transfer" if in_use else "was done with its blocks"), why))


def _why(result: JobResult) -> str | None:
    """The reason a failed job published, as a violation about its result shows it."""
    return None if result.success or result.reason is None else str(result.reason)


def _described(error: BaseException) -> str:
    """An exception as a violation says it: its repr, and the notes kvfsm's engine adds (the
    action and the step that raised it)."""
    return repr(error) + "".join(f" ({note})" for note in getattr(error, "__notes__", ()))


class _NoProbes:
    """Lookups the tier has no answer for say MISS at once (no thread timing on any path)."""

    def query_memory(self, reg_list: Sequence[Any], *args: Any) -> list[None]:
        return [None] * len(reg_list)


def _run_with_parent(path: Path, machine: Declaration[Any, Any], max_polls: int,
                     steps: dict[str, StepFunction] | None = None,
                     ) -> tuple[list[str], list[Violation], SecondaryTier, dict[int, _Job]]:
    """The scenario through the parent: a CPU primary tier whose blocks the stores pin.

    Two stores cascade three ready blocks; once the first is finalized, block "a" is freed and
    loaded back while the other store may still run. At the end every pin must be 0 and no
    block half-written or retired, but those of jobs finalized as ``blocks_in_use`` (NIXL may
    still move them): a store's pins kept, a load's blocks retired; besides the invariants of
    the tier's own scenario.
    """
    from kvfsm.tiering import (  # noqa: PLC0415
        RETIRED,
        BookkeepingError,
        CPUPrimaryTier,
        Finalized,
        TieringManager,
    )

    max_polls = _with_stalls(path, max_polls)
    agent = _WatchedAgent(path.polls)
    watched = _inject(agent, path, machine, steps or {})
    primary = CPUPrimaryTier(4, 8, torch.float32)
    tier = _WatchedTier(primary.cache, agent=agent, machine=machine, probe_agent=_NoProbes(),
                        policy=_POLICY, steps=watched)
    agent.tier = tier
    tier.on_published.append(lambda transfer: _final(agent, transfer, machine))
    violations = agent.violations
    manager = TieringManager(primary, [tier])
    blocks = primary.allocate(["a", "b", "c"])
    primary.complete_write(blocks, True)

    finalized: list[Finalized] = []

    def step() -> None:
        try:
            finalized.extend(manager.step())
        except BookkeepingError as error:
            finalized.extend(error.finalized)
            violations.append(Violation(Invariant.ONE_RESULT, None, str(error)))
        except Exception as error:
            violations.append(Violation(Invariant.NO_ESCAPE, None,
                                        f"step raised {_described(error)}"))

    try:
        first = manager.store(blocks[:2])
        manager.store(blocks[2:])
        for _ in range(max_polls):
            step()
            if not any(s.job_id in first for s in manager.outstanding()):
                break
        if primary.pin_count(blocks[0]) == 0:
            primary.free([blocks[0]])
            manager.load(["a"])
        for _ in range(max_polls):
            if not manager.has_pending_work():
                break
            step()
    except Exception as error:
        violations.append(Violation(Invariant.NO_ESCAPE, None,
                                    f"the parent raised {_described(error)}"))
    held_pins = collections.Counter(block for done in finalized if done.blocks_in_use
                                    and not done.job.is_promotion for block in done.job.block_ids)
    retired = {block for done in finalized if done.blocks_in_use and done.job.is_promotion
               for block in done.job.block_ids}
    for block in range(primary.num_blocks):
        count = primary.pin_count(block)
        wanted = RETIRED if block in retired else held_pins[block]
        if count != wanted and (primary.key_of(block) is not None or count == RETIRED
                                or block in retired):
            violations.append(Violation(Invariant.PINS, None, f"block {block} has count {count}"
                                        + (f", not {wanted}" if wanted else "")))
    _check_end(agent, tier, max_polls, busy=manager.has_pending_work(),
               fault_free=not path.choices)
    return list(agent.calls), violations, tier, agent.jobs


class _WatchedTier(ObjectStoreTier):
    """The object-store tier, telling the watched agent which job each submit is for, and
    checking every result it hands to the parent."""

    agent: _WatchedAgent

    def submit_store(self, job: TransferJob) -> None:
        with self._for(job):
            super().submit_store(job)

    def submit_load(self, job: TransferJob) -> None:
        with self._for(job):
            super().submit_load(job)

    def get_finished_jobs(self) -> list[JobResult]:
        results = super().get_finished_jobs()
        for result in results:
            _published(self.agent, result, self.agent.violations)
        return results

    @contextlib.contextmanager
    def _for(self, job: TransferJob) -> Iterator[None]:
        self.agent.jobs[job.job_id], self.agent.current = _Job(), job.job_id
        try:
            yield
        finally:
            self.agent.current = None


def _check_end(agent: _WatchedAgent, tier: SecondaryTier, max_polls: int, *,
               busy: bool, fault_free: bool) -> None:
    """After the scenario: liveness, held handles, misuse; shut the tier down when idle. On
    the path with no fault injected, a step of the machine's own whose raise decided its job's
    outcome is a violation (once a job: the first such raise, and how many more)."""
    violations = agent.violations
    if fault_free:
        raised: dict[int | None, list[str]] = {}
        for job_id, what in agent.step_errors:
            raised.setdefault(job_id, []).append(what)
        for job_id, whats in raised.items():
            more = f" (and {len(whats) - 1} more time(s))" if len(whats) > 1 else ""
            violations.append(Violation(Invariant.STEP_RAISED, job_id, whats[0] + more))
    for job_id, seen in agent.jobs.items():
        if not seen.results:
            violations.append(Violation(Invariant.LIVENESS, job_id,
                                        f"still {_state(tier, job_id)} after {max_polls} polls"))
        elif seen.xfers and not seen.released and not seen.held:
            violations.append(Violation(Invariant.HANDLE_LEAK, job_id,
                                        f"published success={seen.results[0].success}, and "
                                        "its transfer handle is still held",
                                        _why(seen.results[0])))
    held = sum(1 for seen in agent.jobs.values() if seen.results and seen.held)
    counted = tier.stats()["quarantined"]
    if counted != held:
        violations.append(Violation(Invariant.HANDLE_LEAK, None,
                                    f"the tier counts {counted} quarantined transfer(s); "
                                    f"{held} published still holding a handle"))
    if not busy:
        for _ in range(len(agent.interrupted) + 1):  # a Ctrl-C the path put into the
            # shutdown's calls: once more
            try:
                tier.shutdown(timeout=0)
                break
            except KeyboardInterrupt:
                continue
        stats = tier.stats()
        if tier.closed and not stats["quarantined"]:  # (a quarantined transfer's handle is
            # held for good, and with it what it uses: its descriptors, the primary's)
            leaked = [leak.call for _, leak in stats["leaked"]]
            dlists, registered = agent.live_dlist_handles(), agent.live_registrations()
            if (dlists > leaked.count("release_dlist_handle")
                    or (registered and "deregister_memory" not in leaked)):
                violations.append(Violation(
                    Invariant.DESCRIPTOR_LEAK, None,
                    f"{dlists} descriptor list(s) and {registered} registered descriptor(s) "
                    f"still held after shutdown; leaks recorded: "
                    f"{leaked.count('release_dlist_handle')} release_dlist_handle, "
                    f"{leaked.count('deregister_memory')} deregister_memory"))
    violations += [Violation(Invariant.NO_MISUSE, None, misuse) for misuse in agent.misuses]


#: building the tier registers and preps the primary cache; no fault goes into those two calls
_CONSTRUCTION_CALLS = 2


def _alternatives(call: str, max_stall: int) -> list[Fault | Late | CancelAll]:
    if call == ROUND:
        return [CancelAll()]
    if call in STATUS_CALLS:
        late: list[Fault | Late | CancelAll] = [Late()] if call == "check_xfer_state" else []
        return [Raise(), ReturnErr(), *(StayProc(k) for k in range(1, max_stall + 1)), *late]
    return [Raise()]


#: how a poll round of the tier's scenario is counted among the calls
ROUND = "round"


@dataclass(frozen=True, slots=True)
class FaultFree:
    """What the jobs published on a path with no fault injected, of those whose transfers NIXL
    finished (DONE) and that were not cancelled while it ran them.

    A job among them that failed failed by a step of the machine's own: one that answered a
    failure (a test of the mismatch path, say), or raised (a violation:
    :attr:`Invariant.STEP_RAISED`). A scenario in which every job fails this way explores no
    path where it succeeds, so :meth:`Exploration.report` says so.
    """

    path: Path
    #: each such job's one result, by job id
    results: tuple[JobResult, ...]

    @property
    def failed(self) -> tuple[JobResult, ...]:
        """The results of those that failed."""
        return tuple(result for result in self.results if not result.success)

    def __str__(self) -> str:
        """``on the path with no fault injected, NIXL ending each transfer at its first state
        check (mode=1), 2 of 3 jobs whose transfers NIXL finished failed: jobs 0, 2: verify
        answered MISMATCH`` (the jobs, by reason; the explorer runs a path with no fault in
        each mode, and each has its line)."""
        by_reason: dict[str, list[str]] = {}
        for result in self.failed:
            by_reason.setdefault(str(result.reason), []).append(str(result.job_id))
        when = {0: "as it is posted", 1: "at its first state check"}.get(
            self.path.polls, f"after {self.path.polls} state checks")
        return (f"on the path with no fault injected, NIXL ending each transfer {when} "
                f"(mode={self.path.polls}), "
                f"{len(self.failed)} of {len(self.results)} jobs whose transfers NIXL finished "
                "failed: " + "; ".join(f"job{'s' if len(jobs) > 1 else ''} {', '.join(jobs)}: "
                                       f"{reason}" for reason, jobs in by_reason.items()))


def _fault_free(path: Path, jobs: dict[int, _Job]) -> FaultFree:
    return FaultFree(path, tuple(seen.results[0] for _, seen in sorted(jobs.items())
                                 if seen.results and seen.outcome
                                 and not seen.cancelled_running))


@dataclass
class Exploration:
    """What :func:`explore` found."""

    paths: int = 0
    calls: int = 0
    seconds: float = 0.0
    #: the shortest violating path, and what it violated
    counterexample: Path | None = None
    violations: list[Violation] = field(default_factory=list)
    #: the ``kvfsm explore`` options that explore the same machine the same way (``--machine``,
    #: ``--steps``, ``--parent``): the replay command printed must run the path on what found
    #: it, not on the shipped lifecycle
    options: tuple[str, ...] = ()
    #: what the jobs NIXL finished published on each path with no fault injected (one per
    #: mode the scenario ran in); a job failing there failed by a step's own answer
    fault_free: list[FaultFree] = field(default_factory=list)
    #: each declared transition (edge, and the answer taking it) and how often the paths
    #: explored took it; those never taken (:attr:`untaken`) are where the invariants were
    #: never put to the test
    taken: dict[tuple[Edge, str], int] = field(default_factory=dict)

    #: the states the machine declares unreachable (their transitions are not reported)
    unreachable: frozenset[str] = frozenset()

    @property
    def untaken(self) -> list[tuple[Edge, str]]:
        """The declared transitions no path explored took, as (edge, answer name), but those
        of states the machine declares unreachable."""
        return [pair for pair, count in self.taken.items()
                if not count and pair[0].source not in self.unreachable]

    @property
    def ok(self) -> bool:
        """True when no path violated an invariant."""
        return self.counterexample is None

    def report(self) -> str:
        """A few lines for people."""
        lines = [f"explored {self.paths} paths ({self.calls} NIXL calls) in "
                 f"{self.seconds:.2f} s: "
                 + ("0 violations" if self.ok else "VIOLATION")]
        lines += [str(run) for run in self.fault_free if run.failed]
        untaken = self.untaken
        if untaken and self.counterexample is None:  # (a run stopped at its first violation
            # took what it took: its counterexample is what to read)
            lines.append(f"{len(untaken)} of {len(self.taken)} declared transitions no path "
                         "took (nothing was checked of them): " + ", ".join(
                             f"{edge.source} -{edge.event}({answer})-> {edge.dest}"
                             for edge, answer in untaken))
        if self.counterexample is not None:
            lines.append(f"shortest violating path: {self.counterexample}")
            lines += [f"  {v}" for v in self.violations]
            command = ["kvfsm", "explore", *self.options, "--replay", str(self.counterexample)]
            lines.append(f"replay it with: {shlex.join(command)}")
        return "\n".join(lines)


def explore(
    machine: Declaration[Any, Any] = TRANSFER_MACHINE,
    *,
    steps: dict[str, StepFunction] | None = None,
    parent: bool = False,
    max_faults: int = 2,
    max_stall: int = 2,
    max_calls: int = 80,
    max_polls: int = 40,
    stop_at_first: bool = True,
    spec: str | None = None,
    steps_spec: str | None = None,
    progress: bool = False,
) -> Exploration:
    """Run the scenario on every path with at most ``max_faults`` faults; check every invariant.

    Args:
        machine: the lifecycle under test.
        steps: the functions behind the machine's own effects, as a tier is given them; each
            of their calls also raises at every step.
        parent: run the scenario through :class:`kvfsm.tiering.TieringManager` and its CPU
            primary tier, and check that every pin returns to 0 (but those of a job whose
            result says NIXL may still move its blocks: ``blocks_in_use``).
        max_faults: the most faults on one path (a "PROC for k polls" counts as one).
        max_stall: the most extra "PROC" answers one stall fault adds.
        max_calls: calls past this position in a run get no faults (bounds the depth).
        max_polls: polls after the last submit before a job without a result is a liveness
            violation, and as many more as the path's stalls hold answers; far more than any
            path with ``max_faults`` faults needs.
        stop_at_first: stop at the first violating path (a shortest one).
        spec: how ``kvfsm explore --machine`` names ``machine`` (``module:ATTRIBUTE``), for the
            replay command of :meth:`Exploration.report`; not needed for kvfsm's own machines.
        steps_spec: how ``kvfsm explore --steps`` names ``steps`` (``module:ATTRIBUTE``), for
            the same command.
        progress: show progress bars on stderr, one per mode and number of faults (the paths
            with one more fault are known once these ran): rate and time left.
    """
    found = Exploration(options=_options(machine, spec, parent, steps, steps_spec))
    found.taken = {(step.edge, step.answer.name): 0
                   for step in machine.compile(listen=False).steps()}
    found.unreachable = frozenset(state.name for state in machine.unreachable)
    with Verdict() as verdict:
        _explore(found, verdict.of(machine), machine, steps, parent, max_faults, max_stall,
                 max_calls, max_polls, stop_at_first, progress)
        verdict.counted = found.ok
    return found


class Verdict:
    """Whether what a test tool ran counts as tested (transition coverage): each machine the
    tool's thread compiles while it runs is marked with it (:attr:`CompiledMachine.verdict`),
    and :attr:`counted` is set once the tool is over, True only if it found no violation: the
    transitions a machine breaking an invariant took (a broken variant, a step given wrongly,
    explored by a test that expects the violation) are no transitions tested. Machines other
    threads compile meanwhile are not marked, and one a tool inside another compiles is the
    inner tool's. As a context manager it marks until its block ends (uncounted unless the
    block set :attr:`counted`, as its last statement: one that raised does not);
    :meth:`of` lists a declaration's compilations as they come."""

    def __init__(self) -> None:
        self.counted = False
        self._thread = threading.get_ident()
        self._of: list[tuple[Declaration[Any, Any], list[CompiledMachine[Any, Any]]]] = []

    def of(self, machine: Declaration[Any, Any]) -> list[CompiledMachine[Any, Any]]:
        """The compiled machines of ``machine`` the thread makes from now on, as it makes them
        (a list its user may empty)."""
        compiled: list[CompiledMachine[Any, Any]] = []
        self._of.append((machine, compiled))
        return compiled

    def _listen(self, made: CompiledMachine[Any, Any]) -> None:
        if threading.get_ident() != self._thread:
            return
        if made.verdict is None:
            made.verdict = self
        for machine, compiled in self._of:
            if made.declaration is machine:
                compiled.append(made)

    def __enter__(self) -> Verdict:
        COMPILE_LISTENERS.insert(0, self._listen)  # (first: marked before coverage keeps it)
        return self

    def __exit__(self, *exc: object) -> None:
        COMPILE_LISTENERS.remove(self._listen)


def _explore(found: Exploration, compiled: list[CompiledMachine[Any, Any]],
             machine: Declaration[Any, Any], steps: dict[str, StepFunction] | None,
             parent: bool, max_faults: int, max_stall: int, max_calls: int, max_polls: int,
             stop_at_first: bool, progress: bool) -> Exploration:
    """(:func:`explore`, the transitions each path's tier takes counted in ``found``.)"""
    started = time.perf_counter()
    for polls in (1, 0):  # transfers that complete on a poll, and ones that complete at once
        level: list[tuple[Path, int, list[str] | None]] = [(Path(polls), -1, None)]
        for depth in range(max_faults + 1):
            children: list[tuple[Path, int, list[str] | None]] = []
            with _level_bar(progress, len(level), polls, depth) as bar:
                for path, last, before in level:
                    calls, violations, _, jobs = (_run_with_parent if parent else _run)(
                        path, machine, max_polls, steps)
                    _count_taken(found, compiled)
                    if before is not None and calls[:last + 1] != before[:last + 1]:
                        raise NotRepeatable(_not_repeated(path, last, calls, before))
                    if not path.choices:
                        found.fault_free.append(_fault_free(path, jobs))
                    found.paths += 1
                    found.calls += len(calls) - calls.count(ROUND)
                    bar.update()
                    if violations and found.counterexample is None:
                        found.counterexample, found.violations = path, violations
                        if stop_at_first:
                            found.seconds = time.perf_counter() - started
                            return found
                    if depth < max_faults:
                        first = max(last, _CONSTRUCTION_CALLS - 1)
                        children += ((child, position, calls) for child, position in
                                     _children(path, first, calls, max_stall, max_calls,
                                               () if parent else
                                               (*FAULTABLE_CALLS, *(steps or ()))))
            level = children
    found.seconds = time.perf_counter() - started
    return found


class NotRepeatable(RuntimeError):
    """A path, run again with one more fault, made other calls before that fault than the run
    it came from: the explorer cannot put a fault where it meant to (a step answering
    differently from run to run)."""


def _not_repeated(path: Path, last: int, calls: list[str], before: list[str]) -> str:
    """What :class:`NotRepeatable` says: where the runs parted."""
    at = next((i for i, (ours, theirs) in enumerate(zip(calls, before, strict=False))
               if ours != theirs), min(len(calls), len(before)))
    ours = calls[at] if at < len(calls) else "nothing more"
    theirs = before[at] if at < len(before) else "nothing more"
    return (f"path {path}: run again, it made {ours} as call {at + 1}, where the run it came "
            f"from made {theirs} (before the fault it adds, at call {last + 1}): the paths are "
            "not repeatable, so the faults cannot be put where they were meant to be. A step "
            "answering differently from run to run does this (one keeping state across paths "
            "that the explorer cannot copy per path, a clock, chance): give explore steps that "
            "answer the same on every run of a path")


def _count_taken(found: Exploration, compiled: list[CompiledMachine[Any, Any]]) -> None:
    """Add the transitions the machines compiled for the last path took to ``found``."""
    taken = found.taken
    for made in compiled:
        for step in made.steps():
            if step.count:
                pair = (step.edge, step.answer.name)
                taken[pair] = taken.get(pair, 0) + step.count
    compiled.clear()


def _options(machine: Declaration[Any, Any], spec: str | None, parent: bool,
             steps: dict[str, StepFunction] | None = None,
             steps_spec: str | None = None) -> tuple[str, ...]:
    """The ``kvfsm explore`` options that name ``machine``, its steps and the scenario's mode."""
    options: list[str] = []
    if spec is not None and machine is not TRANSFER_MACHINE:  # (named any way: the default)
        options += ["--machine", spec]
    elif spec is None and machine is not TRANSFER_MACHINE:
        options += ["--machine", f"MODULE:ATTRIBUTE_OF_{machine.name.upper()}"]
    if steps_spec is not None:
        options += ["--steps", steps_spec]
    elif steps:
        options += ["--steps", f"MODULE:ATTRIBUTE_OF_{machine.name.upper()}_STEPS"]
    if parent:
        options.append("--parent")
    return tuple(options)


def _level_bar(enabled: bool, paths: int, polls: int, depth: int) -> Any:
    """A progress bar over the paths with ``depth`` faults (a do-nothing one when disabled)."""
    from kvfsm.demo import progress_bar  # noqa: PLC0415 - the demo's bars, on stderr

    return progress_bar(paths, f"explore mode={polls}, {depth} fault(s)", unit="path",
                        enabled=enabled, leave=True)


def _children(path: Path, last: int, calls: list[str], max_stall: int,
              max_calls: int, interruptible: Sequence[str] = ()) -> Iterator[tuple[Path, int]]:
    occurrences: dict[str, int] = {}
    for position, call in enumerate(calls[:max_calls]):
        occurrences[call] = occurrences.get(call, 0) + 1
        if position <= last:
            continue
        for fault in [*_alternatives(call, max_stall),
                      *([Interrupt()] if call in interruptible else [])]:
            choice = Choice(call, occurrences[call], fault)
            yield Path(path.polls, (*path.choices, choice)), position


def parse_path(text: str) -> Path:
    """Read a path back from its printed form (``mode=1;call:raise@2,...``)."""
    from kvfsm.demo import parse_fault_spec  # noqa: PLC0415 - the one fault-spec grammar

    mode, _, spec = text.partition(";")
    if not mode.startswith("mode=") or not mode[5:].isdigit():
        raise ValueError(f"a path starts with mode=N; got {text!r}")
    if int(mode[5:]) not in (0, 1):  # (a transfer that takes longer may not end in a replay's
        # polls, and would be reported as a liveness violation it is not)
        raise ValueError(f"a path's mode is 0 (transfers complete at once) or 1 (on their "
                         f"first poll), the two the explorer runs; got {mode}")
    choices = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        if item.startswith(f"{ROUND}:"):
            cancel = re.fullmatch(rf"{ROUND}:cancel@(\d+)", item)
            if cancel is None or int(cancel[1]) == 0:
                raise ValueError(f"bad fault {item!r}: a round is cancelled as {ROUND}:cancel@N, "
                                 "N from 1")
            choices.append(Choice(ROUND, int(cancel[1]), CancelAll()))
            continue
        interrupt = re.fullmatch(r"(\w+):interrupt@(\d+)", item)
        if interrupt is not None:
            if not int(interrupt[2]):
                raise ValueError(f"bad fault {item!r}: an interrupt is CALL:interrupt@N, N "
                                 "from 1")
            choices.append(Choice(interrupt[1], int(interrupt[2]), Interrupt()))
            continue
        if re.match(r"\w+:late\b", item):
            late = re.fullmatch(r"(\w+):late@(\d+)", item)
            if late is None or late[1] != "check_xfer_state" or int(late[2]) == 0:
                raise ValueError(f"bad fault {item!r}: late applies to check_xfer_state@N, "
                                 "N from 1")
            choices.append(Choice(late[1], int(late[2]), Late()))
            continue
        try:
            faults = parse_fault_spec(item)
        except ValueError:  # (the demo's grammar has no interrupt, late or round)
            raise ValueError(f"bad fault {item!r}: a path's fault is CALL:raise@N, CALL:err@N, "
                             f"CALL:proc=K@N, CALL:interrupt@N, check_xfer_state:late@N or "
                             f"{ROUND}:cancel@N (N the call's number, from 1)") from None
        for fault in faults:
            if fault.at is None or fault.times != 1:
                raise ValueError(f"each fault of a path names its call number: {fault.call}@N")
            choices.append(Choice(fault.call, fault.at, fault.fault))
    return Path(int(mode[5:]), tuple(choices))


def replay(path: Path, machine: Declaration[Any, Any] = TRANSFER_MACHINE,
           max_polls: int = 40, *, parent: bool = False,
           steps: dict[str, StepFunction] | None = None,
           ) -> tuple[list[str], list[Violation], dict[str, int]]:
    """Run one path again: the calls made, the violations, and the transitions taken (told
    to transition coverage only if the path violated nothing, as :func:`explore`'s)."""
    with Verdict() as verdict:
        calls, violations, tier, _ = (_run_with_parent if parent else _run)(path, machine,
                                                                            max_polls, steps)
        verdict.counted = not violations
    taken = {f"{e.source} -{e.event}[{e.guard_label}]-> {e.dest}": n
             for e, n in tier.machine.transition_counts().items() if n}
    return calls, violations, taken



def explore_table(machine: Declaration[Any, Any]) -> Exploration:
    """Explore any declared machine at the level of its table: every (event, answer) from
    every reachable (state, latched outcome), running the declared actions.

    Checked: firing never raises (an action that raises: an outcome latched twice is F3);
    every reachable state can still reach a final state (liveness). (That a final state
    declares no event, so that its result is handed out once, F6, a Declaration checks when
    it is made.)
    """
    import copy  # noqa: PLC0415 - only this mode copies records

    found = Exploration()
    started = time.perf_counter()
    compiled = machine.compile(listen=False)
    events = [(event, answer) for event, answers in machine.answers.items()
              for answer in sorted(answers, key=lambda a: a.name)]
    start = BareRecord(machine.initial)
    seen = {start.key()}
    frontier = [start]
    edges: set[tuple[Any, Any]] = set()
    while frontier:
        record = frontier.pop()
        for event, answer in events:
            if event not in compiled.table.get(record.state, {}):
                continue
            after = copy.copy(record)
            found.paths += 1
            try:
                compiled.fire(after, event, answer)
            except Exception as error:
                found.violations.append(Violation(
                    Invariant.ACTION_RAISED, None,
                    f"{record.state.name} -{event}({answer.name})-> raised "
                    f"{_described(error)}"))
                # the move is declared, and the record is where it leads: gone on from there
                # (the failing action is the violation, not the states past its edge)
            edges.add((record.state, after.state))
            if after.key() not in seen:
                seen.add(after.key())
                frontier.append(after)
    found.violations += _dead_ends(machine, {state for state, _ in seen}, edges)
    found.calls = len(seen)
    found.seconds = time.perf_counter() - started
    if found.violations:
        found.counterexample = Path(0)
    return found


def _dead_ends(machine: Declaration[Any, Any], reachable: set[Any],
               edges: set[tuple[Any, Any]]) -> list[Violation]:
    """The reachable states from which no final state can be reached."""
    dead = []
    for state in reachable - set(machine.final):
        ahead, todo = {state}, [state]
        while todo:
            here = todo.pop()
            for source, dest in edges:
                if source is here and dest not in ahead:
                    ahead.add(dest)
                    todo.append(dest)
        if not ahead & set(machine.final):
            dead.append(Violation(Invariant.DEAD_END, None,
                                  f"from {state.name} no final state can be reached"))
    return dead


def _run_table(machine: Declaration[Any, Any]) -> int:
    found = explore_table(machine)
    print(f"kvfsm explore: machine {machine.name}, every event and answer from every reachable "
          f"state: {found.paths} transitions fired over {found.calls} (state, outcome) pairs, "
          + ("0 violations" if found.ok else "VIOLATION"))
    for violation in found.violations:
        print(f"  {violation}")
    return 0 if found.ok else 1


def add_arguments(parser: Any) -> None:
    """The ``kvfsm explore`` options."""
    parser.add_argument("--machine", default="transfer", metavar="SPEC",
                        help="the machine to explore: a name of kvfsm's (transfer, "
                             "peer_receive, peer_link) or module:ATTRIBUTE of a Declaration. "
                             "A lifecycle "
                             "over kvfsm's TransferState runs through the real tier with NIXL "
                             "faults; any other machine is explored at the level of its table")
    parser.add_argument("--steps", metavar="SPEC",
                        help="the steps of the machine's own effects: module:ATTRIBUTE of a "
                             "dict of effect name to step function, as a tier is given them "
                             "(steps={'verify': fn}); each step call also fails at every step")
    parser.add_argument("--max-faults", type=int, default=None,
                        help="the most faults on one path (2; 1 with --peer)")
    parser.add_argument("--max-stall", type=int, default=2,
                        help="the most extra PROC answers one stall adds (2)")
    parser.add_argument("--parent", action="store_true",
                        help="run the scenario through the tiering manager and its CPU primary "
                             "tier, and check that every pin returns to 0 (but those of a "
                             "job whose blocks NIXL may still move)")
    parser.add_argument("--all", action="store_true",
                        help="go on past the first violation, counting every path")
    parser.add_argument("--replay", metavar="PATH",
                        help="run one path again, as printed: 'mode=1;release_xfer_handle:raise@1'")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar on stderr (default: when stderr is a terminal)")
    parser.add_argument("--peer", action="store_true",
                        help="explore the peer machines at the level of NIXL calls instead: a "
                             "PeerSender and a PeerReceiver over fake UCX agents "
                             "(kvfsm.testing.explore_peer); --max-faults (default 1 here), "
                             "--max-stall, --all and --replay apply")
    parser.add_argument("--receiver", metavar="NAME",
                        help="with --peer: explore one of the broken receivers "
                             "(kvfsm.testing.explore_peer.BROKEN_RECEIVERS) to see it caught")


def run(args: Any) -> int:
    """``kvfsm explore``: 0 when no path violates an invariant, 1 when one does."""
    from kvfsm.machines import load_machine, load_steps  # noqa: PLC0415 - the CLI's own import

    if getattr(args, "peer", False):
        from kvfsm.testing.explore_peer import run_peer  # noqa: PLC0415 - only this mode

        ignored = [option for option, given in (
            ("--machine", args.machine != "transfer"), ("--steps", args.steps),
            ("--parent", args.parent)) if given]
        if ignored:  # it explores the shipped peer machines, always
            raise ValueError(f"{', '.join(ignored)}: not with --peer, which explores kvfsm's "
                             "peer sender and receiver (--receiver picks a broken receiver)")
        return run_peer(args)
    if getattr(args, "receiver", None) is not None:
        raise ValueError("--receiver: only with --peer")
    faults_given = args.max_faults is not None
    if args.max_faults is None:
        args.max_faults = 2
    machine = load_machine(args.machine)
    steps = load_steps(args.steps) if args.steps else None
    if not machine.effects:  # not a lifecycle a tier runs: explore its table
        ignored = [option for option, given in (
            ("--steps", steps), ("--parent", args.parent), ("--replay", args.replay is not None),
            ("--max-faults", faults_given), ("--max-stall", args.max_stall != 2),
            ("--all", args.all)) if given]
        if ignored:
            raise ValueError(f"{', '.join(ignored)}: machine {machine.name!r} declares no "
                             "effects, so it is explored at the level of its table, where no "
                             "step runs, no tier or parent, and no fault path")
        return _run_table(machine)
    if args.max_faults < 0 or args.max_stall < 1:
        raise ValueError("--max-faults must be at least 0 and --max-stall at least 1")
    _check_steps(machine, steps)
    if args.replay is not None:  # (an empty one is refused, not taken for none: a variable
        return _replay_command(args, machine, steps)  # left unset would explore every path)
    found = explore(machine, steps=steps, parent=args.parent, max_faults=args.max_faults,
                    max_stall=args.max_stall, stop_at_first=not args.all, spec=args.machine,
                    steps_spec=args.steps,
                    progress=sys.stderr.isatty() if args.progress is None else args.progress)
    print(f"kvfsm explore: machine {machine.name}, up to {args.max_faults} fault(s) a path"
          + (", through the tiering manager" if args.parent else ""))
    print(found.report())
    return 0 if found.ok else 1


def _replay_command(args: Any, machine: Declaration[Any, Any],
                    steps: dict[str, StepFunction] | None) -> int:
    """``kvfsm explore --replay PATH``: 1 when the path violates an invariant, or names a
    fault that never fired (it checked less than it says)."""
    path = parse_path(args.replay)
    for choice in path.choices:  # (a step answers what it answers, raises or is interrupted)
        if steps and choice.call in steps and not isinstance(choice.fault, Raise | Interrupt):
            raise ValueError(f"--replay: {choice}: a step of the machine's own takes "
                             "raise or interrupt only")
    calls, violations, taken = replay(path, machine, parent=args.parent, steps=steps)
    print(f"path {path}: {len(calls)} NIXL calls")
    print("  calls: " + " ".join(calls))
    print("  transitions taken:")
    for edge, count in taken.items():
        print(f"    {edge}  x{count}")
    for violation in violations:
        print(f"  {violation}")
    unfired = [f"{choice} never fired (the path made {calls.count(choice.call)} "
               f"{choice.call} call(s))" for choice in path.choices
               if calls.count(choice.call) < choice.occurrence]
    for line in unfired:
        print(f"  {line}")
    print(("0 violations" if not violations else f"{len(violations)} violation(s)")
          + (f" ({len(unfired)} fault(s) never fired: the path checked less than it names)"
             if unfired else ""))
    return 1 if violations or unfired else 0


def _check_steps(machine: Declaration[Any, Any], steps: dict[str, StepFunction] | None) -> None:
    """Refuse, before the first path, a machine the tier cannot run with these steps; a step
    the machine waits on and was not given is named with the option that gives it."""
    try:
        check_runnable(machine, steps or {}, _POLICY)
    except MachineRefused as refused:
        if steps is None and set(machine.effects.values()) - set(TransferEvent):
            raise MachineRefused(f"{refused}; on the command line, name them with --steps "
                                 "module:ATTRIBUTE") from None
        raise
