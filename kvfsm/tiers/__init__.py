"""Secondary tiers with the offload-manager contract, built on the transfer lifecycle."""

from kvfsm.tiers.base import (
    DrainTimeout,
    ForgottenKeyError,
    HoldingEvent,
    InvalidJobError,
    Lookup,
    RemovalInFlightError,
    SecondaryTier,
    TierBusyError,
    TierClosedError,
    TierFullError,
    TierSaturatedError,
    UnknownJobError,
)
from kvfsm.tiers.file import FileTier
from kvfsm.tiers.object_store import ObjectStoreTier

__all__ = [
    "DrainTimeout",
    "FileTier",
    "ForgottenKeyError",
    "HoldingEvent",
    "InvalidJobError",
    "Lookup",
    "ObjectStoreTier",
    "RemovalInFlightError",
    "SecondaryTier",
    "TierBusyError",
    "TierClosedError",
    "TierFullError",
    "TierSaturatedError",
    "UnknownJobError",
]
