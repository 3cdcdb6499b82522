"""Peer writes: two real NIXL agents over UCX in one process, and the receiving machine alone."""

from __future__ import annotations

import re
import threading
import time
import types
from typing import Any

import numpy as np
import pytest
import torch

from kvfsm import JobResult, TransferJob
from kvfsm.nixl_agents import make_agent
from kvfsm.peer import (
    MAX_UNKNOWN_NOTIFICATIONS,
    PEER_RECEIVE,
    PeerNotConnected,
    PeerReceiver,
    PeerSender,
    ReceiveState,
    notification_for,
)
from kvfsm.peer_link import CLOSED_KEPT, DISCONNECTED, LinkState, PeerLinkError
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, FakeNixlError, Raise
from kvfsm.testing.explore import explore_table
from kvfsm.testing.fake_ucx import FakeUcxFabric, fake_ucx_pair
from kvfsm.tiers import DrainTimeout, InvalidJobError, Lookup, TierClosedError

from .real_nixl import require_nixl
from .test_tiering_input import interrupted_at_line

BLOCKS, BLOCK_BYTES = 8, 4096


class Pair:
    """A sender and a receiver engine, each with its own agent and KV cache."""

    def __init__(self) -> None:
        require_nixl()
        generator = torch.Generator().manual_seed(3)
        self.source = torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8,
                                    generator=generator)
        self.target = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
        self.sender_agent = make_agent("engine-a", "UCX")
        self.sender = PeerSender(self.source, agent=self.sender_agent)
        self.receiver = PeerReceiver(self.target, agent=make_agent("engine-b", "UCX"))
        self.receiver_name = self.sender.connect(self.receiver.metadata(),
                                                 self.receiver.block_descs())
        self.sender_name = self.receiver.connect(self.sender.metadata())

    def step_until(self, sent: int, received: int) -> tuple[list[JobResult], list[JobResult]]:
        """Both engines step (each progresses its own side) until the results are in."""
        sent_results: list[JobResult] = []
        received_results: list[JobResult] = []
        for _ in range(20_000):
            sent_results += self.sender.get_finished_jobs()
            received_results += self.receiver.get_finished_jobs()
            if len(sent_results) >= sent and len(received_results) >= received:
                break
        return sent_results, received_results

    def close(self) -> None:
        self.sender.shutdown()
        self.receiver.shutdown()


@pytest.fixture
def pair() -> Any:
    made = Pair()
    yield made
    made.close()


def test_two_real_agents_move_torch_blocks_and_both_sides_publish_once(pair: Pair) -> None:
    # receiver blocks 7, 3, 5 take the sender's blocks 0, 1, 2
    pair.receiver.expect(TransferJob(1, ["7", "3", "5"], [7, 3, 5], is_promotion=True),
                         pair.sender_name)
    pair.sender.submit_store(TransferJob(1, ["7", "3", "5"], [0, 1, 2]))
    sent, received = pair.step_until(1, 1)
    assert [(r.job_id, r.success) for r in sent] == [(1, True)]
    assert [(r.job_id, r.success) for r in received] == [(1, True)]
    for source, target in ((0, 7), (1, 3), (2, 5)):
        assert torch.equal(pair.target[target], pair.source[source])
    assert torch.count_nonzero(pair.target[[0, 1, 2, 4, 6]]) == 0, "no other block touched"
    again = pair.step_until(1, 1)
    assert again == ([], []), "nothing is published twice"
    assert pair.sender.stats()["leaks"] == 0


@pytest.mark.parametrize("gone", ["shut down", "dropped"])
def test_a_receiver_made_again_on_its_agent_refuses_the_link_the_old_one_closed(
        gone: str) -> None:
    """The receiving engine shuts its receiver down and makes another on the same agent and
    a new cache, while the sender's link to the old one is still open: that link writes where
    the old cache was. The new receiver took the old link's metadata, and published the
    sender's next write as arrived while its bytes went into the old cache (and, once that
    memory was freed, corrupted the heap). Its nonce is spent on the agent now, so the new
    receiver refuses it; once the sender links to the new one, its write lands there. The
    same when the old receiver was dropped without a shutdown, its links still open."""
    import gc  # noqa: PLC0415

    pair = Pair()
    receiver = None
    try:
        pair.receiver.expect(promotion(1, 3), pair.sender_name)
        pair.sender.submit_store(TransferJob(1, ["3"], [0]))
        sent, received = pair.step_until(1, 1)
        assert [r.success for r in sent + received] == [True, True]
        agent = pair.receiver.agent
        if gone == "shut down":
            pair.receiver.shutdown(5)
        else:
            del pair.receiver
            gc.collect()
        target = torch.zeros_like(pair.target)
        receiver = PeerReceiver(target, agent=agent)
        with pytest.raises(PeerLinkError, match=r"nonce [0-9a-f]+ is spent\): by this receiver,"
                                                " or by one on its agent before it"):
            receiver.connect(pair.sender.metadata())
        assert receiver.link_state(pair.sender_name) is LinkState.UNKNOWN

        pair.sender.forget_peer()  # what the refusal says to do
        pair.sender.connect(receiver.metadata(), receiver.block_descs())
        name = receiver.connect(pair.sender.metadata())
        receiver.expect(promotion(2, 5), name)
        pair.sender.submit_store(TransferJob(2, ["5"], [1]))
        sent, received = [], []
        for _ in range(20_000):
            sent += pair.sender.get_finished_jobs()
            received += receiver.get_finished_jobs()
            if sent and received:
                break
        assert [(r.job_id, r.success) for r in sent + received] == [(2, True), (2, True)]
        assert torch.equal(target[5], pair.source[1]), "the write landed in the new cache"
        assert torch.count_nonzero(pair.target[5]) == 0, "and not in the old one"
    finally:
        pair.sender.shutdown(5)
        if receiver is not None:
            receiver.shutdown(5)


def test_peers_that_forget_each_other_refuse_new_jobs_and_fail_what_was_owed(
    pair: Pair,
) -> None:
    pair.receiver.expect(TransferJob(1, ["0"], [0], is_promotion=True), pair.sender_name)
    pair.receiver.expect(TransferJob(2, ["1"], [1], is_promotion=True), pair.sender_name)
    pair.sender.submit_store(TransferJob(1, ["0"], [4]))
    sent, received = pair.step_until(1, 1)
    assert [r.success for r in sent + received] == [True, True]

    # the engines lose each other before job 2 was sent
    pair.sender.forget_peer()
    pair.receiver.forget_peer(pair.sender_name)
    assert pair.sender.link_state() is LinkState.CLOSED
    with pytest.raises(PeerNotConnected, match="job 2 refused: receiver 'engine-b' is CLOSED"):
        pair.sender.submit_store(TransferJob(2, ["1"], [5]))
    sent, received = pair.step_until(0, 1)
    assert sent == []
    assert [(r.job_id, r.success) for r in received] == [(2, False)]
    assert str(received[0].reason) == "failed: sender engine-a is gone: forgotten", "says why"
    assert torch.count_nonzero(pair.target[1]) == 0, "the lost write never landed"
    stats = pair.sender.stats()
    assert (stats["leaks"], stats["quarantined"], stats["in_flight"]) == (0, 0, {})
    assert not pair.sender.has_pending_work()
    assert not pair.receiver.has_pending_work()
    assert not pair.sender_agent.check_remote_metadata("engine-b"), "its metadata is removed"


def step_receiver_until(receiver: PeerReceiver, early: int) -> None:
    """Poll the receiver until it keeps ``early`` notifications no expect claimed yet."""
    for _ in range(20_000):
        if receiver.stats()["early"] + receiver.stats()["unknown"] >= early:
            return
        assert receiver.get_finished_jobs() == []
    raise AssertionError(f"the receiver never kept {early} notification(s): {receiver.stats()}")


def test_an_old_senders_early_write_never_completes_a_job_of_a_new_sender_of_the_same_name(
    pair: Pair,
) -> None:
    # the old engine-a writes job 1 into block 2 before the receiver expects it...
    pair.sender.submit_store(TransferJob(1, ["2"], [0]))
    assert [(r.job_id, r.success) for r in pair.step_until(1, 0)[0]] == [(1, True)]
    step_receiver_until(pair.receiver, early=1)
    # ...then goes away; the receiver forgets it, and a new engine-a (a new process, with
    # other bytes) connects and restarts its job ids
    pair.receiver.forget_peer("engine-a")
    pair.sender.shutdown()
    source = torch.full((BLOCKS, BLOCK_BYTES), 9, dtype=torch.uint8)
    new = PeerSender(source, agent=make_agent("engine-a", "UCX"))
    try:
        new.connect(pair.receiver.metadata(), pair.receiver.block_descs())
        assert pair.receiver.connect(new.metadata()) == "engine-a"
        pair.receiver.expect(TransferJob(1, ["2"], [2], is_promotion=True), "engine-a")
        for _ in range(100):
            assert pair.receiver.get_finished_jobs() == [], "the old sender's write is not it"
        assert pair.receiver.state_of(1) is ReceiveState.EXPECTING

        new.submit_store(TransferJob(1, ["2"], [5]))
        received: list[JobResult] = []
        for _ in range(20_000):
            new.get_finished_jobs()
            received += pair.receiver.get_finished_jobs()
            if received:
                break
        assert [(r.job_id, r.success) for r in received] == [(1, True)]
        assert torch.equal(pair.target[2], source[5]), "published with the new sender's bytes"
        assert pair.receiver.stats()["discarded"] == 1, "the old link's notification"
    finally:
        new.shutdown()


def test_a_sender_restarting_its_job_ids_on_a_new_link_completes_only_its_new_jobs(
    pair: Pair,
) -> None:
    # link 1: job 1 is expected and written (its notification used); job 2 is written into
    # block 1 but never expected (left over)
    pair.receiver.expect(TransferJob(1, ["0"], [0], is_promotion=True), pair.sender_name)
    pair.sender.submit_store(TransferJob(1, ["0"], [0]))
    pair.sender.submit_store(TransferJob(2, ["1"], [1]))
    sent, received = pair.step_until(2, 1)
    assert sorted((r.job_id, r.success) for r in sent + received) == [
        (1, True), (1, True), (2, True)]
    step_receiver_until(pair.receiver, early=1)
    old_metadata = pair.sender.metadata()

    # both ends start a new link, and the sender's job ids start from 1 again
    pair.sender.forget_peer()
    pair.receiver.forget_peer(pair.sender_name)
    pair.sender.connect(pair.receiver.metadata(), pair.receiver.block_descs())
    assert pair.sender.metadata() != old_metadata, "a new link, a new nonce"
    pair.receiver.connect(pair.sender.metadata())
    for job in (1, 2):
        pair.receiver.expect(TransferJob(job, [str(job - 1)], [job - 1], is_promotion=True),
                             pair.sender_name)
    for _ in range(100):
        assert pair.receiver.get_finished_jobs() == [], "neither old notification counts"

    pair.sender.submit_store(TransferJob(1, ["0"], [6]))
    pair.sender.submit_store(TransferJob(2, ["1"], [7]))
    sent, received = pair.step_until(2, 2)
    assert sorted((r.job_id, r.success) for r in received) == [(1, True), (2, True)]
    assert torch.equal(pair.target[0], pair.source[6])
    assert torch.equal(pair.target[1], pair.source[7])


def test_a_write_that_comes_before_the_receiver_connected_its_sender_counts_once_it_does(
) -> None:
    require_nixl()
    source = torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
    target = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    sender = PeerSender(source, agent=make_agent("engine-a", "UCX"))
    receiver = PeerReceiver(target, agent=make_agent("engine-b", "UCX"))
    try:
        sender.connect(receiver.metadata(), receiver.block_descs())
        sender.submit_store(TransferJob(1, ["4"], [3]))  # the receiver has not connected it
        sent: list[JobResult] = []
        for _ in range(20_000):
            receiver.get_finished_jobs()
            sent += sender.get_finished_jobs()
            if sent:
                break
        assert [(r.job_id, r.success) for r in sent] == [(1, True)]
        step_receiver_until(receiver, early=1)
        assert receiver.stats()["unknown"] == 1, "its nonce is not known yet: kept"

        receiver.connect(sender.metadata())
        assert (receiver.stats()["unknown"], receiver.stats()["early"]) == (0, 1)
        receiver.expect(TransferJob(1, ["4"], [4], is_promotion=True), "engine-a")
        assert [(r.job_id, r.success) for r in receiver.get_finished_jobs()] == [(1, True)]
        assert torch.equal(target[4], source[3])
    finally:
        sender.shutdown()
        receiver.shutdown()


class FakePair:
    """A sender and a receiver on fake UCX agents, linked both ways: blocks of 0xAA to send,
    a cache of zeros to receive them."""

    def __init__(self) -> None:
        self.sender_agent, self.receiver_agent = fake_ucx_pair()
        self.source = torch.full((4, 64), 0xAA, dtype=torch.uint8)
        self.target = torch.zeros(4, 64, dtype=torch.uint8)
        self.sender = PeerSender(self.source, agent=self.sender_agent)
        self.receiver = PeerReceiver(self.target, agent=self.receiver_agent)
        self.sender.connect(self.receiver.metadata(), self.receiver.block_descs())
        self.name = self.receiver.connect(self.sender.metadata())


def test_the_sender_refuses_loads_and_keys_that_are_not_receiver_blocks(pair: Pair) -> None:
    with pytest.raises(InvalidJobError, match="only writes"):
        pair.sender.submit_load(TransferJob(1, ["0"], [0], is_promotion=True))
    with pytest.raises(InvalidJobError, match="receiver's block index"):
        pair.sender.submit_store(TransferJob(1, ["block-0"], [0]))
    with pytest.raises(InvalidJobError, match="out of range"):
        pair.sender.submit_store(TransferJob(1, [str(BLOCKS)], [0]))
    assert not pair.sender.has_pending_work()


def test_a_sender_never_vouches_for_a_receiver_block_it_wrote() -> None:
    """A write to receiver block 3 succeeds on both sides; the receiver then hands block 3
    back to its engine, which writes over it, and later restarts under the same name with a
    cache of its own. Through all of it the sender's lookup, verdict and holds say MISS: it
    cannot know what the receiver's block holds. (Its write made the key HIT, and a cascading
    store or a vLLM store would have skipped writing a block the receiver no longer had.)"""
    pair = FakePair()
    receiver_agent, source, target = pair.receiver_agent, pair.source, pair.target
    sender, receiver, name = pair.sender, pair.receiver, pair.name
    receiver.expect(TransferJob(1, ["3"], [3], is_promotion=True), name)
    sender.submit_store(TransferJob(1, ["3"], [0]))
    assert [r.success for r in sender.get_finished_jobs()] == [True]
    assert [r.success for r in receiver.get_finished_jobs()] == [True]
    assert torch.equal(target[3], source[0])
    target[3].fill_(0x55)  # the engine has block 3 back, and writes it
    assert (sender.lookup("3"), sender.verdict("3"), sender.holds("3")) == (
        Lookup.MISS, Lookup.MISS, False)

    receiver.shutdown()  # the receiver restarts: a new one of the same name, a cache of zeros
    receiver_agent.fabric.kill("engine-b")
    sender.forget_peer()
    fresh = torch.zeros(4, 64, dtype=torch.uint8)
    restarted = PeerReceiver(fresh, agent=receiver_agent.fabric.agent("engine-b"))
    sender.connect(restarted.metadata(), restarted.block_descs())
    assert (sender.lookup("3"), sender.holds("3")) == (Lookup.MISS, False)
    with pytest.raises(ValueError, match="receiver's block index, got 'block-3'"):
        sender.lookup("block-3")
    sender.shutdown()
    restarted.shutdown()
    with pytest.raises(TierClosedError):
        sender.lookup("3")


# -- the receiving machine, on a stand-in for the receiver's agent ---------------------------------

class NotifyingAgent:
    """What a receiver calls on its agent: registration, peers, delivered notifications, and
    the notifications it sends (probes). A peer in ``gone`` ended: sending to it fails with a
    disconnect; one in ``pending`` is loaded but not yet held; ``failing`` scripts errors for
    the next calls of a method."""

    name = "receiver"

    def __init__(self) -> None:
        self.inbox: dict[str, list[bytes]] = {}
        self.peers: set[str] = set()
        self.pending: set[str] = set()
        self.gone: set[str] = set()
        self.sent: list[tuple[str, bytes]] = []
        self.failing: dict[str, list[Exception]] = {}
        self.registered = 0

    def _fail(self, call: str) -> None:
        errors = self.failing.get(call)
        if errors:
            raise errors.pop(0)

    def register_memory(self, descs: Any, mem_type: str) -> str:
        self.registered += 1
        return "registration"

    def deregister_memory(self, registration: Any) -> None:
        self.registered -= 1

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self._fail("add_remote_agent")
        self.peers.add(metadata.decode())
        return metadata

    def check_remote_metadata(self, name: str) -> bool:
        self._fail("check_remote_metadata")
        return name in self.peers and name not in self.pending

    def remove_remote_agent(self, name: str) -> None:
        self._fail("remove_remote_agent")
        self.peers.remove(name)

    def send_notif(self, name: str, message: bytes) -> None:
        self._fail("send_notif")
        if name in self.gone:
            raise FakeNixlError(DISCONNECTED)
        self.sent.append((name, message))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self._fail("get_new_notifs")
        inbox, self.inbox = self.inbox, {}
        return inbox


class NamedAgent(FakeNixlAgent):
    """A sender's agent whose metadata is its name, as :class:`NotifyingAgent` loads it."""

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()


def sender_metadata(name: str = "engine-a") -> bytes:
    """What a new sender called ``name`` gives a receiver: ``PeerSender.metadata()``, with the
    nonce of its first link."""
    return PeerSender(torch.zeros(1, 16), agent=NamedAgent(name)).metadata()


def nonce_of(receiver: PeerReceiver, sender: str = "engine-a") -> str:
    """The nonce of the receiver's last link to ``sender``."""
    link = receiver.links.get(sender)
    assert link is not None
    return link.nonce


def outcomes(receiver: PeerReceiver) -> list[tuple[int, bool]]:
    return [(r.job_id, r.success) for r in receiver.get_finished_jobs()]


def promotion(job_id: int, block: int) -> TransferJob:
    return TransferJob(job_id, [str(block)], [block], is_promotion=True)


def test_the_receiver_publishes_on_its_notification_and_fails_what_a_lost_peer_owed() -> None:
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    sender = receiver.connect(sender_metadata())
    nonce = nonce_of(receiver)
    receiver.expect(TransferJob(1, ["0"], [0], is_promotion=True), sender)
    receiver.expect(TransferJob(2, ["1"], [1], is_promotion=True), sender)
    assert receiver.get_finished_jobs() == []
    assert receiver.state_of(1) is ReceiveState.EXPECTING

    agent.inbox = {"engine-a": [b"unrelated", notification_for(nonce, 1, [0])]}
    assert outcomes(receiver) == [(1, True)]
    receiver.forget_peer(sender)
    assert "engine-a" not in agent.peers, "cut off before anything it owed fails"
    assert outcomes(receiver) == [(2, False)]
    agent.inbox = {"engine-a": [notification_for(nonce, 2, [1])]}  # too late: link closed
    assert receiver.get_finished_jobs() == []
    assert receiver.stats() == {"expected": 0, "early": 0, "unknown": 0, "dropped": 0,
                                "discarded": 2, "notify_errors": 0, "leaks": 0}, (
        "unrelated; too late")
    receiver.shutdown()
    assert agent.registered == 0


def test_a_notification_that_comes_before_its_expect_still_counts() -> None:
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    sender = receiver.connect(sender_metadata())
    receiver.expect(TransferJob(1, ["0"], [0], is_promotion=True), sender)
    # job 2 is faster than its expect
    agent.inbox = {"engine-a": [notification_for(nonce_of(receiver), 2, [3])]}
    assert receiver.get_finished_jobs() == []
    assert receiver.stats()["early"] == 1
    receiver.expect(TransferJob(2, ["3"], [3], is_promotion=True), sender)
    assert [(r.job_id, r.success) for r in receiver.get_finished_jobs()] == [(2, True)]
    assert receiver.state_of(1) is ReceiveState.EXPECTING
    assert receiver.stats()["early"] == 0


def test_the_receiver_refuses_what_it_cannot_expect() -> None:
    receiver = PeerReceiver(torch.zeros(4, 16), agent=NotifyingAgent())
    with pytest.raises(PeerNotConnected, match="sender 'nobody' is unknown"):
        receiver.expect(TransferJob(1, ["0"], [0], is_promotion=True), "nobody")
    sender = receiver.connect(sender_metadata())
    with pytest.raises(InvalidJobError, match="block 9 is out of range"):
        receiver.expect(TransferJob(1, ["9"], [9], is_promotion=True), sender)
    receiver.expect(TransferJob(1, ["0"], [0], is_promotion=True), sender)
    with pytest.raises(InvalidJobError, match="job 1 is already expected"):
        receiver.expect(TransferJob(1, ["1"], [1], is_promotion=True), sender)


def test_a_receiver_takes_only_a_senders_own_metadata_and_says_what_is_wrong_with_other_input(
) -> None:
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    with pytest.raises(ValueError, match=r"must come from PeerSender.metadata\(\) .* 8 bytes "
                                         r"that do not start with b'kvfsm-sender:'"):
        receiver.connect(b"engine-a")  # the agent's own metadata: no link nonce
    with pytest.raises(ValueError, match="a nonce of 32 lowercase hex digits"):
        receiver.connect(b"kvfsm-sender:1234:engine-a")
    with pytest.raises(ValueError, match="no agent metadata after it"):
        receiver.connect(sender_metadata()[:46])
    with pytest.raises(TypeError, match=r"must be the bytes PeerSender.metadata\(\) returns, "
                                        r"got str"):
        receiver.connect(sender_metadata().hex())  # type: ignore[arg-type]
    assert agent.peers == set(), "nothing was loaded"
    assert receiver.connect(bytearray(sender_metadata())) == "engine-a"


def test_a_new_link_of_a_sender_that_restarts_its_job_ids_never_shares_a_notification_with_the_old(
) -> None:
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    first_metadata = sender_metadata()
    receiver.connect(first_metadata)
    first = nonce_of(receiver)
    receiver.expect(promotion(1, 0), "engine-a")

    # the sender restarts (a new link, job ids from 1 again) and writes its new job 1 into
    # the same block before the receiver polled: the old job 1 was not written by it
    receiver.forget_peer("engine-a")
    receiver.connect(sender_metadata())
    second = nonce_of(receiver)
    assert second != first
    agent.inbox = {"engine-a": [notification_for(second, 1, [0])]}
    assert outcomes(receiver) == [(1, False)], "the old link's job fails"
    # its failure handed block 0 back to the engine, after the new write landed there: the
    # engine may have written the block since, so that notification no longer says what the
    # block holds, and the new link's job 1 waits for a write made after it was expected
    receiver.expect(promotion(1, 0), "engine-a")
    assert receiver.get_finished_jobs() == []
    assert receiver.state_of(1) is ReceiveState.EXPECTING
    agent.inbox = {"engine-a": [notification_for(second, 1, [0])]}
    assert outcomes(receiver) == [(1, True)], "the new link's job 1 has its notification"

    # a notification counts once: the same job id expected again waits for a new write...
    receiver.expect(promotion(1, 0), "engine-a")
    agent.inbox = {"engine-a": [notification_for(first, 1, [0])]}  # ...which the old link's
    assert receiver.get_finished_jobs() == []                         # never is
    assert receiver.state_of(1) is ReceiveState.EXPECTING
    agent.inbox = {"engine-a": [notification_for(second, 1, [0])]}
    assert outcomes(receiver) == [(1, True)]
    assert receiver.stats() == {"expected": 0, "early": 0, "unknown": 0, "dropped": 0,
                                "discarded": 2, "notify_errors": 0, "leaks": 0}

    with pytest.raises(PeerLinkError, match=f"sender 'engine-a': this metadata is that of a link "
                                            f"that closed \\(nonce {first} is spent\\)"):
        receiver.connect(first_metadata)  # the old link's metadata makes no new link
    with pytest.raises(PeerLinkError, match="'engine-a' is already linked \\(CONNECTED\\) with "
                                            "this metadata"):
        receiver.connect(sender_metadata()[:13] + second.encode() + b":engine-a")


def test_a_write_that_landed_before_its_blocks_were_handed_back_never_completes_a_later_job(
    pair: Pair, caplog: pytest.LogCaptureFixture,
) -> None:
    """Job 7 is expected into block 3 over the first link; the sender links again (a new
    nonce) and writes job 7 there, which the receiver cannot count yet. The receiver forgets
    the old link: job 7 fails, block 3 goes back to the engine, which writes it. Job 7 is then
    expected again over the sender's new link: the kept notification reports a write that
    landed before the engine got block 3 back, so it no longer says what block 3 holds. It
    completed the job at once, a success over the engine's bytes."""
    pair.receiver.expect(TransferJob(7, ["3"], [3], is_promotion=True), pair.sender_name)
    pair.sender.forget_peer()  # the sender links again: its writes carry a new nonce
    pair.sender.connect(pair.receiver.metadata(), pair.receiver.block_descs())
    pair.sender.submit_store(TransferJob(7, ["3"], [0]))
    sent, _ = pair.step_until(1, 0)
    assert [(r.job_id, r.success) for r in sent] == [(7, True)]
    step_receiver_until(pair.receiver, early=1)
    assert "its notifications carry a nonce its link does not" in caplog.text, "said why"
    assert pair.receiver.state_of(7) is ReceiveState.EXPECTING

    pair.receiver.forget_peer(pair.sender_name)
    _, received = pair.step_until(0, 1)
    assert [(r.job_id, r.success) for r in received] == [(7, False)]
    pair.target[3].fill_(0x55)  # the engine has block 3 back, and uses it
    pair.receiver.connect(pair.sender.metadata())
    pair.receiver.expect(TransferJob(7, ["3"], [3], is_promotion=True), pair.sender_name)
    for _ in range(200):
        assert pair.receiver.get_finished_jobs() == [], "no success over the engine's bytes"
    assert pair.receiver.state_of(7) is ReceiveState.EXPECTING
    assert "were handed back (a job covering them was published since) were discarded" in (
        caplog.text)
    assert pair.receiver.stats()["discarded"] == 1

    # a write made after it was expected again completes it, with the sender's bytes
    pair.sender.submit_store(TransferJob(7, ["3"], [0]))
    sent, received = pair.step_until(1, 1)
    assert [(r.job_id, r.success) for r in sent + received] == [(7, True), (7, True)]
    assert torch.equal(pair.target[3], pair.source[0])


def test_a_notification_carrying_a_links_nonce_from_another_sender_never_counts() -> None:
    """NIXL names a notification's sender. One that carries engine-a's link nonce but comes
    from engine-x (another agent that learnt the nonce) completes nothing, now or later: it
    is discarded and counted, and engine-a's own completes the job."""
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    receiver.connect(sender_metadata())
    nonce = nonce_of(receiver)
    agent.inbox = {"engine-x": [notification_for(nonce, 1, [0])]}  # before its expect...
    assert outcomes(receiver) == []
    receiver.expect(promotion(1, 0), "engine-a")
    agent.inbox = {"engine-x": [notification_for(nonce, 1, [0])]}  # ...and while expected
    assert outcomes(receiver) == []
    assert receiver.stats()["discarded"] == 2 and receiver.stats()["early"] == 0
    agent.inbox = {"engine-a": [notification_for(nonce, 1, [0])]}
    assert outcomes(receiver) == [(1, True)]


@pytest.mark.parametrize("second_take_raises", [False, True])
def test_a_write_that_lands_inside_the_poll_that_hands_its_blocks_back_is_dated_before(
    second_take_raises: bool,
) -> None:
    """As above, but the sender's new write lands inside the receiver's poll that fails old
    job 7, after that poll took NIXL's notifications and before it handed block 3 back. Its
    notification was taken a poll later, dated after the hand-back, and completed job 7
    expected again: a success over the engine's bytes. The poll now takes NIXL's
    notifications once more before it hands blocks back; if that take raises, it hands
    nothing back (job 7's failure waits for the next poll, whose take goes through)."""
    pair = FakePair()
    receiver_agent, source, target = pair.receiver_agent, pair.source, pair.target
    sender, receiver, name = pair.sender, pair.receiver, pair.name
    receiver.expect(TransferJob(7, ["3"], [3], is_promotion=True), name)
    sender.forget_peer()  # the sender links again: a new nonce
    sender.connect(receiver.metadata(), receiver.block_descs())
    receiver.forget_peer(name)  # job 7 fails at the next poll

    taking = receiver_agent.get_new_notifs
    landed: list[bool] = []
    raises = [second_take_raises]

    def write_lands_after_this_take() -> Any:
        if landed and raises[0]:
            raises[0] = False
            raise RuntimeError("NIXL_ERR_BACKEND")  # (NIXL keeps what it has for the next)
        taken = taking()
        if not landed:
            landed.append(True)
            sender.submit_store(TransferJob(7, ["3"], [0]))
            assert [r.success for r in sender.get_finished_jobs()] == [True]
        return taken

    receiver_agent.get_new_notifs = write_lands_after_this_take  # type: ignore[method-assign]
    if second_take_raises:
        assert receiver.get_finished_jobs() == [], "no hand-back without the second take"
        assert receiver.stats()["notify_errors"] == 1
    assert [(r.job_id, r.success) for r in receiver.get_finished_jobs()] == [(7, False)]
    assert landed and torch.equal(target[3], source[0]), "the write landed in that poll"
    target[3].fill_(0x55)  # the engine has block 3 back, and writes it
    receiver.connect(sender.metadata())
    receiver.expect(TransferJob(7, ["3"], [3], is_promotion=True), name)
    for _ in range(5):
        assert receiver.get_finished_jobs() == [], "no success over the engine's bytes"
    assert receiver.stats()["discarded"] == 1
    sender.shutdown()
    receiver.shutdown()


def test_shutdown_publishes_what_was_owed_even_when_nixl_cannot_say_what_arrived() -> None:
    """A poll whose second take of notifications raises hands no block back; shutdown's does
    all the same, since it closed every link first: no notification can count any more, and
    every job owed publishes its failure."""
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    receiver.connect(sender_metadata())
    receiver.expect(promotion(1, 0), "engine-a")
    receiver.forget_peer("engine-a")
    agent.failing["get_new_notifs"] = [FakeNixlError("NIXL_ERR_BACKEND")] * 10
    assert outcomes(receiver) == [], "the second take raised: nothing handed back"
    receiver.shutdown()
    assert outcomes(receiver) == [(1, False)]


def test_a_job_the_receivers_shutdown_fails_says_so() -> None:
    """A job still expected when the receiver is shut down fails saying the receiver was
    shut down (it said its sender was gone, forgotten: a cause that was not one); one whose
    sender was forgotten before still says that."""
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    receiver.connect(sender_metadata())
    receiver.expect(promotion(1, 0), "engine-a")
    receiver.shutdown()
    [result] = receiver.get_finished_jobs()
    assert (result.job_id, result.success) == (1, False)
    assert str(result.reason) == "failed: sender engine-a cut off: the receiver was shut down"

    receiver = PeerReceiver(torch.zeros(4, 16), agent=NotifyingAgent())
    receiver.connect(sender_metadata("engine-b"))
    receiver.expect(promotion(2, 0), "engine-b")
    receiver.forget_peer("engine-b")
    receiver.shutdown()
    [result] = receiver.get_finished_jobs()
    assert str(result.reason) == "failed: sender engine-b is gone: forgotten"


def test_a_second_early_copy_of_a_notification_counts_only_until_its_blocks_go_back() -> None:
    """A sender writes job 5 into block 2 twice before the receiver expects it. The first
    expect takes one copy; once that job is published, block 2 is the engine's again, so the
    other copy (a write that landed before) no longer says what it holds: a later expect of
    job 5 waits for a new write. Another block's copy is not affected."""
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    receiver.connect(sender_metadata())
    nonce = nonce_of(receiver)
    agent.inbox = {"engine-a": [notification_for(nonce, 5, [2])] * 2
                   + [notification_for(nonce, 6, [3])]}
    assert outcomes(receiver) == []
    assert receiver.stats()["early"] == 3
    receiver.expect(promotion(5, 2), "engine-a")
    assert outcomes(receiver) == [(5, True)]

    receiver.expect(promotion(5, 2), "engine-a")
    assert outcomes(receiver) == [], "the copy from before block 2 went back is discarded"
    assert (receiver.stats()["early"], receiver.stats()["discarded"]) == (1, 1)
    receiver.expect(promotion(6, 3), "engine-a")
    agent.inbox = {"engine-a": [notification_for(nonce, 5, [2])]}
    assert sorted(outcomes(receiver)) == [(5, True), (6, True)]
    assert receiver.stats()["early"] == 0


def test_a_flood_of_unknown_notifications_stays_bounded_and_never_drops_an_open_links_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    receiver.connect(sender_metadata())
    flood = 70_000  # more than the 65,536 unclaimed notifications kvfsm once kept
    agent.inbox = {"engine-x": [notification_for(f"{i:032x}", 1, [0]) for i in range(flood)],
                   "engine-y": [b"not kvfsm's %d" % i for i in range(flood)]}
    with caplog.at_level("WARNING", logger="kvfsm"):
        assert receiver.get_finished_jobs() == []
    assert f"dropped the {flood - MAX_UNKNOWN_NOTIFICATIONS} oldest notification(s)" in caplog.text
    agent.inbox = {"engine-a": [notification_for(nonce_of(receiver), 1, [2])]}  # before expect
    assert receiver.get_finished_jobs() == []
    assert receiver.stats() == {"expected": 0, "early": 1, "unknown": MAX_UNKNOWN_NOTIFICATIONS,
                                "dropped": flood - MAX_UNKNOWN_NOTIFICATIONS,
                                "discarded": flood, "notify_errors": 0, "leaks": 0}
    receiver.expect(promotion(1, 2), "engine-a")
    assert outcomes(receiver) == [(1, True)]


def test_a_notification_that_comes_before_its_sender_is_connected_counts_once_it_is() -> None:
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    metadata = sender_metadata()
    nonce = metadata.split(b":")[1].decode()  # "kvfsm-sender:NONCE:agent metadata"
    agent.inbox = {"engine-a": [notification_for(nonce, 1, [0]), notification_for(nonce, 2, [1])],
                   "engine-z": [notification_for(nonce, 3, [2])]}  # not that sender's
    receiver.get_finished_jobs()
    assert receiver.stats()["unknown"] == 3
    receiver.connect(metadata)
    assert receiver.stats() == {"expected": 0, "early": 2, "unknown": 0, "dropped": 0,
                                "discarded": 1, "notify_errors": 0, "leaks": 0}
    receiver.expect(promotion(1, 0), "engine-a")
    assert outcomes(receiver) == [(1, True)]
    receiver.forget_peer("engine-a")  # what its link kept and no job claimed goes with it
    assert receiver.stats() == {"expected": 0, "early": 0, "unknown": 0, "dropped": 0,
                                "discarded": 2, "notify_errors": 0, "leaks": 0}


def test_the_receiving_machine_explores_clean() -> None:
    found = explore_table(PEER_RECEIVE)
    assert found.ok, found.report()
    assert found.paths == 7


def test_a_receiver_drain_past_its_deadline_raises_drain_timeout_naming_the_job() -> None:
    """Found by review: the shared drain listed a record's ``job_id``, which the receiver's
    records lacked, so the timeout came out as an AttributeError."""
    receiver = PeerReceiver(torch.zeros(4, 16), agent=NotifyingAgent())
    sender = receiver.connect(sender_metadata())
    receiver.expect(promotion(1, 0), sender)
    stuck = r"1 expected job\(s\) not published\n  job 1: EXPECTING"
    with pytest.raises(DrainTimeout, match=stuck):
        receiver.drain_jobs(timeout=0.01)
    assert receiver.state_of(1) is ReceiveState.EXPECTING  # untouched: a later drain goes on


def test_the_receivers_metadata_stays_while_a_quarantined_write_may_still_run() -> None:
    """A write still running past max_running_seconds is given up: published as quarantined,
    its handle held, NIXL may still run it. forget_peer() and shutdown() once removed the
    receiver's metadata under it; now forget_peer() refuses, naming why, and shutdown leaves
    the link (and the metadata) as it is."""
    sending, receiving = fake_ucx_pair(complete_after_polls=10**9)  # a write that never ends
    receiver = PeerReceiver(torch.zeros(4, 64, dtype=torch.uint8), agent=receiving,
                            peer_timeout=None)
    sender = PeerSender(torch.ones(4, 64, dtype=torch.uint8), agent=sending,
                        policy=RetryPolicy(max_running_seconds=0.05))
    receiver.connect(sender.metadata())
    sender.connect(receiver.metadata(), receiver.block_descs())
    sender.submit_store(TransferJob(1, ["2"], [0]))
    results: list[JobResult] = []
    for _ in range(2000):
        results += sender.get_finished_jobs()
        if results:
            break
        time.sleep(0.001)
    assert [(r.job_id, r.success) for r in results] == [(1, False)]
    assert sending.running_transfers() == 1

    with pytest.raises(RuntimeError, match=r"1 quarantined transfer\(s\) hold their handles"):
        sender.forget_peer()
    sender.shutdown(timeout=0.2)
    assert sender.link_state() is LinkState.CONNECTED, "its metadata stays under the write"
    assert sending.misuses == []


# -- what a receiver and a sender refuse -----------------------------------------------------------

def fake_peers() -> tuple[PeerSender, PeerReceiver, str]:
    """A sender and a receiver of four 64-byte blocks on fake UCX agents, linked both ways;
    the sender's name, as the receiver knows it."""
    sending, receiving = fake_ucx_pair()
    receiver = PeerReceiver(torch.zeros(4, 64, dtype=torch.uint8), agent=receiving,
                            peer_timeout=None)
    sender = PeerSender(torch.arange(256, dtype=torch.uint8).view(4, 64), agent=sending)
    name = receiver.connect(sender.metadata())
    sender.connect(receiver.metadata(), receiver.block_descs())
    return sender, receiver, name


def test_a_job_id_whose_result_waits_or_a_block_another_job_expects_is_refused() -> None:
    """Two expected jobs on one receiver block would both be published as arrived, one of them
    with the other's bytes; a job id whose earlier result the engine has not collected would
    make the engine take that result for the new job's. Both are refused, naming why, and
    taken once the earlier job is over and its result collected."""
    sender, receiver, name = fake_peers()
    receiver.expect(TransferJob(1, ["1"], [1]), name)
    with pytest.raises(InvalidJobError, match=r"job 2: block 1 is expected from job 1 already"):
        receiver.expect(TransferJob(2, ["1"], [1]), name)
    assert receiver.state_of(2) is None

    sender.submit_store(TransferJob(1, ["1"], [3]))
    sender.drain_jobs(timeout=5)  # written and notified
    assert [(r.job_id, r.success) for r in sender.get_finished_jobs()] == [(1, True)]
    receiver.drain_jobs(timeout=5)  # published, not yet handed out
    with pytest.raises(InvalidJobError, match="job 1 has a result not yet collected"):
        receiver.expect(TransferJob(1, ["2"], [2]), name)
    assert [(r.job_id, r.success) for r in receiver.get_finished_jobs()] == [(1, True)]
    assert bytes(receiver.primary[1].numpy()) == bytes(sender.primary[3].numpy())

    receiver.expect(TransferJob(1, ["2"], [2]), name)  # now both may be taken again
    receiver.expect(TransferJob(2, ["1"], list(np.array([1]))), name)  # numpy's ints are ints
    assert receiver.state_of(1) is receiver.state_of(2) is not None
    sender.shutdown(timeout=5)
    receiver.shutdown()


class HeldAfterClosing(PeerSender):
    """A sender whose background work, once the tier is closed, starts a call on another
    thread that holds the tier's lock until told to let go (a stats() of a monitor stuck
    in a slow log handler, say)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.let_go = threading.Event()
        self.holding = threading.Event()

    def _stop_probes(self) -> None:
        def hold() -> None:
            with self._lock:
                self.holding.set()
                self.let_go.wait(10)
        if not self.let_go.is_set():
            threading.Thread(target=hold).start()
            self.holding.wait(10)


@pytest.mark.timeout(30)
def test_a_sender_shutdown_keeps_its_deadline_while_another_thread_holds_the_tier() -> None:
    """Closing the link waits for the tier's lock: past the deadline it raises DrainTimeout,
    leaving the link open, and a later shutdown closes it."""
    sending, receiving = fake_ucx_pair()
    receiver = PeerReceiver(torch.zeros(4, 64, dtype=torch.uint8), agent=receiving)
    sender = HeldAfterClosing(torch.zeros(4, 64, dtype=torch.uint8), agent=sending)
    receiver.connect(sender.metadata())
    sender.connect(receiver.metadata(), receiver.block_descs())

    with pytest.raises(DrainTimeout, match="before the link was closed; call shutdown again"):
        sender.shutdown(timeout=0.1)
    assert sender.holding.is_set() and sender.link_state() is LinkState.CONNECTED
    sender.let_go.set()
    sender.shutdown(timeout=5)
    assert sender.link_state() is LinkState.CLOSED
    receiver.shutdown()
    assert sending.misuses == []


@pytest.mark.parametrize(("job", "message"), [
    ("job", "expected a TransferJob, got str"),
    (TransferJob("x", ["1"], [1]), "job_id must be an int, got 'x'"),  # type: ignore[arg-type]
    (TransferJob(True, ["1"], [1]), "job_id must be an int, got True"),
    (TransferJob(1, [], []), r"job 1: block_ids must be a non-empty list or tuple, got \[\]"),
    (TransferJob(1, "12", "12"), "job 1: block_ids must be a non-empty list or tuple, got '12'"),
    (TransferJob(1, ["1"], [3.0]), r"job 1: block 3.0 is not an int"),  # type: ignore[list-item]
    (TransferJob(1, ["1"], [True]), "job 1: block True is not an int"),
    (TransferJob(1, ["1"], [4]), r"job 1: block 4 is out of range \[0, 4\)"),
    (TransferJob(1, ["1", "2"], [0, 0]), r"job 1: a block appears twice in \[0, 0\]"),
])
def test_a_malformed_expected_job_is_refused_naming_what_is_wrong(job: Any, message: str) -> None:
    sender, receiver, name = fake_peers()
    with pytest.raises(InvalidJobError, match=message):
        receiver.expect(job, name)
    assert receiver.stats()["expected"] == 0
    sender.shutdown(timeout=5)
    receiver.shutdown()


def test_a_shut_down_receiver_or_sender_links_nothing_and_expects_nothing() -> None:
    sender, receiver, name = fake_peers()
    receiver.shutdown()
    with pytest.raises(TierClosedError, match="PeerReceiver is shut down; job 1 refused"):
        receiver.expect(TransferJob(1, ["1"], [1]), name)
    with pytest.raises(TierClosedError, match="PeerReceiver is shut down"):
        receiver.connect(sender.metadata())
    sender.forget_peer()
    sender.shutdown(timeout=5)
    with pytest.raises(TierClosedError, match="PeerSender is shut down"):
        sender.connect(receiver.metadata(), receiver.block_descs())


@pytest.mark.parametrize("receiving_cache", [
    torch.zeros(4, 32, dtype=torch.uint8),     # another shape
    torch.zeros(4, 64, dtype=torch.float32),   # another dtype
], ids=["shape", "dtype"])
def test_a_sender_refuses_a_receiver_whose_blocks_are_another_size(
        receiving_cache: torch.Tensor) -> None:
    """connect() took them, and every write then failed in NIXL with a bare
    NIXL_ERR_INVALID_PARAM, the receiver's job left expecting."""
    sending, receiving = fake_ucx_pair()
    receiver = PeerReceiver(receiving_cache, agent=receiving)
    sender = PeerSender(torch.zeros(4, 64, dtype=torch.uint8), agent=sending)
    size = receiving_cache[0].nbytes
    with pytest.raises(ValueError, match=rf"receiver_blocks\[0\] is {size} bytes long, this "
                                         r"sender's blocks 64: the receiver's cache has another "
                                         r"block size"):
        sender.connect(receiver.metadata(), receiver.block_descs())
    assert sender.link_state() is LinkState.UNKNOWN, "nothing linked"
    sender.shutdown(timeout=5)
    receiver.shutdown()


@pytest.mark.parametrize(("blocks", "message"), [
    (None, "receiver_blocks must be a non-empty list"),
    ([], "receiver_blocks must be a non-empty list"),
    ([(0, 64)], r"receiver_blocks\[0\] must be an \(address, length, device\) triple"),
    ([(0, 64, 0), (64, "64", 0)], r"receiver_blocks\[1\] must be an \(address, length, device\)"),
])
def test_a_sender_given_bad_receiver_blocks_is_not_linked(blocks: Any, message: str) -> None:
    """The link was made, and its metadata loaded, before the blocks were read: a retry then
    met 'already linked'. Now nothing changes."""
    sending, receiving = fake_ucx_pair()
    receiver = PeerReceiver(torch.zeros(4, 64, dtype=torch.uint8), agent=receiving)
    sender = PeerSender(torch.zeros(4, 64, dtype=torch.uint8), agent=sending)
    with pytest.raises(ValueError, match=message):
        sender.connect(receiver.metadata(), blocks)
    assert sender.link_state() is LinkState.UNKNOWN
    sender.connect(receiver.metadata(), receiver.block_descs())  # the retry links
    assert sender.link_state() is LinkState.CONNECTED
    sender.forget_peer()
    sender.shutdown(timeout=5)
    receiver.shutdown()


@pytest.mark.timeout(30)
def test_a_receiver_shuts_down_within_a_timeout_as_a_tier_does() -> None:
    """shutdown(timeout=5) raised TypeError on a receiver, where the sender and the tiers take
    one; it bounds the wait for another thread's call, and a later shutdown goes on."""
    sender, receiver, _ = fake_peers()
    holding, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with receiver._lock:  # another thread's call, stuck
            holding.set()
            let_go.wait(10)

    other = threading.Thread(target=hold)
    other.start()
    holding.wait(10)
    try:
        with pytest.raises(DrainTimeout, match="another thread held the receiver past the "
                                               "deadline; call shutdown again"):
            receiver.shutdown(timeout=0.1)
    finally:
        let_go.set()
        other.join()
    assert not receiver._closed
    receiver.shutdown(timeout=5)
    assert receiver._closed
    sender.shutdown(timeout=5)


def test_a_sender_linked_to_one_receiver_after_another_keeps_its_links_and_leaks_bounded(
) -> None:
    """A sender links 300 receivers in turn and forgets each, every metadata removal
    raising. Every leak is counted, the last leak_record are listed, and only the last
    CLOSED_KEPT closed links are kept (an older one reads UNKNOWN)."""
    fabric = FakeUcxFabric()
    agent = fabric.agent("sender")
    sender = PeerSender(torch.zeros(4, 64, dtype=torch.uint8), agent=agent)
    for index in range(300):
        receiver = fabric.agent(f"receiver-{index}")
        sender.connect(receiver.get_agent_metadata(), [(0, 64, 0)] * 4)
        agent.inject("remove_remote_agent", Raise())
        sender.forget_peer()
    stats = sender.stats()
    assert stats["leaks"] == 300
    assert len(stats["leaked"]) == sender.leak_record == 256
    assert stats["leaked"][-1][1].call == "remove_remote_agent"
    assert len(sender.links.links) == CLOSED_KEPT
    assert sender.links.state_of(f"receiver-{300 - CLOSED_KEPT}") is LinkState.CLOSED
    assert sender.links.state_of(f"receiver-{299 - CLOSED_KEPT}") is LinkState.UNKNOWN
    sender.shutdown(5)


def test_a_receiver_that_saw_many_senders_come_and_go_keeps_its_links_bounded() -> None:
    """300 senders connect and are forgotten in turn: the receiver keeps its open links and
    the last CLOSED_KEPT closed ones, and still refuses a closed link's metadata, however
    old (its nonce stays spent)."""
    receiver = PeerReceiver(torch.zeros(4, 16), agent=NotifyingAgent())
    first = sender_metadata("engine-0")
    receiver.connect(first)
    receiver.forget_peer("engine-0")
    for index in range(1, 300):
        receiver.connect(sender_metadata(f"engine-{index}"))
        receiver.forget_peer(f"engine-{index}")
    assert len(receiver.links.links) == CLOSED_KEPT
    assert receiver.link_state(f"engine-{300 - CLOSED_KEPT}") is LinkState.CLOSED
    assert receiver.link_state(f"engine-{299 - CLOSED_KEPT}") is LinkState.UNKNOWN
    with pytest.raises(PeerLinkError, match="spent"):
        receiver.connect(first)
    receiver.shutdown(5)


def test_a_sender_linked_again_counts_as_closed_when_its_new_link_closes() -> None:
    """engine-0 links first and, CLOSED_KEPT closes later, links again and is forgotten:
    its link is the latest closed, kept while the older ones go."""
    receiver = PeerReceiver(torch.zeros(4, 16), agent=NotifyingAgent())
    for index in range(CLOSED_KEPT):
        receiver.connect(sender_metadata(f"engine-{index}"))
        receiver.forget_peer(f"engine-{index}")
    receiver.connect(sender_metadata("engine-0"))
    assert receiver.link_state("engine-0") is LinkState.CONNECTED
    receiver.forget_peer("engine-0")
    for index in range(CLOSED_KEPT, CLOSED_KEPT + CLOSED_KEPT - 1):
        receiver.connect(sender_metadata(f"engine-{index}"))
        receiver.forget_peer(f"engine-{index}")
    assert receiver.link_state("engine-0") is LinkState.CLOSED
    assert receiver.link_state("engine-1") is LinkState.UNKNOWN
    receiver.shutdown(5)


class HeldNotifs(NotifyingAgent):
    """A receiver's agent whose get_new_notifs, once ``hold`` is set, waits inside the call
    until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.inside, self.go = threading.Event(), threading.Event()

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        if self.hold:
            self.inside.set()
            self.go.wait(10)
        return super().get_new_notifs()


def test_a_receivers_stats_answer_while_another_thread_polls_inside_nixl() -> None:
    """A monitoring thread reads the receiver's stats while the scheduler's poll is inside
    get_new_notifs: the stats come at once, the poll still inside (they never wait for the
    receiver's lock), and count the notification kept for an expect to come."""
    agent = HeldNotifs()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    receiver.connect(sender_metadata())
    agent.inbox = {"engine-a": [notification_for(nonce_of(receiver), 5, [2])]}
    assert outcomes(receiver) == []
    assert receiver.stats()["early"] == 1  # (counted: the lock is free)
    agent.hold = True
    poller = threading.Thread(target=receiver.get_finished_jobs)
    poller.start()
    try:
        assert agent.inside.wait(5)
        stats = receiver.stats()
        assert not agent.go.is_set() and poller.is_alive()
        assert (stats["early"], stats["expected"]) == (1, 0)  # (as last counted)
    finally:
        agent.go.set()
        poller.join(5)
    receiver.shutdown(5)
    assert receiver.stats()["early"] == 0 and receiver.stats()["discarded"] == 1


def test_a_ctrl_c_as_a_notification_is_kept_leaves_the_early_count_true() -> None:
    """A Ctrl-C lands in a poll at each line in turn of keeping a notification that came
    before its expect: the job is completed by it all the same (the notification is filed
    again by the next poll), and stats count the copies the receiver keeps (a count kept
    beside the inboxes drifted to -1). One filed twice (the interrupt came once it was kept,
    before it was taken off what NIXL handed over) is kept once more, and never counts: it is
    older than the job's hand-back."""
    for line in range(1, 100):
        agent = NotifyingAgent()
        receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
        receiver.connect(sender_metadata())
        agent.inbox = {"engine-a": [notification_for(nonce_of(receiver), 5, [2])]}
        landed = interrupted_at_line(line, PeerReceiver._arrived, receiver.get_finished_jobs)
        receiver.expect(promotion(5, 2), "engine-a")
        assert outcomes(receiver) == [(5, True)], line
        kept = sum(len(came) for inbox in receiver._inboxes.values()
                   for came in inbox.early.values())
        assert receiver.stats()["early"] == kept <= 1, line
        receiver.expect(promotion(5, 2), "engine-a")  # the same job again: the copy is stale
        assert outcomes(receiver) == [], line
        assert receiver.stats()["early"] == 0, line
        receiver.shutdown(5)
        if not landed:
            assert line > 1
            break


def test_a_drain_poll_of_a_peer_sender_subclass_settles_its_link_once() -> None:
    """A drain's poll settles a sender's link once (one check_remote_metadata of a CONNECTING
    link), as the sender's own get_finished_jobs does, whether a subclass has its own or
    not."""
    class Mine(PeerSender):
        def get_finished_jobs(self) -> list[JobResult]:
            return super().get_finished_jobs()

    counts = {}
    for cls in (PeerSender, Mine):
        sender_agent, receiver_agent = fake_ucx_pair()
        checks: list[object] = []

        def not_yet(name: object, checks: list[object] = checks) -> bool:
            checks.append(name)
            return False  # (CONNECTING: checked again at each settle)

        sender_agent.check_remote_metadata = not_yet  # type: ignore[method-assign]
        sender = cls(torch.zeros(4, 64, dtype=torch.uint8), agent=sender_agent)
        receiver = PeerReceiver(torch.zeros(4, 64, dtype=torch.uint8), agent=receiver_agent)
        sender.connect(receiver.metadata(), receiver.block_descs())
        checks.clear()
        sender._drain_poll(None)
        counts[cls.__name__] = len(checks)
        sender.shutdown(5)
        receiver.shutdown(5)
    assert counts["Mine"] == counts["PeerSender"] == 1


def test_a_monitoring_threads_stats_never_holds_up_a_receivers_shutdown() -> None:
    """A thread calling stats over and over, 100,000 notifications kept: shutdown(0), whose
    wait for the lock has no time left, is never refused (stats never takes the lock; a
    version that counted them under it held the lock some milliseconds a call)."""
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    receiver.connect(sender_metadata())
    nonce = nonce_of(receiver)
    # a sender that wrote and was never expected: kept, "not bounded by a number" (peer.md)
    agent.inbox = {"engine-a": [notification_for(nonce, job, [job % 4])
                                for job in range(100_000)]}
    receiver.get_finished_jobs()
    assert receiver.stats()["early"] == 100_000
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            receiver.stats()

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    time.sleep(0.05)
    try:
        refused = 0
        for _ in range(10):
            try:
                receiver.shutdown(0)
                break
            except DrainTimeout:
                refused += 1
        assert refused == 0
    finally:
        stop.set()
        thread.join(5)
        receiver.shutdown(5)


def test_a_receivers_agent_is_its_alone_while_it_is_open() -> None:
    """An engine that sends and receives made both sides on one agent: the sender's calls to
    let UCX progress took the receiver's job notifications and dropped them, and a write that
    landed left its job expected for good, the receiver's stats all zero. A sender on the
    agent of a receiver not shut down is refused, naming the agent, and so is a second
    receiver on it; nothing is registered. Once the receiver is shut down the agent is free;
    a receiver is refused an agent a sender uses too, and two senders may share one."""
    from kvfsm.testing.fake_ucx import FakeUcxFabric  # noqa: PLC0415

    fabric = FakeUcxFabric()
    shared = fabric.agent("engine-x")
    receiver = PeerReceiver(torch.zeros(4, 64, dtype=torch.uint8), agent=shared)
    registered = shared.live_registrations()
    source = torch.full((4, 64), 0xAA, dtype=torch.uint8)
    for side, make in (("PeerSender", lambda: PeerSender(source, agent=shared)),
                       ("PeerReceiver", lambda: PeerReceiver(torch.zeros(4, 64), agent=shared))):
        with pytest.raises(ValueError, match=re.escape(
                f"agent 'engine-x' is a PeerReceiver's already: NIXL hands each notification "
                f"to one get_new_notifs call, so a receiver sharing its agent with another side "
                f"loses its jobs' notifications (they stay expected for good); give the {side} "
                "an agent of its own")):
            make()
    assert shared.live_registrations() == registered, "nothing registered"
    receiver.shutdown(5)
    sender = PeerSender(source, agent=shared)  # the receiver is shut down: the agent is free
    with pytest.raises(ValueError, match="agent 'engine-x' is a PeerSender's already"):
        PeerReceiver(torch.zeros(4, 64), agent=shared)
    PeerSender(source, agent=shared).shutdown(5)  # (a sender drops only its own probes)
    sender.shutdown(5)
    PeerReceiver(torch.zeros(4, 64), agent=shared).shutdown(5)


def test_a_shut_down_side_makes_no_call_of_the_agent_a_new_receiver_has() -> None:
    """A sender shut down frees its agent, and a receiver is made on it; the old sender shut
    down again (a cleanup's second call) let UCX progress once more, taking the new receiver's
    job notification and dropping it: the write landed, the job stayed expected. A shut-down
    side makes no call of the agent again, the receiver's polls neither."""
    from kvfsm.testing.fake_ucx import FakeUcxFabric  # noqa: PLC0415

    fabric = FakeUcxFabric()
    x, y = fabric.agent("engine-x"), fabric.agent("engine-y")
    old_sender = PeerSender(torch.zeros(4, 64, dtype=torch.uint8), agent=x)
    old_sender.shutdown(5)
    old_receiver = PeerReceiver(torch.zeros(4, 64, dtype=torch.uint8), agent=x)
    old_receiver.shutdown(5)
    receiver = PeerReceiver(torch.zeros(4, 64, dtype=torch.uint8), agent=x)
    sender = PeerSender(torch.full((4, 64), 0xAA, dtype=torch.uint8), agent=y)
    receiver.connect(sender.metadata())
    sender.connect(receiver.metadata(), receiver.block_descs())
    receiver.expect(TransferJob(1, ["2"], [2], is_promotion=True), "engine-y")
    sender.submit_store(TransferJob(1, ["2"], [0]))
    sender.drain_jobs(5)
    assert [(r.job_id, r.success) for r in sender.get_finished_jobs()] == [(1, True)]
    old_sender.shutdown(5)  # again
    assert old_receiver.get_finished_jobs() == []  # (a shut-down receiver's poll)
    receiver.drain_jobs(5)
    assert [(r.job_id, r.success) for r in receiver.get_finished_jobs()] == [(1, True)]
    sender.shutdown(5)
    receiver.shutdown(5)


def test_a_wrapped_agent_is_the_agent_it_wraps_and_a_side_not_made_frees_it() -> None:
    """A FaultyAgent over a receiver's agent reaches that agent's notifications: a sender on
    it is refused as one on the agent itself. A side whose making fails (a registration NIXL
    refuses) leaves its agent free. Two sides made at once on two threads, one of them slow to
    register its cache, do not both get it."""
    from kvfsm.testing import FaultyAgent  # noqa: PLC0415
    from kvfsm.testing.fake_ucx import FakeUcxFabric  # noqa: PLC0415

    fabric = FakeUcxFabric()
    agent = fabric.agent("engine-b")
    receiver = PeerReceiver(torch.zeros(4, 64, dtype=torch.uint8), agent=agent)
    with pytest.raises(ValueError, match="agent 'engine-b' is a PeerReceiver's already"):
        PeerSender(torch.zeros(4, 64, dtype=torch.uint8), agent=FaultyAgent(agent))
    receiver.shutdown(5)

    failing = fabric.agent("engine-c")
    failing.faults.inject("register_memory", Raise("NIXL_ERR_BACKEND"), times=1)
    with pytest.raises(Exception, match="NIXL_ERR_BACKEND"):
        PeerReceiver(torch.zeros(4, 64, dtype=torch.uint8), agent=failing)
    PeerReceiver(torch.zeros(4, 64, dtype=torch.uint8), agent=failing).shutdown(5)

    shared = fabric.agent("engine-d")
    real_register = shared.register_memory
    registering = threading.Event()

    def slow_register(*args: Any, **kwargs: Any) -> Any:
        registering.set()
        time.sleep(0.2)
        return real_register(*args, **kwargs)

    shared.register_memory = slow_register  # type: ignore[method-assign]
    made: list[Any] = []
    refused: list[Exception] = []

    def make(side: type) -> None:
        try:
            made.append(side(torch.zeros(4, 64, dtype=torch.uint8), agent=shared))
        except ValueError as error:
            refused.append(error)

    first = threading.Thread(target=make, args=(PeerReceiver,))
    first.start()
    assert registering.wait(5)  # the receiver is being made, its agent claimed
    make(PeerSender)
    first.join(10)
    assert [type(side).__name__ for side in made] == ["PeerReceiver"]
    assert [str(error).split(":")[0] for error in refused] == [
        "agent 'engine-d' is a PeerReceiver's already"]
    made[0].shutdown(5)


def test_a_receivers_cache_whose_memory_moved_counts_no_write_and_refuses_new_ones() -> None:
    """The receiving engine moves its cache (into shared memory, say) while job 1 is
    expected: senders write into the memory registered when the receiver was made, so job 1
    fails, saying why, and job 2 is refused. (Job 1 was published as arrived, its blocks
    holding none of the sender's bytes.)"""
    pair = FakePair()
    receiver, name = pair.receiver, pair.name
    receiver.expect(TransferJob(1, ["3"], [3], is_promotion=True), name)
    pair.target.share_memory_()
    receiver.drain_jobs(5)
    (result,) = receiver.get_finished_jobs()
    assert (result.job_id, result.success) == (1, False)
    assert "the primary cache's memory moved since this PeerReceiver was made" in str(
        result.reason)
    with pytest.raises(InvalidJobError, match="job 2 refused: the primary cache's memory moved"):
        receiver.expect(TransferJob(2, ["2"], [2], is_promotion=True), name)
    assert not receiver.has_pending_work()
    pair.sender.shutdown(5)
    receiver.shutdown(5)


def test_a_write_landing_after_the_receivers_cache_moved_is_not_counted() -> None:
    """Job 1 is expected, the cache moves (its old memory kept alive, so the write lands
    somewhere), then the sender writes: the receiver's next poll fails job 1 before it takes
    the write's notification. (The notification was taken first, and job 1 published as
    arrived, its block in the cache holding none of the sender's bytes.)"""
    pair = FakePair()
    receiver, sender, name = pair.receiver, pair.sender, pair.name
    receiver.expect(TransferJob(1, ["3"], [3], is_promotion=True), name)
    old = pair.target.data
    pair.target.data = pair.target.clone()
    sender.submit_store(TransferJob(1, ["3"], [0]))
    sender.drain_jobs(5)
    receiver.drain_jobs(5)
    (result,) = receiver.get_finished_jobs()
    assert (result.job_id, result.success) == (1, False)
    assert "the primary cache's memory moved" in str(result.reason)
    assert torch.equal(old[3], pair.source[0])  # where it landed
    sender.shutdown(5)
    receiver.shutdown(5)


def test_a_cache_moved_as_the_receivers_poll_takes_a_notification_counts_no_write() -> None:
    """The sender's write landed; as the receiver's poll asks NIXL for notifications the
    engine (on another thread) swaps in other memory for the cache: the notification taken
    then fails the job instead of counting it. (The move was checked before the take only:
    job 1 was published as arrived, the cache's block holding zeros.)"""
    pair = FakePair()
    receiver, sender, name = pair.receiver, pair.sender, pair.name
    receiver.expect(TransferJob(1, ["3"], [3], is_promotion=True), name)
    other = pair.target.clone()  # (zeros: before the write)
    sender.submit_store(TransferJob(1, ["3"], [0]))
    sender.drain_jobs(5)
    agent = pair.receiver_agent
    take = agent.get_new_notifs

    def moved_meanwhile() -> Any:
        pair.target.data = other
        agent.get_new_notifs = take
        return take()

    agent.get_new_notifs = moved_meanwhile
    receiver.drain_jobs(5)
    (result,) = receiver.get_finished_jobs()
    assert (result.job_id, result.success) == (1, False)
    assert "the primary cache's memory moved" in str(result.reason)
    sender.shutdown(5)
    receiver.shutdown(5)


def test_notifications_handed_over_in_a_read_only_mapping_of_tuples_count() -> None:
    """The receiver takes each notification off what NIXL handed over once it is filed: an
    agent that hands them in a mapping it does not let change, in tuples, is filed all the
    same."""
    class ReadOnly(NotifyingAgent):
        def get_new_notifs(self) -> Any:
            return types.MappingProxyType(
                {name: tuple(messages) for name, messages in super().get_new_notifs().items()})

    agent = ReadOnly()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    receiver.connect(sender_metadata())
    receiver.expect(promotion(1, 2), "engine-a")
    agent.inbox = {"engine-a": [notification_for(nonce_of(receiver), 1, [2])]}
    assert outcomes(receiver) == [(1, True)]
    receiver.shutdown(5)


@pytest.mark.parametrize(("expected_in", "written_in", "said"), [
    ([3, 5], [5, 3], "(its blocks hold each other's bytes)"),
    ([6], [6, 7], "(blocks [7] are no block of the job: the sender wrote them all the same)"),
], ids=["the-same-blocks-in-another-order", "a-block-not-lent"])
def test_a_job_its_sender_wrote_into_other_blocks_fails_saying_where_each_put_it(
    expected_in: list[int], written_in: list[int], said: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sender's notification of an expected job names other blocks: the two engines
    disagree on where the job goes. It never counts (the job's blocks do not hold what the
    sender wrote for it, in that order), and the job fails at once saying where each put it,
    rather than waiting for a write that will not come while its sender is there."""
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(8, 16), agent=agent)
    receiver.connect(sender_metadata())
    receiver.expect(TransferJob(1, [str(b) for b in expected_in], expected_in,
                                is_promotion=True), "engine-a")
    agent.inbox = {"engine-a": [notification_for(nonce_of(receiver), 1, written_in)]}
    with caplog.at_level("ERROR", logger="kvfsm"):
        [result] = receiver.get_finished_jobs()
    why = (f"sender engine-a wrote job 1 into blocks {written_in}, not the {expected_in} it "
           f"was expected in: the engines disagree on the job's blocks {said}")
    assert (result.job_id, result.success) == (1, False)
    assert result.reason is not None and why in str(result.reason)
    assert why in caplog.text
    assert receiver.stats() | {"discarded": 1} == receiver.stats()
    assert receiver.stats()["expected"] == receiver.stats()["early"] == 0
    receiver.expect(TransferJob(1, [str(b) for b in expected_in], expected_in,
                                is_promotion=True), "engine-a")  # its blocks are free again
    receiver.shutdown(5)


def test_what_a_receiver_is_given_in_place_of_a_sender_or_a_job_is_refused_by_name() -> None:
    """A sender that is not its str name, keys that are no list or not one a block: refused,
    naming what was wrong; nothing is expected, nothing forgotten."""
    receiver = PeerReceiver(torch.zeros(4, 16), agent=NotifyingAgent())
    name = receiver.connect(sender_metadata())
    for sender in (["engine-a"], b"engine-a", 123):
        with pytest.raises(TypeError, match="sender must be the str name connect"):
            receiver.expect(promotion(1, 1), sender)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="sender must be the str name connect"):
            receiver.forget_peer(sender)  # type: ignore[arg-type]
    with pytest.raises(InvalidJobError, match="job 1: keys must be a list or tuple"):
        receiver.expect(TransferJob(1, None, [1], is_promotion=True), name)  # type: ignore[arg-type]
    with pytest.raises(InvalidJobError, match="job 1 has 2 keys but 1 block ids"):
        receiver.expect(TransferJob(1, ["1", "2"], [1], is_promotion=True), name)
    assert receiver.stats()["expected"] == 0
    assert receiver.link_state(name) is LinkState.CONNECTED
    receiver.expect(promotion(1, 1), name)  # the same job, right: taken
    assert receiver.state_of(1) is ReceiveState.EXPECTING
    receiver.shutdown(5)
