"""Jobs, results, and the per-transfer record the lifecycle machine moves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfsm.machines.transfer import TRANSFER_MACHINE, FailureKind, FailureReason

__all__ = ["FailureKind", "FailureReason", "JobResult", "Leak", "Transfer", "TransferJob"]

Key = bytes | str


@dataclass(frozen=True, slots=True)
class TransferJob:
    """A request to copy blocks between the primary KV cache and a tier.

    ``keys[i]`` names the block stored in primary slot ``block_ids[i]``. A store copies the
    primary blocks out to the tier; a load (``is_promotion=True``) fills them from the tier.
    """

    job_id: int
    keys: Sequence[Key]
    block_ids: Sequence[int]
    is_promotion: bool = False


@dataclass(frozen=True, slots=True)
class JobResult:
    """The one result a submitted job ever publishes.

    A failed job says why in ``reason`` (:class:`~kvfsm.machines.transfer.FailureReason`: the
    call that failed and what it raised or answered, or cancelled, or quarantined), so an
    application needs no logger to learn it. The reason explains a result, it does not
    identify one: it takes no part in comparing results. ``blocks_in_use`` does: a result
    that lets the job's blocks be reused differs from one that does not.
    """

    job_id: int
    success: bool
    #: bytes moved (0 when the transfer failed)
    transfer_size: int = 0
    #: seconds from submit until the transfer finished or failed
    transfer_time: float = 0.0
    #: why the job failed; None for a success
    reason: FailureReason | None = field(default=None, compare=False)
    #: True only on a failure published while NIXL may still run the job's transfer (given
    #: up past :attr:`~kvfsm.policy.RetryPolicy.max_running_seconds`): NIXL may go on reading
    #: (a store) or writing (a load) the job's primary blocks, so they must never be reused
    #: (all of them: a job of a NIXL transfer per block is given up whole, those whose own
    #: transfer ended included). :class:`~kvfsm.tiering.TieringManager` keeps a store's pins
    #: and retires a load's blocks
    blocks_in_use: bool = False


@dataclass(frozen=True, slots=True)
class Leak:
    """A best-effort cleanup call that failed: NIXL metadata may have leaked, memory is safe."""

    call: str
    error: str


class Transfer:
    """One job's transfer: its state, the NIXL resources it holds, and its latched outcome.

    The driver stores the handles it created, and a cleanup's leaks in ``leaks`` before it
    answers (an interrupt before its answer is taken loses none); only the lifecycle
    machine's actions change ``success``, ``retries`` and ``error``, and an action keeping
    the leaks a LEAKED answer carries replaces ``leaks`` with them (they are all of them).
    """

    __slots__ = (
        "action_error",
        "attempts",
        "doomed",
        "error",
        "error_type",
        "filed",
        "files",
        "finished_at",
        "job",
        "job_id",
        "landed",
        "leaks",
        "names",
        "nbytes",
        "opened",
        "queued",
        "reason",
        "remote",
        "retries",
        "retry_at",
        "slot",
        "split",
        "started_at",
        "state",
        "success",
        "trace",
        "xfer",
    )

    def __init__(self, job: TransferJob, nbytes: int, started_at: float,
                 initial: Any = None) -> None:
        self.job = job
        #: the job this transfer carries
        self.job_id: int = job.job_id
        #: where its lifecycle has it (its machine's initial state to begin with: the tier
        #: passes its machine's; by default the transfer machine's)
        self.state = TRANSFER_MACHINE.initial if initial is None else initial
        self.nbytes = nbytes
        self.started_at = started_at
        self.finished_at = started_at
        #: the outcome, latched on entering DONE (True) or FAILED (False); None before that
        self.success: bool | None = None
        #: how many times releasing the transfer handle raised and was retried
        self.retries = 0
        #: monotonic time before which a failed release (or step) is not retried (0: at once)
        self.retry_at = 0.0
        #: failed tries of the effect the transfer waits on now, for the retry policy (a
        #: release that raised, a step answering a stay): back to 0 when it moves on
        self.attempts = 0
        #: the last NIXL error this transfer saw, as text
        self.error: str | None = None
        #: that error's type, the exception's class name (None: it raised nothing); other
        #: machines key on it (:data:`kvfsm.machines.peer_link.LINK_LOST_BY`), never on the text
        self.error_type: str | None = None
        #: why the transfer failed, latched with a failed outcome (None: it did not fail)
        self.reason: FailureReason | None = None
        self.leaks: tuple[Leak, ...] = ()
        #: registered remote descriptors (register_memory), or None
        self.files: Any = None
        #: prepped remote descriptor list handle (prep_xfer_dlist), or None
        self.remote: Any = None
        #: transfer handle (make_prepped_xfer), or None once released
        self.xfer: Any = None
        #: a job made one NIXL transfer per block: the others' handles (a
        #: :class:`kvfsm.driver.Split`), or None (one transfer, or all released)
        self.split: Any = None
        #: what the tier's remote side opened for this transfer (files), or None
        self.opened: Any = None
        #: whether a store that failed may have left blocks under their names (True unless
        #: its remote side knows it put none there: a file tier's store that failed before
        #: its rename), so that a tier with a capacity removes only what may be its own
        self.landed = True
        #: the names a load reads that the tier was removing as it began: whatever it
        #: answers, the tier does not vouch for them afterwards
        self.doomed: tuple[str, ...] = ()
        #: the remote name of each key (object names, file names), as the tier checked them
        self.names: tuple[str, ...] = ()
        #: where the runner's running list keeps the transfer while NIXL runs it (-1: not there)
        self.slot = -1
        #: which of the runner's poll-schedule queues hold an entry for it (bits), so one
        #: that runs again while still queued is not queued twice
        self.queued = 0
        #: the state the runner counts it under (None: not filed yet, or published)
        self.filed: Any = None
        #: the steps taken, flat: step, time, step, time... (a chain of steps taken at once
        #: in place of a step; see :mod:`kvfsm.trace`)
        self.trace: list[Any] = []

    def result(self) -> JobResult:
        """The job's result, as the record says it once it is final (the runner settles the
        record first: a transfer ending in a final failure state fails, whatever it latched,
        and one that ends there still holding its transfer handle is quarantined); a failure
        carries its reason (one nothing recorded is UNKNOWN, with the action that raised
        before it could latch one, or the last error)."""
        success = bool(self.success)
        reason = None if success else self.reason
        if reason is None and not success:  # (an action that raised says what it was: set
            # only then, by the engine, so no transfer pays for it otherwise)
            reason = FailureReason(FailureKind.UNKNOWN, None, getattr(
                self, "action_error", None) or self.error or NO_REASON)
        return JobResult(self.job_id, success, self.nbytes if success else 0,
                         self.finished_at - self.started_at, reason)

    def log_fields(self, error: str | None = None) -> dict[str, Any]:
        """The structured fields of a log line about this transfer (``extra=`` of logging)."""
        return {"kvfsm_job_id": self.job_id, "kvfsm_state": self.state.name,
                "kvfsm_nixl_error": self.error if error is None else error}

    def __repr__(self) -> str:
        outcome = {None: "pending", True: "success", False: "failure"}[self.success]
        return (f"<Transfer job={self.job_id} {self.state.name} {outcome} "
                f"retries={self.retries} leaks={len(self.leaks)}>")


#: the text of a failure whose machine recorded neither a reason nor an error
NO_REASON = "no reason recorded"
