"""The peer explorer: a sender and a receiver over fake UCX, every NIXL call failing at every
step, and the invariants of a peer write checked on every path.

:func:`explore` (:mod:`kvfsm.testing.explore`) does this for one tier and the transfer machine;
this module does it for the two ends of a peer write, :class:`~kvfsm.peer.PeerSender` and
:class:`~kvfsm.peer.PeerReceiver`, each on its own :class:`~kvfsm.testing.fake_ucx.FakeUcxAgent`
of one :class:`~kvfsm.testing.fake_ucx.FakeUcxFabric`, driven only through their public API.

The scenario (:data:`SCENARIO` says it step by step) runs two links in sequence between a sender
``engine-a`` and a receiver ``engine-b``: a job expected before its write, one written before
it is expected (its notification early), one written and never expected (unclaimed), a job id
expected again after its notification was used, a write when the first link ends; then a second
link whose sender restarts its job ids and writes before the receiver connected it, a job
whose id and blocks are those of a job the first link owed, and a job id written twice. A
*mode* chooses how the first link ends and when notifications travel:

* ``end=forget``: both ends forget each other once the sender is idle;
* ``end=sender-lost``: the sender's process dies with a write running; the receiver's probes
  find it gone (``NIXL_ERR_REMOTE_DISCONNECT``), and a new sender process of the same name
  makes the second link;
* ``end=receiver-lost``: the receiver's process dies under a write; the sender finds it gone,
  and a new receiver process of the same name makes the second link;
* ``late=1``: the notifications of the first link's last write are held in flight until the
  second link expects a job with the same id and blocks (an old link's notification arriving
  late); ``late=0``: every notification arrives when its write completes;
* ``polls=1``: a write completes on its first state check; ``polls=0``: when it is posted.

A *path* is a mode and a set of faults, each one of the fault grammar
(:mod:`kvfsm.testing.faults`) injected into one numbered call of one agent
(``receiver.get_new_notifs:raise@3``; ``sender.transfer:disconnect@1`` raises
``NIXL_ERR_REMOTE_DISCONNECT`` although the peer is there). As :func:`explore` does, the explorer
runs each mode with no fault, then with every fault at every call that run made (the agents'
construction excepted), then every pair, up to ``max_faults``.

Checked on every path (:class:`PeerInvariant`):

* a receiver job publishes success only once a notification of its own write (its link's
  nonce, its job id, its blocks) arrived on its own link, while the link was open, and not one
  an earlier job already used: the n-th success of a job needs n such notifications;
* a receiver job fails only once its link is closed (lost or forgotten), and never when such a
  notification arrived for it while the link was open;
* a link that closed fails, within two polls, every job it owed; every expected job publishes
  exactly one result (after shutdown at the latest); what the receiver keeps of its open links
  (``stats()["early"]``) is exactly the notifications that arrived and no job used;
* the sender publishes exactly one result per job, only after its transfer handle was released,
  success exactly when NIXL said its write finished (DONE); a write NIXL failed with a
  disconnect closes the sender's link once nothing runs to the receiver, and later jobs are
  refused;
* nothing leaks: after shutdown every agent still alive holds no transfer handle, descriptor
  list, registration or peer metadata, except what a fault on its release call (or a
  quarantine) explains; no agent saw a misuse; no exception escaped a poll or a shutdown.

Broken receivers (:data:`BROKEN_RECEIVERS`), each a variant of the declared machine or a
subclass overriding one method, are each caught by the invariant its name says it breaks.
"""

from __future__ import annotations

import contextlib
import enum
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvfsm.engine import Declaration
from kvfsm.machines.peer_receive import PEER_RECEIVE, ReceiveEvent, ReceiveState
from kvfsm.peer import PeerReceiver, PeerSender
from kvfsm.peer_link import LinkState, PeerLinkError, PeerNotConnected, loses_link
from kvfsm.policy import RetryPolicy
from kvfsm.testing.explore import Verdict
from kvfsm.testing.fake_ucx import DISCONNECT, FakeUcxAgent, FakeUcxFabric
from kvfsm.testing.faults import STATUS_CALLS, Fault, Raise, ReturnErr, StayProc, fault_kind
from kvfsm.tiers.base import InvalidJobError
from kvfsm.transfer import JobResult, TransferJob

__all__ = [
    "BROKEN_RECEIVERS",
    "MODES",
    "SCENARIO",
    "PeerChoice",
    "PeerExploration",
    "PeerInvariant",
    "PeerMode",
    "PeerPath",
    "PeerViolation",
    "ReceiverVariant",
    "explore_peer",
    "parse_peer_path",
    "replay_peer",
]


class PeerInvariant(enum.Enum):
    """What must hold on every path of the peer scenario; the value is how a violation reads."""

    OWN_NOTIFICATION = ("a receiver job published success without an unused notification of "
                        "its own write on its own link")
    FAILED_WHILE_OPEN = "a receiver job published failure while its link was still open"
    LOST_NOTIFICATION = ("a receiver job failed although its notification arrived on its open "
                         "link")
    LOST_LINK = "a link closed, and a job it owed was still expected two polls later"
    ONE_RESULT = "an expected job published more than one result, or one nobody expected"
    LIVENESS = "an expected job never published a result, even after shutdown"
    UNCLAIMED = ("what the receiver keeps for its open links is not the notifications that "
                 "arrived and no job used")
    SENDER_ONE_RESULT = "a sender job published more than one result, or one never submitted"
    SENDER_OUTCOME = "a sender job published a result other than what NIXL said of its write"
    SENDER_RELEASE = "a sender job published before its transfer handle was released"
    SENDER_LINK = ("a write failed with a disconnect, and the sender's link was not closed "
                   "or took a later job")
    LEAK = "an agent still held a handle, registration or peer metadata after shutdown"
    NO_MISUSE = "an agent saw a call that would crash real NIXL"
    NO_ESCAPE = "an exception escaped a poll or a shutdown"


@dataclass(frozen=True, slots=True)
class PeerMode:
    """How the first link ends, whether its last notifications arrive late, and when a write
    completes (see the module docstring)."""

    polls: int = 1
    end: str = "forget"
    late: bool = False

    def __str__(self) -> str:
        return f"polls={self.polls},end={self.end},late={int(self.late)}"


#: every mode the explorer runs
MODES: tuple[PeerMode, ...] = tuple(
    PeerMode(polls, end, late) for end in ("forget", "sender-lost", "receiver-lost")
    for late in (False, True) for polls in (1, 0))

#: the agents of the scenario: the first sender and receiver, and the new process that
#: replaces one of them when it is lost
ROLES = ("sender", "receiver", "sender2", "receiver2")


@dataclass(frozen=True, slots=True)
class PeerChoice:
    """One injected fault: the ``occurrence``-th call of ``call`` on the agent of ``role``."""

    role: str
    call: str
    occurrence: int
    fault: Fault

    def __str__(self) -> str:
        kind = fault_kind(self.fault, {DISCONNECT: "disconnect"})
        return f"{self.role}.{self.call}:{kind}@{self.occurrence}"


@dataclass(frozen=True, slots=True)
class PeerPath:
    """A run: a mode and its faults."""

    mode: PeerMode
    choices: tuple[PeerChoice, ...] = ()

    def __str__(self) -> str:
        return f"{self.mode};" + ",".join(str(c) for c in self.choices)


@dataclass(frozen=True, slots=True)
class PeerViolation:
    """An invariant that failed on a path."""

    invariant: PeerInvariant
    job_id: int | None
    detail: str

    def __str__(self) -> str:
        job = f" (job {self.job_id})" if self.job_id is not None else ""
        return f"{self.invariant.name}{job}: {self.invariant.value}: {self.detail}"


@dataclass(frozen=True)
class ReceiverVariant:
    """A broken receiver: a subclass of :class:`~kvfsm.peer.PeerReceiver`, or the receiver with
    a variant of the ``peer_receive`` machine, and the invariant that must catch it."""

    name: str
    invariant: PeerInvariant
    why: str
    receiver: type[PeerReceiver] = PeerReceiver
    machine: Declaration[Any, Any] | None = None


#: the scenario, step by step, as :func:`explore_peer` runs it
SCENARIO = """\
link 1 (receiver connects first):
  receiver expects job 1 into blocks 0,1; sender writes jobs 1 (blocks 0,1), 2 (block 2),
  3 (block 3, never expected); both poll until the sender is idle
  receiver expects job 2 (its notification came first), job 1 again (its notification was
  used) and job 4 (block 4); two polls
  [late=1: notifications are held in flight from here]
  sender writes job 4; then end=forget: the sender drains, both forget each other |
  end=sender-lost: the sender dies with job 4 running, the receiver polls until its probes
  find it gone | end=receiver-lost: the receiver dies, the sender polls until idle
link 2 (a new nonce; the sender connects first and restarts its job ids):
  sender writes job 1 (blocks 0,1) before the receiver connected it; both poll
  receiver connects, expects job 1 and job 4 (block 4, as link 1's job 4)
  [late=1: link 1's held notifications arrive now]; two polls
  sender writes job 4, then job 5 (block 5, never expected); both poll until idle
  sender writes job 1 again, receiver expects job 1 again; both poll until idle
  sender shuts down, receiver shuts down, its last results are taken
"""

_NAMES = {"sender": "engine-a", "sender2": "engine-a",
          "receiver": "engine-b", "receiver2": "engine-b"}
_JOB_NOTIFICATION = re.compile(rb"kvfsm-job:([0-9a-f]{32}):(\d+):([0-9,]*)$")
#: a finite retry bound, so that paths reach QUARANTINED too
_POLICY = RetryPolicy(max_attempts=2, max_seconds=None)
#: the receiver probes a silent sender that owes jobs at every poll
_PEER_TIMEOUT = 1e-9
_BLOCKS, _BLOCK_BYTES = 8, 16
_DRAIN_ROUNDS = 8


@dataclass
class _Sent:
    """What the explorer saw NIXL do for one sender job."""

    job_id: int
    xfer: Any = None
    status: str | None = None  # the last status NIXL answered: PROC, DONE, FAILED
    outcome: bool | None = None  # the first end NIXL answered
    released: bool = False
    held: bool = False  # quarantined: its handles are held for good
    cancelled_running: bool = False


@dataclass
class _Expect:
    """One expect the receiver accepted."""

    job_id: int
    key: tuple[str, str, int, tuple[int, ...]]  # (receiver role, nonce, job id, blocks)
    rank: int  # the n-th expect of its key


class _Agent(FakeUcxAgent):
    """A fake UCX agent that tells the run what NIXL answered, which job each handle is for,
    and each faultable call made."""

    def __init__(self, run: _Run, role: str) -> None:
        self.run = run
        self.role = role
        self.constructing = True
        self.current: _Sent | None = None  # the sender job being submitted
        self.jobs: dict[int, _Sent] = {}  # id(transfer handle) -> its job
        self.saw_disconnect = False
        super().__init__(_NAMES[role], run.fabric, complete_after_polls=run.path.mode.polls)
        for choice in run.path.choices:
            if choice.role == role:
                self.inject(choice.call, choice.fault, at=choice.occurrence)

    def _enter(self, call: str) -> Fault | None:
        fault = super()._enter(call)
        if not self.constructing:
            self.run.log.append((self.role, call, self.faults.count(call)))
        return fault

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        got = super().get_new_notifs()
        if self.role.startswith("receiver"):
            self.run.took(self.role, got)
        return got

    def _failed(self, sent: _Sent | None, error: BaseException | None = None) -> None:
        if error is not None and loses_link(error):
            self.saw_disconnect = True
        if sent is not None:
            sent.status = "FAILED"
            if sent.outcome is None:
                sent.outcome = False

    def prep_xfer_dlist(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().prep_xfer_dlist(*args, **kwargs)
        except Exception:
            self._failed(self.current)
            raise

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        sent = self.current
        try:
            handle = super().make_prepped_xfer(*args, **kwargs)
        except Exception:
            self._failed(sent)
            raise
        if sent is not None:
            sent.xfer = handle
            self.jobs[id(handle)] = sent
        return handle

    def transfer(self, handle: Any, notif_msg: bytes | str = b"") -> str:
        return self._status(handle, lambda: FakeUcxAgent.transfer(self, handle, notif_msg))

    def check_xfer_state(self, handle: Any) -> str:
        return self._status(handle, lambda: FakeUcxAgent.check_xfer_state(self, handle))

    def _status(self, handle: Any, call: Callable[[], str]) -> str:
        sent = self.jobs.get(id(handle))
        try:
            status = call()
        except Exception as error:
            self._failed(sent, error)
            raise
        if sent is not None:
            if status == "DONE":
                sent.status = "DONE"
                if sent.outcome is None:
                    sent.outcome = True
            elif status == "PROC":
                sent.status = "PROC"
            else:
                self._failed(sent)
        return status

    def release_xfer_handle(self, handle: Any) -> None:
        super().release_xfer_handle(handle)
        sent = self.jobs.get(id(handle))
        if sent is not None:
            sent.released = True


class _Run:
    """One run of the scenario on one path."""

    def __init__(self, path: PeerPath, variant: ReceiverVariant | None) -> None:
        self.path = path
        self.variant = variant
        self.fabric = FakeUcxFabric()
        self.violations: list[PeerViolation] = []
        #: (role, call, occurrence) of every faultable call made, in order
        self.log: list[tuple[str, str, int]] = []
        #: where the log stood when the receiver's poll under way began
        self.poll_began = 0
        self.agents: dict[str, _Agent] = {}
        self.sender: PeerSender | None = None
        self.sender_agent: _Agent | None = None
        self.receiver: PeerReceiver | None = None
        self.receiver_agent: _Agent | None = None
        self.sent: dict[int, _Sent] = {}  # the current sender's unpublished jobs, by id
        self.expects: dict[int, _Expect] = {}  # the current receiver's unpublished expects
        self.ranks: Counter[tuple[str, str, int, tuple[int, ...]]] = Counter()
        #: notifications of each key the receiver took while its link was open (or not made)
        self.taken: Counter[tuple[str, str, int, tuple[int, ...]]] = Counter()
        self.successes: Counter[tuple[str, str, int, tuple[int, ...]]] = Counter()
        #: the state of each nonce the current receiver was given: open or closed
        self.nonces: dict[str, str] = {}
        self.link_nonce: str | None = None  # the nonce of the receiver's link to engine-a
        self.quarantined = 0

    # -- the engines --------------------------------------------------------------------

    def new_sender(self, role: str) -> None:
        agent = self.agents[role] = _Agent(self, role)
        cache = torch.arange(_BLOCKS * _BLOCK_BYTES, dtype=torch.int64).to(torch.uint8)
        self.sender = PeerSender(cache.view(_BLOCKS, _BLOCK_BYTES), agent=agent, policy=_POLICY)
        self.sender.on_published.append(self._quarantine)
        agent.constructing = False
        self.sender_agent = agent
        self.sent = {}

    def new_receiver(self, role: str) -> None:
        agent = self.agents[role] = _Agent(self, role)
        variant = self.variant
        cls = PeerReceiver if variant is None else variant.receiver
        receiver = cls(torch.zeros(_BLOCKS, _BLOCK_BYTES, dtype=torch.uint8), agent=agent,
                       peer_timeout=_PEER_TIMEOUT)
        if variant is not None and variant.machine is not None:
            receiver.machine = variant.machine.compile(trace=True)
        agent.constructing = False
        self.receiver, self.receiver_agent = receiver, agent
        self.expects, self.nonces, self.link_nonce = {}, {}, None

    def kill(self, role: str) -> None:
        self.fabric.kill(_NAMES[role])
        if role.startswith("sender"):
            self.sender, self.sent = None, {}
        else:
            self.receiver, self.expects = None, {}

    def _quarantine(self, transfer: Any) -> None:
        sent = self.sent.get(transfer.job_id)
        if sent is not None and getattr(transfer.state, "name", "") == "QUARANTINED":
            sent.held = True
            self.quarantined += 1

    # -- the public API, watched --------------------------------------------------------

    def connect_receiver(self) -> None:
        """The receiver links the sender (with the sender's metadata of its next link)."""
        receiver, sender = self.receiver, self.sender
        if receiver is None or sender is None:
            return
        try:
            metadata = sender.metadata()
        except Exception:
            return  # NIXL refused the sender its own metadata: no link
        nonce = metadata.split(b":", 2)[1].decode()
        try:
            receiver.connect(metadata)
        except (PeerLinkError, ValueError):
            self.nonces[nonce] = "closed"  # refused, or spent: it never counts
            return
        self.nonces[nonce] = "open"
        self.link_nonce = nonce

    def connect_sender(self) -> None:
        """The sender links the receiver."""
        receiver, sender = self.receiver, self.sender
        if receiver is None or sender is None:
            return
        try:
            sender.connect(receiver.metadata(), receiver.block_descs())
        except Exception:  # PeerLinkError, or NIXL refused the receiver its metadata
            return

    def write(self, job_id: int, blocks: Sequence[int], source: int) -> None:
        sender, agent = self.sender, self.sender_agent
        if sender is None or agent is None:
            return
        sent = _Sent(job_id)
        agent.current = sent
        try:
            sender.submit_store(TransferJob(job_id, [str(b) for b in blocks],
                                            list(range(source, source + len(blocks)))))
        except InvalidJobError:  # refused (not connected, or the id still in flight)
            return
        except Exception as error:
            self._violation(PeerInvariant.NO_ESCAPE, job_id, f"submit_store raised {error!r}")
            return
        finally:
            agent.current = None
        self.sent[job_id] = sent

    def expect(self, job_id: int, blocks: Sequence[int]) -> None:
        receiver, nonce = self.receiver, self.link_nonce
        if receiver is None or nonce is None:
            return
        try:
            receiver.expect(TransferJob(job_id, [str(b) for b in blocks], list(blocks),
                                        is_promotion=True), "engine-a")
        except InvalidJobError:  # refused: not connected, or the id still expected
            return
        role = self.receiver_role()
        key = (role, nonce, job_id, tuple(blocks))
        self.ranks[key] += 1
        self.expects[job_id] = _Expect(job_id, key, self.ranks[key])

    def receiver_role(self) -> str:
        return "receiver2" if "receiver2" in self.agents else "receiver"

    def took(self, role: str, got: dict[str, list[bytes]]) -> None:
        """What the receiver's get_new_notifs returned: count what arrived on an open link (the
        first take of a poll judged by the link as the poll began, a later one by the link as
        it is: a poll may close it between its takes)."""
        if role != self.receiver_role():
            return
        # the first take of a poll is judged by the link as the poll began (a receiver takes
        # what NIXL delivered before it watches its links); a later one, as it is now
        takes = sum(1 for r, call, _ in self.log[self.poll_began:]
                    if r == role and call == "get_new_notifs")
        if takes > 1:
            self.note_closed()
        for sender, messages in got.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            if name != "engine-a":
                continue
            for message in messages:
                found = _JOB_NOTIFICATION.match(bytes(message))
                if found is None:
                    continue
                nonce = found.group(1).decode()
                if self.nonces.get(nonce, "unknown") == "closed":
                    continue
                blocks = tuple(int(b) for b in found.group(3).split(b",") if b)
                self.taken[(role, nonce, int(found.group(2)), blocks)] += 1

    def poll(self) -> None:
        """One step of each engine still alive: the sender, then the receiver."""
        self.poll_sender()
        self.poll_receiver()

    def poll_sender(self) -> None:
        sender = self.sender
        if sender is None:
            return
        try:
            results = sender.get_finished_jobs()
        except Exception as error:
            self._violation(PeerInvariant.NO_ESCAPE, None,
                            f"PeerSender.get_finished_jobs raised {error!r}")
            return
        self.sender_results(results)

    def poll_receiver(self) -> None:
        receiver = self.receiver
        if receiver is None:
            return
        self.poll_began = len(self.log)
        try:
            results = receiver.get_finished_jobs()
        except Exception as error:
            self._violation(PeerInvariant.NO_ESCAPE, None,
                            f"PeerReceiver.get_finished_jobs raised {error!r}")
            return
        self.note_closed()
        self.receiver_results(results)
        self.check_unclaimed()

    def note_closed(self) -> None:
        """Mark the receiver's link to engine-a closed once it is."""
        receiver, nonce = self.receiver, self.link_nonce
        if receiver is not None and nonce is not None and receiver.link_state(
                "engine-a") in (LinkState.CLOSED, LinkState.LOST, LinkState.REFUSED):
            self.nonces[nonce] = "closed"

    def sender_idle(self) -> bool:
        return self.sender is None or not self.sender.has_pending_work()

    def drain(self) -> None:
        for _ in range(_DRAIN_ROUNDS):
            if self.sender_idle():
                break
            self.poll()
        self.poll_receiver()

    def forget(self) -> None:
        """Both ends forget each other (the sender first, once idle)."""
        sender, receiver = self.sender, self.receiver
        if sender is not None and not sender.closed:
            with contextlib.suppress(RuntimeError):  # transfers unpublished: it refuses
                sender.forget_peer()
        if receiver is not None and self.link_nonce is not None:
            self.nonces[self.link_nonce] = "closed"  # closed before anything it owed fails
            receiver.forget_peer("engine-a")
        self.settle_link()

    def settle_link(self) -> None:
        """Two polls after the receiver's link closed: every job it owed has its result."""
        self.poll_receiver()
        self.poll_receiver()
        for expect in self.expects.values():
            if self.nonces.get(expect.key[1]) == "closed":
                self._violation(PeerInvariant.LOST_LINK, expect.job_id,
                                "its link is closed, and it is still expected")

    # -- checks ---------------------------------------------------------------------------

    def _violation(self, invariant: PeerInvariant, job_id: int | None, detail: str) -> None:
        self.violations.append(PeerViolation(invariant, job_id, detail))

    def sender_results(self, results: list[JobResult]) -> None:
        for result in results:
            sent = self.sent.pop(result.job_id, None)
            if sent is None:
                self._violation(PeerInvariant.SENDER_ONE_RESULT, result.job_id,
                                "a result for no job in flight")
                continue
            expected = bool(sent.outcome) and not sent.held and not sent.cancelled_running
            if result.success != expected:
                self._violation(PeerInvariant.SENDER_OUTCOME, result.job_id,
                                f"NIXL's first end of its write: {sent.outcome}, quarantined: "
                                f"{sent.held}; published success={result.success}")
            if sent.xfer is not None and not sent.released and not sent.held:
                self._violation(PeerInvariant.SENDER_RELEASE, result.job_id,
                                "its transfer handle was still held")

    def receiver_results(self, results: list[JobResult]) -> None:
        for result in results:
            expect = self.expects.pop(result.job_id, None)
            if expect is None:
                self._violation(PeerInvariant.ONE_RESULT, result.job_id,
                                f"a result (success={result.success}) for no job expected")
                continue
            key = expect.key
            if result.success:
                self.successes[key] += 1
                if self.successes[key] > self.taken[key]:
                    self._violation(
                        PeerInvariant.OWN_NOTIFICATION, result.job_id,
                        f"success #{self.successes[key]} of job {key[2]} into blocks "
                        f"{list(key[3])} on its link, after {self.taken[key]} notification(s) "
                        "of it arrived there")
            elif self.nonces.get(key[1]) != "closed":
                self._violation(PeerInvariant.FAILED_WHILE_OPEN, result.job_id,
                                f"failed ({result.reason}) with its link open")
            elif self.taken[key] >= expect.rank:
                self._violation(PeerInvariant.LOST_NOTIFICATION, result.job_id,
                                f"expect #{expect.rank} of it failed after {self.taken[key]} "
                                "notification(s) of it arrived on its open link")

    def check_unclaimed(self) -> None:
        receiver = self.receiver
        if receiver is None:
            return
        role = self.receiver_role()
        arrived = Counter(expect.key for expect in self.expects.values()  # used, and not
                          if receiver.state_of(expect.job_id) is ReceiveState.ARRIVED)  # yet out
        kept = sum(count - self.successes[key] - arrived[key]
                   for key, count in self.taken.items()
                   if key[0] == role and self.nonces.get(key[1]) == "open")
        early = receiver.stats()["early"]
        if early != kept:
            self._violation(PeerInvariant.UNCLAIMED, None,
                            f"stats()['early'] is {early}; {kept} arrived on open links and "
                            "no job used them")

    def check_sender_link(self) -> None:
        """After a write failed with a disconnect and the sender went idle: its link closed,
        and a later job is refused."""
        sender, agent = self.sender, self.sender_agent
        if sender is None or agent is None or not agent.saw_disconnect or not self.sender_idle():
            return
        state = sender.link_state()
        if state is not LinkState.CLOSED:
            self._violation(PeerInvariant.SENDER_LINK, None, f"the link is {state.name}")
        try:
            sender.submit_store(TransferJob(99, ["7"], [7]))
        except PeerNotConnected:
            return
        except Exception as error:
            self._violation(PeerInvariant.NO_ESCAPE, 99, f"submit_store raised {error!r}")
            return
        self.sent[99] = _Sent(99)
        self._violation(PeerInvariant.SENDER_LINK, 99, "a job was accepted")

    def shutdown(self) -> None:
        sender, receiver = self.sender, self.receiver
        if sender is not None:
            for sent in self.sent.values():
                sent.cancelled_running = sent.status in {None, "PROC"} and sent.outcome is None
            try:
                sender.shutdown(timeout=1.0)
                self.sender_results(sender.get_finished_jobs())
            except Exception as error:
                self._violation(PeerInvariant.NO_ESCAPE, None,
                                f"PeerSender.shutdown raised {error!r}")
        if receiver is not None:
            for nonce in self.nonces:
                self.nonces[nonce] = "closed"  # shutdown closes every link first
            try:
                receiver.shutdown()
                self.receiver_results(receiver.get_finished_jobs())
            except Exception as error:
                self._violation(PeerInvariant.NO_ESCAPE, None,
                                f"PeerReceiver.shutdown raised {error!r}")
            for expect in self.expects.values():
                self._violation(PeerInvariant.LIVENESS, expect.job_id,
                                "still expected after shutdown")
        for sent in self.sent.values():
            self._violation(PeerInvariant.SENDER_ONE_RESULT, sent.job_id,
                            "never published a result")

    def check_leaks(self) -> None:
        for role, agent in self.agents.items():
            for misuse in agent.misuses:
                self._violation(PeerInvariant.NO_MISUSE, None, f"{role}: {misuse}")
            if agent.dead:
                continue  # its process ended: it holds nothing any more
            taken = agent.faults_taken
            held = self.quarantined if role.startswith("sender") else 0
            allowed = {
                "transfer handle(s)": held,
                "descriptor list(s)": taken.get("release_dlist_handle", 0) + 2 * held,
                "registration(s)": taken.get("deregister_memory", 0) + min(held, 1),
                "peer metadata": taken.get("remove_remote_agent", 0),
            }
            live = {
                "transfer handle(s)": agent.live_xfer_handles(),
                "descriptor list(s)": agent.live_dlist_handles(),
                "registration(s)": agent.live_registrations(),
                "peer metadata": len(agent.remote_agents()),
            }
            for what, count in live.items():
                if count > allowed[what]:
                    self._violation(PeerInvariant.LEAK, None,
                                    f"{role} holds {count} {what} after shutdown "
                                    f"({allowed[what]} explained by faults)")


def _scenario(run: _Run) -> None:
    """The scenario of :data:`SCENARIO` on one path."""
    run.new_sender("sender")
    run.new_receiver("receiver")
    _first_link(run)
    _end_first_link(run)
    _second_link(run)
    run.shutdown()
    run.check_leaks()


def _first_link(run: _Run) -> None:
    """Link 1, the receiver connecting first, up to its last write."""
    run.connect_receiver()
    run.connect_sender()
    run.expect(1, (0, 1))
    run.write(1, (0, 1), 0)
    run.write(2, (2,), 2)
    run.write(3, (3,), 3)
    run.drain()
    run.expect(2, (2,))
    run.expect(1, (0, 1))  # again: its notification was used
    run.expect(4, (4,))
    run.poll()
    run.poll()
    if run.path.mode.late:
        run.fabric.hold()
    run.write(4, (4,), 4)


def _end_first_link(run: _Run) -> None:
    """Link 1 ends as the mode says; a lost engine is replaced by a new process."""
    end = run.path.mode.end
    if end == "forget":
        run.drain()
        run.forget()
    elif end == "sender-lost":
        run.kill("sender")
        for _ in range(_DRAIN_ROUNDS):
            run.poll_receiver()
            if run.receiver is None or run.nonces.get(str(run.link_nonce)) == "closed":
                break
        else:
            if run.expects:  # it owes jobs, so it is probed at every poll
                run.violations.append(PeerViolation(
                    PeerInvariant.LOST_LINK, None, f"the sender died, and {_DRAIN_ROUNDS} "
                    "polls (each probing it) later its link is still open"))
        run.settle_link()
        run.new_sender("sender2")
    else:
        run.kill("receiver")
        run.drain()
        run.check_sender_link()
        if run.sender is not None and run.sender.link_state() not in (
                LinkState.CLOSED, LinkState.REFUSED):
            run.forget()
        run.new_receiver("receiver2")


def _second_link(run: _Run) -> None:
    """Link 2: the sender connects first, restarts its ids and writes before it is connected."""
    run.connect_sender()
    run.write(1, (0, 1), 5)
    run.drain()
    run.connect_receiver()
    run.expect(1, (0, 1))
    run.expect(4, (4,))
    if run.path.mode.late:
        run.fabric.release()
    run.poll()
    run.poll()
    run.write(4, (4,), 1)
    run.write(5, (5,), 2)
    run.drain()
    run.write(1, (0, 1), 3)  # the same id again, on the same link
    run.drain()
    run.expect(1, (0, 1))
    run.drain()


def _run(path: PeerPath, variant: ReceiverVariant | None) -> _Run:
    run = _Run(path, variant)
    try:
        _scenario(run)
    except Exception as error:  # an escape from a call the scenario makes without a guard
        run.violations.append(PeerViolation(PeerInvariant.NO_ESCAPE, None,
                                            f"the scenario raised {error!r}"))
    return run


def _alternatives(call: str, max_stall: int) -> list[Fault]:
    faults: list[Fault] = [Raise()]
    if call in {"transfer", "check_xfer_state", "send_notif"}:
        faults.append(Raise(DISCONNECT))
    if call in STATUS_CALLS:
        faults += [ReturnErr(), *(StayProc(k) for k in range(1, max_stall + 1))]
    return faults


def _skipped(role: str, call: str, skip: frozenset[str]) -> bool:
    """Whether ``skip`` names the call, alone or as ``role.call`` (``receiver.call`` also
    names the call on ``receiver2``, and ``sender.call`` on ``sender2``)."""
    return call in skip or f"{role.rstrip('2')}.{call}" in skip


def _children(path: PeerPath, last: int, log: list[tuple[str, str, int]], max_stall: int,
              max_calls: int, skip: frozenset[str]) -> Iterator[tuple[PeerPath, int]]:
    for position, (role, call, occurrence) in enumerate(log[:max_calls]):
        if position <= last or _skipped(role, call, skip):
            continue
        for fault in _alternatives(call, max_stall):
            choice = PeerChoice(role, call, occurrence, fault)
            yield PeerPath(path.mode, (*path.choices, choice)), position


@dataclass
class PeerExploration:
    """What :func:`explore_peer` found."""

    paths: int = 0
    calls: int = 0
    seconds: float = 0.0
    #: the first violating path (a shortest one: paths run in order of their fault count)
    counterexample: PeerPath | None = None
    violations: list[PeerViolation] = field(default_factory=list)
    #: every violating path with what it violated, when the exploration went on past the first
    violating: list[tuple[PeerPath, list[PeerViolation]]] = field(default_factory=list)
    #: the receiver variant explored (None: kvfsm's own)
    variant: str | None = None

    @property
    def ok(self) -> bool:
        """True when no path violated an invariant."""
        return self.counterexample is None

    def caught(self) -> set[PeerInvariant]:
        """Every invariant a path violated."""
        found = {v.invariant for v in self.violations}
        for _, violations in self.violating:
            found |= {v.invariant for v in violations}
        return found

    def report(self) -> str:
        """A few lines for people."""
        lines = [f"explored {self.paths} paths ({self.calls} NIXL calls) in {self.seconds:.2f} s"
                 + (f", receiver variant {self.variant}" if self.variant else "") + ": "
                 + ("0 violations" if self.ok else
                    f"VIOLATION on {max(len(self.violating), 1)} path(s)")]
        if self.counterexample is not None:
            lines.append(f"shortest violating path: {self.counterexample}")
            lines += [f"  {v}" for v in self.violations]
            lines.append(f"replay it with: kvfsm explore --peer --replay '{self.counterexample}'"
                         + (f" --receiver {self.variant}" if self.variant else ""))
        return "\n".join(lines)


def explore_peer(
    variant: ReceiverVariant | str | None = None,
    *,
    modes: Sequence[PeerMode] = MODES,
    max_faults: int = 1,
    max_stall: int = 1,
    max_calls: int = 200,
    skip: Sequence[str] = (),
    stop_at_first: bool = True,
) -> PeerExploration:
    """Run the peer scenario on every path with at most ``max_faults`` faults, in every mode;
    check every invariant on each.

    Args:
        variant: a broken receiver to explore instead of kvfsm's (a :class:`ReceiverVariant`,
            or the name of one of :data:`BROKEN_RECEIVERS`).
        modes: the modes to run (:data:`MODES`: every one).
        max_faults: the most faults on one path (a "PROC for k polls" counts as one).
        max_stall: the most extra "PROC" answers one stall fault adds.
        max_calls: calls past this position in a run get no faults (bounds the depth).
        skip: NIXL calls that get no faults: ``"get_new_notifs"`` on every agent, or
            ``"receiver.get_new_notifs"`` on the receivers' only (``"sender.CALL"``: the
            senders'); every other call of :data:`~kvfsm.testing.fake_ucx.UCX_CALLS` the run
            makes gets each fault it can take.
        stop_at_first: stop at the first violating path (a shortest one).
    """
    if isinstance(variant, str):
        variant = BROKEN_RECEIVERS[variant]
    if max_faults < 0 or max_stall < 1:
        raise ValueError("max_faults must be at least 0 and max_stall at least 1")
    skipped = frozenset(skip)
    found = PeerExploration(variant=None if variant is None else variant.name)
    with Verdict() as verdict:  # (transition coverage counts it only if it found nothing)
        _explore_peer(found, variant, modes, max_faults, max_stall, max_calls, skipped,
                      stop_at_first)
        verdict.counted = found.counterexample is None
    return found


def _explore_peer(found: PeerExploration, variant: ReceiverVariant | None,
                  modes: Sequence[PeerMode], max_faults: int, max_stall: int, max_calls: int,
                  skipped: frozenset[str], stop_at_first: bool) -> None:
    """(:func:`explore_peer`, its paths run.)"""
    started = time.perf_counter()
    for mode in modes:
        level: list[tuple[PeerPath, int]] = [(PeerPath(mode), -1)]
        for depth in range(max_faults + 1):
            children: list[tuple[PeerPath, int]] = []
            for path, last in level:
                run = _run(path, variant)
                found.paths += 1
                found.calls += len(run.log)
                if run.violations:
                    found.violating.append((path, run.violations))
                    if found.counterexample is None:
                        found.counterexample, found.violations = path, run.violations
                    if stop_at_first:
                        found.seconds = time.perf_counter() - started
                        return
                if depth < max_faults:
                    children += _children(path, last, run.log, max_stall, max_calls, skipped)
            level = children
    found.seconds = time.perf_counter() - started


def replay_peer(path: PeerPath, variant: ReceiverVariant | str | None = None
                ) -> tuple[list[str], list[PeerViolation]]:
    """Run one path again: the calls made (``role.call#n``) and the violations."""
    if isinstance(variant, str):
        variant = BROKEN_RECEIVERS[variant]
    with Verdict() as verdict:
        run = _run(path, variant)
        verdict.counted = not run.violations
    return [f"{role}.{call}#{n}" for role, call, n in run.log], run.violations


_CHOICE = re.compile(r"(?P<role>\w+)\.(?P<call>\w+):(?P<kind>raise|disconnect|err|proc=\d+)"
                     r"@(?P<at>\d+)$")


def parse_peer_path(text: str) -> PeerPath:
    """Read a path back from its printed form
    (``polls=1,end=forget,late=0;receiver.get_new_notifs:raise@2``).

    Raises:
        ValueError: not a path, naming the part that is wrong.
    """
    head, _, tail = text.partition(";")
    fields = dict(part.partition("=")[::2] for part in head.split(",") if part)
    try:
        mode = PeerMode(int(fields.pop("polls")), fields.pop("end"),
                        bool(int(fields.pop("late"))))
    except (KeyError, ValueError):
        raise ValueError(f"a peer path starts with polls=N,end=E,late=L; got {head!r}") from None
    if fields or mode not in MODES:
        raise ValueError(f"no such mode: {head!r}; one of {', '.join(map(str, MODES))}")
    choices = []
    for item in filter(None, (part.strip() for part in tail.split(","))):
        match = _CHOICE.match(item)
        if match is None or match["role"] not in ROLES:
            raise ValueError(f"bad fault {item!r}: expected ROLE.CALL:raise|disconnect|err|"
                             f"proc=N@AT, ROLE one of {', '.join(ROLES)}")
        kind = match["kind"]
        fault: Fault = (Raise() if kind == "raise" else Raise(DISCONNECT)
                        if kind == "disconnect" else ReturnErr() if kind == "err"
                        else StayProc(int(kind[5:])))
        choices.append(PeerChoice(match["role"], match["call"], int(match["at"]), fault))
    return PeerPath(mode, tuple(choices))


# -- broken receivers ---------------------------------------------------------------------

def _receive_variant(name: str, replace: dict[tuple[ReceiveState, str, str], dict[str, Any]],
                     unreachable: tuple[ReceiveState, ...] = ()) -> Declaration[Any, Any]:
    """The ``peer_receive`` machine with the edges keyed (source, trigger, guard) replaced."""
    transitions = []
    for transition in PEER_RECEIVE.transitions:
        key = (transition["source"], str(transition["trigger"]), transition.get("conditions", ""))
        transitions.append({**transition, **replace.pop(key)} if key in replace else transition)
    if replace:
        raise ValueError(f"no such edges: {list(replace)}")
    return Declaration(name, states=ReceiveState, initial=PEER_RECEIVE.initial,
                       answers=PEER_RECEIVE.answers, guards=PEER_RECEIVE.guards,
                       actions=PEER_RECEIVE.actions, transitions=transitions,
                       final=PEER_RECEIVE.final, failure_states=PEER_RECEIVE.failure_states,
                       calls=PEER_RECEIVE.calls, unreachable=unreachable)


class _KeepsUsedNotification(PeerReceiver):
    """Keeps a notification it already used to complete a job, as if it had come first (and
    after any hand-back of its blocks)."""

    def _arrived(self, inbox: Any, message: bytes, came: int) -> None:
        used = message in inbox.waiting
        super()._arrived(inbox, message, came)
        if used:
            inbox.early.setdefault(message, []).append(sys.maxsize)


class _DropsEarlyNotification(PeerReceiver):
    """Throws away a notification that comes before its expect."""

    def _arrived(self, inbox: Any, message: bytes, came: int) -> None:
        if message in inbox.waiting:
            super()._arrived(inbox, message, came)


class _CompletesOnOtherLink(PeerReceiver):
    """Matches a notification by its sender's name, not its link: an old link's counts for
    the sender's open link."""

    def _take(self, sender: str, message: bytes, link: Any, came: int) -> None:
        link = self.links.get(sender)
        found = _JOB_NOTIFICATION.match(message)
        if found is not None and link is not None and link.state is LinkState.CONNECTED:
            message = message.replace(found.group(1), link.nonce.encode(), 1)
        super()._take(sender, message, link, came)


class _WatchesBeforeTaking(PeerReceiver):
    """Watches its senders before it takes what NIXL delivered: a sender that wrote, told it
    and died has its link closed first, and the notification is thrown away with it."""

    def _poll(self, everything: bool = False, closing: bool = False) -> None:
        self._watch_links(time.monotonic())
        super()._poll(everything, closing)


class _CompletesTwice(PeerReceiver):
    """Hands out each success twice."""

    def get_finished_jobs(self) -> list[JobResult]:
        results = super().get_finished_jobs()
        return results + [result for result in results if result.success]


R = ReceiveState

#: broken receivers, by name, each with the invariant that catches it
BROKEN_RECEIVERS: dict[str, ReceiverVariant] = {variant.name: variant for variant in (
    ReceiverVariant(
        "keeps-used-notification", PeerInvariant.OWN_NOTIFICATION,
        "a notification that completed a job is kept as if it had come first, so the same "
        "job id expected again completes without a new write", receiver=_KeepsUsedNotification),
    ReceiverVariant(
        "drops-early-notification", PeerInvariant.LOST_NOTIFICATION,
        "a notification that comes before its expect is thrown away, so its job waits for a "
        "write that already landed", receiver=_DropsEarlyNotification),
    ReceiverVariant(
        "completes-on-other-link", PeerInvariant.OWN_NOTIFICATION,
        "a notification counts for the sender's open link whatever link it was sent over, so "
        "an old link's late write completes a job of the new one",
        receiver=_CompletesOnOtherLink),
    ReceiverVariant(
        "watches-before-taking", PeerInvariant.LOST_NOTIFICATION,
        "the senders are watched before what NIXL delivered is taken: a sender that wrote and "
        "died has its link closed first, and its job fails though its bytes landed",
        receiver=_WatchesBeforeTaking),
    ReceiverVariant(
        "completes-twice", PeerInvariant.ONE_RESULT,
        "each success is handed out twice", receiver=_CompletesTwice),
    ReceiverVariant(
        "lost-link-owes-nothing", PeerInvariant.LOST_LINK,
        "watch answering GONE leaves the job expecting: a lost or forgotten sender's jobs "
        "never fail", machine=_receive_variant(
            "lost-link-owes-nothing",
            {(R.EXPECTING, ReceiveEvent.WATCH, "gone"): {"dest": R.EXPECTING, "after": []}},
            unreachable=(R.PEER_LOST,))),
    ReceiverVariant(
        "fails-while-connected", PeerInvariant.FAILED_WHILE_OPEN,
        "watch answering PRESENT fails the job: a sender still connected has its jobs failed "
        "(and their blocks reused) while it may still write them", machine=_receive_variant(
            "fails-while-connected",
            {(R.EXPECTING, ReceiveEvent.WATCH, "present"): {"dest": R.PEER_LOST,
                                                           "after": "latch_failure"}})),
    ReceiverVariant(
        "completes-without-notification", PeerInvariant.OWN_NOTIFICATION,
        "watch answering PRESENT completes the job: success before any write landed",
        machine=_receive_variant(
            "completes-without-notification",
            {(R.EXPECTING, ReceiveEvent.WATCH, "present"): {"dest": R.ARRIVED,
                                                           "after": "latch_success"}})),
)}

def run_peer(args: Any) -> int:
    """``kvfsm explore --peer``: 0 when no path violates an invariant, 1 when one does."""
    variant = args.receiver
    if variant is not None and variant not in BROKEN_RECEIVERS:
        raise ValueError(f"--receiver: no broken receiver {variant!r}; one of "
                         + ", ".join(BROKEN_RECEIVERS))
    if args.replay:
        path = parse_peer_path(args.replay)
        calls, violations = replay_peer(path, variant)
        print(f"path {path}: {len(calls)} NIXL calls")
        print("  calls: " + " ".join(calls))
        for violation in violations:
            print(f"  {violation}")
        print("0 violations" if not violations else f"{len(violations)} violation(s)")
        return 1 if violations else 0
    max_faults = 1 if args.max_faults is None else args.max_faults
    found = explore_peer(variant, max_faults=max_faults, max_stall=args.max_stall,
                         stop_at_first=not args.all)
    print(f"kvfsm explore --peer: a sender and a receiver over fake UCX, {len(MODES)} modes, "
          f"up to {max_faults} fault(s) a path")
    print(found.report())
    return 0 if found.ok else 1
