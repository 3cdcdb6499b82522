"""The receiving side of a peer write, as a machine: when the receiver's blocks may be reused.

A receiver has no transfer handle: it learns that a sender's write landed from the notification
NIXL delivers (``get_new_notifs``), and that it never will when the sender disappears.
:data:`PEER_RECEIVE` declares that with the same tools as the transfer machine (and so with the
same compiled engine, diagram, explorer and coverage)::

    EXPECTING --notified[arrived]--> ARRIVED --publish--> PUBLISHED (success)
    EXPECTING --watch[gone]--> PEER_LOST --publish--> PUBLISHED (failure)
    EXPECTING --notified[misdirected]--> MISDIRECTED --publish--> PUBLISHED (failure)

``watch`` reads the sender's link (:data:`kvfsm.machines.peer_link.PEER_LINK`); which of its
states mean the sender is gone is declared here as data, :data:`RECEIVE_FAILS_WHEN_LINK_IN`,
not decided by the receiver's code. This module is the declaration only: the receiver that
fires it, and why a notification counts, are :mod:`kvfsm.peer`'s.
"""

from __future__ import annotations

import enum

from kvfsm.engine import Declaration
from kvfsm.machines.peer_link import LinkState
from kvfsm.machines.transfer import latch_failure, latch_success

__all__ = ["PEER_RECEIVE", "RECEIVE_FAILS_WHEN_LINK_IN", "PeerAnswer", "ReceiveEvent",
           "ReceiveState"]


class ReceiveState(enum.Enum):
    """Where an expected incoming write is."""

    #: the receiver's blocks wait for the sender's write
    EXPECTING = "expecting"
    #: the notification arrived: NIXL wrote every block before it sent it
    ARRIVED = "arrived"
    #: the sender disappeared and was cut off: no write of it can land any more
    PEER_LOST = "peer_lost"
    #: the sender's notification of the job named other blocks than it is expected in (the
    #: same blocks in another order, or others): the engines disagree on the job's blocks
    MISDIRECTED = "misdirected"
    #: the one result was handed out
    PUBLISHED = "published"


class ReceiveEvent(enum.StrEnum):
    """What moves an expected write; values are the trigger names."""

    #: the job's notification was among ``get_new_notifs``'s
    NOTIFIED = "notified"
    #: the receiver read the sender's link
    WATCH = "watch"
    #: hand the result to the receiver's caller
    PUBLISH = "publish"


class PeerAnswer(enum.Enum):
    """What the receiver learned."""

    #: the job's notification was among NIXL's new notifications
    ARRIVED = "ARRIVED"
    #: a notification of the job's id on its link named other blocks
    MISDIRECTED = "MISDIRECTED"
    #: the sender is still known
    PRESENT = "PRESENT"
    #: the sender is gone, and its metadata removed
    GONE = "GONE"
    #: nothing to learn (publish)
    OK = "OK"


#: The coupling with the link machine: a sender whose link is in one of these states is gone,
#: so ``watch`` answers GONE and what it owed fails (a LOST link's metadata is being removed,
#: a CLOSED one's was; neither can deliver a notification that counts any more).
RECEIVE_FAILS_WHEN_LINK_IN: frozenset[LinkState] = frozenset({LinkState.LOST, LinkState.CLOSED})

R = ReceiveState
E = ReceiveEvent

#: The receiving side of a peer write, declared once.
PEER_RECEIVE: Declaration[ReceiveState, PeerAnswer] = Declaration(
    "peer_receive",
    states=ReceiveState,
    initial=ReceiveState.EXPECTING,
    answers={E.NOTIFIED: [PeerAnswer.ARRIVED, PeerAnswer.MISDIRECTED],
             E.WATCH: [PeerAnswer.PRESENT, PeerAnswer.GONE],
             E.PUBLISH: [PeerAnswer.OK]},
    guards={"arrived": [PeerAnswer.ARRIVED], "misdirected": [PeerAnswer.MISDIRECTED],
            "present": [PeerAnswer.PRESENT], "gone": [PeerAnswer.GONE]},
    actions={"latch_success": latch_success, "latch_failure": latch_failure},
    transitions=[
        {"trigger": E.NOTIFIED, "source": R.EXPECTING, "dest": R.ARRIVED,
         "conditions": "arrived", "after": "latch_success"},
        {"trigger": E.NOTIFIED, "source": R.EXPECTING, "dest": R.MISDIRECTED,
         "conditions": "misdirected", "after": "latch_failure"},
        {"trigger": E.WATCH, "source": R.EXPECTING, "dest": R.EXPECTING,
         "conditions": "present"},
        {"trigger": E.WATCH, "source": R.EXPECTING, "dest": R.PEER_LOST, "conditions": "gone",
         "after": "latch_failure"},
        {"trigger": E.PUBLISH, "source": R.ARRIVED, "dest": R.PUBLISHED},
        {"trigger": E.PUBLISH, "source": R.PEER_LOST, "dest": R.PUBLISHED},
        {"trigger": E.PUBLISH, "source": R.MISDIRECTED, "dest": R.PUBLISHED},
    ],
    final=(ReceiveState.PUBLISHED,),
    failure_states=(ReceiveState.PEER_LOST, ReceiveState.MISDIRECTED),
    calls={E.NOTIFIED: "get_new_notifs"},  # watch reads the sender's link; publish calls none
)
