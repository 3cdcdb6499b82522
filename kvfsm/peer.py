"""Peer-to-peer KV transfers between two engines over NIXL's UCX backend, with notifications.

The sender writes primary blocks straight into the receiver's KV cache. On the sender's side
that is a transfer like any other, so :class:`PeerSender` is a tier running the transfer
lifecycle (:data:`kvfsm.lifecycle.TRANSFER_MACHINE`): it answers PROC, DONE or an error, its
handle is released only once it is over, and only then is the result published (the peer
transport's faults F2 and F4 are the lifecycle's to prevent). What is peer-specific on that side
is the remote memory: the receiver's, known from its metadata (``add_remote_agent``), prepped
under the receiver's name, and a notification message naming the job.

The receiver has no transfer handle: it learns that the write landed from the notification
NIXL delivers (``get_new_notifs``), and that it never will when the sender disappears. That is a
second machine, :data:`PEER_RECEIVE`, declared here with the same tools (and so with the same
compiled engine, diagram, explorer and coverage as the first):

    EXPECTING --notified[arrived]--> ARRIVED --publish--> PUBLISHED (success)
    EXPECTING --watch[gone]--> PEER_LOST --publish--> PUBLISHED (failure)

A receiver block is written by the sender's NIXL, so the receiver may reuse it only when the
write is over: when the notification arrived (NIXL sends it after the data; it names the job
*and* the receiver blocks, so a write into other blocks never counts), or when the sender is
gone. :meth:`PeerReceiver.forget_peer` removes the sender's metadata before any job it owed
fails, but that does not revoke the access a live sender already has: a one-sided UCX write of
a sender that is still running can still land. So call it only when the sender is really gone
(its process ended, its connection broke), and the same goes for :meth:`PeerReceiver.shutdown`
with senders still connected.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvfsm.engine import Declaration
from kvfsm.lifecycle import latch_failure, latch_success
from kvfsm.policy import RetryPolicy
from kvfsm.tiers.base import InvalidJobError, Lookup, SecondaryTier, _check_primary
from kvfsm.transfer import JobResult, Leak, Transfer, TransferJob

__all__ = [
    "PEER_RECEIVE",
    "PeerAnswer",
    "PeerReceiver",
    "PeerSender",
    "ReceiveState",
    "notification_for",
]


class ReceiveState(enum.Enum):
    """Where an expected incoming write is."""

    #: the receiver's blocks wait for the sender's write
    EXPECTING = "expecting"
    #: the notification arrived: NIXL wrote every block before it sent it
    ARRIVED = "arrived"
    #: the sender disappeared and was cut off: no write of it can land any more
    PEER_LOST = "peer_lost"
    #: the one result was handed out
    PUBLISHED = "published"


class PeerAnswer(enum.Enum):
    """What the receiver learned."""

    #: the job's notification was among NIXL's new notifications
    ARRIVED = "ARRIVED"
    #: the sender is still known
    PRESENT = "PRESENT"
    #: the sender is gone, and its metadata removed
    GONE = "GONE"
    #: nothing to learn (publish)
    OK = "OK"


R = ReceiveState

#: The receiving side of a peer write, declared once.
PEER_RECEIVE: Declaration[ReceiveState, PeerAnswer] = Declaration(
    "peer_receive",
    states=ReceiveState,
    initial=ReceiveState.EXPECTING,
    answers={"notified": [PeerAnswer.ARRIVED],
             "watch": [PeerAnswer.PRESENT, PeerAnswer.GONE],
             "publish": [PeerAnswer.OK]},
    guards={"arrived": [PeerAnswer.ARRIVED], "present": [PeerAnswer.PRESENT],
            "gone": [PeerAnswer.GONE]},
    actions={"latch_success": latch_success, "latch_failure": latch_failure},
    transitions=[
        {"trigger": "notified", "source": R.EXPECTING, "dest": R.ARRIVED,
         "conditions": "arrived", "after": "latch_success"},
        {"trigger": "watch", "source": R.EXPECTING, "dest": R.EXPECTING,
         "conditions": "present"},
        {"trigger": "watch", "source": R.EXPECTING, "dest": R.PEER_LOST, "conditions": "gone",
         "after": "latch_failure"},
        {"trigger": "publish", "source": R.ARRIVED, "dest": R.PUBLISHED},
        {"trigger": "publish", "source": R.PEER_LOST, "dest": R.PUBLISHED},
    ],
    final=(ReceiveState.PUBLISHED,),
    failure_states=(ReceiveState.PEER_LOST,),
)


def notification_for(job_id: int, blocks: Sequence[int]) -> bytes:
    """The notification a peer write of ``job_id`` into the receiver's ``blocks`` carries."""
    return f"kvfsm-job:{job_id}:{','.join(map(str, blocks))}".encode()


def _peer_name(name: Any) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


class _Expected:
    """One job the receiver expects: the record its machine moves."""

    __slots__ = ("error", "finished_at", "job", "peer", "started_at", "state", "success",
                 "trace")

    def __init__(self, job: TransferJob, peer: str) -> None:
        self.job = job
        self.peer = peer
        self.state = ReceiveState.EXPECTING
        self.success: bool | None = None
        self.error: str | None = None
        self.started_at = self.finished_at = time.monotonic()
        self.trace: list[Any] = []


class PeerReceiver:
    """The receiving engine's side: registers its KV cache once, expects jobs, publishes one
    result for each when its notification arrives or its sender is gone.

    Args:
        primary: the receiver's KV cache (contiguous CPU tensor, blocks on the first dimension).
        agent: a NIXL agent with the UCX backend.
    """

    def __init__(self, primary: torch.Tensor, *, agent: Any) -> None:
        _check_primary(primary)
        self.primary = primary
        self.agent = agent
        self.name = _peer_name(agent.name)
        self.block_bytes = int(primary[0].nbytes)
        self.num_blocks = int(primary.shape[0])
        self.machine = PEER_RECEIVE.compile(trace=True)
        self._registration = agent.register_memory(
            [(primary.data_ptr(), self.num_blocks * self.block_bytes, 0, "")], "DRAM")
        self._expected: dict[int, _Expected] = {}
        self._by_message: dict[tuple[str, bytes], int] = {}
        #: notifications no expected job claimed yet (one may arrive before its expect())
        self._unclaimed: dict[tuple[str, bytes], None] = {}
        self._peers: set[str] = set()
        self._results: list[JobResult] = []
        self._lock = threading.RLock()
        self._closed = False

    def metadata(self) -> bytes:
        """This agent's metadata, for the sender's ``add_remote_agent``."""
        metadata: bytes = self.agent.get_agent_metadata()
        return metadata

    def block_descs(self) -> list[tuple[int, int, int]]:
        """The receiver's blocks as NIXL descriptors, for the sender."""
        base = self.primary.data_ptr()
        return [(base + i * self.block_bytes, self.block_bytes, 0) for i in range(self.num_blocks)]

    def connect(self, sender_metadata: bytes) -> str:
        """Load a sender's metadata (so its notifications are accepted); returns its name."""
        with self._lock:
            name = _peer_name(self.agent.add_remote_agent(sender_metadata))
            self._peers.add(name)
            return name

    def expect(self, job: TransferJob, sender: str) -> None:
        """Expect ``sender``'s write of ``job`` into ``job.block_ids`` (allocated, being
        written, by the receiver's parent).

        Raises:
            InvalidJobError: the job id is already expected, the sender is unknown, or a block
                id is out of range; nothing changed.
        """
        with self._lock:
            if job.job_id in self._expected:
                raise InvalidJobError(f"job {job.job_id} is already expected")
            if sender not in self._peers:
                raise InvalidJobError(f"job {job.job_id}: unknown sender {sender!r}; "
                                      "connect() it first")
            for block in job.block_ids:
                if not 0 <= block < self.num_blocks:
                    raise InvalidJobError(f"job {job.job_id}: block {block} is out of range "
                                          f"[0, {self.num_blocks})")
            self._expected[job.job_id] = _Expected(job, sender)
            message = (sender, notification_for(job.job_id, job.block_ids))
            if message in self._unclaimed:  # it came first: it counts at the next poll
                del self._unclaimed[message]
                self.machine.fire(self._expected[job.job_id], "notified", PeerAnswer.ARRIVED)
            else:
                self._by_message[message] = job.job_id

    def forget_peer(self, sender: str) -> None:
        """The sender is gone: remove its metadata, then fail what it owed (at the next poll).

        Only for a sender that is really gone: a live sender's writes are not revoked.
        """
        with self._lock:
            if sender in self._peers:
                self.agent.remove_remote_agent(sender)
                self._peers.discard(sender)

    def get_finished_jobs(self) -> list[JobResult]:
        """Take NIXL's new notifications, watch the senders; the results published since."""
        with self._lock:
            for sender, messages in self.agent.get_new_notifs().items():
                for message in messages:
                    key = (_peer_name(sender), bytes(message))
                    job_id = self._by_message.pop(key, None)
                    if job_id is not None:
                        self.machine.fire(self._expected[job_id], "notified", PeerAnswer.ARRIVED)
                    elif len(self._unclaimed) < 65536:
                        self._unclaimed[key] = None
            if self._expected:
                for expected in list(self._expected.values()):
                    if expected.state is ReceiveState.EXPECTING:
                        answer = (PeerAnswer.PRESENT if expected.peer in self._peers
                                  else PeerAnswer.GONE)
                        self.machine.fire(expected, "watch", answer,
                                          None if answer is PeerAnswer.PRESENT
                                          else f"sender {expected.peer} is gone")
                    if expected.state is not ReceiveState.EXPECTING:
                        self._publish(expected)
            results, self._results = self._results, []
            return results

    def has_pending_work(self) -> bool:
        """True while a job is expected or a result not handed out."""
        return bool(self._expected) or bool(self._results)

    def drain_jobs(self, timeout: float | None = None, step: Callable[[], Any] | None = None
                   ) -> None:
        """Wait until every expected job is published (``step`` also runs the sender's side
        when both live in one process)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._expected:
            if step is not None:
                step()
            with self._lock:
                self._results += self.get_finished_jobs()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{len(self._expected)} expected job(s) never arrived: "
                                   f"{sorted(self._expected)}")
            time.sleep(0.0002)

    def shutdown(self) -> None:
        """Cut every sender off, fail what they owed, release the cache. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for sender in list(self._peers):
                self.forget_peer(sender)
            self._results += self.get_finished_jobs()
            self.agent.deregister_memory(self._registration)
            self._closed = True

    def state_of(self, job_id: int) -> ReceiveState | None:
        """The state of an expected job, or None once published."""
        expected = self._expected.get(job_id)
        return None if expected is None else expected.state

    def _publish(self, expected: _Expected) -> None:
        self.machine.fire(expected, "publish", PeerAnswer.OK)
        del self._expected[expected.job.job_id]
        self._by_message.pop(
            (expected.peer, notification_for(expected.job.job_id, expected.job.block_ids)), None)
        success = bool(expected.success)
        self._results.append(JobResult(
            expected.job.job_id, success,
            len(expected.job.block_ids) * self.block_bytes if success else 0,
            expected.finished_at - expected.started_at))


class _PeerMemory:
    """The sender's remote side: the receiver's blocks, named by the job's keys."""

    mem_type = "DRAM"

    def __init__(self, tier: PeerSender) -> None:
        self._tier = tier

    @property
    def peer(self) -> str | None:
        return self._tier.peer

    def open(self, transfer: Transfer) -> list[tuple[int, int, int, str]]:
        tier = self._tier
        if tier.peer is None:
            raise ConnectionError("no receiver is connected")
        return [(*tier.receiver_blocks[tier.remote_index(key)], "") for key in transfer.job.keys]

    def notification(self, transfer: Transfer) -> bytes:
        keys = transfer.job.keys
        return notification_for(transfer.job.job_id, [self._tier.remote_index(k) for k in keys])

    def commit(self, transfer: Transfer) -> None:
        """The receiver learns of the write from the notification; nothing to commit."""

    def close(self, transfer: Transfer) -> list[Leak]:
        return []


class PeerSender(SecondaryTier):
    """The sending engine's side: writes primary blocks into a receiver's KV cache.

    A job's ``keys`` name the receiver's block indices (``"3"`` is the receiver's block 3);
    ``block_ids`` are the sender's primary blocks, pinned by its parent. The notification names
    the job id, which the receiver :meth:`~PeerReceiver.expect`\\ s.

    Args:
        primary: the sender's KV cache.
        agent: a NIXL agent with the UCX backend.
        policy: retry bounds (:class:`~kvfsm.policy.RetryPolicy`).
    """

    def __init__(self, primary: torch.Tensor, *, agent: Any,
                 policy: RetryPolicy | None = None, poll_interval: float = 0.0002) -> None:
        self.peer: str | None = None
        self.receiver_blocks: list[tuple[int, int, int]] = []
        super().__init__(primary, agent=agent, remote=_PeerMemory(self),
                         poll_interval=poll_interval, policy=policy)

    def connect(self, receiver_metadata: bytes, receiver_blocks: Sequence[tuple[int, int, int]]
                ) -> str:
        """Load the receiver's metadata and the descriptors of its blocks; returns its name."""
        with self._lock:
            self.peer = _peer_name(self.agent.add_remote_agent(receiver_metadata))  # type: ignore[attr-defined]
            self.receiver_blocks = [tuple(d) for d in receiver_blocks]  # type: ignore[misc]
            return self.peer

    def forget_peer(self) -> None:
        """The receiver disappeared: remove its metadata; later writes fail at once."""
        with self._lock:
            if self.peer is not None:
                self.agent.remove_remote_agent(self.peer)  # type: ignore[attr-defined]
                self.peer = None

    def remote_index(self, key: bytes | str) -> int:
        """The receiver block a key names."""
        text = key.decode() if isinstance(key, bytes) else key
        if not isinstance(text, str) or not text.isdigit():
            raise ValueError(f"a peer key is the receiver's block index, got {key!r}")
        index = int(text)
        if self.receiver_blocks and index >= len(self.receiver_blocks):
            raise ValueError(f"receiver block {index} is out of range "
                             f"[0, {len(self.receiver_blocks)})")
        return index

    def remote_name(self, key: bytes | str) -> str:
        """A key's receiver block, as text."""
        return str(self.remote_index(key))

    def _probe(self, name: str) -> Lookup:
        return Lookup.MISS  # a peer is written to, never looked up

    def _submit(self, job: TransferJob, *, load: bool) -> None:
        if load:
            raise InvalidJobError(f"job {job.job_id}: a peer sender only writes; the receiver "
                                  "expects the job instead")
        super()._submit(job, load=load)

