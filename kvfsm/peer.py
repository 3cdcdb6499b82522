"""Peer-to-peer KV transfers between two engines over NIXL's UCX backend, with notifications.

The sender writes primary blocks straight into the receiver's KV cache. On the sender's side
that is a transfer like any other, so :class:`PeerSender` is a tier running the transfer
machine (:data:`kvfsm.machines.transfer.TRANSFER_MACHINE`): it answers PROC, DONE or an error,
its handle is released only once it is over, and only then is the result published (the peer
transport's faults F2 and F4 are the lifecycle's to prevent). What is peer-specific on that side
is the remote memory: the receiver's, known from its metadata (``add_remote_agent``), prepped
under the receiver's name, and a notification message naming the job.

The receiver has no transfer handle: it learns that the write landed from the notification
NIXL delivers (``get_new_notifs``), and that it never will when the sender disappears. That is a
second machine, :data:`PEER_RECEIVE`, declared with the same tools (and so with the same
compiled engine, diagram, explorer and coverage as the first) in
:mod:`kvfsm.machines.peer_receive`, and re-exported here:

    EXPECTING --notified[arrived]--> ARRIVED --publish--> PUBLISHED (success)
    EXPECTING --watch[gone]--> PEER_LOST --publish--> PUBLISHED (failure)
    EXPECTING --notified[misdirected]--> MISDIRECTED --publish--> PUBLISHED (failure)

A receiver block is written by the sender's NIXL, so the receiver may reuse it only when the
write is over: when the notification arrived (NIXL sends it after the data; it names the link,
the job *and* the receiver blocks, so a write into other blocks never counts: it fails the
job expected when it comes, MISDIRECTED, saying where each side put it), or when the sender is
gone.
:meth:`PeerReceiver.forget_peer` removes the sender's metadata before any job it owed fails, but
that does not revoke the access a live sender already has: a one-sided UCX write of a sender
that is still running can still land. So call it only when the sender is
really gone (its process ended, its connection broke), and the same goes for
:meth:`PeerReceiver.shutdown` with senders still connected.

Both sides keep a link per peer, a third machine (:data:`kvfsm.machines.peer_link.PEER_LINK`):
metadata exchange and a peer that disappears go through it. A sender posts only to a CONNECTED
receiver, and a receiver expects jobs only from a CONNECTED sender. The machines are coupled by
data declared beside them, never by this module's code: a write whose transfer failed with one
of :data:`~kvfsm.machines.peer_link.LINK_LOST_BY` (NIXL's ``nixlRemoteDisconnectError``, by
type) loses its link, and a receive job whose sender's link is in one of
:data:`~kvfsm.machines.peer_receive.RECEIVE_FAILS_WHEN_LINK_IN` (LOST, CLOSED) fails.

Which notification counts: the link's nonce
--------------------------------------------

A notification counts once, for the link it was sent over and the job it names; never for a
later link of a sender with the same name. The agent name cannot tell links apart: a sender that
reconnects, or a new process of the same engine, has the same name and restarts its job ids,
and NIXL hands out notifications by name only. So every sender link has a *nonce*
(:func:`~kvfsm.peer_link.new_nonce`, 128 random bits): the sender draws a new one whenever its
link closes, :meth:`PeerSender.metadata` hands it to the receiver's :meth:`PeerReceiver.connect`
with the agent metadata, and every notification the sender writes carries it
(:func:`notification_for`). The receiver sorts what NIXL delivers by that nonce:

* **An open link's notification is never dropped.** One that names a job expected on that link
  (same nonce, same sender name, same job id and blocks) completes it; one that came first is
  kept for that link until an :meth:`~PeerReceiver.expect` of its job claims it, or the link
  closes. Each counts once: on one link the n-th expect of a job id is completed by the n-th
  notification of it. One that came first counts only while its blocks stayed the job's: once
  a job covering one of them was published (its blocks handed back to the engine, which may
  write them), a copy kept from before no longer says what they hold, and is discarded when an
  expect would take it (:meth:`PeerReceiver._fresh`). A copy is dated when the receiver takes
  it from NIXL (a poll that hands blocks back takes NIXL's notifications once more first), so
  one still on its way as its blocks go back is dated after: expecting a job before its
  sender is told to write it leaves no copy to date. (A sender writing notifications no
  expect ever claims grows this store; ``stats()["early"]`` shows it, and forgetting the
  sender frees it.)
* **A closed link's nonce is spent.** When a link closes (``forget_peer``, a lost sender,
  ``shutdown``) what it kept is discarded, its jobs still expected fail, and its notifications,
  arriving then or later, never count; ``connect`` refuses metadata that carries a spent nonce,
  so a new link needs the sender's new metadata, taken after it connected again.
* **A notification whose nonce no link has yet is kept, boundedly.** A sender may write before
  the receiver connected it (it only needs the receiver's metadata, and NIXL delivers its
  notifications anyway). Such notifications wait, oldest first, in a store of
  :data:`MAX_UNKNOWN_NOTIFICATIONS`; ``connect`` hands that sender's to its new link. When the
  store is full the oldest is dropped, counted (``stats()["dropped"]``) and logged. Only these
  can be lost; a receiver that connects a sender before the sender gets the receiver's metadata
  never has one of them.
* **Anything else never counts:** not a kvfsm job notification, a nonce of another sender's
  link, or of a closed link. It is discarded on arrival and counted (``stats()["discarded"]``).

How a receiver learns a sender is gone, without being told (``peer_timeout``)
-----------------------------------------------------------------------------

A sender that owes jobs and has sent nothing for ``peer_timeout`` seconds is *probed*: the
receiver sends it a small notification (:data:`~kvfsm.peer_link.PROBE_MESSAGE`), and again every
``peer_timeout`` seconds while it stays silent. Only a probe that fails with NIXL's
``NIXL_ERR_REMOTE_DISCONNECT`` (a ``nixlRemoteDisconnectError``, told by its type) loses the
link; then the sender's metadata is removed and every job it owed publishes a failure. A probe
that goes through, or fails in another way, changes nothing: the jobs stay expected, however
late. That is deliberate. A receiver cannot revoke a one-sided
write: a sender that is still connected may still write into those blocks, so publishing a
failure for them (and letting the engine reuse the blocks) on a clock alone could let a late
write land in memory that holds something else. A timeout only decides *when to ask*; NIXL's
answer decides. A sender that is connected but never writes keeps its jobs expected until the
engine decides otherwise (``forget_peer``, when it knows the sender is really gone).

Measured on NIXL 1.5.1 (UCX, two processes on one host): after the sender process was killed,
the first probe on a connection never used before was accepted (UCX learns of the loss
asynchronously) and the next one, 7 ms later, raised ``nixlRemoteDisconnectError``; on a
connection already used, the first probe raised. So a dead sender is found within two
``peer_timeout`` periods of silence.
"""

from __future__ import annotations

import collections
import functools
import logging
import re
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvfsm.contract import (
    Books,
    DrainTimeout,
    JobSide,
    check_interval,
    check_timeout,
    handing_out,
    marked_results,
    take,
)
from kvfsm.machines.peer_link import PEER_LINK, LinkState, loses_link
from kvfsm.machines.peer_receive import (
    PEER_RECEIVE,
    RECEIVE_FAILS_WHEN_LINK_IN,
    PeerAnswer,
    ReceiveEvent,
    ReceiveState,
)
from kvfsm.machines.transfer import FailureReason
from kvfsm.peer_link import (
    PROBE_MESSAGE,
    PeerLink,
    PeerLinkError,
    PeerLinks,
    PeerNotConnected,
    new_nonce,
)
from kvfsm.policy import RetryPolicy
from kvfsm.tiers.base import (
    InvalidJobError,
    Lookup,
    SecondaryTier,
    TierClosedError,
    _check_primary,
    check_agent,
)
from kvfsm.transfer import JobResult, Leak, Transfer, TransferJob

__all__ = [
    "MAX_UNKNOWN_NOTIFICATIONS",
    "PEER_RECEIVE",
    "PeerAnswer",
    "PeerNotConnected",
    "PeerReceiver",
    "PeerSender",
    "ReceiveEvent",
    "ReceiveState",
    "notification_for",
]


logger = logging.getLogger("kvfsm")


#: how many notifications whose nonce no link has (yet) a receiver keeps, oldest dropped first
#: (a few hundred bytes each: about 1 MiB in all)
MAX_UNKNOWN_NOTIFICATIONS = 4096

#: a kvfsm job notification, and the link nonce it carries
_JOB_NOTIFICATION = re.compile(rb"kvfsm-job:([0-9a-f]{32}):")
#: the job id and the blocks a kvfsm job notification names (after its nonce)
_JOB_AND_BLOCKS = re.compile(
    rb"kvfsm-job:[0-9a-f]{32}:(-?[0-9]{1,30}):([0-9]{1,20}(?:,[0-9]{1,20})*)")
#: what :meth:`PeerSender.metadata` starts with: the nonce, then the agent's metadata
_SENDER_METADATA = re.compile(rb"kvfsm-sender:([0-9a-f]{32}):")


def notification_for(nonce: str, job_id: int, blocks: Sequence[int]) -> bytes:
    """The notification a peer write of ``job_id`` into the receiver's ``blocks`` carries, over
    the link whose nonce is ``nonce``."""
    return f"kvfsm-job:{nonce}:{job_id}:{','.join(map(str, blocks))}".encode()


def _says_link_is_there(link: PeerLink, messages: Sequence[Any]) -> bool:
    """Whether ``messages``, delivered under the link's sender name, say its sender is there:
    one of them is a job notification of the link's nonce, or no kvfsm job notification at
    all. Job notifications of another nonce only are a new process's of the same name (NIXL
    names a sender by agent name only), which says nothing of the link's own."""
    for message in messages:
        found = _JOB_NOTIFICATION.match(bytes(message))
        if found is None or found.group(1).decode() == link.nonce:
            return True
    return False


def _parse_sender_metadata(metadata: object) -> tuple[str, bytes]:
    """The nonce and the agent metadata in what :meth:`PeerSender.metadata` made."""
    if not isinstance(metadata, bytes | bytearray | memoryview):
        raise TypeError(f"sender metadata must be the bytes PeerSender.metadata() returns, "
                        f"got {type(metadata).__name__}")
    data = bytes(metadata)
    if not data.startswith(b"kvfsm-sender:"):
        raise ValueError(f"sender metadata must come from PeerSender.metadata() (it carries the "
                         f"link nonce the sender's notifications name); got {len(data)} bytes "
                         "that do not start with b'kvfsm-sender:' (an agent's own metadata?)")
    found = _SENDER_METADATA.match(data)
    if found is None:
        raise ValueError("sender metadata: b'kvfsm-sender:' must be followed by a nonce of 32 "
                         f"lowercase hex digits and ':', got {data[13:48]!r}")
    if found.end() == len(data):
        raise ValueError("sender metadata carries a nonce but no agent metadata after it")
    return found.group(1).decode(), data[found.end():]


#: the peer sides on each agent, by the id of the agent under any wrappers (a side holds its
#: agent, so the id is that agent's while a side on it lives): a receiver's agent must be its
#: alone; under :data:`_sides_lock`
_sides_on: dict[int, weakref.WeakSet[Any]] = {}
_sides_lock = threading.Lock()
#: the spent nonces of each agent's receivers (:func:`_spent_on`), under :data:`_sides_lock`
_spent_nonces: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()
_spent_by_id: dict[int, dict[str, str]] = {}


def _innermost(agent: Any) -> Any:
    """The agent under its wrappers (a :class:`~kvfsm.testing.FaultyAgent`'s ``wrapped``):
    a wrapper's calls reach that agent's notifications."""
    seen = 0
    while hasattr(agent, "wrapped") and seen < 100:  # (a wrapper of itself: no loop for ever)
        agent, seen = agent.wrapped, seen + 1
    return agent


def _claim_agent(agent: Any, side: Any) -> None:
    """``side`` (a PeerReceiver or a PeerSender being made) takes ``agent``, refused when a
    receiver still on it reads its notifications, or, for a receiver, when any side still
    on it may call it: NIXL hands each notification to one ``get_new_notifs`` call, and a
    sender drops what its calls take (it expects none), so a receiver sharing its agent would
    lose its jobs' notifications, and they would stay expected for good, with nothing to say
    why. Checked and taken at once (two sides made on two threads); given back with
    :func:`_free_agent` if the side is not made after all. A side holds its agent until it
    lets go of it (``_let_go``: a shut-down receiver, a sender once its shutdown made its last
    call of the agent).

    Raises:
        ValueError: names the agent and the side already on it.
    """
    key = id(_innermost(agent))
    with _sides_lock:
        live = [other for other in _sides_on.get(key, ()) if not getattr(other, "_let_go", False)]
        readers = [other for other in live if isinstance(other, PeerReceiver)]
        if readers or (isinstance(side, PeerReceiver) and live):
            other = type((readers or live)[0]).__name__
            raise ValueError(
                f"agent {getattr(agent, 'name', agent)!r} is a {other}'s already: NIXL hands "
                "each notification to one get_new_notifs call, so a receiver sharing its agent "
                "with another side loses its jobs' notifications (they stay expected for good); "
                f"give the {type(side).__name__} an agent of its own")
        for empty in [other for other, sides in _sides_on.items() if not sides]:
            del _sides_on[empty]
        _sides_on.setdefault(key, weakref.WeakSet()).add(side)


def _spent_on(agent: Any) -> dict[str, str]:
    """The nonces of the links the receivers on ``agent`` closed, with their senders: shared
    by every receiver made on it, one after another. A sender whose link to a receiver shut
    down is still open writes, once a new receiver is on the agent, where the old one's cache
    was: the new one must refuse that link (and count none of its notifications), so it
    must know its nonce is spent."""
    inner = _innermost(agent)
    with _sides_lock:
        try:
            return _spent_nonces.setdefault(inner, {})
        except TypeError:  # (an agent no weak reference can name: by its id, for good)
            return _spent_by_id.setdefault(id(inner), {})


def _free_agent(agent: Any, side: Any) -> None:
    """``side`` was not made after all: ``agent`` is not its."""
    with _sides_lock:
        _sides_on.get(id(_innermost(agent)), weakref.WeakSet()).discard(side)


def _made_on(agent: Any, side: Any, made: Callable[[], None]) -> None:
    """Makes ``side`` with ``made()`` on ``agent`` claimed for it (:func:`_claim_agent`),
    giving the agent back if the side is not made (an error, or a Ctrl-C as the claim
    returns)."""
    try:
        _claim_agent(agent, side)
        made()
    except BaseException:
        _free_agent(agent, side)
        raise


def _peer_name(name: Any) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


class _Inbox:
    """One open link's notifications: the jobs waiting for theirs, and those that came first."""

    __slots__ = ("early", "link", "waiting")

    def __init__(self, link: PeerLink) -> None:
        self.link = link
        #: notification -> the expected job it completes
        self.waiting: dict[bytes, int] = {}
        #: notifications that came before their expect(): for each, when each copy of it came
        #: (the receiver's hand-back count then, :meth:`PeerReceiver._fresh`), oldest first
        self.early: dict[bytes, list[int]] = {}


def _check_sender(sender: object) -> None:
    """Raise TypeError unless ``sender`` is a sender's name, a str."""
    if not isinstance(sender, str):
        raise TypeError(f"sender must be the str name connect() returned, got "
                        f"{type(sender).__name__} {sender!r}")


class _HeldSigint:
    """SIGINT's handler held back from :meth:`hold` until :meth:`let_go`, which puts it back
    and runs it (raises the signal again) if a SIGINT came meanwhile. Only on the main thread,
    where Python runs signal handlers (elsewhere no interrupt is raised), and only when the
    handler was set from Python (else it could not be put back): otherwise nothing is held.
    Costs two handler changes (about 4.6 us each on the guest measured, docs/peer.md); the
    handler is put back at once (a wrapper of kvfsm's left in place would cost less, but
    whoever asks for the handler would find it)."""

    __slots__ = ("came", "handler")

    def __init__(self) -> None:
        self.handler: Any = None
        self.came = False

    def hold(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGINT)
        if handler is None:  # (set from C: it could not be put back)
            return
        self.handler = handler  # (first: let_go puts it back, whatever comes after)
        signal.signal(signal.SIGINT, self._came)

    def _came(self, signum: int, frame: Any) -> None:
        self.came = True

    def let_go(self) -> None:
        handler = self.handler
        if handler is None:
            return
        signal.signal(signal.SIGINT, handler)  # (no SIGINT raises before this: it only marks)
        self.handler = None
        if self.came:
            signal.raise_signal(signal.SIGINT)


class _Expected:
    """One job the receiver expects: the record its machine moves."""

    __slots__ = ("error", "finished_at", "job", "job_id", "link", "peer", "reason",
                 "started_at", "state", "success", "trace")

    def __init__(self, job: TransferJob, peer: str, link: PeerLink) -> None:
        self.job = job
        self.job_id = job.job_id
        self.peer = peer
        #: the link the job is owed over (a later connect of the same sender is another link)
        self.link = link
        self.state = ReceiveState.EXPECTING
        self.success: bool | None = None
        self.error: str | None = None
        #: why the job failed, latched with the outcome (the sender was lost)
        self.reason: FailureReason | None = None
        self.started_at = self.finished_at = time.monotonic()
        self.trace: list[Any] = []


class _Mending:
    """``with _Mending(receiver):`` around a call of a receiver that changes its books:
    :meth:`PeerReceiver._mend` first if an interrupt went through a call before, and this
    one's noted (as :attr:`kvfsm.runner.Runner.guarded` does for a tier)."""

    __slots__ = ("receiver",)

    def __init__(self, receiver: PeerReceiver) -> None:
        self.receiver = receiver

    def __enter__(self) -> None:
        if self.receiver._damaged:
            self.receiver._mend()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: Any) -> None:
        if kind is not None and not issubclass(kind, Exception):  # an interrupt: it may
            self.receiver._damaged = True  # have cut a change of the books short


#: the calls a receiver makes of its NIXL agent (its own, and its links')
RECEIVER_CALLS = ("register_memory", "deregister_memory", "get_new_notifs",
                  "add_remote_agent", "check_remote_metadata", "remove_remote_agent",
                  "send_notif")


class PeerReceiver(JobSide):
    """The receiving engine's side: registers its KV cache once, expects jobs, publishes one
    result for each when its notification arrives or its sender is gone.

    A notification counts only for the link whose nonce it carries, once (module docstring);
    :meth:`stats` counts what was kept, dropped and discarded.

    Args:
        primary: the receiver's KV cache (contiguous CPU tensor, blocks on the first dimension).
        agent: a NIXL agent with the UCX backend.
        peer_timeout: seconds a sender that owes jobs may stay silent (no notification under
            its name but job notifications of another link's nonce, a new process's) before
            it is probed, and between probes while it stays silent; None: never probe (a
            sender is then only found gone by :meth:`forget_peer`). A probe never fails a job
            by itself: only NIXL answering that the sender is gone does (module docstring).
    """

    _noun = "expected job(s)"

    def __init__(self, primary: torch.Tensor, *, agent: Any,
                 peer_timeout: float | None = 30.0, poll_interval: float = 0.0002) -> None:
        _check_primary(primary)
        if peer_timeout is not None and (
                isinstance(peer_timeout, bool) or not isinstance(peer_timeout, int | float)
                or not peer_timeout > 0):
            raise ValueError(f"peer_timeout must be > 0 seconds or None, got {peer_timeout!r}")
        check_interval("poll_interval", poll_interval)
        check_agent(agent, RECEIVER_CALLS, "a nixl_agent with the UCX backend, or "
                    "kvfsm.testing.fake_ucx.FakeUcxAgent")
        _made_on(agent, self, lambda: self._made(primary, agent, peer_timeout, poll_interval))

    def _made(self, primary: torch.Tensor, agent: Any, peer_timeout: float | None,
              poll_interval: float) -> None:
        """(``__init__``, the agent claimed.)"""
        self.primary = primary
        self.agent = agent
        self.name = _peer_name(agent.name)
        self.block_bytes = int(primary[0].nbytes)
        self.num_blocks = int(primary.shape[0])
        self.peer_timeout = peer_timeout
        self.machine = PEER_RECEIVE.compile(trace=True)
        self.links = PeerLinks(agent)
        #: where the primary cache's memory was when NIXL registered it (senders write there)
        self._primary_at = primary.data_ptr()
        self._registration = agent.register_memory(
            [(self._primary_at, self.num_blocks * self.block_bytes, 0, "")], "DRAM")
        self.poll_interval = poll_interval
        self._books = Books()
        #: the expected jobs not yet published, by job id
        self._expected: dict[int, _Expected] = self._books.records
        #: each open link's notifications, by its nonce
        self._inboxes: dict[str, _Inbox] = {}
        #: the notifications those inboxes keep for an expect to come, counted as they come
        #: and go (for :meth:`stats`, which never takes the lock); ``_early_stale``: an
        #: interrupt may have come between a change and its count: the next poll counts again
        self._early = 0
        self._early_stale = False
        #: nonces of links that closed, with their sender: their notifications never count
        #: (those a receiver on this agent before it closed too: :func:`_spent_on`)
        self._spent = _spent_on(agent)
        #: the nonces of its open links, with their senders: spent on the agent when the
        #: receiver is collected without a shutdown too (a receiver made on the agent next
        #: must refuse them: their senders write where this one's cache was)
        self._linked: dict[str, str] = {}
        weakref.finalize(self, self._spent.update, self._linked)
        #: (sender, nonce, notification, when it came) with a nonce no link has yet, oldest
        #: first
        self._unknown: collections.deque[tuple[str, str, bytes, int]] = collections.deque(
            maxlen=MAX_UNKNOWN_NOTIFICATIONS)
        #: how many times blocks were handed back to the engine (a job published, whatever its
        #: outcome), and the count each block was last handed back at: a notification kept
        #: from before its blocks were handed back no longer says what they hold
        self._handbacks = 0
        self._handed_back: dict[int, int] = {}
        #: links whose sender's notifications came with another nonce (warned once each)
        self._relinked: set[PeerLink] = set()
        #: the links the receiver's shutdown closed
        self._shut_off: set[PeerLink] = set()
        #: notifications pushed out of the unknown store; notifications that could never count
        self._dropped = 0
        self._discarded = 0
        #: get_new_notifs calls that raised; cleanup calls that failed (call, error)
        self._notif_errors = 0
        self._leaks: list[tuple[str, str]] = []
        #: how many unpublished jobs each link owes
        self._owed: dict[PeerLink, int] = {}
        #: the block ids of the expected jobs, each with the job whose sender writes it
        self._writing: dict[int, int] = {}
        #: the notifications taken from NIXL and not yet filed, each batch with the count of
        #: hand-backs when it was taken (what dates its notifications), oldest first: one an
        #: interrupt cut short goes on where it stopped
        self._arriving: collections.deque[tuple[int, dict[Any, Any]]] = collections.deque()
        #: an interrupt went through a call that changes the books: the next one mends them
        self._damaged = False
        self._lock = threading.RLock()
        self._closed = False
        #: True once shut down: no call of the agent that takes notifications from then on
        self._let_go = False

    def metadata(self) -> bytes:
        """This agent's metadata, for the sender's :meth:`PeerSender.connect`."""
        metadata: bytes = self.agent.get_agent_metadata()
        return metadata

    def block_descs(self) -> list[tuple[int, int, int]]:
        """The receiver's blocks as NIXL descriptors, for the sender."""
        base = self.primary.data_ptr()
        return [(base + i * self.block_bytes, self.block_bytes, 0) for i in range(self.num_blocks)]

    def connect(self, sender_metadata: bytes) -> str:
        """Link a sender: load its agent metadata, and count from now on the notifications
        carrying its link's nonce; returns its name.

        ``sender_metadata`` is what the sender's :meth:`PeerSender.metadata` returned for this
        link. The link is CONNECTED when NIXL says it holds the metadata; if not yet, it is
        CONNECTING and checked again at each :meth:`get_finished_jobs`. Notifications of this
        link that came before it (kept in the unknown store) are now its own.

        Raises:
            TypeError, ValueError: ``sender_metadata`` is not what :meth:`PeerSender.metadata`
                makes (an agent's own metadata, say); nothing was loaded.
            kvfsm.peer_link.PeerLinkError: NIXL refused the metadata, or lost it at once; or
                a link to that sender is still open; or the metadata is that of a link that
                closed (its nonce is spent: take the sender's metadata again after it
                connected again).
        """
        nonce, agent_metadata = _parse_sender_metadata(sender_metadata)
        with self._lock, _Mending(self):
            if self._closed:
                raise TierClosedError("PeerReceiver is shut down; no sender is connected")
            inbox = self._inboxes.get(nonce)
            if inbox is not None:
                raise PeerLinkError(f"peer {inbox.link.name!r} is already linked "
                                    f"({inbox.link.state.name}) with this metadata; "
                                    "forget it first")
            if nonce in self._spent:
                raise PeerLinkError(
                    f"sender {self._spent[nonce]!r}: this metadata is that of a link that "
                    f"closed (nonce {nonce} is spent): by this receiver, or by one on its "
                    "agent before it; a new link needs the sender's PeerSender.metadata() taken "
                    "after its old link closed: the sender forget_peer() and connect() again, "
                    "with this receiver's metadata() and block_descs() (a sender still linked "
                    "to a receiver shut down writes where that one's cache was)")
            link = self.links.connect(agent_metadata, nonce)
            self._linked[nonce] = str(link.name)
            inbox = self._inboxes[nonce] = _Inbox(link)
            self._adopt(inbox)
            return str(link.name)

    def link_state(self, sender: str) -> LinkState:
        """The state of the link to ``sender`` (UNKNOWN if never connected, or closed
        before the last :data:`~kvfsm.peer_link.CLOSED_KEPT` links that closed)."""
        return self.links.state_of(sender)

    def expect(self, job: TransferJob, sender: str) -> None:
        """Expect ``sender``'s write of ``job`` into ``job.block_ids`` (allocated, being
        written, by the receiver's parent). ``job.keys`` (one a block) are kept with it, and
        its ``is_promotion`` is not read: a receive job is a write into this cache either way.

        Job ids are the receiver's, one space for all its senders: two senders' jobs expected
        at once need ids apart (a second expect of an id waiting is refused, naming it).

        Raises:
            TypeError: ``sender`` is not a str (the name :meth:`connect` returned); nothing
                changed.
            InvalidJobError: ``job`` is not a TransferJob with an int id, a non-empty list
                of distinct int block ids in range and a list of as many keys; its id is
                already expected, or has a result
                not yet collected (the engine would take that result for this job's); a block
                is one another expected job's sender writes too (both would be published
                as arrived, one with the other's bytes); or the sender's link is not CONNECTED
                (:class:`PeerNotConnected`); nothing changed.
            TierClosedError: the receiver is shut down.
        """
        _check_sender(sender)
        with self._lock, _Mending(self):
            if self._closed:
                raise TierClosedError(f"PeerReceiver is shut down; job "
                                      f"{getattr(job, 'job_id', job)!r} refused")
            self._check_expected(job)
            if self.primary.data_ptr() != self._primary_at:
                raise InvalidJobError(f"job {job.job_id} refused: {self._moved()}")
            # kept as it is now: the caller's lists may change after this call returns
            job = TransferJob(job.job_id, tuple(job.keys),
                              tuple(block.__index__() for block in job.block_ids),
                              job.is_promotion)
            link = self.links.get(sender)
            if link is None or link.state is not LinkState.CONNECTED:
                state = "unknown; connect() it first" if link is None else link.state.name
                raise PeerNotConnected(f"job {job.job_id}: sender {sender!r} is {state}")
            if not self._owes(link):  # silence counts from when something is owed
                link.quiet_since = time.monotonic()
            expected = _Expected(job, sender, link)
            # taken from here on: what follows is mended from the record if cut short
            self._expected[job.job_id] = expected
            for block in job.block_ids:
                self._writing[block] = job.job_id
            self._owed[link] = self._owed.get(link, 0) + 1
            self._claim(expected)

    def _claim(self, expected: _Expected) -> None:
        """An expected job takes the oldest fresh copy of its notification that came first,
        if any (it counts, once: published at the next poll); else it waits for one."""
        job, link = expected.job, expected.link
        inbox = self._inboxes[link.nonce]
        message = notification_for(link.nonce, job.job_id, job.block_ids)
        if message in inbox.early and self._fresh(inbox, message, job):
            # it came first, and its blocks were not handed back since: it counts
            self.machine.fire(expected, ReceiveEvent.NOTIFIED, PeerAnswer.ARRIVED)
            self._spend(inbox, message)  # (after: cut short, a copy stays, dated before
            # the job's blocks go back, and so never counts again)
        else:
            inbox.waiting[message] = job.job_id

    def _fail_moved(self) -> None:
        """(a poll) The cache's memory moved: every job still expected fails, before another
        notification is taken (a write it tells of may have landed in the memory the cache
        left, so none taken from now on counts)."""
        for expected in list(self._expected.values()):
            if expected.state is ReceiveState.EXPECTING:
                self.machine.fire(expected, ReceiveEvent.WATCH, PeerAnswer.GONE, self._moved())

    def _moved(self) -> str:
        """What is wrong with a primary cache whose memory moved since the receiver was
        made."""
        return (f"the primary cache's memory moved since this PeerReceiver was made (from "
                f"{self._primary_at:#x} to {self.primary.data_ptr():#x}: share_memory_(), "
                "resize_() or setting .data moves it), and senders write into the memory "
                "registered then; move the cache before making the receiver, and make a new "
                "one now (each sender then forget_peer() and connect() to the new one: one "
                "still linked to this one writes where its cache was)")

    def _fresh(self, inbox: _Inbox, message: bytes, job: TransferJob) -> bool:
        """Whether a copy of ``message`` kept in ``inbox`` came after the job's blocks were
        last handed back to the engine (the oldest such is the first: :meth:`_spend` takes
        it once it counted). Older copies are discarded: the write they report landed before
        the engine got those blocks back (a job covering them was published since), and the
        engine may have written the blocks since, so they no longer hold what was written (a
        job failed, say, and expected again with the same id and blocks once its sender linked
        again)."""
        came = inbox.early[message]
        handed_back = max(self._handed_back.get(block, 0) for block in job.block_ids)
        stale = 0
        while stale < len(came) and came[stale] < handed_back:
            stale += 1
        if stale:
            self._discarded += stale
            logger.warning("job %d: %d notification(s) of it kept from before its blocks %s "
                           "were handed back (a job covering them was published since) were "
                           "discarded: the blocks may hold something else now; the job waits "
                           "for a new write", job.job_id, stale, list(job.block_ids))
        try:
            del came[:stale]
            self._early -= stale
        except BaseException:  # (an interrupt between the two: counted again at the next poll)
            self._early_stale = True
            raise
        if not came:
            del inbox.early[message]
            return False
        return True

    def _spend(self, inbox: _Inbox, message: bytes) -> None:
        """The oldest copy of ``message`` kept in ``inbox`` counted for its job: it goes."""
        came = inbox.early.get(message)
        if not came:
            return
        try:
            del came[0]
            self._early -= 1
        except BaseException:  # (as in _fresh)
            self._early_stale = True
            raise
        if not came:
            del inbox.early[message]

    def _check_expected(self, job: Any) -> None:
        """Raise InvalidJobError naming what is wrong with an expected ``job``."""
        if not isinstance(job, TransferJob):
            raise InvalidJobError(f"expected a TransferJob, got {type(job).__name__}")
        job_id = job.job_id
        if not isinstance(job_id, int) or isinstance(job_id, bool):
            raise InvalidJobError(f"job_id must be an int, got {job_id!r}")
        if job_id in self._expected:
            raise InvalidJobError(f"job {job_id} is already expected")
        if job_id in self._books.unreported:
            raise InvalidJobError(f"job {job_id} has a result not yet collected")
        blocks = job.block_ids
        if not isinstance(blocks, list | tuple) or not blocks:
            raise InvalidJobError(f"job {job_id}: block_ids must be a non-empty list or tuple, "
                                  f"got {blocks!r}")
        if not isinstance(job.keys, list | tuple):
            raise InvalidJobError(f"job {job_id}: keys must be a list or tuple (one key a "
                                  f"block), got {type(job.keys).__name__} {job.keys!r}")
        if len(job.keys) != len(blocks):
            raise InvalidJobError(f"job {job_id} has {len(job.keys)} keys but {len(blocks)} "
                                  "block ids")
        for block in blocks:
            if isinstance(block, bool) or not hasattr(block, "__index__"):  # (numpy's too)
                raise InvalidJobError(f"job {job_id}: block {block!r} is not an int")
            if not 0 <= block < self.num_blocks:
                raise InvalidJobError(f"job {job_id}: block {block} is out of range "
                                      f"[0, {self.num_blocks})")
            other = self._writing.get(block)
            if other is not None:
                raise InvalidJobError(f"job {job_id}: block {block} is expected from job "
                                      f"{other} already (its sender may still write it)")
        if len(set(blocks)) != len(blocks):
            raise InvalidJobError(f"job {job_id}: a block appears twice in {list(blocks)}")

    def forget_peer(self, sender: str) -> None:
        """The sender is gone: remove its metadata, then fail what it owed (at the next poll).

        Its link's notifications never count from now on, even for jobs it owed. Only for a
        sender that is really gone: a live sender's writes are not revoked. A name no link has
        changes nothing.

        Raises:
            TypeError: ``sender`` is not a str (the name :meth:`connect` returned).
        """
        _check_sender(sender)
        with self._lock, _Mending(self):
            link = self.links.get(sender)
            if link is not None and link.state not in PEER_LINK.final:
                self._close(link)

    def _poll(self, everything: bool = False, closing: bool = False) -> None:
        """Take NIXL's new notifications, watch the senders, publish what is over (every
        poll looks at every job: ``everything`` changes nothing). Before a job is published
        (its blocks handed back to the engine), NIXL's notifications are taken once more: one
        of a write that landed before the hand-back is then dated before it (:meth:`_fresh`),
        not a poll later. If that take fails, nothing is published this poll (the jobs wait
        for a poll whose take goes through), but when ``closing``: every link is closed then,
        so no notification can count any more."""
        with _Mending(self):
            self._poll_once(closing)

    def _poll_once(self, closing: bool) -> None:
        """(:meth:`_poll`.)"""
        if self._early_stale:
            self._recount_early()
        now = time.monotonic()
        if self._expected and self.primary.data_ptr() != self._primary_at:
            self._fail_moved()  # (before any notification is taken)
        self._take_new(now)
        self._watch_links(now)
        if not self._expected:
            return
        for expected in list(self._expected.values()):
            if expected.state is ReceiveState.EXPECTING:
                link = expected.link
                if link.state in RECEIVE_FAILS_WHEN_LINK_IN:
                    self.machine.fire(expected, ReceiveEvent.WATCH, PeerAnswer.GONE,
                                      f"sender {expected.peer} is gone: {link.error}"
                                      if link.error else
                                      f"sender {expected.peer} cut off: the receiver was "
                                      "shut down" if link in self._shut_off else
                                      f"sender {expected.peer} is gone: forgotten")
                else:
                    self.machine.fire(expected, ReceiveEvent.WATCH, PeerAnswer.PRESENT)
        if all(e.state is ReceiveState.EXPECTING for e in self._expected.values()):
            return
        # what arrived before these hand-backs is dated before them
        if not self._take_new(now) and not closing:
            return
        for expected in list(self._expected.values()):
            if expected.state is not ReceiveState.EXPECTING:
                self._publish(expected)

    def _take_new(self, now: float) -> bool:
        """Take the notifications NIXL delivered since it was last asked, and file them; False
        when NIXL's call raised (nothing was taken).

        NIXL hands each notification over once, and its ``get_new_notifs`` is Python code: a
        Ctrl-C handled as its binding returns would lose what it handed over (measured on
        real UCX under a stream of SIGINTs: 73 of 200 jobs whose writes landed stayed
        expected for good). So SIGINT's handler is held back meanwhile (:class:`_HeldSigint`)
        and runs once they are filed."""
        held = _HeldSigint()
        try:
            held.hold()
            return self._take_and_file(now)
        finally:
            held.let_go()

    def _take_and_file(self, now: float) -> bool:
        """(:meth:`_take_new`, SIGINT held.)"""
        dropped = self._dropped
        self._file_arriving(now)  # (what an interrupt left of an earlier take, first)
        if self._let_go:  # (shut down: another side may have its agent now)
            return False
        try:  # kept as it is taken (one statement): an interrupt after it loses none
            self._arriving.append((self._handbacks, self.agent.get_new_notifs()))
        except Exception as error:  # a NIXL error is the receiver's to report, not to raise
            # (F7): no notification this round; the senders are still watched
            self._notif_errors += 1
            if self._notif_errors & (self._notif_errors - 1) == 0:  # 1st, 2nd, 4th...: not all
                logger.warning("get_new_notifs raised (%d time(s) so far): %s: %s",
                               self._notif_errors, type(error).__name__, error)
            return False
        self._file_arriving(now)
        if self._dropped > dropped:
            logger.warning("dropped the %d oldest notification(s) carrying a nonce no link "
                           "has: the store of %d was full (%d dropped in all)",
                           self._dropped - dropped, MAX_UNKNOWN_NOTIFICATIONS,
                           self._dropped)
        return True

    def _file_arriving(self, now: float) -> None:
        """File the notifications taken from NIXL, each taken off once it was filed (at
        least once: one an interrupt cut short after its filing is filed again, a copy kept
        for an expect dated as the first, so it never counts twice: :meth:`_fresh`)."""
        arriving = self._arriving
        while arriving:
            came, arrived = arriving[0]
            if type(arrived) is not dict:  # (an agent's own mapping: taken off as a dict)
                arrived = dict(arrived)
                arriving[0] = came, arrived
            while arrived:
                sender = next(iter(arrived))
                messages = arrived[sender]
                name = _peer_name(sender)
                link = self.links.get(name)
                if link is not None and messages and _says_link_is_there(link, messages):
                    link.quiet_since = now  # heard from: it is there
                if type(messages) is not collections.deque:  # (taken off at the front)
                    messages = arrived[sender] = collections.deque(messages)
                while messages:
                    self._take(name, bytes(messages[0]), link, came)
                    messages.popleft()
                del arrived[sender]
            arriving.popleft()

    def stats(self) -> dict[str, int]:
        """What the receiver holds and has thrown away.

        ``expected``: jobs not yet published; ``early``: notifications of open links waiting
        for their :meth:`expect`; ``unknown``: notifications whose nonce no link has yet (at
        most :data:`MAX_UNKNOWN_NOTIFICATIONS`); ``dropped``: those pushed out of that store
        since the receiver was made; ``discarded``: notifications that could never count (not
        kvfsm's, another sender's nonce, a closed link's), since it was made;
        ``notify_errors``: ``get_new_notifs`` calls that raised (each took no notification; a
        poll makes two when it hands blocks back, and publishes nothing if the second raised);
        ``leaks``: cleanup calls that failed (the cache's registration
        at shutdown, the links' metadata removals).

        Constant, and never takes the receiver's lock: a monitoring thread is not held up
        behind a poll, nor behind the NIXL call a poll is making, and holds up nobody. (After
        an interrupt that cut a change of the notifications kept short, ``early`` may be off
        until the next poll counts them again.)
        """
        return {"expected": len(self._expected),
                "early": self._early,
                "unknown": len(self._unknown),
                "dropped": self._dropped,
                "discarded": self._discarded,
                "notify_errors": self._notif_errors,
                "leaks": len(self._leaks) + self.links.leak_count}

    def _take(self, sender: str, message: bytes, link: PeerLink | None, came: int) -> None:
        """One notification from NIXL (under the name of ``link``'s sender, when a link has
        that name), taken when ``came`` hand-backs were made: it completes a job, or is kept,
        dropped or discarded."""
        found = _JOB_NOTIFICATION.match(message)
        if found is None:
            if message != PROBE_MESSAGE:
                self._discard(sender, message, "not a kvfsm job notification")
            return
        nonce = found.group(1).decode()
        inbox = self._inboxes.get(nonce)
        if inbox is not None:
            if inbox.link.name == sender:
                self._arrived(inbox, message, came)
            else:
                self._discard(sender, message, f"its nonce is {inbox.link.name!r}'s link's")
        elif nonce in self._spent:
            self._discard(sender, message, "its link is closed")
        else:  # a sender not connected yet, maybe: kept while there is room
            if len(self._unknown) == self._unknown.maxlen:
                self._dropped += 1
            self._unknown.append((sender, nonce, message, came))
            if (link is not None and link.state not in PEER_LINK.final
                    and link not in self._relinked):
                self._relinked.add(link)
                logger.warning(
                    "sender %s: its notifications carry a nonce its link does not: it linked "
                    "again, or a new process of its name writes. The %d job(s) owed over the "
                    "old link wait until it is found gone; if the sender is gone, "
                    "forget_peer(%r), then connect its new metadata", sender,
                    self._owed.get(link, 0), sender)

    def _recount_early(self) -> None:
        """Count the notifications kept for an expect again, from the inboxes (under the
        lock); the count is no longer stale once it is made."""
        self._early = sum(len(came) for inbox in self._inboxes.values()
                          for came in inbox.early.values())
        self._early_stale = False

    def _arrived(self, inbox: _Inbox, message: bytes, came: int) -> None:
        """A notification of an open link, that came when ``came`` hand-backs were made: it
        completes the job waiting for it, or waits."""
        job_id = inbox.waiting.get(message)  # (taken off once it counted: below)
        expected = None if job_id is None else self._expected.get(job_id)
        if job_id is None and self._misdirected(inbox, message):
            return
        if expected is None or expected.state is not ReceiveState.EXPECTING:
            # (no job waits for it, or the one waiting failed meanwhile: its cache moved)
            try:
                inbox.early.setdefault(message, []).append(came)
                self._early += 1
            except BaseException:  # (as in _fresh)
                self._early_stale = True
                raise
        elif self.primary.data_ptr() != self._primary_at:  # (moved as the poll ran: the
            # write may have landed in the memory the cache left)
            self.machine.fire(expected, ReceiveEvent.WATCH, PeerAnswer.GONE, self._moved())
        else:
            self.machine.fire(expected, ReceiveEvent.NOTIFIED, PeerAnswer.ARRIVED)
        if job_id is not None:
            inbox.waiting.pop(message, None)

    def _misdirected(self, inbox: _Inbox, message: bytes) -> bool:
        """Whether ``message``, which no job waits for, names the id of a job expected on its
        link with other blocks (the same in another order, or others): the sender wrote that
        job where the receiver did not expect it, so the two engines disagree on its blocks.
        The job fails, saying where each side put it, and an error is logged; the notification
        never counts (the job's blocks do not hold what the sender wrote for it)."""
        if not self._expected:
            return False
        found = _JOB_AND_BLOCKS.fullmatch(message)
        if found is None:
            return False
        expected = self._expected.get(int(found.group(1)))
        if (expected is None or expected.link is not inbox.link
                or expected.state is not ReceiveState.EXPECTING):
            return False
        written = [int(block) for block in found.group(2).split(b",")]
        lent = list(expected.job.block_ids)
        stray = sorted(set(written) - set(lent))
        why = (f"sender {expected.peer} wrote job {expected.job_id} into blocks {written}, not "
               f"the {lent} it was expected in: the engines disagree on the job's blocks"
               + (f" (blocks {stray} are no block of the job: the sender wrote them all the "
                  "same)" if stray else " (its blocks hold each other's bytes)"))
        logger.error("%s", why)
        self._discarded += 1
        self.machine.fire(expected, ReceiveEvent.NOTIFIED, PeerAnswer.MISDIRECTED, why)
        return True

    def _adopt(self, inbox: _Inbox) -> None:
        """A link was made: the notifications of it that came before are its own now."""
        nonce = inbox.link.nonce
        if all(entry[1] != nonce for entry in self._unknown):
            return
        for entry in [entry for entry in self._unknown if entry[1] == nonce]:
            sender, _, message, came = entry
            if sender == inbox.link.name:
                self._arrived(inbox, message, came)
            else:
                self._discard(sender, message, f"its nonce is {inbox.link.name!r}'s link's")
            self._unknown.remove(entry)  # (after: at least once, as _file_arriving)

    def _discard(self, sender: str, message: bytes, why: str) -> None:
        self._discarded += 1
        logger.debug("discarded notification %r from %s: %s", message[:80], sender, why)

    def _close(self, link: PeerLink) -> None:
        """Close a link: remove its metadata, discard what it kept, spend its nonce."""
        self.links.close(link)
        self._closed_link(link)

    def _closed_link(self, link: PeerLink) -> None:
        """(:meth:`_close`, once the link is closed.) Its nonce is spent first: from then on
        no notification of it counts, whatever an interrupt leaves of the rest (mended)."""
        self._spent[link.nonce] = str(link.name)
        self._relinked.discard(link)
        try:
            inbox = self._inboxes.pop(link.nonce, None)
            count = 0 if inbox is None else sum(map(len, inbox.early.values()))
            self._early -= count
        except BaseException:  # (as in _fresh)
            self._early_stale = True
            raise
        self._linked.pop(link.nonce, None)
        if count:
            self._discarded += count
            logger.info("sender %s: %d notification(s) no job claimed were discarded with its "
                        "link", link.name, count)

    def _owes(self, link: PeerLink) -> bool:
        return self._owed.get(link, 0) > 0

    def _watch_links(self, now: float) -> None:
        """Check links still connecting; probe silent senders that owe jobs; close lost ones."""
        for link in self.links.open_links():
            if link.state is LinkState.CONNECTING:
                self.links.recheck(link)
            if (link.state is LinkState.CONNECTED and self.peer_timeout is not None
                    and now - max(link.quiet_since, link.probed_at) >= self.peer_timeout
                    and self._owes(link)):
                self.links.probe(link)
            if link.state is LinkState.LOST:
                self._close(link)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Cut every sender off, fail what they owed, release the cache. Idempotent.

        It waits for nothing NIXL does (what a sender owed fails at once); ``timeout`` bounds
        its wait for another thread's call to let go of the receiver (None: as long as it
        takes), as a tier's shutdown does. From then on nothing polls this agent, and on UCX a
        write to it ends only while the receiving agent is polled too: a sender's write still
        in flight stays running (its drain and shutdown time out, its blocks stay in use)
        until this process exits. Shut a receiver down once its senders' writes are over, or
        as its process ends.

        Raises:
            DrainTimeout: another thread's call held the receiver past the deadline; nothing
                changed: call shutdown again.
            ValueError: ``timeout`` is not None nor a number of seconds.
        """
        timeout = check_timeout(timeout)
        if not take(self._lock, None if timeout is None else time.monotonic() + timeout):
            raise DrainTimeout("shutdown (another thread held the receiver past the deadline; "
                               "call shutdown again)", [], self._noun)
        try:
            if self._closed:
                return
            with _Mending(self):
                for link in self.links.open_links():
                    self._shut_off.add(link)  # (what it owed fails saying so)
                    self._close(link)
                self._poll(closing=True)  # also lets UCX retire a lost sender
                self._deregister()
                self._closed = self._let_go = True
        finally:
            self._lock.release()

    def _deregister(self) -> None:
        """(shutdown) Release NIXL's registration of the cache, best effort, as a tier's
        cleanup: one that raises is a leak, kept; one an interrupt cut short once it was
        taken is one too (whether NIXL released it is unknown, so it is not asked again:
        twice would be a misuse)."""
        registration = None
        try:
            registration, self._registration = self._registration, None
            if registration is not None:
                self.agent.deregister_memory(registration)
        except Exception as error:
            self._leaks.append(("deregister_memory", f"{type(error).__name__}: {error}"))
            logger.warning("shutdown: deregister_memory of the receiver's cache raised: "
                           "%s: %s", type(error).__name__, error)
        except BaseException:
            if registration is not None:
                self._leaks.append(("deregister_memory", "cut short by an interrupt: whether "
                                    "NIXL released it is unknown, so it is not asked again"))
            raise

    def state_of(self, job_id: int) -> ReceiveState | None:
        """The state of an expected job, or None once published."""
        expected = self._expected.get(job_id)
        return None if expected is None else expected.state

    def _publish(self, expected: _Expected) -> None:
        """Publish a job that arrived or failed. Its result is queued while its record is kept
        (it is handed out once the record is gone), and the record goes last: an interrupt
        anywhere leaves it, PUBLISHED or not, for :meth:`_mend` to finish."""
        self.machine.fire(expected, ReceiveEvent.PUBLISH, PeerAnswer.OK)
        self._books.publish(self._result(expected))
        self._hand_back(expected)
        for block in expected.job.block_ids:
            self._writing.pop(block, None)
        owed = self._owed.get(expected.link, 0) - 1
        if owed > 0:
            self._owed[expected.link] = owed
        else:
            self._owed.pop(expected.link, None)
        inbox = self._inboxes.get(expected.link.nonce)
        if inbox is not None:  # a later job of the same id must not inherit its wait
            inbox.waiting.pop(notification_for(expected.link.nonce, expected.job.job_id,
                                               expected.job.block_ids), None)
        del self._expected[expected.job.job_id]

    def _result(self, expected: _Expected) -> JobResult:
        success = bool(expected.success)
        return JobResult(expected.job.job_id, success,
                         len(expected.job.block_ids) * self.block_bytes if success else 0,
                         expected.finished_at - expected.started_at,
                         None if success else expected.reason)

    def _hand_back(self, expected: _Expected) -> None:
        """The job's blocks go back to the engine, whatever its outcome: a notification kept
        from before this no longer says what they hold (:meth:`_fresh`)."""
        self._handbacks += 1
        handbacks, handed_back = self._handbacks, self._handed_back
        for block in expected.job.block_ids:
            handed_back[block] = handbacks

    def _mend(self) -> None:
        """An interrupt (a signal handler's, which may land between any two statements) went
        through a call that changes the books: put them right before this call goes on.

        A link whose connect it cut short is taken up (CONNECTING if NIXL had loaded its
        metadata, then checked by the polls), with its inbox; a link it closed without the
        rest of its close is finished. A job it left PUBLISHED is published (its result
        queued if it was not, its blocks handed back once more: a notification kept from
        before is then stale, on the safe side) and its record dropped. What is kept per job
        (the blocks being written, what each link owes, which notification each job waits
        for) is made again from the records; a job whose expect it cut short takes a fresh
        copy of its notification that came first, as the expect would have; an outcome whose
        latch it cut short is latched by the actions the table declares on the edge into the
        job's state (ARRIVED a success, PEER_LOST or MISDIRECTED a failure); notifications
        left in the unknown store with an open link's nonce are that link's. The
        notifications taken from NIXL and not yet filed are filed by the next take."""
        self._mend_links()
        self._mend_records()
        self._writing = {block: expected.job_id for expected in self._expected.values()
                         for block in expected.job.block_ids}
        self._owed = dict(collections.Counter(
            expected.link for expected in self._expected.values()))
        for inbox in self._inboxes.values():
            inbox.waiting = {}
        for expected in list(self._expected.values()):
            if (expected.state is ReceiveState.EXPECTING
                    and expected.link.nonce in self._inboxes):
                self._claim(expected)
        for inbox in list(self._inboxes.values()):
            self._adopt(inbox)
        self._recount_early()
        self._damaged = False

    def _mend_links(self) -> None:
        """(:meth:`_mend`) The links a connect or a close left half made."""
        self.links.mend()
        for link in self.links.open_links():
            if link.nonce not in self._inboxes:  # (a connect cut short before its inbox)
                self._linked[link.nonce] = str(link.name)
                self._inboxes[link.nonce] = _Inbox(link)
        for inbox in list(self._inboxes.values()):
            if inbox.link.state in PEER_LINK.final:  # (a close cut short after NIXL's call)
                self._closed_link(inbox.link)

    def _mend_records(self) -> None:
        """(:meth:`_mend`) The outcomes and publications an interrupt left half made: a job
        that left EXPECTING with its outcome not latched whole (a success not set, a failure
        without its reason) has the actions of the edge that took it there run again, as the
        machine's table declares them (the detail the fire carried is lost: what says so)."""
        entered = {step.dest: (answer, step.actions)
                   for answers in self.machine.table[ReceiveState.EXPECTING].values()
                   for answer, step in answers.items() if step.dest is not ReceiveState.EXPECTING}
        for expected in self._expected.values():
            latched = expected.success is True or (
                expected.success is False and expected.reason is not None)
            if expected.state in entered and not latched:
                answer, actions = entered[expected.state]
                expected.success = None
                for action in actions:
                    action(expected, answer, f"sender {expected.peer}: job {expected.job_id} "
                           f"went to {expected.state.name}; what said why was cut short by an "
                           "interrupt")
        queued = {result.job_id for result in self._books.results}
        for expected in list(self._expected.values()):
            if expected.state is ReceiveState.PUBLISHED:
                if expected.job_id not in queued:
                    self._books.publish(self._result(expected))
                self._hand_back(expected)
                del self._expected[expected.job_id]


def _block_descs(descs: object) -> list[tuple[int, int, int]]:
    """A receiver's block descriptors (:meth:`PeerReceiver.block_descs`), checked: a
    non-empty list or tuple of (address, length, device) int triples."""
    if not isinstance(descs, list | tuple) or not descs:
        raise ValueError(f"receiver_blocks must be a non-empty list of (address, length, "
                         f"device) descriptors (PeerReceiver.block_descs()), got {descs!r}")
    checked = []
    for index, desc in enumerate(descs):
        if (not isinstance(desc, list | tuple) or len(desc) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in desc)):
            raise ValueError(f"receiver_blocks[{index}] must be an (address, length, device) "
                             f"triple of ints, got {desc!r}")
        checked.append((desc[0], desc[1], desc[2]))
    return checked


class _Receiver:
    """Who the sender writes to: the link to the receiver (the last one connected) and the
    descriptors of the receiver's blocks. The sender changes them as links come and go; its
    remote side and its books read them, and hold no reference to the sender itself."""

    __slots__ = ("blocks", "link")

    def __init__(self) -> None:
        self.link: PeerLink | None = None
        self.blocks: list[tuple[int, int, int]] = []

    @property
    def peer(self) -> str | None:
        """The receiver's agent name, while its link is not over; else None."""
        link = self.link
        return None if link is None or link.state in PEER_LINK.final else link.name

    def index(self, key: bytes | str) -> int:
        """The receiver block a key names."""
        text = key.decode() if isinstance(key, bytes) else key
        if not isinstance(text, str) or not text.isdigit():
            raise ValueError(f"a peer key is the receiver's block index, got {key!r}")
        index = int(text)
        if self.blocks and index >= len(self.blocks):
            raise ValueError(f"receiver block {index} is out of range [0, {len(self.blocks)})")
        return index


class _PeerMemory:
    """The sender's remote side: the receiver's blocks, named by the job's keys."""

    mem_type = "DRAM"

    def __init__(self, receiver: _Receiver) -> None:
        self._receiver = receiver

    @property
    def peer(self) -> str | None:
        return self._receiver.peer

    def open(self, transfer: Transfer) -> list[tuple[int, int, int, str]]:
        receiver = self._receiver
        if receiver.peer is None:
            raise ConnectionError("no receiver is connected")
        return [(*receiver.blocks[receiver.index(key)], "") for key in transfer.job.keys]

    def notification(self, transfer: Transfer) -> bytes:
        receiver, keys = self._receiver, transfer.job.keys
        if receiver.link is None:
            raise ConnectionError("no receiver is connected")
        return notification_for(receiver.link.nonce, transfer.job.job_id,
                                [receiver.index(k) for k in keys])

    def commit(self, transfer: Transfer) -> None:
        """The receiver learns of the write from the notification; nothing to commit."""

    def close(self, transfer: Transfer) -> list[Leak]:
        return []


class PeerSender(SecondaryTier):
    """The sending engine's side: writes primary blocks into a receiver's KV cache.

    A job's ``keys`` name the receiver's block indices (``"3"`` is the receiver's block 3);
    ``block_ids`` are the sender's primary blocks, pinned by its parent. The notification names
    the link's nonce and the job id, which the receiver :meth:`~PeerReceiver.expect`\\ s.

    Each link has a nonce of its own, drawn when the previous link closed (module docstring):
    give the receiver :meth:`metadata` for each link, taken after the previous link closed.

    The link to the receiver (:data:`~kvfsm.peer_link.PEER_LINK`) decides what may be posted:
    only a CONNECTED receiver is written to. A write that fails with NIXL's
    ``NIXL_ERR_REMOTE_DISCONNECT`` loses the link: its job publishes its failure as any failed
    transfer does, later jobs are refused (:class:`~kvfsm.peer_link.PeerNotConnected`), and once
    no transfer to the receiver is unpublished its metadata is removed (CLOSED).

    As soon as a write fails with the disconnect, before a receiver's metadata is removed, and at
    shutdown, the sender lets its UCX worker progress once (``get_new_notifs``). Measured on
    NIXL 1.5.1: a sender whose receiver was killed before taking the notification of a write,
    and which then posted a write that failed with the disconnect, aborted when its agent was
    destroyed (UCX assertion ``ucs_arbiter_group_is_empty``), whether or not its handles were
    released and the receiver removed first; one ``get_new_notifs`` call after the failed write
    avoided it in every trial.
    The sender expects no notifications (a receiver's probes are the only ones it gets), so it
    drops what that call returns: a sender is refused an agent a receiver not shut down reads
    (and a receiver one any peer side uses).

    Args:
        primary: the sender's KV cache.
        agent: a NIXL agent with the UCX backend.
        policy: retry bounds (:class:`~kvfsm.policy.RetryPolicy`).
    """

    def __init__(self, primary: torch.Tensor, *, agent: Any,
                 policy: RetryPolicy | None = None, poll_interval: float = 0.0002) -> None:
        check_agent(agent)  # (before the links are made on it)
        #: True once shutdown made its last call of the agent that takes notifications: none
        #: is made from then on
        self._let_go = False
        _made_on(agent, self, lambda: self._made(primary, agent, policy, poll_interval))

    def _made(self, primary: torch.Tensor, agent: Any, policy: RetryPolicy | None,
              poll_interval: float) -> None:
        """(``__init__``, the agent claimed.)"""
        self.links = PeerLinks(agent, self.leak_record)
        self._receiver = _Receiver()
        #: the nonce of the link being made, or open; a new one is drawn when it closes
        self._nonce = new_nonce()
        super().__init__(primary, agent=agent, remote=_PeerMemory(self._receiver),
                         poll_interval=poll_interval, policy=policy)
        self._runner.on_final.append(
            functools.partial(_heard, self._receiver, self.links, self._progress))

    @property
    def link(self) -> PeerLink | None:
        """The link to the receiver (the last one connected), or None before the first."""
        return self._receiver.link

    @property
    def receiver_blocks(self) -> list[tuple[int, int, int]]:
        """The descriptors of the receiver's blocks, as :meth:`connect` was given them."""
        return self._receiver.blocks

    @property
    def peer(self) -> str | None:
        """The receiver's agent name, while its link is not over; else None."""
        return self._receiver.peer

    def metadata(self) -> bytes:
        """What the receiver's :meth:`PeerReceiver.connect` takes: this agent's metadata and the
        nonce of this sender's link (the open one, or else the next one :meth:`connect`
        makes).

        The nonce changes when the link closes, so take this again for each link; the
        receiver refuses the metadata of a link that closed.
        """
        with self._lock:
            agent_metadata = self.agent.get_agent_metadata()  # type: ignore[attr-defined]
            return b"kvfsm-sender:" + self._nonce.encode() + b":" + bytes(agent_metadata)

    def connect(self, receiver_metadata: bytes, receiver_blocks: Sequence[tuple[int, int, int]]
                ) -> str:
        """Load the receiver's metadata and the descriptors of its blocks; returns its name.

        Raises:
            ValueError: ``receiver_blocks`` is not a non-empty list of (address, length,
                device) int triples, or a block's length is not this sender's block size
                (every write to it would fail in NIXL); nothing changed.
            kvfsm.peer_link.PeerLinkError: NIXL refused the metadata, or lost it at once; or
                the link to the previous receiver is not over yet (forget it first).
            TierClosedError: the sender is shut down.
        """
        blocks = _block_descs(receiver_blocks)  # before anything changes
        for index, (_, length, _) in enumerate(blocks):
            if length != self.block_bytes:
                raise ValueError(
                    f"receiver_blocks[{index}] is {length} bytes long, this sender's blocks "
                    f"{self.block_bytes}: the receiver's cache has another block size (shape "
                    "or dtype); give both caches the same bytes a block")
        with self._lock:
            if self._closed or self._closing:
                raise TierClosedError("PeerSender is shut down; no receiver is connected")
            if self.link is not None and self.link.state not in PEER_LINK.final:
                raise PeerLinkError(f"already linked to receiver {self.link.name!r} "
                                    f"({self.link.state.name}); forget_peer() first")
            link = self._receiver.link = self.links.connect(receiver_metadata, self._nonce)
            self._receiver.blocks = blocks
            return str(link.name)

    def link_state(self) -> LinkState:
        """The state of the link to the receiver (UNKNOWN before the first connect)."""
        return LinkState.UNKNOWN if self.link is None else self.link.state

    def forget_peer(self) -> None:
        """Close the link to the receiver: remove its metadata. Later jobs are refused.

        Raises:
            RuntimeError: transfers to it are not yet published (drain or cancel them first),
                or quarantined ones hold their handles to it for good: its metadata is never
                removed under a transfer that may still run, nor under a held handle.
        """
        with self._lock:
            link = self.link
            if link is None or link.state in PEER_LINK.final:
                return
            unpublished = len(self._runner.records)
            if unpublished:
                raise RuntimeError(f"receiver {link.name!r}: {unpublished} transfer(s) not yet "
                                   "published; drain_jobs() or cancel() them first")
            held = self._held()
            if held:
                raise RuntimeError(f"receiver {link.name!r}: {held} quarantined transfer(s) "
                                   "hold their handles to it for good (stats()['quarantined'])")
            self._close_link(link)

    def get_finished_jobs(self) -> list[JobResult]:
        """One poll round (the transfers the poll schedule picks, and those with a call due);
        settle the link; the results published since."""
        if handing_out(self):  # (a drain's poll settled it)
            return marked_results(self._books)
        with self._lock:
            if not self._thread_polls():  # (else its progress thread polls)
                self._poll()
            self._settle_link()
        # taken once the lock is let go of (safe without it: Books): a Ctrl-C as the link is
        # settled, or as the lock's release returns, finds them still published
        return self._books.take_results()

    _drained_hand_out = get_finished_jobs  # (JobSide._drain_poll)

    def _drained(self) -> None:
        """After a drain's poll, the link settled, as :meth:`get_finished_jobs` settles it."""
        self._settle_link()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Fail every unfinished job, wait for NIXL, release everything, close the link (but
        not while a quarantined transfer holds a handle to the receiver, or may still run:
        its metadata stays, and the link with it). Within ``timeout`` as the tier's; if
        another thread's call holds the tier past it, DrainTimeout with the link left open:
        call shutdown again."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        super().shutdown(timeout)  # raises DrainTimeout while NIXL still runs a transfer
        if not take(self._lock, deadline):
            raise DrainTimeout("shutdown (every job is published, but another thread held the "
                               "tier's lock past the deadline before the link was closed; "
                               "call shutdown again)", [])
        try:
            link = self.link
            if link is not None and link.state not in PEER_LINK.final and not self._held():
                self._close_link(link)
            else:
                self._progress()
            self._let_go = True  # (the agent's last call made: another side may have it)
        finally:
            self._lock.release()

    def stats(self) -> dict[str, Any]:
        """The tier's stats, with the link's state and its leaks counted among the leaks."""
        stats = super().stats()
        stats["leaks"] += self.links.leak_count
        leaked = stats["leaked"] + [(-1, leak) for _, leak in self.links.leaks()]
        stats["leaked"] = leaked[max(0, len(leaked) - self.leak_record):]  # (the last ones)
        stats["link"] = self.link_state().name
        return stats

    def remote_index(self, key: bytes | str) -> int:
        """The receiver block a key names."""
        return self._receiver.index(key)

    def remote_name(self, key: bytes | str) -> str:
        """A key's receiver block, as text."""
        return str(self.remote_index(key))

    def lookup(self, key: bytes | str) -> Lookup:
        """MISS, always: a sender cannot vouch for what the receiver's blocks hold once its
        write is over (the receiver hands them back to its engine, which overwrites them, or
        it restarts with a cache of its own), so a write never makes its key HIT. (A HIT would
        also have a cascading store or a vLLM store skip the write.)

        Raises:
            TierClosedError: the sender was shut down.
            ValueError: ``key`` is not a key of a receiver block.
        """
        super().lookup(key)  # (its checks)
        return Lookup.MISS

    def verdict(self, key: bytes | str) -> Lookup | None:
        """MISS, always (:meth:`lookup` says why)."""
        super().verdict(key)  # (its checks)
        return Lookup.MISS

    def _probe(self, name: str) -> Lookup:
        return Lookup.MISS  # a peer is written to, never looked up

    def _submit(self, job: TransferJob, *, load: bool) -> None:
        if load:
            raise InvalidJobError(f"job {job.job_id}: a peer sender only writes; the receiver "
                                  "expects the job instead")
        link = self.link
        if link is None or link.state is not LinkState.CONNECTED:
            why = ("no receiver is connected" if link is None
                   else f"receiver {link.name!r} is {link.state.name}"
                   + (f" ({link.error})" if link.error else ""))
            raise PeerNotConnected(f"job {getattr(job, 'job_id', job)!r} refused: {why}; "
                                   "nothing was posted")
        super()._submit(job, load=load)

    def _settle_link(self) -> None:
        """A connecting link is checked again; a lost one is closed once nothing runs to it."""
        link = self.link
        if link is None:
            return
        if link.state is LinkState.CONNECTING:
            self.links.recheck(link)
        if link.state is LinkState.LOST and not self._runner.records and not self._held():
            self._close_link(link)

    def _held(self) -> int:
        """The quarantined transfers holding their handles to the receiver for good (NIXL may
        still run some of them): its metadata is not removed under them."""
        return len(self._runner.quarantined)

    def _close_link(self, link: PeerLink) -> None:
        self._progress()
        self.links.close(link)
        self._nonce = new_nonce()  # the next link is told apart from this one

    def _progress(self) -> None:
        """Let the UCX worker progress once (see the class docstring); best effort; not once
        shutdown let go of the agent (another side may have it)."""
        if self._let_go:
            return
        try:
            self.agent.get_new_notifs()  # type: ignore[attr-defined]
        except Exception as error:
            logger.warning("get_new_notifs raised while closing a peer link: %s", error)


def _heard(receiver: _Receiver, links: PeerLinks, progress: Callable[[], None],
           transfer: Transfer, result: JobResult) -> None:
    """A write was published: one whose last error was one of
    :data:`~kvfsm.machines.peer_link.LINK_LOST_BY` (by type) loses the link, and the sender's
    UCX worker progresses once at once (``progress``): what the failed write left queued is
    retired now, not only when the link is closed, so a sender dropped or left at exit
    without another poll does not abort as its agent is destroyed (the class docstring)."""
    link = receiver.link
    reason = transfer.reason
    # the failure that ended the write (latched), or an error NIXL gave it afterwards (a
    # cancelled write's state check); a release retried later does not hide either
    lost = loses_link(reason.error_type if reason is not None else None) or loses_link(
        transfer.error_type)
    if (transfer.success is False and link is not None and lost
            and link.state in (LinkState.CONNECTED, LinkState.LOST)):
        links.disconnected(link, transfer.error)
        progress()
