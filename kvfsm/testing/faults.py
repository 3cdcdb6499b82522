"""Fault injection for NIXL agents: what to inject, and a schedule of numbered calls.

Every call of a NIXL method is numbered per method name from 1 when it starts, failed calls
included. :meth:`FaultPlan.inject` arms a :data:`Fault` for numbered calls, and the agent takes
(consumes) the fault armed for a call's number as the call starts. The fake agent and
:class:`kvfsm.testing.FaultyAgent`, a wrapper around a real agent, share this schedule.
"""

from __future__ import annotations

import numbers
import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

__all__ = ["FAULTABLE_CALLS", "PEER_CALLS", "STATUS_CALLS", "FakeNixlError", "Fault", "FaultPlan",
           "Raise", "ReturnErr", "StayProc", "fault_kind"]

#: the calls that answer a transfer's status, and so take ReturnErr and StayProc faults
STATUS_CALLS = frozenset({"transfer", "check_xfer_state"})
#: the NIXL calls a fault can be injected into
FAULTABLE_CALLS = frozenset({
    "register_memory",
    "deregister_memory",
    "query_memory",
    "prep_xfer_dlist",
    "make_prepped_xfer",
    "transfer",
    "check_xfer_state",
    "release_xfer_handle",
    "release_dlist_handle",
})
#: the calls of the peer seam (UCX): metadata exchange, notifications; they take ``Raise``
#: faults (:class:`kvfsm.testing.fake_ucx.FakeUcxAgent` serves them)
PEER_CALLS = frozenset({
    "get_agent_metadata",
    "add_remote_agent",
    "check_remote_metadata",
    "remove_remote_agent",
    "get_new_notifs",
    "send_notif",
})


class FakeNixlError(Exception):
    """A failure real NIXL would report; ``str(error)`` is the NIXL code, as in real NIXL.

    Real NIXL raises one exception type per status. Where kvfsm tells errors apart by that type
    (:data:`kvfsm.machines.peer_link.LINK_LOST_BY`), the fake's error is of a subclass named as
    NIXL's: ``FakeNixlError("NIXL_ERR_REMOTE_DISCONNECT")`` is a
    :class:`nixlRemoteDisconnectError`, so a fault injected as that code (``Raise``, the fault
    grammar, chaos) is recognized as real NIXL's would be. Other codes keep this type.

    Args:
        code: the NIXL status name, e.g. "NIXL_ERR_BACKEND".
    """

    def __new__(cls, code: str) -> FakeNixlError:
        """An error of the type real NIXL raises for ``code``, where kvfsm keys on it."""
        typed = _TYPED.get(code, cls) if cls is FakeNixlError else cls
        error: FakeNixlError = super().__new__(typed, code)
        return error

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class nixlRemoteDisconnectError(FakeNixlError):
    """NIXL_ERR_REMOTE_DISCONNECT, named as real NIXL 1.5.1 names its type: the peer is gone."""


#: the codes whose fake error is of the type real NIXL raises for them
_TYPED: dict[str, type[FakeNixlError]] = {
    "NIXL_ERR_REMOTE_DISCONNECT": nixlRemoteDisconnectError}


@dataclass(frozen=True)
class Raise:
    """The call raises ``FakeNixlError(code)`` instead of running."""

    code: str = "NIXL_ERR_BACKEND"

    def __post_init__(self) -> None:
        """Reject a code that is not a NIXL error name."""
        if not isinstance(self.code, str) or not self.code.startswith("NIXL_ERR_"):
            raise ValueError(f"Raise: code must be a NIXL_ERR_* name, got {self.code!r}")


@dataclass(frozen=True)
class ReturnErr:
    """``transfer`` answers "ERR" without posting; ``check_xfer_state`` answers "ERR".

    On a check of a running transfer, the transfer is then over and failed, moving no bytes.
    """


@dataclass(frozen=True)
class StayProc:
    """Makes ``polls`` answers in a row "PROC": the faulted call and the next ``polls - 1`` checks.

    The held answers do not advance the transfer, which resumes where it was afterwards. On
    ``transfer`` the post happens (it still raises NIXL_ERR_REPOST_ACTIVE on a running transfer),
    even with ``complete_after_polls=0``, whose transfer then completes at the first check after
    the held ones. On a transfer that is not running the held answers change nothing but the answer.
    """

    polls: int

    def __post_init__(self) -> None:
        """Reject a count below 1."""
        if isinstance(self.polls, bool) or not isinstance(self.polls, int) or self.polls < 1:
            raise ValueError(f"StayProc: polls must be an int >= 1, got {self.polls!r}")


def fault_kind(fault: Fault, names: dict[str, str] | None = None) -> str:
    """How an explorer's path names a fault: ``raise``, ``err`` or ``proc=N``; a raise whose
    NIXL code ``names`` maps is named so (the peer explorer's ``disconnect``)."""
    if isinstance(fault, Raise):
        return (names or {}).get(fault.code, "raise")
    if isinstance(fault, ReturnErr):
        return "err"
    return f"proc={fault.polls}"


#: a fault to inject with :meth:`FaultPlan.inject`
Fault: TypeAlias = Raise | ReturnErr | StayProc


@dataclass
class _Armed:
    """A fault armed for calls ``first`` to ``last`` of ``call``."""

    call: str
    fault: Fault
    first: int
    last: int


class FaultPlan:
    """Which numbered calls of which NIXL method fail, and how; and every call made.

    Args:
        owner: the agent class's name, for error messages.
        calls: the NIXL calls a fault can be injected into (:data:`FAULTABLE_CALLS`; a peer
            agent's add :data:`PEER_CALLS`).
    """

    def __init__(self, owner: str, calls: frozenset[str] = FAULTABLE_CALLS) -> None:
        self.owner = owner
        #: the calls this plan takes faults for
        self.faultable = calls
        #: the name of every call made, in order, failed ones included
        self.calls: list[str] = []
        self._counts: Counter[str] = Counter()
        self._armed: list[_Armed] = []
        self._chaos: tuple[dict[str, float], random.Random, int] | None = None
        #: how many faults chaos mode injected, by call
        self.chaos_faults: Counter[str] = Counter()

    def chaos(self, rate: float | Mapping[str, float], *, seed: int = 0,
              max_stall: int = 3) -> None:
        """Fail calls at random, reproducibly from ``seed``: each call with probability ``rate``
        (one rate for every call, or a rate per call name). Status calls raise, answer "ERR"
        or stall for up to ``max_stall`` polls; other calls raise. Armed faults come first.
        A rate of 0 (or an empty mapping) turns chaos off.

        Raises:
            ValueError: a rate that is not a number in [0, 1], a name that is not a NIXL call
                of the agent, or a ``max_stall`` that is not an int >= 1; nothing changed.
        """
        if type(max_stall) is not int or max_stall < 1:
            raise ValueError(f"chaos: max_stall must be an int >= 1 (polls), got {max_stall!r}")
        rates = (dict(rate) if isinstance(rate, Mapping)
                 else dict.fromkeys(self.faultable, rate))
        bad = {call: r for call, r in rates.items()
               if call not in self.faultable or isinstance(r, bool)
               or not isinstance(r, numbers.Real) or not 0 <= r <= 1}
        if bad:
            raise ValueError(f"chaos: rates must be numbers in [0, 1] for NIXL calls of "
                             f"{self.owner}; got {bad}")
        rates = {call: r for call, r in rates.items() if r}
        self._chaos = (rates, random.Random(seed), max_stall) if rates else None

    def inject(self, call: str, fault: Fault, *, at: int | None = None, times: int = 1) -> None:
        """Arm ``fault`` for ``times`` calls of ``call``.

        Args:
            call: a NIXL method name, e.g. "transfer".
            fault: what the call does instead (``StayProc``/``ReturnErr``: status calls only).
            at: the number of the first faulted call (1-based, counted from the agent's creation);
                by default the next call.
            times: how many consecutive calls the fault applies to.

        Raises:
            ValueError: unknown call, a fault kind that call cannot take, a bad ``at`` or
                ``times``, or calls that already have a fault armed.
        """
        if call not in self.faultable:
            raise ValueError(f"inject: {call!r} is not a NIXL call of {self.owner}; one of "
                             + ", ".join(sorted(self.faultable)))
        if not isinstance(fault, Raise | ReturnErr | StayProc):
            if isinstance(fault, type) and issubclass(fault, Raise | ReturnErr | StayProc):
                raise ValueError(f"inject: {fault.__name__} is the class of a Fault; pass one: "
                                 f"{fault.__name__}()")
            raise ValueError(f"inject: {fault!r} is not a Fault (Raise(), ReturnErr() or "
                             "StayProc(polls))")
        if not isinstance(fault, Raise) and call not in STATUS_CALLS:
            raise ValueError(
                f"inject: {type(fault).__name__} only applies to transfer and check_xfer_state, "
                f"not {call!r}"
            )
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise ValueError(f"inject: times must be an int >= 1, got {times!r}")
        done = self._counts[call]
        if at is None:
            first = done + 1
        elif isinstance(at, bool) or not isinstance(at, int) or at < 1:
            raise ValueError(f"inject: at must be an int >= 1, got {at!r}")
        elif at <= done:
            raise ValueError(f"inject: {call} call #{at} already happened ({done} so far)")
        else:
            first = at
        last = first + times - 1
        for armed in self._armed:
            if armed.call == call and armed.first <= last and first <= armed.last:
                raise ValueError(
                    f"inject: {call} calls #{armed.first}-#{armed.last} already have "
                    f"{armed.fault!r} armed; pass at= for calls after them"
                )
        self._armed.append(_Armed(call, fault, first, last))

    def take(self, call: str) -> Fault | None:
        """Record and number a call that starts; return (and consume) its fault, if any."""
        self.calls.append(call)
        self._counts[call] += 1
        number = self._counts[call]
        for armed in self._armed:
            if armed.call == call and armed.first <= number <= armed.last:
                armed.first = number + 1
                if armed.first > armed.last:
                    self._armed.remove(armed)
                return armed.fault
        if self._chaos is not None:
            rates, rng, max_stall = self._chaos
            if rng.random() < rates.get(call, 0.0):
                self.chaos_faults[call] += 1
                if call not in STATUS_CALLS:
                    return Raise()
                kinds: list[Fault] = [Raise(), ReturnErr(), StayProc(rng.randint(1, max_stall))]
                return kinds[rng.randrange(3)]
        return None

    def clear(self) -> None:
        """Disarm every fault that has not fired yet."""
        self._armed.clear()

    def pending(self) -> list[tuple[str, int, Fault]]:
        """What is still armed: one ``(call, call_number, fault)`` per call it will hit."""
        return [
            (armed.call, number, armed.fault)
            for armed in self._armed
            for number in range(armed.first, armed.last + 1)
        ]

    def count(self, call: str) -> int:
        """How many calls of ``call`` were made, failed ones included."""
        return self._counts[call]
