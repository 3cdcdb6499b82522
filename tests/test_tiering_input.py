"""Bad input to the tiering manager and its primary tier changes nothing (issue 13).

Each call given bad input raises a ``ValueError`` naming what was wrong, before any block is
evicted, allocated or pinned, before a job id is used and before a tier sees a job. The stories
run on an object-store tier and a file tier, both on fake NIXL agents (the fake has no FILE
backend, so the file tier's transfers fail; no story here needs one to succeed), and on a
user's own tier for what only a user's tier can report.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm import JobResult, TransferJob
from kvfsm.testing import FakeNixlAgent, Raise
from kvfsm.tiering import (
    BookkeepingError,
    CPUPrimaryTier,
    ManagerClosedError,
    PrimaryTierError,
    TieringDrainTimeout,
    TieringInputError,
    TieringManager,
    TierInputRefusedError,
    TierSubmitError,
)
from kvfsm.tiers import FileTier, InvalidJobError, Lookup, ObjectStoreTier

from .test_tiering import DictTier, ScriptedPolls  # a user's own tiers, no remote_name

BLOCK_BYTES = 256
#: a key and a bytes key with the same text: two keys to the primary, one block to a tier
ALIKE = ("6b", b"k")
#: a str no file or object name can hold (a lone surrogate has no UTF-8)
UNNAMEABLE = "\ud800"


@dataclass
class Stack:
    """A full primary tier, and a manager over an object-store tier and a file tier."""

    primary: CPUPrimaryTier
    manager: TieringManager
    tiers: dict[str, ObjectStoreTier | FileTier]
    agents: dict[str, FakeNixlAgent]
    root: Path

    def snapshot(self) -> tuple[object, ...]:
        """Everything observable: the primary's books, the manager's jobs, what NIXL saw."""
        primary, blocks = self.primary, range(self.primary.num_blocks)
        return (tuple(primary.pin_count(b) for b in blocks),
                tuple(primary.key_of(b) for b in blocks), tuple(primary.evictable()),
                primary.stats(), self.manager.outstanding(), self.manager.stats(),
                self.manager.has_pending_work(), self.manager.closed,
                {name: list(agent.calls) for name, agent in self.agents.items()},
                {name: tier.unpublished() for name, tier in self.tiers.items()},
                sorted(path.name for path in self.root.iterdir()))

    def close(self) -> None:
        self.manager.shutdown(timeout=5)
        for agent in self.agents.values():
            assert agent.misuses == [], agent.misuses
            assert agent.live_xfer_handles() == 0
            agent.close()
        assert self.primary.stats()["pinned"] == 0


def ready(primary: CPUPrimaryTier, *keys: str | bytes) -> list[int]:
    blocks = primary.allocate(list(keys))
    primary.complete_write(blocks, success=True)
    return blocks


def fill(primary: CPUPrimaryTier) -> None:
    """Make every free block ready with a key of its own: a load then has to evict."""
    ready(primary, *(f"filler{i}" for i in range(primary.free_blocks)))
    assert primary.free_blocks == 0


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """Seven blocks: "a", the two ALIKE keys and UNNAMEABLE ready (evictable), "w" being
    written, "p" pinned by the engine, and one free."""
    primary = CPUPrimaryTier(7, BLOCK_BYTES, torch.uint8)
    agents = {name: FakeNixlAgent(f"{name}-agent") for name in ("objects", "files")}
    probe = FakeNixlAgent("objects-probe", objects=agents["objects"].objects)
    tiers: dict[str, ObjectStoreTier | FileTier] = {
        "objects": ObjectStoreTier(primary.cache, agent=agents["objects"], probe_agent=probe),
        "files": FileTier(primary.cache, tmp_path / "blocks", agent=agents["files"]),
    }
    ready(primary, "a", *ALIKE, UNNAMEABLE)
    (writing,) = primary.allocate(["w"])
    (pinned,) = ready(primary, "p")
    primary.pin([pinned])
    assert primary.free_blocks == 1
    made = Stack(primary, TieringManager(primary, tiers), tiers, agents, tmp_path / "blocks")
    yield made
    primary.complete_read([pinned])
    primary.complete_write([writing], success=False)
    made.close()
    probe.close()


def block(stack: Stack, key: str | bytes) -> int:
    found = stack.primary.block_of(key)
    assert found is not None
    return found


# -- loads and stores a tier would refuse: refused before anything changes ------------------------

@pytest.mark.parametrize(("keys", "tier", "message"), [
    # the fuzzer's find: the tier saw one block twice, after two ready blocks were evicted
    (list(ALIKE), "objects",
     r"keys\[0\] = '6b' and keys\[1\] = b'k' name the same block '256-bytes/6b' in tier "
     "'objects'"),
    (["x", *ALIKE], "files",
     r"keys\[1\] = '6b' and keys\[2\] = b'k' name the same block '6b' in tier 'files'"),
    (list(ALIKE), None, "name the same block '256-bytes/6b' in tier 'objects'"),
    ([UNNAMEABLE], "files",
     r"tier 'files' cannot name keys\[0\] = '\\ud800': key '\\ud800' holds a lone "
     "surrogate at position 0"),
    (["x", UNNAMEABLE], None, r"tier 'objects' cannot name keys\[1\] = '\\ud800'"),
], ids=["alike from objects", "alike from files", "alike from any", "unnameable from files",
        "unnameable from any"])
def test_a_load_a_tier_would_refuse_evicts_nothing_and_names_tier_and_keys(
    stack: Stack, keys: list[str | bytes], tier: str | None, message: str
) -> None:
    stack.primary.free([block(stack, key) for key in (*ALIKE, UNNAMEABLE)])  # the keys are new
    fill(stack.primary)
    before = stack.snapshot()
    with pytest.raises(TieringInputError, match=message):
        stack.manager.load(keys, tier=tier)
    assert stack.snapshot() == before
    assert stack.primary.stats()["evictions"] == 0


@pytest.mark.timeout(30)
def test_a_key_of_the_other_kind_is_refused_in_any_later_call_where_tiers_name_bytes_in_hex(
    stack: Stack,
) -> None:
    """The engine stores "6b", a str key: the object tier writes it under the name 6b. Later it
    offers b"k", a bytes key the primary holds apart from "6b", which the tiers name as "6b"
    too: stored, it would overwrite "6b"'s copy, and a load of "6b" would then publish b"k"'s
    bytes as a success. So once the manager stored hex str keys it refuses bytes keys, in a
    store, a lookup, a load and a find, and nothing changes; a str key that is no hex goes on."""
    primary = stack.primary
    objects_job, _ = stack.manager.store([block(stack, "6b")])
    assert [r.success for r in stack.manager.drain(5) if r.job_id == objects_job] == [True]
    before = stack.snapshot()
    refusal = (r"keys\[0\] = b'k' would share blocks with the hex str keys of its length it "
               r"stored or loaded before: tier 'objects' names a bytes key as the str key of its "
               r"hex \(b'k' as '6b'\)")
    with pytest.raises(TieringInputError, match=refusal):
        stack.manager.store([block(stack, b"k")])
    with pytest.raises(TieringInputError, match=refusal):
        stack.manager.lookup(b"k")
    primary.free([block(stack, b"k")])
    after_free = stack.snapshot()
    with pytest.raises(TieringInputError, match=refusal):
        stack.manager.load([b"k"])
    assert stack.snapshot() == after_free != before
    with pytest.raises(TieringInputError, match=r"keys\[1\] = b'y' would share blocks with "
                                                r"the hex str keys of its length it stored"):
        stack.manager.find(["x", b"y"])
    assert stack.manager.find(["x", b"yz"]) is None, "2 bytes: no hex str key of 2 was stored"
    with pytest.raises(TieringInputError, match=r"keys\[1\] = b'y' would share blocks with "
                                                r"keys\[0\] = '00'"):
        stack.manager.find(["00", b"y"])
    assert stack.manager.lookup("6b") is Lookup.HIT  # str keys go on as before
    assert stack.manager.find(["x"]) is None


@pytest.mark.timeout(30)
def test_keys_of_both_kinds_are_taken_where_they_cannot_share_a_name() -> None:
    """A tier of the user's own that keeps keys apart by value (no remote_name) may take str
    and bytes keys alike; so may a manager over it. Over a tier that names bytes in hex, a
    manager that stored bytes keys refuses a str key that is hex, and takes one that is not;
    a lookup only asks, and sets no kind."""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    mine = DictTier(primary.cache)
    manager = TieringManager(primary, {"mine": mine})
    blocks = ready(primary, "6b", b"k")
    primary.cache[blocks[0]], primary.cache[blocks[1]] = 1, 2
    assert len(manager.store([blocks[0]])) == len(manager.store([blocks[1]])) == 1
    assert all(result.success for result in manager.drain(5))
    assert mine.blocks["6b"][0] == 1 and mine.blocks[b"k"][0] == 2
    manager.shutdown(timeout=5)

    agent = FakeNixlAgent("bytes-first")
    objects = ObjectStoreTier(primary.cache, agent=agent)
    manager = TieringManager(primary, {"objects": objects})
    try:
        assert manager.lookup("6b") in (Lookup.MISS, Lookup.RETRY)  # asks only: no kind
        assert len(manager.store([blocks[1]])) == 1  # b"k": bytes from now on
        with pytest.raises(TieringInputError, match=r"keys\[0\] = '6b' would share blocks with "
                                                    r"the bytes keys of its length it stored"):
            manager.store([blocks[0]])
        with pytest.raises(TieringInputError, match=r"keys\[1\] = '0a' would share blocks"):
            manager.find([b"z", "0a"])
        assert manager.lookup("hello") in (Lookup.MISS, Lookup.RETRY)  # no hex: no clash
        assert all(result.success for result in manager.drain(5))
    finally:
        manager.shutdown(timeout=5)
        agent.close()


@pytest.mark.parametrize(("keys", "message"), [
    (list(ALIKE), r"keys\[0\] = '6b' and keys\[1\] = b'k' name the same block '256-bytes/6b' "
                  "in tier 'objects'"),
    ([UNNAMEABLE], r"tier 'objects' cannot name keys\[0\] = '\\ud800'"),
], ids=["alike", "unnameable"])
def test_a_store_a_tier_would_refuse_pins_nothing_and_uses_no_job_id(
    stack: Stack, keys: list[str | bytes], message: str
) -> None:
    before = stack.snapshot()
    with pytest.raises(TieringInputError, match=message):
        stack.manager.store([block(stack, key) for key in keys])
    assert stack.snapshot() == before
    assert stack.agents["objects"].call_count("transfer") == 0
    assert stack.manager.store([block(stack, "a")]) == [1, 2], "job ids 1 and 2 are unused"


# -- a tier refusing a job as malformed all the same ----------------------------------------------

def test_a_load_the_tier_refuses_as_malformed_frees_its_block_and_is_a_value_error(
    stack: Stack,
) -> None:
    """What the manager cannot check: its job id is one a user already gave the tier."""
    primary, objects = stack.primary, stack.tiers["objects"]
    objects.submit_store(TransferJob(1, ["theirs"], [block(stack, "p")]))
    before = stack.snapshot()

    with pytest.raises(TierInputRefusedError, match=r"tier 'objects' refused job 1: "
                                                    "InvalidJobError: job 1 is already in "
                                                    "flight") as raised:
        stack.manager.load(["x"], tier="objects")
    assert isinstance(raised.value, ValueError)
    assert isinstance(raised.value, TierSubmitError)
    assert isinstance(raised.value.__cause__, InvalidJobError)
    assert raised.value.submitted == ()
    assert stack.snapshot() == before, "the block is free again, no job is outstanding"
    assert primary.block_of("x") is None

    objects.drain_jobs(timeout=5)  # the user's job, collected by the user
    assert [r.job_id for r in objects.get_finished_jobs()] == [1]
    assert not stack.manager.has_pending_work()


def test_a_store_every_tier_refuses_as_malformed_drops_its_pins_and_is_a_value_error(
    tmp_path: Path,
) -> None:
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    agents = [FakeNixlAgent(f"agent-{i}") for i in range(2)]
    tiers = {name: ObjectStoreTier(primary.cache, agent=agent)
             for name, agent in zip(("first", "second"), agents, strict=True)}
    manager = TieringManager(primary, tiers)
    mine, theirs = ready(primary, "k0", "theirs")
    tiers["first"].submit_store(TransferJob(1, ["theirs"], [theirs]))  # the ids the manager
    tiers["second"].submit_store(TransferJob(2, ["theirs"], [theirs]))  # gives its two jobs

    with pytest.raises(TierInputRefusedError, match=r"(?s)tier 'first' refused job 1: "
                                                    r"InvalidJobError.*tier 'second' refused "
                                                    "job 2: InvalidJobError") as raised:
        manager.store([mine])
    assert isinstance(raised.value, ValueError)
    assert raised.value.submitted == ()
    assert primary.pin_count(mine) == 0
    assert manager.outstanding() == []

    for tier in tiers.values():  # the user's jobs, collected by the user
        tier.drain_jobs(timeout=5)
        assert len(tier.get_finished_jobs()) == 1

    # one tier taking its job is a change no error can take back: a plain TierSubmitError
    tiers["second"].submit_store(TransferJob(4, ["theirs"], [theirs]))
    with pytest.raises(TierSubmitError, match="tier 'second' refused job 4") as partial:
        manager.store([mine])
    assert not isinstance(partial.value, ValueError)
    assert partial.value.submitted == (3,)
    assert primary.pin_count(mine) == 1, "only the first tier's pin"
    tiers["second"].drain_jobs(timeout=5)
    assert len(tiers["second"].get_finished_jobs()) == 1
    assert [(done.job_id, done.success) for done in manager.drain(timeout=5)] == [(3, True)]
    assert primary.pin_count(mine) == 0
    manager.shutdown(timeout=5)
    for agent in agents:
        assert agent.misuses == []
        agent.close()


# -- the other calls ------------------------------------------------------------------------------

@pytest.mark.parametrize(("call", "message"), [
    (lambda m: m.find([]), "find needs at least one key"),  # was "found" in the first tier
    (lambda m: m.find("ab"), "find: keys must be a list or tuple, got str 'ab'"),
    (lambda m: m.find(["x", 7]), r"find: keys\[1\] must be a non-empty str or bytes, got 7"),
    (lambda m: m.find([UNNAMEABLE]), r"tier 'objects' cannot name keys\[0\]"),
    (lambda m: m.lookup(3), "lookup: a key must be a non-empty str or bytes, got 3"),
    (lambda m: m.lookup([1]), r"lookup: a key must be a non-empty str or bytes, got \[1\]"),
    (lambda m: m.lookup(b""), "lookup: a key must be a non-empty str or bytes, got b''"),
    (lambda m: m.lookup(UNNAMEABLE), r"tier 'objects' cannot name keys\[0\] = '\\ud800'"),
    (lambda m: m.load(["x"], tier=["objects"]), r"no tier named \['objects'\]"),
    (lambda m: m.drain(timeout="soon"), "timeout must be a number of seconds >= 0, got 'soon'"),
    (lambda m: m.drain(timeout=math.nan), "got nan"),  # would never time out
    (lambda m: m.drain(timeout=-1), "got -1"),
    (lambda m: m.drain(timeout=True), "got True"),
    (lambda m: m.shutdown(timeout="soon"), "got 'soon'"),
])
def test_bad_input_to_any_manager_call_is_a_tiering_input_error_and_changes_nothing(
    stack: Stack, call: Callable[[TieringManager], object], message: str
) -> None:
    before = stack.snapshot()
    with pytest.raises(TieringInputError, match=message):
        call(stack.manager)
    assert stack.snapshot() == before


@pytest.mark.parametrize("poll_interval", [-0.001, math.nan, "fast", True, None, math.inf,
                                           9.2e9, 1e300, 10**400])
def test_a_manager_takes_only_a_poll_interval_time_sleep_takes(
    poll_interval: Any, tmp_path: Path
) -> None:
    """Else drain would raise from ``time.sleep`` after a step, losing the jobs it finalized
    (1e300 was taken, and an int past a float's range raised a bare OverflowError)."""
    primary = CPUPrimaryTier(2, BLOCK_BYTES, torch.uint8)
    with pytest.raises(TieringInputError, match="poll_interval must be a finite number of "
                                                "seconds >= 0"):
        TieringManager(primary, [DictTier(primary.cache)], poll_interval=poll_interval)


# -- what a tier reports --------------------------------------------------------------------------

def test_a_result_whose_job_id_is_true_finalizes_no_job() -> None:
    """``True == 1`` and hashes alike: a dict lookup would take it for job 1."""
    primary = CPUPrimaryTier(2, BLOCK_BYTES, torch.uint8)
    tier = DictTier(primary.cache)
    manager = TieringManager(primary, {"mine": tier})
    (stored,) = ready(primary, "k0")
    assert manager.store([stored]) == [1]
    tier.pending = [JobResult(True, True)]  # type: ignore[arg-type]

    with pytest.raises(BookkeepingError, match="job_id=True") as raised:
        manager.step()
    assert raised.value.finalized == ()
    assert [job.job_id for job in manager.outstanding()] == [1]
    assert primary.pin_count(stored) == 1, "job 1 still reads its block"

    tier.pending = [JobResult(1, True)]
    assert [done.job_id for done in manager.step()] == [1]
    assert primary.pin_count(stored) == 0


@pytest.mark.parametrize("result", [SimpleNamespace(job_id=1), JobResult(1, "False")],
                         ids=["no success", "success 'False'"])
def test_a_result_without_a_bool_success_finalizes_its_job_as_failed(result: object) -> None:
    """A missing ``success`` raised from step with the job already forgotten (its block loaded
    for ever); a truthy ``"False"`` published a failed load's block as ready."""
    primary = CPUPrimaryTier(2, BLOCK_BYTES, torch.uint8)
    tier = DictTier(primary.cache)
    tier.blocks["k0"] = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
    manager = TieringManager(primary, {"mine": tier})
    assert manager.load(["k0"]) == 1
    (loading,) = [job.job.block_ids[0] for job in manager.outstanding()]
    tier.pending = [result]  # type: ignore[list-item]

    with pytest.raises(BookkeepingError, match=r"job 1 from tier 'mine': .* not a bool; "
                                               "finalized as failed") as raised:
        manager.step()
    assert [(done.job_id, done.success) for done in raised.value.finalized] == [(1, False)]
    assert manager.outstanding() == []
    assert primary.key_of(loading) is None, "the failed load's block is free"
    assert manager.stats()["loads_failed"] == 1
    assert not manager.has_pending_work()


# -- the primary tier -----------------------------------------------------------------------------

@pytest.mark.parametrize(("operation", "message"), [
    (lambda p, b: p.complete_write([b], "False"), "success must be a bool, got str 'False'"),
    (lambda p, b: p.complete_write([b], None), "success must be a bool, got NoneType None"),
    (lambda p, b: p.block_of([1]), r"a key must be a non-empty str or bytes, got \[1\]"),
    (lambda p, b: p.block_of(""), "a key must be a non-empty str or bytes, got ''"),
])
def test_bad_input_to_the_primary_is_a_primary_tier_error_and_changes_nothing(
    operation: Callable[[CPUPrimaryTier, int], object], message: str
) -> None:
    primary = CPUPrimaryTier(2, BLOCK_BYTES, torch.uint8)
    (writing,) = primary.allocate(["w"])
    before = primary.stats(), primary.pin_count(writing), primary.key_of(writing)
    with pytest.raises(PrimaryTierError, match=message):
        operation(primary, writing)
    assert (primary.stats(), primary.pin_count(writing), primary.key_of(writing)) == before


# -- any bad input, at random ---------------------------------------------------------------------

#: keys no primary block holds, each good alone
FRESH = ("x0", "x1", b"x2", "x3")


@st.composite
def bad_loads(draw: st.DrawFn) -> tuple[object, object]:
    """``(keys, tier)`` of a load with at least one thing wrong."""
    keys: list[object] = list(draw(st.lists(st.sampled_from(FRESH), unique=True, max_size=3)))
    tier: object = draw(st.sampled_from([None, "objects", "files"]))
    wrong = draw(st.sampled_from(["held", "malformed", "alike", "unnameable", "repeated",
                                  "tier", "not a list", "empty"]))
    if wrong == "not a list":
        return draw(st.sampled_from(["x0", b"x0", 3, None, {"x0"}])), tier
    if wrong == "empty":
        return draw(st.sampled_from([[], ()])), tier
    if wrong == "tier":
        return keys or ["x0"], draw(st.sampled_from(["nope", ["objects"], 3, b"objects", ""]))
    if wrong == "held":
        poison = [draw(st.sampled_from(["a", "w", "p", *ALIKE, UNNAMEABLE]))]
    elif wrong == "malformed":
        poison = [draw(st.sampled_from(["", b"", 7, None, 1.5, True, ["x"]]))]
    elif wrong == "alike":
        poison = list(draw(st.permutations([b"y".hex(), b"y"])))
    elif wrong == "unnameable":
        poison, tier = [UNNAMEABLE + "x"], draw(st.sampled_from([None, "files"]))
    elif keys:  # repeated: one of them again
        poison = [draw(st.sampled_from(keys))]
    else:
        poison = ["x0", "x0"]
    at = draw(st.integers(0, len(keys)))
    return keys[:at] + poison + keys[at:], tier


@st.composite
def bad_stores(draw: st.DrawFn) -> object:
    """Block ids for a store with at least one thing wrong (by key, resolved in the test)."""
    good = list(draw(st.lists(st.sampled_from(["a", "p"]), unique=True, max_size=2)))
    wrong = draw(st.sampled_from(["id", "state", "repeated", "alike", "unnameable",
                                  "not a list"]))
    if wrong == "not a list":
        return draw(st.sampled_from([0, "0", None, b"\x00", iter([0])]))
    if wrong == "id":
        poison: list[object] = [draw(st.sampled_from([6, -1, 99, True, 1.0, "0", None]))]
    elif wrong == "state":
        poison = [draw(st.sampled_from([("key", "w"), "free"]))]  # being written; free
    elif wrong == "repeated":
        poison = [("key", draw(st.sampled_from(["a", "p", *ALIKE])))] * 2
    elif wrong == "alike":
        poison = [("key", key) for key in draw(st.permutations(list(ALIKE)))]
    else:
        poison = [("key", UNNAMEABLE)]
    ids: list[object] = [("key", key) for key in good]
    at = draw(st.integers(0, len(ids)))
    return ids[:at] + poison + ids[at:]


def test_random_bad_input_changes_nothing_and_is_a_value_error(stack: Stack) -> None:
    """A load of one key would take the free block, of more keys evict too; a store would pin."""
    manager = stack.manager
    (free,) = [b for b in range(stack.primary.num_blocks) if stack.primary.key_of(b) is None]
    before = stack.snapshot()

    def resolve(ids: object) -> object:
        """The block ids of a drawn store: ``("key", k)`` is the block holding ``k``."""
        if not isinstance(ids, list):
            return ids
        return [block(stack, item[1]) if isinstance(item, tuple)
                else free if item == "free" else item for item in ids]

    @settings(max_examples=200, deadline=None, database=None)
    @given(st.one_of(
        bad_loads().map(lambda kt: ("load", kt)),
        bad_stores().map(lambda ids: ("store", ids)),
        st.sampled_from([[], "ab", [None], [UNNAMEABLE]]).map(lambda keys: ("find", keys)),
        st.sampled_from([3, None, "", b"", [1], UNNAMEABLE]).map(lambda key: ("lookup", key)),
        st.sampled_from([-1, math.nan, "1", True]).map(lambda t: ("drain", t)),
    ))
    def bad_call(request: tuple[str, Any]) -> None:
        call, argument = request
        with pytest.raises(ValueError) as raised:
            if call == "load":
                manager.load(argument[0], tier=argument[1])
            elif call == "store":
                manager.store(resolve(argument))  # type: ignore[arg-type]
            elif call == "find":
                manager.find(argument)
            elif call == "lookup":
                manager.lookup(argument)
            else:
                manager.drain(timeout=argument)
        assert isinstance(raised.value, TieringInputError | PrimaryTierError), raised.value
        assert not isinstance(raised.value, TierSubmitError), "no tier saw a job"
        assert stack.snapshot() == before, (request, raised.value)

    bad_call()
    assert stack.primary.stats()["evictions"] == 0
    assert manager.store([block(stack, "a")]) == [1, 2], "no job id was used"


@pytest.mark.timeout(30)
def test_a_call_that_changes_nothing_leaves_the_kinds_of_keys_free(stack: Stack) -> None:
    """A load that found no tier holding its key, or a store every tier refused, recorded its
    keys' kinds all the same: a later bytes key was refused as sharing blocks with hex str
    keys the manager "stored or loaded before", which it never had."""
    assert stack.manager.load(["6c"]) is None  # no tier holds it: nothing changed
    (k_block,) = ready(stack.primary, b"l")  # b"l" is named "6c": free to store now
    done = stack.manager.store([k_block])
    assert len(done) == 2
    assert all(r.success for r in stack.manager.drain(5))


class HandsOutThenFails:
    """A user's tier whose get_finished_jobs is a generator that raises after its first
    result (the OffloadTier protocol takes any iterable)."""

    def __init__(self, inner: DictTier) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_finished_jobs(self) -> Iterator[JobResult]:
        results = self.inner.get_finished_jobs()
        yield from results[:1]
        self.inner.pending[:0] = results[1:]
        raise OSError("the tier's poll broke")


@pytest.mark.timeout(30)
def test_results_a_tier_handed_out_before_its_poll_raised_are_finalized() -> None:
    """A generator's results were collected with list(): the one yielded before it raised was
    thrown away, its job never finalized, its block pinned for good."""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    tier = HandsOutThenFails(DictTier(primary.cache))
    manager = TieringManager(primary, {"gen": tier})
    a, b = ready(primary, "a", "b")
    first, second = manager.store([a]) + manager.store([b])
    with pytest.raises(BookkeepingError, match=r"get_finished_jobs raised OSError: the tier's "
                                               r"poll broke") as raised:
        manager.step()
    assert [done.job.job_id for done in raised.value.finalized] == [first]
    assert primary.pin_count(a) == 0 and primary.pin_count(b) == 1
    tier.get_finished_jobs = tier.inner.get_finished_jobs  # the tier mends
    assert [done.job.job_id for done in manager.step()] == [second]
    assert primary.stats()["pinned"] == 0


@pytest.mark.timeout(30)
def test_an_interrupt_in_a_step_loses_neither_results_nor_the_jobs_it_finalized() -> None:
    """The step took every result from the tier (handed out once), then an interrupt while
    finalizing the second lost the rest: their jobs outstanding for ever, their blocks
    pinned for good, and the first job's Finalized never returned."""
    import sys  # noqa: PLC0415

    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"dict": DictTier(primary.cache)})
    blocks = ready(primary, "a", "b", "c")
    jobs = [job for block in blocks for job in manager.store([block])]
    calls = [0]

    def interrupt_the_second(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is TieringManager._finalize.__code__:
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt

    sys.settrace(interrupt_the_second)
    try:
        with pytest.raises(KeyboardInterrupt):
            manager.step()
    finally:
        sys.settrace(None)
    assert manager.outstanding() != []
    assert sorted(done.job.job_id for done in manager.step()) == jobs, "all three, once"
    assert manager.outstanding() == [] and primary.stats()["pinned"] == 0


def interrupted_at_line(line: int, function: Any, action: Callable[[], None]) -> bool:
    """Run ``action``, raising KeyboardInterrupt at the ``line``-th line event of ``function``
    or of a frame of its module it called (a comprehension of its own); True when it was
    raised. (Not in a frame of another module's code it runs: a garbage collector's callback
    that a collection starts there is no line of it.)"""
    import sys  # noqa: PLC0415

    seen = [0]
    module = function.__code__.co_filename

    def inside(frame: Any) -> bool:
        if frame.f_code.co_filename != module:
            return False
        while frame is not None:
            if frame.f_code is function.__code__:
                return True
            frame = frame.f_back
        return False

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            seen[0] += 1
            if seen[0] == line:
                raise KeyboardInterrupt
        return local

    sys.settrace(lambda frame, event, arg: local if inside(frame) else None)
    try:
        action()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


@pytest.mark.parametrize("call", ["pin", "complete_read"])
def test_a_ctrl_c_anywhere_in_a_pin_or_an_unpin_changes_every_block_or_none(call: str) -> None:
    """A Ctrl-C lands at each line in turn of pinning (or unpinning) three blocks: each
    block's count moved, or none did. (One that landed between two blocks of the loop left
    the first pinned, and the store's cascade, told the pin raised, took none of it back:
    pinned for good.)"""
    for line in range(1, 1000):
        primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
        blocks = ready(primary, "a", "b", "c")
        if call == "complete_read":
            primary.pin(blocks)
        before = [primary.pin_count(block) for block in blocks]
        function = getattr(CPUPrimaryTier, call)
        fired = interrupted_at_line(line, function, functools.partial(
            getattr(primary, call), blocks))
        after = [primary.pin_count(block) for block in blocks]
        moved = [1, 1, 1] if call == "pin" else [0, 0, 0]
        assert after in (before, moved), (line, after)
        if not fired:
            assert after == moved
            break
    assert line > 3, "the interrupts landed inside"


@pytest.mark.parametrize("entering", ["finalized", "unpin"])
def test_a_ctrl_c_as_a_store_is_finalized_loses_neither_its_pin_nor_its_job(
        entering: str) -> None:
    """A Ctrl-C lands as a store's result is finalized: as its Finalized is made (the next
    step finalizes it whole: unpinned, counted, returned), or as its block's unpin starts (the
    one window TieringManager._step names: the job is returned and counted, its block stays
    pinned, never unpinned twice). (Landing after the unpin lost the job: no step returned
    it; and, unpinned first, an unpin the interrupt cut short was made again.)"""
    from kvfsm.tiering import Finalized  # noqa: PLC0415

    from .test_interrupts import ctrl_c_entering  # noqa: PLC0415

    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"dict": DictTier(primary.cache)})
    (block,) = ready(primary, "a")
    (job,) = manager.store([block])
    function = Finalized.__init__ if entering == "finalized" else CPUPrimaryTier.complete_read
    with ctrl_c_entering(function):
        manager.step()
    assert [done.job.job_id for done in manager.step()] == [job]
    assert manager.outstanding() == [] and manager.stats()["stores_ok"] == 1
    assert primary.pin_count(block) == (0 if entering == "finalized" else 1)
    assert manager.step() == []


def test_a_ctrl_c_as_a_stores_unpin_returns_never_has_it_unpinned_twice() -> None:
    """Two tiers each store a block: it is pinned twice. A Ctrl-C lands as the first tier's
    unpin returns, its work done (a signal is checked as its last C call returns). The next
    step does not unpin it again: the second tier's store still reads the block, which stays
    pinned until that store's result; each job is returned once. (Unpinned before it was
    marked finalized, it was unpinned a second time, and the block could be evicted and
    written under the second store.)"""
    from .test_interrupts import ctrl_c_returning  # noqa: PLC0415

    class Holding(ScriptedPolls):
        """Hands nothing out while ``held``."""

        held = True

        def poll(self, number: int) -> list[JobResult]:
            return [] if self.held else super().poll(number)

    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    second = Holding(primary.cache)  # its store still reads the block
    manager = TieringManager(primary, {"first": DictTier(primary.cache), "second": second})
    (block,) = ready(primary, "a")
    jobs = manager.store([block])
    assert primary.pin_count(block) == 2
    with ctrl_c_returning(CPUPrimaryTier.complete_read):
        manager.step()
    assert [done.job.job_id for done in manager.step()] == jobs[:1]
    assert primary.pin_count(block) == 1, "unpinned twice"
    second.held = False
    assert [done.job.job_id for done in manager.step()] == jobs[1:]
    assert primary.pin_count(block) == 0 and manager.step() == []


def interrupted_at_c_return(count: int, function: Any, action: Callable[[], Any],
                            *more: Any) -> bool:
    """Run ``action``, raising KeyboardInterrupt as the ``count``-th C call made by
    ``function`` (or the ``more`` functions) returns, or Python function it calls starts
    (where a signal handler runs); True when it was raised."""
    import sys  # noqa: PLC0415

    seen = [0]
    codes = {function.__code__, *(other.__code__ for other in more)}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if (event == "c_return" and frame.f_code in codes) or (
                event == "call" and frame.f_back is not None and frame.f_back.f_code in codes):
            seen[0] += 1
            if seen[0] == count:
                sys.setprofile(None)
                raise KeyboardInterrupt

    sys.setprofile(profile)
    try:
        action()
    except KeyboardInterrupt:
        return True
    finally:
        sys.setprofile(None)
    return False


def step_into(manager: TieringManager, out: list[int], issues: list[int | None]) -> None:
    """A step: the jobs it finalized into ``out``, those of its issues into ``issues``."""
    try:
        out.extend(done.job.job_id for done in manager.step())
    except BookkeepingError as error:
        out.extend(done.job.job_id for done in error.finalized)
        issues.extend(issue.job_id for issue in error.issues)


@pytest.mark.parametrize("unpinned_behind", [False, True])
def test_a_ctrl_c_as_each_call_of_a_finalize_returns_neither_loses_nor_repeats_the_job(
        unpinned_behind: bool) -> None:
    """A Ctrl-C lands as each C call a store's finalizing makes returns, in turn; with the
    block's pin as it should be, or dropped behind the manager's back (so the unpin fails).
    Every time, the steps that follow hand the job out, once as finalized and counted so, or,
    when the unpin failed, as an issue, as finalized (a Ctrl-C before the issue was made), or
    both (one between the issue's keeping and the job's taking back), never neither; the
    block is never unpinned twice. (A Ctrl-C as the Finalized was kept left it uncounted; one
    on the failing unpin's path lost the job.)"""
    for count in range(1, 100):
        primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
        manager = TieringManager(primary, {"dict": DictTier(primary.cache)})
        (block,) = ready(primary, "a")
        (job,) = manager.store([block])
        if unpinned_behind:
            primary.complete_read([block])
        out: list[int] = []
        issues: list[int | None] = []
        step = functools.partial(step_into, manager, out, issues)
        fired = interrupted_at_c_return(count, TieringManager._finalize, step)
        for _ in range(3):
            step()
        if unpinned_behind:
            assert out + issues and {*out, *issues} == {job}, (count, out, issues)
            assert len(out) <= 1 and len(issues) <= 1, (count, out, issues)
        else:
            assert (out, issues) == ([job], []), count
        assert manager.stats()["stores_ok"] == len(out), (count, manager.stats())
        assert primary.pin_count(block) in ((0,) if unpinned_behind else (0, 1)), count
        if not fired:
            break
    assert count > 2, "the interrupts landed inside"


class OneAPollThenOdd(DictTier):
    """Hands its jobs' results out one a poll (so a drain steps, and sleeps, between them),
    and one the manager must report, once: a result for a job nobody submitted, after them
    (``"stray"``); the first result twice, in its poll (``"twice"``); or the second result
    saying success=1 (``"non-bool"``)."""

    def __init__(self, cache: torch.Tensor, odd: str) -> None:
        super().__init__(cache)
        self.due: list[JobResult] = []
        self.odd = odd
        self.handed: list[JobResult] = []
        self.extra = odd == "stray"

    def get_finished_jobs(self) -> list[JobResult]:
        self.due += super().get_finished_jobs()
        if self.due:
            result = self.due.pop(0)
            if self.odd == "non-bool" and self.handed:
                result = JobResult(result.job_id, 1)  # type: ignore[arg-type]
            self.handed.append(result)
            return [result, result] if self.odd == "twice" and len(self.handed) == 1 else [result]
        if self.extra:
            self.extra = False
            return [JobResult(999, True)]
        return []

    def has_pending_work(self) -> bool:
        return bool(self.due) or self.extra or super().has_pending_work()


def drain_into(manager: TieringManager, out: list[int], issues: list[int | None]) -> None:
    """A drain: the jobs it finalized into ``out``, those of its issues into ``issues``."""
    try:
        out.extend(done.job.job_id for done in manager.drain(5))
    except BookkeepingError as error:
        out.extend(done.job.job_id for done in error.finalized)
        issues.extend(issue.job_id for issue in error.issues)


@pytest.mark.parametrize(("odd", "reported"), [("stray", 999), ("twice", 1), ("non-bool", 2)])
def test_a_ctrl_c_as_each_call_of_a_drain_returns_loses_no_job_and_no_issue(
        odd: str, reported: int) -> None:
    """Two stores come out of a tier one a poll, and then a result the manager must report
    (one for no job, the first again, or one whose success is not a bool); a Ctrl-C lands
    as each C call of the drain, its steps and their finalizing returns, in turn (its sleeps
    between the polls included). Every time, the steps that follow hand each job out once,
    counted once, and the issue once, listed once; at most the one job of the window
    TieringManager._step names keeps its pin. (A Ctrl-C between two results a tier handed
    out lost the rest; one as the issue's error was made, or as a result left the queue
    with its issue still a local, lost the issue, and the jobs the step had finalized; one
    as the drain slept lost the jobs of its earlier steps; one as a result handed out twice
    left the queue skipped its second hand-out; one as a non-bool result's Finalized was
    kept lost its issue.)"""
    for count in range(1, 400):
        primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
        manager = TieringManager(primary, {"dict": OneAPollThenOdd(primary.cache, odd)})
        blocks = ready(primary, "a", "b")
        jobs = [job for block in blocks for job in manager.store([block])]
        out: list[int] = []
        issues: list[int | None] = []
        fired = interrupted_at_c_return(
            count, TieringManager.drain, functools.partial(drain_into, manager, out, issues),
            TieringManager._step, TieringManager._finalize)
        for _ in range(3):
            step_into(manager, out, issues)
        assert (sorted(out), issues) == (jobs, [reported]), (count, out, issues)
        assert [issue.job_id for issue in manager.bookkeeping_errors] == [reported], count
        stats = manager.stats()
        assert (stats["stores_ok"], stats["stores_failed"]) == (
            (1, 1) if odd == "non-bool" else (2, 0)), count
        assert primary.stats()["pinned"] <= 1, "more than the window's one job left pinned"
        if not fired:
            break
    assert count > 10, "the interrupts landed inside"


class GatedAgent(FakeNixlAgent):
    """A fake agent whose transfers run until the gate opens."""

    def __init__(self) -> None:
        super().__init__("gated")
        self.open = False

    def check_xfer_state(self, handle: Any) -> str:
        answer = super().check_xfer_state(handle) if self.open else "PROC"
        return answer


@pytest.mark.timeout(30)
def test_a_timeout_past_any_wait_is_no_bound_and_a_drain_timeout_names_a_busy_tier() -> None:
    """drain(10**400) and shutdown(timeout=10**400) raised a bare OverflowError, where the
    tiers take such a timeout as no bound; and a drain waiting on a tier's own job (submitted
    by another caller) timed out saying "0 job(s) without a result", naming nothing."""
    primary = CPUPrimaryTier(2, BLOCK_BYTES, torch.uint8)
    agent = GatedAgent()
    objects = ObjectStoreTier(primary.cache, agent=agent)
    manager = TieringManager(primary, {"objects": objects})
    (a,) = ready(primary, "a")
    objects.submit_store(TransferJob(900, ["own"], [a]))  # another caller's job
    with pytest.raises(TieringDrainTimeout, match=r"drain: 0 job\(s\) without a result\n  "
                                                  r"tier 'objects' has work in flight: job 900: "
                                                  r"PROCESSING, last error: None"):
        manager.drain(timeout=0.05)
    agent.open = True
    objects.drain_jobs(timeout=5)
    assert [r.job_id for r in objects.get_finished_jobs()] == [900]
    assert manager.drain(timeout=10**400) == []
    assert manager.shutdown(timeout=10**400) == [] and manager.closed
    agent.close()


class InterruptedSecondPoll(ScriptedPolls):
    """A user's tier that hands its first result out, then is interrupted in the next poll."""

    def poll(self, number: int) -> list[JobResult]:
        if number == 1:
            out, self.pending = self.pending[:1], self.pending[1:]
            return out
        if number == 2:
            raise KeyboardInterrupt  # Ctrl-C during the drain's second step
        return super().poll(number)


@pytest.mark.timeout(30)
def test_an_interrupted_drain_loses_no_job_it_finalized_and_a_result_twice_is_an_issue() -> None:
    """The jobs an interrupted drain had finalized in its earlier rounds were lost with its
    local list; and once a step had finalized a result, that same result handed out again
    passed without a word."""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    tier = InterruptedSecondPoll(primary.cache)
    manager = TieringManager(primary, {"t": tier}, poll_interval=0)
    a, b = ready(primary, "a", "b")
    first, second = manager.store([a]) + manager.store([b])
    with pytest.raises(KeyboardInterrupt):
        manager.drain()
    assert manager.has_pending_work()
    assert sorted(done.job.job_id for done in manager.drain()) == [first, second]
    (c,) = ready(primary, "c")
    (third,) = manager.store([c])
    (result,) = tier.pending
    assert [done.job.job_id for done in manager.step()] == [third]
    tier.pending.append(result)  # handed out a second time
    with pytest.raises(BookkeepingError, match=rf"job {third} from tier 't': result .* is for "
                                               r"no outstanding job"):
        manager.step()
    assert primary.stats()["pinned"] == 0


# -- a result that says NIXL may still move its blocks ---------------------------------------------

class GivesUp(DictTier):
    """A user's own tier whose every result is a failure that says ``blocks_in_use`` as
    ``said`` (and ``success`` as ``success``): given up while NIXL may still run it."""

    said: object = True
    success: object = False

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__(cache)
        #: every result it made, in order
        self.handed: list[Any] = []

    def submit_store(self, job: TransferJob) -> None:
        self.pending.append(self._result(job))

    def submit_load(self, job: TransferJob) -> None:
        self.pending.append(self._result(job))

    def _result(self, job: TransferJob) -> Any:
        result = SimpleNamespace(job_id=job.job_id, success=self.success, reason=None,
                                 blocks_in_use=self.said)
        self.handed.append(result)
        return result


@pytest.mark.parametrize(("said", "success", "problem", "held"), [
    (1, False, "blocks_in_use=1, not a bool; its blocks held for good", True),
    ("yes", False, "blocks_in_use='yes', not a bool; its blocks held for good", True),
    (True, True, "blocks_in_use=True on a success; its blocks held for good; finalized as "
     "failed", True),
    (np.True_, False, "blocks_in_use=np.True_, not a bool; its blocks held for good", True),
    (np.False_, True, "blocks_in_use=np.False_, not a bool; taken as False", False),
    (np.False_, False, "blocks_in_use=np.False_, not a bool; taken as False", False),
    (None, "False", "success='False', not a bool; blocks_in_use=None, not a bool; taken as "
     "False; finalized as failed", False),
])
def test_a_result_saying_blocks_in_use_oddly_is_read_by_its_truth_and_is_an_issue(
        said: object, success: object, problem: str, held: bool) -> None:
    """However a tier says NIXL may still move a job's blocks, they are held, the job
    finalized as failed (the safe side: held for good rather than reused under NIXL); a
    flag that is no bool is read by its truth, and the step says what was odd. (A truthy
    value other than True was read as False: a store's block unpinned, a load's freed, and
    nothing said.)"""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    tier = GivesUp(primary.cache)
    tier.said, tier.success = said, success
    tier.blocks["b"] = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
    manager = TieringManager(primary, {"mine": tier})
    (block,) = ready(primary, "a")
    stored = manager.store([block])
    loaded = manager.load(["b"])
    (loading,) = [s.job.block_ids[0] for s in manager.outstanding() if s.job.is_promotion]
    with pytest.raises(BookkeepingError) as raised:
        manager.step()
    assert [str(issue) for issue in raised.value.issues] == [
        f"job {job} from tier 'mine': result {result!r} has {problem}"
        for job, result in zip([*stored, loaded], tier.handed, strict=True)]
    ok = success is True and not held
    assert [(d.job_id, d.success, d.blocks_in_use) for d in raised.value.finalized] == [
        (stored[0], ok, held), (loaded, ok, held)]
    assert primary.pin_count(block) == (1 if held else 0)
    assert primary.pin_count(loading) == (-2 if held else 0)
    assert primary.key_of(loading) == ("b" if ok else None)
    assert manager.stats()["blocks_held"] == (2 if held else 0)
    assert not manager.has_pending_work()


def test_a_held_stores_pin_dropped_behind_the_managers_back_is_an_issue() -> None:
    """The manager keeps a held store's pin: one already dropped (the primary changed behind
    its back) is reported, as an unpin that fails is, and not counted as held. (It was counted
    held while the block could be evicted and written under NIXL.)"""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"mine": GivesUp(primary.cache)})
    (block,) = ready(primary, "a")
    (job,) = manager.store([block])
    primary.complete_read([block])
    with pytest.raises(BookkeepingError) as raised:
        manager.step()
    [issue] = raised.value.issues
    assert str(issue) == (
        f"job {job} from tier 'mine': finalizing the primary failed: block {block} is not "
        "pinned (it is ready with key 'a'); its result said blocks_in_use: NIXL may still read "
        f"its blocks [{block}]")
    assert raised.value.finalized == ()
    assert manager.stats()["blocks_held"] == 0 and manager.stats()["stores_failed"] == 0


@pytest.mark.parametrize("load", [False, True], ids=["store", "load"])
def test_a_ctrl_c_as_each_call_of_a_held_jobs_finalize_returns_keeps_the_books_true(
        load: bool) -> None:
    """A Ctrl-C lands as each C call of finalizing a held job returns, in turn (retiring a
    load's block included): the steps that follow hand the job out once, and ``blocks_held``
    counts its block once, however far it got: a store's pin kept, a load's block retired, or
    (a Ctrl-C before the retire's change, the window complete_write has too) still being
    written, never handed out. (Counted after the mark, a Ctrl-C there left it uncounted.)"""
    for count in range(1, 100):
        primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
        tier = GivesUp(primary.cache)
        manager = TieringManager(primary, {"mine": tier})
        if load:
            tier.blocks["a"] = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
            job = manager.load(["a"])
            (block,) = [s.job.block_ids[0] for s in manager.outstanding()]
        else:
            (block,) = ready(primary, "a")
            (job,) = manager.store([block])
        out: list[int] = []
        issues: list[int | None] = []
        step = functools.partial(step_into, manager, out, issues)
        fired = interrupted_at_c_return(count, TieringManager._finalize, step,
                                        CPUPrimaryTier.retire)
        for _ in range(3):
            step()
        assert (out, issues) == ([job], []), (count, out, issues)
        assert manager.stats()["blocks_held"] == 1, count
        assert primary.pin_count(block) in ((-2, -1) if load else (1,)), count
        if not fired:
            break
    assert count > 3, "the interrupts landed inside"


class HandsOutAs(DictTier):
    """A user's own tier handing its results out as a list, a tuple, an iterator over a list
    it emptied, a sequence iterated by index, a generator expression over the list, a
    generator given the list, or a generator that takes the results only once it runs
    (``shape``). ``ran`` counts the runs of a generator's code."""

    shape = "list"
    ran = 0

    def get_finished_jobs(self) -> Any:
        if self.shape == "lazy":
            return self._lazily()
        results = super().get_finished_jobs()
        if self.shape == "genexpr":
            return (result for result in results)
        if self.shape == "wrapped":
            return self._wrapped(results)
        if self.shape == "by-index":
            return ByIndex(results)
        return {"list": list, "tuple": tuple, "iterator": iter}[self.shape](results)

    def _lazily(self) -> Iterator[JobResult]:
        self.ran += 1
        yield from DictTier.get_finished_jobs(self)

    def _wrapped(self, results: list[JobResult]) -> Iterator[JobResult]:
        self.ran += 1
        yield from results


class ByIndex:
    """Results iterable only by index (``__getitem__``), as the old sequence protocol goes."""

    def __init__(self, results: list[JobResult]) -> None:
        self.results = results

    def __getitem__(self, index: int) -> JobResult:
        return self.results[index]


def ctrl_c_as_zip_returns(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """The ``at``-th ``zip`` kvfsm.tiering makes raises KeyboardInterrupt as it returns (a
    signal is checked as that call returns; a profiler sees no event there)."""
    from kvfsm import tiering  # noqa: PLC0415

    calls = [0]

    def zip_then_ctrl_c(*iterables: Any) -> Any:
        zipped = zip(*iterables, strict=False)
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt
        return zipped

    monkeypatch.setattr(tiering, "zip", zip_then_ctrl_c, raising=False)


@pytest.mark.parametrize("shape", ["list", "tuple", "iterator", "by-index", "genexpr",
                                   "wrapped", "lazy"])
@pytest.mark.parametrize("at", [1, 2], ids=["first-tier", "second-tier"])
def test_a_ctrl_c_as_a_steps_zip_returns_loses_no_result(
        monkeypatch: pytest.MonkeyPatch, at: int, shape: str) -> None:
    """A Ctrl-C lands as the ``zip`` of a tier's results returns in a step: what the tier
    handed out is kept, and queued by the next step (no code of the tier's runs while the
    Ctrl-C goes on: a generator's body runs then); the steps that follow hand every
    job out once, its pin dropped. (That tier's results were lost, the job outstanding for
    good and its block pinned; then a generator was run while the Ctrl-C waited.)"""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    one, two = HandsOutAs(primary.cache), HandsOutAs(primary.cache)
    one.shape = two.shape = shape
    interrupted = (one, two)[at - 1]
    manager = TieringManager(primary, {"one": one, "two": two})
    (block,) = ready(primary, "a")
    jobs = manager.store([block])
    out: list[int] = []
    issues: list[int | None] = []
    ctrl_c_as_zip_returns(monkeypatch, at)
    with pytest.raises(KeyboardInterrupt):
        step_into(manager, out, issues)
    assert interrupted.ran == 0, "the tier's generator ran while the Ctrl-C waited"
    for _ in range(3):
        step_into(manager, out, issues)
    assert (sorted(out), issues) == (jobs, [])
    assert primary.pin_count(block) == 0 and not manager.has_pending_work()


def test_a_ctrl_c_as_zip_returns_queues_a_list_ending_in_a_result_queued_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step an interrupt cut short left a result queued; the tier hands that same result
    out again, after a new one, and a Ctrl-C lands as their ``zip`` returns: both are queued,
    the new job is finalized and the result handed out twice is reported. (Told apart by the
    queue's last result, the list looked queued: the new job was lost.)"""
    from .test_interrupts import ctrl_c_entering  # noqa: PLC0415

    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    tier = DictTier(primary.cache)
    manager = TieringManager(primary, {"mine": tier})
    first, second = ready(primary, "a", "b")
    (job,) = manager.store([first])
    (result,) = tier.pending
    with ctrl_c_entering(TieringManager._finalize):
        manager.step()  # its result queued, not finalized
    (later,) = manager.store([second])
    tier.pending.append(result)  # (handed out again, after the new one)
    out: list[int] = []
    issues: list[int | None] = []
    ctrl_c_as_zip_returns(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        step_into(manager, out, issues)
    for _ in range(3):
        step_into(manager, out, issues)
    assert (sorted(out), issues) == ([job, later], [job])
    assert primary.pin_count(first) == primary.pin_count(second) == 0


def test_a_drain_after_a_kept_hand_out_polls_every_tier_in_its_one_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C kept a tier's hand-out (empty: nothing had ended) from being queued; stores
    then end on both tiers, and ``drain(0)``, one step, finds all of them: the kept hand-out
    is queued, and the tier polled, in the same step. (The step that queued a kept hand-out
    skipped that tier's poll: drain(0) timed out with a result the tier had ready.)"""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"one": DictTier(primary.cache),
                                       "two": DictTier(primary.cache)})
    out: list[int] = []
    issues: list[int | None] = []
    ctrl_c_as_zip_returns(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        step_into(manager, out, issues)
    assert manager.has_pending_work(), "a hand-out is kept"
    (block,) = ready(primary, "a")
    jobs = manager.store([block])
    assert sorted(done.job_id for done in manager.drain(timeout=0)) == jobs
    assert primary.pin_count(block) == 0 and not manager.has_pending_work()


class InterruptedAt(ByIndex):
    """Results iterable by index, a Ctrl-C landing in the tier's code as the ``at``-th is
    taken, once."""

    def __init__(self, results: list[JobResult], at: int) -> None:
        super().__init__(results)
        self.at = at

    def __getitem__(self, index: int) -> JobResult:
        if index == self.at:
            self.at = -1
            raise KeyboardInterrupt
        return super().__getitem__(index)


def test_a_ctrl_c_in_a_tiers_code_mid_hand_out_keeps_what_is_left() -> None:
    """A Ctrl-C lands in a tier's own code as its second result is taken (the first is
    queued): what is left is kept where it stopped, and the next step queues it; both jobs
    are handed out once, their pins dropped. (Only a hand-out not begun was kept: the second
    job was lost, outstanding for good, its block pinned.)"""

    class Halting(DictTier):
        def get_finished_jobs(self) -> Any:
            return InterruptedAt(super().get_finished_jobs(), at=1)

    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"mine": Halting(primary.cache)})
    blocks = ready(primary, "a", "b")
    jobs = [job for block in blocks for job in manager.store([block])]
    out: list[int] = []
    issues: list[int | None] = []
    with pytest.raises(KeyboardInterrupt):
        step_into(manager, out, issues)
    assert out == [], "the first result is queued, finalized by the next step"
    step_into(manager, out, issues)
    assert (out, issues) == (jobs, [])
    assert [primary.pin_count(block) for block in blocks] == [0, 0]
    assert not manager.has_pending_work()


def test_a_kept_hand_out_of_a_stray_result_is_pending_work_until_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept hand-out holding only a result for no job is work still pending: a caller
    stepping while there is some hears of it. (has_pending_work said False: never reported.)"""
    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    tier = DictTier(primary.cache)
    manager = TieringManager(primary, {"mine": tier})
    tier.pending = [JobResult(99, True)]
    ctrl_c_as_zip_returns(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        manager.step()
    assert manager.has_pending_work()
    with pytest.raises(BookkeepingError, match=r"job 99 from tier 'mine': result .* is for no "
                                               r"outstanding job"):
        manager.step()
    assert not manager.has_pending_work()


def test_a_second_ctrl_c_as_a_kept_hand_out_is_kept_loses_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C lands as a step turns a tier's hand-out into an iterator (``iter`` returns),
    and a second at the first call the step would make after it: the hand-out is kept all the
    same, and the next step hands the job out. (The step's handler asked the queue's length
    first: a second Ctrl-C as that returned lost the hand-out.)"""
    import sys  # noqa: PLC0415

    from kvfsm import tiering  # noqa: PLC0415

    interrupted = [False]

    def iter_then_ctrl_c(iterable: Any) -> Any:
        made = iter(iterable)
        if not interrupted[0]:
            interrupted[0] = True
            raise KeyboardInterrupt("first")
        return made

    def len_of_the_step(sized: Any) -> int:  # the second, at the step's first call after
        if interrupted[0] and sys._getframe(1).f_code is TieringManager._step.__code__:
            raise KeyboardInterrupt("second")
        return len(sized)

    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"mine": DictTier(primary.cache)})
    (block,) = ready(primary, "a")
    jobs = manager.store([block])
    monkeypatch.setattr(tiering, "iter", iter_then_ctrl_c, raising=False)
    monkeypatch.setattr(tiering, "len", len_of_the_step, raising=False)
    with pytest.raises(KeyboardInterrupt):
        manager.step()
    monkeypatch.undo()
    assert [done.job_id for done in manager.step()] == jobs
    assert primary.pin_count(block) == 0 and not manager.has_pending_work()


def accounted(primary: CPUPrimaryTier) -> bool:
    """Every block is in the books once: free, being written, ready, pinned or retired."""
    stats = primary.stats()
    return sum(stats[state] for state in ("free", "writing", "ready", "pinned", "retired")) == (
        primary.num_blocks)


def test_a_ctrl_c_as_each_call_of_a_stores_cascade_returns_leaves_no_pin_behind() -> None:
    """A Ctrl-C lands as each C call of a store's cascade, and of its pin, returns (where a
    signal is handled), or as each function they call starts, in turn. Afterwards a shutdown
    leaves both blocks unpinned, and the engine may free them: a pin the interrupt cut short
    is taken back, or the job it was made for gets its result. (One landing as pin's update
    returned left both blocks pinned for good, with no job: the cascade was told the pin
    raised, so it took none of it back.)"""
    for count in range(1, 200):
        primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
        manager = TieringManager(primary, {"dict": DictTier(primary.cache)})
        blocks = ready(primary, "a", "b")
        fired = interrupted_at_c_return(count, TieringManager._cascade, functools.partial(
            manager.store, blocks), CPUPrimaryTier.pin)
        manager.shutdown(timeout=5)
        assert [primary.pin_count(block) for block in blocks] == [0, 0], count
        primary.free(blocks)
        assert accounted(primary) and primary.stats()["free"] == 4, count
        if not fired:
            break
    assert count > 10, "the interrupts landed inside"


@pytest.mark.parametrize("evicting", [False, True])
def test_a_ctrl_c_as_each_call_of_a_loads_allocation_returns_loses_no_block(
        evicting: bool) -> None:
    """A Ctrl-C lands as each C call of a load and of its allocation (the evictions it makes
    too) returns, or as each function they call starts, in turn. Afterwards, with the load
    shut down, no block is lost from the primary's books, none is left being written, and
    the keys are held only by a load that got its result: a load of them again is taken.
    (One landing between two blocks of the allocation left the first being written for good,
    its key never to be loaded again: the load was told the allocation raised.)"""
    for count in range(1, 400):
        primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
        agent = FakeNixlAgent("objects")
        tier = ObjectStoreTier(primary.cache, agent=agent)  # (it says what it took: owes)
        manager = TieringManager(primary, {"objects": tier})
        if evicting:  # two blocks ready: the load of three takes two free, evicts one
            ready(primary, "r1", "r2")
        for key in ("x", "y", "z"):
            agent.objects[tier.object_key(key)] = key.encode() * BLOCK_BYTES
        fired = interrupted_at_c_return(count, TieringManager.load, functools.partial(
            manager.load, ["x", "y", "z"], tier="objects"), CPUPrimaryTier.allocate,
            CPUPrimaryTier._drop)
        manager.shutdown(timeout=5)
        assert accounted(primary), (count, primary.stats())
        assert primary.stats()["writing"] == 0, count
        held = [primary.block_of(key) for key in ("x", "y", "z")]
        assert held == [None] * 3 or None not in held, (count, held)
        if None not in held:  # the load took them and got its result: the bytes landed
            for key, block in zip("xyz", held, strict=True):
                assert bool((primary.cache[block] == ord(key)).all()), (count, key)
            primary.free([block for block in held if block is not None])
        tier = ObjectStoreTier(primary.cache, agent=agent)
        manager = TieringManager(primary, {"objects": tier})
        assert manager.load(["x", "y", "z"], tier="objects") is not None, count
        assert [done.success for done in manager.shutdown(timeout=5)] == [True], count
        assert primary.stats()["writing"] == 0 and accounted(primary), count
        assert agent.misuses == [] and agent.live_xfer_handles() == 0, count
        if not fired:
            break
    assert count > 10, "the interrupts landed inside"


def test_a_ctrl_c_as_each_call_of_a_shutdown_past_its_deadline_returns_loses_no_job() -> None:
    """A shutdown whose drain runs out (a release that keeps raising) goes on to the tiers'
    shutdowns; a Ctrl-C lands as each of its calls returns, or each function it calls starts,
    in turn. The shutdowns that follow hand out every job once, and close the manager with
    the block unpinned. (One landing as it asked whether work was left lost the jobs it had
    finalized: held only in the call's own list, no later call handed them out.)"""
    from .test_tiering import build, write  # noqa: PLC0415

    for count in range(1, 100):
        stack = build()
        primary, manager = stack.primary, stack.manager
        (block,) = write(primary, "k0")
        stack.agents["second"].inject("release_xfer_handle", Raise(), times=10**6)
        jobs = manager.store([block])
        seen: list[int] = []

        def shut(seconds: float, manager: TieringManager = manager,
                 seen: list[int] = seen) -> None:
            try:
                seen.extend(done.job.job_id for done in manager.shutdown(timeout=seconds))
            except (TieringDrainTimeout, BookkeepingError) as error:
                seen.extend(done.job.job_id for done in error.finalized)

        fired = interrupted_at_c_return(count, TieringManager.shutdown,
                                        functools.partial(shut, 0.05),
                                        TieringManager._shut_tiers)
        for _ in range(3):
            if not manager.closed:
                shut(0.5)
        assert manager.closed and sorted(seen) == sorted(jobs), (count, seen)
        assert primary.pin_count(block) == 0, count
        if not fired:
            break
    assert count > 5, "the interrupts landed inside"


def test_a_shutdown_that_did_not_finish_takes_no_new_job_and_says_what_a_tier_raised(
) -> None:
    """A user's tier whose job never ends and whose shutdown raises: the manager's shutdown
    raises TieringDrainTimeout, whose notes and cause say what the tier's shutdown raised
    (it was dropped), and from then on the manager refuses new jobs, saying a shutdown did
    not finish (they went on to tiers shut down, each refused by them in turn)."""
    class Wedged(DictTier):
        """Its job never ends; its shutdown raises."""

        def get_finished_jobs(self) -> list[JobResult]:
            return []

        def has_pending_work(self) -> bool:
            return True

        def shutdown(self) -> None:
            raise RuntimeError("disk controller wedged")

    primary = CPUPrimaryTier(4, BLOCK_BYTES, torch.uint8)
    manager = TieringManager(primary, {"mine": Wedged(primary.cache)})
    blocks = ready(primary, "a", "b")
    manager.store(blocks[:1])
    with pytest.raises(TieringDrainTimeout) as raised:
        manager.shutdown(timeout=0.05)
    assert raised.value.__notes__ == [
        "RuntimeError: disk controller wedged; raised by the shutdown of tier 'mine'"]
    assert isinstance(raised.value.__cause__, RuntimeError)
    for call in (functools.partial(manager.store, blocks[1:]),
                 functools.partial(manager.load, ["c"], tier="mine")):
        with pytest.raises(ManagerClosedError, match=r"shutting down .* call shutdown again"):
            call()
    assert primary.pin_count(blocks[1]) == 0 and primary.block_of("c") is None
    assert not manager.closed
