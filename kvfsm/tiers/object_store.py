"""An object-store secondary tier: one object per KV block, over NIXL's OBJ backend."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvfsm.agent import NixlAgent
from kvfsm.tiers.base import InvalidJobError, SecondaryTier

__all__ = ["ObjectStoreTier"]

# NIXL's OBJ backend maps a descriptor's device id to its object key, so every descriptor
# registered at the same time needs its own id; they are reused only after 2**31 registrations.
_DEV_ID_SPACE = 2**31


class ObjectStoreTier(SecondaryTier):
    """Stores each block as one object, named ``key_prefix`` + the block key.

    Args:
        primary: the primary KV cache (contiguous CPU tensor, blocks on the first dimension).
        agent: a NIXL agent with the OBJ backend, or a :class:`kvfsm.testing.FakeNixlAgent`.
        key_prefix: prepended to every object name.
        poll_interval: seconds :meth:`drain_jobs` sleeps between polls.
    """

    remote_mem_type = "OBJ"

    def __init__(self, primary: torch.Tensor, *, agent: NixlAgent, key_prefix: str = "",
                 poll_interval: float = 0.0005) -> None:
        if not isinstance(key_prefix, str):
            raise ValueError(f"key_prefix must be a str, got {type(key_prefix).__name__}")
        self.key_prefix = key_prefix
        self._dev_ids = itertools.count()
        super().__init__(primary, agent=agent, poll_interval=poll_interval)

    def object_key(self, key: bytes | str) -> str:
        """The object name block ``key`` is stored under: str keys as they are, bytes in hex."""
        if isinstance(key, str):
            return self.key_prefix + key
        if isinstance(key, bytes):
            return self.key_prefix + key.hex()
        raise InvalidJobError(f"a key must be bytes or str, got {type(key).__name__} {key!r}")

    def _remote_descs(self, keys: Sequence[bytes | str]) -> list[tuple[int, int, int, str]]:
        dev_ids = self._dev_ids
        return [(0, self.block_bytes, next(dev_ids) % _DEV_ID_SPACE, self.object_key(key))
                for key in keys]
