"""An object store that stops answering (SIGSTOP: connections accepted, never answered), on real
NIXL: every call of the tier keeps its bound, nothing is lost, and the process exits cleanly.

Measured on NIXL 1.5.1: against such a server a ``query_memory`` gives up on its keys one after
the other, 30 s each, and a transfer stays PROC until the server answers again.
"""

from __future__ import annotations

import select
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch

from kvfsm import TransferJob
from kvfsm.policy import RetryPolicy
from kvfsm.tiering import CPUPrimaryTier, Finalized, OutOfBlocksError, TieringManager
from kvfsm.tiers import DrainTimeout, Lookup, ObjectStoreTier

from .real_nixl import S3Server, free_port, require_nixl

pytestmark = pytest.mark.nixl


@pytest.fixture
def server() -> Iterator[S3Server]:
    require_nixl()
    server = S3Server(free_port())
    server.start()
    yield server
    server.thaw()
    server.stop()


def test_with_the_store_frozen_submit_poll_drain_and_shutdown_keep_their_bounds(
    server: S3Server,
) -> None:
    cache = torch.arange(8 * 4096, dtype=torch.int32).view(8, 4096).to(torch.uint8)
    tier = ObjectStoreTier(cache, store=server.config(server.new_bucket()))
    tier.submit_store(TransferJob(1, ["before"], [0]))
    tier.drain_jobs(timeout=30)
    assert [r.success for r in tier.get_finished_jobs()] == [True]

    server.freeze()
    for index in range(20):
        assert tier.lookup(f"unknown-{index}") is Lookup.RETRY  # probes that will hang
    tier.submit_store(TransferJob(2, ["during"], [1]))
    assert tier.get_finished_jobs() == []
    assert tier.lookup("before") is Lookup.HIT, "what the tier knows needs no probe"
    with pytest.raises(DrainTimeout, match="job 2: PROCESSING"):
        tier.drain_jobs(timeout=0.2)
    with pytest.raises(DrainTimeout, match="NIXL still runs these"):
        tier.shutdown(timeout=0.3)
    assert tier.state_of(2) is not None, "never given up while NIXL may still run it"

    server.thaw()
    tier.shutdown(timeout=60)
    assert tier.closed
    results = tier.get_finished_jobs()
    assert [(r.job_id, r.success) for r in results] == [(2, False)], "cancelled: one failure"


EXIT_SCRIPT = """
import sys, threading, time
import torch
from kvfsm.nixl_agents import StoreConfig
from kvfsm.tiers import ObjectStoreTier
config = StoreConfig({bucket!r}, endpoint={endpoint!r}, access_key="kvfsm-access",
                     secret_key="kvfsm-secret")
tier = ObjectStoreTier(torch.zeros(4, 1024, dtype=torch.uint8), store=config)
print("frozen?", flush=True)
sys.stdin.readline()
for index in range(5):
    tier.lookup(f"unknown-{{index}}")
time.sleep(0.3)  # the prober is inside query_memory now
if {shut_down}:
    tier.shutdown(timeout=0.5)
del tier
asking = [t for t in threading.enumerate() if t.name == "kvfsm-object-probe" and t.is_alive()]
print(f"returned; probes still asking: {{len(asking)}}", flush=True)
"""


@pytest.mark.parametrize("shut_down", [True, False], ids=["shut-down", "dropped"])
def test_a_process_exits_cleanly_with_a_lookup_probe_hanging_on_a_frozen_store(
    server: S3Server, shut_down: bool
) -> None:
    """The probe's thread is waited for at exit (a daemon thread inside query_memory aborts the
    interpreter's exit); shutdown and dropping the tier do not wait for it."""
    script = EXIT_SCRIPT.format(bucket=server.new_bucket(), endpoint=server.endpoint,
                                shut_down=shut_down)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "frozen?"
        server.freeze()
        child.stdin.write("go\n")
        child.stdin.flush()
        # while the server is still frozen: a call that waited for the probe would not return
        # before NIXL gives up on the query (30 s a key)
        ready, _, _ = select.select([child.stdout], [], [], 20)
        assert ready, "shutdown or dropping the tier waited for the hanging probe"
        assert child.stdout.readline().strip() == "returned; probes still asking: 1"
        server.thaw()  # the probe in flight is answered, and the process may end
        _, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, stderr[-2000:]
    assert "terminate called" not in stderr


def test_a_store_given_up_while_the_store_is_frozen_keeps_its_block_and_lands_its_bytes(
    server: S3Server,
) -> None:
    """The running bound gives up a store NIXL still runs (the server frozen mid-PUT of a
    32 MiB block): the job fails at once, saying its block is in use, and the manager keeps the
    block pinned, so the engine, taking every block it can for new keys and writing them, never
    gets that one. Once the server answers, the PUT lands, and another engine's tier on the
    bucket, which knows nothing of the give-up, loads exactly the block's bytes (a block reused
    under the PUT made the object land with what the engine wrote there since, loaded there as
    a success: checked by writing the block anyway, all 32 MiB came back as the new bytes)."""
    blocks, block_bytes = 3, 32 << 20
    primary = CPUPrimaryTier(blocks, block_bytes, torch.uint8)
    bucket = server.new_bucket()
    tier = ObjectStoreTier(primary.cache, store=server.config(bucket),
                           policy=RetryPolicy(max_running_seconds=0.5))
    manager = TieringManager(primary, {"s3": tier})
    (block,) = primary.allocate(["kept"])
    original = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(18))
    primary.cache[block] = original
    primary.complete_write([block], True)

    server.freeze()
    manager.store([block])
    finalized: list[Finalized] = []
    deadline = time.monotonic() + 30
    while not finalized and time.monotonic() < deadline:
        finalized += manager.step()
        time.sleep(0.05)
    [done] = finalized
    assert not done.success and done.blocks_in_use, "given up while NIXL runs the PUT"
    assert done.reason is not None and done.reason.error == "still running after 0.5 s"
    assert primary.pin_count(block) == 1 and manager.stats()["blocks_held"] == 1
    with pytest.raises(OutOfBlocksError, match="1 pinned"):  # the engine wants every block
        primary.allocate([f"new-{index}" for index in range(blocks)])
    reused = primary.allocate([f"new-{index}" for index in range(blocks - 1)])
    assert block not in reused
    primary.cache[reused] = 0xFF
    primary.complete_write(reused, True)
    server.thaw()

    elsewhere = torch.zeros(1, block_bytes, dtype=torch.uint8)
    other = ObjectStoreTier(elsewhere, store=server.config(bucket))
    try:
        deadline = time.monotonic() + 60
        while other.lookup("kept") is not Lookup.HIT:  # the PUT lands once the server answers
            assert time.monotonic() < deadline, "the given-up PUT never landed"
            time.sleep(0.1)
        other.submit_load(TransferJob(1, ["kept"], [0], is_promotion=True))
        other.drain_jobs(timeout=60)
        [loaded] = other.get_finished_jobs()
        assert loaded.success
        assert torch.equal(elsewhere[0], original), "another engine loaded other bytes"
    finally:
        other.shutdown(timeout=60)
        manager.shutdown(timeout=60)
