"""vLLM 0.33's real tiering manager, driven the way its scheduler-side connector drives it.

Tests build the manager through vLLM's own configuration path (``OffloadingConfig`` ->
``TieringOffloadingSpec(...).get_manager()``), naming kvfsm's tiers in ``secondary_tiers``, and
play the connector: per step, lookups (which poll the tiers), ``prepare_store``, the worker's
copy into the primary's chunks, ``on_schedule_end``; the next step ``complete_store`` (which
cascades to the tiers), ``on_request_finished``. Every call but ``shutdown()`` holds the
manager's lock, as the connector's do.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

CHUNK_BYTES = 4096  # one block a chunk; vLLM rounds chunks up to 4096 bytes
STEP_SECONDS = 0.001  # between two scheduler steps


def require_vllm() -> None:
    """Skip without vLLM, except under CI, where its absence is a setup failure."""
    try:
        # vLLM's import chain warns about deprecated torch APIs: not kvfsm's concern
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import vllm.v1.kv_offload.tiering.factory  # noqa: PLC0415
            import vllm.v1.kv_offload.tiering.spec  # noqa: F401, PLC0415

            import kvfsm.vllm  # noqa: F401, PLC0415
    except ImportError as error:
        if os.environ.get("CI") == "true":
            raise AssertionError(f"CI must run the vLLM tests, but vLLM does not import: "
                                 f"{error} (scripts/install-vllm)") from error
        pytest.skip(f"vLLM 0.33 is not installed (scripts/install-vllm): {error}")


def offloading_spec(tiers: Sequence[dict[str, Any]] = (), *, primary_chunks: int = 4,
                    events: bool = True, tier_poll_interval: float = 0,
                    model: str = "kvfsm-test-model", dtype: str = "float16",
                    chunk_bytes: int = CHUNK_BYTES, engine_id: str = "kvfsm-test",
                    tp_size: int = 1, kv_cache_layout: str | None = None) -> Any:
    """vLLM's offloading spec for a model (its name and dtype) with one layer of blocks of
    ``chunk_bytes`` (a layout vLLM calls parallelism-agnostic, on ``tp_size`` workers, in
    ``kv_cache_layout``), and ``tiers`` behind a primary of ``primary_chunks`` chunks."""
    from vllm.v1.kv_offload.config import (  # noqa: PLC0415
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: PLC0415

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",),
                                      group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": primary_chunks * chunk_bytes,
                      "eviction_policy": "lru", "tier_poll_interval_s": tier_poll_interval,
                      "secondary_tiers": list(tiers)},
        engine_id=engine_id, kv_cache_layout=kv_cache_layout,
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True))
    return TieringOffloadingSpec(config)


class Engine:
    """A vLLM tiering manager with kvfsm tiers, and the scheduler steps that drive it."""

    def __init__(self, tiers: Sequence[dict[str, Any]], *, primary_chunks: int = 4,
                 events: bool = True, tier_poll_interval: float = 0,
                 model: str = "kvfsm-test-model", dtype: str = "float16",
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext  # noqa: PLC0415

        self.engine_id = f"kvfsm-test-{uuid.uuid4().hex[:8]}"
        self.chunk_bytes = chunk_bytes
        self.spec = offloading_spec(tiers, primary_chunks=primary_chunks, events=events,
                                    tier_poll_interval=tier_poll_interval, model=model,
                                    dtype=dtype, chunk_bytes=chunk_bytes,
                                    engine_id=self.engine_id)
        self.manager = self.spec.get_manager()
        self._end = ScheduleEndContext
        self._new: list[str] = []
        self.events: list[Any] = []

    # -- the view of the primary -------------------------------------------------------------

    @property
    def view(self) -> memoryview:
        return self.manager.primary_tier.get_kv_memoryview().cast("B")

    @property
    def tier_objects(self) -> list[Any]:
        """vLLM's secondary tier objects (kvfsm.vllm adapters)."""
        return list(self.manager.secondary_tiers)

    def chunk(self, chunk_id: int) -> bytes:
        size = self.chunk_bytes
        return bytes(self.view[chunk_id * size:(chunk_id + 1) * size])

    # -- scheduler steps ---------------------------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[Any]:
        with self.manager.lock:
            yield self.manager

    def request(self, req_id: str) -> Any:
        from vllm.v1.kv_offload.base import ReqContext  # noqa: PLC0415

        context = ReqContext(req_id=req_id)
        with self.locked() as manager:
            manager.on_new_request(context)
        self._new.append(req_id)
        return context

    def end_step(self) -> None:
        with self.locked() as manager:
            manager.on_schedule_end(self._end(new_req_ids=list(self._new), preempted_req_ids=[]))
            self.events += list(manager.take_events())
        self._new = []

    def offload(self, req_id: str, blocks: dict[bytes, bytes], *,
                lookup: bool = True) -> list[bytes]:
        """A request whose blocks the worker computed: store them (two steps); returns the
        keys the primary took. ``lookup=False``: the scheduler computed them without asking
        the tiers first."""
        context = self.request(req_id)
        keys = list(blocks)
        with self.locked() as manager:
            if lookup:
                for key in keys:
                    manager.lookup(key, context)
            prepared = manager.prepare_store(keys, context)
        stored: list[bytes] = []
        if prepared is not None:
            stored = list(prepared.keys_to_store)
            # the worker copies each block into the chunk the primary gave it
            for key, chunk_id in zip(stored, prepared.store_spec.chunk_ids, strict=True):
                start = int(chunk_id) * self.chunk_bytes
                self.view[start:start + self.chunk_bytes] = blocks[key]
        self.end_step()
        with self.locked() as manager:
            if stored:
                manager.complete_store(set(stored), context)  # the connector passes a set
            manager.on_request_finished(context)
        self.end_step()
        return stored

    def lookup_until_settled(self, req_id: str, keys: Sequence[bytes],
                             steps: int = 5000) -> tuple[Any, list[Any]]:
        """Look the keys up, step after step, until none is pending; the answers."""
        from vllm.v1.kv_offload.base import LookupResult  # noqa: PLC0415

        context = self.request(req_id)
        answers: list[Any] = []
        for _ in range(steps):
            with self.locked() as manager:
                answers = [manager.lookup(key, context) for key in keys]
            self.end_step()
            if all(a in (LookupResult.HIT, LookupResult.MISS) for a in answers):
                break
            time.sleep(STEP_SECONDS)
        return context, answers

    def fetch(self, req_id: str, keys: Sequence[bytes],
              steps: int = 5000) -> dict[bytes, bytes | None]:
        """A request that needs the blocks: look them up until each is HIT or MISS (a tier HIT
        is promoted into the primary meanwhile), load the hits; returns each key's bytes, None
        for a miss. The request is finished at the end."""
        from vllm.v1.kv_offload.base import LookupResult  # noqa: PLC0415

        context, answers = self.lookup_until_settled(req_id, keys, steps)
        hits = [key for key, a in zip(keys, answers, strict=True) if a is LookupResult.HIT]
        found: dict[bytes, bytes | None] = dict.fromkeys(keys)
        if hits:
            with self.locked() as manager:
                spec = manager.prepare_load(hits, context)
            for key, chunk_id in zip(hits, spec.chunk_ids, strict=True):
                found[key] = self.chunk(int(chunk_id))
            with self.locked() as manager:
                manager.complete_load(hits, context)
        with self.locked() as manager:
            manager.on_request_finished(context)
        self.end_step()
        return found

    def settle(self, seconds: float = 30.0) -> None:
        """Step (a step each millisecond, as an engine would) until no tier has pending
        work."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with self.locked() as manager:
                pending = manager.has_pending_work()
            if not pending:
                return
            self.end_step()
            time.sleep(STEP_SECONDS)
        raise AssertionError(f"the tiers still had pending work after {seconds} s of steps")

    def pinned_chunks(self) -> int:
        """Primary chunks with a ref count above 0 (pinned by a job or a load)."""
        primary = self.manager.primary_tier
        return sum(1 for chunk in _chunks(primary) if chunk.ref_cnt > 0)

    def reset_cache(self) -> None:
        with self.locked() as manager:
            manager.reset_cache()

    def shutdown(self) -> None:
        self.manager.shutdown()

    def mapped(self) -> bool:
        """True while this process still maps the primary's region (an array over vLLM's view
        left alive keeps it mapped after vLLM's shutdown)."""
        with open("/proc/self/maps") as maps:
            return self.engine_id in maps.read()

    def shm_files(self) -> list[str]:
        """This engine's shared-memory files under /dev/shm."""
        return [name for name in os.listdir("/dev/shm") if self.engine_id in name]


def _chunks(primary: Any) -> list[Any]:
    """The primary's chunk records (vLLM 0.33's CPU primary keeps them in its policy, by
    key)."""
    return list(primary._policy.chunks.values())


def block(seed: int, size: int = CHUNK_BYTES) -> bytes:
    """``size`` bytes distinct for each seed."""
    return bytes((seed * 131 + i * 7) % 251 for i in range(size))


def key(seed: int) -> bytes:
    """A vLLM OffloadKey: a 32-byte block hash and a 4-byte group index."""
    from vllm.v1.kv_offload.base import make_offload_key  # noqa: PLC0415

    return make_offload_key(seed.to_bytes(32, "big"), 0)
