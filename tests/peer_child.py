"""One engine of a peer pair in a process of its own, driven by JSON lines on stdin.

``python tests/peer_child.py sender|receiver [peer_timeout]`` makes a real UCX agent and a
:class:`~kvfsm.peer.PeerSender` or :class:`~kvfsm.peer.PeerReceiver` on an 8-block cache, prints
``{"metadata": ..., "blocks": ...}`` (a sender's metadata carries the nonce of the link its
first connect makes), then obeys one command a line and answers each with one line. Between
commands it keeps stepping its side (``get_finished_jobs``): a UCX agent without a progress
thread answers its peer only while it is stepped. ``{"do": "freeze"}`` stops that, as an engine
that hangs would; ``{"do": "exit"}`` shuts the side down and ends the process with 0. A receiver
also forgets a sender (``{"do": "forget", "sender": name}``) and says its ``stats``.
A test may kill the process at any time instead, or have the sender kill the receiver the moment
a write is over (``"kill_when_done": pid``), before the receiver can take its notification.
A submit may end the process right after it, with no step and no shutdown (``"then": "exit"``),
or after dropping the side and collecting it (``"then": "drop"``): an engine that dies of an
error it does not catch, or lets go of a sender it is done with.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys
import time
from typing import Any

import torch

from kvfsm import JobResult, TransferJob
from kvfsm.nixl_agents import make_agent
from kvfsm.peer import PeerReceiver, PeerSender

BLOCKS, BLOCK_BYTES = 8, 4096


#: the answers go to what was stdout; the process's stdout then goes to stderr, so that what
#: UCX logs on stdout (it logs there) cannot come between two answers
ANSWERS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def say(**fields: Any) -> None:
    ANSWERS.write(json.dumps(fields) + "\n")
    ANSWERS.flush()


class Child:
    """One side, its results not yet reported, and whether it still steps."""

    def __init__(self, role: str, peer_timeout: float) -> None:
        self.role = role
        cache = torch.full((BLOCKS, BLOCK_BYTES), 7 if role == "sender" else 0,
                           dtype=torch.uint8)
        self.agent = make_agent(f"engine-{role}", "UCX")
        self.side: Any
        if role == "sender":
            self.side = PeerSender(cache, agent=self.agent)
            say(metadata=self.side.metadata().hex())
        else:
            self.side = PeerReceiver(cache, agent=self.agent, peer_timeout=peer_timeout)
            say(metadata=self.side.metadata().hex(), blocks=self.side.block_descs())
        self.results: list[JobResult] = []
        self.frozen = False

    def step(self) -> None:
        self.results += self.side.get_finished_jobs()

    def connect(self, metadata: str, blocks: list[list[int]] | None = None) -> None:
        if self.role == "sender":
            name = self.side.connect(bytes.fromhex(metadata), [tuple(d) for d in blocks or []])
        else:
            name = self.side.connect(bytes.fromhex(metadata))
        say(connected=name)

    def expect(self, job: int, keys: list[str], blocks: list[int], sender: str) -> None:
        self.side.expect(TransferJob(job, keys, blocks, is_promotion=True), sender)
        say(expecting=job)

    def submit(self, job: int, keys: list[str], blocks: list[int],
               kill_when_done: int | None = None, then: str | None = None) -> None:
        try:
            self.side.submit_store(TransferJob(job, keys, blocks))
        except Exception as error:
            say(refused=job, error=f"{type(error).__name__}: {error}")
            return
        if kill_when_done is not None:  # kill the receiver the moment the write is over
            while not self.results:
                self.step()
            os.kill(kill_when_done, signal.SIGKILL)
        if then == "drop":
            link = self.side.link_state().name
            self.side = None
            gc.collect()  # (a side is in reference cycles: the collector tears it down)
            say(submitted=job, dropped=True, link=link)
            raise SystemExit(0)
        say(submitted=job)
        if then == "exit":
            raise SystemExit(0)

    def report(self, count: int, within: float, link: list[str] | None = None) -> None:
        """Step until ``count`` results are in or ``within`` seconds passed; say them."""
        deadline = time.monotonic() + within
        while len(self.results) < count and time.monotonic() < deadline:
            self.step()
            time.sleep(0.0005)
        say(results=[[r.job_id, r.success] for r in self.results],
            link=self.side.link_state(*(link or [])).name)
        self.results = []

    def forget(self, sender: str) -> None:
        """The receiver forgets a sender (the engine knows it is gone); say what it holds."""
        self.side.forget_peer(sender)
        say(stats=self.side.stats())

    def stats(self) -> None:
        say(stats=self.side.stats())

    def freeze(self) -> None:
        self.frozen = True
        say(frozen=True)

    def exit(self) -> None:
        self.side.shutdown()
        stats = self.side.stats() if self.role == "sender" else {}
        say(leaks=stats.get("leaks", 0), in_flight=stats.get("in_flight", {}),
            pending=self.side.has_pending_work(), link=stats.get("link"),
            closed=bool(getattr(self.side, "closed", True)))


def main() -> int:
    child = Child(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 30.0)
    commands = {"connect": child.connect, "expect": child.expect, "submit": child.submit,
                "results": child.report, "forget": child.forget, "stats": child.stats,
                "freeze": child.freeze, "exit": child.exit}
    while True:
        if not child.frozen:
            child.step()
        if not select.select([sys.stdin], [], [], None if child.frozen else 0.0005)[0]:
            continue
        line = sys.stdin.readline()
        if not line:
            return 1
        command = json.loads(line)
        do = command.pop("do")
        commands[do](**command)
        if do == "exit":
            return 0


if __name__ == "__main__":
    sys.exit(main())
