"""A tier, a manager or a machine given an argument of the wrong kind refuses it at once, naming
the argument and what it got, and nothing is made: no agent call, no directory, no half-built
object (each of these once surfaced as an AttributeError or TypeError from deep inside)."""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.verify_lifecycle import VERIFY_MACHINE
from kvfsm import TRANSFER_MACHINE, DeclarationError
from kvfsm.peer import PeerReceiver, PeerSender
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent
from kvfsm.tiering import CPUPrimaryTier, TieringInputError, TieringManager
from kvfsm.tiers import FileTier, ObjectStoreTier

pytestmark = pytest.mark.timeout(60)


def cache() -> torch.Tensor:
    return torch.zeros(4, 64, dtype=torch.uint8)


@pytest.mark.parametrize(("options", "message"), [
    ({"policy": {"max_seconds": 5}},
     r"policy must be a kvfsm.policy.RetryPolicy, got dict \{'max_seconds': 5\}"),
    ({"machine": "verify"}, "machine must be a kvfsm Declaration .*, got str 'verify'"),
    ({"steps": ["checksums"]}, r"steps must be a dict of effect names to step functions, "
                               r"got list \['checksums'\]"),
    ({"machine": VERIFY_MACHINE, "steps": {"verify": 3}},
     r"steps\['verify'\] must be a function \(step\(transfer, primary\) -> its answer\), "
     r"got int 3"),
    ({"capacity_bytes": -1}, "capacity_bytes"),  # its own value first, not the missing remove=
])
def test_an_object_store_tier_names_the_argument_of_the_wrong_kind(
    options: dict[str, Any], message: str
) -> None:
    agent = FakeNixlAgent("wrong-kind")
    with pytest.raises(ValueError, match=message):
        ObjectStoreTier(cache(), agent=agent, **options)
    assert agent.calls == [], "nothing was asked of NIXL"
    agent.close()


@pytest.mark.parametrize(("agent", "message"), [
    ("nixl", r"agent must be a NIXL agent \(nixl_agent, or kvfsm.testing.FakeNixlAgent\), got "
             r"str 'nixl', which has no register_memory, prep_xfer_dlist"),
    (object(), "agent must be a NIXL agent .*, got object"),
])
def test_a_tier_given_something_else_than_an_agent_says_what_it_lacks(
    agent: Any, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=message):
        ObjectStoreTier(cache(), agent=agent)
    with pytest.raises(ValueError, match=message):
        FileTier(cache(), tmp_path / "blocks", agent=agent)
    assert not (tmp_path / "blocks").exists(), "no directory was made"


def test_a_file_tier_without_nixl_installed_says_so_and_makes_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without NIXL (its module cannot be imported), a FileTier that would make its own agent
    is refused saying how to install it, before its root is made."""
    from kvfsm.nixl_agents import NixlUnavailable  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, "nixl_cu12", None)  # what an import finds without NIXL
    with pytest.raises(NixlUnavailable, match=r"NIXL is not installed: pip install --no-deps "
                                              r"nixl-cu12==1.5.1"):
        FileTier(cache(), tmp_path / "blocks")
    assert not (tmp_path / "blocks").exists(), "no directory was made"


def test_a_probe_agent_without_queries_is_refused() -> None:
    agent = FakeNixlAgent("probed")
    with pytest.raises(ValueError, match="probe_agent must be a NIXL agent with the OBJ backend "
                                         r"\(it asks query_memory\), got str 'probe'"):
        ObjectStoreTier(cache(), agent=agent, probe_agent="probe")
    assert agent.calls == []
    agent.close()


@pytest.mark.parametrize("root", [None, "", 3])
def test_a_file_tier_root_that_is_not_a_path_is_refused(root: Any) -> None:
    agent = FakeNixlAgent("rootless")
    with pytest.raises(ValueError, match=f"root must be a directory's path, got {root!r}"):
        FileTier(cache(), root, agent=agent)
    assert agent.calls == []
    agent.close()


def test_a_manager_given_one_tier_instead_of_a_list_says_so() -> None:
    primary = CPUPrimaryTier(4, 64, torch.uint8)
    agent = FakeNixlAgent("single")
    tier = ObjectStoreTier(primary.cache, agent=agent)
    with pytest.raises(TieringInputError, match="secondaries must be a list of tiers or a dict "
                                                "of names to tiers, got ObjectStoreTier"):
        TieringManager(primary, tier)  # type: ignore[arg-type]
    manager = TieringManager(primary, collections.deque([tier]))  # any sequence is one
    assert list(manager.tiers) == ["ObjectStoreTier[0]"]
    manager.shutdown(timeout=5)
    agent.close()


@pytest.mark.parametrize("field", ["states", "running", "final", "failure_states",
                                   "unreachable"])
def test_a_machine_extended_with_one_name_instead_of_a_list_says_so(field: str) -> None:
    """A str is iterable: "VERIFYING" was taken as the states V, E, R, I..."""
    with pytest.raises(DeclarationError, match=f"verify: {field} must be a list of state "
                                               "names, got 'VERIFYING'; write \\['VERIFYING'\\]"):
        TRANSFER_MACHINE.extend("verify", **{field: "VERIFYING"})


def test_a_policy_of_the_right_kind_is_taken() -> None:
    agent = FakeNixlAgent("right-kind")
    tier = ObjectStoreTier(cache(), agent=agent, policy=RetryPolicy(max_seconds=5))
    assert tier.policy.max_seconds == 5
    tier.shutdown()
    agent.close()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("io_threads", "4", r"StoreConfig.io_threads must be an int of at least 1 or None, got '4'"),
    ("io_threads", 2.5, r"StoreConfig.io_threads must be an int of at least 1 or None, got 2.5"),
    ("io_threads", 0, r"StoreConfig.io_threads must be an int of at least 1 or None, got 0"),
    ("region", None, r"StoreConfig.region must be a str, got None"),
    ("use_virtual_addressing", "false",
     r"StoreConfig.use_virtual_addressing must be True or False, got 'false'"),
    ("endpoint", 9000, r"StoreConfig.endpoint must be a str or None, got 9000"),
    ("endpoint", "http://[::1", r"StoreConfig.endpoint must be http\(s\)://host\[:port\], got "
     r"'http://\[::1' \(Invalid IPv6 URL\)"),  # (urllib's error, naming nothing)
    ("endpoint", "http://h:99999", r"StoreConfig.endpoint .*, got 'http://h:99999' \(Port out"),
    ("key_prefix", None, r"StoreConfig.key_prefix must be a str, got None"),
])
def test_a_store_config_from_a_configuration_file_names_the_field_of_the_wrong_type(
        field: str, value: Any, message: str) -> None:
    """Such values reached NIXL: a TypeError comparing str with int, a bare NIXL_ERR_BACKEND,
    createBackend's incompatible arguments, or "false" taken as true (virtual addressing on,
    and the bucket's host name not found)."""
    from kvfsm.nixl_agents import StoreConfig  # noqa: PLC0415

    with pytest.raises(ValueError, match=message):
        StoreConfig("bucket", **{field: value})


def test_a_faulty_agent_wraps_only_an_agent() -> None:
    """FaultyAgent(None) raised AttributeError: 'NoneType' object has no attribute 'name'."""
    from kvfsm.testing import FaultyAgent  # noqa: PLC0415

    for wrong in (None, "agent", FakeNixlAgent):
        with pytest.raises(ValueError, match=r"FaultyAgent wraps a NIXL agent \(a nixl_agent "
                                             r"with a name and its calls\), got "):
            FaultyAgent(wrong)
    assert FaultyAgent(FakeNixlAgent(name="wrapped")).name == "wrapped"


def test_an_object_store_tier_given_a_buckets_name_for_its_store_says_what_a_store_is() -> None:
    """``store=`` takes a StoreConfig; its bucket's name alone is named as the mistake,
    with or without an agent, before anything reads it."""
    for options in ({}, {"agent": FakeNixlAgent()}):
        with pytest.raises(ValueError, match="store must be a kvfsm.nixl_agents.StoreConfig "
                                             r"\(the bucket, its endpoint and credentials\), "
                                             "got str 'my-bucket'"):
            ObjectStoreTier(cache(), store="my-bucket", **options)


def test_a_peer_sender_or_receiver_given_something_else_than_an_agent_says_what_it_lacks(
) -> None:
    with pytest.raises(ValueError, match=r"agent must be a NIXL agent .*got str 'x', which "
                                         r"has no register_memory"):
        PeerSender(cache(), agent="x")
    with pytest.raises(ValueError, match=r"agent must be a NIXL agent .*got NoneType None, "
                                         r"which has no register_memory, deregister_memory, "
                                         r"get_new_notifs"):
        PeerReceiver(cache(), agent=None)


@pytest.mark.parametrize(("options", "message"), [
    ({"dtype": "float16"}, "dtype must be a torch.dtype .*got str 'float16'"),
    ({"dtype": torch.uint8, "pin_memory": "no"},
     "pin_memory must be True, False or None, got 'no'"),
])
def test_a_primary_tier_names_a_dtype_or_pin_memory_of_the_wrong_kind(
        options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CPUPrimaryTier(4, 8, **options)


def test_record_events_is_true_or_false() -> None:
    with pytest.raises(ValueError, match="record_events must be True or False, got 'yes'"):
        ObjectStoreTier(cache(), agent=FakeNixlAgent(), capacity_bytes=4 * 64,
                        remove=lambda names: 0, record_events="yes")  # type: ignore[arg-type]
