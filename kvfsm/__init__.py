"""kvfsm: KV-cache offload transfers as explicit, declarative finite-state machines."""

from kvfsm.engine import CompiledMachine, Declaration, DeclarationError, InvalidTransition
from kvfsm.lifecycle import TRANSFER_MACHINE, Answer, TransferEvent, TransferState
from kvfsm.transfer import JobResult, Leak, Transfer, TransferJob

__all__ = [
    "TRANSFER_MACHINE",
    "Answer",
    "CompiledMachine",
    "Declaration",
    "DeclarationError",
    "InvalidTransition",
    "JobResult",
    "Leak",
    "Transfer",
    "TransferEvent",
    "TransferJob",
    "TransferState",
]

__version__ = "0.1.0"
