"""A lifecycle of your own: a load succeeds only once each block it loaded matches its checksum.

The shipped transfer lifecycle (:data:`kvfsm.TRANSFER_MACHINE`) with one more state. When NIXL
answers DONE, a transfer goes to VERIFYING instead of DONE, where it waits on an effect of its
own, ``verify``: a function the tier is given (``steps={"verify": Checksums()}``) that answers
MATCH or MISMATCH. MATCH latches success and the transfer goes on to its release as usual;
MISMATCH (or a step that raises: RAISED) latches failure, with the step's answer and its reason
as the job's :class:`~kvfsm.FailureReason` (``verify answered MISMATCH: block 3 ...``).

The scheme is what an engine would do with its own block index: a store records the CRC-32 of
each block it wrote (the bytes NIXL copied are the primary block's, pinned until the store's
result), under the block's remote name; a load compares the CRC-32 of each block it filled with
the one recorded. A block changed in the store since (bit rot, another writer, a truncated
file) fails its load instead of handing the engine wrong KV values. Keep the record where the
block index lives; here it is a dict in the process's memory, so a block stored by another
process (or before a restart) has no checksum, and its load fails.

Run it in a tier::

    checksums = Checksums()
    tier = FileTier(cache, "/tmp/kv", machine=VERIFY_MACHINE, steps={"verify": checksums})

and explore it with every NIXL call, and the step, failing at every step::

    explore(VERIFY_MACHINE, steps={"verify": Checksums()})

or from the command line, naming the steps as the machine is named (:data:`STEPS`)::

    kvfsm explore --machine examples.verify_lifecycle:VERIFY_MACHINE \\
        --steps examples.verify_lifecycle:STEPS
"""

from __future__ import annotations

import enum
import zlib
from typing import Any

import torch

from kvfsm import TRANSFER_MACHINE, Declaration
from kvfsm.driver import StepFunction
from kvfsm.lifecycle import Answer
from kvfsm.transfer import Transfer

__all__ = ["STEPS", "VERIFY_MACHINE", "Checksums", "Verified", "VerifyState"]


class Verified(enum.Enum):
    """What the ``verify`` step answers."""

    #: every block matches its recorded checksum (or, for a store, was recorded)
    MATCH = "MATCH"
    #: a loaded block differs from what was stored, or nothing was recorded for it
    MISMATCH = "MISMATCH"


#: the transfer lifecycle with a checksum check of every block after NIXL's DONE: DONE from
#: NIXL leads to VERIFYING instead (nothing latched yet), which waits on the step ``verify``
VERIFY_MACHINE: Declaration[Any, Any] = TRANSFER_MACHINE.extend(
    "verify",
    states=["VERIFYING"],
    replace={("SUBMITTED", "post", "finished"): {"dest": "VERIFYING", "after": []},
             ("PROCESSING", "poll", "finished"): {"dest": "VERIFYING", "after": []}},
    answers={"verify": (Verified.MATCH, Verified.MISMATCH, Answer.RAISED)},
    guards={"matched": (Verified.MATCH,), "unverified": (Verified.MISMATCH, Answer.RAISED)},
    transitions=[
        {"trigger": "verify", "source": "VERIFYING", "dest": "DONE", "conditions": "matched",
         "after": "latch_success"},
        {"trigger": "verify", "source": "VERIFYING", "dest": "FAILED",
         "conditions": "unverified", "after": "latch_failure"},
        {"trigger": "cancel", "source": "VERIFYING", "dest": "VERIFYING"}],
    effects={"VERIFYING": "verify"},
    calls={"verify": "crc32"},
)
#: its states: the shipped ones, and VERIFYING (NIXL finished, the blocks are being checked)
VerifyState: Any = VERIFY_MACHINE.states


class Checksums:
    """The ``verify`` step: records each stored block's CRC-32, checks each loaded one.

    ``crcs`` maps a block's remote name (object key, file name) to the CRC-32 of its bytes.
    """

    def __init__(self) -> None:
        self.crcs: dict[str, int] = {}

    def __call__(self, transfer: Transfer, primary: torch.Tensor,
                 ) -> Verified | tuple[Verified, str]:
        blocks = transfer.job.block_ids
        if not transfer.job.is_promotion:  # a store: what NIXL copied out is recorded
            for name, block in zip(transfer.names, blocks, strict=True):
                self.crcs[name] = _crc(primary[block])
            return Verified.MATCH
        for name, block in zip(transfer.names, blocks, strict=True):
            loaded, stored = _crc(primary[block]), self.crcs.get(name)
            if loaded != stored:
                recorded = "none recorded" if stored is None else f"stored {stored:08x}"
                return Verified.MISMATCH, (f"checksum mismatch in block {block} ({name}): "
                                           f"crc32 {loaded:08x}, {recorded}")
        return Verified.MATCH


#: the machine's steps, for ``kvfsm explore --steps examples.verify_lifecycle:STEPS``; a tier
#: is given its own (``steps={"verify": Checksums()}``), so each keeps the checksums of its store
STEPS: dict[str, StepFunction] = {"verify": Checksums()}


def _crc(block: torch.Tensor) -> int:
    return zlib.crc32(block.contiguous().view(torch.uint8).numpy().tobytes())
