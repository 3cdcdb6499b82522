"""A process that exits with NIXL transfers in flight: kvfsm's tiers on real NIXL are shut down
at the interpreter's exit, waiting for NIXL to end what it runs. Without it, a process that
left 16 object-store jobs in flight crashed (SIGSEGV) 7 times out of 8 as it exited."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from .real_nixl import S3Server, s3_server

__all__ = ["s3_server"]  # the fixture, imported for pytest

pytestmark = pytest.mark.nixl

LEAVE_IN_FLIGHT = """
import logging
import torch
from kvfsm import TransferJob
from kvfsm.nixl_agents import StoreConfig
from kvfsm.tiers import DrainTimeout, ObjectStoreTier
logging.basicConfig(format="%(message)s")  # the engine's logging, to stderr
config = StoreConfig({bucket!r}, endpoint={endpoint!r}, access_key="kvfsm-access",
                     secret_key="kvfsm-secret")
tier = ObjectStoreTier(torch.ones(64, 1 << 16, dtype=torch.uint8), store=config)
for job in range(16):
    tier.submit_store(TransferJob(job, [f"k{{job}}-{{i}}" for i in range(4)],
                                  [4 * job + i for i in range(4)]))
if {how!r} == "timed-out":
    try:
        tier.shutdown(timeout=0)  # too short: DrainTimeout, and the tier stays open
    except DrainTimeout:
        print("shutdown timed out", flush=True)
print("leaving", len(tier.unpublished()), "jobs in flight", flush=True)
if {how!r} == "dropped":  # the collector would tear the NIXL agent down under them
    import gc
    del tier
    gc.collect()
"""


@pytest.mark.parametrize("how", ["forgotten", "timed-out", "dropped"])
def test_a_process_leaving_transfers_in_flight_waits_for_them_and_exits_cleanly(
    s3_server: S3Server, how: str,
) -> None:
    """The engine forgot to shut its tier down, or shut it down with too short a timeout, or
    dropped it: the process exits once NIXL ended the transfers, saying why it waits."""
    script = LEAVE_IN_FLIGHT.format(bucket=s3_server.new_bucket(), endpoint=s3_server.endpoint,
                                    how=how)
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], text=True,
                           capture_output=True, timeout=120, check=False)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    left = int(re.search(r"leaving (\d+) jobs in flight", child.stdout)[1])  # type: ignore[index]
    assert left > 0, "nothing was in flight: the story did not happen"
    assert (f"interpreter exit: ObjectStoreTier was not shut down, with {left} job(s) "
            "unpublished; shutting it down, waiting for NIXL to end their transfers"
            ) in child.stderr
