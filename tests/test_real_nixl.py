"""Real bytes through real NIXL: the OBJ backend against a local S3 server, POSIX to files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvfsm import TRANSFER_MACHINE, JobResult, TransferJob
from kvfsm.nixl_agents import BucketUnreachable, make_agent
from kvfsm.testing import FaultyAgent, Raise, ReturnErr, StayProc
from kvfsm.tiers import FileTier, Lookup, ObjectStoreTier, SecondaryTier
from kvfsm.trace import read_traces, replay

from .real_nixl import (
    S3Server,
    free_port,
    no_aws_credentials,
    own_s3_server,
    require_nixl,
    s3_server,
)

__all__ = ["own_s3_server", "s3_server"]  # fixtures, imported for pytest

pytestmark = pytest.mark.nixl

BLOCKS, BLOCK_BYTES = 16, 64 * 1024


@pytest.fixture
def cache() -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=generator)


@pytest.fixture
def tiers() -> Iterator[list[SecondaryTier]]:
    """Tiers a test makes; each must end with nothing in flight, and is shut down."""
    made: list[SecondaryTier] = []
    yield made
    for tier in made:
        tier.drain_jobs(timeout=120)
        assert tier.stats()["in_flight"] == {}, "nothing may be in flight at the end"
        tier.shutdown()
        assert tier.closed


def collect(tier: SecondaryTier, expected: int, timeout: float = 120) -> dict[int, JobResult]:
    """Poll until ``expected`` results arrived; a second result for a job fails the test."""
    results: dict[int, JobResult] = {}
    deadline = time.monotonic() + timeout
    while len(results) < expected and time.monotonic() < deadline:
        for result in tier.get_finished_jobs():
            assert result.job_id not in results, f"job {result.job_id} published twice"
            results[result.job_id] = result
        time.sleep(0.001)
    assert len(results) == expected, f"{expected - len(results)} results missing"
    return results


def keys(job: int, blocks: range | list[int]) -> list[str]:
    return [f"seq{job}/block{b}" for b in blocks]


# -- the object store ----------------------------------------------------------------------------

def test_object_store_round_trip_on_real_nixl(
    s3_server: S3Server, cache: torch.Tensor, tiers: list[SecondaryTier]
) -> None:
    bucket = s3_server.new_bucket()
    tier = ObjectStoreTier(cache, store=s3_server.config(bucket, key_prefix="kv/"))
    tiers.append(tier)
    original = cache.clone()
    for job in range(4):
        blocks = range(job * 4, job * 4 + 4)
        tier.submit_store(TransferJob(job, keys(0, blocks), list(blocks)))
    assert all(r.success for r in collect(tier, 4).values())

    s3 = s3_server.client()
    for block in range(BLOCKS):
        name = f"kv/{BLOCK_BYTES}-bytes/seq0/block{block}"  # the prefix, the size's folder, the key
        assert tier.object_key(f"seq0/block{block}") == name
        body = s3.get_object(Bucket=bucket, Key=name)["Body"].read()
        assert body == original[block].numpy().tobytes(), f"object of block {block}"

    cache.zero_()
    order = [5, 0, 15, 9, 2, 12, 7, 1, 14, 3, 10, 6, 13, 4, 11, 8]  # key b -> slot order[b]
    tier.submit_load(TransferJob(10, keys(0, range(BLOCKS)), order, is_promotion=True))
    assert collect(tier, 1)[10].success
    for block, slot in enumerate(order):
        assert torch.equal(cache[slot], original[block]), f"block {block} in slot {slot}"


def test_a_store_cancelled_while_its_put_runs_is_never_loaded_as_a_success(
    s3_server: S3Server, cache: torch.Tensor, tiers: list[SecondaryTier]
) -> None:
    """A second store of a key is cancelled while NIXL's PUT runs; NIXL cannot stop it, and its
    object lands whole. A load of the key submitted after the cancel returned fails: it would
    have read the cancelled store's bytes and published them as a success. The store's own
    result is a failure, and the key stays MISS until a store of it succeeds."""
    tier = ObjectStoreTier(cache, store=s3_server.config(s3_server.new_bucket()))
    tiers.append(tier)
    tier.submit_store(TransferJob(1, ["k"], [0]))
    assert collect(tier, 1)[1].success and tier.lookup("k") is Lookup.HIT
    tier.submit_store(TransferJob(2, ["k"], [1]))  # block 1's bytes differ from block 0's
    tier.cancel(2)
    assert tier.lookup("k") is Lookup.MISS, "the failure is latched: the key is not vouched for"
    time.sleep(0.5)  # (the PUT lands meanwhile)
    before = cache[2].clone()
    tier.submit_load(TransferJob(3, ["k"], [2], is_promotion=True))
    results = collect(tier, 2)
    assert results[2].success is False
    assert results[3].success is False and results[3].reason is not None
    assert "forgot" in results[3].reason.error
    assert torch.equal(cache[2], before), "nothing was read into the engine's block"
    tier.submit_store(TransferJob(4, ["k"], [0]))
    assert collect(tier, 1)[4].success and tier.lookup("k") is Lookup.HIT


def test_a_missing_object_fails_its_load_and_the_lookup_then_says_miss(
    s3_server: S3Server, cache: torch.Tensor, tiers: list[SecondaryTier]
) -> None:
    tier = ObjectStoreTier(cache, store=s3_server.config(s3_server.new_bucket()))
    tiers.append(tier)
    tier.submit_store(TransferJob(1, ["present"], [0]))
    assert collect(tier, 1)[1].success
    assert tier.lookup("present") is Lookup.HIT  # a finished store answers at once

    assert wait_for_lookup(tier, "never-stored") is Lookup.MISS  # probed in the background
    tier.submit_load(TransferJob(2, ["never-stored", "present"], [3, 4], is_promotion=True))
    result = collect(tier, 1)[2]
    assert (result.job_id, result.success) == (2, False)
    assert tier.lookup("never-stored") is Lookup.MISS
    assert tier.lookup("present") is Lookup.MISS, "F11: a failed load is not retried as a HIT"


def test_only_a_probe_agent_the_tier_made_waits_out_its_query_before_it_is_let_go_of(
    s3_server: S3Server, cache: torch.Tensor, tiers: list[SecondaryTier]
) -> None:
    """Its last reference is the tier's, so its teardown, which waits for a query's HTTP
    request holding the interpreter's lock, would come as the tier lets go of it; one the
    caller gave is the caller's to tear down (tests/test_bounds.py shows the wait itself)."""
    from kvfsm.tiers.object_store import SETTLE_SECONDS  # noqa: PLC0415

    made = ObjectStoreTier(cache, store=s3_server.config(s3_server.new_bucket()))
    tiers.append(made)
    config = s3_server.config(s3_server.new_bucket())
    given = ObjectStoreTier(cache, store=config,
                            probe_agent=make_agent("probe-given", "OBJ", config.backend_params()))
    tiers.append(given)
    assert (made._prober.settle_seconds, given._prober.settle_seconds) == (SETTLE_SECONDS, 0.0)


#: keys NIXL's S3 client would send as one object (it collapses a leading "/", "//", "/./" and
#: "x/../"), keys that only look alike, a key that reads as another's quoted name, and one
#: with a line feed (sent as it is, NIXL's request for it failed)
LOOKALIKE_KEYS = ["k", "/k", "a/b", "a//b", "a/./b", "x/../a/b", "k/", "..", "%2Fk", "%%2Fk",
                  "k%20b", "k b", "a\nb", "%a%0Ab"]


def test_keys_nixl_would_send_as_one_object_each_load_their_own_bytes(
    s3_server: S3Server, tiers: list[SecondaryTier]
) -> None:
    """Each key is stored in turn, the later ones over the earlier ones if they shared an
    object; each then loads its own block, and the keys NIXL sends as they are keep their
    names. In a bucket holding only ``a/b``, a lookup of ``a//b`` does not find it."""
    bucket = s3_server.new_bucket()
    count = len(LOOKALIKE_KEYS)
    cache = torch.stack([torch.full((4096,), index + 1, dtype=torch.uint8)
                         for index in range(count)])
    tier = ObjectStoreTier(cache, store=s3_server.config(bucket, key_prefix="kv/"))
    tiers.append(tier)
    for index, key in enumerate(LOOKALIKE_KEYS):  # one after the other: the last write wins
        tier.submit_store(TransferJob(index, [key], [index]))
        assert collect(tier, 1)[index].success, key
    names = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert len(names) == count, f"one object a key: {sorted(names)}"
    assert {f"kv/4096-bytes/{key}" for key in ("k", "a/b", "k/", "k%20b", "k b")} <= names, \
        sorted(names)
    cache.zero_()
    tier.submit_load(TransferJob(100, LOOKALIKE_KEYS, list(range(count)), is_promotion=True))
    assert collect(tier, 1)[100].success
    got = {key: int(cache[index, 0]) for index, key in enumerate(LOOKALIKE_KEYS)}
    assert got == {key: index + 1 for index, key in enumerate(LOOKALIKE_KEYS)}

    alone = s3_server.new_bucket()
    s3_server.client().put_object(Bucket=alone, Key="kv/4096-bytes/a/b", Body=b"x" * 4096)
    other = ObjectStoreTier(torch.zeros(2, 4096, dtype=torch.uint8),
                            store=s3_server.config(alone, key_prefix="kv/"))
    tiers.append(other)
    assert wait_for_lookup(other, "a/b") is Lookup.HIT
    assert wait_for_lookup(other, "a//b") is Lookup.MISS, "a//b found a/b"


def test_a_tier_of_another_block_size_on_the_same_prefix_finds_nothing_to_load_half_of(
    s3_server: S3Server, tiers: list[SecondaryTier]
) -> None:
    """Two engines of different block sizes share a bucket and a key prefix, and make the same
    key. NIXL's OBJ backend reads what an object has and answers DONE, so a tier of 8 KiB
    blocks loading a 4 KiB object published half of its block as a success: the other half
    kept what the engine had left in it. Each tier keeps its objects in a folder of its block
    size, so the larger tier finds no object of its size: a MISS, and a load that fails.
    Without the folders, the load now fails too: the block's end is still as the tier marked
    it before the load."""
    bucket = s3_server.new_bucket()
    for size_folder in (True, False):
        small = torch.full((2, 4096), 0x11, dtype=torch.uint8)
        large = torch.full((2, 8192), 0x22, dtype=torch.uint8)
        prefix = "kv/" if size_folder else "flat/"  # the old layout: the objects under the prefix
        small_tier = ObjectStoreTier(small, store=s3_server.config(bucket, key_prefix=prefix),
                                     size_folder=size_folder)
        large_tier = ObjectStoreTier(large, store=s3_server.config(bucket, key_prefix=prefix),
                                     size_folder=size_folder)
        tiers += [small_tier, large_tier]
        small_tier.submit_store(TransferJob(1, ["k"], [0]))
        assert collect(small_tier, 1)[1].success
        large_tier.submit_load(TransferJob(2, ["k"], [1], is_promotion=True))
        loaded = collect(large_tier, 1)[2]
        if size_folder:
            assert small_tier.object_key("k") == "kv/4096-bytes/k"
            assert large_tier.object_key("k") == "kv/8192-bytes/k"
            assert wait_for_lookup(large_tier, "k") is Lookup.MISS
            assert not loaded.success, "a 4 KiB object loaded into an 8 KiB block"
        else:  # without the size's folder: NIXL fills half the block and answers DONE; the
            # block still ends as the tier marked it before the load, so the load fails
            assert not loaded.success, "half a block published as a success"
            assert loaded.reason is not None and loaded.reason.call == "landed"
            assert "ShortObjectError" in loaded.reason.error
            assert bool((large[1, :4096] == 0x11).all()) and bool((large[1, 4096:] == 0x22).all())


def test_an_object_another_program_put_under_a_blocks_name_loads_only_if_it_fills_the_block(
    s3_server: S3Server, tiers: list[SecondaryTier]
) -> None:
    """Another program puts objects under a tier's names. One shorter than a block fills the
    start of the block, and NIXL answers DONE: the tier fails the load, naming the object, and
    the rest of the block is as the engine had it. One of a block's size loads. One longer
    than a block loads its first block's worth: the tier cannot tell (operations.md)."""
    size = 4096
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    bodies = {"short": b"\x01" * 100, "nearly": b"\x02" * (size - 8), "exact": b"\x03" * size,
              "long": b"\x04" * size + b"\x05" * size}
    for key, body in bodies.items():
        client.put_object(Bucket=bucket, Key=f"{size}-bytes/{key}", Body=body)
    cache = torch.full((len(bodies), size), 0x77, dtype=torch.uint8)
    tier = ObjectStoreTier(cache, store=s3_server.config(bucket))
    tiers.append(tier)
    for job, key in enumerate(bodies):
        tier.submit_load(TransferJob(job, [key], [job], is_promotion=True))
    results = collect(tier, len(bodies))
    outcomes = {key: results[job].success for job, key in enumerate(bodies)}
    assert outcomes == {"short": False, "nearly": False, "exact": True, "long": True}
    for job, key in enumerate(bodies):
        block = cache[job].numpy().tobytes()
        if key in ("short", "nearly"):
            reason = results[job].reason
            assert reason is not None and reason.call == "landed"
            assert reason.error.startswith(
                f"ShortObjectError: 1 object(s) shorter than a block of {size} bytes: "
                f"'{size}-bytes/{key}'")
            written = len(bodies[key])
            assert block == bodies[key] + b"\x77" * (size - written), "the rest as it was"
        else:
            assert block == bodies[key][:size]


def test_a_key_prefix_nixl_would_not_send_as_it_is_is_refused_before_any_agent_is_made(
    s3_server: S3Server, cache: torch.Tensor
) -> None:
    bucket = s3_server.new_bucket()
    for prefix in ("/kv/", "kv//", "kv/./", "kv/../other/", "../kv/"):
        with pytest.raises(ValueError, match=r"key_prefix .* has an empty, '\.' or '\.\.' part"):
            ObjectStoreTier(cache, store=s3_server.config(bucket, key_prefix=prefix))
    for prefix in ("", "kv/", "kv", "kv/.", "a.b/..c/"):  # sent as they are
        ObjectStoreTier(cache, store=s3_server.config(bucket, key_prefix=prefix)).shutdown()


def test_a_block_stored_again_while_its_delete_runs_on_the_store_is_stored_once_it_ended(
    s3_server: S3Server, cache: torch.Tensor, tiers: list[SecondaryTier]
) -> None:
    """A capacity of one block: b's store evicts a, and the S3 delete of a is held on its way.
    The engine stores a again meanwhile: refused, naming a (written then, the delete would have
    landed after it, and the tier would have answered HIT for an object that was gone). Once
    the delete is answered a is stored again, and its object is in the bucket and loads."""
    import threading  # noqa: PLC0415

    from kvfsm.tiers import RemovalInFlightError  # noqa: PLC0415
    from kvfsm.tiers.object_store import s3_deleter  # noqa: PLC0415

    bucket = s3_server.new_bucket()
    config = s3_server.config(bucket)
    delete = s3_deleter(config)
    sent, gate = threading.Event(), threading.Event()

    def held_delete(names: list[str]) -> int:
        sent.set()
        gate.wait()  # (the test sets it, finally too)
        return delete(names)

    tier = ObjectStoreTier(cache, store=config, capacity_bytes=BLOCK_BYTES, remove=held_delete)
    tiers.append(tier)
    original = cache.clone()
    try:
        tier.submit_store(TransferJob(1, ["a"], [0]))
        assert collect(tier, 1)[1].success
        tier.submit_store(TransferJob(2, ["b"], [1]))
        assert collect(tier, 1)[2].success
        assert sent.wait(30)
        with pytest.raises(RemovalInFlightError, match=f"store of {tier.object_key('a')} refused"):
            tier.submit_store(TransferJob(3, ["a"], [0]))
    finally:
        gate.set()
    assert tier.wait_for_removals(30)
    listed = s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    assert [o["Key"] for o in listed] == [tier.object_key("b")]

    tier.submit_store(TransferJob(4, ["a"], [0]))
    assert collect(tier, 1)[4].success
    assert tier.wait_for_removals(30)  # b's delete, evicted by it
    listed = s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    assert [o["Key"] for o in listed] == [tier.object_key("a")]
    assert tier.lookup("a") is Lookup.HIT
    cache[5].zero_()
    tier.submit_load(TransferJob(5, ["a"], [5], is_promotion=True))
    assert collect(tier, 1)[5].success
    assert torch.equal(cache[5], original[0])


def test_a_failed_load_writes_nothing_into_its_blocks_once_its_failure_is_published(
    s3_server: S3Server, tiers: list[SecondaryTier]
) -> None:
    """NIXL 1.5.1's OBJ backend answers a transfer's state check with the error of one failed
    request (the missing object) while its other requests still run. The job is published as
    failed only once NIXL wrote all it was going to: the engine then takes its blocks back
    (here: fills them), and nothing lands in them afterwards."""
    blocks, size = 8, 4 << 20
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    for block in range(1, blocks):
        client.put_object(Bucket=bucket, Key=f"{size}-bytes/b{block}", Body=b"\xab" * size)
    cache = torch.zeros(blocks, size, dtype=torch.uint8)
    tier = ObjectStoreTier(cache, store=s3_server.config(bucket))
    tiers.append(tier)
    tier.submit_load(TransferJob(1, [f"b{block}" for block in range(blocks)],
                                 list(range(blocks)), is_promotion=True))
    result = collect(tier, 1)[1]
    assert result.success is False
    assert result.reason is not None and result.reason.call == "check_xfer_state"

    cache.fill_(0x11)  # the engine reuses the blocks of a failed load
    time.sleep(0.5)
    changed = [block for block in range(blocks) if not bool((cache[block] == 0x11).all())]
    assert changed == [], f"NIXL wrote into blocks {changed} after the failure was published"


def logged(caplog: pytest.LogCaptureFixture, text: str, timeout: float = 15) -> str:
    """The first record logged that holds ``text``, waited for (a thread of the tier's logs
    it); fails the test when none came by ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r.getMessage() for r in caplog.records if text in r.getMessage()]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no record holding {text!r} within {timeout} s: "
                         f"{[r.getMessage() for r in caplog.records]}")


def test_a_request_the_store_refused_says_where_it_went_and_the_bucket_is_checked(
    s3_server: S3Server, tiers: list[SecondaryTier], caplog: pytest.LogCaptureFixture
) -> None:
    """NIXL's OBJ backend fails a load of an object that is not there and a store into a
    bucket that is gone alike: ``nixlBackendError: NIXL_ERR_BACKEND``, all a job's reason
    said. It now names the bucket and endpoint and what it may have been, and a check of the
    bucket after the failure logs which of the two it was."""
    caplog.set_level("WARNING", logger="kvfsm")
    cache = torch.zeros(4, 4096, dtype=torch.uint8)
    bucket = s3_server.new_bucket()
    tier = ObjectStoreTier(cache, store=s3_server.config(bucket))
    tiers.append(tier)
    tier.submit_load(TransferJob(1, ["never-stored"], [0], is_promotion=True))
    reason = str(collect(tier, 1)[1].reason)
    assert reason == (f"check_xfer_state raised nixlBackendError: NIXL_ERR_BACKEND (a request "
                      f"to bucket {bucket!r} at {s3_server.endpoint}; NIXL's OBJ backend says "
                      "no more: an object may not be there, the bucket may be missing or "
                      "unreachable, or the credentials refused; the tier checks the bucket, "
                      "and logs what it answers)"), reason
    assert f"bucket {bucket!r} at {s3_server.endpoint} answers (it is there)" in logged(
        caplog, "the load of job 1 failed with NIXL_ERR_BACKEND; the bucket check after it")

    gone = s3_server.new_bucket()
    other = ObjectStoreTier(cache, store=s3_server.config(gone))
    tiers.append(other)
    s3_server.client().delete_bucket(Bucket=gone)
    other.submit_store(TransferJob(2, ["k1", "k2"], [1, 2]))
    reason = str(collect(other, 1)[2].reason)
    assert (f"(a request to bucket {gone!r} at {s3_server.endpoint}; NIXL's OBJ backend says "
            "no more: the bucket may be missing") in reason, reason
    assert f"bucket {gone!r} at {s3_server.endpoint} does not exist (HTTP 404)" in logged(
        caplog, "the store of job 2 failed with NIXL_ERR_BACKEND; the bucket check after it")


def wait_for_lookup(tier: SecondaryTier, key: str, timeout: float = 30) -> Lookup:
    deadline = time.monotonic() + timeout
    answer = tier.lookup(key)
    while answer is Lookup.RETRY and time.monotonic() < deadline:
        time.sleep(0.01)
        answer = tier.lookup(key)
    return answer


def test_lookups_probe_objects_another_process_stored(
    s3_server: S3Server, cache: torch.Tensor, tiers: list[SecondaryTier]
) -> None:
    bucket = s3_server.new_bucket()
    s3_server.client().put_object(Bucket=bucket, Key=f"{BLOCK_BYTES}-bytes/elsewhere",
                                  Body=b"x" * BLOCK_BYTES)
    tier = ObjectStoreTier(cache, store=s3_server.config(bucket))
    tiers.append(tier)
    assert tier.lookup("elsewhere") is Lookup.RETRY, "the caller never waits on S3"
    assert wait_for_lookup(tier, "elsewhere") is Lookup.HIT
    assert tier.probe_errors == 0


def test_a_failed_release_on_real_nixl_is_retried_and_publishes_once(
    s3_server: S3Server, cache: torch.Tensor, tiers: list[SecondaryTier]
) -> None:
    config = s3_server.config(s3_server.new_bucket())
    agent = FaultyAgent(make_agent("faulty-obj", "OBJ", config.backend_params()))
    agent.inject("release_xfer_handle", Raise(), times=2)
    agent.inject("check_xfer_state", Raise(), at=1)
    tier = ObjectStoreTier(cache, agent=agent)
    tiers.append(tier)
    tier.submit_store(TransferJob(1, ["a", "b"], [0, 1]))
    results = collect(tier, 1)
    assert results[1].success is False, "the injected state-check failure is the verdict"
    assert agent.call_count("release_xfer_handle") == 2 + 2, "two raised; then each block's " \
                                                              "transfer released once"
    assert tier.stats()["retries"] == 2


def test_an_agent_of_a_backend_nixl_lacks_or_an_object_store_without_its_settings_is_named(
) -> None:
    """NIXL answered both with a bare code: NIXL_ERR_NOT_FOUND, NIXL_ERR_BACKEND."""
    require_nixl()
    with pytest.raises(ValueError, match=r"make_agent: NIXL has no backend 'S3'; it has .*OBJ"):
        make_agent("no-such-backend", "S3")
    with pytest.raises(ValueError, match=r"NIXL has no backend 'posix' \(its names are in "
                                         r"capitals: 'POSIX'\)"):
        make_agent("lowercase-backend", "posix")
    with pytest.raises(ValueError, match=r"make_agent: the OBJ backend needs the store's "
                                         r"parameters: make_agent\(name, 'OBJ', StoreConfig"):
        make_agent("obj-without-settings", "OBJ")


def test_a_tier_given_an_agent_without_its_backend_is_refused_naming_what_it_needs(
    s3_server: S3Server, cache: torch.Tensor, tmp_path: Path
) -> None:
    """An object store tier on a POSIX agent, or a file tier on a UCX one, was taken, and every
    job then failed with a bare NIXL_ERR_NOT_FOUND from register_memory. Refused now, before
    anything is registered or created."""
    posix, ucx = make_agent("posix-for-obj", "POSIX"), make_agent("ucx-for-files", "UCX")
    with pytest.raises(ValueError, match=r"ObjectStoreTier: agent 'posix-for-obj' has no backend "
                                         r"for OBJ memory \(its backends and what they move: "
                                         r"POSIX: .*FILE.*\); it needs OBJ with the store's"):
        ObjectStoreTier(cache, agent=posix)
    root = tmp_path / "blocks"
    with pytest.raises(ValueError, match=r"FileTier: agent 'ucx-for-files' has no backend for "
                                         r"FILE memory .*UCX: .*DRAM.*; it needs POSIX"):
        FileTier(cache, root, agent=FaultyAgent(ucx))  # a wrapper says what its agent has
    assert not root.exists(), "nothing created"
    objects = make_agent("obj-right", "OBJ", s3_server.config(s3_server.new_bucket())
                         .backend_params())
    with pytest.raises(ValueError, match=r"ObjectStoreTier's probe_agent: agent 'posix-for-obj' "
                                         r"has no backend for OBJ memory"):
        ObjectStoreTier(cache, agent=objects, probe_agent=posix)
    tier = ObjectStoreTier(cache, agent=objects, probe_agent=objects)  # the right ones
    tier.shutdown()
    FileTier(cache, root, agent=posix, durable=False).shutdown()


def test_the_bucket_is_checked_at_start_up(s3_server: S3Server, cache: torch.Tensor) -> None:
    with pytest.raises(BucketUnreachable, match=r"bucket 'no-such-bucket' at .* does not exist"):
        ObjectStoreTier(cache, store=s3_server.config("no-such-bucket"))
    port = free_port()  # nothing listens there
    dead = S3Server(port).config("kvfsm-any")
    with pytest.raises(BucketUnreachable, match=rf"cannot reach bucket 'kvfsm-any' at "
                                                rf"http://127.0.0.1:{port}"):
        ObjectStoreTier(cache, store=dead)


def test_a_tier_made_where_no_credentials_are_found_says_so_as_a_python_warning(
    s3_server: S3Server, cache: torch.Tensor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvfsm's logger has no handler unless the engine sets one up, so a log line alone went
    unseen, and every transfer then failed with NIXL_ERR_BACKEND, naming no cause. Making the
    tier now warns, pointing at the line that made it; with credentials it does not."""
    import warnings  # noqa: PLC0415

    from kvfsm.nixl_agents import NoCredentialsWarning, StoreConfig  # noqa: PLC0415

    no_aws_credentials(monkeypatch, tmp_path)
    bucket = s3_server.new_bucket()
    with pytest.warns(NoCredentialsWarning, match=r"no S3 credentials found .* every transfer "
                                                  "will fail with NIXL_ERR_BACKEND") as caught:
        tier = ObjectStoreTier(cache, store=StoreConfig(bucket, endpoint=s3_server.endpoint))
    tier.shutdown()
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoCredentialsWarning)
        ObjectStoreTier(cache, store=s3_server.config(bucket)).shutdown()


def test_the_s3_server_killed_mid_run_gives_failed_results_and_no_crash(
    own_s3_server: S3Server, cache: torch.Tensor, tiers: list[SecondaryTier]
) -> None:
    """Every job publishes exactly once; those cut off fail (NIXL's client retries ~25 s)."""
    config = own_s3_server.config(own_s3_server.new_bucket(), io_threads=32)
    tier = ObjectStoreTier(cache, store=config)
    tiers.append(tier)
    tier.submit_store(TransferJob(0, ["first"], [0]))
    assert collect(tier, 1)[0].success
    for job in range(1, BLOCKS):
        tier.submit_store(TransferJob(job, [f"key{job}"], [job]))
    own_s3_server.stop()

    results = collect(tier, BLOCKS - 1, timeout=180)
    assert sorted(results) == list(range(1, BLOCKS))
    assert not all(r.success for r in results.values()), "some stores were cut off"
    assert not tier.has_pending_work()
    assert tier.get_finished_jobs() == []


def test_a_process_that_used_real_nixl_exits_cleanly(s3_server: S3Server, tmp_path: Path) -> None:
    """Stores, loads and shuts down in a child process, which must exit 0 (no SIGSEGV)."""
    script = textwrap.dedent(f"""
        import torch
        from kvfsm import TransferJob
        from kvfsm.nixl_agents import StoreConfig
        from kvfsm.tiers import FileTier, ObjectStoreTier
        cache = torch.ones(8, 4096, dtype=torch.uint8)
        config = StoreConfig({s3_server.new_bucket()!r}, endpoint={s3_server.endpoint!r},
                             access_key="kvfsm-access", secret_key="kvfsm-secret")
        for tier in (ObjectStoreTier(cache, store=config), FileTier(cache, {str(tmp_path)!r})):
            tier.submit_store(TransferJob(1, ["a", "b"], [0, 1]))
            tier.drain_jobs(timeout=60)
            tier.submit_store(TransferJob(2, ["c"], [2]))  # still running at shutdown
            tier.shutdown(timeout=60)
            results = {{r.job_id: r.success for r in tier.get_finished_jobs()}}
            assert results == {{1: True, 2: False}}, results
        print("clean")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "clean"


def test_a_trace_of_a_real_nixl_run_replays_clean(tmp_path: Path) -> None:
    require_nixl()
    traces = tmp_path / "traces.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "kvfsm", "demo", "--blocks", "32", "--block-kib", "4",
         "--blocks-per-job", "4", "--trace", str(traces),
         "--inject-faults", "release_xfer_handle:raise*2,check_xfer_state:err@3"],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    recorded = list(read_traces(traces))
    assert len(recorded) == 16, "8 stores and 8 loads"
    assert {tuple(s[:4]) for t in recorded for s in t["steps"]} >= {
        ("release", "RAISED", "DONE", "DONE"), ("poll", "ERR", "PROCESSING", "FAILED")}
    assert [replay(TRANSFER_MACHINE, t) for t in recorded] == [None] * 16


# -- the file tier -------------------------------------------------------------------------------

@pytest.fixture
def file_tier(cache: torch.Tensor, tmp_path: Path, tiers: list[SecondaryTier]) -> FileTier:
    require_nixl()
    tier = FileTier(cache, tmp_path / "blocks")
    tiers.append(tier)
    return tier


def test_file_tier_round_trip_on_real_nixl(file_tier: FileTier, cache: torch.Tensor) -> None:
    original = cache.clone()
    file_tier.submit_store(TransferJob(1, keys(0, range(BLOCKS)), list(range(BLOCKS))))
    assert collect(file_tier, 1)[1].success
    for block in range(BLOCKS):
        path = file_tier.path_of(f"seq0/block{block}")
        assert path.read_bytes() == original[block].numpy().tobytes()
    assert not list(file_tier.root.glob(".kvfsm-partial-*"))

    cache.zero_()
    order = list(reversed(range(BLOCKS)))
    file_tier.submit_load(TransferJob(2, keys(0, range(BLOCKS)), order, is_promotion=True))
    assert collect(file_tier, 1)[2].success
    assert torch.equal(cache, original.flip(0))


def test_a_store_that_fails_never_leaves_a_block_that_reads_as_valid(
    cache: torch.Tensor, tmp_path: Path, tiers: list[SecondaryTier]
) -> None:
    require_nixl()
    agent = FaultyAgent(make_agent("faulty-posix", "POSIX"))
    tier = FileTier(cache, tmp_path, agent=agent)
    tiers.append(tier)
    original = cache.clone()
    tier.submit_store(TransferJob(1, ["kept"], [0]))
    assert collect(tier, 1)[1].success

    cache[0] = 0  # new content for the same key, whose store fails after NIXL wrote it
    agent.inject("check_xfer_state", Raise())
    tier.submit_store(TransferJob(2, ["kept", "new"], [0, 1]))
    assert collect(tier, 1)[2].success is False
    assert tier.path_of("kept").read_bytes() == original[0].numpy().tobytes(), "old block intact"
    assert not tier.path_of("new").exists()
    assert not list(tmp_path.glob(".kvfsm-partial-*")), "a failed store's temporary files go"
    assert tier.lookup("new") is Lookup.MISS


def test_a_faulty_agent_over_real_nixl_keeps_no_released_handle_and_still_catches_a_second(
    cache: torch.Tensor, tmp_path: Path, tiers: list[SecondaryTier]
) -> None:
    """FaultyAgent used to keep every released transfer handle alive (so that an id is never
    reused), which grew without bound over a long run. NIXL's own handles keep a released flag:
    that is what catches a second release now, and nothing is kept."""
    require_nixl()
    agent = FaultyAgent(make_agent("faulty-keep", "POSIX"))
    tier = FileTier(cache, tmp_path, agent=agent, durable=False)
    tiers.append(tier)
    for job_id in range(50):
        tier.submit_store(TransferJob(job_id, [f"k{job_id}"], [job_id % len(cache)]))
        assert collect(tier, 1)[job_id].success
    assert agent._keep == [] and agent._released == set()
    agent.inject("transfer", StayProc(2))  # running after submit: its handle can be seen
    tier.submit_store(TransferJob(99, ["last"], [0]))
    transfer = tier.transfer_of(99)
    assert transfer is not None
    handle = transfer.xfer
    assert collect(tier, 1)[99].success  # released by the tier, once
    with pytest.raises(RuntimeError, match="already released"):
        agent.release_xfer_handle(handle)
    assert agent.misuses and "released twice" in agent.misuses[0]


def test_a_load_of_a_missing_file_publishes_one_failure(
    file_tier: FileTier, cache: torch.Tensor
) -> None:
    file_tier.submit_load(TransferJob(1, ["absent"], [0], is_promotion=True))
    result = collect(file_tier, 1)[1]
    assert (result.success, result.transfer_size) == (False, 0)
    assert file_tier.stats()["leaks"] == 0
    assert file_tier.lookup("absent") is Lookup.MISS


def test_a_truncated_block_file_fails_its_load(file_tier: FileTier, cache: torch.Tensor) -> None:
    file_tier.submit_store(TransferJob(1, ["whole"], [0]))
    assert collect(file_tier, 1)[1].success
    path = file_tier.path_of("whole")
    os.truncate(path, BLOCK_BYTES // 2)  # damaged outside kvfsm
    file_tier.submit_load(TransferJob(2, ["whole"], [1], is_promotion=True))
    assert collect(file_tier, 1)[2].success is False
    assert file_tier.lookup("whole") is Lookup.MISS


@pytest.mark.parametrize("kind", ["objects", "files"])
def test_a_store_nixl_reported_as_failed_is_a_miss_in_either_tier_even_if_it_landed(
    kind: str, s3_server: S3Server, cache: torch.Tensor, tmp_path: Path,
    tiers: list[SecondaryTier],
) -> None:
    """One rule for both tiers (docs/lifecycle.md): after a failed store the tier cannot vouch
    for what it holds under the job's keys, so they are MISS. Here NIXL really wrote the block,
    then the state check answered ERR: the object tier used to find the object and say HIT."""
    tier: SecondaryTier
    if kind == "objects":
        config = s3_server.config(s3_server.new_bucket())
        agent = FaultyAgent(make_agent("err-after-put", "OBJ", config.backend_params()))
        tier = ObjectStoreTier(cache, agent=agent,
                               probe_agent=make_agent("err-probe", "OBJ", config.backend_params()))
    else:
        agent = FaultyAgent(make_agent("err-after-write", "POSIX"))
        tier = FileTier(cache, tmp_path / "blocks", agent=agent)
    tiers.append(tier)
    agent.inject("transfer", StayProc(1))  # posted for real; polled...
    agent.inject("check_xfer_state", ReturnErr())  # ...and ERR once NIXL finished the write
    tier.submit_store(TransferJob(1, ["landed"], [0]))
    assert collect(tier, 1)[1].success is False
    assert tier.lookup("landed") is Lookup.MISS
    assert wait_for_lookup(tier, "landed") is Lookup.MISS
