"""The peer machines explored at the level of NIXL calls: a PeerSender and a PeerReceiver over
fake UCX agents, every fault at every call, the invariants on every path; each broken receiver
caught by name; and the receiver bugs the explorer found, pinned."""

from __future__ import annotations

import pytest
import torch

from kvfsm import TransferJob
from kvfsm.cli import main
from kvfsm.peer import PeerReceiver, PeerSender
from kvfsm.peer_link import LinkState
from kvfsm.testing import NixlMisuseError, Raise
from kvfsm.testing.explore_peer import (
    BROKEN_RECEIVERS,
    MODES,
    PeerInvariant,
    explore_peer,
    parse_peer_path,
    replay_peer,
)
from kvfsm.testing.fake_ucx import DISCONNECT, FakeUcxFabric, fake_ucx_pair
from kvfsm.testing.faults import FakeNixlError, nixlRemoteDisconnectError

#: the paths the exploration runs (1537 when this was written): 12 modes, each with no fault
#: and with every single fault at every call
PATH_FLOOR = 1400


# -- the fake UCX agents ------------------------------------------------------------------------

def engines(polls: int = 1) -> tuple[PeerSender, PeerReceiver, torch.Tensor, torch.Tensor]:
    sender_agent, receiver_agent = fake_ucx_pair(complete_after_polls=polls)
    source = torch.arange(8 * 16, dtype=torch.int64).to(torch.uint8).view(8, 16)
    target = torch.zeros(8, 16, dtype=torch.uint8)
    sender = PeerSender(source, agent=sender_agent)
    receiver = PeerReceiver(target, agent=receiver_agent, peer_timeout=None)
    receiver.connect(sender.metadata())
    sender.connect(receiver.metadata(), receiver.block_descs())
    return sender, receiver, source, target


def test_two_fake_ucx_agents_move_bytes_and_deliver_the_notification_once() -> None:
    sender, receiver, source, target = engines()
    receiver.expect(TransferJob(1, ["6", "2"], [6, 2], is_promotion=True), "engine-a")
    sender.submit_store(TransferJob(1, ["6", "2"], [0, 1]))
    sent, received = [], []
    for _ in range(5):
        sent += sender.get_finished_jobs()
        received += receiver.get_finished_jobs()
    assert [(r.job_id, r.success) for r in sent + received] == [(1, True), (1, True)]
    assert torch.equal(target[6], source[0]) and torch.equal(target[2], source[1])
    assert torch.count_nonzero(target[[0, 1, 3, 4, 5, 7]]) == 0
    sender.shutdown()
    receiver.shutdown()
    for agent in (sender.agent, receiver.agent):
        assert (agent.live_xfer_handles(), agent.live_dlist_handles(),
                agent.live_registrations(), agent.remote_agents(), agent.misuses) == (
                    0, 0, 0, set(), [])


def test_a_peer_that_is_killed_answers_a_disconnect_of_nixls_type() -> None:
    sender, receiver, _, _ = engines(polls=0)
    fabric = sender.agent.fabric
    fabric.kill("engine-b")
    sender.submit_store(TransferJob(1, ["0"], [0]))
    (result,) = sender.get_finished_jobs()
    assert not result.success and result.reason is not None
    assert result.reason.error_type == "nixlRemoteDisconnectError"
    assert sender.link_state() is LinkState.CLOSED, "lost, and closed once nothing ran to it"
    assert sender.agent.remote_agents() == set(), "its metadata removed"
    with pytest.raises(nixlRemoteDisconnectError, match=DISCONNECT):
        fabric.kill("engine-a")
        receiver.agent.send_notif("engine-a", b"probe")  # a receiver's probe of a dead sender


def test_held_notifications_arrive_late_and_never_at_a_new_process_of_the_same_name() -> None:
    fabric = FakeUcxFabric()
    a, b = fabric.agent("engine-a"), fabric.agent("engine-b")
    a.add_remote_agent(b.get_agent_metadata())
    fabric.hold()
    a.send_notif("engine-b", b"one")
    assert b.get_new_notifs() == {}
    fabric.release()
    assert b.get_new_notifs() == {"engine-a": [b"one"]}
    fabric.hold()
    a.send_notif("engine-b", b"two")
    fabric.kill("engine-b")
    with pytest.raises(ValueError, match="already called 'engine-a'"):
        fabric.agent("engine-a")
    new_b = fabric.agent("engine-b")
    fabric.release()
    assert new_b.get_new_notifs() == {}, "the dead process's notification is lost with it"


def test_the_fault_grammar_takes_the_peer_calls_and_misuse_is_recorded() -> None:
    sender, receiver, _, _ = engines()
    receiver.agent.inject("get_new_notifs", Raise(), at=1)
    receiver.agent.inject("send_notif", Raise(DISCONNECT))
    with pytest.raises(ValueError, match="not a NIXL call of FakeUcxAgent"):
        receiver.agent.inject("query_memory", Raise())
    with pytest.raises(FakeNixlError, match="NIXL_ERR_BACKEND"):
        receiver.agent.get_new_notifs()
    assert receiver.agent.get_new_notifs() == {}
    assert receiver.agent.faults_taken == {"get_new_notifs": 1}
    sender.submit_store(TransferJob(1, ["0"], [0]))
    with pytest.raises(NixlMisuseError, match="still the target of unreleased"):
        sender.agent.remove_remote_agent("engine-b")
    assert len(sender.agent.misuses) == 1


# -- the explorer -------------------------------------------------------------------------------

def test_the_real_peers_violate_nothing_on_any_path() -> None:
    found = explore_peer(stop_at_first=False)
    assert found.ok, found.report()
    assert found.paths >= PATH_FLOOR, found.report()
    assert "0 violations" in found.report()


@pytest.mark.parametrize("name", sorted(BROKEN_RECEIVERS))
def test_each_broken_receiver_is_caught_by_name(name: str) -> None:
    variant = BROKEN_RECEIVERS[name]
    found = explore_peer(name)
    assert not found.ok, f"{name} went unnoticed over {found.paths} paths"
    assert variant.invariant in found.caught(), found.report()
    assert f"receiver variant {name}" in found.report()


def test_the_receiver_that_keeps_a_used_notification_is_caught_on_the_fault_free_path() -> None:
    """The mutant that survived the peer tests: the job id expected again completes on the
    notification its first expect used, and what the receiver keeps is one too many."""
    found = explore_peer("keeps-used-notification")
    assert found.counterexample is not None and found.counterexample.choices == ()
    caught = {v.invariant for v in found.violations}
    assert {PeerInvariant.OWN_NOTIFICATION, PeerInvariant.UNCLAIMED} <= caught
    assert "success #2 of job 1 into blocks [0, 1] on its link, after 1 notification(s)" in (
        found.report())


def test_a_counterexample_prints_parses_and_replays_to_the_same_violation() -> None:
    found = explore_peer("completes-on-other-link")
    assert found.counterexample is not None
    printed = str(found.counterexample)
    assert printed.startswith("polls=1,end=forget,late=1;"), "an old link's late notification"
    path = parse_peer_path(printed)
    assert path == found.counterexample
    calls, violations = replay_peer(path, "completes-on-other-link")
    assert PeerInvariant.OWN_NOTIFICATION in {v.invariant for v in violations}
    assert "receiver.get_new_notifs#1" in calls
    assert replay_peer(parse_peer_path("polls=0,end=receiver-lost,late=1;"
                                       "sender.transfer:disconnect@2"))[1] == []


def test_a_bad_peer_path_is_refused_saying_why() -> None:
    with pytest.raises(ValueError, match="starts with polls=N,end=E,late=L"):
        parse_peer_path("receiver.get_new_notifs:raise@1")
    with pytest.raises(ValueError, match="no such mode"):
        parse_peer_path("polls=2,end=forget,late=0;")
    with pytest.raises(ValueError, match="ROLE one of sender, receiver, sender2, receiver2"):
        parse_peer_path("polls=1,end=forget,late=0;engine.transfer:raise@1")
    assert len(MODES) == 12


def test_the_command_line_explores_the_peers_and_catches_a_broken_receiver(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["explore", "--peer", "--receiver", "completes-twice"]) == 1
    out = capsys.readouterr().out
    assert "receiver variant completes-twice" in out and "ONE_RESULT" in out
    assert "replay it with: kvfsm explore --peer --replay 'polls=1,end=forget,late=0;' " \
           "--receiver completes-twice" in out
    assert main(["explore", "--peer", "--replay",
                 "polls=1,end=sender-lost,late=0;receiver.send_notif:raise@1"]) == 0
    assert "0 violations" in capsys.readouterr().out
    assert main(["explore", "--peer", "--receiver", "nobody"]) == 2
    assert "no broken receiver 'nobody'" in capsys.readouterr().err


# -- the receiver bugs the explorer found ---------------------------------------------------------

def receiver_owing(job_ids: tuple[int, ...]) -> tuple[PeerSender, PeerReceiver]:
    sender, receiver, _, _ = engines()
    for job_id in job_ids:
        receiver.expect(TransferJob(job_id, [str(job_id)], [job_id], is_promotion=True),
                        "engine-a")
    return sender, receiver


def test_a_receiver_shut_down_owing_jobs_publishes_each_failure_once() -> None:
    """Found by the explorer: ``self._results += self.get_finished_jobs()`` in shutdown (and
    drain_jobs) extended the list get_finished_jobs returned with itself, so every result
    published in that call came out twice (fixed when the receiver's books moved to
    kvfsm.contract)."""
    _, receiver = receiver_owing((1, 2))
    receiver.shutdown()
    assert sorted((r.job_id, r.success) for r in receiver.get_finished_jobs()) == [
        (1, False), (2, False)]


def test_a_receiver_that_drains_publishes_each_result_once() -> None:
    sender, receiver = receiver_owing((1,))
    sender.submit_store(TransferJob(1, ["1"], [5]))
    receiver.drain_jobs(timeout=5, step=sender.get_finished_jobs)
    assert [(r.job_id, r.success) for r in receiver.get_finished_jobs()] == [(1, True)]


def test_a_get_new_notifs_that_raises_does_not_escape_the_receivers_poll() -> None:
    """Found by the explorer: the receiver's poll let a NIXL error from get_new_notifs out (a
    tier keeps every NIXL error out of get_finished_jobs, F7). It is counted, and the next
    round takes the notification."""
    sender, receiver = receiver_owing((1,))
    receiver.agent.inject("get_new_notifs", Raise())
    sender.submit_store(TransferJob(1, ["1"], [5]))
    sender.get_finished_jobs()
    results = receiver.get_finished_jobs()
    assert results == [] and receiver.stats()["notify_errors"] == 1
    results += receiver.get_finished_jobs()
    assert [(r.job_id, r.success) for r in results] == [(1, True)]


@pytest.mark.parametrize("call", ["get_new_notifs", "deregister_memory"])
def test_a_nixl_error_at_receiver_shutdown_is_counted_not_raised(call: str) -> None:
    """Found by the explorer: an error from either call escaped shutdown and left the receiver
    open. Now shutdown ends, and says what failed."""
    _, receiver = receiver_owing((3,))
    receiver.agent.inject(call, Raise())
    receiver.shutdown()
    stats = receiver.stats()
    assert (stats["notify_errors"], stats["leaks"]) == (
        (1, 0) if call == "get_new_notifs" else (0, 1))
    assert [(r.job_id, r.success) for r in receiver.get_finished_jobs()] == [(3, False)]
    receiver.shutdown()  # idempotent: nothing is called twice
    assert receiver.stats()["leaks"] == stats["leaks"]
