"""The links of one agent to its peers: the NIXL calls that move the link machine.

The rules of a link (states, events, answers, the table, and which NIXL errors mean the peer is
gone) are declared in :mod:`kvfsm.machines.peer_link`, whose docstring says why; this module
re-exports them under the names they had first, and holds what runs them: :class:`PeerLinks`
makes each call (``add_remote_agent``, ``check_remote_metadata``, a probe's ``send_notif``,
``remove_remote_agent``), turns what NIXL answered (a return, or an exception, told apart by
its type) into a :class:`LinkAnswer`, and fires the event; :class:`PeerLink` is the record the
machine moves. The peer sender and receiver (:mod:`kvfsm.peer`) decide *when* (a receiver
probes a silent peer; a sender removes a lost peer once its transfers are over).
"""

from __future__ import annotations

import collections
import secrets
import time
from typing import Any

from kvfsm.machines.peer_link import (
    DISCONNECTED,
    LINK_LOST_BY,
    PEER_LINK,
    LinkAnswer,
    LinkEvent,
    LinkState,
    loses_link,
)
from kvfsm.tiers.base import InvalidJobError
from kvfsm.transfer import Leak

__all__ = [
    "DISCONNECTED",
    "LINK_LOST_BY",
    "PEER_LINK",
    "PROBE_MESSAGE",
    "LinkAnswer",
    "LinkEvent",
    "LinkState",
    "PeerLink",
    "PeerLinkError",
    "PeerLinks",
    "PeerNotConnected",
    "is_disconnect",
    "loses_link",
    "new_nonce",
]

#: the notification a receiver sends a silent sender to find out whether it is still there
PROBE_MESSAGE = b"kvfsm-probe"
#: closed links kept for :meth:`PeerLinks.state_of` (older ones are forgotten: UNKNOWN)
CLOSED_KEPT = 64
#: metadata removals that raised kept for ``stats()`` (each counted)
LEAK_RECORD = 256


class PeerLinkError(ConnectionError):
    """NIXL refused a peer's metadata, or lost it while connecting; the link says why."""


class PeerNotConnected(InvalidJobError):
    """A job names a peer whose link is not CONNECTED; nothing was registered or posted, and
    no result will be published for it."""


def new_nonce() -> str:
    """A fresh link nonce: 32 hex digits, drawn from :mod:`secrets` (never the same twice in
    practice, across links, processes and hosts)."""
    return secrets.token_hex(16)


def is_disconnect(error: BaseException | str | None) -> bool:
    """True when a NIXL error (an exception, or its class name as a transfer's ``error_type``
    keeps it) means the peer is gone: :func:`~kvfsm.machines.peer_link.loses_link`, by type."""
    return loses_link(error)


class PeerLink:
    """The record the link machine moves: one peer agent, as this agent knows it."""

    __slots__ = ("error", "finished_at", "leaks", "name", "nonce", "probed_at", "quiet_since",
                 "started_at", "state", "success", "trace")

    def __init__(self, nonce: str = "") -> None:
        self.state = LinkState.UNKNOWN
        #: the peer agent's name, once ``add_remote_agent`` answered it
        self.name: str | None = None
        #: the sender's nonce for this link, carried in each notification sent over it
        self.nonce = nonce
        #: False once the link failed (LOST, REFUSED); it never turns True
        self.success: bool | None = None
        #: what NIXL answered last, when it was an error
        self.error: str | None = None
        self.leaks: tuple[Leak, ...] = ()
        self.started_at = self.finished_at = time.monotonic()
        #: since when the peer has been silent (a receiver's clock; see kvfsm.peer)
        self.quiet_since = self.started_at
        #: when it was last probed
        self.probed_at = 0.0
        self.trace: list[Any] = []

    def __repr__(self) -> str:
        return f"<PeerLink {self.name} {self.state.name}>"


def _peer_name(name: Any) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


class PeerLinks:
    """The links of one agent, by peer name: makes the NIXL calls, fires the link machine.

    Args:
        agent: a NIXL agent (UCX backend).
    """

    def __init__(self, agent: Any, leak_record: int = LEAK_RECORD) -> None:
        self.agent = agent
        self.machine = PEER_LINK.compile(trace=True)
        #: the links made, by peer name (a later connect of the same name replaces a closed
        #: one): every open one, and the last :data:`CLOSED_KEPT` closed
        self.links: dict[str, PeerLink] = {}
        #: every ``remove_remote_agent`` that raised, counted; the last ``leak_record`` kept,
        #: with their peer's name
        self.leak_count = 0
        self._leaked: collections.deque[tuple[str, Leak]] = collections.deque(
            maxlen=leak_record)
        #: the names of the closed links in ``links``, the last closed last
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()

    def get(self, name: str) -> PeerLink | None:
        """The link to ``name``, or None if it was never connected (or closed before the
        last :data:`CLOSED_KEPT` links that closed)."""
        return self.links.get(name)

    def state_of(self, name: str) -> LinkState:
        """The state of the link to ``name`` (UNKNOWN if it was never connected, or closed
        before the last :data:`CLOSED_KEPT` links that closed)."""
        link = self.links.get(name)
        return LinkState.UNKNOWN if link is None else link.state

    def open_links(self) -> list[PeerLink]:
        """The links not yet over (CONNECTING, CONNECTED, LOST)."""
        return [link for link in self.links.values()
                if link.state not in PEER_LINK.final]

    def connect(self, metadata: bytes, nonce: str) -> PeerLink:
        """Load a peer's metadata, then ask NIXL once whether it holds it; the link carries
        ``nonce`` (the sender's, see :func:`new_nonce`).

        Returns the link, CONNECTED or (when NIXL does not hold it yet) CONNECTING; a
        CONNECTING link is checked again by :meth:`recheck`.

        Raises:
            PeerLinkError: ``add_remote_agent`` refused the metadata (REFUSED), or
                ``check_remote_metadata`` raised (LOST, and then CLOSED: its metadata removed);
                or a link to that peer is still open.
        """
        link = PeerLink(nonce)
        try:
            name = _peer_name(self.agent.add_remote_agent(metadata))
        except Exception as error:
            self.machine.fire(link, LinkEvent.ADD, LinkAnswer.RAISED, error)
            raise PeerLinkError(f"add_remote_agent refused the peer's metadata: "
                                f"{link.error}") from error
        known = self.links.get(name)
        if known is not None and known.state not in PEER_LINK.final:
            # the metadata was loaded again over an open link: the link stays as it was
            raise PeerLinkError(f"peer {name!r} is already linked ({known.state.name}); "
                                "forget it first")
        link.name = name
        self._closed.pop(name, None)  # (closed: the new link takes its place)
        self.links[name] = link
        self.machine.fire(link, LinkEvent.ADD, LinkAnswer.OK)
        self.recheck(link)
        if link.state is LinkState.LOST:
            self.close(link)
            raise PeerLinkError(f"peer {name!r}: check_remote_metadata raised: {link.error}")
        return link

    def mend(self) -> None:
        """After an interrupt: a link whose :meth:`connect` it cut short once NIXL loaded the
        peer's metadata (kept, its ``add`` not yet fired) is taken up, CONNECTING: checked
        again by :meth:`recheck`, as a link NIXL does not hold yet."""
        for link in list(self.links.values()):
            if link.state is LinkState.UNKNOWN:
                self.machine.fire(link, LinkEvent.ADD, LinkAnswer.OK)

    def recheck(self, link: PeerLink) -> None:
        """Ask NIXL whether it holds a CONNECTING link's metadata; fire ``check``."""
        try:
            held = self.agent.check_remote_metadata(link.name)
        except Exception as error:
            self.machine.fire(link, LinkEvent.CHECK, LinkAnswer.RAISED, error)
            return
        self.machine.fire(link, LinkEvent.CHECK, LinkAnswer.TRUE if held else LinkAnswer.FALSE)
        if link.state is LinkState.CONNECTED:
            link.quiet_since = time.monotonic()

    def probe(self, link: PeerLink) -> None:
        """Send a CONNECTED peer a probe notification; fire ``probe`` with what NIXL answered.

        A probe on a connection never used before may be accepted although the peer is gone
        (UCX learns it asynchronously); the next probe then fails (measured: 7 ms later).
        """
        link.probed_at = time.monotonic()
        try:
            self.agent.send_notif(link.name, PROBE_MESSAGE)
        except Exception as error:
            answer = LinkAnswer.DISCONNECTED if loses_link(error) else LinkAnswer.RAISED
            self.machine.fire(link, LinkEvent.PROBE, answer, error)
            return
        self.machine.fire(link, LinkEvent.PROBE, LinkAnswer.OK)

    def disconnected(self, link: PeerLink, detail: Any) -> None:
        """A write to the peer failed with a disconnect; fire ``disconnected``."""
        self.machine.fire(link, LinkEvent.DISCONNECTED, LinkAnswer.DISCONNECTED, detail)

    def close(self, link: PeerLink) -> None:
        """Remove the peer's metadata; fire ``remove`` (a raise is recorded as a leak)."""
        leaks = len(link.leaks)
        try:
            try:
                self.agent.remove_remote_agent(link.name)
            except Exception as error:
                self.machine.fire(link, LinkEvent.REMOVE, LinkAnswer.RAISED, error)
                return
            self.machine.fire(link, LinkEvent.REMOVE, LinkAnswer.OK)
        finally:
            self._over(link, link.leaks[leaks:])

    def _over(self, link: PeerLink, leaks: tuple[Leak, ...]) -> None:
        """Record the leaks a close just made; once closed, ``link`` is the last of the
        closed links kept, and the one closed :data:`CLOSED_KEPT` closes before it goes (a
        sender that linked to one receiver after another keeps no more)."""
        name = str(link.name)
        self.leak_count += len(leaks)
        self._leaked.extend((name, leak) for leak in leaks)
        if link.state not in PEER_LINK.final or self.links.get(name) is not link:
            return
        closed = self._closed
        closed[name] = None
        closed.move_to_end(name)
        while len(closed) > CLOSED_KEPT:
            oldest, _ = closed.popitem(last=False)
            kept = self.links.get(oldest)
            if kept is not None and kept.state in PEER_LINK.final:
                del self.links[oldest]

    def leaks(self) -> list[tuple[str, Leak]]:
        """The last ``leak_record`` ``remove_remote_agent`` calls that raised, with their
        peer's name (:attr:`leak_count` counts them all)."""
        return list(self._leaked)
