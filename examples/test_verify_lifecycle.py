"""The verify lifecycle runs in both tiers on real NIXL; a corrupted block fails its load."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from examples.verify_lifecycle import VERIFY_MACHINE, Checksums, VerifyState
from kvfsm import FailureKind, JobResult, TransferJob
from kvfsm.driver import MachineRefused
from kvfsm.testing import FakeNixlAgent
from kvfsm.testing.explore import Invariant, explore, parse_path, replay
from kvfsm.tiers import FileTier, ObjectStoreTier
from kvfsm.tiers.base import SecondaryTier
from tests.real_nixl import S3Server, require_nixl, s3_server

__all__ = ["s3_server"]  # a fixture, imported for pytest

BLOCKS, BLOCK_BYTES = 8, 4096


@pytest.fixture
def cache() -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    return torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=generator)


def results(tier: SecondaryTier, expected: int, timeout: float = 60) -> dict[int, JobResult]:
    found: dict[int, JobResult] = {}
    deadline = time.monotonic() + timeout
    while len(found) < expected and time.monotonic() < deadline:
        found.update((r.job_id, r) for r in tier.get_finished_jobs())
        time.sleep(0.001)
    assert len(found) == expected, f"{expected - len(found)} results missing"
    return found


def store_corrupt_load(tier: SecondaryTier, cache: torch.Tensor,
                       corrupt: object) -> dict[int, JobResult]:
    """Store blocks 0-3 as a..d, corrupt b in the store, load all four into blocks 4-7."""
    keys = ["a", "b", "c", "d"]
    tier.submit_store(TransferJob(1, keys, [0, 1, 2, 3]))
    assert results(tier, 1)[1].success
    corrupt("b")  # type: ignore[operator]
    tier.submit_load(TransferJob(2, ["a", "c"], [4, 5], is_promotion=True))
    tier.submit_load(TransferJob(3, ["b", "d"], [6, 7], is_promotion=True))
    return results(tier, 2)


def assert_the_corrupted_load_failed(found: dict[int, JobResult], cache: torch.Tensor,
                                     name: str = "b") -> None:
    assert found[2].success, found[2].reason
    assert torch.equal(cache[4], cache[0]) and torch.equal(cache[5], cache[2])
    failed = found[3]
    assert not failed.success
    assert failed.reason is not None and failed.reason.kind is FailureKind.ERR
    assert failed.reason.call == "verify"
    assert f"answered MISMATCH: checksum mismatch in block 6 ({name})" in str(failed.reason)


@pytest.fixture
def file_tier(cache: torch.Tensor, tmp_path: Path) -> Iterator[FileTier]:
    require_nixl()
    tier = FileTier(cache, tmp_path, machine=VERIFY_MACHINE, steps={"verify": Checksums()})
    yield tier
    tier.shutdown()


@pytest.mark.nixl
def test_a_corrupted_file_fails_its_load_with_a_mismatch_on_real_nixl(
        file_tier: FileTier, cache: torch.Tensor) -> None:
    def corrupt(key: str) -> None:
        path = file_tier.path_of(key)
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF
        path.write_bytes(bytes(data))

    found = store_corrupt_load(file_tier, cache, corrupt)
    assert_the_corrupted_load_failed(found, cache)
    assert file_tier.stats()["in_flight"] == {}


@pytest.mark.nixl
def test_a_corrupted_object_fails_its_load_with_a_mismatch_on_real_nixl(
        s3_server: S3Server, cache: torch.Tensor) -> None:
    bucket = s3_server.new_bucket()
    tier = ObjectStoreTier(cache, store=s3_server.config(bucket, key_prefix="kv/"),
                           machine=VERIFY_MACHINE, steps={"verify": Checksums()})
    s3 = s3_server.client()

    def corrupt(key: str) -> None:
        name = tier.object_key(key)  # "kv/<block bytes>-bytes/<key>"
        body = bytearray(s3.get_object(Bucket=bucket, Key=name)["Body"].read())
        body[0] ^= 0x01
        s3.put_object(Bucket=bucket, Key=name, Body=bytes(body))

    try:
        assert_the_corrupted_load_failed(store_corrupt_load(tier, cache, corrupt), cache,
                                         f"kv/{BLOCK_BYTES}-bytes/b")
    finally:
        tier.shutdown()


def test_on_the_fake_agent_the_transfer_passes_through_verifying(cache: torch.Tensor) -> None:
    agent = FakeNixlAgent(name="verify")
    checksums = Checksums()
    tier = ObjectStoreTier(cache, agent=agent, machine=VERIFY_MACHINE,
                           steps={"verify": checksums})

    def corrupt(key: str) -> None:
        name = tier.object_key(key)
        agent.objects[name] = bytes([agent.objects[name][0] ^ 1]) + agent.objects[name][1:]

    assert_the_corrupted_load_failed(store_corrupt_load(tier, cache, corrupt), cache,
                                     f"{BLOCK_BYTES}-bytes/b")
    assert set(checksums.crcs) == {f"{BLOCK_BYTES}-bytes/{key}" for key in "abcd"}
    taken = {(e.source, e.event, e.dest): n
             for e, n in tier.machine.transition_counts().items() if n}
    assert taken[("PROCESSING", "poll", "VERIFYING")] == 3
    assert taken[("VERIFYING", "verify", "FAILED")] == 1
    tier.shutdown()
    assert agent.misuses == []


def test_a_load_of_a_block_nobody_recorded_fails_and_a_step_that_raises_fails_its_job(
        cache: torch.Tensor) -> None:
    agent = FakeNixlAgent(name="verify")
    # stored by someone else, as a block of this size: no checksum
    agent.objects[f"{BLOCK_BYTES}-bytes/elsewhere"] = bytes(BLOCK_BYTES)

    def broken(transfer: object, primary: torch.Tensor) -> object:
        raise OSError("the checksum index is gone")

    for step, reason in ((Checksums(), "none recorded"),
                         (broken, "verify raised OSError: the checksum index is gone")):
        tier = ObjectStoreTier(cache, agent=agent, machine=VERIFY_MACHINE,
                               steps={"verify": step})
        tier.submit_load(TransferJob(1, ["elsewhere"], [0], is_promotion=True))
        result = results(tier, 1)[1]
        assert not result.success and reason in str(result.reason)
        tier.shutdown()


def test_the_explorer_fails_the_step_too_and_finds_no_violation() -> None:
    found = explore(VERIFY_MACHINE, steps={"verify": Checksums()}, stop_at_first=False)
    assert found.ok, found.report()
    assert found.paths > 1000
    calls, violations, taken = replay(parse_path("mode=1;verify:raise@1"), VERIFY_MACHINE,
                                      steps={"verify": Checksums()})
    assert violations == [] and "verify" in calls
    assert taken["VERIFYING -verify[unverified]-> FAILED"] >= 1


def test_the_explorer_catches_a_verify_lifecycle_that_ignores_a_mismatch() -> None:
    from kvfsm import Declaration  # noqa: PLC0415

    lenient = Declaration(
        "lenient_verify", states=VerifyState, initial=VerifyState.SUBMITTED,
        answers=VERIFY_MACHINE.answers, guards=VERIFY_MACHINE.guards,
        actions=VERIFY_MACHINE.actions,
        transitions=[{**t, "dest": VerifyState.DONE, "after": "latch_success"}
                     if t.get("conditions") == "unverified" else t
                     for t in VERIFY_MACHINE.transitions],
        final=VERIFY_MACHINE.final, failure_states=VERIFY_MACHINE.failure_states,
        effects=VERIFY_MACHINE.effects, running=VERIFY_MACHINE.running)
    found = explore(lenient, steps={"verify": Checksums()})
    assert Invariant.OUTCOME in {v.invariant for v in found.violations}, found.report()
    shortest = found.violations[0]  # NIXL finished it, the check failed: what it says
    assert shortest.detail == ("NIXL said the transfer finished (DONE), then a step failed it, "
                               "so the job must publish success=False; it published "
                               "success=True"), found.report()


def test_without_its_step_the_machine_is_refused_before_any_nixl_call(
        cache: torch.Tensor) -> None:
    agent = FakeNixlAgent(name="verify")
    with pytest.raises(MachineRefused, match="machine 'verify': state VERIFYING waits on effect "
                       "'verify', which the tier does not make"):
        ObjectStoreTier(cache, agent=agent, machine=VERIFY_MACHINE)
    assert agent.calls == []


def test_the_tutorial_declares_the_machine_word_for_word_as_this_example_does() -> None:
    """docs/tutorial.md shows the declaration as a block it runs; it is this module's."""
    root = Path(__file__).resolve().parent.parent
    example = (root / "examples" / "verify_lifecycle.py").read_text()
    tutorial = (root / "docs" / "tutorial.md").read_text()
    block = tutorial.split("```python\n", 1)[1].split("```\n", 1)[0]
    imports, _, declaration = block.partition("\n\n\n")
    assert "VERIFY_MACHINE: Declaration[Any, Any] = TRANSFER_MACHINE.extend(" in declaration
    assert len(declaration.strip().splitlines()) <= 32  # the machine in about 30 lines
    assert declaration in example
    lines = example.splitlines()
    assert [line for line in imports.splitlines() if line and line not in lines] == []
