"""kvfsm's tiers inside vLLM 0.33's tiered KV offload, driven by vLLM's own manager.

Each test builds vLLM's ``TieringOffloadingManager`` from an offloading configuration that names
a kvfsm tier (``{"type": "FileTier", "module_path": "kvfsm.vllm", ...}``), on real NIXL: POSIX
files in a temporary directory, or the OBJ backend against the local S3 server the tests start.
The scheduler steps are played as vLLM's connector plays them (tests/vllm_engine.py).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvfsm.testing import FaultyAgent, Raise, ReturnErr, StayProc
from kvfsm.tiers import Lookup

from .real_nixl import S3Server, require_nixl, s3_server  # noqa: F401 - a fixture
from .vllm_engine import CHUNK_BYTES, Engine, block, key, offloading_spec, require_vllm

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(180)]  # the first test imports vLLM


@pytest.fixture(scope="module", autouse=True)
def _vllm() -> None:
    require_nixl()
    require_vllm()


def file_entry(directory: Path, **settings: Any) -> dict[str, Any]:
    return {"type": "FileTier", "module_path": "kvfsm.vllm", "directory": str(directory),
            "durable": False, **settings}


def object_entry(server: S3Server, **settings: Any) -> dict[str, Any]:
    from .real_nixl import ACCESS_KEY, SECRET_KEY  # noqa: PLC0415

    return {"type": "ObjectStoreTier", "module_path": "kvfsm.vllm",
            "bucket": server.new_bucket(), "endpoint": server.endpoint,
            "access_key": ACCESS_KEY, "secret_key": SECRET_KEY, **settings}


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    """Builds engines; each is shut down after the test (if the test did not) and must leave
    no shared-memory file behind."""
    made: list[Engine] = []

    def make(*tiers: dict[str, Any], **options: Any) -> Engine:
        engine = Engine(tiers, **options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        if engine.tier_objects and engine.tier_objects[0]._tier is not None:
            engine.shutdown()
        assert engine.shm_files() == [], "the primary's region is still there"
        assert not engine.mapped(), "something still holds an array over vLLM's primary"


def blocks(*seeds: int) -> dict[bytes, bytes]:
    return {key(seed): block(seed) for seed in seeds}


def the_tier(engine: Engine) -> Any:
    (tier,) = engine.tier_objects
    return tier


def path_of(tier: Any, seed: int) -> Path:
    """Where a file tier keeps the block of ``key(seed)``."""
    return Path(tier.tier.root / tier.tier.remote_name(key(seed)))


def stored(tier: Any) -> list[str]:
    """The names of the blocks a file tier's folder holds (its own files left out)."""
    return sorted(p.name for p in tier.tier.root.iterdir() if not p.name.startswith("."))


# -- the round trip ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["files", "objects"])
def test_vllm_cascades_evicts_and_promotes_through_a_kvfsm_tier(
    kind: str, tmp_path: Path, s3_server: S3Server, engines: Callable[..., Engine]  # noqa: F811
) -> None:
    entry = (file_entry(tmp_path, enable_kv_events=True) if kind == "files"
             else object_entry(s3_server, enable_kv_events=True))
    engine = engines(entry)
    tier = the_tier(engine)
    a, b = blocks(1, 2, 3), blocks(4, 5, 6, 7)
    assert engine.offload("A", a) == list(a)
    engine.settle()
    engine.offload("B", b)  # the 4-chunk primary evicts A's chunks
    engine.settle()
    assert tier.tier.stats()["published"] == 2

    found = engine.fetch("C", list(a))  # A comes back from the kvfsm tier
    assert found == a
    engine.settle()
    assert engine.pinned_chunks() == 0
    assert engine.manager._jobs == {}
    ours = [(e.medium.name, e.removed, sorted(e.keys)) for e in engine.events
            if e.ownership in {"FileTier", "ObjectStoreTier"}]
    assert ours == [("STORAGE", False, sorted(a)), ("STORAGE", False, sorted(b))]
    engine.reset_cache()
    engine.shutdown()
    assert engine.shm_files() == []
    assert not engine.mapped()


def test_a_capacity_removes_the_least_recently_used_files_and_says_so(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    engine = engines(file_entry(tmp_path, capacity_bytes=4 * CHUNK_BYTES,
                                enable_kv_events=True))
    tier = the_tier(engine)
    engine.offload("A", blocks(1, 2))
    engine.settle()
    engine.offload("B", blocks(3, 4))
    engine.settle()
    engine.offload("C", blocks(5, 6))  # past 4 blocks: A's two go
    engine.settle()
    assert stored(tier) == sorted(tier.tier.remote_name(key(s)) for s in (3, 4, 5, 6))
    ours = [(e.removed, sorted(e.keys)) for e in engine.events if e.ownership == "FileTier"]
    assert ours == [(False, sorted([key(1), key(2)])), (False, sorted([key(3), key(4)])),
                    (True, sorted([key(1), key(2)])), (False, sorted([key(5), key(6)]))]
    assert all(e.medium.name == "STORAGE" for e in engine.events if e.ownership == "FileTier")
    found = engine.fetch("D", [key(1), key(3)])  # A is gone from both tiers, B is not
    assert found == {key(1): None, key(3): block(3)}


def test_a_capacity_deletes_objects_from_the_bucket(
    s3_server: S3Server, engines: Callable[..., Engine]  # noqa: F811
) -> None:
    entry = object_entry(s3_server, capacity_bytes=2 * CHUNK_BYTES, prefix="kv/")
    engine = engines(entry)
    tier = the_tier(engine)
    for seed in range(6):
        engine.offload(f"R{seed}", blocks(seed))
        engine.settle()
    assert tier.tier.wait_for_removals(10)
    listed = s3_server.client().list_objects_v2(Bucket=entry["bucket"]).get("Contents", [])
    assert sorted(o["Key"] for o in listed) == sorted(
        tier.tier.object_key(key(s)) for s in (4, 5))
    assert tier.tier.stats()["holdings"]["removed"] == 4


def test_a_store_of_blocks_the_tier_holds_moves_nothing(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    engine = engines(file_entry(tmp_path), primary_chunks=2)
    tier = the_tier(engine)
    engine.offload("A", blocks(1, 2))
    engine.settle()
    engine.offload("B", blocks(3, 4))  # evicts A from the primary
    engine.settle()
    # computed again without asking the tiers: the primary stores A again, and cascades it
    assert engine.offload("A again", blocks(1, 2), lookup=False) == [key(1), key(2)]
    engine.settle()
    assert tier.tier.stats()["published"] == 2  # the third cascade made no transfer
    stats = tier.get_stats()
    jobs = stats.data["data"]["vllm:kv_offload_kvfsm_jobs"]
    assert jobs[("FileTier", "store", "ok")] == 2
    assert jobs[("FileTier", "store", "skipped")] == 1
    assert stats.data["data"]["vllm:kv_offload_kvfsm_bytes"][("FileTier", "store")] == (
        4 * CHUNK_BYTES)


def test_vllms_touch_counts_as_use_and_no_events_are_kept_unless_asked_for(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    engine = engines(file_entry(tmp_path, capacity_bytes=2 * CHUNK_BYTES))
    tier = the_tier(engine)
    engine.offload("A", blocks(1))
    engine.settle()
    engine.offload("B", blocks(2))
    engine.settle()
    request = engine.request("T")
    with engine.locked() as manager:
        manager.touch([key(1)], request)  # 2 is now the least recently used
    engine.offload("C", blocks(3))
    engine.settle()
    assert stored(tier) == sorted(tier.tier.remote_name(key(s)) for s in (1, 3))
    assert [e for e in engine.events if e.ownership == "FileTier"] == []  # not enabled
    assert tier.tier.take_events() == []  # and not piling up either


def test_a_cascade_of_a_block_the_tier_holds_never_evicts_it_to_make_room_for_the_rest(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """A cascade of blocks 1 and 2 to a full tier that holds 1 (its least recently used):
    the store skips 1, and the room for 2 was made by evicting 1 itself, the block vLLM had
    just cascaded. Skipped, it now counts as used: the least recently used of the others goes."""
    engine = engines(file_entry(tmp_path, capacity_bytes=3 * CHUNK_BYTES), primary_chunks=2)
    tier = the_tier(engine)
    for seed in (1, 3, 4):
        engine.offload(f"R{seed}", blocks(seed))
        engine.settle()
    engine.offload("again", blocks(1, 2), lookup=False)
    engine.settle()
    assert stored(tier) == sorted(tier.tier.remote_name(key(s)) for s in (1, 2, 4))
    assert tier.tier.lookup(key(1)) is Lookup.HIT


def test_a_job_for_a_closed_or_confused_tier_is_a_failed_result(tmp_path: Path) -> None:
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from vllm.v1.kv_offload.base import ReqContext  # noqa: PLC0415
    from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: PLC0415
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: PLC0415

    view = memoryview(torch.zeros((4, CHUNK_BYTES), dtype=torch.int8).numpy())
    tier = SecondaryTierFactory.create_secondary_tier(file_entry(tmp_path), view,
                                                      offloading_spec())
    context = ReqContext(req_id="r")
    tier.submit_store(TransferJob(1, [key(1), key(2)], np.array([0], np.int32), False, context))
    tier.submit_load(TransferJob(2, [key(1)], np.array([9], np.int32), True, context))
    tier.shutdown()
    tier.submit_store(TransferJob(3, [key(3)], np.array([0], np.int32), False, context))
    results = {r.job_id: (r.success, r.successful_keys) for r in tier.get_finished_jobs()}
    assert results == {1: (False, []), 2: (False, []), 3: (False, [])}
    assert not tier.has_pending_work()


def test_a_job_whose_id_is_in_flight_is_refused_with_no_result_of_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller's bug: a second job under the id of one in flight. It is refused, saying so,
    and leaves the first job as it was; it has no result, since vLLM would take a result under
    that id for the first job's and let go of its chunks while NIXL may still read them. (It
    was reported as failed: two results for one id, the first while the store ran.)"""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from vllm.v1.kv_offload.base import ReqContext  # noqa: PLC0415
    from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: PLC0415
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: PLC0415

    cache = torch.zeros((4, CHUNK_BYTES), dtype=torch.int8)
    cache[0] = 5
    tier = SecondaryTierFactory.create_secondary_tier(
        file_entry(tmp_path), memoryview(cache.numpy()), offloading_spec())
    try:
        context = ReqContext(req_id="r")
        tier.submit_store(TransferJob(1, [key(1)], np.array([0], np.int32), False, context))
        with caplog.at_level(logging.ERROR, logger="kvfsm.vllm"):
            tier.submit_store(TransferJob(1, [key(2)], np.array([1], np.int32), False, context))
        assert "store job 1 refused, with no result: a job of that id is in flight" in (
            caplog.text)
        tier.drain_jobs()
        results = [(r.job_id, r.success) for r in tier.get_finished_jobs()]
        assert results == [(1, True)], "one result for the id: the first job's"
        assert tier.tier.lookup(key(1)) is Lookup.HIT
        assert tier.tier.lookup(key(2)) is not Lookup.HIT, "the second job moved nothing"
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()


def test_a_job_whose_id_has_a_result_not_yet_taken_is_refused_with_no_result_too() -> None:
    """A store of a block the tier holds has its result made at once, with no transfer; a
    second job under that id, before vLLM took the result, is refused too, with no result:
    the id has one result. (Only an id in flight was refused: this one got two.)"""
    import numpy as np  # noqa: PLC0415 - vLLM's job type wants its chunk ids so
    from vllm.v1.kv_offload.tiering.base import TransferJob as VllmJob  # noqa: PLC0415

    from kvfsm.testing import FakeNixlAgent  # noqa: PLC0415
    from kvfsm.vllm import ObjectStoreTier  # noqa: PLC0415

    agent = FakeNixlAgent("ready", complete_after_polls=1)
    view = memoryview(bytearray(4 * 64)).cast("B", (4, 64))
    adapter = ObjectStoreTier(offloading_spec(chunk_bytes=64), view, "ObjectStoreTier",
                              agent=agent,
                              probe_agent=FakeNixlAgent("probe", objects=agent.objects))
    k1, k2 = b"\x01" * 8, b"\x02" * 8

    def job(job_id: int, keys: list[bytes], chunk: int) -> Any:
        return VllmJob(job_id=job_id, keys=keys, chunk_ids=np.array([chunk]),
                       is_promotion=False, req_context=None)

    try:
        adapter.submit_store(job(1, [k1], 0))
        adapter.drain_jobs()
        assert [(r.job_id, r.success) for r in adapter.get_finished_jobs()] == [(1, True)]
        adapter.submit_store(job(5, [k1], 0))  # held: its result made at once
        adapter.submit_store(job(5, [k2], 1))  # the same id, its result not taken yet
        adapter.drain_jobs()
        assert [(r.job_id, r.success) for r in adapter.get_finished_jobs()] == [(5, True)]
        assert adapter.tier.lookup(k2) is not Lookup.HIT, "the second job moved nothing"
    finally:
        adapter.shutdown()


def test_results_ready_without_the_tier_wait_out_a_poll_of_the_tier_that_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job the adapter answers itself (refused, skipped, missing keys) has its result ready
    before the tier is polled: a poll of the tier that raises must leave it for vLLM's next
    call (it was taken first, and lost with the raise: its blocks pinned for good)."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from vllm.v1.kv_offload.base import ReqContext  # noqa: PLC0415
    from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: PLC0415
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: PLC0415

    view = memoryview(torch.zeros((4, CHUNK_BYTES), dtype=torch.int8).numpy())
    tier = SecondaryTierFactory.create_secondary_tier(file_entry(tmp_path), view,
                                                      offloading_spec())
    try:
        context = ReqContext(req_id="r")
        tier.submit_store(TransferJob(1, [key(1), key(2)], np.array([0], np.int32), False,
                                      context))  # refused: a result ready at once
        inner = tier.tier

        def raise_once() -> list[Any]:
            monkeypatch.undo()
            raise RuntimeError("the tier's poll broke")

        monkeypatch.setattr(inner, "get_finished_jobs", raise_once)
        with pytest.raises(RuntimeError, match="the tier's poll broke"):
            tier.get_finished_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()


def test_blocks_an_earlier_engine_stored_are_found_and_loaded(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """The file tier answers a lookup from the directory itself: a block this process never
    stored (an engine before a restart, or another engine sharing the directory) is a HIT and
    is loaded, once, with its bytes."""
    first = engines(file_entry(tmp_path))
    first.offload("A", blocks(1, 2))
    first.settle()
    first.shutdown()
    second = engines(file_entry(tmp_path))
    assert second.fetch("B", [key(1), key(2)]) == blocks(1, 2)
    second.settle()
    jobs = the_tier(second).get_stats().data["data"]["vllm:kv_offload_kvfsm_jobs"]
    assert jobs == {("FileTier", "load", "ok"): 1}


def test_a_file_tier_starting_removes_the_temporary_files_of_engines_gone(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """A killed engine's stores in flight leave temporary files that nothing removed (vLLM
    never calls remove_stale), growing with every restart. A tier that stores removes them as
    it starts; another live engine's are left alone."""
    first = engines(file_entry(tmp_path))
    first.offload("A", blocks(1))
    first.settle()
    root = the_tier(first).tier.root
    first.shutdown()
    gone = root / ".kvfsm-partial-0123456789abcdef-0-block"  # its writer's lock file is gone
    gone.write_bytes(b"x" * CHUNK_BYTES)
    live = engines(file_entry(tmp_path))
    live.offload("B", blocks(2), lookup=False)  # its store's temporary file: while it runs
    assert not gone.exists(), "the dead engine's temporary file was removed at start-up"
    live.settle()
    assert stored(the_tier(live)) == sorted(the_tier(live).tier.remote_name(key(s))
                                            for s in (1, 2))


def test_a_read_only_tier_is_cascaded_no_store_and_loads_what_others_stored(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """vLLM cascaded every store to a read-only file tier, and each came back a failed job, a
    warning and a cascade failure in vLLM's metrics. The tier now declines them as under
    back-pressure: vLLM sends none, and the tier still loads what another engine stored."""
    writer = engines(file_entry(tmp_path))
    writer.offload("A", blocks(1))
    writer.settle()
    writer.shutdown()
    reader = engines(file_entry(tmp_path, read_only=True))
    reader.offload("B", blocks(2))
    reader.settle()
    assert the_tier(reader).tier.stats()["published"] == 0, "no store reached the tier"
    assert reader.fetch("C", [key(1)]) == blocks(1)
    reader.settle()
    jobs = the_tier(reader).get_stats().data["data"]["vllm:kv_offload_kvfsm_jobs"]
    assert jobs == {("FileTier", "load", "ok"): 1}


@pytest.mark.parametrize("kind", ["files", "objects"])
def test_engines_of_other_models_or_layouts_sharing_a_store_never_load_each_others_blocks(
    kind: str, tmp_path: Path, s3_server: S3Server, engines: Callable[..., Engine]  # noqa: F811
) -> None:
    """vLLM's keys hash tokens, not the model: an engine of another model, dtype or block size
    sharing the bucket or directory makes the same keys. Each keeps its blocks in a folder of
    its own model and layout, so the others find nothing there (a MISS, not their bytes: an
    object half a chunk's size once loaded into a chunk as a success), while an engine of the
    same model and layout finds them all."""
    entry = file_entry(tmp_path) if kind == "files" else object_entry(s3_server)
    first = engines(entry)
    first.offload("A", blocks(1, 2))
    first.settle()
    first.shutdown()
    others = [engines(entry, model="another-model"), engines(entry, dtype="bfloat16"),
              engines(entry, chunk_bytes=2 * CHUNK_BYTES)]
    for other in others:
        assert other.fetch("B", [key(1), key(2)]) == {key(1): None, key(2): None}
        other.shutdown()
    folders = {the_tier(engine).namespace for engine in [first, *others]}
    assert len(folders) == 4
    assert the_tier(first).namespace.startswith("kvfsm-test-model_")
    same = engines(entry)
    assert the_tier(same).namespace == the_tier(first).namespace
    assert same.fetch("C", [key(1), key(2)]) == blocks(1, 2)


def test_a_prefix_or_directory_that_is_not_one_is_refused_by_name() -> None:
    from kvfsm.testing import FakeNixlAgent  # noqa: PLC0415
    from kvfsm.vllm import FileTier, ObjectStoreTier  # noqa: PLC0415

    view = memoryview(bytearray(4 * 64)).cast("B", (4, 64))
    agent = FakeNixlAgent("prefix")
    with pytest.raises(ValueError,
                       match=r"ObjectStoreTier: prefix must be a str, got bytes b'kv/'"):
        ObjectStoreTier(offloading_spec(chunk_bytes=64), view, "ObjectStoreTier", agent=agent,
                        prefix=b"kv/")
    # named as the setting is, with the value given (the folder of the model is joined after)
    with pytest.raises(ValueError, match=r"^ObjectStoreTier: prefix '/kv/' has an empty, '\.' "
                                         r"or '\.\.' part before its last '/'"):
        ObjectStoreTier(offloading_spec(chunk_bytes=64), view, "ObjectStoreTier", agent=agent,
                        prefix="/kv/")
    assert agent.live_registrations() == 0, "nothing was registered"
    with pytest.raises(ValueError, match=r"FileTier: directory must be a directory's path, "
                                         r"got 3"):
        FileTier(offloading_spec(chunk_bytes=64), view, "FileTier", directory=3)


def test_an_empty_directory_setting_is_refused_not_taken_as_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unset variable in a configuration gives ``"directory": ""``; the tier would have
    stored into the engine's working directory. It is refused, and nothing is made there."""
    from kvfsm.vllm import FileTier  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    view = memoryview(bytearray(4 * 64)).cast("B", (4, 64))
    with pytest.raises(ValueError, match=r"FileTier: directory must be a directory's path, "
                                         r"got ''"):
        FileTier(offloading_spec(chunk_bytes=64), view, "FileTier", directory="")
    assert list(tmp_path.iterdir()) == []


def test_a_namespace_names_the_model_and_changes_with_every_part_of_the_layout() -> None:
    from kvfsm.vllm import namespace  # noqa: PLC0415

    base = namespace(offloading_spec(), CHUNK_BYTES)
    assert re.fullmatch(r"kvfsm-test-model_[0-9a-f]{16}", base)
    assert namespace(offloading_spec(), CHUNK_BYTES) == base  # the same in every process
    assert namespace(offloading_spec(tier_poll_interval=0.5, primary_chunks=8),
                     CHUNK_BYTES) == base  # the engine's own settings are not the layout
    changed = [namespace(offloading_spec(model="org/another-model"), CHUNK_BYTES),
               namespace(offloading_spec(dtype="bfloat16"), CHUNK_BYTES),
               namespace(offloading_spec(), 2 * CHUNK_BYTES),  # (a KV cache dtype of its own)
               # a chunk's bytes in another order (where vLLM calls the layout agnostic too)
               namespace(offloading_spec(tp_size=2), CHUNK_BYTES),
               namespace(offloading_spec(kv_cache_layout="HND"), CHUNK_BYTES)]
    assert len({base, *changed}) == 6
    assert namespace(offloading_spec(chunk_bytes=2 * CHUNK_BYTES), 2 * CHUNK_BYTES) == changed[2]
    assert changed[0].startswith("org_another-model_")  # one folder, not two
    for odd, start in (("../../etc", "_.._etc_"), ("..", "model_"), ("a b/c:d", "a_b_c_d_")):
        assert namespace(offloading_spec(model=odd), CHUNK_BYTES).startswith(start)
    with pytest.raises(ValueError, match="does not say the model and KV layout"):
        namespace(None, CHUNK_BYTES)


def test_two_tiers_of_one_type_are_told_apart_by_their_labels(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    engine = engines(file_entry(tmp_path / "fast", label="nvme", enable_kv_events=True),
                     file_entry(tmp_path / "slow", label="disk", enable_kv_events=True))
    engine.offload("A", blocks(1, 2))
    engine.settle()
    held = engine.manager.get_stats().data["data"]["vllm:kv_offload_kvfsm_bytes"]
    assert held == {("nvme", "store"): 2 * CHUNK_BYTES, ("disk", "store"): 2 * CHUNK_BYTES}
    assert sorted(e.ownership for e in engine.events if e.ownership) == ["disk", "nvme"]


def test_two_tiers_of_one_type_without_labels_are_said_to_count_as_one(
    tmp_path: Path, engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture,
) -> None:
    """Two FileTiers of one engine without labels: vLLM counts their metrics as one tier's,
    its gauges overwritten by either. kvfsm says so as the second is made (nothing did), and
    not of a tier of another engine in the process."""
    with caplog.at_level("WARNING", logger="kvfsm"):
        engines(file_entry(tmp_path / "other-engine"))
        engines(file_entry(tmp_path / "fast"), file_entry(tmp_path / "slow"))
    said = [r.getMessage() for r in caplog.records if "labelled" in r.getMessage()]
    assert said == ["FileTier: another tier of this engine's is labelled 'FileTier' too: vLLM "
                    "counts their metrics as one tier's (their gauges overwrite each other); "
                    "give each a \"label\" of its own"]


def test_a_quarantined_transfer_keeps_vllms_cache_mapped_after_shutdown(
    tmp_path: Path
) -> None:
    """A release that keeps failing ends in quarantine: the job fails, vLLM unpins, and the
    transfer's handle stays held over vLLM's CPU cache; shutdown then keeps that memory
    registered with NIXL and mapped, instead of letting vLLM unmap memory NIXL still knows."""
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    agent = FaultyAgent(make_agent("vllm-quarantine", "POSIX"))
    engine = Engine([file_entry(tmp_path, agent=agent, retry={"max_attempts": 2})])
    try:
        agent.inject("release_xfer_handle", Raise("NIXL_ERR_BACKEND"), times=2)
        engine.offload("A", blocks(1))
        engine.settle()
        assert engine.manager._jobs == {}
        assert engine.pinned_chunks() == 0
        assert the_tier(engine).tier.stats()["quarantined"] == 1
        from kvfsm.vllm import HandlesHeld  # noqa: PLC0415

        with pytest.raises(HandlesHeld, match="1 quarantined transfer"):
            engine.shutdown()  # vLLM's manager re-raises, and leaves its cache alone
        assert engine.mapped(), "vLLM unmapped its cache under a NIXL registration"
        assert agent.misuses == []
    finally:
        for name in engine.shm_files():
            Path("/dev/shm", name).unlink()


# -- failures, as vLLM sees them -----------------------------------------------------------------

def test_a_failed_promotion_is_a_miss_afterwards_and_never_loaded_again(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    agent = FaultyAgent(make_agent("vllm-failed-load", "POSIX"))
    engine = engines(file_entry(tmp_path, agent=agent), primary_chunks=2)
    engine.offload("A", blocks(1, 2))
    engine.settle()
    engine.offload("B", blocks(3, 4))
    engine.settle()
    agent.inject("check_xfer_state", Raise("NIXL_ERR_BACKEND"))  # the promotion's read fails
    assert engine.fetch("C", [key(1), key(2)]) == {key(1): None, key(2): None}
    engine.settle()
    posts = agent.call_count("transfer")
    assert engine.fetch("D", [key(1), key(2)]) == {key(1): None, key(2): None}
    assert agent.call_count("transfer") == posts  # a MISS: no reload loop
    assert engine.pinned_chunks() == 0
    assert agent.misuses == []


def test_a_promotion_of_blocks_removed_since_the_lookup_names_what_did_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Straight through the factory and vLLM's own job types: the tier evicts a block between
    the lookup's HIT and the load. vLLM's result has no reason: the log says which keys were
    missing."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: PLC0415
    from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: PLC0415
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: PLC0415

    cache = torch.zeros((4, CHUNK_BYTES), dtype=torch.int8)
    view = memoryview(cache.numpy())
    tier = SecondaryTierFactory.create_secondary_tier(
        file_entry(tmp_path, capacity_bytes=2 * CHUNK_BYTES), view, offloading_spec())
    try:
        context = ReqContext(req_id="r")
        for chunk, seed in enumerate((1, 2)):
            view.cast("B")[chunk * CHUNK_BYTES:(chunk + 1) * CHUNK_BYTES] = block(seed)
        tier.submit_store(TransferJob(1, [key(1), key(2)], np.array([0, 1], np.int32), False,
                                      context))
        tier.drain_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
        assert tier.lookup(key(1), context) is LookupResult.HIT
        tier.touch([key(1)], context)  # key 2 is now the least recently used
        view.cast("B")[2 * CHUNK_BYTES:3 * CHUNK_BYTES] = block(3)
        tier.submit_store(TransferJob(2, [key(3)], np.array([2], np.int32), False, context))
        tier.drain_jobs()
        cache.zero_()
        tier.submit_load(TransferJob(3, [key(2), key(1)], np.array([3, 0], np.int32), True,
                                     context))
        tier.drain_jobs()
        results = {r.job_id: r for r in tier.get_finished_jobs()}
        assert results[2].success and results[2].transfer_bytes == CHUNK_BYTES
        load = results[3]
        assert (load.success, load.successful_keys) == (False, [key(1)])
        assert [r.getMessage() for r in caplog.records if "no longer in the tier" in
                r.getMessage()] == [
            f"{tier.label}: load job 3 fails: 1 of its keys are no longer in the tier "
            f"(removed, or a transfer of them failed, since vLLM looked them up): {key(2)!r}"]
        assert bytes(view.cast("B")[:CHUNK_BYTES]) == block(1)
        assert tier.lookup(key(2), context) is LookupResult.MISS
    finally:
        tier.shutdown()


def test_a_job_the_tier_cannot_start_is_a_failed_result_not_an_exception(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """A cascade of three blocks into a tier that holds two is refused by kvfsm
    (TierFullError); vLLM gets a failed result, not the exception, and unpins the chunks."""
    engine = engines(file_entry(tmp_path, capacity_bytes=2 * CHUNK_BYTES))
    engine.offload("A", blocks(1, 2, 3))
    engine.settle()
    assert engine.manager._jobs == {}
    assert engine.pinned_chunks() == 0
    jobs = the_tier(engine).get_stats().data["data"]["vllm:kv_offload_kvfsm_jobs"]
    assert jobs == {("FileTier", "store", "refused"): 1}
    assert stored(the_tier(engine)) == []
    engine.offload("B", blocks(4, 5))  # the tier still works
    engine.settle()
    assert stored(the_tier(engine)) == sorted(
        the_tier(engine).tier.remote_name(key(s)) for s in (4, 5))


def test_reset_cache_drains_transfers_still_running_without_aborting_them(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    agent = FaultyAgent(make_agent("vllm-drain", "POSIX"))
    engine = engines(file_entry(tmp_path, agent=agent))
    agent.inject("transfer", StayProc(40))  # NIXL says PROC for 40 checks
    context = engine.request("A")
    with engine.locked() as manager:
        prepared = manager.prepare_store([key(1)], context)
    engine.end_step()
    with engine.locked() as manager:
        manager.complete_store({key(1)}, context)
    assert the_tier(engine).has_pending_work()
    engine.reset_cache()  # asserts inside vLLM if any job's result is not ready
    assert prepared is not None
    assert engine.manager._jobs == {}
    assert agent.call_count("check_xfer_state") >= 40
    assert path_of(the_tier(engine), 1).exists()


def test_a_drain_waiting_on_nixl_logs_what_it_waits_for_each_time_its_period_passes(
    tmp_path: Path, engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``reset_cache()`` behind a transfer NIXL says it runs for 0.6 s: the drain says what it
    waits for each period (5 s; a tenth of a second here), not once (it waited on in silence
    after the first, for as long as NIXL took, holding vLLM's lock)."""
    import time  # noqa: PLC0415

    import kvfsm.vllm  # noqa: PLC0415
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    class RunsUntil(FaultyAgent):
        """NIXL says every transfer runs until ``until`` (monotonic seconds)."""

        until = 0.0

        def check_xfer_state(self, handle: Any) -> str:
            if time.monotonic() < self.until:
                return "PROC"
            answer: str = super().check_xfer_state(handle)
            return answer

    monkeypatch.setattr(kvfsm.vllm, "DRAIN_LOG_SECONDS", 0.1)
    agent = RunsUntil(make_agent("vllm-drain-log", "POSIX"))
    engine = engines(file_entry(tmp_path, agent=agent))
    agent.until = time.monotonic() + 0.6
    context = engine.request("A")
    with engine.locked() as manager:
        manager.prepare_store([key(1)], context)
    engine.end_step()
    with caplog.at_level(logging.WARNING, logger="kvfsm.vllm"):
        with engine.locked() as manager:
            manager.complete_store({key(1)}, context)
        engine.reset_cache()
    waits = [r.getMessage() for r in caplog.records if "drain_jobs still waiting" in r.message]
    assert len(waits) >= 3, waits
    assert all("PROCESSING" in wait for wait in waits), waits
    assert time.monotonic() >= agent.until
    assert engine.manager._jobs == {}


def test_a_tier_made_by_vllm_logs_where_vllms_log_goes(tmp_path: Path) -> None:
    """vLLM's results carry no reason: kvfsm's log says why a job failed. In a vLLM process,
    whose logging configuration gives vLLM's logger its handlers and the root logger none, a
    store that failed said nothing anywhere (kvfsm's logger had only its NullHandler): now it
    is told through vLLM's handler, formatted as vLLM's own lines; and on stderr where vLLM's
    logging is not configured. Once the application gives the root logger a handler, after
    the tier was made, that handler alone tells it (it was told twice)."""
    script = tmp_path / "engine.py"
    script.write_text(f"""
import sys, tempfile, warnings
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
warnings.simplefilter("ignore")
if sys.argv[1] != "plain":  # as vLLM's engine core configures its logging as it starts
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    configure_logging(LoggingConfig())
from tests.vllm_engine import Engine, block, key
from kvfsm.testing import FakeNixlAgent, Raise
agent = FakeNixlAgent("logged")
engine = Engine([{{"type": "FileTier", "module_path": "kvfsm.vllm",
                  "directory": tempfile.mkdtemp(dir={str(tmp_path)!r}), "durable": False,
                  "agent": agent}}], primary_chunks=2)
if sys.argv[1] == "later":  # the application configures its logging once vLLM's is
    import logging
    logging.basicConfig(format="APP %(name)s: %(message)s")
agent.inject("make_prepped_xfer", Raise("NIXL_ERR_BACKEND"))
engine.offload("A", {{key(1): block(1)}})
engine.settle()
engine.shutdown()
""")
    for configured in ("vllm", "plain", "later"):
        done = subprocess.run([sys.executable, str(script), configured], capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        said = [line for line in (done.stdout + done.stderr).splitlines()
                if "store of 1 block(s) failed: make_prepped_xfer raised" in line]
        assert len(said) == 1, (configured, done.stdout, done.stderr)
        if configured == "vllm":
            assert "WARNING" in said[0] and "[runner.py:" in said[0], said  # vLLM's format
        elif configured == "later":
            assert said[0].startswith("APP kvfsm: job 0: store"), said
        else:
            assert said[0].startswith("job 0: store of 1 block(s) failed"), said


def test_kvfsms_records_go_to_vllms_handlers_only_where_the_application_gave_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's logging configured (a handler on its logger, none on the root), a tier made by
    vLLM: kvfsm's records go to vLLM's handler; a record of a logger the application gave a
    handler of its own (the adapter's, ``kvfsm.vllm``) goes to that handler alone (it was told
    by both)."""
    import io  # noqa: PLC0415

    import kvfsm.vllm  # noqa: PLC0415

    told = io.StringIO()
    theirs, ours = logging.StreamHandler(told), logging.StreamHandler(told)
    theirs.setFormatter(logging.Formatter("VLLM %(name)s: %(message)s"))
    ours.setFormatter(logging.Formatter("APP %(name)s: %(message)s"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # (pytest's own, put back after)
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [theirs])
    monkeypatch.setattr(logging.getLogger("kvfsm"), "handlers",
                        list(logging.getLogger("kvfsm").handlers))
    monkeypatch.setattr(logging.getLogger("kvfsm.vllm"), "handlers", [])
    kvfsm.vllm._log_where_vllm_does()
    kvfsm.vllm._log_where_vllm_does()  # (a second tier: one handler still)
    logging.getLogger("kvfsm").warning("job 0 failed")
    logging.getLogger("kvfsm.vllm").warning("job 7 refused")
    logging.getLogger("kvfsm.vllm").addHandler(ours)
    logging.getLogger("kvfsm.vllm").warning("job 8 refused")
    logging.getLogger("kvfsm").warning("job 1 failed")
    assert told.getvalue().splitlines() == [
        "VLLM kvfsm: job 0 failed", "VLLM kvfsm.vllm: job 7 refused",
        "APP kvfsm.vllm: job 8 refused", "VLLM kvfsm: job 1 failed"]


def test_past_its_in_flight_bound_vllms_manager_stops_cascading_to_the_tier(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    agent = FaultyAgent(make_agent("vllm-backpressure", "POSIX"))
    engine = engines(file_entry(tmp_path, agent=agent, in_flight={"jobs": 2}), primary_chunks=8)
    agent.inject("transfer", StayProc(400), times=2)  # the first two stores run on a while
    for seed in range(1, 6):
        engine.offload(f"req-{seed}", blocks(seed))
        assert engine.pinned_chunks() <= 2  # only what the tier took is pinned
    tier = the_tier(engine)
    assert tier.tier.stats()["in_flight_limit"]["jobs"] == 2
    # vLLM's manager asked the tier's detector and dropped the other three stores itself:
    # the tier never saw them, and nothing of theirs was pinned
    assert tier.bp_detector.policy.pop_stores_dropped() == (3, 3)
    assert tier.tier.stats()["in_flight_limit"]["stores_refused"] == 0
    assert tier.bp_detector.stats == {"jobs": 2, "bytes": 2 * tier.tier.block_bytes,
                                      "stores_refused": 0}
    # one more dropped, then vLLM resets its detectors: the dropped-store counts start again
    engine.offload("req-6", blocks(6))
    tier.bp_detector.reset()
    assert tier.bp_detector.policy.pop_stores_dropped() == (0, 0)
    engine.settle()
    assert engine.pinned_chunks() == 0
    stored = [seed for seed in range(1, 6)
              if path_of(tier, seed).exists()]
    assert stored == [1, 2]
    assert not tier.bp_detector.is_under_pressure()


def test_vllms_tier_poll_thread_collects_results_between_scheduler_steps(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    import time  # noqa: PLC0415

    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    agent = FaultyAgent(make_agent("vllm-poll-thread", "POSIX"))
    engine = engines(file_entry(tmp_path, agent=agent), tier_poll_interval=0.001)
    agent.inject("transfer", StayProc(20))  # the store runs on after the steps below
    engine.offload("A", blocks(1))
    assert engine.pinned_chunks() == 1  # the store's pin
    # no scheduler step from here on: vLLM's tier-poll thread polls the tier meanwhile, and
    # the finished store's result unpins the chunk
    deadline = time.monotonic() + 30
    while engine.pinned_chunks() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.pinned_chunks() == 0
    assert agent.call_count("check_xfer_state") >= 20
    assert path_of(the_tier(engine), 1).exists()
    with engine.locked() as manager:
        assert not manager.has_pending_work()


def test_with_a_progress_thread_the_tier_polls_itself_and_vllms_polls_only_take_results(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    import threading  # noqa: PLC0415

    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    agent = FaultyAgent(make_agent("vllm-progress", "POSIX"))
    engine = engines(file_entry(tmp_path, agent=agent, retry={"progress_interval": 0.001}))
    tier = the_tier(engine).tier
    agent.inject("transfer", StayProc(20))  # the store needs 20 checks more to end
    a = blocks(1)
    engine.offload("A", a)
    engine.settle()
    assert engine.pinned_chunks() == 0
    progress = tier.stats()["progress"]
    # every check was the tier's own thread's: vLLM's polls only took the result
    assert progress["error"] is None and progress["polls"] >= 20
    assert agent.call_count("check_xfer_state") == progress["polls"]
    engine.offload("B", blocks(4, 5, 6, 7))  # evicts A from the primary
    engine.settle()
    assert engine.fetch("C", list(a)) == a  # and it comes back through the tier
    engine.settle()
    assert engine.pinned_chunks() == 0
    engine.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvfsm-progress")]


def test_metrics_are_declared_and_labelled_as_vllm_requires(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    engine = engines(file_entry(tmp_path, capacity_bytes=2 * CHUNK_BYTES))
    definitions = engine.spec.build_metric_definitions(engine.spec.extra_config)
    engine.offload("A", blocks(1, 2))
    engine.settle()
    engine.offload("B", blocks(3))  # the tier removes one of A's
    engine.settle()
    stats = engine.manager.get_stats()
    ours = {name: values for name, values in stats.data["data"].items()
            if name.startswith("vllm:kv_offload_kvfsm_")}
    assert {"vllm:kv_offload_kvfsm_jobs", "vllm:kv_offload_kvfsm_in_flight",
            "vllm:kv_offload_kvfsm_held_bytes"} <= ours.keys()
    for name, values in ours.items():
        assert name in definitions, name
        for labels in values:
            assert len(labels) == len(definitions[name].labelnames), (name, labels)
    assert ours["vllm:kv_offload_kvfsm_held_bytes"][("FileTier",)] == 2 * CHUNK_BYTES
    assert ours["vllm:kv_offload_kvfsm_removed_blocks"][("FileTier",)] == 1


# -- every NIXL call failing -------------------------------------------------------------------

CALLS = ["register_memory", "deregister_memory", "prep_xfer_dlist", "make_prepped_xfer",
         "transfer", "check_xfer_state", "release_xfer_handle", "release_dlist_handle",
         "query_memory"]
FAULTS = [(kind, call, fault) for kind in ("files", "objects") for call in CALLS
          if not (kind == "files" and call == "query_memory")  # a file tier stats, never asks
          for fault in ([Raise("NIXL_ERR_BACKEND")]
                        + ([ReturnErr(), StayProc(3)] if call in ("transfer", "check_xfer_state")
                           else []))]


def run_workload(engine: Engine) -> None:
    """Stores that evict each other from the primary, and promotions; then the checks vLLM's
    users need: every job reported once (none left in the manager), no pin left, and every
    block read back either the bytes stored or a miss, never other bytes."""
    stored = blocks(*range(8))
    for seed in range(0, 8, 2):
        engine.offload(f"S{seed}", {key(s): stored[key(s)] for s in (seed, seed + 1)})
        engine.settle()
    found = engine.fetch("L", [key(s) for s in range(4)])
    for k, got in found.items():
        assert got is None or got == stored[k], "a load returned bytes that were not stored"
    engine.settle()
    assert engine.manager._jobs == {}
    assert engine.pinned_chunks() == 0


@pytest.mark.parametrize(("kind", "call", "fault"), FAULTS,
                         ids=[f"{k}-{c}-{type(f).__name__}" for k, c, f in FAULTS])
def test_every_nixl_call_failing_under_vllms_manager(
    kind: str, call: str, fault: Any, tmp_path: Path, s3_server: S3Server,  # noqa: F811
    engines: Callable[..., Engine]
) -> None:
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    if kind == "files":
        agent = FaultyAgent(make_agent(f"vllm-{call}", "POSIX"))
        entry = file_entry(tmp_path, agent=agent, capacity_bytes=6 * CHUNK_BYTES,
                           retry={"max_attempts": 5})
    else:
        entry = object_entry(s3_server, capacity_bytes=6 * CHUNK_BYTES,
                             retry={"max_attempts": 5})
        store = _store_of(entry)
        agent = FaultyAgent(make_agent(f"vllm-obj-{call}", "OBJ", store.backend_params()))
        entry.update(agent=agent, probe_agent=agent)
    engine = engines(entry, primary_chunks=2)
    agent.inject(call, fault, times=2)
    run_workload(engine)
    engine.reset_cache()
    engine.shutdown()
    assert agent.faults.pending() == [], "the fault never fired"
    assert agent.misuses == []


@pytest.mark.parametrize("kind", ["files", "objects"])
def test_random_faults_in_every_call_under_vllms_manager(
    kind: str, tmp_path: Path, s3_server: S3Server,  # noqa: F811
    engines: Callable[..., Engine]
) -> None:
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415

    # (a release failing 5 times in a row, 0.2**5 a try, came once in a full run, with the
    # lookups' probes on another thread drawing from the same faults: its quarantine then
    # keeps vLLM's cache registered, and shutdown rightly raises HandlesHeld)
    retry = {"max_attempts": 40}
    if kind == "files":
        agent = FaultyAgent(make_agent("vllm-chaos", "POSIX"))
        entry = file_entry(tmp_path, agent=agent, capacity_bytes=6 * CHUNK_BYTES, retry=retry)
    else:
        entry = object_entry(s3_server, capacity_bytes=6 * CHUNK_BYTES, retry=retry)
        agent = FaultyAgent(make_agent("vllm-obj-chaos", "OBJ",
                                       _store_of(entry).backend_params()))
        entry.update(agent=agent, probe_agent=agent)
    engine = engines(entry, primary_chunks=2)
    for seed in range(3):
        agent.chaos(0.2, seed=seed)
        run_workload(engine)
    agent.chaos(0)
    engine.reset_cache()
    engine.shutdown()
    assert agent.misuses == []


def _store_of(entry: dict[str, Any]) -> Any:
    from kvfsm.nixl_agents import StoreConfig  # noqa: PLC0415

    return StoreConfig(entry["bucket"], endpoint=entry["endpoint"],
                       access_key=entry["access_key"], secret_key=entry["secret_key"])


# -- kvfsm without vLLM ------------------------------------------------------------------------

def test_kvfsm_imports_without_vllm() -> None:
    """``import kvfsm`` (and its tiers, its testing kit) never imports vLLM: run with vLLM made
    unimportable."""
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import kvfsm, kvfsm.tiers, kvfsm.testing, kvfsm.tiering\n"
            "assert not any(m.startswith('vllm') and sys.modules[m] is not None "
            "for m in sys.modules)\n"
            "try:\n    import kvfsm.vllm\nexcept ImportError:\n    print('refused')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused"


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("in_flight", 8, "FileTier: in_flight must be a dict of InFlightLimit fields, got 8"),
    ("in_flight", {"job": 8},
     "FileTier: in_flight: unknown field(s) job; InFlightLimit has bytes, jobs"),
    ("in_flight", {"jobs": 0}, "FileTier: in_flight: InFlightLimit.jobs must be"),
    ("retry", [], "FileTier: retry must be a dict of RetryPolicy fields, got []"),
    ("retry", {"max_unpoled": 2},
     "FileTier: retry: unknown field(s) max_unpoled; RetryPolicy has "),
    ("retry", {"max_running_seconds": 30}, "FileTier: retry: max_running_seconds=30 is refused "
     "under vLLM: a transfer given up while NIXL still runs it would go on reading or writing "
     "chunks vLLM reuses once it has the job's result"),  # (its failure freed them under NIXL)
    ("shutdown_timeout", "30", "FileTier: shutdown_timeout must be a number of seconds >= 0 "
     "or None, got '30'"),
    ("shutdown_timeout", -5, "FileTier: shutdown_timeout must be a number of seconds >= 0 "
     "or None, got -5"),  # (was taken as a shutdown that waits for nothing)
    ("durable", "false", "FileTier: durable must be True or False, got 'false'"),
    ("read_only", "yes", "FileTier: read_only must be a bool, got 'yes'"),
    ("poll_interval", -1, "FileTier: poll_interval must be a finite number of seconds >= 0"),
    ("capacity_bytes", 1, "FileTier: capacity_bytes must be an int of at least one block"),
    ("capacity_byte", 100, "FileTier: unknown setting(s) capacity_byte; its settings: agent, "
     "capacity_bytes, directory, durable,"),
    ("policy", {}, "FileTier: unknown setting(s) policy; its settings:"),  # (retry makes it)
    ("enable_kv_events", "false", "FileTier: enable_kv_events must be true or false, got "
     "'false'"),  # (was taken as true)
    ("in_flight", {"bytes": 100}, f"FileTier: in_flight bytes 100 is less than one chunk "
     f"({CHUNK_BYTES} bytes): every store would be refused"),  # (was: every store dropped)
    ("machine", "examples.verify_lifecycle:VERIFY", "FileTier: machine: "
     "'examples.verify_lifecycle:VERIFY': examples.verify_lifecycle has no attribute 'VERIFY'"),
    ("machine", "examples.verify_lifecycle:STEPS", "FileTier: machine: "
     "'examples.verify_lifecycle:STEPS' is not a kvfsm Declaration (found dict)"),
    ("steps", "examples.verify_lifecycle", "FileTier: steps: 'examples.verify_lifecycle': name "
     "steps as module:ATTRIBUTE, e.g. examples.verify_lifecycle:STEPS"),
    ("locality", "nearby", "FileTier: locality must be one of 'LOCAL', 'REMOTE' or None, got "
     "'nearby'"),  # (was: 'nearby' is not a valid Locality)
])
def test_a_bad_setting_is_refused_with_an_error_naming_it(
    tmp_path: Path, engines: Callable[..., Engine], setting: str, value: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        engines(file_entry(tmp_path, **{setting: value}))
    assert list(tmp_path.iterdir()) == []  # no tier was made: nothing in its directory


def test_a_bad_setting_of_one_of_two_tiers_of_a_kind_names_that_tier_by_its_label(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """Two file tiers, labelled: the one whose retry, back-pressure or lifecycle is wrong is
    named by its label, not only by its type."""
    good = file_entry(tmp_path / "near", label="near")
    for setting, value, message in (
            ("retry", {"max_seconds": -1}, "far: retry: "),
            ("in_flight", {"jobs": 0}, "far: in_flight: InFlightLimit.jobs must be"),
            ("machine", "kvfsm.machines.peer_link:PEER_LINK", "far: machine 'peer_link' "),
            ("durable", "no", "far: durable must be True or False, got 'no'"),
            ("locality", "moon", "far: locality must be one of"),
            ("enable_kv_events", "yes", "far: enable_kv_events must be true or false"),
            ("steps", "nope", "far: steps: 'nope'"),
            ("shutdown_timeout", "x", "far: shutdown_timeout must be"),
            ("capacity_byte", 1, "far: unknown setting(s) capacity_byte")):
        bad = file_entry(tmp_path / "far", label="far", **{setting: value})
        with pytest.raises(ValueError, match=re.escape(message)):
            engines(good, bad)


def test_a_store_one_of_the_tiers_cannot_reach_is_named_by_that_tiers_label(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """Nothing answers at the second object-store tier's endpoint: the error says which of
    the configuration's tiers cannot reach its store (it named only the bucket and the
    endpoint)."""
    from kvfsm.nixl_agents import BucketUnreachable  # noqa: PLC0415

    from .real_nixl import ACCESS_KEY, SECRET_KEY, free_port  # noqa: PLC0415

    far = {"type": "ObjectStoreTier", "module_path": "kvfsm.vllm", "label": "far",
           "bucket": "nowhere", "endpoint": f"http://127.0.0.1:{free_port()}",
           "access_key": ACCESS_KEY, "secret_key": SECRET_KEY}
    with pytest.raises(BucketUnreachable, match=r"^far: cannot reach bucket 'nowhere'"):
        engines(file_entry(tmp_path, label="near"), far)


def test_a_configuration_names_its_lifecycle_and_steps_as_kvfsm_explore_does(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """A JSON configuration can only name ``machine`` and ``steps``: as ``module:ATTRIBUTE``,
    the tier runs the tutorial's checksum lifecycle with its steps. A block whose file changed
    since its store fails its promotion (a MISS, not other bytes); one left alone comes back."""
    engine = engines(file_entry(tmp_path, machine="examples.verify_lifecycle:VERIFY_MACHINE",
                                steps="examples.verify_lifecycle:STEPS"))
    tier = the_tier(engine)
    assert tier.tier.machine.declaration.name == "verify"
    engine.offload("A", blocks(1, 2))
    engine.settle()
    engine.offload("B", blocks(3, 4, 5, 6))  # the 4-chunk primary evicts A's chunks
    engine.settle()
    path_of(tier, 1).write_bytes(block(9))  # another writer, bit rot: not what was stored

    def mismatches() -> int:  # (the machine's counts are the process's: compared before, after)
        return sum(count for edge, count in tier.tier.machine.transition_counts().items()
                   if "unverified" in edge.conditions)

    before = mismatches()
    assert engine.fetch("C", [key(1)]) == {key(1): None}
    assert mismatches() == before + 1  # the verify step said so
    engine.settle()
    assert engine.fetch("D", [key(2)]) == {key(2): block(2)}


def test_the_object_tiers_names_are_the_adapters_own_to_choose(
    s3_server: S3Server, engines: Callable[..., Engine]  # noqa: F811
) -> None:
    """The adapter's folder covers the chunk's size, so it keeps no size folder under it, and
    neither that nor the key prefix is a setting (the folder is what keeps models apart)."""
    for setting in ("size_folder", "key_prefix"):
        with pytest.raises(ValueError, match=f"ObjectStoreTier: unknown setting\\(s\\) {setting};"):
            engines(object_entry(s3_server, **{setting: "x"}))


def test_an_interrupt_once_the_tier_took_a_job_loses_no_result() -> None:
    """A KeyboardInterrupt landing right after NIXL's transfer() returned propagates out of
    submit_store, with the job in flight in the tier (as the tier documents). The adapter used
    to forget the job, so the tier's result for it made get_finished_jobs raise KeyError,
    losing the other results of that call with it."""
    import numpy as np  # noqa: PLC0415 - vLLM's job type wants its chunk ids so
    from vllm.v1.kv_offload.tiering.base import TransferJob as VllmJob  # noqa: PLC0415

    from kvfsm.testing import FakeNixlAgent  # noqa: PLC0415
    from kvfsm.vllm import ObjectStoreTier  # noqa: PLC0415

    class InterruptedAfterPost(FakeNixlAgent):
        armed = False

        def transfer(self, *args: Any, **kwargs: Any) -> str:
            status = super().transfer(*args, **kwargs)
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt  # as a signal handled right after the call returned
            return status

    agent = InterruptedAfterPost("interrupted", complete_after_polls=1)
    view = memoryview(bytearray(4 * 64)).cast("B", (4, 64))
    adapter = ObjectStoreTier(offloading_spec(chunk_bytes=64), view, "ObjectStoreTier", agent=agent,
                              probe_agent=FakeNixlAgent("probe", objects=agent.objects))

    def job(job_id: int, seed: int) -> Any:
        return VllmJob(job_id=job_id, keys=[bytes([seed]) * 8], chunk_ids=np.array([seed]),
                       is_promotion=False, req_context=None)

    adapter.submit_store(job(1, 0))
    agent.armed = True
    with pytest.raises(KeyboardInterrupt):
        adapter.submit_store(job(2, 1))
    assert adapter.tier.owes(2), "the tier took job 2"
    results = list(adapter.get_finished_jobs())
    assert sorted((r.job_id, r.success) for r in results) == [(1, True), (2, True)]
    assert not adapter.has_pending_work()
    adapter.shutdown()


def test_a_job_id_reused_while_its_job_runs_is_refused_and_the_running_job_keeps_its_keys() -> None:
    """vLLM promotes k1 and k2, k2 a MISS (so only k1 is loaded); a store reusing that job id
    comes while the promotion runs. It is refused (with no result of its own) without touching
    the promotion's record: the promotion still reports k2 as not loaded, its one result the
    only one of the id. (The store's record once replaced the promotion's, which then reported
    every key loaded.)"""
    import numpy as np  # noqa: PLC0415 - vLLM's job type wants its chunk ids so
    from vllm.v1.kv_offload.tiering.base import TransferJob as VllmJob  # noqa: PLC0415

    from kvfsm.testing import FakeNixlAgent, StayProc  # noqa: PLC0415
    from kvfsm.vllm import ObjectStoreTier  # noqa: PLC0415

    agent = FakeNixlAgent("reused", complete_after_polls=1)
    view = memoryview(bytearray(4 * 64)).cast("B", (4, 64))
    adapter = ObjectStoreTier(offloading_spec(chunk_bytes=64), view, "ObjectStoreTier", agent=agent,
                              probe_agent=FakeNixlAgent("probe", objects=agent.objects))
    k1, k2, k3 = (bytes([seed]) * 8 for seed in (1, 2, 3))

    def job(job_id: int, keys: list[bytes], chunks: list[int], promotion: bool) -> Any:
        return VllmJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks),
                       is_promotion=promotion, req_context=None)

    adapter.submit_store(job(1, [k1], [0], False))
    adapter.drain_jobs()
    assert [(r.job_id, r.success) for r in adapter.get_finished_jobs()] == [(1, True)]
    adapter.tier._known.record([adapter.tier.remote_name(k2)], Lookup.MISS)  # k2: gone

    agent.inject("check_xfer_state", StayProc(3))
    adapter.submit_load(job(3, [k1, k2], [1, 2], True))
    adapter.submit_store(job(3, [k3], [3], False))
    adapter.submit_store(job(3, [k1], [0], False))  # k1 is held: nothing to move, refused too
    adapter.drain_jobs()
    results = list(adapter.get_finished_jobs())
    assert [(r.job_id, r.success, r.successful_keys) for r in results] == [
        (3, False, [k1]),  # the promotion: k1 loaded, k2 not; the stores refused, no result
    ]
    adapter.shutdown()



def test_a_tier_takes_the_locality_its_entry_names(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    from vllm.v1.kv_offload.tiering.base import Locality  # noqa: PLC0415 - (vLLM on demand)

    engine = engines(file_entry(tmp_path, locality="REMOTE"))
    assert the_tier(engine).locality is Locality.REMOTE


@contextmanager
def ctrl_c_at_event(landing: int, own: set[Any]) -> Iterator[list[int]]:
    """The block is interrupted (a KeyboardInterrupt raised, and taken here) at the
    ``landing``-th place a signal handler may run in the functions of the code objects
    ``own``: a C call one makes returns, or a function one calls is entered. Yields the count
    of those places the block passed (a list of one)."""
    events = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        entering = event == "call" and frame.f_back is not None and frame.f_back.f_code in own
        if entering or (event == "c_return" and frame.f_code in own):
            events[0] += 1
            if events[0] == landing:
                sys.setprofile(None)
                raise KeyboardInterrupt

    sys.setprofile(profile)
    try:
        yield events
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)


def test_a_ctrl_c_as_vllm_takes_a_tiers_results_loses_none_and_hands_none_out_twice(
    tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """Stores over in the tier, vLLM's step takes their results, and a Ctrl-C lands in the
    adapter's making of them: as each call it makes returns, or as it enters a function of
    its own, in turn. The next steps hand each job to vLLM once: no block stays pinned, each
    loads back. (A Ctrl-C as the second result was made lost it and the ones after: their
    chunks pinned for good.)"""
    from kvfsm.nixl_agents import make_agent  # noqa: PLC0415
    from kvfsm.vllm import _Adapter  # noqa: PLC0415

    agent = FaultyAgent(make_agent("vllm-ctrl-c", "POSIX"))
    engine = engines(file_entry(tmp_path, agent=agent), primary_chunks=8)
    adapter = the_tier(engine)
    own = {_Adapter.get_finished_jobs.__code__, _Adapter._tell.__code__}
    handed: list[int] = []  # the job ids of the results vLLM got

    def get_finished_jobs() -> list[Any]:
        results = list(_Adapter.get_finished_jobs(adapter))
        handed.extend(result.job_id for result in results)
        return results

    adapter.get_finished_jobs = get_finished_jobs
    seeds = iter(range(1, 10_000))
    for landing in range(1, 200):
        handed.clear()
        stored: dict[bytes, bytes] = {}
        agent.inject("transfer", StayProc(20), times=3)  # running through the requests' steps
        for request in range(3):  # three jobs, two blocks each
            two = blocks(next(seeds), next(seeds))
            engine.offload(f"R{landing}.{request}", two)
            stored.update(two)
        adapter._tier.drain_jobs(5)  # over, not yet vLLM's
        assert adapter._tier.has_pending_work(), "the results are waiting for the step"
        told = adapter._counts.get(("store", "ok"), 0)
        with ctrl_c_at_event(landing, own) as events:
            engine.end_step()
        if adapter._taken or adapter._made:  # results owed to vLLM: pending work
            assert adapter.has_pending_work(), f"Ctrl-C at event {landing}"
        engine.settle()
        # each store's stats (and KV event) told at least once
        assert adapter._counts.get(("store", "ok"), 0) >= told + 3, f"Ctrl-C at event {landing}"
        assert engine.pinned_chunks() == 0, f"a chunk pinned, Ctrl-C at event {landing}"
        assert engine.fetch(f"F{landing}", list(stored)) == stored
        engine.settle()
        assert len(handed) == len(set(handed)) >= 3, f"Ctrl-C at event {landing}: {handed}"
        if events[0] < landing:  # every place swept: the step ran whole
            break
    else:
        raise AssertionError("more places than expected")
    assert landing > 10


def test_a_store_whose_lifecycle_action_raises_as_it_is_posted_is_reported_once(
    engines: Callable[..., Engine], tmp_path: Path,
) -> None:
    """An action of the user's lifecycle raises as the store's post is filed: the tier took
    the job, so vLLM hears of it once, when it is over (it heard a failure at once, and then
    the success, and its manager raised AssertionError on the second; meanwhile it had
    unpinned chunks NIXL was reading)."""
    from kvfsm import TRANSFER_MACHINE  # noqa: PLC0415

    raised: list[int] = []

    def note_started(transfer: Any, answer: Any, detail: Any) -> None:
        if not raised:
            raised.append(transfer.job_id)
            raise RuntimeError("the user's action failed")

    noting = TRANSFER_MACHINE.extend(
        "noting", replace={("SUBMITTED", "post", "running"): {
            "dest": "PROCESSING", "after": ["note_started"]}},
        actions={"note_started": note_started})
    engine = engines(file_entry(tmp_path, machine=noting), primary_chunks=2)
    engine.offload("a", blocks(1))
    engine.settle()
    assert raised and engine.pinned_chunks() == 0
    assert stored(the_tier(engine)) == [the_tier(engine).tier.remote_name(key(1))]


def test_an_in_flight_bound_below_one_cascade_says_its_stores_are_all_dropped(
    engines: Callable[..., Engine], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """``in_flight`` bytes of two chunks, and a cascade of three to an idle tier: vLLM drops
    the store, as back-pressure, and so every such store, for good. kvfsm says so once, naming
    the bound (nothing in its log said it; only vLLM's dropped-store metrics showed it)."""
    engine = engines(file_entry(tmp_path, in_flight={"bytes": 2 * CHUNK_BYTES}),
                     primary_chunks=4)
    with caplog.at_level("WARNING", logger="kvfsm"):
        for request in range(2):
            engine.offload(f"r{request}", blocks(*range(10 * request, 10 * request + 3)))
            engine.settle()
    said = [r.getMessage() for r in caplog.records
            if "with nothing in flight: every such store is dropped" in r.getMessage()]
    assert said == [f"FileTier: a store of 3 chunk(s) ({3 * CHUNK_BYTES} bytes) is more than "
                    f"in_flight bytes {2 * CHUNK_BYTES} allow with nothing in flight: every "
                    "such store is dropped (vLLM counts them as backpressure_stores_dropped); "
                    "raise in_flight bytes to the largest store vLLM cascades, or drop the "
                    "bound"], "once"
    assert stored(the_tier(engine)) == []
