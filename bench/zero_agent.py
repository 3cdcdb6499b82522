"""A NIXL agent that answers at zero cost: no bytes move, every call returns at once.

It has the methods of ``nixl_agent`` a tier calls (:class:`kvfsm.agent.NixlAgent`), so every
contender of the benchmarks drives the same object, and what they cost over it is their own
bookkeeping. Handles are distinct small objects, as NIXL's are (a ``__slots__`` object per
transfer handle and per descriptor list), so code may keep them in dicts or sets; the memory
benchmark leaves out what this file allocates ("NIXL's own handles").

``transfer`` answers :attr:`ZeroAgent.post_answer` and ``check_xfer_state`` answers
:attr:`ZeroAgent.answer`; a benchmark sets them to choose what NIXL says ("PROC", "DONE").
"""

from __future__ import annotations

from typing import Any


class ZeroHandle:
    """A transfer handle, a prepped descriptor list or a registration: identity only."""

    __slots__ = ()


class ZeroRegDList:
    """What ``register_memory`` returns; ``trim()`` gives the descriptors for prepping."""

    __slots__ = ()

    def trim(self) -> ZeroHandle:
        return _TRIMMED


_TRIMMED = ZeroHandle()


class ZeroAgent:
    """Every ``nixl_agent`` call a tier makes, answering at once."""

    def __init__(self, name: str = "zero") -> None:
        self.name = name
        #: what ``transfer()`` answers
        self.post_answer = "PROC"
        #: what ``check_xfer_state()`` answers
        self.answer = "PROC"

    # the signatures are nixl_agent's (nixl-cu12 1.5.1), optional arguments included

    def register_memory(self, reg_list: Any, mem_type: str | None = None,
                        backends: Any = ()) -> ZeroRegDList:
        return ZeroRegDList()

    def deregister_memory(self, dereg_list: Any, backends: Any = ()) -> None:
        return None

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: str | None = None,
                        backends: Any = ()) -> ZeroHandle:
        return ZeroHandle()

    def make_prepped_xfer(self, operation: str, local_xfer_side: Any, local_indices: Any,
                          remote_xfer_side: Any, remote_indices: Any, notif_msg: Any = b"",
                          backends: Any = (), skip_desc_merge: bool = False) -> ZeroHandle:
        return ZeroHandle()

    def transfer(self, handle: Any, notif_msg: Any = b"") -> str:
        return self.post_answer

    def check_xfer_state(self, handle: Any) -> str:
        return self.answer

    def release_xfer_handle(self, handle: Any) -> None:
        return None

    def release_dlist_handle(self, handle: Any) -> None:
        return None

    def query_memory(self, reg_list: Any, backend: str,
                     mem_type: str | None = None) -> list[Any]:
        return [None] * len(reg_list)
