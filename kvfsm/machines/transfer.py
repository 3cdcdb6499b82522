"""The transfer machine: every rule about what a KV-offload transfer may do next.

This module is the transfer machine's declaration and nothing else (:mod:`kvfsm.machines` lists
kvfsm's machines, each alone in its module); :mod:`kvfsm.lifecycle` re-exports it under the name
it had first.

Theory of operation
-------------------

A transfer copies a job's KV blocks between the primary cache and a tier with NIXL. It holds up to
three NIXL resources (registered remote descriptors, a prepped descriptor list, a transfer handle)
and, through the job, primary blocks the engine has pinned. The one thing that must never happen
is that the engine learns the job is over (and reuses its blocks) while NIXL may still touch them,
or never learns it at all.

So a transfer moves through seven states, and only forward::

    SUBMITTED -> PROCESSING -> DONE | FAILED -> XFER_RELEASED -> CLEANED -> PUBLISHED

with two side states: CANCELLING (cancelled while running, waiting for NIXL) and QUARANTINED
(a retry bound spent: handles held for good, a failure handed out).

Every event is one NIXL call, and carries what NIXL answered (an :class:`Answer`). The driver
(:mod:`kvfsm.driver`) makes the call and fires the event; this table alone decides what follows:

* ``post`` (the submit calls: register, prep, make, transfer): ``PROC`` -> PROCESSING, ``DONE``
  -> DONE, ``ERR`` or a raise at *any* submit step -> FAILED. Leaving SUBMITTED is total (F5).
* ``poll`` (``check_xfer_state``): ``PROC`` stays, ``DONE`` -> DONE, ``ERR`` or a raise -> FAILED.
  Every answer is handled (F4).
* Entering DONE or FAILED latches the outcome, once; nothing recomputes it (F3). From here on the
  transfer is known to be over, so its handle may be released.
* ``release`` (``release_xfer_handle``): success -> XFER_RELEASED; a raise is a declared self-loop
  that stays in DONE or FAILED and is retried on the next poll (F1). There is no other way to
  XFER_RELEASED, and no way to PUBLISHED that skips it (F2).
* ``clean`` (``release_dlist_handle`` then ``deregister_memory``): best effort; failures are
  recorded as leaks and never hold the transfer back (F7). It is only declared from
  XFER_RELEASED, so descriptors are never torn down under a live transfer (F8).
* ``publish``: CLEANED -> PUBLISHED, entered exactly once; the transfer leaves the tier's table
  only here or in QUARANTINED, and its one result is handed out (F6).
* ``cancel``: from PROCESSING, CANCELLING latches failure; it still waits for ``poll`` to answer
  DONE or an error before FAILED lets the handle go (F10). A transfer already over (DONE,
  FAILED, XFER_RELEASED, CLEANED) keeps its outcome: cancel is declared there as a stay, so a
  cancel may arrive between any two steps and the table says what it means.
* ``EXHAUSTED`` (the tier's :class:`~kvfsm.policy.RetryPolicy` says a bound is spent, or a
  shutdown's deadline passed while a release kept raising) moves a release that keeps raising,
  or a transfer NIXL still runs past ``max_running_seconds``, to QUARANTINED: its handles are
  never released, and its result is a failure (F9). A shutdown never gives up a transfer NIXL
  still runs.

Why a job failed is latched with its outcome, as a :class:`FailureReason` (the call that failed
and what it raised or answered, or the declared reason: cancelled, quarantined), and handed out
with its result (:attr:`kvfsm.transfer.JobResult.reason`). The driver says which call failed by
firing the answer with a :class:`CallFailed` detail; the actions below turn it into the reason.
What a call raised is kept by its type too (the exception's class name: ``error_type`` of the
record and of the reason), never only as text: other machines react to NIXL's errors by type
(a write that raised ``nixlRemoteDisconnectError`` loses its peer link,
:data:`kvfsm.machines.peer_link.LINK_LOST_BY`).

Any (state, event) pair not in the table raises :class:`kvfsm.engine.InvalidTransition` naming
both, and leaves the transfer unchanged. The table is declared with ``transitions`` and compiled
(:mod:`kvfsm.engine`); compilation proves that each declared (state, event) handles every answer
its event can carry exactly once.
"""

from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvfsm.engine import Declaration

__all__ = [
    "ACTIONS",
    "ANSWERS",
    "GUARDS",
    "TRANSFER_MACHINE",
    "TRANSITIONS",
    "Answer",
    "CallFailed",
    "FailureKind",
    "FailureReason",
    "OutcomeAlreadyLatched",
    "PostInterrupted",
    "StepMisanswered",
    "TransferEvent",
    "TransferState",
    "count_retry",
    "latch_cancelled",
    "latch_failure",
    "latch_success",
    "note_ended",
    "note_error",
    "quarantine",
    "record_leaks",
]


class TransferState(enum.Enum):
    """Where a transfer is in its lifecycle."""

    # members are singletons: hash them by identity, in C, not by name in Python (the table is
    # a dict keyed by state and answer, looked up several times per transfer)
    __hash__ = object.__hash__

    #: the submit calls are being made; no answer from NIXL yet
    SUBMITTED = "submitted"
    #: posted; NIXL answered PROC and the transfer may be touching memory
    PROCESSING = "processing"
    #: NIXL answered DONE: the copy finished, its handle may be released
    DONE = "done"
    #: a submit call or the state check failed: the transfer is over, its handle may be released
    FAILED = "failed"
    #: the transfer handle is released; NIXL no longer references the primary blocks
    XFER_RELEASED = "xfer_released"
    #: descriptor list released and remote descriptors deregistered (leaks recorded, if any)
    CLEANED = "cleaned"
    #: the one result was handed out; the transfer left the table
    PUBLISHED = "published"
    #: cancelled while NIXL may still run it: the outcome is failure, the handles wait for
    #: NIXL to answer DONE or an error before they may be released
    CANCELLING = "cancelling"
    #: past its retry bound: its handles are held for good (never released while the transfer
    #: may run), and its one result, a failure, was handed out
    QUARANTINED = "quarantined"


class TransferEvent(enum.StrEnum):
    """The NIXL calls whose answers move a transfer; values are the trigger names."""

    #: register_memory, prep_xfer_dlist, make_prepped_xfer and transfer, in that order
    POST = "post"
    #: check_xfer_state
    POLL = "poll"
    #: release_xfer_handle
    RELEASE = "release"
    #: release_dlist_handle then deregister_memory
    CLEAN = "clean"
    #: hand the result to the tier's caller
    PUBLISH = "publish"
    #: the tier's caller cancelled the job (cancel() or shutdown())
    CANCEL = "cancel"


class Answer(enum.Enum):
    """What a NIXL call answered."""

    __hash__ = object.__hash__  # see TransferState

    #: the transfer is still running
    PROC = "PROC"
    #: the transfer finished
    DONE = "DONE"
    #: NIXL returned the string "ERR"
    ERR = "ERR"
    #: the call raised an exception
    RAISED = "RAISED"
    #: the call returned normally (calls that return nothing)
    OK = "OK"
    #: a best-effort cleanup call raised; its resources may have leaked
    LEAKED = "LEAKED"
    #: the retry policy's bound is spent: a release that raised once too often, or a
    #: transfer still running at its deadline
    EXHAUSTED = "EXHAUSTED"


class OutcomeAlreadyLatched(RuntimeError):
    """An action tried to set a transfer's outcome a second time (an F3 violation)."""


class FailureKind(enum.StrEnum):
    """Why a job failed, in one word; the value is how traces write it."""

    #: ``call`` raised; ``error`` is the exception's type and text
    RAISED = "raised"
    #: ``call`` answered an error status ("ERR"), or a user step a failing answer of its own
    #: (``verify answered MISMATCH: ...``); ``error`` says what it answered
    ERR = "err"
    #: ``cancel()`` or ``shutdown()`` cancelled the job while NIXL ran it
    CANCELLED = "cancelled"
    #: a retry bound was spent (a release that kept raising, a transfer running too long, the
    #: shutdown deadline): the handles are held for good; ``call`` is the call it waited on
    QUARANTINED = "quarantined"
    #: the machine's actions recorded no reason (a lifecycle with actions of its own)
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class FailureReason:
    """Why a job failed: the kind of failure, the call that failed, and what went wrong.

    ``call`` is the NIXL call (``register_memory``, ``prep_xfer_dlist``, ``make_prepped_xfer``,
    ``transfer``, ``check_xfer_state``, ``release_xfer_handle``) or the tier's own call beside it
    (``open`` of the remote blocks, ``commit`` of a finished store, ``landed``, the check of
    what a finished load put in place, ``notification``), or None
    when no call failed (cancelled) or it is not known. ``error`` is text: for RAISED the
    exception as ``"Type: text"`` (``"OSError: [Errno 30] Read-only file system: '/x'"``,
    ``"nixlBackendError: NIXL_ERR_BACKEND"``); for ERR ``"answered 'ERR'"``; for CANCELLED
    ``"cancelled"``; for QUARANTINED why the bound is spent, and the call's last error, if any
    (``"retry bound spent; last error: nixlBackendError: NIXL_ERR_BACKEND"``).

    ``error_type`` is the class name of the exception that failed the job (RAISED), or that
    the call it was quarantined waiting on raised last (QUARANTINED), else None: what the
    coupled machines key on (``"nixlRemoteDisconnectError"``), never the text. It explains
    ``error``, so it takes no part in comparing reasons, and a trace does not write it (its
    ``error`` begins with it).

    ``str(reason)`` reads as one line: ``check_xfer_state raised nixlBackendError: ...``.
    """

    kind: FailureKind
    call: str | None
    error: str
    error_type: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        call = self.call or "a call"
        if self.kind is FailureKind.RAISED:
            return f"{call} raised {self.error}"
        if self.kind is FailureKind.ERR:
            return f"{call} {self.error}"
        if self.kind is FailureKind.QUARANTINED:
            return f"quarantined waiting on {call}: {self.error}"
        return self.error if self.kind is FailureKind.CANCELLED else f"failed: {self.error}"

    def as_dict(self) -> dict[str, str | None]:
        """The reason as plain data (a trace's ``reason``); :meth:`from_dict` reads it back."""
        return {"kind": self.kind.value, "call": self.call, "error": self.error}

    @classmethod
    def from_dict(cls, data: Any) -> FailureReason:
        """A reason written by :meth:`as_dict`.

        Raises:
            ValueError: ``data`` is not such a mapping (the message says what is wrong).
        """
        if not isinstance(data, dict):
            raise ValueError(f"a reason is a mapping, got {data!r}")
        kind, call, error = data.get("kind"), data.get("call"), data.get("error")
        if (kind not in _KINDS or not isinstance(error, str)
                or not (call is None or isinstance(call, str))):
            raise ValueError(f"a reason has a kind ({', '.join(_KINDS)}), a call (text or "
                             f"null) and an error (text), got {data!r}")
        return cls(FailureKind(kind), call, error)


@dataclass(frozen=True, slots=True)
class CallFailed:
    """The detail the driver fires a failed call's answer (RAISED, ERR, EXHAUSTED) with: which
    call failed, and what it raised (the exception) or answered (the status, a string).

    Actions also take a bare exception or message as the detail (the call is then not known).
    """

    call: str
    error: BaseException | str


class StepMisanswered(TypeError):
    """What a user's step returned is no answer it may give (not one of its event's answers,
    nor ``(answer, why)`` with one of them): its event answers RAISED, and the job's reason says
    what it returned (ERR, the step as the call: ``verify answered str 'MATCH', which is not one
    of its event's answers (...)``), not that it raised."""

    def __init__(self, step: str, what: str) -> None:
        super().__init__(f"step {step!r} {what}")
        #: what the step did, without its name (``answered str 'MATCH', ...``)
        self.what = what


class PostInterrupted(Exception):
    """What a transfer's post is said to have raised when the submit was interrupted before
    NIXL answered it and no transfer handle was made: nothing runs, and its job fails with
    this as the reason's error (the interrupt itself goes on to the caller)."""

    def __init__(self) -> None:
        super().__init__("the submit was interrupted before NIXL answered the post")


S = TransferState
E = TransferEvent

#: what each event can carry
ANSWERS: dict[str, tuple[Answer, ...]] = {
    E.POST: (Answer.PROC, Answer.DONE, Answer.ERR, Answer.RAISED),
    E.POLL: (Answer.PROC, Answer.DONE, Answer.ERR, Answer.RAISED, Answer.EXHAUSTED),
    E.RELEASE: (Answer.OK, Answer.RAISED, Answer.EXHAUSTED),
    E.CLEAN: (Answer.OK, Answer.LEAKED),
    E.PUBLISH: (Answer.OK,),
    E.CANCEL: (Answer.OK,),
}

#: named guards: the answers each accepts
GUARDS: dict[str, tuple[Answer, ...]] = {
    "running": (Answer.PROC,),
    "finished": (Answer.DONE,),
    "errored": (Answer.ERR, Answer.RAISED),
    "released": (Answer.OK,),
    "release_raised": (Answer.RAISED,),
    "cleaned": (Answer.OK,),
    "leaked": (Answer.LEAKED,),
    "exhausted": (Answer.EXHAUSTED,),
}


# -- named actions: (transfer, answer, detail); detail is the exception or message, if any ----

def latch_success(transfer: Any, answer: Answer, detail: Any) -> None:
    """Latch the outcome as success (entering DONE)."""
    if transfer.success is not None:
        raise OutcomeAlreadyLatched(f"job {transfer.job.job_id}: outcome already latched")
    transfer.success = True
    transfer.finished_at = time.monotonic()


def latch_failure(transfer: Any, answer: Answer, detail: Any) -> None:
    """Latch the outcome as failure (entering FAILED); keep NIXL's error, and why the job
    failed (:class:`FailureReason`), latched with the outcome."""
    if transfer.success is not None:
        raise OutcomeAlreadyLatched(f"job {transfer.job.job_id}: outcome already latched")
    transfer.success = False
    transfer.finished_at = time.monotonic()
    _keep_error(transfer, answer, detail)
    _set_reason(transfer, _failure(answer, detail))


def count_retry(transfer: Any, answer: Answer, detail: Any) -> None:
    """Count a release that raised; the transfer stays put and is retried on the next poll."""
    transfer.retries += 1
    _keep_error(transfer, answer, detail)


def record_leaks(transfer: Any, answer: Answer, detail: Any) -> None:
    """Keep the cleanup calls that failed (``detail`` is a tuple of :class:`Leak`)."""
    transfer.leaks = tuple(detail or ())


def latch_cancelled(transfer: Any, answer: Answer, detail: Any) -> None:
    """Latch the outcome of a transfer cancelled while running: failure, reason CANCELLED
    (whatever NIXL answers while the transfer is waited for), its error what cancelled it
    when that is said (``cancelled by shutdown()``), else ``cancelled``."""
    latch_failure(transfer, answer, detail or "cancelled")
    _set_reason(transfer, FailureReason(FailureKind.CANCELLED, None, detail)
                if isinstance(detail, str) and detail else _CANCELLED)


def note_ended(transfer: Any, answer: Answer, detail: Any) -> None:
    """Stamp when NIXL ended a transfer cancelled while it ran (its outcome was latched at the
    cancel): a failing release is retried for the policy's ``max_seconds`` from here, and the
    result's ``transfer_time`` ends here."""
    transfer.finished_at = time.monotonic()


def note_error(transfer: Any, answer: Answer, detail: Any) -> None:
    """Keep NIXL's error of a transfer whose outcome is already latched (its reason stays)."""
    if detail is not None:
        _keep_error(transfer, answer, detail)


def quarantine(transfer: Any, answer: Answer, detail: Any) -> None:
    """Hold the transfer's handles for good; its result will be a failure.

    A job that had already failed keeps the reason latched then; one that had finished, or
    still ran, fails because it is quarantined (reason QUARANTINED, with the call it waited on
    and that call's last error).
    """
    running = transfer.success is None
    if running:
        transfer.success = False
        transfer.finished_at = time.monotonic()
    last, last_type = transfer.error, getattr(transfer, "error_type", None)
    # a call that failed once too often (what it raised), or the tier giving up on a call
    # (why, as text: the shutdown deadline, a step's retry bound)
    gave_up = isinstance(detail, CallFailed) and not isinstance(detail.error, BaseException)
    given = (str(detail.error) or f"answered {getattr(answer, 'name', answer)}"  # a step's
             if gave_up else "")  # answer given alone says what it answered
    _keep_error(transfer, answer, given if gave_up else (detail or "retry bound spent"))
    if not running and transfer.success is False:
        return  # it had failed (or was cancelled) before: that is why the job failed
    if gave_up:
        call, why = detail.call, given
    elif isinstance(detail, CallFailed):
        call, why, last = detail.call, "retry bound spent", transfer.error
        last_type = _error_type(detail)
    else:  # the tier gave up (shutdown deadline, running too long): say so
        call = "check_xfer_state" if running else "release_xfer_handle"
        why = str(detail) if detail is not None else "retry bound spent"
    _set_reason(transfer, FailureReason(FailureKind.QUARANTINED, call,
                                        f"{why}; last error: {last}" if last else why,
                                        last_type if last else None))


ACTIONS = {
    "latch_success": latch_success,
    "latch_failure": latch_failure,
    "latch_cancelled": latch_cancelled,
    "count_retry": count_retry,
    "record_leaks": record_leaks,
    "note_ended": note_ended,
    "note_error": note_error,
    "quarantine": quarantine,
}

#: The table, grouped by source state; edges of one (state, event) are tried in this order.
TRANSITIONS: list[dict[str, Any]] = [
    # SUBMITTED: the submit calls answered
    {"trigger": E.POST, "source": S.SUBMITTED, "dest": S.PROCESSING, "conditions": "running"},
    {"trigger": E.POST, "source": S.SUBMITTED, "dest": S.DONE, "conditions": "finished",
     "after": "latch_success"},
    {"trigger": E.POST, "source": S.SUBMITTED, "dest": S.FAILED, "conditions": "errored",
     "after": "latch_failure"},
    # PROCESSING: check_xfer_state answered
    {"trigger": E.POLL, "source": S.PROCESSING, "dest": S.PROCESSING, "conditions": "running"},
    {"trigger": E.POLL, "source": S.PROCESSING, "dest": S.DONE, "conditions": "finished",
     "after": "latch_success"},
    {"trigger": E.POLL, "source": S.PROCESSING, "dest": S.FAILED, "conditions": "errored",
     "after": "latch_failure"},
    {"trigger": E.POLL, "source": S.PROCESSING, "dest": S.QUARANTINED, "conditions": "exhausted",
     "after": "quarantine"},
    {"trigger": E.CANCEL, "source": S.PROCESSING, "dest": S.CANCELLING,
     "after": "latch_cancelled"},
    # CANCELLING: cancelled while running; NIXL must still say the transfer is over
    {"trigger": E.POLL, "source": S.CANCELLING, "dest": S.CANCELLING, "conditions": "running"},
    {"trigger": E.POLL, "source": S.CANCELLING, "dest": S.FAILED, "conditions": "finished",
     "after": "note_ended"},
    {"trigger": E.POLL, "source": S.CANCELLING, "dest": S.FAILED, "conditions": "errored",
     "after": ["note_ended", "note_error"]},
    {"trigger": E.POLL, "source": S.CANCELLING, "dest": S.QUARANTINED,
     "conditions": "exhausted", "after": "quarantine"},
    {"trigger": E.CANCEL, "source": S.CANCELLING, "dest": S.CANCELLING},
    # DONE: release_xfer_handle answered
    {"trigger": E.RELEASE, "source": S.DONE, "dest": S.XFER_RELEASED, "conditions": "released"},
    {"trigger": E.RELEASE, "source": S.DONE, "dest": S.DONE, "conditions": "release_raised",
     "after": "count_retry"},
    {"trigger": E.RELEASE, "source": S.DONE, "dest": S.QUARANTINED, "conditions": "exhausted",
     "after": "quarantine"},
    {"trigger": E.CANCEL, "source": S.DONE, "dest": S.DONE},
    # FAILED: release_xfer_handle answered
    {"trigger": E.RELEASE, "source": S.FAILED, "dest": S.XFER_RELEASED, "conditions": "released"},
    {"trigger": E.RELEASE, "source": S.FAILED, "dest": S.FAILED, "conditions": "release_raised",
     "after": "count_retry"},
    {"trigger": E.RELEASE, "source": S.FAILED, "dest": S.QUARANTINED, "conditions": "exhausted",
     "after": "quarantine"},
    {"trigger": E.CANCEL, "source": S.FAILED, "dest": S.FAILED},
    # XFER_RELEASED: release_dlist_handle and deregister_memory answered
    {"trigger": E.CLEAN, "source": S.XFER_RELEASED, "dest": S.CLEANED, "conditions": "cleaned"},
    {"trigger": E.CLEAN, "source": S.XFER_RELEASED, "dest": S.CLEANED, "conditions": "leaked",
     "after": "record_leaks"},
    {"trigger": E.CANCEL, "source": S.XFER_RELEASED, "dest": S.XFER_RELEASED},
    # CLEANED: the result is handed out
    {"trigger": E.PUBLISH, "source": S.CLEANED, "dest": S.PUBLISHED},
    {"trigger": E.CANCEL, "source": S.CLEANED, "dest": S.CLEANED},
]

#: The transfer lifecycle, declared once.
TRANSFER_MACHINE: Declaration[TransferState, Answer] = Declaration(
    "transfer",
    states=TransferState,
    initial=TransferState.SUBMITTED,
    answers=ANSWERS,
    guards=GUARDS,
    actions=ACTIONS,
    transitions=TRANSITIONS,
    final=(TransferState.PUBLISHED, TransferState.QUARANTINED),
    failure_states=(TransferState.FAILED, TransferState.CANCELLING, TransferState.QUARANTINED),
    calls={E.POST: ("register_memory", "prep_xfer_dlist", "make_prepped_xfer", "transfer"),
           E.POLL: "check_xfer_state",
           E.RELEASE: "release_xfer_handle",
           E.CLEAN: ("release_dlist_handle", "deregister_memory")},
    # what each state waits on, by the event it fires: the driver and the tier read which
    # call a state makes, when a transfer is over and what NIXL may still run from here
    effects={S.SUBMITTED: E.POST, S.PROCESSING: E.POLL, S.CANCELLING: E.POLL,
             S.DONE: E.RELEASE, S.FAILED: E.RELEASE, S.XFER_RELEASED: E.CLEAN,
             S.CLEANED: E.PUBLISH},
    running=(S.PROCESSING, S.CANCELLING),
)


def _describe(answer: Answer, detail: Any) -> str:
    """The error as text (a transfer's ``error``): an exception's type and text, or what a
    call answered."""
    if isinstance(detail, CallFailed):
        if isinstance(detail.error, StepMisanswered):
            return f"{detail.call} {detail.error.what}"
        if isinstance(detail.error, BaseException):
            detail = detail.error
        elif detail.error == "":  # a step's answer given alone
            return f"{detail.call} answered {getattr(answer, 'name', answer)}"
        elif answer is Answer.EXHAUSTED:  # a step's tries given up: the runner's words
            return f"{detail.call}: {detail.error}"
        else:
            return f"{detail.call} answered {detail.error!r}"
    if isinstance(detail, BaseException):
        return f"{type(detail).__name__}: {detail}"
    if detail is None:
        return answer.value
    return str(detail)


def _error_type(detail: Any) -> str | None:
    """The class name of the exception in ``detail`` (bare, or a :class:`CallFailed`'s), if any."""
    error = detail.error if isinstance(detail, CallFailed) else detail
    return type(error).__name__ if isinstance(error, BaseException) else None


def _keep_error(record: Any, answer: Answer, detail: Any) -> None:
    """Keep the error on the record: as text (``error``) and, on a record with a place for it
    (a transfer's), by its type (``error_type``: None when the call raised nothing)."""
    record.error = _describe(answer, detail)
    with contextlib.suppress(AttributeError):
        record.error_type = _error_type(detail)


def _set_reason(record: Any, reason: FailureReason) -> None:
    """Latch ``reason`` on a record that has a place for it (a record of another machine that
    shares these actions, such as the peer receiver's, keeps its ``error`` only)."""
    with contextlib.suppress(AttributeError):
        record.reason = reason


def _failure(answer: Answer, detail: Any) -> FailureReason:
    """Why a transfer failed, from the answer that failed it and its detail."""
    call = detail.call if isinstance(detail, CallFailed) else None
    error = detail.error if isinstance(detail, CallFailed) else detail
    if isinstance(error, StepMisanswered):  # a step that returned what is no answer
        return FailureReason(FailureKind.ERR, call, error.what)
    if isinstance(error, BaseException):
        return FailureReason(FailureKind.RAISED, call, f"{type(error).__name__}: {error}",
                             type(error).__name__)
    if answer is Answer.EXHAUSTED and call is not None and isinstance(error, str) and error:
        # a step's tries given up, on an edge of the user's that fails the job: the step,
        # what it answered last and how many tries (the runner's words)
        return FailureReason(FailureKind.ERR, call, error)
    if answer is Answer.ERR:  # the status answered, or a message saying so
        return FailureReason(FailureKind.ERR, call, f"answered {error or 'ERR'!r}"
                             if call is not None or error is None else str(error))
    if call is not None and not isinstance(answer, Answer):  # a user step's own answer
        return FailureReason(FailureKind.ERR, call,
                             f"answered {answer.name}" + (f": {error}" if error else ""))
    return FailureReason(FailureKind.UNKNOWN, call, _describe(answer, detail))


_CANCELLED = FailureReason(FailureKind.CANCELLED, None, "cancelled")
_KINDS = tuple(kind.value for kind in FailureKind)
