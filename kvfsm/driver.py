"""The driver: the I/O part of the runner. It makes each NIXL call and says what it answered.

The driver holds no rules and no books. :class:`~kvfsm.runner.Runner` (the part without I/O)
says which effect is due for which transfer; the driver makes the calls of that effect and
turns what they did (a status string, a return, or an exception, ``StopIteration`` and NIXL's
typed errors included) into an :class:`~kvfsm.runner.Outcome`, in one function per kind of
effect: :meth:`TransferDriver.post`, :meth:`~TransferDriver.check` with
:meth:`~TransferDriver.polled`, :meth:`~TransferDriver.end` (release, then cleanup),
:meth:`~TransferDriver.release`, :meth:`~TransferDriver.clean` and
:meth:`~TransferDriver.step` (a user's step, a function given to the tier:
:data:`StepFunction`). The runner fires the outcome; whether the transfer moves, stays or
retries is the lifecycle table's decision (:mod:`kvfsm.machines.transfer`).

What differs between tiers (object keys, files, a peer's memory) is a :class:`RemoteSide`: it opens
the remote descriptors of a transfer, commits a finished store (a file tier renames its file into
place), closes what it opened, and says whether each block needs a NIXL transfer of its own
(:attr:`StorageSide.transfer_per_block`: NIXL 1.5.1's OBJ backend answers a transfer's state check
with the error of one failed request while the transfer's other requests still run, and says
nothing when they end; a transfer of one block is over when it answers). Its calls are part of the
NIXL call they sit beside: an error while opening or committing is that call's error, and an error
while closing is a leak. A commit that is not finished yet (a file tier flushing on a thread of its
own) makes the answer PROC: for the machine the store still runs, and the next poll asks again.
"""

from __future__ import annotations

import collections
import enum
import functools
import operator
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any, Protocol

from kvfsm.agent import NixlAgent
from kvfsm.engine import Declaration
from kvfsm.machines.transfer import (
    Answer,
    CallFailed,
    StepMisanswered,
    TransferEvent,
    latch_cancelled,
    latch_failure,
    latch_success,
)
from kvfsm.policy import RetryPolicy
from kvfsm.runner import COMMITTING, END, NIXL_RUNNING, Outcome
from kvfsm.transfer import Leak, Transfer

__all__ = ["CLEANED", "DONE", "RELEASED", "MachineRefused", "RemoteSide", "StepFunction",
           "StorageSide", "TransferDriver", "check_runnable"]

_DONE = Outcome(Answer.DONE)
#: what NIXL's status strings mean to the machine (any other string is an error status)
_STATUS = {NIXL_RUNNING: Outcome(Answer.PROC), "DONE": _DONE}
_COMMITTING = Outcome(Answer.PROC, COMMITTING)
_PROC = _STATUS[NIXL_RUNNING]
#: the effects the driver makes itself, each named by the event it fires, with the answers it
#: fires that event with (a machine's event must carry them all)
_EFFECTS: dict[str, frozenset[Answer]] = {
    TransferEvent.POST: frozenset({Answer.PROC, Answer.DONE, Answer.ERR, Answer.RAISED}),
    TransferEvent.POLL: frozenset({Answer.PROC, Answer.DONE, Answer.ERR, Answer.RAISED}),
    TransferEvent.RELEASE: frozenset({Answer.OK, Answer.RAISED}),
    TransferEvent.CLEAN: frozenset({Answer.OK, Answer.LEAKED}),
    TransferEvent.PUBLISH: frozenset({Answer.OK}),
}
#: a user's step: given the transfer (its job, remote names, block ids) and the primary KV
#: cache, it answers one of its event's answers, or ``(answer, why)`` with ``why`` a text
#: kept as the failure's reason; one that raises answers RAISED
StepFunction = Callable[[Transfer, Any], "enum.Enum | tuple[enum.Enum, str]"]
_OK = Outcome(Answer.OK)
#: a round that checks every running transfer asks a batch of at least this many in one list
#: comprehension (:meth:`TransferDriver.check_all`)
BULK_CHECKS = 256


class RemoteSide(Protocol):
    """How a tier names the remote side of its transfers."""

    #: the NIXL memory type of the remote descriptors ("OBJ", "FILE", "DRAM")
    mem_type: str
    @property
    def peer(self) -> str | None:
        """The remote agent's name for a peer's memory; None for storage this agent registers."""

    def notification(self, transfer: Transfer) -> bytes:
        """The message NIXL delivers to the peer when the transfer is done (b"": none); asked
        only of a peer's memory (``peer`` set)."""

    def open(self, transfer: Transfer) -> list[tuple[int, int, int, str]]:
        """The remote descriptors of ``transfer``; keep what was opened on the transfer."""

    def commit(self, transfer: Transfer) -> bool | None:
        """Make a store NIXL finished visible (may raise: the store then fails). False: not
        finished yet, ask again on a later poll (the driver answers PROC meanwhile). The poll
        schedule then asks about the store only at its turns in the sweep (``max_unpolled``),
        unless the side says when the commit is over: a side with a ``commit_over`` attribute
        (:class:`StorageSide` has one) gets it set by the tier, to call with the transfer."""

    def close(self, transfer: Transfer) -> list[Leak]:
        """Release what :meth:`open` kept, after NIXL let go of it; report what could not be."""

    # (a side may also say ``landed(transfer)``: checks what a load NIXL finished put in the
    # primary blocks, raising if it is not a block's worth (the load then fails, its call
    # ``landed``), as :class:`~kvfsm.tiers.object_store.ObjectStoreTier`'s side does; NIXL's
    # OBJ backend reads what an object has, a shorter one included, and answers DONE)

    # (a side may also say ``transfer_per_block = True``: one NIXL transfer per block of a
    # job, for a backend whose state check may answer one request's error while others still
    # run: :class:`Split`; :class:`StorageSide` says False)


class StorageSide:
    """What most remote sides share: storage this agent registers itself, no notification,
    nothing to commit or close. Subclasses say ``mem_type`` and how to ``open``."""

    mem_type: str
    peer: str | None = None
    #: set by the tier: to be called with a transfer (from any thread) once a commit that
    #: answered False is over, so that the next poll checks it first (a second call for it,
    #: or one for a transfer that failed meanwhile, is harmless). A side that never calls it
    #: is found at the transfer's turn in the poll schedule's sweep (``max_unpolled``)
    commit_over: Callable[[Transfer], None] | None = None
    #: one NIXL transfer per block (see :class:`RemoteSide`); a job of one block makes one
    transfer_per_block = False

    def open(self, transfer: Transfer) -> list[tuple[int, int, int, str]]:
        """The remote descriptors of ``transfer``."""
        raise NotImplementedError

    def notification(self, transfer: Transfer) -> bytes:
        """Never asked: storage has nobody to tell."""
        return b""

    def commit(self, transfer: Transfer) -> bool | None:
        """Nothing to commit: the data is visible once NIXL finished."""
        return True

    def close(self, transfer: Transfer) -> list[Leak]:
        """Nothing opened, nothing to close."""
        return []


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _check_each(check: Callable[[Any], str], handles: Sequence[Any]
                ) -> list[str | Exception]:
    """``check`` once on every handle, in one ``map`` resumed past each handle whose call
    raised: what each answered, or what it raised."""
    statuses: list[str | Exception] = []
    while len(statuses) < len(handles):
        try:  # CPython's list.extend keeps what map produced before a call raised
            statuses.extend(map(check, islice(handles, len(statuses), None))
                            if statuses else map(check, handles))
        except Exception as error:  # that handle's answer: the machine hears poll(RAISED)
            statuses.append(_raised(error))
            continue
        if len(statuses) < len(handles):  # a StopIteration ends map quietly: that call's
            statuses.append(_raised(StopIteration()))
    return statuses


def _raised(error: Exception) -> Exception:
    """What a state check that raised ``error`` answered: the error without its traceback
    (which would hold the poll's frames, and through them the agent, in a cycle only the
    garbage collector breaks); a ``StopIteration`` named as such."""
    if isinstance(error, StopIteration):
        return RuntimeError("check_xfer_state raised StopIteration")
    return error.with_traceback(None)


def _cut_short_leak(call: str) -> Leak:
    """The leak of a cleanup call an interrupt cut short."""
    what = ("what it could not release is unknown" if call == "close" else
            "whether NIXL released it is unknown, so it is not asked again")
    return Leak(call, f"cut short by an interrupt: {what}")


#: the leaks of cleanup calls an interrupt cut short, made beforehand (the handler that keeps
#: them makes no call, so a second interrupt there loses nothing)
_CUT_SHORT: dict[str, tuple[Leak, ...]] = {
    call: (_cut_short_leak(call),)
    for call in ("release_dlist_handle", "deregister_memory", "close")}
_CUT_SHORT_KEEPING_FILES = (
    _cut_short_leak("release_dlist_handle"),
    Leak("deregister_memory", "not asked: the descriptor list on the registration may still "
         "hold it"))


class Split:
    """The NIXL transfers of a job made one per block (:attr:`StorageSide.transfer_per_block`)
    besides the first, which is the job's ``xfer``: the job runs while any of them does, and
    is over, with the first failure any of them had, once every one posted is.

    ``handles`` holds the others, of which the first ``posted`` were posted (one whose post was
    interrupted counts as posted: a state check says whether NIXL runs it), and the first
    ``done`` are over (each is asked until it answered DONE or failed, and not again); they are
    released, each once, before the first. While one of them still runs once the first is
    over, it takes the first's place (the poll schedule then asks it, and it answers PROC
    until it is over: the first would answer DONE, or its error, every time).
    """

    __slots__ = ("done", "failure", "handles", "posted")

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.posted = 0
        self.done = 0
        #: the first failure one of them had (the first's is its state check's own answer)
        self.failure: Outcome | None = None

    def __repr__(self) -> str:
        return (f"<Split handles={len(self.handles)} posted={self.posted} done={self.done} "
                f"failure={self.failure}>")


class TransferDriver:
    """Makes the NIXL calls of transfers on one agent, and says what each answered.

    Args:
        agent: the NIXL agent (real or fake).
        remote: the tier's remote side.
        declaration: the lifecycle (its events say which answers a user's step may give).
        steps: the functions behind the machine's own effects, by name, each given the
            transfer (the tier binds the primary cache to them).
    """

    def __init__(self, agent: NixlAgent, remote: RemoteSide,
                 declaration: Declaration[Any, Any],
                 steps: Mapping[str, Callable[[Transfer], Any]] | None = None) -> None:
        self.agent = agent
        self.remote = remote
        self.steps = dict(steps or {})
        self._answers = declaration.answers
        # a remote side that keeps StorageSide's commit or close has nothing to do there
        self._commits = getattr(type(remote), "commit", None) is not StorageSide.commit
        self._closes = getattr(type(remote), "close", None) is not StorageSide.close
        #: the side's close has something to do only where its open kept something on the
        #: transfer (``opened``): a side says so with ``closes_opened_only = True``
        self._opened_only = getattr(remote, "closes_opened_only", False) is True
        self._lands = callable(getattr(type(remote), "landed", None))
        self._after_done = self._commits or self._lands  # (one test on the hot path)
        self._per_block = bool(getattr(remote, "transfer_per_block", False))
        #: the leaks a cleanup an interrupt cut short had found, by transfer, for its rest
        self._cut_short: dict[Transfer, list[Leak]] = {}

    def makers(self) -> dict[str, Callable[[Transfer], Outcome | tuple[Outcome, Outcome]]]:
        """For each effect the runner may say is due after the post, the function that makes
        its calls for a transfer (``make[effect](transfer)``)."""
        makers: dict[str, Callable[[Transfer], Outcome | tuple[Outcome, Outcome]]] = {
            END: self.end, TransferEvent.RELEASE: self.release, TransferEvent.CLEAN: self.clean,
            TransferEvent.PUBLISH: _publish, TransferEvent.POLL: self._poll_one}
        for name in self.steps:
            makers[name] = functools.partial(self.step, name=name)
        return makers

    def _poll_one(self, transfer: Transfer) -> Outcome:
        """One transfer's state check, as a batch of one."""
        return self.polled(transfer, self.check([transfer.xfer])[0])

    def post(self, transfer: Transfer, local: Any, local_indices: Sequence[int]) -> Outcome:
        """Open, register, prep, make and post ``transfer``.

        Each resource is stored on the transfer as soon as it exists, so a failure at any step
        leaves the transfer holding exactly what was created (F5). A job with no blocks makes
        no call and answers DONE. An interrupt comes back in the outcome: PROC once
        ``transfer()`` was called (NIXL may run it; only a poll can say it is over), else
        RAISED.
        """
        if not local_indices:
            return _DONE
        agent = self.agent
        posting = False
        call = "open"  # the call under way: a failure is that call's (CallFailed)
        try:
            remote = self.remote
            descs = remote.open(transfer)
            peer = remote.peer
            if peer is None:  # storage: register the remote side, prep it locally
                call = "register_memory"
                transfer.files = agent.register_memory(descs, remote.mem_type)
                call = "prep_xfer_dlist"
                transfer.remote = agent.prep_xfer_dlist(agent.name, transfer.files.trim())
                message = b""  # nobody to notify
            else:  # another agent's memory, known from its metadata
                call = "prep_xfer_dlist"
                transfer.remote = agent.prep_xfer_dlist(
                    peer, [d[:3] for d in descs], remote.mem_type)
                call = "notification"
                message = remote.notification(transfer)
            call = "make_prepped_xfer"
            operation = "READ" if transfer.job.is_promotion else "WRITE"
            if self._per_block and len(descs) > 1:
                return self._post_per_block(transfer, local, local_indices, operation, message)
            transfer.xfer = agent.make_prepped_xfer(
                operation, local, list(local_indices), transfer.remote, list(range(len(descs))),
                message)
            posting = True
            call = "transfer"
            return self.polled(transfer, agent.transfer(transfer.xfer), "transfer")
        except Exception as error:  # every failure is an answer, not an escape (F5)
            # (its text is what is kept; its traceback would hold this frame, and through it
            # the agent, in a cycle only the garbage collector breaks)
            return Outcome(Answer.RAISED, CallFailed(call, error.with_traceback(None)))
        except BaseException as interrupt:  # the job still gets its result
            return Outcome(Answer.PROC if posting else Answer.RAISED,
                           CallFailed(call, interrupt), interrupt)

    def _post_per_block(self, transfer: Transfer, local: Any, local_indices: Sequence[int],
                        operation: str, message: bytes) -> Outcome:
        """Make and post one NIXL transfer per block (:class:`Split`), each stored as soon as
        it exists, as :meth:`post` does for one: what the first's post answered (a poll then
        answers for all of them). A post after the first that fails leaves those after it
        unposted, and is the job's failure once the posted ones are over."""
        agent, remote = self.agent, transfer.remote
        split = transfer.split = Split()
        call, posting = "make_prepped_xfer", False
        try:
            for index, block in enumerate(local_indices):
                handle = agent.make_prepped_xfer(operation, local, [block], remote, [index],
                                                 message)
                if index == 0:
                    transfer.xfer = handle
                else:
                    split.handles.append(handle)
            call, posting = "transfer", True
            status = agent.transfer(transfer.xfer)
            if type(status) is not str or status not in _STATUS:
                return self._status(status, call)  # nothing runs: all released unposted
            answered: str | Exception
            for index, handle in enumerate(split.handles):
                split.posted = index + 1  # first: an interrupt in the post leaves it to a poll
                try:
                    answered = agent.transfer(handle)
                except Exception as error:
                    answered = error.with_traceback(None)
                if type(answered) is not str or answered not in _STATUS:  # not posted
                    split.posted = index
                    split.failure = self._status(answered, call)
                    break
                if answered == "DONE" and split.done == index:
                    split.done = index + 1  # over already: never asked
            return self.polled(transfer, status, call)
        except Exception as error:  # a make, or the first post, that raised: nothing runs
            return Outcome(Answer.RAISED, CallFailed(call, error.with_traceback(None)))
        except BaseException as interrupt:  # the job still gets its result
            if posting and split.posted < len(split.handles) and split.failure is None:
                # blocks never posted: whatever the posted ones answer, the job failed
                split.failure = Outcome(Answer.RAISED, CallFailed(call, interrupt))
            return Outcome(Answer.PROC if posting else Answer.RAISED,
                           CallFailed(call, interrupt), interrupt)

    def check(self, handles: Sequence[Any], bulk: bool = False) -> list[str | Exception]:
        """``check_xfer_state`` once on every handle, in one ``map`` resumed past each handle
        whose call raised: what each answered, or what the call raised (``StopIteration``
        included), in order. The one place kvfsm asks NIXL about a running transfer.

        With ``bulk`` (:meth:`check_all`), a batch of :data:`BULK_CHECKS` handles or more is
        asked in one list comprehension, where CPython calls a check written in Python (NIXL's
        ``check_xfer_state`` is one) without the cost of calling it from C (``map``: ~1.4x the
        calls alone on the zero-cost agent, against ~1.05x). A check that raises there loses
        the answers before it in the batch: those handles are asked again (a state check only
        reads; each answer is then the latest), then the rest once each.
        """
        check = self.agent.check_xfer_state
        if not bulk or len(handles) < BULK_CHECKS or type(handles) is not list:
            return _check_each(check, handles)
        rest = iter(handles)
        try:
            return [check(handle) for handle in rest]
        except Exception as error:  # the handle at ``failed`` raised it
            failed = len(handles) - operator.length_hint(rest) - 1
            raised = _raised(error)
        statuses = _check_each(check, handles[:failed])
        statuses.append(raised)
        statuses += _check_each(check, handles[failed + 1:])
        return statuses

    def check_all(self, handles: Sequence[Any]) -> list[str | Exception]:
        """:meth:`check` in bulk, for a round that asks about every running transfer (a drain,
        or at most ``check_all_below`` running). The poll schedule's batches, which a progress
        thread's slice bounds, go through :meth:`check` as it is: each asked once."""
        return self.check(handles, bulk=True)

    def polled(self, transfer: Transfer, status: str | Exception,
               call: str = "check_xfer_state") -> Outcome:
        """What a status call (``check_xfer_state``, or ``transfer`` at the post) answered, as
        an outcome: PROC, DONE (a store's commit made), ERR, or RAISED. A store NIXL finished
        whose commit raised answers RAISED, and one whose commit is not over yet PROC; so
        does a load whose side's ``landed`` check raised."""
        outcome = _STATUS.get(status) if type(status) is str else None
        if transfer.split is not None and outcome is not _PROC:
            # a job made per block whose first transfer is over: is every other one?
            outcome = self._split_over(
                transfer, transfer.split, outcome or self._status(status, call))
        if outcome is None:
            return self._status(status, call)
        if outcome is _DONE and self._after_done:
            if transfer.job.is_promotion:
                if self._lands:
                    try:
                        self.remote.landed(transfer)  # type: ignore[attr-defined]
                    except Exception as error:
                        return Outcome(Answer.RAISED,
                                       CallFailed("landed", error.with_traceback(None)))
            elif self._commits:
                try:
                    committed = self.remote.commit(transfer)
                except Exception as error:
                    return Outcome(Answer.RAISED,
                                   CallFailed("commit", error.with_traceback(None)))
                if committed is False:
                    return _COMMITTING
        return outcome

    @staticmethod
    def _status(status: str | Exception, call: str) -> Outcome:
        """A status that is not PROC or DONE: what the call raised, or an error status."""
        if isinstance(status, Exception):
            return Outcome(Answer.RAISED, CallFailed(call, status))
        return Outcome(Answer.ERR, CallFailed(call, status))

    def _split_over(self, transfer: Transfer, split: Split, first: Outcome) -> Outcome:
        """The first transfer of a job made per block is over (``first``: DONE, or its
        failure): PROC while another posted one still runs (which takes the first's place),
        else the job's answer, DONE or the first failure any of them had (each kept from the
        poll that saw it; a post that failed, or was cut short, included). Each of the others
        is asked until it is over, in order, and never again (NIXL's first answer that it is
        over is the one kept: F3), so a job costs each of its checks once, plus one for each
        time one still running takes the first's place."""
        if first is not _DONE and split.failure is None:
            split.failure = first
        handles = split.handles
        while split.done < split.posted:
            index = split.done
            status = self.check([handles[index]])[0]
            # over, and never asked again; or running, and then it takes the place of the
            # first (over, its answer kept above), which is never asked again either
            split.done = index + 1
            if status == NIXL_RUNNING:
                transfer.xfer, handles[index] = handles[index], transfer.xfer
                return _PROC
            if status != "DONE" and split.failure is None:
                split.failure = self._status(status, "check_xfer_state")
        return _DONE if split.failure is None else split.failure

    def end(self, transfer: Transfer) -> tuple[Outcome, Outcome]:
        """Release a transfer that is over, then (once released) make its cleanup calls: what
        each answered. An interrupt during the cleanup comes back in the second."""
        released = self.release(transfer)
        if released.answer is not Answer.OK:
            return released, _NONE
        try:
            return released, self.clean(transfer)
        except BaseException as interrupt:  # the cleanup goes on from where it stopped
            return released, Outcome(None, None, interrupt)

    def release(self, transfer: Transfer) -> Outcome:
        """Release the transfer handle (a transfer that never got one has nothing to release):
        OK, or RAISED with what the call raised (the handle is then still held).

        An interrupt during the call leaves the handle on the transfer, and a later round
        releases it: leaving its descriptors registered under a handle that may still hold them
        would be worse. One that lands as the call returns, NIXL having released it, left it
        on the transfer too, so the later round asked NIXL to release it again (the fake agent
        and the FaultyAgent refused that, and the release was tried again on every poll for
        good): a handle whose own released flag is set (NIXL's Python wrapper keeps one,
        ``_released``, as the fake's handles do) is not handed to NIXL again. (One landing
        inside NIXL's wrapper, between its release and its flag, is a window kvfsm cannot
        close.)
        """
        xfer = transfer.xfer
        if xfer is None:
            return _OK
        try:
            if transfer.split is not None:  # the others first, each once (one that raised
                self._release_others(transfer.split)  # is tried again with those after it)
            if not getattr(xfer, "_released", False):
                self.agent.release_xfer_handle(xfer)
        except Exception as error:  # still held: retried on a later round
            return Outcome(Answer.RAISED,
                           CallFailed("release_xfer_handle", error.with_traceback(None)))
        transfer.xfer = None  # released: never handed to NIXL again
        transfer.split = None
        return _OK

    def _release_others(self, split: Split) -> None:
        """Release the handles of a job made per block besides the first, the last first
        (none runs: the job is over only once every posted one is)."""
        release, handles = self.agent.release_xfer_handle, split.handles
        while handles:
            if not getattr(handles[-1], "_released", False):  # (as in :meth:`release`)
                release(handles[-1])
            handles.pop()  # released: never handed to NIXL again

    def clean(self, transfer: Transfer) -> Outcome:
        """Release the remote descriptor list, deregister, close, best effort: OK, or LEAKED
        with what could not be released, as they stand on the transfer (``leaks``: those of
        its cleanups before, and the ones this one found; an action keeps them by replacing
        ``leaks`` with them, as ``record_leaks`` does).

        Each handle is taken off the transfer before its call, so none is handed to NIXL
        twice: a call an interrupt cut short (as it started, or as it returned: NIXL may have
        released it) is a leak, never made again, and the registration under a descriptor
        list so cut short is kept (a leak too), since the list may still hold it; a remote
        side's close so cut short is a leak of ``close`` (what it could not release is
        unknown). The leaks an interrupted cleanup found are kept for its rest, made on a
        later round, and the leaks a cleanup found are on the transfer before it answers, so
        an interrupt before its answer is taken loses none. Between taking a handle and
        keeping what became of it there is no call (plain stores, the cleanup's ``try``, and
        in its handler only stores and list additions of leaks made beforehand): an interrupt
        lands in a call, or before or after one, never where a handle is taken and nothing
        says so, and a second one in the handler loses nothing either."""
        cut = self._cut_short
        leaks: list[Leak] = cut[transfer] if cut and transfer in cut else []
        call = ""
        try:
            remote = transfer.remote
            if remote is not None:
                transfer.remote = None
                call = "release_dlist_handle"
                try:
                    self.agent.release_dlist_handle(remote)
                except Exception as error:
                    leaks.append(Leak(call, _describe(error)))
            files = transfer.files
            if files is not None:
                transfer.files = None
                call = "deregister_memory"
                try:
                    self.agent.deregister_memory(files)
                except Exception as error:
                    leaks.append(Leak(call, _describe(error)))
            if self._closes and (transfer.opened is not None or not self._opened_only):
                call = "close"
                try:
                    leaks += self.remote.close(transfer)
                except Exception as error:
                    leaks.append(Leak(call, _describe(error)))
                call = ""
        except BaseException:  # cut short: what is known stays for the rest
            cut[transfer] = leaks  # (first: the same list gets what follows)
            if call and not (leaks and leaks[-1].call == call):  # (its end not kept yet)
                if call == "release_dlist_handle" and transfer.files is not None:
                    transfer.files = None  # (the list may still hold it)
                    leaks += _CUT_SHORT_KEEPING_FILES
                else:
                    leaks += _CUT_SHORT[call]
            raise
        if cut and transfer in cut:
            del cut[transfer]
        if not leaks:
            return _CLEAN
        transfer.leaks = found = (*transfer.leaks, *leaks)
        return Outcome(Answer.LEAKED, found)

    def step(self, transfer: Transfer, *, name: str) -> Outcome:
        """Make the user's step ``name``: what it answered.

        A step that raises, or returns what is not one of its event's answers, nor such an
        answer with a reason (``(answer, why)``; a why that is not text is made text), answers
        RAISED (its event must carry it: :func:`check_runnable`); one that returned so fails
        with a :class:`StepMisanswered` saying what it returned and what it may return (the
        job's reason: ``verify returned ...`` or ``verify answered ...``). An answer equal to
        one of its event's (a StrEnum's value) is taken as that answer. An answer given with
        a reason carries it to the machine's actions as the failure's detail; one given alone
        carries the step's name all the same (an empty why), so a failure it latches says
        which step answered what (``verify answered MISMATCH``), but OK and LEAKED, whose
        detail the machine's own actions read as theirs (``record_leaks`` takes its detail
        for the leaks).
        """
        try:
            answer, why = _step_answer(name, self.steps[name](transfer), self._answers[name])
        except Exception as error:  # a step's failure is an answer, not an escape
            return Outcome(Answer.RAISED, CallFailed(name, error.with_traceback(None)))
        if why is not None:
            return Outcome(answer, CallFailed(name, why))
        return Outcome(answer, None if answer in _DETAIL_OF_THEIR_OWN else CallFailed(name, ""))


def _step_answer(name: str, answered: Any, carried: Collection[Any]) -> tuple[Any, Any]:
    """What step ``name`` returned, as (answer, why), or :class:`StepMisanswered` (a TypeError)
    saying what it returned and what it must return: one of its event's answers (``carried``,
    but RAISED, which a step answers by raising), or ``(answer, why)`` (``why`` None: none).
    A value equal to one of them (a StrEnum's ``"match"``, an IntEnum's ``1``) is that
    answer."""
    if isinstance(answered, tuple):
        if len(answered) != 2:
            raise StepMisanswered(name, f"returned {answered!r}, a tuple of {len(answered)} "
                                  f"items; a step returns its answer ({_answers_of(carried)}),"
                                  " or (answer, why)")
        answer, why = answered
        if why is not None and not isinstance(why, str):
            why = _as_text(why)  # (a tensor's truth value raises: the why is text from here)
    else:
        answer, why = answered, None
    if not (isinstance(answer, enum.Enum) and answer in carried):
        answer = _equal_answer(answer, carried)
    if answer is Answer.RAISED or not (isinstance(answer, enum.Enum) and answer in carried):
        said = _misanswered(answer, carried)
        if isinstance(answered, tuple) and isinstance(answered[1], enum.Enum) \
                and answered[1] in carried:  # (why, answer): the pair the wrong way round
            said += (f"; it returned {answered!r}: a step returns (answer, why), the answer "
                     "first")
        raise StepMisanswered(name, said)
    return answer, why


def _as_text(why: Any) -> str:
    """A step's why as text (what ``str`` makes of it, or its type's name when that raises)."""
    try:
        return str(why)
    except Exception:
        return f"<{type(why).__name__}>"


#: answers a step may give whose detail kvfsm's own actions read as theirs: given alone, they
#: are handed on with none (LEAKED's is the leaks, for ``record_leaks``)
_DETAIL_OF_THEIR_OWN = frozenset({Answer.OK, Answer.LEAKED})


def _equal_answer(answer: Any, carried: Collection[Any]) -> Any:
    """The declared answer ``answer`` equals (a StrEnum's or an IntEnum's value), if exactly
    one does; else ``answer`` itself."""
    try:
        equal = [declared for declared in carried if declared == answer]
    except Exception:  # an answer whose comparison raises is no answer
        return answer
    return equal[0] if len(equal) == 1 else answer


def _answers_of(carried: Collection[Any]) -> str:
    """The answers a step may return: its event's, but RAISED (``Verified.MATCH, ...``)."""
    return ", ".join(sorted(f"{type(a).__name__}.{a.name}" for a in carried
                            if a is not Answer.RAISED))


def _misanswered(answer: Any, carried: Collection[Any]) -> str:
    """Why ``answer`` is not one a step may give, and what it may (words that follow the
    step's name): a member of another class
    than the event's answers are (a copy of their Enum, under the same name, is named with
    both modules), the name of an answer rather than the answer, or RAISED."""
    kinds = {type(a) for a in carried}
    if isinstance(answer, enum.Enum):
        kind = type(answer)
        what = (f"{kind.__name__}.{answer.name}" if kind in kinds else
                f"{kind.__module__}.{kind.__qualname__}.{answer.name}")
    else:
        kind, what = None, f"{type(answer).__name__} {answer!r}"
    if answer is Answer.RAISED:
        return (f"answered {what}, which a step answers by raising an exception, not by "
                f"returning it; it returns one of {_answers_of(carried)}")
    said = (f"answered {what}, which is not one of its event's answers "
            f"({_answers_of(carried)})")
    twins = sorted(f"{k.__module__}.{k.__qualname__}" for k in kinds
                   if kind is not None and k is not kind and k.__name__ == kind.__name__)
    if twins:
        return (f"{said}: the event takes {' or '.join(twins)} members, another class of the "
                f"same name; answer with the class the machine declares")
    named = sorted(f"{type(a).__name__}.{a.name}" for a in carried
                   if isinstance(answer, str) and a.name == answer and a is not Answer.RAISED)
    if named:
        return f"{said}; answer the member {named[0]}, not its name"
    return said


_NONE = Outcome(None)
_CLEAN = Outcome(Answer.OK, ())
#: the outcomes of a transfer's common path, each one object a tier may take by identity:
#: NIXL's DONE (a store's commit made), the release's OK, the cleanup's OK with no leak
DONE, RELEASED, CLEANED = _DONE, _OK, _CLEAN


def _publish(transfer: Transfer) -> Outcome:
    """Publishing makes no call: it answers OK."""
    return _OK


class MachineRefused(ValueError):
    """A tier was given a lifecycle it cannot run; nothing was registered with NIXL."""


def check_runnable(declaration: Declaration[Any, Any], steps: Mapping[str, Any],
                   policy: RetryPolicy) -> None:
    """Refuse a lifecycle the driver cannot run, before any NIXL call is made.

    Everything is read from the declaration (:attr:`~kvfsm.engine.Declaration.effects`,
    ``running``, ``final``): each state waits on an effect the driver makes or a step it was
    given; the initial state on ``post``, and ``post`` answering PROC leads to a running state;
    running states, and only they, on the state check ``poll``; every state but the initial one
    declares ``cancel`` (cancel() and shutdown() may come between any two steps: a running
    state latches failure, one that is over typically stays); running states under a
    ``max_running_seconds`` bound have a give-up (EXHAUSTED) edge; a state whose effect may
    leave the transfer where it is (a retry) has a give-up edge out of it too, as the retry
    bound and the shutdown deadline need one (``post`` is made once, at submit: nothing retries
    it). A step's event carries RAISED, which a step that raises answers, and no step takes the
    name of a call the tier makes itself; only the initial state waits on ``post``, and no edge
    leads back into it; each state on a circle of waits (through running states too) has a
    give-up edge; a running state is left before NIXL's end (a cancel, a give-up) only for a
    running state, or by a give-up (EXHAUSTED) for a final failure state; every way into a
    final state that is no failure state passes a ``release`` NIXL answered OK (F2); a final
    failure state is entered before it on a step's answer or a cancel only by giving up;
    every way from the release into a final state passes a ``clean`` (F8); and no edge runs
    one of kvfsm's latches from a state a transfer may reach with its outcome latched (F3).

    Raises:
        MachineRefused: one line naming the machine, the state and what is missing.
    """
    if not isinstance(declaration, Declaration):
        raise MachineRefused(f"machine must be a kvfsm Declaration (kvfsm.TRANSFER_MACHINE, or "
                             f"one of its extend()), got {type(declaration).__name__} "
                             f"{declaration!r}")
    if not isinstance(steps, Mapping):
        raise ValueError(f"steps must be a dict of effect names to step functions, got "
                         f"{type(steps).__name__} {steps!r}")
    if not isinstance(policy, RetryPolicy):
        raise ValueError(f"policy must be a kvfsm.policy.RetryPolicy, got "
                         f"{type(policy).__name__} {policy!r}")
    name = declaration.name
    effects = declaration.effects
    if not effects:
        raise MachineRefused(f"machine {name!r} declares no effects: a tier needs, for each "
                             "state a transfer waits in, the effect it waits on (effects=) and "
                             "the states NIXL may run it in (running=)")
    initial = declaration.initial
    if effects.get(initial) != TransferEvent.POST:
        raise MachineRefused(f"machine {name!r}: the initial state {initial.name} waits on "
                             f"{effects.get(initial)!r}; a tier posts a transfer from its initial "
                             "state, which waits on 'post'")
    _check_step_names(name, steps, effects)
    table = declaration.compile(listen=False).table
    _check_initial_left_for_good(declaration, table)
    for state, effect in effects.items():
        if effect == TransferEvent.POST and state is not initial:
            raise MachineRefused(f"machine {name!r}: state {state.name} waits on 'post', but a "
                                 f"tier posts a transfer once, from the initial state "
                                 f"{initial.name}: a transfer waiting there would never move")
        _check_state(declaration, table.get(state, {}), state, effect, steps, policy)
    _check_give_ups_end(declaration, table)
    _check_circles(declaration, table)
    _check_running_left_when_over(declaration, table)
    _check_released_before_final(declaration, table)
    _check_latched_once(declaration, table)
    posted = table[initial][TransferEvent.POST][Answer.PROC].dest
    if posted not in declaration.running:
        raise MachineRefused(f"machine {name!r}: 'post' answering PROC leads {initial.name} to "
                             f"{posted.name}, which is not running= (NIXL runs the transfer)")
    for step, function in steps.items():  # (after the machine: what it needs comes first)
        if not callable(function):
            raise ValueError(f"steps[{step!r}] must be a function (step(transfer, primary) -> "
                             f"its answer), got {type(function).__name__} {function!r}")


def _check_initial_left_for_good(declaration: Declaration[Any, Any],
                                 table: Mapping[Any, Any]) -> None:
    """No edge leads back into the initial state: a tier posts a transfer once, at submit, so
    one sent back there would wait for a post that never comes (and a cancel there would fire
    the post's answer over an outcome already latched)."""
    initial = declaration.initial
    for state, row in table.items():
        for event, answers in sorted(row.items()):
            for answer, step in answers.items():
                if step.dest is initial and state is not initial:
                    raise MachineRefused(
                        f"machine {declaration.name!r}: {state.name} -{event}({answer.name})-> "
                        f"{initial.name} leads back to the initial state, but a tier posts a "
                        "transfer once, at submit: it would wait there for good")


def _check_step_names(name: str, steps: Mapping[str, Any], effects: Mapping[Any, str]) -> None:
    """Each step given is one a state waits on, and none takes the name of a call the tier
    makes itself (it would take that call's place on some paths and not on others)."""
    for step in steps:
        if step in _EFFECTS or step == END:
            raise MachineRefused(f"machine {name!r}: a step {step!r} was given, but {step!r} "
                                 "is a call the tier makes itself (" + ", ".join(_EFFECTS)
                                 + "); a step of your own needs a name of its own")
        if step not in effects.values():
            own = {effect: sorted(state.name for state, waited in effects.items()
                                  if waited == effect)
                   for effect in effects.values() if effect not in _EFFECTS and effect != END}
            wanted = "; ".join(f"{', '.join(states)} wait(s) on {effect!r}"
                               + ("" if effect in steps else ", for which no step was given")
                               for effect, states in sorted(own.items()))
            raise MachineRefused(f"machine {name!r}: a step {step!r} was given, but no state "
                                 "waits on it (" + (f"the machine's own steps: {wanted}"
                                                    if own else "the machine waits on no "
                                                    "step of its own") + ")")


def _check_state(declaration: Declaration[Any, Any], moves: Mapping[str, Any], state: Any,
                 effect: str, steps: Mapping[str, Any], policy: RetryPolicy) -> None:
    """What :func:`check_runnable` checks of one state waiting on ``effect``."""
    where = f"machine {declaration.name!r}: state {state.name}"
    carried = declaration.answers[effect]
    if effect in _EFFECTS:
        missing = _EFFECTS[effect] - carried
        if missing:
            raise MachineRefused(
                f"{where} waits on {effect!r}, whose event does not carry "
                f"{', '.join(sorted(a.name for a in missing))}: the driver answers it so")
    elif effect not in steps:
        raise MachineRefused(
            f"{where} waits on effect {effect!r}, which the tier does not make "
            f"({', '.join(_EFFECTS)}) and no step was given for (steps={{{effect!r}: ...}})")
    elif Answer.RAISED not in carried:
        raise MachineRefused(f"{where} waits on the step {effect!r}, whose event does not "
                             "carry Answer.RAISED: a step that raises answers it")
    if (state in declaration.running) != (effect == TransferEvent.POLL):
        raise MachineRefused(
            f"{where} is running and waits on {effect!r}, not on the state check 'poll'"
            if state in declaration.running else
            f"{where} waits on the state check 'poll' but is not running= (its transfer "
            "would be released while NIXL may run it)")
    if state in declaration.unreachable:
        return
    if effect != TransferEvent.POST and TransferEvent.CANCEL not in moves:
        raise MachineRefused(
            f"{where} declares no 'cancel' edge: cancel() and shutdown() could not end its "
            "jobs" if state in declaration.running else
            f"{where} declares no 'cancel' edge: a cancel() or shutdown() may come while a "
            "transfer waits here, and the table must say what it means (a stay keeps the "
            "outcome)")
    if state in declaration.running:
        if policy.max_running_seconds is not None:
            _check_give_up(where, moves, effect, "the policy's max_running_seconds")
    elif effect != TransferEvent.POST and any(step.dest is state
                                              for step in moves[effect].values()):
        _check_give_up(where, moves, effect, "the retry bound and the shutdown deadline")


def _check_give_ups_end(declaration: Declaration[Any, Any], table: Mapping[Any, Any]) -> None:
    """Giving up ends: no chain of give-up edges (a state's effect answering EXHAUSTED) leads
    round to a state it left. A job whose bound is spent gives up at its next try in every
    state of such a circle (the retry bound spans them), so a poll would go round it for ever."""
    gives_up_to = {}
    for state, effect in declaration.effects.items():
        step = table.get(state, {}).get(effect, {}).get(Answer.EXHAUSTED)
        if step is not None and step.dest is not state:
            gives_up_to[state] = step.dest
    for start in gives_up_to:
        path = [start]
        while path[-1] in gives_up_to:
            following = gives_up_to[path[-1]]
            if following in path:
                circle = " -> ".join(s.name for s in [*path[path.index(following):], following])
                raise MachineRefused(
                    f"machine {declaration.name!r}: giving up goes round in a circle, {circle} "
                    "(each state's effect answering EXHAUSTED): a job whose retry bound is "
                    "spent would never end; a give-up edge must lead, in the end, to a state "
                    "that does not give up (a final one, such as QUARANTINED)")
            path.append(following)


def _check_circles(declaration: Declaration[Any, Any], table: Mapping[Any, Any]) -> None:
    """Each state on a circle of waits (states waiting on calls, steps or NIXL's end, whose
    effects' answers lead round back to it; a step may send a transfer back to a running state,
    to be asked about again) has a give-up edge: the retry bound counts the tries a state's
    effect makes in place, so a circle goes on round after round (a round making a bounded
    number of calls) until its steps stop it or shutdown's deadline gives the transfer up,
    which is its effect answering EXHAUSTED."""
    effects = declaration.effects
    waits = {state: {step.dest for answer, step in table.get(state, {}).get(effect, {}).items()
                     if answer is not Answer.EXHAUSTED and step.dest is not state}
             for state, effect in effects.items()
             if effect != TransferEvent.POST and state not in declaration.unreachable}
    for start, following_start in sorted(waits.items(), key=lambda item: _by_name(item[0])):
        path = _way_back(start, following_start, waits)
        if path is None:
            continue
        effect = effects[start]
        give_up = table.get(start, {}).get(effect, {}).get(Answer.EXHAUSTED)
        if give_up is None or give_up.dest is start:
            circle = " -> ".join(s.name for s in [*path, start])
            raise MachineRefused(
                f"machine {declaration.name!r}: state {start.name} is on a circle of waits, "
                f"{circle}, and has no give-up edge ({effect!r} answering EXHAUSTED to another "
                "state): the retry bound counts tries in place and does not span a circle, so "
                "only shutdown's deadline ends a job going round it, by giving it up there")


def _way_back(start: Any, following_start: set[Any], waits: Mapping[Any, set[Any]],
              ) -> list[Any] | None:
    """A way from ``start`` through waiting states back to it, or None (a depth-first walk)."""
    path, seen = [start], {start}
    stack = [iter(sorted(following_start, key=_by_name))]
    while stack:
        following = next(stack[-1], None)
        if following is None:
            stack.pop()
            path.pop()
            continue
        if following is start:
            return path
        if following in waits and following not in seen:
            seen.add(following)
            path.append(following)
            stack.append(iter(sorted(waits[following], key=_by_name)))
    return None


def _by_name(state: Any) -> str:
    return str(state.name)


def _check_released_before_final(declaration: Declaration[Any, Any],
                                 table: Mapping[Any, Any]) -> None:
    """What a transfer holds is let go of before it ends, on every way from the initial state
    into a final state (a walk through the states, with what each way let go of so far):

    - a final state that is no failure state is entered past a ``release`` NIXL answered OK (a
      result published before its transfer handle is released lets the engine reuse memory
      NIXL may still use, F2);
    - a final failure state entered before the release (the handle held for good, and the
      primary cache's registration with it: quarantined) on a step of the machine's own, or
      on a cancel, only by giving up (EXHAUSTED): NIXL's transfer is over (a cancel of one
      NIXL runs goes to a running state: :func:`_check_running_left_when_over`), and a step
      that merely failed, or a cancel, would hold them for nothing (on NIXL's answers, a
      release that raised, it is the lifecycle's choice to hold them);
    - and none past the release without its ``clean`` (its descriptors and registrations would
      leak, F8).
    """
    name, final = declaration.name, declaration.final
    held_ok = final & declaration.failure_states
    held, released, cleaned = 0, 1, 2

    def phase_after(phase: int, event: str, answer: Any, step: Any) -> int:
        if phase == held and event == TransferEvent.RELEASE and answer is Answer.OK:
            return released  # past a release NIXL answered: the handle was let go
        if phase == released and event == TransferEvent.CLEAN:
            return cleaned
        return phase

    for _, _, event, answer, step, after, way in _walk(declaration, table, held, phase_after):
        dest = step.dest
        if dest in final and (after == released or (after == held and (
                dest not in held_ok or (answer is not Answer.EXHAUSTED and (
                    event not in _TIER_EVENTS or event == TransferEvent.CANCEL))))):
            path = way(dest)
            raise MachineRefused(f"machine {name!r}: " + (
                f"{dest.name}, a final state, is reached after the release without a "
                f"'clean' ({path}): the transfer's descriptors and registrations "
                "would leak; lead every way from the release into a final state "
                "through a state waiting on 'clean'" if after == released else
                f"{dest.name}, a final state that is no failure state, is reached "
                f"without a 'release' ({path}): a result published before its transfer "
                "handle is released lets the engine reuse memory NIXL may still use; "
                "lead every way into it through a state waiting on 'release' (or make "
                "the state a failure state: its transfer's handles are then held for "
                "good)" if dest not in held_ok else
                f"{dest.name}, a final failure state, is entered holding the transfer "
                f"handle on {'a ' if event == TransferEvent.CANCEL else 'the step '}"
                f"{getattr(event, 'value', event)!r} answering {answer.name} ({path}):"
                " NIXL's transfer is over, "
                "yet it would hold its handles, and the primary cache's registration, "
                "for good (quarantined); lead the "
                + ("cancel elsewhere (a stay, as the shipped lifecycle's in DONE: "
                   "the job keeps its outcome)" if event == TransferEvent.CANCEL
                   else "step's failure through the release (to FAILED, say), or into "
                   "this state only on EXHAUSTED (its tries given up)")))


#: a step of a walk through the states: the state, what the walk kept of the way there, the
#: event, the answer, the step, what it keeps past the step, and the way there by name
_Walked = tuple[Any, Any, str, Any, Any, Any, Callable[..., str]]


def _walk(declaration: Declaration[Any, Any], table: Mapping[Any, Any], first: Any,
          then: Callable[[Any, str, Any, Any], Any]) -> Iterator[_Walked]:
    """Every step of the table a transfer may take, breadth first from the initial state, each
    state with what the walk keeps of the way there (``first`` at the initial state, then
    ``then(kept, event, answer, step)`` past each step: a way keeping something else is walked
    again). Each step comes with a function naming a shortest way to it (``way(*more)``:
    ``"SUBMITTED -> DONE -> ..."``, then the states ``more``)."""
    start = (declaration.initial, first)
    before: dict[tuple[Any, Any], tuple[Any, Any] | None] = {start: None}
    queue = collections.deque([start])

    def way_to(here: tuple[Any, Any]) -> Callable[..., str]:
        def way(*more: Any) -> str:
            states: list[Any] = []
            back: tuple[Any, Any] | None = here
            while back is not None:
                states.append(back[0])
                back = before[back]
            return " -> ".join(state.name for state in [*reversed(states), *more])
        return way

    while queue:
        here = queue.popleft()
        state, kept = here
        for event, row in sorted(table.get(state, {}).items()):
            for answer, step in sorted(row.items(), key=lambda item: item[0].name):
                after = then(kept, event, answer, step)
                yield state, kept, event, answer, step, after, way_to(here)
                if (step.dest, after) not in before:
                    before[(step.dest, after)] = here
                    queue.append((step.dest, after))


#: the events of the calls a tier makes itself (the others are the machine's own steps)
_TIER_EVENTS = frozenset(event.value for event in TransferEvent)

#: kvfsm's actions that latch a transfer's outcome (each raises if one is latched already),
#: known by the function, whatever name a declaration gives it
_LATCHES = (latch_success, latch_failure, latch_cancelled)


def _check_latched_once(declaration: Declaration[Any, Any], table: Mapping[Any, Any]) -> None:
    """An outcome is latched once (F3): no edge runs one of kvfsm's latches from a state a
    transfer may reach with its outcome latched already (a walk through the states, with
    whether each way latched one so far). There the latch would raise once the transfer had
    moved on, and the outcome latched first would be the one published. (Read from the table:
    an action of the user's own that calls one of kvfsm's latches is not seen.)"""
    def latches(step: Any) -> list[str]:
        return [getattr(action, "__name__", str(action))
                for action in step.actions if action in _LATCHES]

    for state, latched, event, answer, step, _, way in _walk(
            declaration, table, False,
            lambda latched, event, answer, step: latched or bool(latches(step))):
        if latched and latches(step):
            raise MachineRefused(
                f"machine {declaration.name!r}: {state.name} -{event}({answer.name})-> "
                f"{step.dest.name} runs {latches(step)[0]}, but a transfer may come to "
                f"{state.name} with its outcome latched already ({way()}): an outcome "
                "is latched once (F3), so this latch would raise, and the outcome "
                "latched first be published; decide it before one is latched (a step "
                "NIXL's end leads to, as the tutorial's VERIFYING), or take the latch "
                "off this edge")


def _check_running_left_when_over(declaration: Declaration[Any, Any],
                                  table: Mapping[Any, Any]) -> None:
    """A transfer leaves the running states (for a state whose effect may release it) only
    once its state check said NIXL's transfer is over (DONE, ERR, or the check raised); on
    another answer (a cancel, a give-up) it goes to a running state, which waits for NIXL's
    end (as CANCELLING does), or, giving up (EXHAUSTED), to a final failure state (its handle
    held for good, and its result saying its blocks are in use: only a give-up tells the
    runner NIXL may run it): NIXL crashes on a handle released while it runs the transfer,
    and a block reused under a running transfer is overwritten."""
    running = declaration.running
    held_ok = declaration.final & declaration.failure_states
    over = (Answer.DONE, Answer.ERR, Answer.RAISED)
    for state in sorted(running, key=_by_name):
        for event, row in sorted(table.get(state, {}).items()):
            for answer, step in sorted(row.items(), key=lambda item: item[0].name):
                if ((event == TransferEvent.POLL and answer in over) or step.dest in running
                        or (step.dest in held_ok and answer is Answer.EXHAUSTED)):
                    continue
                if step.dest in held_ok:
                    raise MachineRefused(
                        f"machine {declaration.name!r}: {state.name} -{event}({answer.name})-> "
                        f"{step.dest.name} ends a transfer NIXL may still run in a final "
                        "failure state on an answer that is no give-up: its result would not "
                        "say its blocks are in use (blocks_in_use), so they would be reused "
                        "under the running transfer; give up there only on EXHAUSTED (the "
                        "runner then knows NIXL may run it), or lead it to a running state that "
                        "waits for NIXL's end (as CANCELLING does)")
                raise MachineRefused(
                    f"machine {declaration.name!r}: {state.name} -{event}({answer.name})-> "
                    f"{step.dest.name} leaves a running state on an answer that does not say "
                    "NIXL's transfer is over, for a state neither running nor a final failure "
                    "state: its release would come while NIXL may still run the transfer (NIXL "
                    "crashes on that); lead it to a running state that waits for NIXL's end (as "
                    "CANCELLING does), or, giving up (EXHAUSTED), to a final failure state")


def _check_give_up(where: str, moves: Mapping[str, Any], effect: str, who: str) -> None:
    """A give-up edge: the state's effect answering EXHAUSTED leaves the state."""
    step = moves[effect].get(Answer.EXHAUSTED)
    if step is None or step.dest is step.source:
        raise MachineRefused(f"{where} has no give-up edge ({effect!r} answering EXHAUSTED to "
                             f"another state), which {who} need")
