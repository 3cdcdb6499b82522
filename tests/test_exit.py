"""A process that exits with NIXL transfers in flight: kvfsm's tiers on real NIXL are shut down
at the interpreter's exit, waiting for NIXL to end what it runs, within a bound. Without it, a
process that left 16 object-store jobs in flight crashed (SIGSEGV) 7 times out of 8 as it
exited."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from .real_nixl import S3Server, require_nixl, s3_server

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
    assert (f"interpreter exit: ObjectStoreTier was not shut down (or its shutdown timed out), "
            f"with {left} job(s) "
            "unpublished; waiting up to 60 s for NIXL to end their transfers") in child.stderr
    assert "exiting with them in flight" not in child.stderr


def run_child(script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], text=True,
                          capture_output=True, timeout=timeout, check=False)


GIVEN_UP_WHILE_RUNNING = """
import logging, time
import torch
from kvfsm import TransferJob
from kvfsm.nixl_agents import StoreConfig
from kvfsm.policy import RetryPolicy
from kvfsm.tiers import ObjectStoreTier
logging.basicConfig(format="%(message)s")
config = StoreConfig({bucket!r}, endpoint={endpoint!r}, access_key="kvfsm-access",
                     secret_key="kvfsm-secret")
tier = ObjectStoreTier(torch.ones(256, 1 << 16, dtype=torch.uint8), store=config,
                       policy=RetryPolicy(max_running_seconds=0.05))
tier.submit_store(TransferJob(1, [f"k-{{i}}" for i in range(256)], list(range(256))))
time.sleep(0.1)
[result] = tier.get_finished_jobs()  # the running bound gave it up: NIXL may still run it
print("published", result.success, "unpublished", len(tier.unpublished()),
      "may run", tier.stats()["quarantined_running"], flush=True)
if {how!r} == "shut-down":
    tier.shutdown(timeout=1)
del tier, result
import gc
gc.collect()
"""


@pytest.mark.parametrize("how", ["forgotten", "shut-down"])
def test_a_transfer_given_up_while_nixl_runs_it_is_waited_for_at_exit(
    s3_server: S3Server, how: str,
) -> None:
    """The running bound gave a 256-block store up while NIXL still ran it: its job is
    published (quarantined) and nothing is unpublished, yet the tier is held (dropped, it
    tore the agent down under the transfer) and the exit asks NIXL about the transfer until
    it is over. It crashed (SIGSEGV) 6 times in 12 before."""
    child = run_child(GIVEN_UP_WHILE_RUNNING.format(
        bucket=s3_server.new_bucket(), endpoint=s3_server.endpoint, how=how))
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "published False unpublished 0 may run 1" in child.stdout
    assert "exiting with them in flight" not in child.stderr


SHUT_DOWN_WITH_A_TRANSFER_GIVEN_UP = """
import logging, time
import torch
import kvfsm.tiers.base
from kvfsm import TransferJob
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent
from kvfsm.tiers import ObjectStoreTier
logging.basicConfig(format="%(message)s")
kvfsm.tiers.base.EXIT_WAIT_SECONDS = 1.0

class NixlLike(FakeNixlAgent):  # taken for NIXL's own agent: the exit waits for its transfers
    def check_xfer_state(self, handle):
        super().check_xfer_state(handle)
        return "PROC"  # (a transfer NIXL never ends)
NixlLike.__module__ = "nixl.fake"

tier = ObjectStoreTier(torch.zeros(4, 8), agent=NixlLike("a"),
                       policy=RetryPolicy(max_running_seconds=0.01))
tier.submit_store(TransferJob(1, ["x"], [0]))
time.sleep(0.05)
[result] = tier.get_finished_jobs()  # given up by the running bound: NIXL may still run it
tier.shutdown(timeout=1)
print("closed", tier.closed, "may run", tier.stats()["quarantined_running"], flush=True)
"""


def test_a_shut_down_tier_whose_transfer_nixl_may_still_run_says_the_exit_waits_for_it() -> None:
    """The tier is shut down, nothing unpublished, but NIXL may still run a transfer the running
    bound gave up: the exit says it waits for it, and then that it gave up on it (the wait was
    said only at its end)."""
    child = run_child(SHUT_DOWN_WITH_A_TRANSFER_GIVEN_UP)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "closed True may run 1" in child.stdout
    said, gave_up = child.stderr.splitlines()[-2:]
    assert re.fullmatch(r"interpreter exit: ObjectStoreTier: NIXL still runs 1 transfer\(s\) "
                        r"\(jobs \[1\]\); waiting up to [0-9.]+ s for it to end them \(a "
                        r"process must not exit with one in flight\)", said), child.stderr
    assert gave_up == ("interpreter exit: ObjectStoreTier: NIXL still runs 1 transfer(s) (jobs "
                       "[1]) at the exit's deadline (EXIT_WAIT_SECONDS, 1 s); exiting with them "
                       "in flight"), child.stderr


DAEMON_KEEPS_STORING = """
import itertools, logging, threading, time
import torch
from kvfsm import TransferJob
from kvfsm.nixl_agents import StoreConfig
from kvfsm.tiers import ObjectStoreTier, TierClosedError
logging.basicConfig(format="%(message)s")
config = StoreConfig({bucket!r}, endpoint={endpoint!r}, access_key="kvfsm-access",
                     secret_key="kvfsm-secret")
tier = ObjectStoreTier(torch.ones(64, 1 << 12, dtype=torch.uint8), store=config)
ids = itertools.count()

def engine():
    while True:
        job = next(ids)
        try:
            tier.submit_store(TransferJob(job, [f"k{{job}}"], [job % 64]))
            tier.get_finished_jobs()
        except TierClosedError:
            print("the engine's store was refused: the process is exiting", flush=True)
            return
        time.sleep(0.002)

threading.Thread(target=engine, daemon=True).start()
time.sleep(0.5)
"""


def test_a_daemon_thread_still_storing_at_exit_is_refused_and_the_process_exits(
    s3_server: S3Server,
) -> None:
    """An engine's daemon thread keeps storing as the main thread returns: the exit refuses
    its next store at once and waits only for what is in flight (it waited for a moment with
    nothing unpublished, which never came)."""
    child = run_child(DAEMON_KEEPS_STORING.format(
        bucket=s3_server.new_bucket(), endpoint=s3_server.endpoint), timeout=90)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "exiting with them in flight" not in child.stderr


PEER_IN_ONE_PROCESS = """
import logging
import torch
import kvfsm.tiers.base
from kvfsm import TransferJob
from kvfsm.nixl_agents import make_agent
from kvfsm.peer import PeerReceiver, PeerSender
logging.basicConfig(format="%(relativeCreated)d ms: %(message)s")
kvfsm.tiers.base.EXIT_WAIT_SECONDS = 2.0
from kvfsm.policy import RetryPolicy
sender = PeerSender(torch.ones(8, 4096, dtype=torch.uint8), agent=make_agent("engine-a", "UCX"),
                    policy=RetryPolicy(progress_interval={progress}))
receiver = PeerReceiver(torch.zeros(8, 4096, dtype=torch.uint8),
                        agent=make_agent("engine-b", "UCX"))
sender.connect(receiver.metadata(), receiver.block_descs())
receiver.connect(sender.metadata())
for _ in range(2000):
    sender.get_finished_jobs()
    receiver.get_finished_jobs()
    if sender.link_state().name == "CONNECTED":
        break
sender.submit_store(TransferJob(1, ["0"], [0]))
print("left", len(sender.unpublished()), flush=True)
logging.getLogger("kvfsm").warning("the main thread returns")
"""


@pytest.mark.parametrize("progress", [None, 0.01], ids=["polled-by-the-engine", "progress-thread"])
def test_an_exit_that_cannot_see_a_transfer_end_waits_its_bound_and_says_so(
    progress: float | None,
) -> None:
    """A sender and its receiver in one process: the write ends only once the receiver is
    polled too, which nothing does at exit. The exit waits EXIT_WAIT_SECONDS (2 s here), names
    what NIXL still runs, and goes on (it waited for ever; with the sender's progress thread,
    the interpreter's join of that thread did, before the exit's wait began). With the
    progress thread, the join and the exit's wait share the bound: they took it twice, one
    after the other."""
    require_nixl()
    child = run_child(PEER_IN_ONE_PROCESS.replace("{progress}", str(progress)), timeout=90)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "left 1" in child.stdout
    assert ("interpreter exit: PeerSender: NIXL still runs 1 transfer(s) (jobs [1]) at the "
            "exit's deadline (EXIT_WAIT_SECONDS, 2 s); exiting with them in flight"
            ) in child.stderr
    returned = int(re.search(r"(\d+) ms: the main thread returns", child.stderr)[1])  # type: ignore[index]
    gave_up = int(re.search(r"(\d+) ms: interpreter exit: PeerSender: NIXL still runs",  # type: ignore[index]
                            child.stderr)[1])
    assert 2000 <= gave_up - returned < 3500, "one bound of 2 s, not two"


WORKER_OUTLIVES_THE_PROGRESS_THREAD = """
import logging, threading, time
import torch
import kvfsm.tiers.base
from kvfsm import TransferJob
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent
from kvfsm.tiers import ObjectStoreTier
logging.basicConfig(format="%(relativeCreated)d ms: %(message)s")
kvfsm.tiers.base.EXIT_WAIT_SECONDS = 1.0

class NixlLike(FakeNixlAgent):  # taken for NIXL's own agent: the exit waits for its transfers
    takes = float("inf")  # how long a transfer runs once posted, polled or not, as NIXL's do

    def transfer(self, handle, notif_msg=b""):
        self.__dict__.setdefault("ends", {})[id(handle)] = time.monotonic() + self.takes
        return super().transfer(handle, notif_msg)

    def check_xfer_state(self, handle):
        if time.monotonic() < self.ends.get(id(handle), 0.0):
            return "PROC"
        return super().check_xfer_state(handle)
NixlLike.__module__ = "nixl.fake"

polled_agent = NixlLike("a", complete_after_polls=1)
polled = ObjectStoreTier(torch.zeros(4, 8), agent=polled_agent,
                         policy=RetryPolicy(progress_interval=0.01))
polled.submit_store(TransferJob(1, ["x"], [0]))  # never ends
worker_agent = NixlLike("b", complete_after_polls=1)
worker_tier = ObjectStoreTier(torch.zeros(4, 8), agent=worker_agent)

def worker():
    time.sleep(0.7 if SAME else 2.0)  # near or past the bound, from the main thread's return
    agent, tier = (polled_agent, polled) if SAME else (worker_agent, worker_tier)
    agent.takes = 0.5
    tier.submit_store(TransferJob(2, ["y"], [1]))  # NIXL ends it 0.5 s after its post
    print("worker returns", flush=True)

threading.Thread(target=worker).start()
"""


@pytest.mark.parametrize("same", [False, True], ids=["another-tier", "the-polled-tier"])
def test_a_worker_thread_outliving_the_exit_bound_still_gets_the_exit_wait(same: bool) -> None:
    """The exit's bound counts from when no thread of the caller's runs any more (the main
    thread returned, and the others ended: they may still use a tier). A worker thread's
    store, 2 s after the main thread returned in a tier of its own, or 0.7 s after it in the
    one a progress thread polls, is waited for within a bound of 1 s (counted from the main
    thread's return, the bound passed before it ended: the process exited with it in flight)."""
    child = run_child(WORKER_OUTLIVES_THE_PROGRESS_THREAD.replace(
        "import logging,", f"SAME = {same}\nimport logging,"), timeout=60)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "worker returns" in child.stdout
    assert "NIXL still runs 1 transfer(s) (jobs [1])" in child.stderr, "the first tier's"
    assert "(jobs [2])" not in child.stderr, child.stderr


IDLE_POOL = """
from concurrent.futures import ThreadPoolExecutor
import torch
POOL = ThreadPoolExecutor(2)  # idle workers, not daemons, kept by a module
POOL.submit(print, "task ran", flush=True).result()
from kvfsm.tiers import FileTier
print("main done", flush=True)
"""


def test_an_exit_with_idle_worker_threads_and_no_tier_is_not_held_up() -> None:
    """A module keeps a thread pool whose workers are stopped by the interpreter's own exit:
    importing kvfsm's tiers does not hold that exit up (a version of the exit's wait joined
    every such thread before the pool was told to stop, and waited for ever)."""
    child = run_child(IDLE_POOL, timeout=60)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.split() == ["task", "ran", "main", "done"]


LONG_PAUSE = """
import logging
import torch
from kvfsm import TransferJob
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, StayProc
from kvfsm.tiers import ObjectStoreTier
logging.basicConfig(format="%(message)s")
agent = FakeNixlAgent()
if NEVER_ENDS:
    agent.inject("check_xfer_state", StayProc(10**9))
tier = ObjectStoreTier(torch.zeros(4, 16), agent=agent,
                       policy=RetryPolicy(progress_interval=1000))
tier.submit_store(TransferJob(1, ["k"], [0]))  # the thread polls once, then pauses 1000 s
print("main done", flush=True)
"""


@pytest.mark.parametrize("never_ends", [False, True], ids=["a-job-that-ends", "nixl-never-ends"])
def test_an_exit_does_not_wait_out_the_progress_threads_pause(never_ends: bool) -> None:
    """The main thread returns while the progress thread pauses between polls (a
    ``progress_interval`` of 1000 s). The exit wakes it: the job that ends is finished and the
    process exits; a transfer that never ends is polled within the exit's bound, set to 3 s
    here, and the process exits (the exit used to wait out the whole pause first: past 60 s,
    the bound, with a pause of 35 s, and for ever with one of 1000 s)."""
    script = f"NEVER_ENDS = {never_ends}\n" + textwrap.dedent(LONG_PAUSE)
    script = script.replace("import logging\n", "import logging\nimport kvfsm.tiers.base\n"
                            "kvfsm.tiers.base.EXIT_WAIT_SECONDS = 3.0\n", 1)
    child = run_child(script, timeout=60)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.split() == ["main", "done"]


FORKED_WORKER = """
import gc, logging, multiprocessing, tempfile, weakref
import torch
from kvfsm import TransferJob
from kvfsm.tiers import FileTier
logging.basicConfig(format="%(message)s")
root = tempfile.mkdtemp()
tier = FileTier(torch.ones(64, 1 << 16, dtype=torch.uint8), root)
for job in range(16):
    tier.submit_store(TransferJob(job, [f"k{job}-{i}" for i in range(4)],
                                  [4 * job + i for i in range(4)]))
held = weakref.ref(tier)
if DROPPED:  # the engine let go of it: kvfsm holds it while its stores are in flight
    del tier
    gc.collect()
worker = multiprocessing.get_context("fork").Process(target=print, args=("worker done",))
worker.start()
worker.join(60)
print("worker exit code", worker.exitcode, flush=True)
other = FileTier(torch.ones(4, 1 << 16, dtype=torch.uint8), root)  # a restarted engine, say
print("removed as stale", other.remove_stale(), flush=True)
other.shutdown(timeout=5)
tier = held()
tier.drain_jobs(timeout=30)
results = tier.get_finished_jobs()
print("stored", sum(r.success for r in results), "of", len(results), flush=True)
tier.shutdown(timeout=10)
"""


@pytest.mark.parametrize("dropped", [False, True], ids=["kept", "dropped"])
def test_a_forked_worker_exiting_leaves_the_parents_transfers_alone(dropped: bool) -> None:
    """A worker forked while the engine's stores are in flight returns. Its exit does not
    drain the copy of the parent's tier it inherited (it did: the copy's state checks failed,
    its cleanup removed the parent's partial files, and every one of the parent's 16 stores
    failed at its commit), nor give up the parent's claim on its partial files when the copy
    is freed (another tier then removed them as stale, and the stores failed all the same)."""
    require_nixl()
    child = run_child(f"DROPPED = {dropped}\n" + textwrap.dedent(FORKED_WORKER), timeout=120)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "worker exit code 0" in child.stdout
    assert "removed as stale 0" in child.stdout
    assert "stored 16 of 16" in child.stdout, child.stderr[-2000:]
    assert "interpreter exit" not in child.stderr


FORKED_BESIDE_AN_OBJECT_STORE = """
import multiprocessing, time
import torch
from kvfsm.nixl_agents import StoreConfig
from kvfsm.tiers import ObjectStoreTier
config = StoreConfig({bucket!r}, endpoint={endpoint!r}, access_key="kvfsm-access",
                     secret_key="kvfsm-secret")
tier = ObjectStoreTier(torch.ones(8, 4096, dtype=torch.uint8), store=config)
worker = multiprocessing.get_context("fork").Process(target=print, args=("worker done",))
worker.start()
worker.join(30)
print("worker exit code", worker.exitcode, flush=True)
tier.shutdown(timeout=10)
"""


def test_a_forked_worker_beside_an_object_store_tier_ends(s3_server: S3Server) -> None:
    """The worker's exit leaves the parent's lookup prober and its NIXL agent alone: dropping
    the child's copy of that agent never returned, and every forked worker hung at its end."""
    child = run_child(FORKED_BESIDE_AN_OBJECT_STORE.format(
        bucket=s3_server.new_bucket(), endpoint=s3_server.endpoint), timeout=90)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "worker exit code 0" in child.stdout
