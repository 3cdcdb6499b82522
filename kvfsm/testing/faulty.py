"""A wrapper that injects faults into a real NIXL agent's calls, keeping real NIXL safe.

:class:`FaultyAgent` forwards every call to the agent it wraps, except a call that has a fault
armed (:meth:`FaultyAgent.inject`, same schedule as :class:`~kvfsm.testing.FakeNixlAgent`):

* ``Raise`` on a call that creates or releases something: the call raises
  :class:`~kvfsm.testing.FakeNixlError` and the real call is not made (nothing is created, or
  the resource stays held, exactly as if NIXL had refused).
* ``Raise`` or ``ReturnErr`` on ``transfer``: the transfer is not posted.
* ``StayProc(n)`` on ``transfer``: it is posted, and it and the next ``n - 1`` checks of that
  transfer answer "PROC" whatever NIXL says.
* ``Raise`` or ``ReturnErr`` on ``check_xfer_state``: a failed state check says the transfer is
  over, so the fault waits until the real transfer is: while NIXL answers "PROC" the check
  answers "PROC"; when NIXL answers, the check raises (or answers "ERR") instead. A fault never
  makes a caller release a handle whose transfer may still be running.
"""

from __future__ import annotations

from typing import Any

from kvfsm.testing.faults import FakeNixlError, Fault, FaultPlan, Raise, ReturnErr, StayProc

__all__ = ["FaultyAgent"]


class FaultyAgent:
    """Wraps a NIXL agent; injects faults into its calls by name and occurrence.

    Args:
        agent: the agent to wrap (a real ``nixl_agent``).
    """

    def __init__(self, agent: Any) -> None:
        name = getattr(agent, "name", None)
        if not isinstance(name, str) or not callable(getattr(agent, "transfer", None)):
            raise ValueError(f"FaultyAgent wraps a NIXL agent (a nixl_agent with a name and its "
                             f"calls), got {type(agent).__name__} {agent!r}")
        self.wrapped = agent
        self.name: str = name
        #: the fault schedule, and the record of every call made
        self.faults = FaultPlan(f"FaultyAgent({type(agent).__name__})")
        self._held: dict[int, int] = {}  # id(handle) -> checks still to answer PROC
        self._failing: dict[int, Fault] = {}  # id(handle) -> failure waiting for the end
        # ids of released transfer handles that keep no released flag (NIXL's own do, and are
        # not remembered here: a long run on a real agent keeps no handle), and those handles,
        # kept so that their ids are not reused
        self._released: set[int] = set()
        self._keep: list[Any] = []
        #: what would crash real NIXL, caught before it reached it (a handle released twice)
        self.misuses: list[str] = []

    def inject(self, call: str, fault: Fault, *, at: int | None = None, times: int = 1) -> None:
        """Arm ``fault`` for ``times`` calls of ``call`` (see :meth:`FaultPlan.inject`)."""
        self.faults.inject(call, fault, at=at, times=times)

    def chaos(self, rate: float, *, seed: int = 0, **options: Any) -> None:
        """Fail calls at random (see :meth:`FaultPlan.chaos`)."""
        self.faults.chaos(rate, seed=seed, **options)

    def call_count(self, name: str) -> int:
        """How many calls of ``name`` were made, failed ones included."""
        return self.faults.count(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def _plain(self, call: str, *args: Any, **kwargs: Any) -> Any:
        fault = self.faults.take(call)
        if isinstance(fault, Raise):
            raise FakeNixlError(fault.code)
        return getattr(self.wrapped, call)(*args, **kwargs)

    def register_memory(self, *args: Any, **kwargs: Any) -> Any:
        """register_memory, unless a fault is armed."""
        return self._plain("register_memory", *args, **kwargs)

    def deregister_memory(self, *args: Any, **kwargs: Any) -> Any:
        """deregister_memory, unless a fault is armed."""
        return self._plain("deregister_memory", *args, **kwargs)

    def query_memory(self, *args: Any, **kwargs: Any) -> Any:
        """query_memory, unless a fault is armed."""
        return self._plain("query_memory", *args, **kwargs)

    def prep_xfer_dlist(self, *args: Any, **kwargs: Any) -> Any:
        """prep_xfer_dlist, unless a fault is armed."""
        return self._plain("prep_xfer_dlist", *args, **kwargs)

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        """make_prepped_xfer, unless a fault is armed."""
        return self._plain("make_prepped_xfer", *args, **kwargs)

    def release_dlist_handle(self, handle: Any) -> None:
        """release_dlist_handle, unless a fault is armed."""
        self._plain("release_dlist_handle", handle)

    def release_xfer_handle(self, handle: Any) -> None:
        """release_xfer_handle, unless a fault is armed; a second release is refused."""
        flag = getattr(handle, "_released", None)  # NIXL's own handles keep one
        if flag is True or (flag is None and id(handle) in self._released):
            self.misuses.append(f"release_xfer_handle: {handle!r} released twice")
            raise RuntimeError(f"kvfsm FaultyAgent: {handle!r} was already released")
        self._plain("release_xfer_handle", handle)
        self._held.pop(id(handle), None)
        self._failing.pop(id(handle), None)
        if flag is None:  # a handle with no flag of its own: remembered here, and kept alive
            self._released.add(id(handle))  # so that its id is not reused
            self._keep.append(handle)

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> str:
        """Post, unless a Raise or ReturnErr fault is armed; StayProc holds its answers."""
        fault = self.faults.take("transfer")
        if isinstance(fault, Raise):
            raise FakeNixlError(fault.code)
        if isinstance(fault, ReturnErr):
            return "ERR"
        status: str = self.wrapped.transfer(handle, *args, **kwargs)
        if isinstance(fault, StayProc) and status != "ERR":
            if fault.polls > 1:
                self._held[id(handle)] = fault.polls - 1
            return "PROC"
        return status

    def check_xfer_state(self, handle: Any) -> str:
        """Check; a failure fault waits for the real transfer to be over before it answers."""
        fault = self.faults.take("check_xfer_state")
        key = id(handle)
        if isinstance(fault, StayProc):
            if fault.polls > 1:
                self._held[key] = self._held.get(key, 0) + fault.polls - 1
            return "PROC"
        if isinstance(fault, Raise | ReturnErr):
            self._failing[key] = fault
        held = self._held.get(key, 0)
        if held:
            self._held[key] = held - 1
            return "PROC"
        status: str = self.wrapped.check_xfer_state(handle)  # a real failure raises here
        if status == "PROC":
            return status
        failure = self._failing.pop(key, None)
        if isinstance(failure, Raise):
            raise FakeNixlError(failure.code)
        if isinstance(failure, ReturnErr):
            return "ERR"
        return status
