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
from collections.abc import Iterator

import pytest
import torch

from kvfsm import TransferJob
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
