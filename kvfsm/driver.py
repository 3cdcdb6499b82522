"""The driver: performs each NIXL call of a transfer and feeds its answer to the machine.

The driver holds no rules. It knows which call a transfer in a given state is waiting on, makes
that call, turns what NIXL answered (a string, a return, or an exception) into an
:class:`~kvfsm.lifecycle.Answer`, and fires the matching event. Whether the transfer moves, stays
or retries is the lifecycle table's decision (:mod:`kvfsm.lifecycle`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvfsm.agent import NixlAgent
from kvfsm.engine import CompiledMachine
from kvfsm.lifecycle import TRANSFER_MACHINE, Answer, TransferEvent, TransferState
from kvfsm.transfer import Leak, Transfer

__all__ = ["TransferDriver"]

_STATUS = {"PROC": Answer.PROC, "DONE": Answer.DONE}


def _status(answer: str) -> Answer:
    """Map a NIXL status string; anything but PROC and DONE is an error."""
    return _STATUS.get(answer, Answer.ERR)


class TransferDriver:
    """Performs the NIXL calls of transfers on one agent, for one compiled lifecycle.

    Args:
        agent: the NIXL agent (real or fake).
        machine: the compiled lifecycle; by default a fresh compilation of
            :data:`~kvfsm.lifecycle.TRANSFER_MACHINE` (so its step counts are this driver's own).
    """

    def __init__(
        self,
        agent: NixlAgent,
        machine: CompiledMachine[TransferState, Answer] | None = None,
    ) -> None:
        self.agent = agent
        self.machine = machine if machine is not None else TRANSFER_MACHINE.compile()
        self._calls: dict[TransferState, Callable[[Transfer], None]] = {
            TransferState.PROCESSING: self.poll,
            TransferState.DONE: self.release,
            TransferState.FAILED: self.release,
            TransferState.XFER_RELEASED: self.clean,
            TransferState.CLEANED: self.publish,
        }

    def post(
        self,
        transfer: Transfer,
        operation: str,
        local: Any,
        local_indices: Sequence[int],
        remote_descs: Sequence[tuple[int, int, int, str]],
        remote_mem_type: str,
    ) -> None:
        """Register, prep, make and post ``transfer``; fire ``post`` with the answer.

        Each resource is stored on the transfer as soon as it exists, so a failure at any step
        leaves the transfer holding exactly what was created (F5). A job with no descriptors
        makes no call and answers DONE.
        """
        agent = self.agent
        detail: Any = None
        if not remote_descs:
            answer = Answer.DONE
        else:
            try:
                transfer.files = agent.register_memory(list(remote_descs), remote_mem_type)
                transfer.remote = agent.prep_xfer_dlist(agent.name, transfer.files.trim())
                transfer.xfer = agent.make_prepped_xfer(
                    operation, local, list(local_indices), transfer.remote,
                    list(range(len(remote_descs))))
                answer = _status(agent.transfer(transfer.xfer))
                if answer is Answer.ERR:
                    detail = "transfer() answered ERR"
            except Exception as error:  # every NIXL failure is an answer, not an escape (F5)
                answer, detail = Answer.RAISED, error
        self.machine.fire(transfer, TransferEvent.POST, answer, detail)

    def poll(self, transfer: Transfer) -> None:
        """Ask NIXL whether the transfer is still running; fire ``poll`` with the answer."""
        try:
            status = self.agent.check_xfer_state(transfer.xfer)
        except Exception as error:  # a raised state check is the transfer's failure (F4)
            self.machine.fire(transfer, TransferEvent.POLL, Answer.RAISED, error)
            return
        answer = _status(status)
        self.machine.fire(transfer, TransferEvent.POLL, answer,
                          f"check_xfer_state answered {status!r}" if answer is Answer.ERR
                          else None)

    def release(self, transfer: Transfer) -> None:
        """Release the transfer handle (a transfer that never got one has nothing to release)."""
        if transfer.xfer is not None:
            try:
                self.agent.release_xfer_handle(transfer.xfer)
            except Exception as error:  # stay and retry on the next poll (F1)
                self.machine.fire(transfer, TransferEvent.RELEASE, Answer.RAISED, error)
                return
            transfer.xfer = None  # released: never handed to NIXL again
        self.machine.fire(transfer, TransferEvent.RELEASE, Answer.OK)

    def clean(self, transfer: Transfer) -> None:
        """Release the remote descriptor list, then deregister; each failure is a leak."""
        leaks: list[Leak] = []
        if transfer.remote is not None:
            try:
                self.agent.release_dlist_handle(transfer.remote)
            except Exception as error:
                leaks.append(Leak("release_dlist_handle", f"{type(error).__name__}: {error}"))
            transfer.remote = None
        if transfer.files is not None:
            try:
                self.agent.deregister_memory(transfer.files)
            except Exception as error:
                leaks.append(Leak("deregister_memory", f"{type(error).__name__}: {error}"))
            transfer.files = None
        self.machine.fire(transfer, TransferEvent.CLEAN,
                          Answer.LEAKED if leaks else Answer.OK, tuple(leaks))

    def publish(self, transfer: Transfer) -> None:
        """Hand the result out: the last step, taken once."""
        self.machine.fire(transfer, TransferEvent.PUBLISH, Answer.OK)

    def advance(self, transfer: Transfer) -> bool:
        """Make calls for ``transfer`` until it waits on NIXL or is published.

        Returns:
            True when the transfer reached PUBLISHED in this call.
        """
        calls = self._calls
        while True:
            before = transfer.state
            call = calls.get(before)
            if call is None:  # SUBMITTED waits on post(); PUBLISHED has nothing left
                return False
            call(transfer)
            if transfer.state is TransferState.PUBLISHED:
                return True
            if transfer.state is before:  # still running, or a release to retry next poll
                return False
