"""The link to one peer agent: metadata exchange, and a peer that disappears, as a machine.

Before two engines can move KV blocks over NIXL's UCX backend, each loads the other's agent
metadata (``add_remote_agent``), and NIXL must say it holds it (``check_remote_metadata``). A
peer can later disappear: its process ends, its connection breaks. Then NIXL answers
``NIXL_ERR_REMOTE_DISCONNECT`` to a write posted to it, or to a notification sent to it, and the
peer's metadata is removed again (``remove_remote_agent``). Each of these is one NIXL call whose
answer decides what the link may do next, so a link is a third machine, :data:`PEER_LINK`,
declared with the same tools as the transfer and receive machines (compiled engine, diagram,
table explorer, transition coverage)::

    UNKNOWN --add[ok]--> CONNECTING --check[present]--> CONNECTED --remove--> CLOSED
    UNKNOWN --add[raised]--> REFUSED
    CONNECTING --check[absent]--> CONNECTING            (not yet: checked again at the next poll)
    CONNECTING --check[raised]--> LOST
    CONNECTED --disconnected[gone] | probe[gone]--> LOST --remove--> CLOSED
    CONNECTED --probe[ok]--> CONNECTED, --probe[raised]--> CONNECTED (an error is not a loss)

Decisions, and why:

* **Only a CONNECTED link carries work.** A sender refuses to post to a peer whose link is not
  CONNECTED (:class:`PeerNotConnected`, raised before anything is registered), and a receiver
  refuses to expect a job from one. So nothing is ever owed on a link that is CONNECTING, LOST,
  CLOSED or REFUSED.
* **LOST is entered on evidence, never on a clock.** The evidence is NIXL's
  ``NIXL_ERR_REMOTE_DISCONNECT``: a write that failed with it (the sender's ``disconnected``
  event), or a probe notification that raised it (the receiver's ``probe``). A probe that fails
  another way, or a peer that is merely slow, leaves the link CONNECTED. A raised
  ``check_remote_metadata`` while connecting also loses the link: its metadata may be half
  loaded, and LOST is the state that removes it.
* **``check_remote_metadata`` is not a liveness test.** It only says whether this agent holds the
  peer's metadata: measured on NIXL 1.5.1, it kept answering True for a peer whose process was
  killed. That is why it is only asked while CONNECTING, and liveness comes from ``probe``.
* **LOST is not yet CLOSED.** On entering LOST, what the peer owed fails: a receiver publishes
  failures for the jobs it expected from it; a sender refuses new jobs, and its transfers already
  posted end as NIXL answers them (a transfer is never released while it may run). Once nothing
  is in flight to the peer, ``remove`` removes its metadata: CLOSED.
* **``remove`` is best effort.** A ``remove_remote_agent`` that raises is recorded as a leak (NIXL
  may keep the peer's metadata) and the link is CLOSED anyway: nothing is posted to a closed
  link, so a retry would protect nothing.
* **REFUSED and CLOSED are final.** A peer that comes back is a new link, made by a new
  ``connect``.
* **A link has a nonce, the sender's.** A sender draws a random one (:func:`new_nonce`, 128
  bits from :mod:`secrets`) whenever its link closes, so each of its links has its own, and
  writes it into every notification it sends over the link; the receiver learns it with the
  sender's metadata. So a notification names the link it was sent over, not only the sender's
  agent name, which a reconnecting sender or a new process keeps (:mod:`kvfsm.peer` says how
  the receiver uses it).

The machine never makes a NIXL call itself: :class:`PeerLinks` makes them and fires the events
with what NIXL answered; the peer sender and receiver (:mod:`kvfsm.peer`) decide *when*
(a receiver probes a silent peer; a sender removes a lost peer once its transfers are over).
"""

from __future__ import annotations

import enum
import secrets
import time
from typing import Any

from kvfsm.engine import Declaration
from kvfsm.tiers.base import InvalidJobError
from kvfsm.transfer import Leak

__all__ = [
    "DISCONNECTED",
    "PEER_LINK",
    "PROBE_MESSAGE",
    "LinkAnswer",
    "LinkState",
    "PeerLink",
    "PeerLinkError",
    "PeerLinks",
    "PeerNotConnected",
    "is_disconnect",
    "new_nonce",
]

#: the NIXL status a call to a peer that went away fails with
DISCONNECTED = "NIXL_ERR_REMOTE_DISCONNECT"
#: the notification a receiver sends a silent sender to find out whether it is still there
PROBE_MESSAGE = b"kvfsm-probe"


class LinkState(enum.Enum):
    """Where the link to one peer agent is."""

    __hash__ = object.__hash__

    #: nothing is known of the peer yet
    UNKNOWN = "unknown"
    #: its metadata was given to NIXL; NIXL has not yet said it holds it
    CONNECTING = "connecting"
    #: NIXL holds its metadata: jobs may be posted to it, or expected from it
    CONNECTED = "connected"
    #: NIXL answered that the peer is gone: what it owed fails, its metadata is to be removed
    LOST = "lost"
    #: its metadata was removed (or its removal recorded as a leak): the link is over
    CLOSED = "closed"
    #: ``add_remote_agent`` refused its metadata: nothing was loaded
    REFUSED = "refused"


class LinkAnswer(enum.Enum):
    """What NIXL answered a call about a peer."""

    __hash__ = object.__hash__

    #: the call returned
    OK = "OK"
    #: the call raised (anything but a disconnect)
    RAISED = "RAISED"
    #: ``check_remote_metadata`` answered True
    TRUE = "TRUE"
    #: ``check_remote_metadata`` answered False
    FALSE = "FALSE"
    #: the call failed with NIXL_ERR_REMOTE_DISCONNECT: the peer is gone
    DISCONNECTED = "DISCONNECTED"


def _describe(answer: LinkAnswer, detail: Any) -> str:
    if isinstance(detail, BaseException):
        return f"{type(detail).__name__}: {detail}"
    return answer.value if detail is None else str(detail)


def note_error(link: Any, answer: LinkAnswer, detail: Any) -> None:
    """Keep what NIXL answered; the link stays where the table put it."""
    link.error = _describe(answer, detail)


def note_lost(link: Any, answer: LinkAnswer, detail: Any) -> None:
    """The link is over, as a failure: keep why and when."""
    link.success = False
    link.error = _describe(answer, detail)
    link.finished_at = time.monotonic()


def note_leak(link: Any, answer: LinkAnswer, detail: Any) -> None:
    """``remove_remote_agent`` raised: NIXL may keep the peer's metadata."""
    link.leaks = (*link.leaks, Leak("remove_remote_agent", _describe(answer, detail)))


L = LinkState

#: The link to one peer agent, declared once.
PEER_LINK: Declaration[LinkState, LinkAnswer] = Declaration(
    "peer_link",
    states=LinkState,
    initial=LinkState.UNKNOWN,
    answers={"add": [LinkAnswer.OK, LinkAnswer.RAISED],
             "check": [LinkAnswer.TRUE, LinkAnswer.FALSE, LinkAnswer.RAISED],
             "probe": [LinkAnswer.OK, LinkAnswer.RAISED, LinkAnswer.DISCONNECTED],
             "disconnected": [LinkAnswer.DISCONNECTED],
             "remove": [LinkAnswer.OK, LinkAnswer.RAISED]},
    guards={"ok": [LinkAnswer.OK], "raised": [LinkAnswer.RAISED],
            "present": [LinkAnswer.TRUE], "absent": [LinkAnswer.FALSE],
            "gone": [LinkAnswer.DISCONNECTED]},
    actions={"note_error": note_error, "note_lost": note_lost, "note_leak": note_leak},
    transitions=[
        {"trigger": "add", "source": L.UNKNOWN, "dest": L.CONNECTING, "conditions": "ok"},
        {"trigger": "add", "source": L.UNKNOWN, "dest": L.REFUSED, "conditions": "raised",
         "after": "note_lost"},

        {"trigger": "check", "source": L.CONNECTING, "dest": L.CONNECTED,
         "conditions": "present"},
        {"trigger": "check", "source": L.CONNECTING, "dest": L.CONNECTING,
         "conditions": "absent"},
        {"trigger": "check", "source": L.CONNECTING, "dest": L.LOST, "conditions": "raised",
         "after": "note_lost"},
        {"trigger": "remove", "source": L.CONNECTING, "dest": L.CLOSED, "conditions": "ok"},
        {"trigger": "remove", "source": L.CONNECTING, "dest": L.CLOSED, "conditions": "raised",
         "after": "note_leak"},

        {"trigger": "probe", "source": L.CONNECTED, "dest": L.CONNECTED, "conditions": "ok"},
        {"trigger": "probe", "source": L.CONNECTED, "dest": L.CONNECTED,
         "conditions": "raised", "after": "note_error"},
        {"trigger": "probe", "source": L.CONNECTED, "dest": L.LOST, "conditions": "gone",
         "after": "note_lost"},
        {"trigger": "disconnected", "source": L.CONNECTED, "dest": L.LOST,
         "conditions": "gone", "after": "note_lost"},
        {"trigger": "remove", "source": L.CONNECTED, "dest": L.CLOSED, "conditions": "ok"},
        {"trigger": "remove", "source": L.CONNECTED, "dest": L.CLOSED, "conditions": "raised",
         "after": "note_leak"},

        {"trigger": "disconnected", "source": L.LOST, "dest": L.LOST, "conditions": "gone"},
        {"trigger": "remove", "source": L.LOST, "dest": L.CLOSED, "conditions": "ok"},
        {"trigger": "remove", "source": L.LOST, "dest": L.CLOSED, "conditions": "raised",
         "after": "note_leak"},
    ],
    final=(LinkState.CLOSED, LinkState.REFUSED),
    failure_states=(LinkState.LOST, LinkState.REFUSED),
    calls={"add": "add_remote_agent", "check": "check_remote_metadata", "probe": "send_notif",
           # what a write answered: its transfer, or the state check of it
           "disconnected": ("transfer", "check_xfer_state"),
           "remove": "remove_remote_agent"},
)


class PeerLinkError(ConnectionError):
    """NIXL refused a peer's metadata, or lost it while connecting; the link says why."""


class PeerNotConnected(InvalidJobError):
    """A job names a peer whose link is not CONNECTED; nothing was registered or posted, and
    no result will be published for it."""


def new_nonce() -> str:
    """A fresh link nonce: 32 hex digits, drawn from :mod:`secrets` (never the same twice in
    practice, across links, processes and hosts)."""
    return secrets.token_hex(16)


def is_disconnect(error: object) -> bool:
    """True when a NIXL error (an exception, or a transfer's recorded error) is a disconnect."""
    return DISCONNECTED in str(error)


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

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.machine = PEER_LINK.compile(trace=True)
        #: every link made, by peer name (a later connect of the same name replaces a closed one)
        self.links: dict[str, PeerLink] = {}

    def get(self, name: str) -> PeerLink | None:
        """The link to ``name``, or None if it was never connected."""
        return self.links.get(name)

    def state_of(self, name: str) -> LinkState:
        """The state of the link to ``name`` (UNKNOWN if it was never connected)."""
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
            self.machine.fire(link, "add", LinkAnswer.RAISED, error)
            raise PeerLinkError(f"add_remote_agent refused the peer's metadata: "
                                f"{link.error}") from error
        known = self.links.get(name)
        if known is not None and known.state not in PEER_LINK.final:
            # the metadata was loaded again over an open link: the link stays as it was
            raise PeerLinkError(f"peer {name!r} is already linked ({known.state.name}); "
                                "forget it first")
        link.name = name
        self.links[name] = link
        self.machine.fire(link, "add", LinkAnswer.OK)
        self.recheck(link)
        if link.state is LinkState.LOST:
            self.close(link)
            raise PeerLinkError(f"peer {name!r}: check_remote_metadata raised: {link.error}")
        return link

    def recheck(self, link: PeerLink) -> None:
        """Ask NIXL whether it holds a CONNECTING link's metadata; fire ``check``."""
        try:
            held = self.agent.check_remote_metadata(link.name)
        except Exception as error:
            self.machine.fire(link, "check", LinkAnswer.RAISED, error)
            return
        self.machine.fire(link, "check", LinkAnswer.TRUE if held else LinkAnswer.FALSE)
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
            answer = LinkAnswer.DISCONNECTED if is_disconnect(error) else LinkAnswer.RAISED
            self.machine.fire(link, "probe", answer, error)
            return
        self.machine.fire(link, "probe", LinkAnswer.OK)

    def disconnected(self, link: PeerLink, detail: Any) -> None:
        """A write to the peer failed with a disconnect; fire ``disconnected``."""
        self.machine.fire(link, "disconnected", LinkAnswer.DISCONNECTED, detail)

    def close(self, link: PeerLink) -> None:
        """Remove the peer's metadata; fire ``remove`` (a raise is recorded as a leak)."""
        try:
            self.agent.remove_remote_agent(link.name)
        except Exception as error:
            self.machine.fire(link, "remove", LinkAnswer.RAISED, error)
            return
        self.machine.fire(link, "remove", LinkAnswer.OK)

    def leaks(self) -> list[tuple[str, Leak]]:
        """Every ``remove_remote_agent`` that raised, with its peer's name."""
        return [(str(link.name), leak) for link in self.links.values() for leak in link.leaks]
