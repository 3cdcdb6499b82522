"""Peers that disappear across processes: each engine in a child process, one of them killed.

Each child is ``tests/peer_child.py``; this test process only carries metadata between them, sends
commands and kills. So a UCX abort in an engine would show as that child's exit status, not take
the test run down.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .real_nixl import require_nixl

pytestmark = pytest.mark.nixl

CHILD = Path(__file__).with_name("peer_child.py")


class Engine:
    """An engine in a child process, driven one JSON line at a time."""

    def __init__(self, role: str, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD), role, *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=CHILD.parent.parent)
        self._hello: dict[str, Any] | None = None

    @property
    def hello(self) -> dict[str, Any]:
        """What the child said once its agent was up (children start in parallel)."""
        if self._hello is None:
            self._hello = self.read()
        return self._hello

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"the child said nothing: exit {self.process.wait(10)}, "
                                 f"stderr {self.stderr()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.read()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stderr(self) -> str:
        assert self.process.stderr is not None
        return self.process.stderr.read()[-2000:]

    def close(self) -> None:
        if self.process.poll() is None:
            self.kill()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    require_nixl()
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.close()


def connect(sender: Engine, receiver: Engine) -> tuple[str, str]:
    """Exchange metadata both ways; returns (the receiver's name, the sender's name)."""
    assert sender.process.stdin is not None
    sender.process.stdin.write(json.dumps({"do": "connect",
                                           "metadata": receiver.hello["metadata"],
                                           "blocks": receiver.hello["blocks"]}) + "\n")
    sender.process.stdin.flush()
    sender_name = receiver.ask(do="connect", metadata=sender.hello["metadata"])["connected"]
    receiver_name = sender.read()["connected"]
    return receiver_name, sender_name


def receiver_killed_after_a_write(engines: list[Engine]) -> tuple[Engine, str]:
    """A sender and a receiver, job 1 written and published on both sides; then the receiver
    is killed the moment job 2's write is over, before it takes the notification (measured: a
    sender that then posted another write aborted at teardown, in a UCX assertion, unless its
    worker progressed). Returns the sender and the receiver's name."""
    receiver, sender = Engine("receiver", "30"), Engine("sender")
    engines += [receiver, sender]
    receiver_name, sender_name = connect(sender, receiver)
    receiver.ask(do="expect", job=1, keys=["2"], blocks=[2], sender=sender_name)
    sender.ask(do="submit", job=1, keys=["2"], blocks=[0])
    assert sender.ask(do="results", count=1, within=5)["results"] == [[1, True]]
    assert receiver.ask(do="results", count=1, within=5,
                        link=[sender_name])["results"] == [[1, True]]
    sender.ask(do="submit", job=2, keys=["3"], blocks=[1], kill_when_done=receiver.process.pid)
    assert receiver.process.wait(10) == -signal.SIGKILL
    return sender, receiver_name


def test_a_sender_whose_receiver_is_killed_fails_what_it_owed_and_exits_cleanly(
    engines: list[Engine],
) -> None:
    # the sender does not know yet, and posts job 3 to the killed receiver
    sender, receiver_name = receiver_killed_after_a_write(engines)
    sender.ask(do="submit", job=3, keys=["4"], blocks=[2])
    assert sender.ask(do="results", count=2, within=5) == {"results": [[2, True], [3, False]],
                                                           "link": "CLOSED"}
    refused = sender.ask(do="submit", job=4, keys=["5"], blocks=[3])
    assert refused["error"].startswith("PeerNotConnected: job 4 refused: receiver "
                                       f"{receiver_name!r} is CLOSED")
    assert "NIXL_ERR_REMOTE_DISCONNECT" in refused["error"]

    farewell = sender.ask(do="exit")
    assert farewell == {"leaks": 0, "in_flight": {}, "pending": False, "link": "CLOSED",
                        "closed": True}
    assert sender.process.wait(10) == 0, sender.stderr()  # no UCX abort at teardown


@pytest.mark.parametrize("then", ["exit", "drop"])
def test_a_sender_left_without_a_poll_after_a_write_to_its_killed_receiver_failed_exits_cleanly(
    engines: list[Engine], then: str,
) -> None:
    """As above, but the sender's engine makes no call after the failed write: it exits at once
    (an error it did not catch), or drops the sender first. Its UCX worker progressed as the
    write failed, so its agent's teardown does not abort (it did, in every trial, while the
    worker progressed only as the link was closed, by a poll or a shutdown)."""
    sender, _ = receiver_killed_after_a_write(engines)
    answer = sender.ask(do="submit", job=3, keys=["4"], blocks=[2], then=then)
    assert answer["submitted"] == 3
    if then == "drop":
        assert answer["link"] == "LOST"  # (job 2 failed with the disconnect as it was posted)
    assert sender.process.wait(10) == 0, sender.stderr()  # no UCX abort at teardown


def test_a_write_in_flight_to_a_receiver_that_hangs_and_is_killed_fails_only_once_over(
    engines: list[Engine],
) -> None:
    receiver, sender = Engine("receiver", "30"), Engine("sender")
    engines += [receiver, sender]
    connect(sender, receiver)
    receiver.ask(do="freeze")  # UCX needs the receiver to progress: NIXL holds the write
    sender.ask(do="submit", job=1, keys=["6"], blocks=[4])
    assert sender.ask(do="results", count=1, within=0.3) == {"results": [], "link": "CONNECTED"}

    receiver.kill()
    assert sender.ask(do="results", count=1, within=5) == {"results": [[1, False]],
                                                           "link": "CLOSED"}
    assert sender.ask(do="exit")["leaks"] == 0
    assert sender.process.wait(10) == 0, sender.stderr()


def test_a_receiver_finds_a_killed_sender_gone_and_fails_only_what_it_still_owed(
    engines: list[Engine],
) -> None:
    receiver = Engine("receiver", "0.2")  # probe a sender silent for 0.2 s while it owes jobs
    sender = Engine("sender")
    engines += [receiver, sender]
    _, sender_name = connect(sender, receiver)
    for job, block in ((1, 5), (2, 6)):
        receiver.ask(do="expect", job=job, keys=[str(block)], blocks=[block], sender=sender_name)
    sender.ask(do="submit", job=1, keys=["5"], blocks=[0])
    assert sender.ask(do="results", count=1, within=5)["results"] == [[1, True]]
    heard = receiver.ask(do="results", count=1, within=5, link=[sender_name])
    assert heard == {"results": [[1, True]], "link": "CONNECTED"}

    # still connected and merely silent for longer than peer_timeout: job 2 stays expected
    assert receiver.ask(do="results", count=1, within=0.5, link=[sender_name]) == {
        "results": [], "link": "CONNECTED"}

    sender.kill()  # found by the probes (two periods at most, measured 67-82 ms), within 5 s
    lost = receiver.ask(do="results", count=1, within=5, link=[sender_name])
    assert lost == {"results": [[2, False]], "link": "CLOSED"}
    assert receiver.ask(do="exit")["pending"] is False
    assert receiver.process.wait(10) == 0, receiver.stderr()


def test_a_new_sender_process_of_the_same_name_never_completes_a_job_with_the_old_ones_write(
    engines: list[Engine],
) -> None:
    receiver, old, new = Engine("receiver", "30"), Engine("sender"), Engine("sender")
    engines += [receiver, old, new]  # both senders are agents called "engine-sender"
    _, sender_name = connect(old, receiver)
    old.ask(do="submit", job=1, keys=["3"], blocks=[0])  # before the receiver expects it
    assert old.ask(do="results", count=1, within=5)["results"] == [[1, True]]
    deadline = time.monotonic() + 5
    while receiver.ask(do="stats")["stats"]["early"] < 1:  # it took the notification
        assert time.monotonic() < deadline, "the receiver never took the notification"

    old.kill()  # the old process is gone, and the engine knows it
    assert receiver.ask(do="forget", sender=sender_name)["stats"]["discarded"] == 1
    assert connect(new, receiver)[1] == sender_name
    receiver.ask(do="expect", job=1, keys=["3"], blocks=[3], sender=sender_name)
    assert receiver.ask(do="results", count=1, within=0.3, link=[sender_name]) == {
        "results": [], "link": "CONNECTED"}, "the old process's write is not the new one's"

    new.ask(do="submit", job=1, keys=["3"], blocks=[1])
    assert new.ask(do="results", count=1, within=5)["results"] == [[1, True]]
    assert receiver.ask(do="results", count=1, within=5, link=[sender_name])["results"] == [
        [1, True]]


def test_a_dead_senders_jobs_fail_while_a_new_process_of_its_name_keeps_writing(
    engines: list[Engine],
) -> None:
    """A new process of the sender's name writes to the receiver, which has not linked it, a
    notification every ~0.1 s, each carrying the new process's own nonce. The old sender is
    killed meanwhile: the new process's notifications no longer keep the dead sender's link
    from being probed (peer_timeout 0.2 s), so the job the dead one owed fails while the new
    one goes on writing."""
    receiver, old, new = Engine("receiver", "0.2"), Engine("sender"), Engine("sender")
    engines += [receiver, old, new]  # both senders are agents called "engine-sender"
    _, sender_name = connect(old, receiver)
    receiver.ask(do="expect", job=2, keys=["6"], blocks=[6], sender=sender_name)
    assert new.hello["metadata"]  # (up)
    assert new.ask(do="connect", metadata=receiver.hello["metadata"],
                   blocks=receiver.hello["blocks"])["connected"]  # (the new one links itself)
    lost: dict[str, Any] = {}
    deadline = time.monotonic() + 10
    writes = 0
    while not lost.get("results") and time.monotonic() < deadline:
        writes += 1
        if writes == 3:
            old.kill()  # with the new process's writes under way
        job = 100 + writes
        assert new.ask(do="submit", job=job, keys=["7"], blocks=[0]) == {"submitted": job}
        assert new.ask(do="results", count=1, within=5)["results"] == [[job, True]]
        lost = receiver.ask(do="results", count=1, within=0.05, link=[sender_name])
        assert writes >= 3 or lost == {"results": [], "link": "CONNECTED"}, "alive: kept"
    assert lost == {"results": [[2, False]], "link": "CLOSED"}, f"after {writes} writes"
    assert receiver.ask(do="exit")["pending"] is False
    assert receiver.process.wait(10) == 0, receiver.stderr()
