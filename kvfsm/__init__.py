"""kvfsm: KV-cache offload transfers as explicit, declarative finite-state machines."""

import logging

from kvfsm.engine import CompiledMachine, Declaration, DeclarationError, InvalidTransition
from kvfsm.machines.transfer import (
    TRANSFER_MACHINE,
    Answer,
    FailureKind,
    FailureReason,
    TransferEvent,
    TransferState,
)
from kvfsm.transfer import JobResult, Leak, Transfer, TransferJob

__all__ = [
    "TRANSFER_MACHINE",
    "Answer",
    "CompiledMachine",
    "Declaration",
    "DeclarationError",
    "FailureKind",
    "FailureReason",
    "InvalidTransition",
    "JobResult",
    "Leak",
    "Transfer",
    "TransferEvent",
    "TransferJob",
    "TransferState",
]

__version__ = "0.1.0"

# A library logs to the "kvfsm" logger and leaves handlers to the application.
logging.getLogger("kvfsm").addHandler(logging.NullHandler())
