"""Contender (c): the same tier with ``transitions`` deciding every step at run time.

The machine is kvfsm's own declaration (:data:`kvfsm.machines.transfer.TRANSFER_MACHINE`: its
states, transition dicts, guard sets and actions), run by ``transitions`` itself instead of the
compiled table. Two ways to use it:

* ``per_transfer``: one ``transitions.Machine`` per transfer, built at submit;
* ``shared``: one ``Machine`` for the tier, each transfer added with ``add_model`` at submit and
  removed with ``remove_model`` when it is published.

Every NIXL answer is fired as an event (``post``, ``poll``, ``release``, ``clean``,
``publish``), a PROC answer to a poll included: with ``transitions`` the machine, not the
caller, decides that PROC is a stay. The NIXL calls, validation and publishing are those of the
hand-written loop (:mod:`handloop`), so the difference is what ``transitions`` costs.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from handloop import (
    _DEV_ID_SPACE,
    HandTier,
    Others,
    _describe,
    _dev_ids,
    make_and_post,
    others_over,
    release_others,
)
from transitions import Machine

from kvfsm.machines.transfer import ACTIONS, GUARDS, TRANSFER_MACHINE, Answer, TransferState
from kvfsm.transfer import Leak, TransferJob

PROCESSING = TransferState.PROCESSING
PUBLISHED = TransferState.PUBLISHED
_STATUS = {"PROC": Answer.PROC, "DONE": Answer.DONE}


def _guard(accepted: frozenset[Answer]) -> Any:
    def guard(self: Any, answer: Answer, detail: Any = None) -> bool:
        return answer in accepted

    return guard


class TransferModel:
    """One transfer, as a ``transitions`` model: its guards and actions are the declared ones."""

    # no __slots__: transitions adds its trigger methods to each model's __dict__

    def __init__(self, job: TransferJob, names: tuple[str, ...], nbytes: int) -> None:
        self.job = job
        self.names = names
        self.nbytes = nbytes
        self.started_at = self.finished_at = time.monotonic()
        self.success: bool | None = None
        self.retries = 0
        self.error: str | None = None
        self.leaks: tuple[Leak, ...] = ()
        self.files: Any = None
        self.remote: Any = None
        self.xfer: Any = None
        self.others: Others | None = None  # a job of several blocks: a transfer per block


def _answer(status: Any, call: str) -> tuple[Answer, Any]:
    """What a status call answered (a status, or what it raised), as the machine's answer."""
    if isinstance(status, Exception):
        return Answer.RAISED, status
    answer = _STATUS.get(status, Answer.ERR)
    return answer, None if answer is not Answer.ERR else f"{call} answered {status!r}"


for _name, _accepted in GUARDS.items():
    setattr(TransferModel, _name, _guard(frozenset(_accepted)))
for _name, _action in ACTIONS.items():  # latch_success(self, answer, detail) and the others
    setattr(TransferModel, _name, _action)


class TransitionsTier(HandTier):
    """The hand-written tier's calls, with every step decided by ``transitions``."""

    def __init__(self, primary: torch.Tensor, *, agent: Any, mode: str,
                 key_prefix: str = "") -> None:
        super().__init__(primary, agent=agent, key_prefix=key_prefix)
        if mode not in {"per_transfer", "shared"}:
            raise ValueError(f"mode must be per_transfer or shared, got {mode!r}")
        self.mode = mode
        self._machine: Machine | None = (TRANSFER_MACHINE.build_machine(None)
                                         if mode == "shared" else None)
        self._models: dict[int, TransferModel] = {}  # job id -> unpublished transfer

    def has_pending_work(self) -> bool:
        return bool(self._models) or bool(self._results)

    def _submit(self, job: TransferJob, load: bool) -> None:
        names, block_ids = self._validate(job, load)
        self._in_flight.add(job.job_id)
        model = TransferModel(job, names, len(block_ids) * self.block_bytes)
        if self._machine is None:
            TRANSFER_MACHINE.build_machine(model)
        else:
            self._machine.add_model(model)
        self._models[job.job_id] = model
        answer, detail = Answer.DONE, None
        if load and self._forgotten and not self._forgotten.isdisjoint(names):
            answer, detail = Answer.RAISED, "open raised ForgottenKeyError"  # no NIXL call
        elif block_ids:
            agent = self.agent
            try:
                size = self.block_bytes
                model.files = agent.register_memory(
                    [(0, size, next(_dev_ids) % _DEV_ID_SPACE, name) for name in names], "OBJ")
                model.remote = agent.prep_xfer_dlist(agent.name, model.files.trim())
                others = model.others = Others() if len(block_ids) > 1 else None
                status = make_and_post(agent, self._local, model.remote, block_ids, load,
                                       lambda handle: setattr(model, "xfer", handle), others)
                if status == "DONE" and others is not None:
                    status = others_over(agent, others, status)
                answer, detail = _answer(status, "transfer()")
            except Exception as error:
                answer, detail = Answer.RAISED, error
        model.post(answer, detail)
        if model.state is not PROCESSING:
            self._advance(model)

    def _poll(self) -> None:
        check = self.agent.check_xfer_state
        models = list(self._models.values())
        checked: dict[int, Any] = {}  # every running transfer's first handle, then the rest
        for model in models:
            if model.state is PROCESSING:
                try:
                    checked[id(model)] = check(model.xfer)
                except Exception as error:
                    checked[id(model)] = error
        for model in models:
            if model.state is PROCESSING:
                status = checked[id(model)]
                if status != "PROC" and model.others is not None:
                    status = others_over(self.agent, model.others, status)
                model.poll(*_answer(status, "check_xfer_state"))
                if model.state is PROCESSING:
                    continue
            self._advance(model)

    def _advance(self, model: TransferModel) -> None:
        """Release, clean and publish as far as the machine lets the transfer go."""
        if model.state in (TransferState.DONE, TransferState.FAILED):
            if model.xfer is not None:
                try:
                    if model.others is not None:
                        release_others(self.agent, model.others)
                    self.agent.release_xfer_handle(model.xfer)
                except Exception as error:
                    model.release(Answer.RAISED, error)
                    return
                model.xfer = None
            model.release(Answer.OK)
        if model.state is TransferState.XFER_RELEASED:
            self._clean(model)
        if model.state is TransferState.CLEANED:
            model.publish(Answer.OK)
        if model.state is PUBLISHED:
            self._published_model(model)

    def _clean(self, model: TransferModel) -> None:
        agent = self.agent
        leaks: list[Leak] = []
        if model.remote is not None:
            try:
                agent.release_dlist_handle(model.remote)
            except Exception as error:
                leaks.append(Leak("release_dlist_handle", _describe(error)))
            model.remote = None
        if model.files is not None:
            try:
                agent.deregister_memory(model.files)
            except Exception as error:
                leaks.append(Leak("deregister_memory", _describe(error)))
            model.files = None
        model.clean(Answer.LEAKED if leaks else Answer.OK, tuple(leaks))

    def _published_model(self, model: TransferModel) -> None:
        job_id = model.job.job_id
        del self._models[job_id]
        if self._machine is not None:
            self._machine.remove_model(model)
        self._publish([job_id, model.names, model.nbytes, model.started_at,
                       model.job.is_promotion, None, None, None, bool(model.success),
                       model.finished_at, model.retries, model.error], list(model.leaks))
