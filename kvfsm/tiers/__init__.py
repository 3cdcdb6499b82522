"""Secondary tiers with the offload-manager contract, built on the transfer lifecycle."""

from kvfsm.tiers.base import (
    DrainTimeout,
    InvalidJobError,
    Lookup,
    SecondaryTier,
    TierClosedError,
    UnknownJobError,
)
from kvfsm.tiers.file import FileTier
from kvfsm.tiers.object_store import ObjectStoreTier

__all__ = [
    "DrainTimeout",
    "FileTier",
    "InvalidJobError",
    "Lookup",
    "ObjectStoreTier",
    "SecondaryTier",
    "TierClosedError",
    "UnknownJobError",
]
