"""The driver: performs each NIXL call of a transfer and feeds its answer to the machine.

The driver holds no rules. It knows which call a transfer in a given state is waiting on, makes
that call, turns what NIXL answered (a string, a return, or an exception) into an
:class:`~kvfsm.lifecycle.Answer`, and fires the matching event. Whether the transfer moves, stays
or retries is the lifecycle table's decision (:mod:`kvfsm.lifecycle`).

What differs between tiers (object keys, files) is a :class:`RemoteSide`: it opens the remote
descriptors of a transfer, commits a finished store (a file tier renames its file into place),
and closes what it opened. Its calls are part of the NIXL call they sit beside: an error while
opening or committing is that call's error, and an error while closing is a leak.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvfsm.agent import NixlAgent
from kvfsm.engine import Chain, CompiledMachine
from kvfsm.lifecycle import TRANSFER_MACHINE, Answer, TransferEvent, TransferState
from kvfsm.policy import RetryPolicy
from kvfsm.transfer import Leak, Transfer

__all__ = ["RemoteSide", "StorageSide", "TransferDriver"]

_STATUS = {"PROC": Answer.PROC, "DONE": Answer.DONE}
_FINAL = frozenset({TransferState.PUBLISHED, TransferState.QUARANTINED})
_RUNNING = frozenset({TransferState.PROCESSING, TransferState.CANCELLING})
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

    def commit(self, transfer: Transfer) -> None:
        """Make a store NIXL finished visible (may raise: the store then fails)."""

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

    def commit(self, transfer: Transfer) -> None:
        """Nothing to commit: the data is visible once NIXL finished."""

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
            :data:`~kvfsm.lifecycle.TRANSFER_MACHINE` (so its step counts are this driver's own).
    """

    def __init__(
        self,
        agent: NixlAgent,
        remote: RemoteSide,
        machine: CompiledMachine[TransferState, Answer] | None = None,
        policy: RetryPolicy | None = None,
    ) -> None:
        self.agent = agent
        self.remote = remote
        self.policy = policy if policy is not None else RetryPolicy()
        self.machine = machine if machine is not None else TRANSFER_MACHINE.compile()
        # each call fires what it got; True: the release was already tried this round. Kept
        # as the class's functions, not bound methods: a driver that referred to itself would
        # live (and keep its NIXL agent) until the garbage collector found the cycle
        cls = TransferDriver
        self._calls: dict[TransferState, Callable[[TransferDriver, Transfer], bool | None]] = {
            TransferState.PROCESSING: cls.poll,
            TransferState.DONE: cls.release,
            TransferState.FAILED: cls.release,
            TransferState.XFER_RELEASED: cls.clean,
            TransferState.CLEANED: cls.publish,
            TransferState.CANCELLING: cls.poll,
        }
        # a remote side that keeps StorageSide's commit or close has nothing to do there
        self._commits = getattr(type(remote), "commit", None) is not StorageSide.commit
        self._closes = getattr(type(remote), "close", None) is not StorageSide.close
        #: per state whose call is the release: the chain release, clean, publish take when
        #: each answers OK, read from the table (a machine that declares another way has none)
        self._ending: dict[TransferState, Chain[TransferState]] = {}
        for state, call in self._calls.items():
            ending = self._ending_chain(state) if call is cls.release else None
            if ending is not None:
                self._ending[state] = ending
        #: per event (post, poll) and state: where the table leads a DONE on to such a state,
        #: that step and the ending as one chain (a failure's detail varies: those are fired
        #: step by step)
        self._finishing: dict[str, dict[TransferState, Chain[TransferState]]] = {}
        for event in (TransferEvent.POST, TransferEvent.POLL):
            chains = self._finishing[event] = {}
            for source, events in self.machine.table.items():
                step = events.get(event, {}).get(Answer.DONE)
                ending = self._ending.get(step.dest) if step is not None else None
                if step is not None and ending is not None and not step.is_stay:
                    moves: list[tuple[str, Answer, Any]] = [(event, Answer.DONE, None)]
                    moves += ((s.edge.event, Answer(s.answer), d) for s, d in ending.moves)
                    chains[source] = self.machine.chain(source, moves)

    def post(self, transfer: Transfer, local: Any, local_indices: Sequence[int]) -> bool:
        """Open, register, prep, make and post ``transfer``; fire ``post`` with the answer.
        Returns True when the release was tried too and must wait for the next poll.

        Each resource is stored on the transfer as soon as it exists, so a failure at any step
        leaves the transfer holding exactly what was created (F5). A job with no blocks makes
        no call and answers DONE.
        """
        agent = self.agent
        detail: Any = None
        answer = Answer.DONE
        posting = False
        if local_indices:
            try:
                remote = self.remote
                descs = remote.open(transfer)
                peer = remote.peer
                if peer is None:  # storage: register the remote side, prep it locally
                    transfer.files = agent.register_memory(descs, remote.mem_type)
                    transfer.remote = agent.prep_xfer_dlist(agent.name, transfer.files.trim())
                    message = b""  # nobody to notify
                else:  # another agent's memory, known from its metadata
                    transfer.remote = agent.prep_xfer_dlist(
                        peer, [d[:3] for d in descs], remote.mem_type)
                    message = remote.notification(transfer)
                transfer.xfer = agent.make_prepped_xfer(
                    "READ" if transfer.job.is_promotion else "WRITE",
                    local, list(local_indices), transfer.remote, list(range(len(descs))),
                    message)
                posting = True
                status = agent.transfer(transfer.xfer)
                answer = _STATUS.get(status, Answer.ERR)
                if answer is Answer.ERR:
                    detail = f"transfer() answered {status!r}"
                elif answer is Answer.DONE:
                    answer, detail = self._commit(transfer)
            except Exception as error:  # every failure is an answer, not an escape (F5)
                answer, detail = Answer.RAISED, error
            except BaseException as interrupt:  # an interrupt: the job still gets its result
                # once transfer() was called NIXL may run it: only a poll can say it is over
                self.machine.fire(transfer, TransferEvent.POST,
                                  Answer.PROC if posting else Answer.RAISED, interrupt)
                raise
        if answer is Answer.PROC:  # posted and running: the common case, one step
            self.machine.fire(transfer, TransferEvent.POST, answer)
            return False
        try:
            return self._answer(transfer, TransferEvent.POST, answer, detail)
        finally:  # an exception kept here would hold this frame, and the agent, in a cycle
            del detail

    def poll(self, transfer: Transfer) -> bool:
        """Ask NIXL whether the transfer is still running; fire ``poll`` with the answer."""
        try:
            status = self.agent.check_xfer_state(transfer.xfer)
        except Exception as error:  # a raised state check is the transfer's failure (F4)
            return self.polled(transfer, error)
        return self.polled(transfer, status)

    def polled(self, transfer: Transfer, status: str | Exception) -> bool:
        """Fire ``poll`` with what ``check_xfer_state`` answered (a status, or what it raised).
        Returns True when the release was tried too and must wait for the next poll."""
        if isinstance(status, Exception):
            self.machine.fire(transfer, TransferEvent.POLL, Answer.RAISED, status)
            return False
        answer = _STATUS.get(status, Answer.ERR)
        detail: Any = None
        if answer is Answer.DONE and self._commits:
            answer, detail = self._commit(transfer)
        elif answer is Answer.ERR:
            detail = f"check_xfer_state answered {status!r}"
        return self._answer(transfer, TransferEvent.POLL, answer, detail)

    def settle(self, transfer: Transfer, held: bool) -> bool:
        """After a post or poll: go on with the calls the transfer waits on (unless ``held``,
        its release already tried this round); True once it is in a final state."""
        if transfer.state in _FINAL:
            return True
        return False if held else self.advance(transfer)

    def _answer(self, transfer: Transfer, event: str, answer: Answer, detail: Any) -> bool:
        """Fire ``event`` with NIXL's answer. Where the table leads a DONE on to the release
        (the copy is over), the release, clean and publish calls are made at once and, when
        each answers OK, all four steps are taken as one :class:`~kvfsm.engine.Chain`; else
        the steps are fired one by one, in the same order, each with what its call answered.
        Returns True when the release raised and the transfer stays to retry it (or backs
        off): it waits for the next poll.
        """
        machine = self.machine
        finish = self._finishing[event].get(transfer.state) if answer is Answer.DONE else None
        if finish is None:
            machine.fire(transfer, event, answer, detail)  # raises if not declared
            return False
        released: bool | Exception = False
        try:
            released = self._release_call(transfer)
            leaks = self._cleanup(transfer) if released is True else []
        except BaseException:  # an interrupt: keep what NIXL answered and what was done
            machine.fire(transfer, event, answer, detail)
            if released is True:  # released; the cleanup goes on from where it stopped
                machine.fire(transfer, TransferEvent.RELEASE, Answer.OK)
            raise
        if released is True:
            if not leaks:
                machine.run(transfer, finish)
                return False
            machine.fire(transfer, event, answer, detail)
            machine.fire(transfer, TransferEvent.RELEASE, Answer.OK)
            machine.fire(transfer, TransferEvent.CLEAN, Answer.LEAKED, tuple(leaks))
            return False
        machine.fire(transfer, event, answer, detail)
        if released is False:  # backing off: no call made
            return True
        waiting = transfer.state
        self._release_failed(transfer, released)
        return transfer.state is waiting  # a retry waits for the next poll, as in advance()

    def release(self, transfer: Transfer) -> None:
        """Release the transfer handle (a transfer that never got one has nothing to release)."""
        released = self._release_call(transfer)
        if released is True:
            self.machine.fire(transfer, TransferEvent.RELEASE, Answer.OK)
        elif released is not False:
            self._release_failed(transfer, released)

    def _release_call(self, transfer: Transfer) -> bool | Exception:
        """Make the release call, firing nothing: True when the handle is released (or there
        was none), False while backing off (no call), or what the call raised."""
        if transfer.xfer is None:
            return True
        if transfer.retry_at and time.monotonic() < transfer.retry_at:
            return False  # backing off: no call this poll
        try:
            self.agent.release_xfer_handle(transfer.xfer)
        except Exception as error:
            return error
        transfer.xfer = None  # released: never handed to NIXL again
        return True

    def _release_failed(self, transfer: Transfer, error: Exception) -> None:
        """Fire a release that raised: it stays and is retried on the next poll (F1), or is
        quarantined once the retry policy's bound is spent."""
        now = time.monotonic()
        failures = transfer.retries + 1
        if self.policy.spent(failures, transfer.finished_at, now):
            self.machine.fire(transfer, TransferEvent.RELEASE, Answer.EXHAUSTED, error)
            logger.error("job %d quarantined after %d failed release(s): %s",
                         transfer.job_id, failures, transfer.error, extra=transfer.log_fields())
            return
        self.machine.fire(transfer, TransferEvent.RELEASE, Answer.RAISED, error)
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

    def cancel(self, transfer: Transfer) -> None:
        """The caller cancelled the job; the machine says what that means in its state."""
        self.machine.fire(transfer, TransferEvent.CANCEL, Answer.OK)

    def give_up(self, transfer: Transfer, why: str) -> None:
        """The retry policy's bound is spent for a transfer still waiting on NIXL: fire the
        call it waits on with EXHAUSTED (a release, or a poll of a transfer still running)."""
        was = transfer.state
        event = (TransferEvent.POLL if was in _RUNNING else TransferEvent.RELEASE)
        self.machine.fire(transfer, event, Answer.EXHAUSTED, why)
        logger.error("job %d quarantined in %s: %s", transfer.job_id, was.name, why,
                     extra=transfer.log_fields())

    def advance(self, transfer: Transfer) -> bool:
        """Make calls for ``transfer`` until it waits on NIXL or is published.

        A transfer that is over (in a state whose call is the release, DONE or FAILED in the
        lifecycle) takes the rest of its way, release, clean and publish, as one
        :class:`~kvfsm.engine.Chain` when each call answers OK; the first call that does not
        is fired on its own, where the chain had got to, and the calls go on one by one.

        Returns:
            True when the transfer is in a final state (PUBLISHED, QUARANTINED): reached in
            this call, or by the answer fired just before it.
        """
        calls, endings = self._calls, self._ending
        if transfer.state in _FINAL:  # the answer fired before took it all the way
            return True
        while True:
            before = transfer.state
            ending = endings.get(before)
            if ending is None:
                call = calls.get(before)
                if call is None:  # SUBMITTED waits on post(); PUBLISHED has nothing left
                    return False
                if call(self, transfer):  # a release tried already: it waits for the next poll
                    return transfer.state in _FINAL
            else:
                released = self._release_call(transfer)
                if released is True:
                    leaks = self._cleanup(transfer)
                    if not leaks:
                        self.machine.run(transfer, ending)
                        return True
                    self.machine.fire(transfer, TransferEvent.RELEASE, Answer.OK)
                    self.machine.fire(transfer, TransferEvent.CLEAN, Answer.LEAKED,
                                      tuple(leaks))
                elif released is not False:  # False: backing off, no call this poll
                    self._release_failed(transfer, released)
            if transfer.state in _FINAL:
                return True
            if transfer.state is before:  # still running, or a release to retry next poll
                return False

    def _ending_chain(self, state: TransferState) -> Chain[TransferState] | None:
        """Release, clean and publish, each answering OK, from ``state``: the chain, when the
        table leads them through states whose calls are exactly those, to a final state."""
        cls = TransferDriver
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
        if at not in _FINAL:
            return None
        return self.machine.chain(state, [(event, Answer.OK, detail)
                                          for _, event, detail in moves])

    def _commit(self, transfer: Transfer) -> tuple[Answer, Any]:
        """NIXL answered DONE: commit a store; a commit that raises makes the answer RAISED."""
        if transfer.job.is_promotion or not self._commits:
            return Answer.DONE, None
        try:
            self.remote.commit(transfer)
        except Exception as error:
            return Answer.RAISED, error
        return Answer.DONE, None
