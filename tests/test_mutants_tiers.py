"""A secondary tier's input checks off the common path (docs/testing.md, "Mutation testing").

A job's block ids are checked on a fast path when they are plain ints in range; anything else
(a numpy integer, an int subclass, a value out of range) goes through ``_block_id``, which no
test reached with block 0: mutants that made block 0 out of range survived. Job ids that are an
int subclass, and the messages of a refused job id, a lookup after shutdown and a cancel of an
unknown job, were not checked either.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvfsm import TransferJob
from kvfsm.testing import FakeNixlAgent
from kvfsm.tiers import InvalidJobError, ObjectStoreTier, TierClosedError, UnknownJobError


class JobNumber(int):
    """An int subclass, as an engine's own id type may be."""


@pytest.fixture
def tier() -> Iterator[ObjectStoreTier]:
    agent = FakeNixlAgent("tiers")
    tier = ObjectStoreTier(torch.arange(32, dtype=torch.float32).view(4, 8), agent=agent)
    yield tier
    tier.shutdown(timeout=5)
    assert agent.misuses == []


def results(tier: ObjectStoreTier, count: int) -> dict[int, bool]:
    found: dict[int, bool] = {}
    for _ in range(1000):
        found.update((r.job_id, r.success) for r in tier.get_finished_jobs())
        if len(found) == count:
            break
    return found


def test_numpy_block_ids_reach_every_block_from_the_first_to_the_last(
        tier: ObjectStoreTier) -> None:
    tier.submit_store(TransferJob(1, ["a", "d"], [np.int64(0), np.int64(3)]))  # type: ignore[list-item]
    tier.submit_store(TransferJob(JobNumber(2), ["b"], [np.int32(1)]))  # type: ignore[list-item]
    assert results(tier, 2) == {1: True, 2: True}
    assert tier.state_of(2) is None


def test_a_block_id_out_of_range_is_refused_naming_the_range(tier: ObjectStoreTier) -> None:
    with pytest.raises(InvalidJobError) as refused:
        tier.submit_store(TransferJob(1, ["a", "b"], [np.int64(0), 4]))  # type: ignore[list-item]
    assert str(refused.value) == "job 1: block_ids[1] = 4 is out of range [0, 4)"
    with pytest.raises(InvalidJobError) as refused:
        tier.submit_store(TransferJob(1, ["a"], [-1]))
    assert str(refused.value) == "job 1: block_ids[0] = -1 is out of range [0, 4)"


def test_a_cancel_names_a_job_id_that_is_no_int_or_no_job(tier: ObjectStoreTier) -> None:
    with pytest.raises(InvalidJobError) as refused:
        tier.cancel("7")  # type: ignore[arg-type]
    assert str(refused.value) == "a job id is an int, got str '7'"
    with pytest.raises(UnknownJobError) as unknown:
        tier.cancel(JobNumber(99))
    assert str(unknown.value) == ("job 99 is not in flight on this tier (never submitted, or "
                                  "already published)")


def test_after_shutdown_a_lookup_is_refused_naming_the_tier_and_the_key(
        tier: ObjectStoreTier) -> None:
    tier.shutdown(timeout=5)
    with pytest.raises(TierClosedError) as refused:
        tier.lookup("k")
    assert str(refused.value) == "ObjectStoreTier is shut down; lookup('k') refused"
