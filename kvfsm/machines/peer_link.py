"""The link to one peer agent, as a machine: metadata exchange, and a peer that disappears.

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

* **A disconnect is told by its type, never by its text.** Which NIXL errors mean the peer is
  gone is declared here as data, :data:`LINK_LOST_BY`: exception class names. NIXL 1.5.1
  raises ``nixlRemoteDisconnectError`` for ``NIXL_ERR_REMOTE_DISCONNECT`` (and kvfsm's fake
  NIXL an error of that name for that code); a probe that raises one answers DISCONNECTED, and
  a write whose transfer last raised one (its ``error_type``) fires ``disconnected``. An error
  of another type whose message happens to name the status is just an error.

This module is the declaration only. The machine never makes a NIXL call itself:
:class:`kvfsm.peer_link.PeerLinks` makes them and fires the events with what NIXL answered; the
peer sender and receiver (:mod:`kvfsm.peer`) decide *when* (a receiver probes a silent peer; a
sender removes a lost peer once its transfers are over).
"""

from __future__ import annotations

import enum
import time
from typing import Any

from kvfsm.engine import Declaration
from kvfsm.transfer import Leak

__all__ = [
    "DISCONNECTED",
    "LINK_LOST_BY",
    "PEER_LINK",
    "LinkAnswer",
    "LinkEvent",
    "LinkState",
    "loses_link",
]

#: the NIXL status a call to a peer that went away fails with (``str`` of the error NIXL raises)
DISCONNECTED = "NIXL_ERR_REMOTE_DISCONNECT"

#: The coupling with the transfer machine and NIXL: the errors that mean the peer is gone, by
#: the exception's class name. A probe that raises one loses the link, and so does a write
#: whose transfer failed with one (its record's ``error_type``); any other error does not,
#: whatever its text says.
LINK_LOST_BY: frozenset[str] = frozenset({"nixlRemoteDisconnectError"})


def loses_link(error: BaseException | str | None) -> bool:
    """True when ``error`` (an exception, or an exception's class name as a record keeps it)
    is one of :data:`LINK_LOST_BY`."""
    name = type(error).__name__ if isinstance(error, BaseException) else error
    return name in LINK_LOST_BY


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


class LinkEvent(enum.StrEnum):
    """What moves a link; values are the trigger names."""

    #: add_remote_agent
    ADD = "add"
    #: check_remote_metadata
    CHECK = "check"
    #: send_notif of a probe to a silent peer
    PROBE = "probe"
    #: a write to the peer (its transfer, or the state check of it) raised a disconnect
    DISCONNECTED = "disconnected"
    #: remove_remote_agent
    REMOVE = "remove"


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
    #: the call raised one of :data:`LINK_LOST_BY` (NIXL_ERR_REMOTE_DISCONNECT): the peer is gone
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
E = LinkEvent

#: The link to one peer agent, declared once.
PEER_LINK: Declaration[LinkState, LinkAnswer] = Declaration(
    "peer_link",
    states=LinkState,
    initial=LinkState.UNKNOWN,
    answers={E.ADD: [LinkAnswer.OK, LinkAnswer.RAISED],
             E.CHECK: [LinkAnswer.TRUE, LinkAnswer.FALSE, LinkAnswer.RAISED],
             E.PROBE: [LinkAnswer.OK, LinkAnswer.RAISED, LinkAnswer.DISCONNECTED],
             E.DISCONNECTED: [LinkAnswer.DISCONNECTED],
             E.REMOVE: [LinkAnswer.OK, LinkAnswer.RAISED]},
    guards={"ok": [LinkAnswer.OK], "raised": [LinkAnswer.RAISED],
            "present": [LinkAnswer.TRUE], "absent": [LinkAnswer.FALSE],
            "gone": [LinkAnswer.DISCONNECTED]},
    actions={"note_error": note_error, "note_lost": note_lost, "note_leak": note_leak},
    transitions=[
        {"trigger": E.ADD, "source": L.UNKNOWN, "dest": L.CONNECTING, "conditions": "ok"},
        {"trigger": E.ADD, "source": L.UNKNOWN, "dest": L.REFUSED, "conditions": "raised",
         "after": "note_lost"},

        {"trigger": E.CHECK, "source": L.CONNECTING, "dest": L.CONNECTED,
         "conditions": "present"},
        {"trigger": E.CHECK, "source": L.CONNECTING, "dest": L.CONNECTING,
         "conditions": "absent"},
        {"trigger": E.CHECK, "source": L.CONNECTING, "dest": L.LOST, "conditions": "raised",
         "after": "note_lost"},
        {"trigger": E.REMOVE, "source": L.CONNECTING, "dest": L.CLOSED, "conditions": "ok"},
        {"trigger": E.REMOVE, "source": L.CONNECTING, "dest": L.CLOSED, "conditions": "raised",
         "after": "note_leak"},

        {"trigger": E.PROBE, "source": L.CONNECTED, "dest": L.CONNECTED, "conditions": "ok"},
        {"trigger": E.PROBE, "source": L.CONNECTED, "dest": L.CONNECTED,
         "conditions": "raised", "after": "note_error"},
        {"trigger": E.PROBE, "source": L.CONNECTED, "dest": L.LOST, "conditions": "gone",
         "after": "note_lost"},
        {"trigger": E.DISCONNECTED, "source": L.CONNECTED, "dest": L.LOST,
         "conditions": "gone", "after": "note_lost"},
        {"trigger": E.REMOVE, "source": L.CONNECTED, "dest": L.CLOSED, "conditions": "ok"},
        {"trigger": E.REMOVE, "source": L.CONNECTED, "dest": L.CLOSED, "conditions": "raised",
         "after": "note_leak"},

        {"trigger": E.DISCONNECTED, "source": L.LOST, "dest": L.LOST, "conditions": "gone"},
        {"trigger": E.REMOVE, "source": L.LOST, "dest": L.CLOSED, "conditions": "ok"},
        {"trigger": E.REMOVE, "source": L.LOST, "dest": L.CLOSED, "conditions": "raised",
         "after": "note_leak"},
    ],
    final=(LinkState.CLOSED, LinkState.REFUSED),
    failure_states=(LinkState.LOST, LinkState.REFUSED),
    calls={E.ADD: "add_remote_agent", E.CHECK: "check_remote_metadata", E.PROBE: "send_notif",
           # what a write answered: its transfer, or the state check of it
           E.DISCONNECTED: ("transfer", "check_xfer_state"),
           E.REMOVE: "remove_remote_agent"},
)
