"""The driver: performs each NIXL call of a transfer and feeds its answer to the machine.

The driver holds no rules. The declaration says which effect a transfer in each state waits on
(``effects``, each named by the event it fires), which states are running and which final; the
driver makes that effect, turns what it answered (a string, a return, or an exception) into an
:class:`~kvfsm.machines.transfer.Answer`, in one place per kind of effect, and fires the event. The
effects it knows are NIXL's (``post``, ``poll``, ``release``, ``clean``) and ``publish``; any
other is a *step* of the user's, a function given to the tier (:data:`StepFunction`), whose
answer (or raise: ``RAISED``) is fired as its event. Whether the transfer moves, stays
or retries is the lifecycle table's decision (:mod:`kvfsm.machines.transfer`). Once a transfer
is over, its release and cleanup calls are made one after the other and, when each answers OK,
the steps they lead to are taken together as one chain read from the same table.

What differs between tiers (object keys, files) is a :class:`RemoteSide`: it opens the remote
descriptors of a transfer, commits a finished store (a file tier renames its file into place),
and closes what it opened. Its calls are part of the NIXL call they sit beside: an error while
opening or committing is that call's error, and an error while closing is a leak. A commit that
is not finished yet (a file tier flushing on a thread of its own) makes the answer PROC: for the
machine the store still runs, and the next poll asks again.
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from kvfsm.agent import NixlAgent
from kvfsm.engine import Chain, CompiledMachine, Declaration
from kvfsm.machines.transfer import TRANSFER_MACHINE, Answer, CallFailed, TransferEvent
from kvfsm.policy import RetryPolicy
from kvfsm.transfer import Leak, Transfer

__all__ = ["NIXL_RUNNING", "MachineRefused", "RemoteSide", "StepFunction", "StorageSide",
           "TransferDriver", "check_runnable"]

#: what NIXL's status calls answer while a transfer runs (the tier's poll compares it in bulk)
NIXL_RUNNING = "PROC"
_STATUS = {NIXL_RUNNING: Answer.PROC, "DONE": Answer.DONE}
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
logger = logging.getLogger("kvfsm")


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
        finished yet, ask again on a later poll (the driver answers PROC meanwhile)."""

    def close(self, transfer: Transfer) -> list[Leak]:
        """Release what :meth:`open` kept, after NIXL let go of it; report what could not be."""


class StorageSide:
    """What most remote sides share: storage this agent registers itself, no notification,
    nothing to commit or close. Subclasses say ``mem_type`` and how to ``open``."""

    mem_type: str
    peer: str | None = None

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


class TransferDriver:
    """Performs the NIXL calls of transfers on one agent, for one compiled lifecycle.

    Args:
        agent: the NIXL agent (real or fake).
        remote: the tier's remote side.
        machine: the compiled lifecycle; by default a fresh compilation of
            :data:`~kvfsm.machines.transfer.TRANSFER_MACHINE` (so its step counts are this
            driver's own).
    """

    def __init__(
        self,
        agent: NixlAgent,
        remote: RemoteSide,
        machine: CompiledMachine[Any, Any] | None = None,
        policy: RetryPolicy | None = None,
        steps: Mapping[str, Callable[[Transfer], Any]] | None = None,
    ) -> None:
        self.agent = agent
        self.remote = remote
        self.policy = policy if policy is not None else RetryPolicy()
        self.machine = machine if machine is not None else TRANSFER_MACHINE.compile()
        declaration = self.machine.declaration
        self.steps = dict(steps or {})
        check_runnable(declaration, self.steps, self.policy)
        #: the states a transfer is over in, and those NIXL may still run it in
        self.final = declaration.final
        self.running = declaration.running
        #: the effect each state waits on, by the event it fires
        self.effects = declaration.effects
        # each state's call, kept as the class's functions, not bound methods: a driver that
        # referred to itself would live (and keep its NIXL agent) until the garbage collector
        # found the cycle. The initial state's post is made by post() alone, at submit
        cls = type(self)
        made: dict[str, Callable[[TransferDriver, Transfer], None]] = {
            TransferEvent.POLL: cls.poll, TransferEvent.RELEASE: cls.release,
            TransferEvent.CLEAN: cls.clean, TransferEvent.PUBLISH: cls.publish}
        self._calls: dict[Any, Callable[[TransferDriver, Transfer], None]] = {
            state: made.get(effect) or functools.partial(cls.step, name=effect)
            for state, effect in self.effects.items() if effect != TransferEvent.POST}
        # a remote side that keeps StorageSide's commit or close has nothing to do there
        self._commits = getattr(type(remote), "commit", None) is not StorageSide.commit
        self._closes = getattr(type(remote), "close", None) is not StorageSide.close
        #: per state whose call is the release (DONE, FAILED): the chain release, clean and
        #: publish take when each answers OK, read from the table (a machine that declares
        #: another way has none, and runs step by step)
        self._ending: dict[Any, Chain[Any]] = {}
        for state, call in self._calls.items():
            ending = self._ending_chain(state) if call is cls.release else None
            if ending is not None:
                self._ending[state] = ending

    def post(self, transfer: Transfer, local: Any, local_indices: Sequence[int]) -> None:
        """Open, register, prep, make and post ``transfer``; fire ``post`` with the answer.

        Each resource is stored on the transfer as soon as it exists, so a failure at any step
        leaves the transfer holding exactly what was created (F5). A job with no blocks makes
        no call and answers DONE.
        """
        agent = self.agent
        detail: Any = None
        answer = Answer.DONE
        posting = False
        call = "open"  # the call under way: a failure is that call's (CallFailed)
        if local_indices:
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
                transfer.xfer = agent.make_prepped_xfer(
                    "READ" if transfer.job.is_promotion else "WRITE",
                    local, list(local_indices), transfer.remote, list(range(len(descs))),
                    message)
                posting = True
                call = "transfer"
                status = agent.transfer(transfer.xfer)
                answer = _STATUS.get(status, Answer.ERR)
                if answer is Answer.ERR:
                    detail = CallFailed("transfer", status)
                elif answer is Answer.DONE and self._commits:
                    answer, detail = self._commit(transfer)
            except Exception as error:  # every failure is an answer, not an escape (F5)
                # (its text is what is kept; its traceback would hold this frame, and through
                # it the agent, in a cycle only the garbage collector breaks)
                answer, detail = Answer.RAISED, CallFailed(call, error.with_traceback(None))
            except BaseException as interrupt:  # an interrupt: the job still gets its result
                # once transfer() was called NIXL may run it: only a poll can say it is over
                self.machine.fire(transfer, TransferEvent.POST,
                                  Answer.PROC if posting else Answer.RAISED, interrupt)
                raise
        self.machine.fire(transfer, TransferEvent.POST, answer, detail)

    def poll(self, transfer: Transfer) -> None:
        """Ask NIXL whether the transfer is still running; fire ``poll`` with the answer."""
        try:
            status = self.agent.check_xfer_state(transfer.xfer)
        except Exception as error:  # a raised state check is the transfer's failure (F4)
            self.polled(transfer, error.with_traceback(None))
            return
        self.polled(transfer, status)

    def polled(self, transfer: Transfer, status: str | Exception) -> None:
        """Fire ``poll`` with what ``check_xfer_state`` answered (a status, or what it raised)."""
        if isinstance(status, Exception):
            self.machine.fire(transfer, TransferEvent.POLL, Answer.RAISED,
                              CallFailed("check_xfer_state", status))
            return
        answer = _STATUS.get(status, Answer.ERR)
        detail: Any = None
        if answer is Answer.DONE and self._commits:
            answer, detail = self._commit(transfer)
        elif answer is Answer.ERR:
            detail = CallFailed("check_xfer_state", status)
        self.machine.fire(transfer, TransferEvent.POLL, answer, detail)

    def commit_failed(self, transfer: Transfer, error: Exception) -> None:
        """A store NIXL finished whose commit did not end (a flush past the running bound):
        fire the poll's RAISED, as a commit that raised does."""
        self.machine.fire(transfer, TransferEvent.POLL, Answer.RAISED, CallFailed("commit", error))

    def settle(self, transfer: Transfer) -> bool:
        """After a post or poll fired: make the calls the transfer waits on now; True once it
        is in a final state."""
        return transfer.state in self.final or self.advance(transfer)

    def release(self, transfer: Transfer) -> None:
        """Release the transfer handle (a transfer that never got one has nothing to release)."""
        released = self._release_call(transfer)
        if released is True:
            self.machine.fire(transfer, TransferEvent.RELEASE, Answer.OK)
        elif released is not False:
            self._release_failed(transfer, released)

    def _release_call(self, transfer: Transfer) -> bool | Exception:
        """Make the release call, firing nothing: True when the handle is released (or there
        was none), False while backing off (no call), or what the call raised.

        An interrupt during the call leaves the handle on the transfer, and a later poll
        releases it: leaving its descriptors registered under a handle that may still hold them
        would be worse. (One that lands after NIXL released it but before this method noted it
        makes that later call a second one, which NIXL's Python wrapper ignores: its handle
        keeps a released flag.)
        """
        xfer = transfer.xfer
        if xfer is None:
            return True
        if transfer.retry_at and time.monotonic() < transfer.retry_at:
            return False  # backing off: no call this poll
        try:
            self.agent.release_xfer_handle(xfer)
        except Exception as error:  # still held: retried on a later poll
            return error.with_traceback(None)  # no cycle through the caller's frame
        transfer.xfer = None  # released: never handed to NIXL again
        return True

    def _release_failed(self, transfer: Transfer, error: Exception) -> None:
        """Fire a release that raised: it stays and is retried on the next poll (F1), or is
        quarantined once the retry policy's bound is spent."""
        now = time.monotonic()
        failures = transfer.retries + 1
        failed = CallFailed("release_xfer_handle", error)
        if self.policy.spent(failures, transfer.finished_at, now):
            self.machine.fire(transfer, TransferEvent.RELEASE, Answer.EXHAUSTED, failed)
            logger.error("job %d quarantined after %d failed release(s): %s",
                         transfer.job_id, failures, transfer.error, extra=transfer.log_fields())
            return
        self.machine.fire(transfer, TransferEvent.RELEASE, Answer.RAISED, failed)
        transfer.retry_at = self.policy.next_attempt(failures, now)
        retries = transfer.retries
        if retries & (retries - 1) == 0:  # the 1st, 2nd, 4th, 8th... retry: not every poll
            logger.warning("job %d: release_xfer_handle raised (retry %d): %s",
                           transfer.job_id, retries, transfer.error, extra=transfer.log_fields())

    def clean(self, transfer: Transfer) -> None:
        """Release the remote descriptor list, deregister, close; each failure is a leak."""
        leaks = self._cleanup(transfer)
        self.machine.fire(transfer, TransferEvent.CLEAN,
                          Answer.LEAKED if leaks else Answer.OK, tuple(leaks))

    def _cleanup(self, transfer: Transfer) -> list[Leak]:
        """The cleanup calls, best effort; what could not be released."""
        leaks: list[Leak] = []
        if transfer.remote is not None:
            try:
                self.agent.release_dlist_handle(transfer.remote)
            except Exception as error:
                leaks.append(Leak("release_dlist_handle", _describe(error)))
            transfer.remote = None
        if transfer.files is not None:
            try:
                self.agent.deregister_memory(transfer.files)
            except Exception as error:
                leaks.append(Leak("deregister_memory", _describe(error)))
            transfer.files = None
        if self._closes:
            try:
                leaks += self.remote.close(transfer)
            except Exception as error:
                leaks.append(Leak("close", _describe(error)))
        return leaks

    def publish(self, transfer: Transfer) -> None:
        """Hand the result out: the last step, taken once."""
        self.machine.fire(transfer, TransferEvent.PUBLISH, Answer.OK)

    def step(self, transfer: Transfer, *, name: str) -> None:
        """Make the user's step ``name``; fire its event with what it answered.

        A step that raises, or answers what its event does not carry, answers RAISED (its
        event must carry it: :func:`check_runnable`); an answer given with a reason
        (``(answer, why)``) carries it to the machine's actions as the failure's detail.
        """
        try:
            answered = self.steps[name](transfer)
            answer, why = answered if isinstance(answered, tuple) else (answered, None)
            if answer not in self.machine.declaration.answers[name] or answer is Answer.RAISED:
                raise TypeError(f"step {name!r} answered {answered!r}, not one of its "
                                "event's answers")
        except Exception as error:  # a step's failure is an answer, not an escape
            self.machine.fire(transfer, name, Answer.RAISED,
                              CallFailed(name, error.with_traceback(None)))
            return
        self.machine.fire(transfer, name, answer, None if why is None else CallFailed(name, why))

    def cancel(self, transfer: Transfer) -> None:
        """The caller cancelled the job; the machine says what that means in its state.

        A state that declares no ``cancel`` is one NIXL no longer runs in (a tier refuses a
        machine whose running states lack it): the transfer is over, keeps its outcome and goes
        on to its result, as a cancelled job that already ended does. (An interrupt during the
        cleanup calls leaves a transfer in XFER_RELEASED, which is such a state.)
        """
        if TransferEvent.CANCEL in self.machine.table.get(transfer.state, {}):
            self.machine.fire(transfer, TransferEvent.CANCEL, Answer.OK)

    def give_up(self, transfer: Transfer, why: str) -> None:
        """The retry policy's bound is spent for a transfer still waiting on NIXL: fire the
        call it waits on with EXHAUSTED (a release, or a poll of a transfer still running)."""
        was = transfer.state
        self.machine.fire(transfer, self.effects[was], Answer.EXHAUSTED, why)
        logger.error("job %d quarantined in %s: %s", transfer.job_id, was.name, why,
                     extra=transfer.log_fields())

    def advance(self, transfer: Transfer) -> bool:
        """Make calls for ``transfer`` until it waits on NIXL or is published.

        A transfer that is over (in a state whose call is the release, DONE or FAILED in the
        lifecycle) makes its release and cleanup calls and, when each answers OK, takes the
        rest of its way (release, clean, publish) as one :class:`~kvfsm.engine.Chain`; else
        each step is fired on its own with what its call answered, in the same order.

        Returns:
            True when the transfer is in a final state (PUBLISHED, QUARANTINED).
        """
        calls, endings, final = self._calls, self._ending, self.final
        while True:
            before = transfer.state
            if before in final:
                return True
            ending = endings.get(before)
            if ending is not None:
                self._end(transfer, ending)
            else:
                call = calls.get(before)
                if call is None:  # SUBMITTED waits on post()
                    return False
                call(self, transfer)
            if transfer.state is before:  # still running, or a release to retry next poll
                return False

    def _end(self, transfer: Transfer, ending: Chain[Any]) -> None:
        """Release and clean up a transfer that is over; publish it as one chain if every call
        answered OK, else fire what each answered."""
        machine = self.machine
        released: bool | Exception = False
        try:
            released = self._release_call(transfer)
            leaks = self._cleanup(transfer) if released is True else []
        except BaseException:  # an interrupt: record the release if it was made, and go
            if released is True:  # the cleanup goes on from where it stopped
                machine.fire(transfer, TransferEvent.RELEASE, Answer.OK)
            raise
        if released is True:
            if not leaks:
                machine.run(transfer, ending)
                return
            machine.fire(transfer, TransferEvent.RELEASE, Answer.OK)
            machine.fire(transfer, TransferEvent.CLEAN, Answer.LEAKED, tuple(leaks))
        elif released is not False:  # False: backing off, no call this poll
            self._release_failed(transfer, released)

    def _ending_chain(self, state: Any) -> Chain[Any] | None:
        """Release, clean and publish, each answering OK, from ``state``: the chain, when the
        table leads them through states whose calls are exactly those, to a final state."""
        cls = type(self)
        moves = ((cls.release, TransferEvent.RELEASE, None),
                 (cls.clean, TransferEvent.CLEAN, ()),
                 (cls.publish, TransferEvent.PUBLISH, None))
        table = self.machine.table
        at = state
        for call, event, _ in moves:
            step = table.get(at, {}).get(event, {}).get(Answer.OK)
            if self._calls.get(at) is not call or step is None or step.dest is at:
                return None
            at = step.dest
        if at not in self.final:
            return None
        return self.machine.chain(state, [(event, Answer.OK, detail)
                                          for _, event, detail in moves])

    def _commit(self, transfer: Transfer) -> tuple[Answer, Any]:
        """NIXL answered DONE: commit a store; a commit that raises makes the answer RAISED,
        and one not finished yet PROC (the store is not over until its commit is)."""
        if transfer.job.is_promotion:
            return Answer.DONE, None
        try:
            committed = self.remote.commit(transfer)
        except Exception as error:
            return Answer.RAISED, CallFailed("commit", error.with_traceback(None))  # no cycle
        return (Answer.PROC, None) if committed is False else (Answer.DONE, None)


class MachineRefused(ValueError):
    """A tier was given a lifecycle it cannot run; nothing was registered with NIXL."""


def check_runnable(declaration: Declaration[Any, Any], steps: Mapping[str, Any],
                   policy: RetryPolicy) -> None:
    """Refuse a lifecycle the driver cannot run, before any NIXL call is made.

    Everything is read from the declaration (:attr:`~kvfsm.engine.Declaration.effects`,
    ``running``, ``final``): each state waits on an effect the driver makes or a step it was
    given; the initial state on ``post``, and ``post`` answering PROC leads to a running state;
    running states, and only they, on the state check ``poll``, with a ``cancel`` edge (cancel()
    and shutdown() must reach them) and, under a ``max_running_seconds`` bound, a give-up
    (EXHAUSTED) edge; a state whose effect may leave the transfer where it is (a retry) has a
    give-up edge out of it too, as the retry bound and the shutdown deadline need one (``post``
    is made once, at submit: nothing retries it). A step's event carries RAISED, which a step
    that raises answers.

    Raises:
        MachineRefused: one line naming the machine, the state and what is missing.
    """
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
    for step in steps:
        if step not in effects.values():
            raise MachineRefused(f"machine {name!r}: a step {step!r} was given, but no state "
                                 "waits on it")
    table = declaration.compile(listen=False).table
    for state, effect in effects.items():
        _check_state(declaration, table.get(state, {}), state, effect, steps, policy)
    posted = table[initial][TransferEvent.POST][Answer.PROC].dest
    if posted not in declaration.running:
        raise MachineRefused(f"machine {name!r}: 'post' answering PROC leads {initial.name} to "
                             f"{posted.name}, which is not running= (NIXL runs the transfer)")


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
    if state in declaration.running:
        if TransferEvent.CANCEL not in moves:
            raise MachineRefused(f"{where} is running and declares no 'cancel' edge: "
                                 "cancel() and shutdown() could not end its jobs")
        if policy.max_running_seconds is not None:
            _check_give_up(where, moves, effect, "the policy's max_running_seconds")
    elif effect != TransferEvent.POST and any(step.dest is state
                                              for step in moves[effect].values()):
        _check_give_up(where, moves, effect, "the retry bound and the shutdown deadline")


def _check_give_up(where: str, moves: Mapping[str, Any], effect: str, who: str) -> None:
    """A give-up edge: the state's effect answering EXHAUSTED leaves the state."""
    step = moves[effect].get(Answer.EXHAUSTED)
    if step is None or step.dest is step.source:
        raise MachineRefused(f"{where} has no give-up edge ({effect!r} answering EXHAUSTED to "
                             f"another state), which {who} need")
