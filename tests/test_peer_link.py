"""The link to a peer: metadata exchange, a receiver that finds a silent sender gone, and a
sender that loses its receiver; on a stand-in agent and on two real UCX agents."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from kvfsm import JobResult, TransferJob
from kvfsm.cli import main
from kvfsm.machines.peer_link import LINK_LOST_BY
from kvfsm.nixl_agents import make_agent
from kvfsm.peer import PeerReceiver, PeerSender, ReceiveState, notification_for
from kvfsm.peer_link import (
    DISCONNECTED,
    PEER_LINK,
    PROBE_MESSAGE,
    LinkState,
    PeerLink,
    PeerLinkError,
    PeerNotConnected,
)
from kvfsm.testing import FakeNixlError, FaultyAgent, Raise, StayProc
from kvfsm.testing.explore import explore_table
from kvfsm.testing.faults import nixlRemoteDisconnectError

from .real_nixl import require_nixl
from .test_peer import BLOCK_BYTES, BLOCKS, NotifyingAgent, sender_metadata


def receiver_on(agent: NotifyingAgent, peer_timeout: float | None = None) -> PeerReceiver:
    return PeerReceiver(torch.zeros(4, 16), agent=agent, peer_timeout=peer_timeout)


def expect(receiver: PeerReceiver, job_id: int, sender: str = "engine-a") -> None:
    receiver.expect(TransferJob(job_id, [str(job_id)], [job_id], is_promotion=True), sender)


def link_of(receiver: PeerReceiver, sender: str = "engine-a") -> PeerLink:
    link = receiver.links.get(sender)
    assert link is not None
    return link


def outcomes(receiver: PeerReceiver) -> list[tuple[int, bool]]:
    return [(r.job_id, r.success) for r in receiver.get_finished_jobs()]


# -- metadata exchange -------------------------------------------------------------------------

def test_a_link_connects_once_nixl_holds_the_metadata_and_closes_when_it_is_removed() -> None:
    agent = NotifyingAgent()
    receiver = receiver_on(agent)
    assert receiver.link_state("engine-a") is LinkState.UNKNOWN
    assert receiver.connect(sender_metadata()) == "engine-a"
    assert receiver.link_state("engine-a") is LinkState.CONNECTED
    receiver.forget_peer("engine-a")
    assert receiver.link_state("engine-a") is LinkState.CLOSED
    assert agent.peers == set()


def test_metadata_nixl_refuses_makes_no_link_and_nothing_can_be_owed_over_it() -> None:
    agent = NotifyingAgent()
    agent.failing["add_remote_agent"] = [FakeNixlError("NIXL_ERR_MISMATCH")]
    receiver = receiver_on(agent)
    with pytest.raises(PeerLinkError, match="refused the peer's metadata: FakeNixlError: "
                                            "NIXL_ERR_MISMATCH"):
        receiver.connect(sender_metadata())
    with pytest.raises(PeerNotConnected, match="sender 'engine-a' is unknown"):
        expect(receiver, 1)


def test_a_link_nixl_does_not_hold_yet_is_connecting_until_a_poll_finds_it_held() -> None:
    agent = NotifyingAgent()
    agent.pending.add("engine-a")
    receiver = receiver_on(agent)
    receiver.connect(sender_metadata())
    assert receiver.link_state("engine-a") is LinkState.CONNECTING
    with pytest.raises(PeerNotConnected, match="job 1: sender 'engine-a' is CONNECTING"):
        expect(receiver, 1)
    assert receiver.get_finished_jobs() == []
    assert receiver.link_state("engine-a") is LinkState.CONNECTING, "still not held"

    agent.pending.clear()
    receiver.get_finished_jobs()
    assert receiver.link_state("engine-a") is LinkState.CONNECTED
    expect(receiver, 1)


def test_a_check_that_raises_while_connecting_loses_the_link_and_removes_its_metadata() -> None:
    agent = NotifyingAgent()
    agent.failing["check_remote_metadata"] = [FakeNixlError("NIXL_ERR_BACKEND")]
    receiver = receiver_on(agent)
    with pytest.raises(PeerLinkError, match="check_remote_metadata raised: FakeNixlError"):
        receiver.connect(sender_metadata())
    assert receiver.link_state("engine-a") is LinkState.CLOSED
    assert agent.peers == set(), "half-loaded metadata is removed"


def test_a_sender_forgotten_while_connecting_is_closed() -> None:
    agent = NotifyingAgent()
    agent.pending.add("engine-a")
    receiver = receiver_on(agent)
    receiver.connect(sender_metadata())
    receiver.forget_peer("engine-a")
    assert receiver.link_state("engine-a") is LinkState.CLOSED
    assert agent.peers == set()


def lose(agent: NotifyingAgent, receiver: PeerReceiver) -> None:
    """The sender disappears while it owes job 1, and a probe finds it gone."""
    expect(receiver, 1)
    agent.gone.add("engine-a")
    time.sleep(0.03)
    receiver.get_finished_jobs()


@pytest.mark.parametrize("state", [LinkState.CONNECTING, LinkState.CONNECTED, LinkState.LOST])
def test_a_removal_that_raises_is_a_leak_and_the_link_is_closed_anyway(state: LinkState) -> None:
    agent = NotifyingAgent()
    if state is LinkState.CONNECTING:
        agent.pending.add("engine-a")
    receiver = receiver_on(agent, peer_timeout=0.02)
    receiver.connect(sender_metadata())
    agent.failing["remove_remote_agent"] = [FakeNixlError("NIXL_ERR_NOT_FOUND")]
    if state is LinkState.LOST:
        lose(agent, receiver)
    else:
        assert receiver.link_state("engine-a") is state
        receiver.forget_peer("engine-a")
    assert receiver.link_state("engine-a") is LinkState.CLOSED
    assert [(name, leak.call) for name, leak in receiver.links.leaks()] == [
        ("engine-a", "remove_remote_agent")]


def test_a_link_that_is_still_open_cannot_be_connected_again() -> None:
    receiver = receiver_on(NotifyingAgent())
    receiver.connect(sender_metadata())
    with pytest.raises(PeerLinkError, match="'engine-a' is already linked \\(CONNECTED\\)"):
        receiver.connect(sender_metadata())
    receiver.forget_peer("engine-a")
    receiver.connect(sender_metadata())  # a closed link is over: a new one may be made
    assert receiver.link_state("engine-a") is LinkState.CONNECTED


# -- a receiver finds a silent sender gone -----------------------------------------------------

def test_a_silent_sender_that_owes_jobs_is_probed_and_its_jobs_fail_only_once_it_is_gone(
) -> None:
    agent = NotifyingAgent()
    receiver = receiver_on(agent, peer_timeout=0.05)
    receiver.connect(sender_metadata())
    expect(receiver, 1)
    expect(receiver, 2)
    assert receiver.get_finished_jobs() == []
    assert agent.sent == [], "not silent for long enough yet"

    time.sleep(0.06)
    assert receiver.get_finished_jobs() == []
    assert agent.sent == [("engine-a", PROBE_MESSAGE)]
    assert receiver.state_of(1) is ReceiveState.EXPECTING, "still there: nothing fails"

    agent.gone.add("engine-a")  # its process ends
    assert receiver.get_finished_jobs() == []
    assert len(agent.sent) == 1, "probed again only after another peer_timeout"
    time.sleep(0.06)
    assert outcomes(receiver) == [(1, False), (2, False)]
    assert receiver.link_state("engine-a") is LinkState.CLOSED
    assert agent.peers == set(), "its metadata is removed"
    assert link_of(receiver).error == f"nixlRemoteDisconnectError: {DISCONNECTED}"


def test_a_sender_heard_from_or_owing_nothing_is_not_probed() -> None:
    agent = NotifyingAgent()
    receiver = receiver_on(agent, peer_timeout=0.05)
    receiver.connect(sender_metadata())
    time.sleep(0.06)
    receiver.get_finished_jobs()
    assert agent.sent == [], "it owes nothing"

    expect(receiver, 1)  # silence counts from now
    receiver.get_finished_jobs()
    for _ in range(3):
        time.sleep(0.03)
        agent.inbox = {"engine-a": [b"another job's notification"]}
        receiver.get_finished_jobs()
    assert agent.sent == [], "heard from within every peer_timeout"


def test_a_new_process_of_the_same_name_does_not_keep_the_dead_senders_link_alive() -> None:
    """NIXL names a notification's sender by agent name only. A new process under a dead
    sender's name writes before the receiver links it: its notifications carry its own nonce,
    and used to restart the dead link's clock on every one, so the jobs the dead sender owed
    were never probed for while the new process was busy."""
    agent = NotifyingAgent()
    receiver = receiver_on(agent, peer_timeout=0.05)
    receiver.connect(sender_metadata())
    expect(receiver, 1)
    agent.gone.add("engine-a")  # the process that owes job 1 ends...
    new_nonce = "f" * 32  # ...and a new one of its name writes, under a link of its own
    for _ in range(6):
        time.sleep(0.03)
        agent.inbox = {"engine-a": [notification_for(new_nonce, 7, [3])]}
        receiver.get_finished_jobs()
        if receiver.state_of(1) is None:
            break
    assert receiver.link_state("engine-a") is LinkState.CLOSED, "the dead link was probed"
    assert link_of(receiver).error == f"nixlRemoteDisconnectError: {DISCONNECTED}"
    assert receiver.stats()["unknown"] >= 1, "the new process's notifications are kept"


def test_a_probe_that_fails_another_way_keeps_the_sender_and_its_jobs() -> None:
    agent = NotifyingAgent()
    agent.failing["send_notif"] = [FakeNixlError("NIXL_ERR_BACKEND")]
    receiver = receiver_on(agent, peer_timeout=0.02)
    receiver.connect(sender_metadata())
    expect(receiver, 1)
    time.sleep(0.03)
    assert receiver.get_finished_jobs() == []
    assert receiver.link_state("engine-a") is LinkState.CONNECTED
    assert receiver.state_of(1) is ReceiveState.EXPECTING
    assert link_of(receiver).error == "FakeNixlError: NIXL_ERR_BACKEND"


# -- a disconnect is told by NIXL's error type, never by its text -----------------------------

def real_nixl_error(name: str, text: str) -> Exception:
    """An exception of real NIXL's own type ``name`` (skipped when NIXL is not installed)."""
    require_nixl()
    bindings = pytest.importorskip("nixl_cu12._bindings")
    error: Exception = getattr(bindings, name)(text)
    return error


#: (what the call raised, does the peer count as gone)
DISCONNECTS = {
    "nixl's type, a text without the status": (
        lambda: real_nixl_error("nixlRemoteDisconnectError", "Connection reset by remote peer"),
        True),
    "the fake's type, a text without the status": (
        lambda: nixlRemoteDisconnectError("the peer went away"), True),
    "the fake's error for the status": (lambda: FakeNixlError(DISCONNECTED), True),
    "another nixl type whose text names the status": (
        lambda: real_nixl_error("nixlBackendError", f"UCX said {DISCONNECTED}"), False),
    "another type whose text names the status": (
        lambda: ConnectionError(f"relayed: {DISCONNECTED}"), False),
}


def test_real_nixl_raises_the_type_kvfsm_keys_a_disconnect_on_and_the_fake_raises_it_too() -> None:
    require_nixl()
    bindings = pytest.importorskip("nixl_cu12._bindings")
    assert bindings.nixlRemoteDisconnectError.__name__ in LINK_LOST_BY
    fake = FakeNixlError(DISCONNECTED)
    assert isinstance(fake, FakeNixlError) and type(fake).__name__ in LINK_LOST_BY
    assert (str(fake), fake.code) == (DISCONNECTED, DISCONNECTED)
    assert type(FakeNixlError("NIXL_ERR_BACKEND")) is FakeNixlError


@pytest.mark.parametrize("case", list(DISCONNECTS))
def test_a_probe_loses_the_sender_by_the_type_of_nixls_error_not_by_its_text(case: str) -> None:
    make_error, gone = DISCONNECTS[case]
    agent = NotifyingAgent()
    agent.failing["send_notif"] = [make_error()]
    receiver = receiver_on(agent, peer_timeout=0.02)
    receiver.connect(sender_metadata())
    expect(receiver, 1)
    time.sleep(0.03)
    if gone:
        assert outcomes(receiver) == [(1, False)], "what it owed fails"
        assert receiver.link_state("engine-a") is LinkState.CLOSED
    else:
        assert outcomes(receiver) == [], "an error is not a loss"
        assert receiver.link_state("engine-a") is LinkState.CONNECTED
        assert receiver.state_of(1) is ReceiveState.EXPECTING


def test_without_a_peer_timeout_a_silent_sender_is_never_probed() -> None:
    agent = NotifyingAgent()
    receiver = receiver_on(agent, peer_timeout=None)
    receiver.connect(sender_metadata())
    expect(receiver, 1)
    time.sleep(0.02)
    receiver.get_finished_jobs()
    assert agent.sent == []
    with pytest.raises(ValueError, match="peer_timeout must be > 0"):
        receiver_on(agent, peer_timeout=0)


def test_a_job_owed_over_a_forgotten_link_fails_even_when_its_sender_reconnects() -> None:
    receiver = receiver_on(NotifyingAgent())
    receiver.connect(sender_metadata())
    expect(receiver, 1)
    receiver.forget_peer("engine-a")
    receiver.connect(sender_metadata())
    assert outcomes(receiver) == [(1, False)]


# -- a sender loses its receiver (two real UCX agents) -----------------------------------------

class Sender:
    """A sender on a real agent wrapped to inject faults, and a live receiver it writes to."""

    def __init__(self, connect: bool = True) -> None:
        require_nixl()
        self.source = torch.ones(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
        self.agent = FaultyAgent(make_agent("engine-a", "UCX"))
        self.sender = PeerSender(self.source, agent=self.agent)
        self.receiver = PeerReceiver(torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8),
                                     agent=make_agent("engine-b", "UCX"))
        if connect:
            self.sender.connect(self.receiver.metadata(), self.receiver.block_descs())
            self.receiver.connect(self.sender.metadata())

    def step(self) -> list[tuple[int, bool]]:
        self.receiver.get_finished_jobs()  # the receiver progresses its side
        return [(r.job_id, r.success) for r in self.sender.get_finished_jobs()]

    def holds_receiver(self) -> bool:
        return bool(self.agent.check_remote_metadata("engine-b"))

    def close(self) -> None:
        deadline = time.monotonic() + 5  # a write needs the receiver to progress: step both
        while self.sender.unpublished() and time.monotonic() < deadline:
            self.step()
        self.sender.shutdown(timeout=5)
        self.receiver.shutdown()


@pytest.fixture
def pair() -> Any:
    made = Sender()
    yield made
    made.close()


@pytest.mark.nixl
def test_a_write_that_fails_with_a_disconnect_loses_the_receiver_and_later_jobs_are_refused(
    pair: Sender,
) -> None:
    pair.agent.inject("transfer", Raise(DISCONNECTED), at=2)
    pair.sender.submit_store(TransferJob(1, ["0"], [0]))
    pair.sender.submit_store(TransferJob(2, ["1"], [1]))  # the receiver is gone by now
    assert pair.sender.link_state() is LinkState.LOST
    registered = pair.agent.call_count("prep_xfer_dlist")
    with pytest.raises(PeerNotConnected, match="job 3 refused: receiver 'engine-b' is LOST "
                                               f"\\(nixlRemoteDisconnectError: {DISCONNECTED}\\)"):
        pair.sender.submit_store(TransferJob(3, ["2"], [2]))
    assert pair.agent.call_count("prep_xfer_dlist") == registered, "nothing was prepped"

    results: list[tuple[int, bool]] = []
    while len(results) < 2:
        results += pair.step()
    assert sorted(results) == [(1, True), (2, False)]
    assert pair.sender.link_state() is LinkState.CLOSED
    assert not pair.holds_receiver(), "its metadata was removed once nothing ran to it"
    stats = pair.sender.stats()
    assert (stats["leaks"], stats["in_flight"], stats["link"]) == (0, {}, "CLOSED")


@pytest.mark.nixl
@pytest.mark.parametrize("case", list(DISCONNECTS))
def test_a_write_loses_the_receiver_by_the_type_of_nixls_error_not_by_its_text(
    pair: Sender, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_error, gone = DISCONNECTS[case]
    error = make_error()
    errors, post = [error], pair.agent.transfer

    def transfer(handle: Any, *args: Any, **kwargs: Any) -> str:
        if errors:
            raise errors.pop()
        status: str = post(handle, *args, **kwargs)
        return status

    monkeypatch.setattr(pair.agent, "transfer", transfer)
    pair.sender.submit_store(TransferJob(1, ["0"], [0]))
    published: list[JobResult] = []
    while not published:
        pair.receiver.get_finished_jobs()
        published = pair.sender.get_finished_jobs()
    (failed,) = published
    assert not failed.success and failed.reason is not None
    assert failed.reason.error_type == type(error).__name__, "kept by its type, beside its text"
    if gone:
        assert pair.sender.link_state() in {LinkState.LOST, LinkState.CLOSED}
        with pytest.raises(PeerNotConnected):
            pair.sender.submit_store(TransferJob(2, ["1"], [1]))
    else:
        assert pair.sender.link_state() is LinkState.CONNECTED
        pair.sender.submit_store(TransferJob(2, ["1"], [1]))
        results: list[tuple[int, bool]] = []
        while not results:
            results = pair.step()
        assert results == [(2, True)], "the receiver is still written to"


@pytest.mark.nixl
def test_a_lost_receiver_is_removed_only_once_no_transfer_to_it_may_run(pair: Sender) -> None:
    pair.agent.inject("transfer", StayProc(3), at=1)  # job 1 runs for three more checks...
    pair.agent.inject("check_xfer_state", Raise(DISCONNECTED), at=3)  # ...then fails too
    pair.agent.inject("transfer", Raise(DISCONNECTED), at=2)
    pair.sender.submit_store(TransferJob(1, ["0"], [0]))
    pair.sender.submit_store(TransferJob(2, ["1"], [1]))
    assert pair.sender.link_state() is LinkState.LOST

    assert pair.step() == [(2, False)]
    results: list[tuple[int, bool]] = []
    while not results:
        assert pair.sender.link_state() is LinkState.LOST, "job 1 may still run"
        assert pair.holds_receiver()
        results = pair.step()
    assert results == [(1, False)]
    assert pair.sender.link_state() is LinkState.CLOSED
    assert not pair.holds_receiver()


@pytest.mark.nixl
def test_a_sender_posts_nothing_before_it_is_connected_and_forgets_only_when_idle() -> None:
    made = Sender(connect=False)
    try:
        with pytest.raises(PeerNotConnected, match="job 1 refused: no receiver is connected"):
            made.sender.submit_store(TransferJob(1, ["0"], [0]))
        assert made.agent.call_count("prep_xfer_dlist") == 1, "only the sender's own cache"
        with pytest.raises(PeerLinkError, match="NIXL_ERR_MISMATCH"):
            made.sender.connect(b"not metadata", made.receiver.block_descs())
        assert made.sender.link_state() is LinkState.UNKNOWN

        made.sender.connect(made.receiver.metadata(), made.receiver.block_descs())
        made.receiver.connect(made.sender.metadata())
        with pytest.raises(PeerLinkError, match="already linked to receiver 'engine-b'"):
            made.sender.connect(made.receiver.metadata(), made.receiver.block_descs())
        made.agent.inject("transfer", StayProc(2), at=1)
        made.sender.submit_store(TransferJob(1, ["0"], [0]))
        with pytest.raises(RuntimeError, match="1 transfer\\(s\\) not yet published"):
            made.sender.forget_peer()
        while not made.step():
            pass
        made.sender.forget_peer()
        assert made.sender.link_state() is LinkState.CLOSED
    finally:
        made.close()


# -- the machine itself ------------------------------------------------------------------------

def test_the_link_machine_explores_clean_from_the_library_and_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    found = explore_table(PEER_LINK)
    assert found.ok, found.report()
    assert found.calls == 7  # (state, outcome) pairs: LOST and REFUSED latch a failure
    assert main(["explore", "--machine", "peer_link"]) == 0
    assert "machine peer_link" in capsys.readouterr().out


def test_a_write_that_found_the_receiver_gone_loses_the_link_even_if_its_release_is_retried(
) -> None:
    """The failure that ended the write decides, not the release error retried after it."""
    require_nixl()
    agent = FaultyAgent(make_agent("engine-a", "UCX"))
    sender = PeerSender(torch.ones(BLOCKS, BLOCK_BYTES, dtype=torch.uint8), agent=agent)
    receiver = PeerReceiver(torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8),
                            agent=make_agent("engine-b", "UCX"))
    try:
        sender.connect(receiver.metadata(), receiver.block_descs())
        receiver.connect(sender.metadata())
        agent.inject("transfer", Raise(DISCONNECTED), at=1)  # the write finds it gone
        agent.inject("release_xfer_handle", Raise(), at=1)  # and its release raises once
        sender.submit_store(TransferJob(1, ["0"], [0]))
        results: list[JobResult] = []
        for _ in range(10_000):
            receiver.get_finished_jobs()
            results += sender.get_finished_jobs()
            if results:
                break
        assert [(r.job_id, r.success) for r in results] == [(1, False)]
        assert sender.link_state() is not LinkState.CONNECTED
        with pytest.raises(PeerNotConnected):
            sender.submit_store(TransferJob(2, ["1"], [1]))
    finally:
        sender.shutdown(timeout=5)
        receiver.shutdown()
