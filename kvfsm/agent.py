"""The part of NIXL's ``nixl_agent`` that kvfsm uses, as a typing protocol.

kvfsm never needs NIXL to import: any object with these methods (the real ``nixl_agent``, or
:class:`kvfsm.testing.FakeNixlAgent`) drives a tier. The call sequence is the prepped-dlist one:
register the primary memory once and prep it once; per transfer register the remote descriptors,
prep them, make the transfer, post it, poll it, release the transfer handle, release the remote
descriptor list and deregister the remote descriptors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["LOCAL_AGENT", "NixlAgent"]

#: the agent name NIXL uses for the local side of a prepped descriptor list
LOCAL_AGENT = "NIXL_INIT_AGENT"


@runtime_checkable
class NixlAgent(Protocol):
    """The subset of ``nixl._api.nixl_agent`` a tier calls."""

    name: str

    def register_memory(self, reg_list: Any, mem_type: str | None = ...) -> Any:
        """Register descriptors ``(addr, len, dev_id, meta)``; returns a registration list."""

    def deregister_memory(self, dereg_list: Any) -> None:
        """Deregister what :meth:`register_memory` returned."""

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: str | None = ...) -> Any:
        """Prepare a descriptor list; returns a handle to release with release_dlist_handle."""

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: Any,
        local_indices: Sequence[int],
        remote_xfer_side: Any,
        remote_indices: Sequence[int],
        notif_msg: bytes = ...,
    ) -> Any:
        """Make a WRITE or READ transfer between two prepped lists; returns a transfer handle."""

    def transfer(self, handle: Any) -> str:
        """Post a transfer: "PROC", "DONE" or "ERR"; may raise."""

    def check_xfer_state(self, handle: Any) -> str:
        """Poll a transfer: "PROC", "DONE" or "ERR"; raises when the transfer failed."""

    def release_xfer_handle(self, handle: Any) -> None:
        """Release a transfer handle (only once, and only once the transfer is over)."""

    def release_dlist_handle(self, handle: Any) -> None:
        """Release a prepped descriptor list handle."""
