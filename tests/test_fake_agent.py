"""FakeNixlAgent: real bytes, real NIXL's failure shapes, misuse detection and fault injection."""

from __future__ import annotations

import dis
import functools
import gc
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import FrameType, FunctionType, ModuleType
from typing import Any

import pytest
import torch

from kvfsm import TransferJob
from kvfsm.agent import NixlAgent
from kvfsm.testing import fake_agent, faults
from kvfsm.testing.fake_agent import (
    FakeDlistHandle,
    FakeNixlAgent,
    FakeNixlError,
    FakeRegDList,
    FakeXferHandle,
    NixlMisuseError,
    Raise,
    ReturnErr,
    StayProc,
)
from kvfsm.tiers import ObjectStoreTier

BLOCKS = 8
BLOCK_ELEMS = 64
LOCAL = "NIXL_INIT_AGENT"


@dataclass
class Tier:
    """An agent with a registered, prepped KV buffer of BLOCKS float32 blocks."""

    agent: FakeNixlAgent
    kv: torch.Tensor
    dram: FakeRegDList
    local: FakeDlistHandle

    @property
    def block_bytes(self) -> int:
        return self.kv[0].nbytes

    def block(self, i: int) -> bytes:
        return self.kv[i].numpy().tobytes()

    def stage(self, keys: Sequence[str]) -> tuple[FakeRegDList, FakeDlistHandle]:
        """Register one object descriptor per key and prep them as the loopback side."""
        files = self.agent.register_memory(
            [(0, self.block_bytes, dev_id, key) for dev_id, key in enumerate(keys, start=1)], "OBJ"
        )
        return files, self.agent.prep_xfer_dlist(self.agent.name, files.trim())

    def make(self, op: str, blocks: Sequence[int], remote: FakeDlistHandle) -> FakeXferHandle:
        return self.agent.make_prepped_xfer(
            op, self.local, list(blocks), remote, list(range(len(blocks)))
        )


def make_tier(**agent_kwargs: int) -> Tier:
    agent = FakeNixlAgent("tier-agent", **agent_kwargs)
    kv = torch.arange(BLOCKS * BLOCK_ELEMS, dtype=torch.float32).view(BLOCKS, BLOCK_ELEMS)
    base, block_bytes = kv.data_ptr(), kv[0].nbytes
    dram = agent.register_memory([(base, kv.nbytes, 0, "")], "DRAM")
    local = agent.prep_xfer_dlist(
        LOCAL, [(base + i * block_bytes, block_bytes, 0) for i in range(BLOCKS)], "DRAM"
    )
    return Tier(agent, kv, dram, local)


@pytest.fixture
def tier() -> Tier:
    return make_tier()


def poll(agent: FakeNixlAgent, xfer: FakeXferHandle, limit: int = 20) -> list[str]:
    """Every answer of check_xfer_state until it is not PROC."""
    answers = [agent.check_xfer_state(xfer)]
    while answers[-1] == "PROC" and len(answers) < limit:
        answers.append(agent.check_xfer_state(xfer))
    return answers


def write_blocks(tier: Tier, keys: Sequence[str]) -> None:
    """Store blocks 0.. len(keys)-1 under ``keys`` and clean up after."""
    files, remote = tier.stage(keys)
    xfer = tier.make("WRITE", range(len(keys)), remote)
    assert tier.agent.transfer(xfer) == "PROC"
    assert poll(tier.agent, xfer)[-1] == "DONE"
    tier.agent.release_xfer_handle(xfer)
    tier.agent.release_dlist_handle(remote)
    tier.agent.deregister_memory(files)


# -- real bytes -------------------------------------------------------------------------------


def test_write_then_read_back_in_another_order_round_trips_the_bytes(tier: Tier) -> None:
    agent, keys = tier.agent, [f"blk-{i}" for i in range(BLOCKS)]
    original = tier.kv.clone()
    files, remote = tier.stage(keys)
    write = tier.make("WRITE", range(BLOCKS), remote)
    assert agent.transfer(write) == "PROC"
    assert poll(agent, write) == ["DONE"]
    assert all(agent.objects[keys[i]] == tier.block(i) for i in range(BLOCKS))
    agent.release_xfer_handle(write)

    tier.kv.zero_()
    order = [5, 2, 7, 0, 3, 6, 1, 4]  # object i lands in block order[i]
    read = tier.make("READ", order, remote)
    assert agent.transfer(read) == "PROC"
    assert poll(agent, read) == ["DONE"]
    for i, block in enumerate(order):
        assert torch.equal(tier.kv[block], original[i])
        assert tier.block(block) == agent.objects[keys[i]]

    agent.release_xfer_handle(read)
    agent.release_dlist_handle(remote)
    agent.deregister_memory(files)
    assert agent.live_xfer_handles() == 0
    assert agent.live_dlist_handles() == 1  # the KV buffer's own list
    assert agent.live_registrations("OBJ") == 0
    assert agent.live_registrations("DRAM") == agent.live_registrations() == 1


def test_bytes_move_only_when_the_transfer_completes() -> None:
    tier = make_tier(complete_after_polls=2)
    agent = tier.agent
    _, remote = tier.stage(["k"])
    write = tier.make("WRITE", [3], remote)
    assert agent.transfer(write) == "PROC"
    assert agent.check_xfer_state(write) == "PROC"
    assert agent.objects == {}
    assert agent.running_transfers() == 1
    assert agent.check_xfer_state(write) == "DONE"
    assert agent.objects == {"k": tier.block(3)}
    assert agent.running_transfers() == 0

    agent.objects["k"] = bytes(tier.block_bytes)
    read = tier.make("READ", [3], remote)
    agent.transfer(read)
    assert agent.check_xfer_state(read) == "PROC"
    assert tier.kv[3].abs().sum() > 0
    assert agent.check_xfer_state(read) == "DONE"
    assert tier.kv[3].abs().sum() == 0


@pytest.mark.parametrize(
    ("complete_after_polls", "answers"),
    [
        (1, ["DONE"]),
        (2, ["PROC", "DONE"]),
        (4, ["PROC", "PROC", "PROC", "DONE"]),
    ],
)
def test_complete_after_polls_is_the_number_of_checks_a_transfer_needs(
    complete_after_polls: int, answers: list[str]
) -> None:
    tier = make_tier(complete_after_polls=complete_after_polls)
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    assert tier.agent.transfer(xfer) == "PROC"
    assert poll(tier.agent, xfer) == answers
    assert tier.agent.objects["k"] == tier.block(0)


def test_complete_after_polls_zero_finishes_inside_transfer() -> None:
    tier = make_tier(complete_after_polls=0)
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [6], remote)
    assert tier.agent.transfer(xfer) == "DONE"
    assert tier.agent.objects["k"] == tier.block(6)
    assert tier.agent.running_transfers() == 0
    tier.agent.release_xfer_handle(xfer)


def test_a_done_transfer_keeps_answering_done_and_can_be_posted_again(tier: Tier) -> None:
    agent = tier.agent
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [1], remote)
    agent.transfer(xfer)
    assert poll(agent, xfer) == ["DONE"]
    assert agent.check_xfer_state(xfer) == "DONE"
    tier.kv[1].fill_(7.0)
    assert agent.transfer(xfer) == "PROC"
    assert poll(agent, xfer) == ["DONE"]
    assert agent.objects["k"] == tier.block(1)


def test_reading_a_missing_object_raises_from_check_ends_the_transfer_and_moves_nothing(
    tier: Tier,
) -> None:
    agent = tier.agent
    agent.objects["present"] = bytes(tier.block_bytes)
    before = tier.kv.clone()
    _, remote = tier.stage(["present", "missing"])
    read = tier.make("READ", [0, 1], remote)
    assert agent.transfer(read) == "PROC"
    with pytest.raises(FakeNixlError) as raised:
        agent.check_xfer_state(read)
    assert raised.value.code == str(raised.value) == "NIXL_ERR_BACKEND"
    assert torch.equal(tier.kv, before)
    assert agent.running_transfers() == 0
    with pytest.raises(FakeNixlError, match="NIXL_ERR_BACKEND"):
        agent.check_xfer_state(read)  # a failed transfer keeps failing
    agent.release_xfer_handle(read)  # over, so releasing is fine


def test_reading_an_object_of_another_length_reads_what_real_nixl_reads(tier: Tier) -> None:
    """As NIXL 1.5.1's OBJ backend does against an S3 server: a shorter object fills the
    start of the block and leaves the rest as it was, a longer one fills the block with its
    first bytes, and both answer DONE (a tier names objects of other sizes apart for this)."""
    size = tier.block_bytes
    tier.agent.objects["short"] = b"\x01" * (size - 1)
    tier.agent.objects["long"] = b"\x02" * size + b"\x03"
    tier.kv[0].fill_(0)
    tier.kv[1].fill_(0)
    _, remote = tier.stage(["short", "long"])
    read = tier.make("READ", [0, 1], remote)
    tier.agent.transfer(read)
    while tier.agent.check_xfer_state(read) == "PROC":
        pass
    assert tier.block(0) == b"\x01" * (size - 1) + b"\x00"
    assert tier.block(1) == b"\x02" * size
    tier.agent.release_xfer_handle(read)


def test_a_failed_read_with_complete_after_polls_zero_fails_on_the_check_as_nixl_does() -> None:
    """Real NIXL answers the post of a read of a missing object PROC and raises the failure
    from the check; the fake raised it from transfer(), a path no real run takes."""
    tier = make_tier(complete_after_polls=0)
    _, remote = tier.stage(["missing"])
    read = tier.make("READ", [0], remote)
    assert tier.agent.transfer(read) == "PROC"
    assert tier.agent.running_transfers() == 0, "over already: its handle may be released"
    for _ in range(2):  # the same failure on every check
        with pytest.raises(FakeNixlError, match="NIXL_ERR_BACKEND"):
            tier.agent.check_xfer_state(read)
    tier.agent.release_xfer_handle(read)


def test_query_memory_answers_empty_dict_for_present_and_none_for_absent(tier: Tier) -> None:
    write_blocks(tier, ["a"])
    answer = tier.agent.query_memory([(0, 1, 0, "a"), (0, 1, 0, "b")], "OBJ", "OBJ")
    assert answer == [{}, None]


def test_a_later_registration_of_the_same_dev_id_wins(tier: Tier) -> None:
    agent = tier.agent
    agent.register_memory([(0, tier.block_bytes, 9, "old")], "OBJ")
    agent.register_memory([(0, tier.block_bytes, 9, "new")], "OBJ")
    remote = agent.prep_xfer_dlist(agent.name, [(0, tier.block_bytes, 9)], "OBJ")
    xfer = tier.make("WRITE", [2], remote)
    agent.transfer(xfer)
    poll(agent, xfer)
    assert agent.objects == {"new": tier.block(2)}


def test_two_agents_can_share_one_object_store(tier: Tier) -> None:
    write_blocks(tier, ["shared"])
    other = FakeNixlAgent("restarted", objects=tier.agent.objects)
    assert other.query_memory([(0, 1, 0, "shared")], "OBJ", "OBJ") == [{}]


# -- what real NIXL raises --------------------------------------------------------------------


def test_errors_print_as_their_nixl_code_and_are_not_misuse() -> None:
    error = FakeNixlError("NIXL_ERR_NOT_FOUND")
    assert str(error) == error.code == "NIXL_ERR_NOT_FOUND"
    assert not issubclass(NixlMisuseError, FakeNixlError)
    assert not issubclass(FakeNixlError, NixlMisuseError)


def test_three_tuples_cannot_be_registered(tier: Tier) -> None:
    with pytest.raises(TypeError):
        tier.agent.register_memory([(0, 8, 1)], "OBJ")  # type: ignore[list-item]
    assert tier.agent.live_registrations("OBJ") == 0


def test_an_operation_other_than_write_or_read_is_a_key_error(tier: Tier) -> None:
    _, remote = tier.stage(["k"])
    with pytest.raises(KeyError):
        tier.agent.make_prepped_xfer("COPY", tier.local, [0], remote, [0])


@pytest.mark.parametrize(
    ("local_indices", "remote_indices"),
    [
        ([0, 1], [0]),  # different lengths
        ([BLOCKS], [0]),  # local index out of range
        ([0], [2]),  # remote index out of range
        ([-1], [0]),  # negative index
        ([], []),  # real NIXL refuses a transfer of zero descriptors
    ],
)
def test_bad_indices_are_invalid_param(
    tier: Tier, local_indices: list[int], remote_indices: list[int]
) -> None:
    _, remote = tier.stage(["a", "b"])
    with pytest.raises(FakeNixlError, match="NIXL_ERR_INVALID_PARAM"):
        tier.agent.make_prepped_xfer("WRITE", tier.local, local_indices, remote, remote_indices)
    assert tier.agent.live_xfer_handles() == 0


def test_descriptors_of_different_lengths_cannot_be_paired(tier: Tier) -> None:
    files = tier.agent.register_memory([(0, 16, 1, "small")], "OBJ")
    remote = tier.agent.prep_xfer_dlist(tier.agent.name, files.trim())
    with pytest.raises(FakeNixlError, match="NIXL_ERR_INVALID_PARAM"):
        tier.make("WRITE", [0], remote)


def test_sides_prepped_the_wrong_way_round_are_invalid_param(tier: Tier) -> None:
    files = tier.agent.register_memory([(0, tier.block_bytes, 1, "k")], "OBJ")
    remote_as_local = tier.agent.prep_xfer_dlist(LOCAL, files.trim())
    with pytest.raises(FakeNixlError, match="NIXL_ERR_INVALID_PARAM"):
        tier.make("WRITE", [0], remote_as_local)


def test_deregistering_twice_is_not_found_not_a_crash(tier: Tier) -> None:
    files, remote = tier.stage(["k"])
    tier.agent.release_dlist_handle(remote)
    tier.agent.deregister_memory(files)
    with pytest.raises(FakeNixlError, match="NIXL_ERR_NOT_FOUND"):
        tier.agent.deregister_memory(files)


def test_prepping_for_an_unknown_agent_or_unregistered_object_is_not_found(tier: Tier) -> None:
    files = tier.agent.register_memory([(0, tier.block_bytes, 1, "k")], "OBJ")
    with pytest.raises(FakeNixlError, match="NIXL_ERR_NOT_FOUND"):
        tier.agent.prep_xfer_dlist("somebody-else", files.trim())
    with pytest.raises(FakeNixlError, match="NIXL_ERR_NOT_FOUND"):
        tier.agent.prep_xfer_dlist(tier.agent.name, [(0, tier.block_bytes, 2)], "OBJ")


def test_posting_a_running_transfer_again_is_repost_active(tier: Tier) -> None:
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    tier.agent.transfer(xfer)
    with pytest.raises(FakeNixlError, match="NIXL_ERR_REPOST_ACTIVE"):
        tier.agent.transfer(xfer)
    assert poll(tier.agent, xfer) == ["DONE"]


def test_checking_a_transfer_never_posted_is_not_posted(tier: Tier) -> None:
    _, remote = tier.stage(["k"])
    with pytest.raises(FakeNixlError, match="NIXL_ERR_NOT_POSTED"):
        tier.agent.check_xfer_state(tier.make("WRITE", [0], remote))


def test_the_object_store_supports_no_notifications(tier: Tier) -> None:
    _, remote = tier.stage(["k"])
    with pytest.raises(FakeNixlError, match="NIXL_ERR_BACKEND"):
        tier.agent.make_prepped_xfer("WRITE", tier.local, [0], remote, [0], notif_msg=b"hi")
    xfer = tier.make("WRITE", [0], remote)
    with pytest.raises(FakeNixlError, match="NIXL_ERR_BACKEND"):
        tier.agent.transfer(xfer, b"hi")
    assert tier.agent.running_transfers() == 0


# -- misuse -----------------------------------------------------------------------------------


def test_releasing_a_transfer_handle_twice_is_misuse(tier: Tier) -> None:
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    tier.agent.release_xfer_handle(xfer)
    with pytest.raises(NixlMisuseError, match=r"release_xfer_handle: FakeXferHandle\(.*released"):
        tier.agent.release_xfer_handle(xfer)


def test_releasing_a_dlist_handle_twice_is_misuse(tier: Tier) -> None:
    _, remote = tier.stage(["k"])
    tier.agent.release_dlist_handle(remote)
    with pytest.raises(NixlMisuseError, match="release_dlist_handle: FakeDlistHandle"):
        tier.agent.release_dlist_handle(remote)


def test_using_a_released_transfer_handle_is_misuse(tier: Tier) -> None:
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    tier.agent.release_xfer_handle(xfer)
    with pytest.raises(NixlMisuseError, match=r"transfer: .*already released"):
        tier.agent.transfer(xfer)
    with pytest.raises(NixlMisuseError, match="check_xfer_state"):
        tier.agent.check_xfer_state(xfer)


def test_handles_of_another_agent_are_misuse(tier: Tier) -> None:
    other = make_tier()
    _, remote = other.stage(["k"])
    foreign = other.make("WRITE", [0], remote)
    with pytest.raises(NixlMisuseError, match="not a transfer handle made by agent"):
        tier.agent.release_xfer_handle(foreign)
    with pytest.raises(NixlMisuseError, match="not a dlist handle made by agent"):
        tier.agent.release_dlist_handle(remote)
    with pytest.raises(NixlMisuseError, match="make_prepped_xfer"):
        tier.agent.make_prepped_xfer("WRITE", tier.local, [0], remote, [0])
    assert other.agent.live_xfer_handles() == 1


def test_releasing_a_transfer_still_running_is_misuse(tier: Tier) -> None:
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    tier.agent.transfer(xfer)
    with pytest.raises(NixlMisuseError, match="may still be running"):
        tier.agent.release_xfer_handle(xfer)
    assert poll(tier.agent, xfer) == ["DONE"]
    tier.agent.release_xfer_handle(xfer)


def test_releasing_a_dlist_or_deregistering_under_a_live_transfer_handle_is_misuse(
    tier: Tier,
) -> None:
    agent = tier.agent
    files, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)  # never posted: still refers to both lists
    with pytest.raises(NixlMisuseError, match="still used by"):
        agent.release_dlist_handle(remote)
    with pytest.raises(NixlMisuseError, match="still used by"):
        agent.release_dlist_handle(tier.local)
    with pytest.raises(NixlMisuseError, match="deregister_memory: OBJ"):
        agent.deregister_memory(files)
    with pytest.raises(NixlMisuseError, match="deregister_memory: DRAM"):
        agent.deregister_memory(tier.dram)
    agent.release_xfer_handle(xfer)
    agent.release_dlist_handle(remote)
    agent.deregister_memory(files)
    assert agent.live_registrations("OBJ") == 0


def test_a_dram_descriptor_outside_registered_memory_is_misuse(tier: Tier) -> None:
    end = tier.kv.data_ptr() + tier.kv.nbytes
    with pytest.raises(NixlMisuseError, match="outside every registered DRAM region"):
        tier.agent.prep_xfer_dlist(LOCAL, [(end - 8, 16, 0)], "DRAM")
    assert tier.agent.live_dlist_handles() == 1


def test_making_a_transfer_from_a_list_whose_memory_was_deregistered_is_misuse(
    tier: Tier,
) -> None:
    files, remote = tier.stage(["k"])
    tier.agent.deregister_memory(files)
    with pytest.raises(NixlMisuseError, match="deregistered"):
        tier.make("WRITE", [0], remote)


def test_closing_with_a_running_transfer_is_misuse_and_every_call_after_close_too(
    tier: Tier,
) -> None:
    agent = tier.agent
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    agent.transfer(xfer)
    with pytest.raises(NixlMisuseError, match=r"close: .*running"):
        agent.close()
    assert poll(agent, xfer) == ["DONE"]
    agent.close()
    with pytest.raises(NixlMisuseError, match="check_xfer_state: agent 'tier-agent' is closed"):
        agent.check_xfer_state(xfer)


def test_the_context_manager_closes_the_agent() -> None:
    with FakeNixlAgent() as agent:
        agent.register_memory([(0, 8, 1, "k")], "OBJ")
    with pytest.raises(NixlMisuseError, match="closed"):
        agent.register_memory([(0, 8, 2, "j")], "OBJ")


def test_misuse_escapes_code_that_handles_nixl_failures(tier: Tier) -> None:
    _, remote = tier.stage(["k"])
    tier.agent.release_dlist_handle(remote)
    with pytest.raises(NixlMisuseError):
        try:
            tier.agent.release_dlist_handle(remote)
        except FakeNixlError:
            pytest.fail("a double release must not look like a NIXL failure")


# -- fault injection --------------------------------------------------------------------------


def test_raise_on_the_next_call_fails_that_call_only_and_changes_nothing(tier: Tier) -> None:
    agent = tier.agent
    agent.inject("register_memory", Raise("NIXL_ERR_NOT_ALLOWED"))
    with pytest.raises(FakeNixlError, match="NIXL_ERR_NOT_ALLOWED"):
        agent.register_memory([(0, 8, 1, "k")], "OBJ")
    assert agent.live_registrations("OBJ") == 0
    agent.register_memory([(0, 8, 1, "k")], "OBJ")
    assert agent.live_registrations("OBJ") == 1
    assert agent.pending_faults() == []


def test_raise_at_the_kth_call_counts_from_the_agents_creation(tier: Tier) -> None:
    agent = tier.agent
    _, remote = tier.stage(["k"])
    agent.inject("transfer", Raise(), at=2)
    assert agent.pending_faults() == [("transfer", 2, Raise("NIXL_ERR_BACKEND"))]
    xfer = tier.make("WRITE", [0], remote)
    assert agent.transfer(xfer) == "PROC"  # call 1
    poll(agent, xfer)
    with pytest.raises(FakeNixlError, match="NIXL_ERR_BACKEND"):
        agent.transfer(xfer)  # call 2
    assert agent.running_transfers() == 0
    assert agent.transfer(xfer) == "PROC"  # call 3
    assert agent.calls.count("transfer") == agent.call_count("transfer") == 3


def test_times_makes_a_fault_hit_consecutive_calls(tier: Tier) -> None:
    agent = tier.agent
    agent.inject("prep_xfer_dlist", Raise(), times=2)
    files = agent.register_memory([(0, tier.block_bytes, 1, "k")], "OBJ")
    for _ in range(2):
        with pytest.raises(FakeNixlError):
            agent.prep_xfer_dlist(agent.name, files.trim())
    assert agent.live_dlist_handles() == 1  # only the tier's own list
    agent.prep_xfer_dlist(agent.name, files.trim())
    assert agent.live_dlist_handles() == 2


def test_return_err_on_transfer_means_the_post_did_not_happen(tier: Tier) -> None:
    agent = tier.agent
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    agent.inject("transfer", ReturnErr())
    assert agent.transfer(xfer) == "ERR"
    assert agent.running_transfers() == 0
    with pytest.raises(FakeNixlError, match="NIXL_ERR_NOT_POSTED"):
        agent.check_xfer_state(xfer)
    assert agent.transfer(xfer) == "PROC"


def test_return_err_on_check_ends_the_transfer_as_failed_without_moving_bytes(tier: Tier) -> None:
    agent = tier.agent
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    agent.transfer(xfer)
    agent.inject("check_xfer_state", ReturnErr(), at=1)
    assert agent.check_xfer_state(xfer) == "ERR"
    assert agent.check_xfer_state(xfer) == "ERR"
    assert agent.objects == {}
    agent.release_xfer_handle(xfer)


def test_raise_on_check_ends_the_running_transfer_so_it_can_be_released(tier: Tier) -> None:
    agent = tier.agent
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    agent.transfer(xfer)
    agent.inject("check_xfer_state", Raise("NIXL_ERR_UNKNOWN"))
    with pytest.raises(FakeNixlError, match="NIXL_ERR_UNKNOWN"):
        agent.check_xfer_state(xfer)
    assert agent.running_transfers() == 0
    assert agent.objects == {}
    agent.release_xfer_handle(xfer)


@pytest.mark.parametrize("polls", [1, 3, 5])
def test_stay_proc_on_check_keeps_the_transfer_proc_for_n_polls(tier: Tier, polls: int) -> None:
    agent = tier.agent
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    agent.transfer(xfer)
    agent.inject("check_xfer_state", StayProc(polls))
    assert poll(agent, xfer) == ["PROC"] * polls + ["DONE"]
    assert agent.objects["k"] == tier.block(0)


def test_stay_proc_on_transfer_holds_even_an_immediate_completion() -> None:
    tier = make_tier(complete_after_polls=0)
    agent = tier.agent
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    agent.inject("transfer", StayProc(3))
    assert agent.transfer(xfer) == "PROC"
    assert agent.objects == {}
    assert poll(agent, xfer) == ["PROC", "PROC", "DONE"]
    assert agent.objects["k"] == tier.block(0)


def test_stay_proc_at_a_later_check_and_release_is_refused_while_held() -> None:
    tier = make_tier(complete_after_polls=3)
    agent = tier.agent
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    agent.transfer(xfer)
    agent.inject("check_xfer_state", StayProc(2), at=2)
    answers = [agent.check_xfer_state(xfer) for _ in range(5)]
    assert answers == ["PROC", "PROC", "PROC", "PROC", "DONE"]  # 2 normal + 2 held PROC
    xfer2 = tier.make("WRITE", [1], remote)
    agent.transfer(xfer2)
    agent.inject("check_xfer_state", StayProc(4))
    agent.check_xfer_state(xfer2)
    with pytest.raises(NixlMisuseError, match="may still be running"):
        agent.release_xfer_handle(xfer2)


def test_raise_on_release_leaves_the_handle_to_release_again(tier: Tier) -> None:
    agent = tier.agent
    _, remote = tier.stage(["k"])
    xfer = tier.make("WRITE", [0], remote)
    agent.inject("release_xfer_handle", Raise())
    with pytest.raises(FakeNixlError):
        agent.release_xfer_handle(xfer)
    assert agent.live_xfer_handles() == 1
    agent.release_xfer_handle(xfer)
    assert agent.live_xfer_handles() == 0


def test_raise_on_deregister_or_make_changes_nothing(tier: Tier) -> None:
    agent = tier.agent
    files, remote = tier.stage(["k"])
    agent.inject("make_prepped_xfer", Raise())
    with pytest.raises(FakeNixlError):
        tier.make("WRITE", [0], remote)
    assert agent.live_xfer_handles() == 0
    agent.release_dlist_handle(remote)
    agent.inject("deregister_memory", Raise())
    with pytest.raises(FakeNixlError):
        agent.deregister_memory(files)
    assert agent.live_registrations("OBJ") == 1
    agent.deregister_memory(files)


def test_calls_records_every_call_in_order_including_failed_ones(tier: Tier) -> None:
    agent = FakeNixlAgent()
    agent.inject("register_memory", Raise())
    with pytest.raises(FakeNixlError):
        agent.register_memory([(0, 8, 1, "k")], "OBJ")
    files = agent.register_memory([(0, 8, 1, "k")], "OBJ")
    with pytest.raises(KeyError):
        agent.make_prepped_xfer("MOVE", tier.local, [0], tier.local, [0])
    agent.query_memory(files, "OBJ")
    assert agent.calls == [
        "register_memory",
        "register_memory",
        "make_prepped_xfer",
        "query_memory",
    ]
    assert agent.call_count("register_memory") == 2
    assert agent.call_count("transfer") == 0


def test_a_call_that_is_misuse_still_consumes_its_fault(tier: Tier) -> None:
    agent = tier.agent
    _, remote = tier.stage(["k"])
    agent.release_dlist_handle(remote)
    agent.inject("release_dlist_handle", Raise())
    with pytest.raises(NixlMisuseError):
        agent.release_dlist_handle(remote)
    assert agent.pending_faults() == []


def test_pending_faults_lists_what_is_armed_until_it_fires(tier: Tier) -> None:
    agent = tier.agent
    agent.inject("query_memory", Raise(), times=2)
    agent.inject("query_memory", Raise("NIXL_ERR_NOT_FOUND"), at=5)
    assert [(call, n) for call, n, _ in agent.pending_faults()] == [
        ("query_memory", 1),
        ("query_memory", 2),
        ("query_memory", 5),
    ]
    for _ in range(2):
        with pytest.raises(FakeNixlError, match="NIXL_ERR_BACKEND"):
            agent.query_memory([(0, 1, 0, "k")], "OBJ", "OBJ")
    assert agent.pending_faults() == [("query_memory", 5, Raise("NIXL_ERR_NOT_FOUND"))]


@pytest.mark.parametrize(
    ("call", "fault", "kwargs", "message"),
    [
        ("frobnicate", Raise(), {}, "frobnicate"),
        ("close", Raise(), {}, "close"),
        ("register_memory", ReturnErr(), {}, "ReturnErr only applies"),
        ("release_xfer_handle", StayProc(2), {}, "StayProc only applies"),
        ("transfer", Raise(), {"times": 0}, "times"),
        ("transfer", Raise(), {"at": 0}, "at must be"),
        ("register_memory", Raise(), {"at": 1}, "already happened"),
        ("transfer", Raise(), {"at": 3}, "already have"),
        ("transfer", Raise, {}, r"inject: Raise is the class of a Fault; pass one: Raise\(\)"),
        ("transfer", "raise", {}, r"inject: 'raise' is not a Fault \(Raise\(\), ReturnErr\(\) "
                                  r"or StayProc\(polls\)\)"),
    ],
)
def test_inject_refuses_what_cannot_fire(
    tier: Tier,
    call: str,
    fault: Raise | ReturnErr | StayProc,
    kwargs: dict[str, int],
    message: str,
) -> None:
    tier.agent.inject("transfer", ReturnErr(), at=2, times=2)
    with pytest.raises(ValueError, match=message):
        tier.agent.inject(call, fault, **kwargs)


def test_faults_reject_meaningless_values() -> None:
    with pytest.raises(ValueError, match="polls"):
        StayProc(0)
    with pytest.raises(ValueError, match="NIXL_ERR_"):
        Raise("oops")
    with pytest.raises(ValueError, match="complete_after_polls"):
        FakeNixlAgent(complete_after_polls=-1)


def test_the_fake_satisfies_the_agent_protocol_kvfsm_drives() -> None:
    assert isinstance(FakeNixlAgent(), NixlAgent)


# -- scale: the agent keeps what is live, and a call costs the same whatever ran before ------


#: the fake's code: its modules, and the ``__init__`` dataclasses generate (not, say, a garbage
#: collector callback another library installed, which runs whenever a collection does)
FAKE_CODE = frozenset({fake_agent.__file__, faults.__file__, "<string>"})


def lines_run(call: Callable[[], object]) -> int:
    """How many lines of the fake's code ``call`` runs: a cost that a timer's noise does not
    blur, and that grows with whatever a call walks through."""
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if frame.f_code.co_filename not in FAKE_CODE:
            return None
        if event == "line":
            count += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(previous)
    return count


def held(agent: FakeNixlAgent) -> int:
    """How many objects the agent holds on to, apart from what it keeps by design (the object
    store, the call log, the misuses and the fault schedule)."""
    kept = {id(agent.objects), id(agent.calls), id(agent.misuses), id(agent.faults)}
    leaves = (type, ModuleType, FunctionType, str, bytes, int, float, Enum, type(None))
    seen: set[int] = set()
    stack: list[object] = list(vars(agent).values())
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in kept or isinstance(obj, leaves):
            continue
        seen.add(id(obj))
        stack.extend(gc.get_referents(obj))
    return len(seen)


def one_job(tier: Tier, n: int) -> FakeXferHandle:
    """The calls of one object-store job, as a tier makes them; its (released) handle."""
    agent = tier.agent
    files = agent.register_memory([(0, tier.block_bytes, n % 1024 + 1, f"job-{n}")], "OBJ")
    remote = agent.prep_xfer_dlist(agent.name, files.trim())
    xfer = agent.make_prepped_xfer("WRITE", tier.local, [n % BLOCKS], remote, [0])
    assert agent.transfer(xfer) == "PROC"
    assert poll(agent, xfer)[-1] == "DONE"
    agent.release_xfer_handle(xfer)
    agent.release_dlist_handle(remote)
    agent.deregister_memory(files)
    del agent.objects[f"job-{n}"]  # (the object store keeps what it is given: not the fake's)
    return xfer


def test_a_job_costs_the_same_after_thousands_and_the_agent_keeps_only_what_is_live() -> None:
    tier = make_tier()
    agent = tier.agent
    first = one_job(tier, 0)
    for n in range(1, 10):
        one_job(tier, n)
    early_cost, early_held = lines_run(lambda: one_job(tier, 10)), held(agent)
    for n in range(11, 3000):
        one_job(tier, n)
    assert lines_run(lambda: one_job(tier, 3000)) == early_cost
    assert held(agent) == early_held, "released handles and deregistered memory are forgotten"
    assert (agent.live_xfer_handles(), agent.live_dlist_handles(), agent.live_registrations(),
            agent.running_transfers()) == (0, 1, 1, 0)
    with pytest.raises(NixlMisuseError, match="already released"):  # still told, though forgotten
        agent.release_xfer_handle(first)


def test_a_poll_round_over_100000_transfers_in_flight_costs_the_same_per_transfer() -> None:
    tier = make_tier(complete_after_polls=2)
    agent = tier.agent
    _, remote = tier.stage(["k"])

    def post() -> FakeXferHandle:
        xfer = agent.make_prepped_xfer("WRITE", tier.local, [1], remote, [0])
        assert agent.transfer(xfer) == "PROC"
        return xfer

    def costs() -> list[int]:
        """Lines run, with whatever else is in flight, by: making and posting one more transfer,
        its check answering PROC, the check that completes it, its release, and a whole job
        from registration to deregistration."""
        made: list[FakeXferHandle] = []
        cost = [lines_run(lambda: made.append(post()))]
        cost += [lines_run(lambda: agent.check_xfer_state(made[0])) for _ in range(2)]
        cost.append(lines_run(lambda: agent.release_xfer_handle(made[0])))
        cost.append(lines_run(lambda: one_job(tier, 7)))
        return cost

    costs()  # (first calls of each name run a line more, to start counting them)
    alone = costs()
    in_flight = [post() for _ in range(100_000)]
    check = agent.check_xfer_state
    assert all(check(xfer) == "PROC" for xfer in in_flight)  # a poll round: all still running
    assert agent.running_transfers() == 100_000
    assert costs() == alone
    assert all(check(xfer) == "DONE" for xfer in in_flight)  # the round that completes them
    assert agent.running_transfers() == 0
    release = agent.release_xfer_handle
    for xfer in in_flight:
        release(xfer)
    assert agent.live_xfer_handles() == 0


@pytest.mark.timeout(30)
def test_a_file_tier_runs_on_the_fake_agent_as_on_nixls_posix_backend(tmp_path: Path) -> None:
    """The fake is a stand-in for a FileTier's agent too: blocks are stored as files, loaded
    back in another order, a release that raises is retried, and a file cut short is a failed
    load that leaves its block as it was (every job once failed: the fake had no file
    backend, and refused every registration of files with NIXL_ERR_NOT_FOUND)."""
    from kvfsm.tiers import FileTier  # noqa: PLC0415

    kv = torch.arange(8 * 64, dtype=torch.float32).view(8, 64)
    stored = kv.clone()
    agent = FakeNixlAgent("files")
    tier = FileTier(kv, tmp_path, agent=agent, durable=False)
    agent.inject("release_xfer_handle", Raise(), times=2)
    tier.submit_store(TransferJob(1, ["a", "b"], [0, 1]))
    tier.submit_store(TransferJob(2, ["c"], [2]))
    tier.drain_jobs(timeout=10)
    assert sorted((r.job_id, r.success) for r in tier.get_finished_jobs()) == [(1, True), (2, True)]
    assert (tmp_path / "b").read_bytes() == stored[1].numpy().tobytes()
    assert tier.stats()["retries"] == 2
    tier.submit_load(TransferJob(3, ["c", "a"], [5, 6], is_promotion=True))
    with (tmp_path / "b").open("r+b") as cut:
        cut.truncate(10)  # a file another process cut short: no whole block
    tier.submit_load(TransferJob(4, ["b"], [7], is_promotion=True))
    tier.drain_jobs(timeout=10)
    results = {r.job_id: r for r in tier.get_finished_jobs()}
    assert results[3].success and not results[4].success
    assert torch.equal(kv[5], stored[2]) and torch.equal(kv[6], stored[0])
    assert torch.equal(kv[7], stored[7]), "the failed load left its block as it was"
    tier.shutdown()
    assert (agent.live_registrations(), agent.live_xfer_handles(), agent.misuses) == (0, 0, [])


def files_agent(real: bool, name: str) -> Any:
    """The fake agent, or (``real``) a real one with NIXL's POSIX backend, for the tests that
    run the same file transfers on both."""
    if not real:
        return FakeNixlAgent(name)
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    from .real_nixl import require_nixl  # noqa: PLC0415

    require_nixl()
    return make_agent(f"{name}-{os.getpid()}", "POSIX")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("real", [False, True], ids=["fake", "real NIXL POSIX"])
def test_files_a_transfer_could_not_wholly_move_fail_it_and_keep_what_moved_as_nixl_does(
    real: bool, tmp_path: Path
) -> None:
    """Two blocks to or from two files, the second one short (a READ) or opened read-only (a
    WRITE): NIXL_ERR_BACKEND, the first block moved whole, the second as far as it went; and a
    query of files. The same calls on the fake and on real NIXL's POSIX backend, which this
    checks it against."""
    agent = files_agent(real, "files")
    memory = torch.full((32,), 7, dtype=torch.uint8)
    base = memory.data_ptr()
    dram = agent.register_memory([(base, 32, 0, "")], "DRAM")
    local = agent.prep_xfer_dlist(LOCAL, [(base, 16, 0), (base + 16, 16, 0)], "DRAM")
    (tmp_path / "a").write_bytes(b"a" * 16)
    (tmp_path / "b").write_bytes(b"b" * 8)

    def move(operation: str, flags: tuple[int, int]) -> str:
        fds = [os.open(tmp_path / name, flag) for name, flag in zip("ab", flags, strict=True)]
        files = agent.register_memory([(0, 16, fd, "") for fd in fds], "FILE")
        remote = agent.prep_xfer_dlist(agent.name, files.trim())
        xfer = agent.make_prepped_xfer(operation, local, [0, 1], remote, [0, 1])
        try:
            answer = agent.transfer(xfer)
            while answer == "PROC":
                answer = agent.check_xfer_state(xfer)
        except Exception as error:  # (the real agent's error type, or the fake's)
            answer = str(error)
        agent.release_xfer_handle(xfer)
        agent.release_dlist_handle(remote)
        agent.deregister_memory(files)
        for fd in fds:
            os.close(fd)
        return answer

    assert move("READ", (os.O_RDONLY, os.O_RDONLY)) == "NIXL_ERR_BACKEND"
    assert bytes(memory.numpy()) == b"a" * 16 + b"b" * 8 + b"\x07" * 8
    memory.fill_(9)
    assert move("WRITE", (os.O_WRONLY, os.O_RDONLY)) == "NIXL_ERR_BACKEND"
    assert (tmp_path / "a").read_bytes() == b"\x09" * 16, "the block it could write stays"
    assert (tmp_path / "b").read_bytes() == b"b" * 8
    present, absent = agent.query_memory([(0, 16, 0, str(tmp_path / "a")),
                                          (0, 16, 0, str(tmp_path / "none"))], "POSIX", "FILE")
    assert (present["size"], absent) == ("16", None), "a query of files: stat, or None"
    agent.release_dlist_handle(local)
    agent.deregister_memory(dram)


# -- interrupts: a fake call happens whole or not at all, as a NIXL C call does ---------------


#: CPython (3.11) runs a signal handler, which raises KeyboardInterrupt, only at these bytecodes:
#: a function starting (RESUME), a loop jumping back, and right after a call returned
_CALLS = frozenset(dis.opmap[name] for name in ("CALL", "CALL_FUNCTION_EX") if name in dis.opmap)
_JUMP_BACK = dis.opmap["JUMP_BACKWARD"]


class Interrupt:
    """Raises KeyboardInterrupt once, at the ``at``-th point of a call where Python could run a
    signal handler: where a function inside the call starts, where a loop jumps back, and after
    every call returned (even from a Python function, where CPython does not look: a superset).
    With ``statements``, also where any statement starts (stricter than CPython: a handler that
    only re-raises a NIXL error cannot see an interrupt, for one).
    """

    def __init__(self, at: int, *, statements: bool = False) -> None:
        self.at = at
        self.statements = statements
        self.points = 0
        self.fired = False

    def run(self, call: Callable[..., Any], *args: Any) -> Any:
        previous = sys.gettrace()
        sys.settrace(self._enter)
        try:
            return call(*args)
        finally:
            sys.settrace(previous)

    def _point(self) -> None:
        if not self.fired:
            self.points += 1
            if self.points == self.at:
                self.fired = True
                raise KeyboardInterrupt

    def _enter(self, frame: FrameType, event: str, arg: object) -> Any:
        if self.fired or frame.f_code.co_filename not in FAKE_CODE:
            return None
        frame.f_trace_opcodes = True
        code, after_call = frame.f_code.co_code, False
        self._point()  # RESUME

        def step(frame: FrameType, event: str, arg: object) -> Any:
            nonlocal after_call
            if event == "opcode":
                opcode = code[frame.f_lasti]
                if after_call or opcode == _JUMP_BACK:
                    after_call = False
                    self._point()
                after_call = opcode in _CALLS
            elif event == "exception":  # a call that raised: no signal is looked for
                after_call = False
            elif event == "line" and self.statements:
                self._point()
            return step

        return step


def snapshot(agent: FakeNixlAgent, fds: Sequence[int] = ()) -> tuple[object, ...]:
    """What a NIXL call may change: handles, registrations, running transfers, objects, and
    what the files of ``fds`` hold."""
    return (agent.live_xfer_handles(), agent.live_dlist_handles(),
            agent.live_registrations("DRAM"), agent.live_registrations("OBJ"),
            agent.running_transfers(), dict(agent.objects), held(agent),
            agent.live_registrations("FILE"),
            [os.pread(fd, os.fstat(fd).st_size, 0) for fd in fds])


def store_and_load(complete_after_polls: int, target: int, at: int,
                   where: str = "OBJ", root: Path | None = None) -> tuple[list[str], bool]:
    """Every kind of call, from registering a KV buffer to closing the agent: a store of two
    blocks, their load into two others, a load that fails, to objects or (``where`` "FILE")
    to files in ``root``. Call number ``target`` is interrupted at its ``at``-th point; it
    must then have changed nothing, and is made again.

    Returns what each call answered (handles by type), and whether the interrupt fired."""
    agent = FakeNixlAgent("interrupted", complete_after_polls=complete_after_polls)
    kv = torch.arange(BLOCKS * BLOCK_ELEMS, dtype=torch.float32).view(BLOCKS, BLOCK_ELEMS)
    base, size = kv.data_ptr(), kv[0].nbytes
    answers: list[str] = []
    interrupt = Interrupt(at)
    fds = [os.open(root / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
           for name in ("a", "b", "gone")] if where == "FILE" and root is not None else []

    def answer(call: Callable[..., Any], *args: Any) -> Any:
        try:
            result = call(*args)
        except FakeNixlError as error:
            answers.append(error.code)
            return None
        answers.append(type(result).__name__ if isinstance(result, FAKE_TYPES) else repr(result))
        return result

    def call(name: str, *args: Any) -> Any:
        method = getattr(agent, name)
        if len(answers) + 1 == target:
            before = snapshot(agent, fds)
            try:
                return answer(interrupt.run, method, *args)
            except KeyboardInterrupt:
                assert snapshot(agent, fds) == before, f"an interrupted {name} changed the agent"
        return answer(method, *args)  # (after an interrupt: made again)

    def until_over(xfer: FakeXferHandle) -> None:
        while call("check_xfer_state", xfer) == "PROC":
            pass

    dram = call("register_memory", [(base, kv.nbytes, 0, "")], "DRAM")
    local = call("prep_xfer_dlist", LOCAL, [(base + i * size, size, 0) for i in range(BLOCKS)],
                 "DRAM")
    files = call("register_memory", [(0, size, fd, "") for fd in fds], "FILE") if fds else call(
        "register_memory", [(0, size, 1, "a"), (0, size, 2, "b"), (0, size, 3, "gone")], "OBJ")
    remote = call("prep_xfer_dlist", agent.name, files.trim())
    for operation, blocks, objects in (("WRITE", [1, 2], [0, 1]), ("READ", [5, 6], [0, 1]),
                                       ("READ", [7], [2])):
        xfer = call("make_prepped_xfer", operation, local, blocks, remote, objects)
        if call("transfer", xfer) == "PROC":
            until_over(xfer)
        call("check_xfer_state", xfer)  # over: answers the same again
        call("release_xfer_handle", xfer)
    call("query_memory", files, "OBJ")  # (files registered with no path: None each)
    call("release_dlist_handle", remote)
    call("deregister_memory", files)
    call("release_dlist_handle", local)
    call("deregister_memory", dram)
    call("close")
    assert torch.equal(kv[5:7], kv[1:3]), "the load brought the stored blocks back"
    if fds:
        assert [os.pread(fd, 2 * size, 0) for fd in fds] == [
            kv[1].numpy().tobytes(), kv[2].numpy().tobytes(), b""]
        for fd in fds:
            os.close(fd)
    else:
        assert sorted(agent.objects) == ["a", "b"]
    assert snapshot(agent)[:5] == (0, 0, 0, 0, 0)
    assert agent.misuses == []
    return answers, interrupt.fired


FAKE_TYPES = (FakeRegDList, FakeDlistHandle, FakeXferHandle)


@pytest.mark.parametrize("where", ["OBJ", "FILE"])
@pytest.mark.parametrize("complete_after_polls", [0, 2])
def test_an_interrupt_anywhere_inside_any_call_leaves_no_effect(
    complete_after_polls: int, where: str, tmp_path: Path
) -> None:
    """(Files: the bytes a WRITE wrote are put back, and the file's size.)"""
    expected, _ = store_and_load(complete_after_polls, target=0, at=0, where=where,
                                 root=tmp_path)
    if where == "FILE":  # the load of the empty file failed, as NIXL's POSIX backend fails it
        assert "NIXL_ERR_BACKEND" in expected and "[None, None, None]" in expected
    for target in range(1, len(expected) + 1):
        at = 1
        while True:  # every point of the call, until it runs out of points
            answers, fired = store_and_load(complete_after_polls, target, at, where, tmp_path)
            if not fired:
                break
            assert answers == expected, (target, at)
            at += 1
        assert at > 3, "the call was interrupted at several points"


@pytest.mark.parametrize(
    "call", ["register_memory", "prep_xfer_dlist", "make_prepped_xfer", "transfer"])
def test_an_interrupt_inside_a_submit_call_of_a_tier_leaks_nothing(
    call: str, primary: torch.Tensor,
) -> None:
    """Each call a submit makes, interrupted anywhere inside the fake (wherever CPython could
    run a signal handler, and at every statement), leaves nothing behind.

    Interrupted inside ``make_prepped_xfer`` once it had filed the new handle (at its ``return``),
    the fake used to keep the handle live though the driver never got it: the job's cleanup and
    then the tier's shutdown were refused as misuse (a live handle relies on them) and the
    primary cache stayed registered. Inside ``register_memory``, where the generator feeding its
    ``extend`` resumes after the first descriptor was filed (a point CPython does run handlers
    at), the descriptor stayed registered for good; ``prep_xfer_dlist`` kept its list alike; and
    ``transfer`` raised after it had posted."""
    at = 1
    while True:  # every point of the call, until it runs out of them
        agent = FakeNixlAgent()
        tier = ObjectStoreTier(primary, agent=agent)
        interrupt = Interrupt(at, statements=True)
        setattr(agent, call, functools.partial(interrupt.run, getattr(agent, call)))
        try:
            tier.submit_store(TransferJob(1, keys=["k"], block_ids=[0]))
        except KeyboardInterrupt:
            assert interrupt.fired
        tier.drain_jobs(timeout=5)
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [
            (1, not interrupt.fired)]
        tier.shutdown(timeout=5)
        assert (agent.live_xfer_handles(), agent.live_dlist_handles(),
                agent.live_registrations("DRAM"), agent.live_registrations()) == (0, 0, 0, 0), at
        assert agent.misuses == [], at
        assert tier.stats()["leaks"] == 0
        if not interrupt.fired:
            break
        at += 1
    assert at > 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("remote", [((0, 16), (8, 16)), ((0, 8), (0, 16))],
                         ids=["overlapping", "one offset, two lengths"])
def test_an_interrupted_write_through_descriptors_sharing_a_file_puts_it_back_whole(
    remote: tuple[tuple[int, int], tuple[int, int]], tmp_path: Path
) -> None:
    """Two blocks written into one file through descriptors that overlap: interrupted at any
    point of the check that completes the write, the file holds what it held (the ranges were
    once read one after the other's write, and put back first to last)."""
    at = 1
    while True:
        agent = FakeNixlAgent("shared-file", complete_after_polls=1)
        memory = torch.tensor(list(b"B" * 16 + b"C" * 16), dtype=torch.uint8)
        base = memory.data_ptr()
        agent.register_memory([(base, 32, 0, "")], "DRAM")
        local = agent.prep_xfer_dlist(
            LOCAL, [(base, remote[0][1], 0), (base + 16, remote[1][1], 0)], "DRAM")
        (tmp_path / "f").write_bytes(b"A" * 32)
        fd = os.open(tmp_path / "f", os.O_RDWR)
        agent.register_memory([(0, 32, fd, "")], "FILE")
        files = agent.prep_xfer_dlist(agent.name, [(offset, length, fd)
                                                   for offset, length in remote], "FILE")
        xfer = agent.make_prepped_xfer("WRITE", local, [0, 1], files, [0, 1])
        assert agent.transfer(xfer) == "PROC"
        interrupt = Interrupt(at)
        try:
            answer = interrupt.run(agent.check_xfer_state, xfer)
        except KeyboardInterrupt:
            assert os.pread(fd, 64, 0) == b"A" * 32, f"put back whole (point {at})"
            assert agent.check_xfer_state(xfer) == "DONE", "made again"
        else:
            assert answer == "DONE" and not interrupt.fired
            os.close(fd)
            break
        os.close(fd)
        at += 1
    assert at > 3, "the check was interrupted at several points"


def _files_transfer(agent: Any, tmp_path: Path, operation: str, modes: Sequence[int],
                    memory: torch.Tensor) -> tuple[Any, Callable[[], None]]:
    """A transfer of one 16-byte block a file, each file (holding b"f" * 16) opened with its
    mode; the transfer, and what cleans up after it."""
    base = memory.data_ptr()
    dram = agent.register_memory([(base, memory.nbytes, 0, "")], "DRAM")
    local = agent.prep_xfer_dlist(LOCAL, [(base + 16 * i, 16, 0) for i in range(len(modes))],
                                  "DRAM")
    fds = []
    for index, mode in enumerate(modes):
        (tmp_path / str(index)).write_bytes(b"f" * 16)
        fds.append(os.open(tmp_path / str(index), mode))
    files = agent.register_memory([(0, 16, fd, "") for fd in fds], "FILE")
    remote = agent.prep_xfer_dlist(agent.name, files.trim())
    xfer = agent.make_prepped_xfer(operation, local, list(range(len(modes))), remote,
                                   list(range(len(modes))))

    def clean() -> None:
        agent.release_xfer_handle(xfer)
        for release, handle in ((agent.release_dlist_handle, remote),
                                (agent.deregister_memory, files),
                                (agent.release_dlist_handle, local),
                                (agent.deregister_memory, dram)):
            release(handle)
        for fd in fds:
            os.close(fd)

    return xfer, clean


@pytest.mark.timeout(60)
@pytest.mark.parametrize("real", [False, True], ids=["fake", "real NIXL POSIX"])
def test_a_file_descriptor_that_cannot_do_the_operation_stops_the_transfer_there(
    real: bool, tmp_path: Path
) -> None:
    """A file opened for the other operation (or closed): the first block's fails the post
    itself; a later one's lets the blocks before it move, and the transfer fails when
    checked, the blocks after it untouched. The fake and real NIXL's POSIX backend alike."""
    agent = files_agent(real, "stop")
    ok, bad = os.O_RDWR, os.O_RDONLY
    for modes, posted, written in (((bad, ok), "NIXL_ERR_BACKEND", b"ff"),
                                   ((ok, bad, ok), "PROC", b"Mff")):
        memory = torch.full((16 * len(modes),), ord("M"), dtype=torch.uint8)
        xfer, clean = _files_transfer(agent, tmp_path, "WRITE", modes, memory)
        try:
            answer = agent.transfer(xfer)
        except Exception as error:  # (the real agent's error type, or the fake's)
            answer = str(error)
        assert answer == posted, modes
        if answer == "PROC":
            with pytest.raises(Exception, match="NIXL_ERR_BACKEND"):
                while agent.check_xfer_state(xfer) == "PROC":
                    pass
        assert b"".join((tmp_path / str(i)).read_bytes()[:1] for i in range(len(modes))) == (
            written), modes
        clean()


@pytest.mark.timeout(60)
def test_an_interrupted_check_that_fails_a_write_to_files_puts_them_back(tmp_path: Path) -> None:
    """The check that completes a WRITE stopped at its second file writes the first, then fails
    the transfer. Interrupted anywhere in it, the call has had no effect: the first file holds
    what it held, the transfer still runs, and the next check fails it, the first file
    written."""
    at = 1
    while True:
        agent = FakeNixlAgent("stopped", complete_after_polls=1)
        memory = torch.full((48,), ord("M"), dtype=torch.uint8)
        xfer, clean = _files_transfer(agent, tmp_path, "WRITE",
                                      (os.O_RDWR, os.O_RDONLY, os.O_RDWR), memory)
        assert agent.transfer(xfer) == "PROC"
        interrupt = Interrupt(at)
        try:
            interrupt.run(agent.check_xfer_state, xfer)
        except KeyboardInterrupt:
            assert (tmp_path / "0").read_bytes() == b"f" * 16, f"put back (point {at})"
            assert agent.running_transfers() == 1
        except FakeNixlError:
            assert not interrupt.fired
            assert (tmp_path / "0").read_bytes() == b"M" * 16
            clean()
            break
        with pytest.raises(FakeNixlError, match="NIXL_ERR_BACKEND"):
            agent.check_xfer_state(xfer)
        assert (tmp_path / "0").read_bytes() == b"M" * 16
        clean()
        at += 1
    assert at > 3, "the check was interrupted at several points"



def test_the_fake_agent_fails_calls_at_random_the_same_way_for_a_seed() -> None:
    """FaultyAgent had chaos(); the fake had it only as agent.faults.chaos."""
    def run(seed: int) -> list[tuple[int, bool]]:
        from kvfsm.tiers import ObjectStoreTier  # noqa: PLC0415

        agent = FakeNixlAgent(name=f"chaos-{seed}")
        tier = ObjectStoreTier(torch.zeros(8, 16), agent=agent)
        agent.chaos(0.3, seed=seed)  # (once the tier registered its cache)
        for job_id in range(8):
            tier.submit_store(TransferJob(job_id, [f"k{job_id}"], [job_id]))
        tier.drain_jobs(timeout=10)
        results = sorted((r.job_id, r.success) for r in tier.get_finished_jobs())
        tier.shutdown(timeout=5)
        return results

    first = run(7)
    assert first == run(7), "one seed, one run"
    assert not all(success for _, success in first), "some calls failed"


@pytest.mark.parametrize(("options", "message"), [
    ({"max_stall": 0}, r"chaos: max_stall must be an int >= 1 \(polls\), got 0"),
    ({"max_stall": 2.5}, "chaos: max_stall must be an int >= 1"),
    ({"rate": "0.5"}, r"rates must be numbers in \[0, 1\] .* got \{.*'transfer': '0.5'"),
    ({"rate": {"check_xfer_state": "0.5"}}, r"got \{'check_xfer_state': '0.5'\}"),
    ({"rate": {"check_xfer_state": float("nan")}}, r"got \{'check_xfer_state': nan\}"),
    ({"rate": True}, "rates must be numbers"),
    ({"rate": {"no_such_call": 0.5}}, r"got \{'no_such_call': 0.5\}"),
])
def test_chaos_refuses_a_bad_rate_or_stall_at_once_naming_it(
    options: dict[str, Any], message: str,
) -> None:
    """A stall of 0 polls used to be taken, and to raise inside a later state check (a
    FaultyAgent then had the tier release a transfer that may still run); a rate given as text
    failed with a TypeError naming nothing. Both are refused when chaos is asked for, and the
    agent goes on without chaos."""
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(torch.zeros(4, 16), agent=agent)
    with pytest.raises(ValueError, match=message):
        agent.chaos(options.pop("rate", 0.5), seed=1, **options)
    tier.submit_store(TransferJob(1, ["k"], [0]))
    tier.drain_jobs(timeout=5)
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    tier.shutdown(timeout=5)


@pytest.mark.parametrize("objects", [[], "bucket", 5])
def test_a_fake_agent_refuses_objects_that_are_no_store_of_named_bytes(objects: Any) -> None:
    with pytest.raises(ValueError, match=f"objects must be a dict of object names to bytes .* "
                                         f"got {type(objects).__name__}"):
        FakeNixlAgent(objects=objects)
