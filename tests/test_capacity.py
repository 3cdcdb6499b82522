"""A tier with a capacity: the least recently used blocks are removed to make room, never one a
transfer uses, and what was stored and removed comes back as events."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfsm import JobResult, TransferJob
from kvfsm.testing import FakeNixlAgent, Raise, StayProc
from kvfsm.tiers import (
    FileTier,
    HoldingEvent,
    Lookup,
    ObjectStoreTier,
    RemovalInFlightError,
    SecondaryTier,
    TierBusyError,
    TierFullError,
)
from kvfsm.tiers.holdings import Holdings
from kvfsm.tiers.object_store import _Objects

from .conftest import NUM_BLOCKS
from .real_nixl import require_nixl

BLOCK = 256  # bytes of one block of the conftest primary


def object_names(tier: ObjectStoreTier, *keys: str) -> list[str]:
    """The sorted names of the objects of ``keys`` in ``tier`` (in its block size's folder)."""
    return sorted(tier.object_key(key) for key in keys)


def store(job_id: int, *pairs: tuple[str, int]) -> TransferJob:
    return TransferJob(job_id, [k for k, _ in pairs], [b for _, b in pairs])


def load(job_id: int, *pairs: tuple[str, int]) -> TransferJob:
    return TransferJob(job_id, [k for k, _ in pairs], [b for _, b in pairs], is_promotion=True)


def settle(tier: SecondaryTier, polls: int = 50) -> list[JobResult]:
    """Every result, once the tier is idle and (an object store) deleted what it evicted."""
    results: list[JobResult] = []
    for _ in range(polls):
        results += tier.get_finished_jobs()
        if not tier.has_pending_work():
            break
    if isinstance(tier, ObjectStoreTier):
        assert tier.wait_for_removals(5)
    return results


@pytest.fixture
def small(primary: torch.Tensor, agent: FakeNixlAgent) -> ObjectStoreTier:
    """An object store that keeps three blocks."""
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=3 * BLOCK, record_events=True,
                           remove=agent.remove_objects)
    yield tier
    tier.shutdown(timeout=5)


def test_the_least_recently_used_block_goes_first_and_a_lookup_counts_as_use(
    small: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    small.submit_store(store(1, ("a", 0), ("b", 1), ("c", 2)))
    assert [r.success for r in settle(small)] == [True]
    assert small.take_events() == [HoldingEvent(("a", "b", "c"), removed=False)]
    assert small.lookup("a") is Lookup.HIT  # a is now the most recent: b is the oldest

    small.submit_store(store(2, ("d", 3)))
    assert [r.success for r in settle(small)] == [True]
    assert sorted(agent.objects) == object_names(small, "a", "c", "d")
    assert small.lookup("b") is Lookup.MISS
    assert small.take_events() == [HoldingEvent(("b",), removed=True),
                                   HoldingEvent(("d",), removed=False)]
    holdings = small.stats()["holdings"]
    assert (holdings["held_blocks"], holdings["held_bytes"], holdings["removed"]) == (
        3, 3 * BLOCK, 1)


def test_touch_and_a_load_count_as_use(small: ObjectStoreTier, agent: FakeNixlAgent) -> None:
    small.submit_store(store(1, ("a", 0), ("b", 1), ("c", 2)))
    settle(small)
    small.touch(["a"])  # order now b, c, a
    small.submit_load(load(2, ("b", 5)))  # order now c, a, b
    assert [r.success for r in settle(small)] == [True]
    small.submit_store(store(3, ("d", 3), ("e", 4)))
    settle(small)
    assert sorted(agent.objects) == object_names(small, "b", "d", "e")


def test_a_block_a_load_still_reads_is_never_removed(
    small: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    small.submit_store(store(1, ("a", 0), ("b", 1), ("c", 2)))
    settle(small)
    agent.inject("check_xfer_state", StayProc(3))  # the load runs a while
    small.submit_load(load(2, ("a", 5)))
    small.touch(["b", "c"])  # a, being read, is now the least recently used: b goes instead
    small.submit_store(store(3, ("d", 3)))
    assert small.wait_for_removals(5)
    assert small.object_key("a") in agent.objects
    assert small.object_key("b") not in agent.objects
    assert sorted((r.job_id, r.success) for r in settle(small)) == [(2, True), (3, True)]


def test_a_store_that_cannot_make_room_is_refused_and_changes_nothing(
    small: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    agent.inject("check_xfer_state", StayProc(10))
    small.submit_store(store(1, ("a", 0), ("b", 1)))  # being written: not removable
    with pytest.raises(TierFullError, match=re.escape(
            "needs 1 block(s) removed to stay within capacity_bytes=768 (3 blocks), and only 0 "
            "can be: of the 2 block(s) counted, 2 being written by stores in flight, not stored "
            "yet")):
        small.submit_store(store(2, ("c", 2), ("d", 3)))
    assert small.state_of(2) is None
    assert small.stats()["holdings"]["writing_blocks"] == 2
    small.submit_store(store(2, ("c", 2)))  # fits: the same job id is free to use
    assert sorted((r.job_id, r.success) for r in settle(small)) == [(1, True), (2, True)]
    assert sorted(agent.objects) == object_names(small, "a", "b", "c")


def test_a_store_larger_than_the_whole_capacity_is_refused_as_one_that_can_never_fit(
    small: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    """On an empty, idle tier no block is in the way: the store itself is too big, and the
    error says so rather than blaming blocks being written or read."""
    with pytest.raises(TierFullError) as refused:
        small.submit_store(store(1, ("a", 0), ("b", 1), ("c", 2), ("d", 3)))
    assert str(refused.value) == (
        "a store of 4 block(s) (1024 bytes) is larger than capacity_bytes=768 (3 blocks): it "
        "can never be stored")
    assert small.state_of(1) is None
    assert agent.objects == {}
    holdings = small.stats()["holdings"]
    assert (holdings["held_blocks"], holdings["writing_blocks"]) == (0, 0)


def test_a_refused_store_counts_the_blocks_in_its_way_by_what_keeps_each(
    small: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    """a, b and c are stored; a load reads b and c while a store names a again with a new d.
    Only a could make room, and this store keeps a: the error counts each block for what it
    is, read or named by the store, none being written."""
    small.submit_store(store(1, ("a", 0), ("b", 1), ("c", 2)))
    settle(small)
    agent.inject("check_xfer_state", StayProc(10))  # the load runs a while
    small.submit_load(load(2, ("b", 5), ("c", 6)))
    with pytest.raises(TierFullError) as refused:
        small.submit_store(store(3, ("a", 0), ("d", 3)))
    assert str(refused.value) == (
        "a store of 2 block(s) needs 1 block(s) removed to stay within capacity_bytes=768 "
        "(3 blocks), and only 0 can be: of the 3 block(s) counted, 2 stored and being read, "
        "1 stored and named by this store")
    assert small.state_of(3) is None
    assert [(r.job_id, r.success) for r in settle(small)] == [(2, True)]
    assert sorted(agent.objects) == object_names(small, "a", "b", "c")


def test_a_failed_store_of_a_new_block_removes_what_may_have_landed(
    small: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    agent.objects[small.object_key("a")] = b"half a block"  # what a broken write may leave
    agent.inject("check_xfer_state", Raise("NIXL_ERR_BACKEND"))
    small.submit_store(store(1, ("a", 0)))
    (result,) = settle(small)
    assert not result.success
    assert small.object_key("a") not in agent.objects
    assert small.lookup("a") is Lookup.MISS
    holdings = small.stats()["holdings"]
    assert (holdings["held_blocks"], holdings["writing_blocks"]) == (0, 0)
    assert small.take_events() == []  # nothing was ever held


def test_a_failed_load_is_a_miss_and_its_block_goes_when_its_turn_comes(
    small: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    small.submit_store(store(1, ("a", 0), ("b", 1)))
    settle(small)
    agent.inject("check_xfer_state", Raise("NIXL_ERR_BACKEND"))
    small.submit_load(load(2, ("a", 5)))
    (result,) = settle(small)
    assert not result.success
    assert small.lookup("a") is Lookup.MISS  # F11: not loaded again and again
    # the failure may not be the bytes' fault
    assert sorted(agent.objects) == object_names(small, "a", "b")
    small.lookup("b")  # b is used, a is not: a goes first
    small.submit_store(store(3, ("c", 2), ("d", 3)))
    settle(small)
    assert sorted(agent.objects) == object_names(small, "b", "c", "d")


def test_capacity_needs_a_way_to_remove_and_at_least_one_block(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    with pytest.raises(ValueError, match="needs remove="):
        ObjectStoreTier(primary, agent=agent, capacity_bytes=4 * BLOCK)
    with pytest.raises(ValueError, match=r"at least one block \(256 bytes\), got 100"):
        ObjectStoreTier(primary, agent=agent, capacity_bytes=100,
                        remove=agent.remove_objects)
    with pytest.raises(ValueError, match="record_events=True needs capacity_bytes"):
        ObjectStoreTier(primary, agent=agent, record_events=True)
    with pytest.raises(ValueError, match=r"remove must be a function .* got 5"):
        ObjectStoreTier(primary, agent=agent, capacity_bytes=4 * BLOCK, remove=5)
    with pytest.raises(ValueError, match="remove= is given without capacity_bytes"):
        ObjectStoreTier(primary, agent=agent, remove=agent.remove_objects)

    class OwnTier(SecondaryTier):  # a tier of the user's own, on kvfsm's base
        def remote_name(self, key: bytes | str) -> str:
            return str(key)

    with pytest.raises(ValueError, match=r"remove must be a function .* got 42"):
        OwnTier(primary, agent=agent, remote=_Objects(primary), capacity_bytes=BLOCK, remove=42)
    assert agent.live_registrations() == 0  # refused before any NIXL call


def test_a_removal_that_fails_is_counted_logged_and_the_block_forgotten(
    primary: torch.Tensor, agent: FakeNixlAgent, caplog: pytest.LogCaptureFixture,
) -> None:
    def refuse(names: list[str]) -> int:
        raise PermissionError("AccessDenied: s3:DeleteObject")

    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=BLOCK, remove=refuse)
    try:
        tier.submit_store(store(1, ("a", 0)))
        settle(tier)
        tier.submit_store(store(2, ("b", 1)))
        assert [r.success for r in settle(tier)] == [True]
        tier.shutdown(timeout=5)
        holdings = tier.stats()["holdings"]
        assert (holdings["removed"], holdings["remove_errors"]) == (0, 1)
        # a stays in the store, unknown to the tier
        assert sorted(agent.objects) == object_names(tier, "a", "b")
        assert tier.stats()["holdings"]["held_blocks"] == 1
        assert [r.getMessage() for r in caplog.records if "not removed" in r.getMessage()] == [
            "1 block(s) not removed, left where they are: the remove raised PermissionError: "
            "AccessDenied: s3:DeleteObject"]
    finally:
        tier.shutdown(timeout=5)


def test_a_removal_answering_no_count_is_logged_and_later_removals_go_on(
    primary: torch.Tensor, agent: FakeNixlAgent, caplog: pytest.LogCaptureFixture,
) -> None:
    """A ``remove=`` that answers with the names it could not delete, not their number: what
    it removed cannot be told, so all count as not removed, saying what it returned; its
    thread goes on (a list answer used to end it, and the counts with it)."""
    answers: list[object] = [["x"], None]

    def remove(names: list[str]) -> object:
        agent.remove_objects(names)
        return answers.pop(0)

    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=BLOCK, remove=remove)
    try:
        for job_id, key in enumerate("abc"):
            tier.submit_store(store(job_id, (key, job_id)))
            assert [r.success for r in settle(tier)] == [True]
        holdings = tier.stats()["holdings"]
        assert (holdings["removed"], holdings["remove_errors"]) == (1, 1)
        assert sorted(agent.objects) == object_names(tier, "c")
        assert [r.getMessage() for r in caplog.records if "counted as not" in r.getMessage()] == [
            "1 block(s) counted as not removed: the remove returned ['x'], not how many of "
            "them it could not remove (an int from 0 to 1, or None)"]
    finally:
        tier.shutdown(timeout=5)


@pytest.mark.timeout(30)
def test_a_removal_that_ends_its_thread_neither_hangs_a_wait_nor_stops_later_removals(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    """A ``remove=`` that raises SystemExit (a client library calling ``sys.exit``) ends the
    thread that sends the deletes. What it carried is counted as not deleted, a wait for the
    removals returns within its timeout, and the next eviction's delete is sent on a new
    thread."""
    calls: list[list[str]] = []

    def remove(names: list[str]) -> int:
        calls.append(list(names))
        if len(calls) == 1:
            raise SystemExit("the client gave up")
        agent.remove_objects(names)
        return 0

    quiet, threading.excepthook = threading.excepthook, lambda args: None
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=BLOCK, remove=remove)
    try:
        tier.submit_store(store(1, ("a", 0)))
        settle(tier)
        tier.submit_store(store(2, ("b", 1)))  # evicts a: its delete ends the thread
        assert [r.success for r in settle(tier)] == [True]
        assert calls == [object_names(tier, "a")]
        tier.submit_store(store(3, ("c", 2)))  # evicts b: sent on a new thread
        assert [r.success for r in settle(tier)] == [True]
        assert calls == [object_names(tier, "a"), object_names(tier, "b")]
        assert sorted(agent.objects) == object_names(tier, "a", "c")  # a's delete never ran
        holdings = tier.stats()["holdings"]
        assert (holdings["removed"], holdings["remove_errors"]) == (1, 1)
    finally:
        threading.excepthook = quiet
        tier.shutdown(timeout=5)


@pytest.mark.timeout(30)
def test_a_removal_that_shuts_its_tier_down_ends_the_shutdown_without_waiting_for_itself(
    primary: torch.Tensor, agent: FakeNixlAgent, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``remove=`` that shuts the tier down (it found the store gone, say) runs on the thread
    that sends the deletes; the shutdown once joined that very thread and raised
    RuntimeError. It now closes the tier, and says no deadline was missed; the deletes'
    thread ends after its call."""
    raised: list[BaseException] = []
    tier: ObjectStoreTier

    def remove(names: list[str]) -> int:
        try:
            tier.shutdown(timeout=5)
        except BaseException as error:  # (kept, for the assertion below)
            raised.append(error)
        return agent.remove_objects(names)

    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=BLOCK, remove=remove)
    tier.submit_store(store(1, ("a", 0)))
    assert [r.success for r in settle(tier)] == [True]
    tier.submit_store(store(2, ("b", 1)))  # evicts a: its delete shuts the tier down
    give_up = time.monotonic() + 10
    while not (tier.closed or raised) and time.monotonic() < give_up:
        time.sleep(0.01)
    assert raised == [] and tier.closed
    assert tier.wait_for_removals(5)
    assert object_names(tier, "a")[0] not in agent.objects, "a's delete was sent all the same"
    assert "deadline" not in caplog.text, caplog.text


def test_a_file_tier_deletes_its_least_recently_used_files(
    tmp_path: object, primary: torch.Tensor
) -> None:
    require_nixl()
    tier = FileTier(primary, tmp_path, capacity_bytes=2 * BLOCK, durable=False,
                    record_events=True)
    try:
        for job_id in range(NUM_BLOCKS):
            tier.submit_store(store(job_id, (f"k{job_id}", job_id)))
            assert [r.success for r in settle(tier)] == [True]
        assert sorted(p.name for p in tier.root.iterdir() if not p.name.startswith(".")) == [
            "k6", "k7"]
        events = tier.take_events()
        assert [e.keys for e in events if e.removed] == [(f"k{i}",) for i in range(6)]
        primary.zero_()
        tier.submit_load(load(99, ("k7", 0)))
        assert [r.success for r in settle(tier)] == [True]
        assert torch.equal(primary[0], torch.arange(7 * 64, 8 * 64, dtype=torch.float32))
    finally:
        tier.shutdown(timeout=5)


def test_a_block_file_that_cannot_be_removed_is_logged_and_counted(
    tmp_path: Path, primary: torch.Tensor, caplog: pytest.LogCaptureFixture,
) -> None:
    """The least recently used block's file is evicted, but what is under its name cannot be
    unlinked (a directory put there): the tier forgets it, counts it, and logs why."""
    require_nixl()
    tier = FileTier(primary, tmp_path, capacity_bytes=BLOCK, durable=False)
    try:
        tier.submit_store(store(1, ("a", 0)))
        assert [r.success for r in settle(tier)] == [True]
        tier.path_of("a").unlink()
        (tier.path_of("a") / "in the way").mkdir(parents=True)
        tier.submit_store(store(2, ("b", 1)))
        assert [r.success for r in settle(tier)] == [True]
        holdings = tier.stats()["holdings"]
        assert (holdings["removed"], holdings["remove_errors"]) == (0, 1)
        (message,) = [r.getMessage() for r in caplog.records
                      if "not deleted" in r.getMessage()]
        assert message.startswith(f"1 of 1 evicted block file(s) in {tmp_path}/ not deleted, "
                                  "left there; the first: [Errno 21] Is a directory")
    finally:
        tier.shutdown(timeout=5)


@pytest.mark.parametrize("durable", [False, True])
def test_a_file_store_that_failed_before_its_rename_removes_no_file_it_did_not_write(
    tmp_path: object, primary: torch.Tensor, durable: bool
) -> None:
    """Another tier (another process, say) stored k in the shared root. This tier, with a
    capacity, stores k too, and its post fails: nothing of its store was put under k's name,
    so the other's whole file stays (it was unlinked as this store's possible leftovers), and
    the other tier still loads it. A store that failed after its rename removes its file."""
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415
    from kvfsm.testing import FaultyAgent  # noqa: PLC0415

    require_nixl()
    other = FileTier(primary, tmp_path, durable=False)
    faulty = FaultyAgent(make_agent("capacity-fails", "POSIX"))
    tier = FileTier(primary, tmp_path, capacity_bytes=2 * BLOCK, durable=durable, agent=faulty)
    try:
        other.submit_store(store(1, ("k", 3)))
        assert [r.success for r in settle(other)] == [True]
        faulty.inject("transfer", Raise())
        tier.submit_store(store(2, ("k", 5)))
        tier.drain_jobs(10)
        (result,) = tier.get_finished_jobs()
        assert str(result.reason) == "transfer raised FakeNixlError: NIXL_ERR_BACKEND"
        assert tier.path_of("k").read_bytes() == primary[3].numpy().tobytes()
        other.submit_load(load(3, ("k", 6)))
        assert [r.success for r in settle(other)] == [True]

        (tier.path_of("j2") / "in the way").mkdir(parents=True)  # j2 cannot be renamed
        tier.submit_store(store(4, ("j1", 5), ("j2", 6)))
        tier.drain_jobs(10)  # (a durable store waits for its flush)
        (result,) = tier.get_finished_jobs()
        assert (result.success, result.reason.call if result.reason else None) == (
            False, "commit")
        assert not tier.path_of("j1").exists(), "renamed before j2 failed: this store's"
    finally:
        tier.shutdown(timeout=5)
        other.shutdown(timeout=5)


def test_a_file_store_whose_first_open_failed_removes_no_file_it_did_not_write(
    tmp_path: object, primary: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's temporary file cannot be created (the disk is full): the store fails by
    ``open`` before it wrote anything, and another tier's block under the same name stays."""
    import errno  # noqa: PLC0415
    import os  # noqa: PLC0415


    require_nixl()
    other = FileTier(primary, tmp_path, durable=False)
    tier = FileTier(primary, tmp_path, capacity_bytes=2 * BLOCK, durable=False)
    real_open = os.open

    def full_disk(path: str, flags: int, *args: Any, **kwargs: Any) -> int:
        if ".kvfsm-partial-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_open(path, flags, *args, **kwargs)

    try:
        other.submit_store(store(1, ("k", 3)))
        assert [r.success for r in settle(other)] == [True]
        monkeypatch.setattr(os, "open", full_disk)
        tier.submit_store(store(2, ("k", 5)))
        (result,) = settle(tier)
        monkeypatch.undo()
        assert result.reason is not None and result.reason.call == "open"
        assert tier.path_of("k").read_bytes() == primary[3].numpy().tobytes()
    finally:
        monkeypatch.undo()
        tier.shutdown(timeout=5)
        other.shutdown(timeout=5)


def test_what_a_failed_store_left_in_place_goes_when_the_last_store_of_it_ends(
    tmp_path: object, primary: torch.Tensor
) -> None:
    """Two stores of k run at once. The second renames k into place and fails (its other block
    cannot be renamed) while the first still runs, so k is not removed then; the first then
    fails before any rename of its own. k, the second's block, is removed as that first store
    ends: it is this tier's, and nothing counts it (it was once left for good)."""
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415
    from kvfsm.testing import FaultyAgent  # noqa: PLC0415

    require_nixl()
    faulty = FaultyAgent(make_agent("owed", "POSIX"))
    tier = FileTier(primary, tmp_path, capacity_bytes=4 * BLOCK, durable=False, agent=faulty)
    try:
        faulty.inject("check_xfer_state", StayProc(60), at=1)  # the first store runs on
        tier.submit_store(store(1, ("k", 3)))
        (tier.path_of("j") / "in the way").mkdir(parents=True)
        tier.submit_store(store(2, ("k", 5), ("j", 6)))
        assert [(r.job_id, r.reason.call if r.reason else None)
                for r in settle_without_removals(tier)] == [(2, "commit")]
        assert tier.path_of("k").read_bytes() == primary[5].numpy().tobytes()  # the second's
        assert tier.stats()["holdings"]["owed_blocks"] == 1

        faulty.inject("check_xfer_state", Raise())  # the first fails: it renamed nothing
        (result,) = settle(tier)
        assert (result.job_id, result.success) == (1, False)
        assert not tier.path_of("k").exists()
        holdings = tier.stats()["holdings"]
        assert (holdings["held_blocks"], holdings["owed_blocks"]) == (0, 0)
    finally:
        tier.shutdown(timeout=5)


def test_lookups_on_another_thread_never_break_an_eviction(
    small: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    """A lookup's HIT counts as use without taking the tier's lock: it is noted, and the next
    store counts it; lookups racing with evictions neither raise nor block them."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def look() -> None:
        try:
            while not stop.is_set():
                for name in ("k0", "k1", "k2", "k3"):
                    small.lookup(name)
        except BaseException as error:
            errors.append(error)

    looker = threading.Thread(target=look)
    looker.start()
    try:
        for job_id in range(60):
            small.submit_store(store(job_id, (f"k{job_id % 5}", job_id % NUM_BLOCKS)))
            assert [r.success for r in settle(small)] == [True]
    finally:
        stop.set()
        looker.join(10)
    assert errors == []
    assert small.stats()["holdings"]["held_blocks"] == 3


def test_a_refused_store_leaves_the_deletes_waiting_as_they_were(
    primary: torch.Tensor, agent: FakeNixlAgent, deletes: HeldDeletes
) -> None:
    """A store that names a block waiting to be deleted takes it back only once admitted: a
    refused one leaves the delete to be sent, so nothing stays in the store untracked."""
    from kvfsm.tiers.object_store import _stop_all_probers  # noqa: PLC0415

    tier = deletes.tier(ObjectStoreTier, primary, capacity_bytes=2 * BLOCK)
    for job_id, name in enumerate("abcd"):  # c evicts a (its delete held), d evicts b
        tier.submit_store(store(job_id, (name, job_id)))
        settle_without_removals(tier)
        if name == "c":  # a's delete is sent before b waits (not one delete of both)
            assert deletes.sent.wait(10)
    assert tier.stats()["holdings"]["removes_waiting"] == 1
    with pytest.raises(TierFullError):
        tier.submit_store(store(10, ("b", 4), ("e", 5), ("f", 6)))
    deletes.gate.set()
    assert tier.wait_for_removals(10)
    assert sorted(agent.objects) == object_names(tier, "c", "d")
    _stop_all_probers()  # what interpreter exit does: nothing is left waiting


def test_a_block_stored_again_while_its_delete_is_in_flight_is_refused_until_it_is_answered(
    primary: torch.Tensor, agent: FakeNixlAgent, deletes: HeldDeletes
) -> None:
    """Block a is evicted and its delete sent; the engine stores a again before the store
    answers the delete. Written then, the delete could land after the new object, and the tier
    would answer HIT for an object that is gone. So that store is refused, naming a, and
    changes nothing; once the delete is answered, a is stored again, and every block the tier
    answers HIT for is in the store."""
    tier = deletes.tier(ObjectStoreTier, primary, capacity_bytes=BLOCK)
    tier.submit_store(store(1, ("a", 0)))
    assert [r.success for r in settle_without_removals(tier)] == [True]
    tier.submit_store(store(2, ("b", 1)))  # evicts a: its delete is sent, not answered
    assert deletes.sent.wait(10)
    assert [r.success for r in settle_without_removals(tier)] == [True]
    registrations = agent.call_count("register_memory")

    with pytest.raises(RemovalInFlightError,
                       match=rf"store of {re.escape(tier.object_key('a'))} refused: the object "
                       r"is being deleted") as refused:
        tier.submit_store(store(3, ("a", 2)))
    assert isinstance(refused.value, TierBusyError)
    assert agent.call_count("register_memory") == registrations  # nothing registered
    assert not tier.has_pending_work()
    assert tier.lookup("a") is Lookup.MISS
    holdings = tier.stats()["holdings"]
    assert (holdings["removes_sending"], holdings["stores_refused_removing"]) == (1, 1)
    assert holdings["held_blocks"] == 1  # b, as before the refusal

    deletes.gate.set()
    assert tier.wait_for_removals(10)
    assert tier.object_key("a") not in agent.objects
    assert tier.stats()["holdings"]["removes_sending"] == 0
    tier.submit_store(store(4, ("a", 2)))  # taken now (and b goes)
    assert [r.success for r in settle(tier)] == [True]
    assert tier.lookup("a") is Lookup.HIT
    assert all(tier.object_key(name) in agent.objects
               for name in "ab" if tier.lookup(name) is Lookup.HIT)


def test_a_store_that_takes_a_waiting_delete_back_is_not_refused(
    primary: torch.Tensor, agent: FakeNixlAgent, deletes: HeldDeletes
) -> None:
    """Only a delete already sent refuses a store: one still waiting behind it is taken back,
    and its object is never deleted."""
    tier = deletes.tier(ObjectStoreTier, primary, capacity_bytes=BLOCK)
    store_a_b_c(tier, deletes)  # b evicts a (its delete sent), c evicts b (waiting)
    holdings = tier.stats()["holdings"]
    assert (holdings["removes_sending"], holdings["removes_waiting"]) == (1, 1)
    with pytest.raises(RemovalInFlightError,
                       match=f"store of {re.escape(tier.object_key('a'))} refused"):
        tier.submit_store(store(4, ("b", 3), ("a", 4)))  # a's is sent: b's stays waiting
    assert tier.stats()["holdings"]["removes_waiting"] == 1
    tier.submit_store(store(5, ("b", 3)))  # b's delete is waiting: taken back
    assert tier.stats()["holdings"]["removes_waiting"] == 1  # c's, evicted by it
    deletes.gate.set()
    assert [r.success for r in settle(tier)] == [True]
    assert sorted(agent.objects) == object_names(tier, "b")
    assert tier.lookup("b") is Lookup.HIT
    assert tier.stats()["holdings"]["stores_refused_removing"] == 1


def test_a_load_of_blocks_being_deleted_does_not_make_them_a_hit_again(
    primary: torch.Tensor, agent: FakeNixlAgent, deletes: HeldDeletes
) -> None:
    """a's delete is sent and b's waits behind it when a caller that skipped the lookup (a
    manager told which tier to load from) loads both: the objects are still there, so the
    loads succeed, with the bytes stored; but the tier does not answer HIT for them again,
    since their deletes are on their way (it once did, for objects then gone)."""
    tier = deletes.tier(ObjectStoreTier, primary, capacity_bytes=BLOCK)
    store_a_b_c(tier, deletes)  # b evicts a (its delete sent), c evicts b (waiting)
    stored = primary[:2].clone()
    tier.submit_load(load(5, ("a", 4), ("b", 5)))
    assert [r.success for r in settle_without_removals(tier)] == [True]
    assert torch.equal(primary[4:6], stored)
    assert (tier.lookup("a"), tier.lookup("b")) == (Lookup.MISS, Lookup.MISS)
    deletes.gate.set()
    assert tier.wait_for_removals(10)
    assert sorted(agent.objects) == object_names(tier, "c")
    assert (tier.lookup("a"), tier.lookup("b"), tier.lookup("c")) == (
        Lookup.MISS, Lookup.MISS, Lookup.HIT)


def test_a_probe_finding_an_object_being_deleted_answers_miss(
    primary: torch.Tensor, agent: FakeNixlAgent, deletes: HeldDeletes
) -> None:
    """The lookup cache forgot b's eviction (newer names pushed it out) while b's delete waits:
    a lookup of b probes the store, which still has the object; the probe answers MISS all the
    same (it once answered HIT, for an object gone a moment later)."""
    class Forgetful(ObjectStoreTier):
        known_names = 2

    tier = deletes.tier(Forgetful, primary, capacity_bytes=BLOCK)
    store_a_b_c(tier, deletes)  # b evicts a (its delete sent), c evicts b (waiting)
    tier.submit_store(store(7, ("x", 6)))  # evicts c; its HIT and x's push b's MISS out
    settle_without_removals(tier)
    assert tier.object_key("b") in agent.objects
    assert wait_for_verdict(tier, "b") is Lookup.MISS


def test_a_probe_answered_while_the_delete_ended_during_it_answers_miss(
    primary: torch.Tensor, agent: FakeNixlAgent, deletes: HeldDeletes
) -> None:
    """The probe of b finds b's object, and b's delete, which waited as the probe began, ends
    before the probe's answer is taken: the probe still answers MISS (what the store said was
    true when asked, and no longer is)."""

    class DeleteDuringQuery(FakeNixlAgent):
        def query_memory(self, *args: Any, **kwargs: Any) -> Any:
            answers = super().query_memory(*args, **kwargs)
            deletes.gate.set()  # the deletes go on, and end, before NIXL answers
            assert tier.wait_for_removals(10)
            return answers

    class Forgetful(ObjectStoreTier):
        known_names = 2

    tier = deletes.tier(Forgetful, primary, capacity_bytes=BLOCK,
                        probe_agent=DeleteDuringQuery("probe", objects=agent.objects))
    store_a_b_c(tier, deletes)
    tier.submit_store(store(7, ("x", 6)))  # evicts c; its MISS and x's HIT push b's out
    settle_without_removals(tier)
    assert tier.object_key("b") in agent.objects
    assert wait_for_verdict(tier, "b") is Lookup.MISS
    assert tier.object_key("b") not in agent.objects


def test_a_load_of_a_block_a_store_took_back_meanwhile_leaves_it_a_hit(
    primary: torch.Tensor, agent: FakeNixlAgent, deletes: HeldDeletes
) -> None:
    """b's delete waits when a load of b begins; while the load runs, a store of b takes the
    delete back and succeeds: the tier holds b, and the load ending does not make it a MISS."""
    tier = deletes.tier(ObjectStoreTier, primary, capacity_bytes=BLOCK)
    store_a_b_c(tier, deletes)
    agent.inject("check_xfer_state", StayProc(3), at=agent.call_count("check_xfer_state") + 1)
    tier.submit_load(load(8, ("b", 6)))
    tier.submit_store(store(9, ("b", 1)))  # takes b's waiting delete back
    assert sorted(r.job_id for r in settle_without_removals(tier)) == [8, 9]
    assert tier.holds("b") and tier.lookup("b") is Lookup.HIT
    deletes.gate.set()
    assert tier.wait_for_removals(10)
    assert tier.object_key("b") in agent.objects and tier.lookup("b") is Lookup.HIT


def wait_for_verdict(tier: ObjectStoreTier, name: str) -> Lookup:
    """The lookup's answer once its probe is over (RETRY until then), within 10 s."""
    import time  # noqa: PLC0415

    verdict = tier.lookup(name)
    deadline = time.monotonic() + 10
    while verdict is Lookup.RETRY and time.monotonic() < deadline:
        time.sleep(0.01)
        verdict = tier.lookup(name)
    return verdict


class HeldDeletes:
    """An object store's ``remove=`` whose deletes wait until the test opens ``gate`` (set at
    the end of each test, whatever happened); ``sent`` is set once one was sent."""

    def __init__(self, agent: FakeNixlAgent) -> None:
        self.agent = agent
        self.sent, self.gate = threading.Event(), threading.Event()
        self.tiers: list[ObjectStoreTier] = []

    def __call__(self, names: list[str]) -> int:
        self.sent.set()
        self.gate.wait()
        return self.agent.remove_objects(names)

    def tier(self, kind: type[ObjectStoreTier], primary: torch.Tensor, **options: Any
             ) -> ObjectStoreTier:
        """A tier of ``kind`` on the agent, whose evicted objects these deletes remove; shut
        down at the end of the test."""
        tier = kind(primary, agent=self.agent, remove=self, **options)
        self.tiers.append(tier)
        return tier


@pytest.fixture
def deletes(agent: FakeNixlAgent) -> Iterator[HeldDeletes]:
    """Deletes held until a test lets them go (let go at its end, whatever happened, before
    its tiers are shut down)."""
    held = HeldDeletes(agent)
    yield held
    held.gate.set()
    for tier in held.tiers:
        tier.shutdown(timeout=5)


def store_a_b_c(tier: ObjectStoreTier, deletes: HeldDeletes) -> None:
    """Store a, b and c one after the other into a tier that keeps one block: b evicts a,
    whose delete is sent (and held), and c evicts b, whose delete waits behind it."""
    for job_id, name in enumerate("abc"):
        tier.submit_store(store(job_id, (name, job_id)))
        assert [r.success for r in settle_without_removals(tier)] == [True]
        if name == "b":
            assert deletes.sent.wait(10)


def settle_without_removals(tier: SecondaryTier) -> list[JobResult]:
    """Every result, once the tier is idle (its deletes may still wait or run)."""
    results: list[JobResult] = []
    for _ in range(50):
        results += tier.get_finished_jobs()
        if not tier.has_pending_work():
            break
    return results


def test_a_cancelled_load_keeps_the_block_it_was_reading(
    small: ObjectStoreTier, agent: FakeNixlAgent
) -> None:
    """A load that fails for a reason of its own (cancelled here) removes nothing: the block
    stays stored and counted; the tier answers MISS for it until a store succeeds again."""
    small.submit_store(store(1, ("a", 0)))
    settle(small)
    agent.inject("check_xfer_state", StayProc(5))
    small.submit_load(load(2, ("a", 5)))
    small.cancel(2)
    (result,) = settle(small)
    assert not result.success
    assert small.object_key("a") in agent.objects
    assert small.stats()["holdings"]["held_blocks"] == 1
    assert small.lookup("a") is Lookup.MISS
    assert not small.holds("a")
    small.submit_store(store(3, ("a", 0)))  # not skipped by anyone: it is a MISS
    assert [r.success for r in settle(small)] == [True]
    assert small.lookup("a") is Lookup.HIT


def test_what_the_capacity_keeps_is_held_when_the_lookup_cache_forgot_it(
    primary: torch.Tensor, agent: FakeNixlAgent
) -> None:
    class Forgetful(ObjectStoreTier):
        known_names = 2  # far fewer than the capacity's blocks

    tier = Forgetful(primary, agent=agent, capacity_bytes=8 * BLOCK,
                     remove=agent.remove_objects)
    try:
        tier.submit_store(store(1, ("a", 0), ("b", 1), ("c", 2), ("d", 3)))
        settle(tier)
        assert tier.stats()["lookup_cache"] == 2
        assert all(tier.holds(name) for name in "abcd")
        assert tier.verdict("zz") is None
    finally:
        tier.shutdown(timeout=5)


def test_events_past_the_limit_drop_the_oldest_and_are_counted() -> None:
    """Between two take_events() calls at most ``event_limit`` events are kept: the oldest go,
    and stats() counts them, so a caller that fell behind knows it missed some."""
    removed: list[str] = []
    holdings = Holdings(4 * 16, 16, removed.extend, record_events=True, event_limit=2)
    for key in ("a", "b", "c"):
        holdings.reserve([key], [key])
        holdings.finished([key], [key], load=False, success=True)
    assert [event.keys for event in holdings.take_events()] == [("b",), ("c",)]
    assert holdings.stats()["events_dropped"] == 1
    assert holdings.take_events() == []


def test_a_shutdown_past_a_delete_in_flight_says_what_is_still_being_deleted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A delete of an evicted object still waiting for the store at shutdown's deadline: the
    warning says one is in flight and goes on after shutdown (it said "0 were left in the
    store", the count of deletes that failed before)."""
    sent, gate = threading.Event(), threading.Event()
    agent = FakeNixlAgent()

    def slow_remove(names: list[str]) -> int:
        sent.set()
        gate.wait(10)
        return agent.remove_objects(names)

    primary = torch.zeros(4, BLOCK, dtype=torch.uint8)
    tier = ObjectStoreTier(primary, agent=agent, capacity_bytes=BLOCK, remove=slow_remove)
    try:
        for job_id, key in enumerate(("key-a", "key-b")):  # key-b's store evicts key-a
            tier.submit_store(TransferJob(job_id, [key], [job_id]))
            tier.drain_jobs(timeout=5)
        assert sent.wait(10)
        with caplog.at_level("WARNING", logger="kvfsm"):
            tier.shutdown(timeout=0.2)
        assert ("shutdown: deleting evicted objects did not finish by the deadline: a delete "
                "of 1 object(s) is still waiting for the store, and 0 more wait to be sent "
                "after it (it goes on after shutdown returns); 0 failed or were never sent "
                "before, and stay in the store") in caplog.text
    finally:
        gate.set()
    assert tier.wait_for_removals(10)
    assert tier.object_key("key-a") not in agent.objects
