"""Secondary tiers with the offload-manager contract, built on the transfer lifecycle."""

from kvfsm.tiers.base import DrainTimeout, InvalidJobError, SecondaryTier, TierClosedError
from kvfsm.tiers.object_store import ObjectStoreTier

__all__ = ["DrainTimeout", "InvalidJobError", "ObjectStoreTier", "SecondaryTier", "TierClosedError"]
