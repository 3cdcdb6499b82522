"""One bucket shared by two tiers and by two processes, on real NIXL and a local S3 server: one
stores while the other looks up and loads. A block is HIT elsewhere only once it is complete,
and a load never returns other bytes than the ones stored."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvfsm import TransferJob
from kvfsm.tiers import Lookup, ObjectStoreTier

from .real_nixl import S3Server, require_nixl, s3_server

__all__ = ["s3_server"]  # the fixture, imported for pytest

pytestmark = pytest.mark.nixl

BLOCKS, BLOCK_BYTES = 24, 64 * 1024


class Eager(ObjectStoreTier):
    """Asks the store again soon after a MISS, so a test need not wait long."""

    probed_miss_seconds = 0.05


def block_bytes(index: int) -> torch.Tensor:
    """What the writer stores under key ``index``: different for every block."""
    generator = torch.Generator().manual_seed(1000 + index)
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=generator)


def settle(tier: ObjectStoreTier, key: str, timeout: float = 30) -> Lookup:
    deadline = time.monotonic() + timeout
    answer = tier.lookup(key)
    while answer is Lookup.RETRY and time.monotonic() < deadline:
        time.sleep(0.005)
        answer = tier.lookup(key)
    return answer


def load_one(tier: ObjectStoreTier, key: str, job_id: int, block: int) -> bool:
    tier.submit_load(TransferJob(job_id, [key], [block], is_promotion=True))
    tier.drain_jobs(timeout=30)
    (result,) = tier.get_finished_jobs()
    return result.success


def test_a_block_another_tier_stores_is_found_after_a_miss(s3_server: S3Server) -> None:
    require_nixl()
    config = s3_server.config(s3_server.new_bucket(), key_prefix="shared/")
    writer_cache = torch.stack([block_bytes(0), block_bytes(1)])
    reader_cache = torch.zeros(2, BLOCK_BYTES, dtype=torch.uint8)
    writer = ObjectStoreTier(writer_cache, store=config)
    reader = Eager(reader_cache, store=config)
    try:
        assert settle(reader, "block-0") is Lookup.MISS, "not stored yet"
        writer.submit_store(TransferJob(1, ["block-0"], [0]))
        writer.drain_jobs(timeout=30)
        assert [r.success for r in writer.get_finished_jobs()] == [True]
        deadline = time.monotonic() + 30
        while settle(reader, "block-0") is not Lookup.HIT and time.monotonic() < deadline:
            time.sleep(0.01)
        assert settle(reader, "block-0") is Lookup.HIT, "the MISS was asked again"
        assert load_one(reader, "block-0", 1, 1)
        assert torch.equal(reader_cache[1], block_bytes(0))
    finally:
        writer.shutdown(timeout=30)
        reader.shutdown(timeout=30)


WRITER = """
import sys
import torch
from kvfsm import TransferJob
from kvfsm.nixl_agents import StoreConfig
from kvfsm.tiers import ObjectStoreTier
from tests.test_shared_store import BLOCKS, block_bytes
config = StoreConfig({bucket!r}, endpoint={endpoint!r}, access_key="kvfsm-access",
                     secret_key="kvfsm-secret", key_prefix="shared/")
cache = torch.stack([block_bytes(index) for index in range(BLOCKS)])
tier = ObjectStoreTier(cache, store=config)
for index in range(BLOCKS):
    tier.submit_store(TransferJob(index, [f"block-{{index}}"], [index]))
    tier.drain_jobs(timeout=30)
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    print(index, flush=True)
tier.shutdown(timeout=30)
"""


def test_a_reader_process_loads_only_whole_blocks_a_writer_process_is_storing(
    s3_server: S3Server,
) -> None:
    require_nixl()
    bucket = s3_server.new_bucket()
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER.format(bucket=bucket,
                                                             endpoint=s3_server.endpoint))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reader_cache = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    reader = Eager(reader_cache, store=s3_server.config(bucket, key_prefix="shared/"))
    loaded: set[int] = set()
    job_ids = iter(range(10**6))
    try:
        deadline = time.monotonic() + 120
        while len(loaded) < BLOCKS and time.monotonic() < deadline:
            for index in sorted(set(range(BLOCKS)) - loaded):
                if reader.lookup(f"block-{index}") is Lookup.HIT:
                    # HIT while the writer goes on: the object must already be whole
                    assert load_one(reader, f"block-{index}", next(job_ids), index)
                    assert torch.equal(reader_cache[index], block_bytes(index)), index
                    loaded.add(index)
            time.sleep(0.002)
        assert loaded == set(range(BLOCKS))
        _, stderr = writer.communicate(timeout=60)
        assert writer.returncode == 0, stderr[-2000:]
    finally:
        writer.kill()
        writer.wait()
        reader.shutdown(timeout=30)
