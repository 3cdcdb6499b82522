"""Shared fixtures: a small primary KV cache, a fake NIXL agent, an object-store tier on them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvfsm.testing import FakeNixlAgent
from kvfsm.tiers import ObjectStoreTier

NUM_BLOCKS = 8
BLOCK_ELEMENTS = 64  # float32: 256 bytes a block


@pytest.fixture
def primary() -> torch.Tensor:
    """A primary cache whose every block holds distinct values."""
    return torch.arange(NUM_BLOCKS * BLOCK_ELEMENTS, dtype=torch.float32).view(
        NUM_BLOCKS, BLOCK_ELEMENTS)


@pytest.fixture
def agent() -> Iterator[FakeNixlAgent]:
    """A fake agent that must end every test with no transfer running and no misuse."""
    agent = FakeNixlAgent(name="test-agent")
    yield agent
    assert agent.misuses == [], agent.misuses
    agent.close()


@pytest.fixture
def tier(primary: torch.Tensor, agent: FakeNixlAgent) -> Iterator[ObjectStoreTier]:
    """An object-store tier on the fake agent; shut down (and checked) after the test."""
    tier = ObjectStoreTier(primary, agent=agent)
    yield tier
    tier.shutdown(timeout=5)
    assert_nothing_held_but_recorded_leaks(tier, agent)


def assert_nothing_held_but_recorded_leaks(tier: ObjectStoreTier, agent: FakeNixlAgent) -> None:
    """Every NIXL resource is released, except those a recorded leak accounts for."""
    leaked_calls = [leak.call for _, leak in tier.stats()["leaked"]]
    primary_held = 0 if tier.closed else 1  # the primary cache's registration and dlist
    assert agent.live_xfer_handles() == 0
    assert agent.live_dlist_handles() == leaked_calls.count("release_dlist_handle") + primary_held
    assert (agent.live_registrations("OBJ") > 0) == ("deregister_memory" in leaked_calls)
    assert agent.live_registrations("DRAM") == primary_held
