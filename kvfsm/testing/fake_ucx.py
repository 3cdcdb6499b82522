"""An in-memory stand-in for two or more NIXL agents on the UCX backend: the peer seam.

:class:`FakeUcxAgent` serves the calls a :class:`~kvfsm.peer.PeerSender` and a
:class:`~kvfsm.peer.PeerReceiver` make on their agents, with the call shapes of the real
wrapper (``nixl._api.nixl_agent``): metadata exchange (``get_agent_metadata``,
``add_remote_agent``, ``check_remote_metadata``, ``remove_remote_agent``), registration of DRAM,
a WRITE from this agent's registered memory into a peer's, carrying a notification the peer's
``get_new_notifs`` returns, and notifications sent on their own (``send_notif``). The agents of
one :class:`FakeUcxFabric` reach each other by name; bytes really move (``ctypes.memmove``
between the registered tensors).

Timing is :class:`~kvfsm.testing.FakeNixlAgent`'s: ``complete_after_polls`` state checks
complete a transfer (0: ``transfer`` completes it at once). A WRITE moves its bytes, then
queues its notification to the peer, when it completes. The fabric can hold notifications
(:meth:`FakeUcxFabric.hold`), so they arrive late, after anything the test does next.

A peer that disappears: :meth:`FakeUcxFabric.kill` ends an agent's process. From then on a
write to it, or a notification sent to it, raises ``FakeNixlError("NIXL_ERR_REMOTE_DISCONNECT")``
(a :class:`~kvfsm.testing.faults.nixlRemoteDisconnectError`, the type real NIXL 1.5.1 raises), a
write to it still running fails the same way at its next state check, and its own writes still
running never land. What it sent before is still delivered. A new agent of the same name may
join the fabric after it (a new process of the same engine).

Faults: the fault grammar of :mod:`kvfsm.testing.faults`, for every call here
(:data:`~kvfsm.testing.faults.FAULTABLE_CALLS` and :data:`~kvfsm.testing.faults.PEER_CALLS`):
``agent.inject("get_new_notifs", Raise(), at=2)``; ``Raise("NIXL_ERR_REMOTE_DISCONNECT")`` makes
a call answer that the peer is gone when it is not. ``Raise`` on a call changes nothing but the
raise (a ``get_new_notifs`` that raises keeps what it would have returned for the next call),
except on ``check_xfer_state`` of a running transfer, which then ends failed, moving no bytes
and sending no notification, as in :class:`~kvfsm.testing.FakeNixlAgent`.

What would crash or corrupt a real process becomes
:class:`~kvfsm.testing.NixlMisuseError`, recorded in :attr:`FakeUcxAgent.misuses`: a handle
released twice or while its transfer may run, a descriptor list released under a transfer
handle, memory deregistered under a transfer (this agent's, or a peer's write into it), a
peer's metadata removed under a transfer to it, a call after :meth:`FakeUcxAgent.close`.

Not thread safe, and not interrupt safe: drive the agents of one fabric from one thread.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfsm.testing.fake_agent import (
    FakeDlistHandle,
    FakeRegDList,
    FakeXferDList,
    FakeXferHandle,
    NixlMisuseError,
    _reg_descs,
    _xfer_descs,
)
from kvfsm.testing.faults import (
    FAULTABLE_CALLS,
    PEER_CALLS,
    FakeNixlError,
    Fault,
    FaultPlan,
    Raise,
    ReturnErr,
    StayProc,
)

__all__ = ["DISCONNECT", "UCX_CALLS", "FakeUcxAgent", "FakeUcxFabric", "fake_ucx_pair"]

#: the NIXL code a call to a peer that is gone raises
DISCONNECT = "NIXL_ERR_REMOTE_DISCONNECT"
#: every call a fault can be injected into on a :class:`FakeUcxAgent`
UCX_CALLS = (FAULTABLE_CALLS | PEER_CALLS) - {"query_memory"}

_LOCAL_AGENT = "NIXL_INIT_AGENT"
_METADATA = b"fake-ucx-metadata:"
_handle_ids = itertools.count(0x100000)
_serials = itertools.count(1)


@dataclass(eq=False)
class _Prepped:
    handle: FakeDlistHandle
    #: None: this agent's memory; else the peer's name
    peer: str | None
    descs: tuple[tuple[int, int, int], ...]
    users: int = 0


@dataclass(eq=False)
class _Xfer:
    handle: FakeXferHandle
    local: _Prepped
    remote: _Prepped
    #: (source address, destination address, length) per descriptor pair
    moves: tuple[tuple[int, int, int], ...]
    notification: bytes
    state: str = "MADE"  # RUNNING, DONE, FAILED
    polls_left: int = 0
    hold: int = 0
    failure: str | None = None


@dataclass
class _Inbox:
    """What a peer delivered to one agent and its ``get_new_notifs`` has not returned yet."""

    messages: dict[str, list[bytes]] = field(default_factory=dict)

    def put(self, sender: str, message: bytes) -> None:
        self.messages.setdefault(sender, []).append(message)


class FakeUcxFabric:
    """The wire between fake UCX agents: who is reachable by name, and the notifications in
    flight.

    ``fabric.agent("engine-a")`` makes an agent on it; a name is taken by one live agent at a
    time (a killed agent's name may be taken again). :attr:`delivered` records every
    notification put into an agent's inbox, in order.
    """

    def __init__(self) -> None:
        #: the live agents, by name
        self.agents: dict[str, FakeUcxAgent] = {}
        #: while True, notifications wait in :attr:`held` instead of reaching their inbox
        self.holding = False
        #: (sender, receiving agent, message) held back, oldest first
        self.held: list[tuple[str, FakeUcxAgent, bytes]] = []
        #: (sender, receiver, message) of every notification that reached an inbox, in order
        self.delivered: list[tuple[str, str, bytes]] = []
        #: (writer, receiver, destination address, length) of every write that landed
        self.landed: list[tuple[str, str, int, int]] = []

    def agent(self, name: str, *, complete_after_polls: int = 1) -> FakeUcxAgent:
        """A new agent called ``name`` on this fabric (as ``FakeUcxAgent(name, fabric)``).

        Raises:
            ValueError: a live agent already has that name.
        """
        return FakeUcxAgent(name, self, complete_after_polls=complete_after_polls)

    def kill(self, name: str) -> None:
        """End the process of the agent called ``name``: it is gone for its peers from now on
        (its own writes still running never land). A no-op for a name no live agent has."""
        agent = self.agents.pop(name, None)
        if agent is not None:
            agent.dead = True

    def hold(self) -> None:
        """From now on notifications wait (in flight) until :meth:`release`."""
        self.holding = True

    def release(self) -> None:
        """Deliver every held notification, oldest first, and stop holding; one whose receiver
        is gone is lost (a new agent of the same name is another process: it never gets it)."""
        self.holding = False
        held, self.held = self.held, []
        for sender, receiver, message in held:
            self._deliver(sender, receiver, message)

    def reachable(self, name: str) -> FakeUcxAgent | None:
        """The live agent called ``name``, or None when it is gone (or never was)."""
        return self.agents.get(name)

    def send(self, sender: str, receiver: FakeUcxAgent, message: bytes) -> None:
        """Carry a notification to ``receiver`` (now, or when held, at :meth:`release`)."""
        if self.holding:
            self.held.append((sender, receiver, message))
        else:
            self._deliver(sender, receiver, message)

    def _deliver(self, sender: str, receiver: FakeUcxAgent, message: bytes) -> None:
        if not receiver.dead:
            receiver.inbox.put(sender, message)
            self.delivered.append((sender, receiver.name, message))

    def running_into(self, agent: FakeUcxAgent, addr: int, length: int) -> bool:
        """Whether a live agent's running write lands in ``[addr, addr + length)`` of
        ``agent``'s memory."""
        for writer in self.agents.values():
            for xfer in writer._running():
                if xfer.remote.peer == agent.name and any(
                        dst < addr + length and addr < dst + size for _, dst, size in xfer.moves):
                    return True
        return False


class FakeUcxAgent:
    """An in-memory NIXL agent with the UCX backend, on a :class:`FakeUcxFabric`.

    Make it with :meth:`FakeUcxFabric.agent` (or :func:`fake_ucx_pair`); see the module
    docstring for what it does and the faults it takes.

    Args:
        name: the agent's name, by which its peers reach it (no other live agent of the
            fabric may have it: ValueError).
        fabric: the fabric it joins.
        complete_after_polls: how many ``check_xfer_state`` calls a posted transfer needs; 0
            makes ``transfer`` complete it at once.
    """

    def __init__(self, name: str, fabric: FakeUcxFabric, *, complete_after_polls: int = 1
                 ) -> None:
        if (isinstance(complete_after_polls, bool) or not isinstance(complete_after_polls, int)
                or complete_after_polls < 0):
            raise ValueError(
                f"complete_after_polls must be an int >= 0, got {complete_after_polls!r}")
        self.name = name
        self.fabric = fabric
        self.complete_after_polls = complete_after_polls
        self.backends: dict[str, int] = {"UCX": 1}
        #: the fault schedule, and the record of every call made
        self.faults = FaultPlan("FakeUcxAgent", UCX_CALLS)
        #: the name of every NIXL call made, in order, failed ones included
        self.calls: list[str] = self.faults.calls
        #: every misuse detected, also when the caller caught the NixlMisuseError it raised
        self.misuses: list[str] = []
        #: the notifications delivered and not yet returned by get_new_notifs
        self.inbox = _Inbox()
        #: True once the fabric killed this agent's process
        self.dead = False
        self._serial = next(_serials)
        self._registered: list[tuple[FakeRegDList, tuple[int, int, int, str]]] = []
        self._remotes: set[str] = set()
        self._dlists: dict[int, _Prepped] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._closed = False
        #: how many injected faults each call took (a Raise, ReturnErr or StayProc)
        self.faults_taken: dict[str, int] = {}
        if name in fabric.agents:
            raise ValueError(f"a live agent is already called {name!r}; kill() it first")
        fabric.agents[name] = self

    # -- fault injection and introspection ------------------------------------------------

    def inject(self, call: str, fault: Fault, *, at: int | None = None, times: int = 1) -> None:
        """Arm ``fault`` for ``times`` calls of ``call`` (see
        :meth:`~kvfsm.testing.faults.FaultPlan.inject`)."""
        self.faults.inject(call, fault, at=at, times=times)

    def call_count(self, name: str) -> int:
        """How many calls of ``name`` were made, failed ones included."""
        return self.faults.count(name)

    def live_xfer_handles(self) -> int:
        """Transfer handles made and not yet released."""
        return len(self._xfers)

    def live_dlist_handles(self) -> int:
        """Prepped descriptor list handles made and not yet released."""
        return len(self._dlists)

    def live_registrations(self) -> int:
        """Registered descriptors not yet deregistered."""
        return len(self._registered)

    def remote_agents(self) -> set[str]:
        """The peers whose metadata this agent holds."""
        return set(self._remotes)

    def running_transfers(self) -> int:
        """Transfers posted and not yet seen DONE or failed."""
        return sum(1 for _ in self._running())

    def close(self) -> None:
        """Tear the agent down; every later call raises NixlMisuseError.

        Raises:
            NixlMisuseError: a transfer is still running, or the agent is already closed.
        """
        self._enter("close")
        if self.running_transfers():
            raise self._misuse(f"close: agent {self.name!r} still has running transfers")
        self._closed = True

    # -- metadata -------------------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        """This agent's metadata, which a peer's ``add_remote_agent`` loads."""
        self._fire(self._enter("get_agent_metadata"))
        return _METADATA + self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer's metadata; returns its name (as bytes, as the real wrapper does).

        Raises:
            FakeNixlError: NIXL_ERR_INVALID_PARAM for bytes no agent's metadata are.
        """
        self._fire(self._enter("add_remote_agent"))
        data = bytes(metadata)
        if not data.startswith(_METADATA) or len(data) == len(_METADATA):
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM")
        name = data[len(_METADATA):].decode()
        self._remotes.add(name)
        return name.encode()

    def check_remote_metadata(self, remote_name: str | bytes) -> bool:
        """Whether this agent holds the peer's metadata (not whether the peer is alive)."""
        self._fire(self._enter("check_remote_metadata"))
        return _text(remote_name) in self._remotes

    def remove_remote_agent(self, agent: str | bytes) -> None:
        """Forget a peer's metadata.

        Raises:
            FakeNixlError: NIXL_ERR_NOT_FOUND when it is not held.
            NixlMisuseError: a transfer handle to it is not released.
        """
        fault = self._enter("remove_remote_agent")
        name = _text(agent)
        users = [x.handle for x in self._xfers.values() if x.remote.peer == name]
        if users:
            raise self._misuse(f"remove_remote_agent: {name!r} is still the target of "
                               f"unreleased {users!r}; release the transfers first")
        self._fire(fault)
        if name not in self._remotes:
            raise FakeNixlError("NIXL_ERR_NOT_FOUND")
        self._remotes.discard(name)

    # -- registration ---------------------------------------------------------------------

    def register_memory(self, reg_list: FakeRegDList | Sequence[tuple[int, int, int, str]],
                        mem_type: str | None = None, backends: Sequence[str] = ()
                        ) -> FakeRegDList:
        """Register ``(addr, len, dev_id, meta)`` DRAM descriptors.

        Raises:
            FakeNixlError: NIXL_ERR_NOT_SUPPORTED for a memory type other than DRAM.
        """
        fault = self._enter("register_memory")
        canonical, descs = _reg_descs("register_memory", reg_list, mem_type)
        self._fire(fault)
        if canonical != "DRAM":
            raise FakeNixlError("NIXL_ERR_NOT_SUPPORTED")
        registered = FakeRegDList(canonical, descs)
        self._registered += [(registered, desc) for desc in descs]
        return registered

    def deregister_memory(self, dereg_list: FakeRegDList, backends: Sequence[str] = ()) -> None:
        """Deregister what :meth:`register_memory` returned.

        Raises:
            TypeError: not a FakeRegDList.
            NixlMisuseError: a transfer of this agent, or a peer's write into it, may still use
                the memory.
            FakeNixlError: NIXL_ERR_NOT_FOUND when it is not registered.
        """
        fault = self._enter("deregister_memory")
        if not isinstance(dereg_list, FakeRegDList):
            raise TypeError(f"deregister_memory: expected a FakeRegDList, "
                            f"got {type(dereg_list).__name__}")
        mine = [entry for entry in self._registered if entry[0] is dereg_list]
        for _, (addr, length, _, _) in mine:
            if self.fabric.running_into(self, addr, length):
                raise self._misuse(f"deregister_memory: a peer's write into "
                                   f"[{addr:#x}, +{length}) may still run")
            if any(x.state == "RUNNING" and any(src < addr + length and addr < src + size
                                                for src, _, size in x.moves)
                   for x in self._xfers.values()):
                raise self._misuse(f"deregister_memory: a transfer of {self.name!r} from "
                                   f"[{addr:#x}, +{length}) may still run")
        self._fire(fault)
        if not mine:
            raise FakeNixlError("NIXL_ERR_NOT_FOUND")
        self._registered = [entry for entry in self._registered if entry[0] is not dereg_list]

    # -- transfers ------------------------------------------------------------------------

    def prep_xfer_dlist(self, agent_name: str | bytes,
                        xfer_list: FakeXferDList | Sequence[tuple[int, int, int]],
                        mem_type: str | None = None, backends: Sequence[str] = ()
                        ) -> FakeDlistHandle:
        """Prep descriptors of this agent's memory (``"NIXL_INIT_AGENT"``) or of a peer's whose
        metadata it holds.

        Raises:
            FakeNixlError: NIXL_ERR_NOT_FOUND for a peer whose metadata is not held, or
                descriptors no registration covers.
        """
        fault = self._enter("prep_xfer_dlist")
        _, descs = _xfer_descs("prep_xfer_dlist", xfer_list, mem_type)
        name = _text(agent_name)
        self._fire(fault)
        if name == _LOCAL_AGENT:
            covered, peer = self._covers(descs), None
        else:
            if name not in self._remotes:
                raise FakeNixlError("NIXL_ERR_NOT_FOUND")
            target = self.fabric.reachable(name)
            covered, peer = target is None or target._covers(descs), name
        if not covered:
            raise FakeNixlError("NIXL_ERR_NOT_FOUND")
        handle = FakeDlistHandle(next(_handle_ids), self._serial)
        self._dlists[handle._handle] = _Prepped(handle, peer, tuple(descs))
        return handle

    def make_prepped_xfer(self, operation: str, local_xfer_side: FakeDlistHandle,
                          local_indices: Sequence[int], remote_xfer_side: FakeDlistHandle,
                          remote_indices: Sequence[int], notif_msg: bytes | str = b"",
                          backends: Sequence[str] = (), skip_desc_merge: bool = False
                          ) -> FakeXferHandle:
        """A WRITE from prepped local descriptors into a peer's, with its notification.

        Raises:
            NixlMisuseError: a descriptor list handle this agent did not make, or released.
            FakeNixlError: NIXL_ERR_INVALID_PARAM for mismatched indices or lengths, a local
                side that is a peer's or a remote side that is not; NIXL_ERR_NOT_SUPPORTED for
                a READ.
        """
        fault = self._enter("make_prepped_xfer")
        local = self._dlist("make_prepped_xfer", local_xfer_side)
        remote = self._dlist("make_prepped_xfer", remote_xfer_side)
        self._fire(fault)
        if operation != "WRITE":
            raise FakeNixlError("NIXL_ERR_NOT_SUPPORTED")
        if local.peer is not None or remote.peer is None:
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM")
        if len(local_indices) != len(remote_indices) or any(
                not 0 <= i < len(side.descs)
                for indices, side in ((local_indices, local), (remote_indices, remote))
                for i in indices):
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM")
        moves = []
        for i, j in zip(local_indices, remote_indices, strict=True):
            (src, size, _), (dst, other, _) = local.descs[i], remote.descs[j]
            if size != other:
                raise FakeNixlError("NIXL_ERR_INVALID_PARAM")
            moves.append((src, dst, size))
        message = notif_msg.encode() if isinstance(notif_msg, str) else bytes(notif_msg)
        handle = FakeXferHandle(next(_handle_ids), self._serial)
        self._xfers[handle._handle] = _Xfer(handle, local, remote, tuple(moves), message)
        local.users += 1
        remote.users += 1
        return handle

    def transfer(self, handle: FakeXferHandle, notif_msg: bytes | str = b"") -> str:
        """Post a transfer: "PROC", or "DONE" with ``complete_after_polls=0``.

        Raises:
            NixlMisuseError: a handle this agent did not make, or one already released.
            FakeNixlError: NIXL_ERR_REMOTE_DISCONNECT when the peer is gone (nothing posted);
                NIXL_ERR_REPOST_ACTIVE while it still runs.
        """
        fault = self._enter("transfer")
        xfer = self._xfer("transfer", handle)
        self._fire(fault)
        if isinstance(fault, ReturnErr):
            return "ERR"
        if self.fabric.reachable(str(xfer.remote.peer)) is None:
            raise FakeNixlError(DISCONNECT)
        if xfer.state == "RUNNING":
            raise FakeNixlError("NIXL_ERR_REPOST_ACTIVE")
        if notif_msg:
            xfer.notification = notif_msg.encode() if isinstance(notif_msg, str) else notif_msg
        xfer.state, xfer.failure, xfer.hold = "RUNNING", None, 0
        xfer.polls_left = max(self.complete_after_polls - 1, 0)
        if isinstance(fault, StayProc):
            xfer.hold = fault.polls - 1
            return "PROC"
        if self.complete_after_polls == 0:
            return self._complete(xfer)
        return "PROC"

    def check_xfer_state(self, handle: FakeXferHandle) -> str:
        """Poll a transfer: "PROC" while it runs, "DONE" once it completed.

        Raises:
            NixlMisuseError: a handle this agent did not make, or one already released.
            FakeNixlError: the transfer failed (NIXL_ERR_REMOTE_DISCONNECT when its peer went
                away), again on every later check; NIXL_ERR_NOT_POSTED for one never posted.
        """
        fault = self._enter("check_xfer_state")
        xfer = self._xfer("check_xfer_state", handle)
        if isinstance(fault, StayProc):
            xfer.hold = fault.polls - 1
            return "PROC"
        if isinstance(fault, Raise | ReturnErr):
            outcome = fault.code if isinstance(fault, Raise) else "ERR"
            if xfer.state == "RUNNING":
                xfer.state, xfer.failure = "FAILED", outcome
            return _failure(outcome)
        if xfer.hold:
            xfer.hold -= 1
            return "PROC"
        if xfer.state == "RUNNING" and self.fabric.reachable(str(xfer.remote.peer)) is None:
            xfer.state, xfer.failure = "FAILED", DISCONNECT  # the peer went away under it
        if xfer.state == "MADE":
            raise FakeNixlError("NIXL_ERR_NOT_POSTED")
        if xfer.state == "DONE":
            return "DONE"
        if xfer.state == "FAILED":
            return _failure(xfer.failure or "NIXL_ERR_BACKEND")
        if xfer.polls_left:
            xfer.polls_left -= 1
            return "PROC"
        return self._complete(xfer)

    def release_xfer_handle(self, handle: FakeXferHandle) -> None:
        """Release a transfer handle whose transfer is not running.

        Raises:
            NixlMisuseError: released already, not made by this agent, or its transfer may
                still run.
        """
        fault = self._enter("release_xfer_handle")
        xfer = self._xfer("release_xfer_handle", handle)
        if xfer.state == "RUNNING":
            raise self._misuse(f"release_xfer_handle: the transfer of {handle!r} may still "
                               "be running")
        self._fire(fault)
        handle._released = True
        del self._xfers[handle._handle]
        xfer.local.users -= 1
        xfer.remote.users -= 1

    def release_dlist_handle(self, handle: FakeDlistHandle) -> None:
        """Release a prepped descriptor list no unreleased transfer handle uses.

        Raises:
            NixlMisuseError: released already, not made by this agent, or still used.
        """
        fault = self._enter("release_dlist_handle")
        prepped = self._dlist("release_dlist_handle", handle)
        if prepped.users:
            raise self._misuse(f"release_dlist_handle: {handle!r} is still used by "
                               f"{prepped.users} unreleased transfer handle(s)")
        self._fire(fault)
        handle._released = True
        del self._dlists[handle._handle]

    # -- notifications --------------------------------------------------------------------

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """The notifications delivered since the last call, by sender name.

        A call that raises (an injected fault) returns nothing and keeps them for the next.
        """
        self._fire(self._enter("get_new_notifs"))
        messages, self.inbox.messages = self.inbox.messages, {}
        return messages

    def send_notif(self, remote_agent_name: str | bytes, notif_msg: bytes | str) -> None:
        """Send a peer whose metadata this agent holds a notification.

        Raises:
            FakeNixlError: NIXL_ERR_NOT_FOUND for a peer whose metadata is not held;
                NIXL_ERR_REMOTE_DISCONNECT for one that is gone.
        """
        self._fire(self._enter("send_notif"))
        name = _text(remote_agent_name)
        if name not in self._remotes:
            raise FakeNixlError("NIXL_ERR_NOT_FOUND")
        target = self.fabric.reachable(name)
        if target is None:
            raise FakeNixlError(DISCONNECT)
        message = notif_msg.encode() if isinstance(notif_msg, str) else bytes(notif_msg)
        self.fabric.send(self.name, target, message)

    # -- internals ------------------------------------------------------------------------

    def _misuse(self, message: str) -> NixlMisuseError:
        self.misuses.append(message)
        return NixlMisuseError(message)

    def _enter(self, call: str) -> Fault | None:
        fault = self.faults.take(call)
        if fault is not None:
            self.faults_taken[call] = self.faults_taken.get(call, 0) + 1
        if self._closed:
            raise self._misuse(f"{call}: agent {self.name!r} is closed")
        return fault

    @staticmethod
    def _fire(fault: Fault | None) -> None:
        if isinstance(fault, Raise):
            raise FakeNixlError(fault.code)

    def _covers(self, descs: Sequence[tuple[int, int, int]]) -> bool:
        return all(any(dev == reg_dev and addr >= base and addr + size <= base + length
                       for _, (base, length, reg_dev, _) in self._registered)
                   for addr, size, dev in descs)

    def _running(self) -> list[_Xfer]:
        return [xfer for xfer in self._xfers.values() if xfer.state == "RUNNING"]

    def _xfer(self, call: str, handle: object) -> _Xfer:
        if isinstance(handle, FakeXferHandle):
            found = self._xfers.get(handle._handle)
            if found is not None and found.handle is handle:
                return found
            if handle._released and handle._owner == self._serial:
                raise self._misuse(f"{call}: {handle!r} was already released")
        raise self._misuse(f"{call}: {handle!r} is not a transfer handle of {self.name!r}")

    def _dlist(self, call: str, handle: object) -> _Prepped:
        if isinstance(handle, FakeDlistHandle):
            found = self._dlists.get(handle._handle)
            if found is not None and found.handle is handle:
                return found
            if handle._released and handle._owner == self._serial:
                raise self._misuse(f"{call}: {handle!r} was already released")
        raise self._misuse(f"{call}: {handle!r} is not a dlist handle of {self.name!r}")

    def _complete(self, xfer: _Xfer) -> str:
        """Land a running WRITE: its bytes, then its notification; or fail it when the peer
        (or this agent's own process) is gone."""
        peer = self.fabric.reachable(str(xfer.remote.peer))
        if self.dead:  # this process ended: nothing of it lands any more
            return "PROC"
        if peer is None:
            xfer.state, xfer.failure = "FAILED", DISCONNECT
            raise FakeNixlError(DISCONNECT)
        for src, dst, size in xfer.moves:
            ctypes.memmove(dst, src, size)
            self.fabric.landed.append((self.name, peer.name, dst, size))
        xfer.state = "DONE"
        if xfer.notification:
            self.fabric.send(self.name, peer, xfer.notification)
        return "DONE"


def _failure(outcome: str) -> str:
    if outcome == "ERR":
        return "ERR"
    raise FakeNixlError(outcome)


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def fake_ucx_pair(sender: str = "engine-a", receiver: str = "engine-b", *,
                  complete_after_polls: int = 1) -> tuple[FakeUcxAgent, FakeUcxAgent]:
    """Two fake UCX agents on one new fabric (``agent.fabric``): a sender's and a receiver's."""
    fabric = FakeUcxFabric()
    return (fabric.agent(sender, complete_after_polls=complete_after_polls),
            fabric.agent(receiver, complete_after_polls=complete_after_polls))
