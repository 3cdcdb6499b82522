"""Peer writes: two real NIXL agents over UCX in one process, and the receiving machine alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvfsm import JobResult, TransferJob
from kvfsm.nixl_agents import make_agent
from kvfsm.peer import (
    PEER_RECEIVE,
    PeerNotConnected,
    PeerReceiver,
    PeerSender,
    ReceiveState,
    notification_for,
)
from kvfsm.peer_link import DISCONNECTED, LinkState
from kvfsm.testing import FakeNixlError
from kvfsm.testing.explore import explore_table
from kvfsm.tiers import InvalidJobError

from .real_nixl import require_nixl

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
        self.sender_name = self.receiver.connect(self.sender_agent.get_agent_metadata())

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
    assert torch.count_nonzero(pair.target[1]) == 0, "the lost write never landed"
    stats = pair.sender.stats()
    assert (stats["leaks"], stats["quarantined"], stats["in_flight"]) == (0, 0, {})
    assert not pair.sender.has_pending_work()
    assert not pair.receiver.has_pending_work()
    assert not pair.sender_agent.check_remote_metadata("engine-b"), "its metadata is removed"


def test_the_sender_refuses_loads_and_keys_that_are_not_receiver_blocks(pair: Pair) -> None:
    with pytest.raises(InvalidJobError, match="only writes"):
        pair.sender.submit_load(TransferJob(1, ["0"], [0], is_promotion=True))
    with pytest.raises(InvalidJobError, match="receiver's block index"):
        pair.sender.submit_store(TransferJob(1, ["block-0"], [0]))
    with pytest.raises(InvalidJobError, match="out of range"):
        pair.sender.submit_store(TransferJob(1, [str(BLOCKS)], [0]))
    assert not pair.sender.has_pending_work()


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
        inbox, self.inbox = self.inbox, {}
        return inbox


def test_the_receiver_publishes_on_its_notification_and_fails_what_a_lost_peer_owed() -> None:
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    sender = receiver.connect(b"engine-a")
    receiver.expect(TransferJob(1, ["0"], [0], is_promotion=True), sender)
    receiver.expect(TransferJob(2, ["1"], [1], is_promotion=True), sender)
    assert receiver.get_finished_jobs() == []
    assert receiver.state_of(1) is ReceiveState.EXPECTING

    agent.inbox = {"engine-a": [b"unrelated", notification_for(1, [5]),  # other blocks: no
                                notification_for(1, [0])]}
    assert [(r.job_id, r.success) for r in receiver.get_finished_jobs()] == [(1, True)]
    receiver.forget_peer(sender)
    assert "engine-a" not in agent.peers, "cut off before anything it owed fails"
    assert [(r.job_id, r.success) for r in receiver.get_finished_jobs()] == [(2, False)]
    agent.inbox = {"engine-a": [notification_for(2, [1])]}  # too late: already published
    assert receiver.get_finished_jobs() == []
    receiver.shutdown()
    assert agent.registered == 0


def test_a_notification_that_comes_before_its_expect_still_counts() -> None:
    agent = NotifyingAgent()
    receiver = PeerReceiver(torch.zeros(4, 16), agent=agent)
    sender = receiver.connect(b"engine-a")
    receiver.expect(TransferJob(1, ["0"], [0], is_promotion=True), sender)
    agent.inbox = {"engine-a": [notification_for(2, [3])]}  # job 2 is faster than its expect
    assert receiver.get_finished_jobs() == []
    receiver.expect(TransferJob(2, ["3"], [3], is_promotion=True), sender)
    assert [(r.job_id, r.success) for r in receiver.get_finished_jobs()] == [(2, True)]
    assert receiver.state_of(1) is ReceiveState.EXPECTING


def test_the_receiver_refuses_what_it_cannot_expect() -> None:
    receiver = PeerReceiver(torch.zeros(4, 16), agent=NotifyingAgent())
    with pytest.raises(PeerNotConnected, match="sender 'nobody' is unknown"):
        receiver.expect(TransferJob(1, ["0"], [0], is_promotion=True), "nobody")
    sender = receiver.connect(b"engine-a")
    with pytest.raises(InvalidJobError, match="block 9 is out of range"):
        receiver.expect(TransferJob(1, ["9"], [9], is_promotion=True), sender)
    receiver.expect(TransferJob(1, ["0"], [0], is_promotion=True), sender)
    with pytest.raises(InvalidJobError, match="job 1 is already expected"):
        receiver.expect(TransferJob(1, ["1"], [1], is_promotion=True), sender)


def test_the_receiving_machine_explores_clean() -> None:
    found = explore_table(PEER_RECEIVE)
    assert found.ok, found.report()
    assert found.paths == 5
