"""kvfsm's tiers as secondary tiers of vLLM 0.33's tiered KV offload.

vLLM's ``TieringOffloadingManager`` loads an out-of-tree secondary tier by class name and module
path. Naming one of these in vLLM's offloading configuration puts kvfsm's object-store or file
tier behind vLLM's primary CPU cache::

    "secondary_tiers": [
        {"type": "ObjectStoreTier", "module_path": "kvfsm.vllm",
         "bucket": "kv-cache", "endpoint": "http://127.0.0.1:9000",
         "capacity_bytes": 64 << 30, "retry": {"max_seconds": 30}},
        {"type": "FileTier", "module_path": "kvfsm.vllm", "directory": "/mnt/nvme/kv",
         "capacity_bytes": 256 << 30},
    ]

Every other key of an entry is the tier's own setting (see :class:`ObjectStoreTier` and
:class:`FileTier`). What vLLM's contract asks, and how it is kept:

- the primary is vLLM's memoryview, wrapped without a copy (``torch.frombuffer``); keys are
  vLLM's ``OffloadKey`` bytes, paired with ``chunk_ids`` in the job's iteration order;
- a submit never raises into the manager (the job's chunks are pinned already): a job the tier
  cannot start (a bad job, a full tier, a closed tier, a NIXL call that raised) is a failed
  result on the next ``get_finished_jobs()``;
- a store skips the keys the tier knows it holds and reports the bytes it moved;
- results between steps: the tier lets vLLM's tier-poll thread poll it (its
  ``tolerates_off_thread_polling``), so with ``tier_poll_interval_s`` above 0 (vLLM's default
  is 1 ms) finished jobs are collected and their chunks unpinned between scheduler steps, and
  a step's own poll finds only what ended since;
- back-pressure: with ``in_flight`` set (the :class:`kvfsm.policy.InFlightLimit` fields, as
  a dict) and no back-pressure of vLLM's configured for the tier, the tier's detector tells
  vLLM's manager the tier is saturated once a store would take it past the bound, and the
  manager does not cascade the store there (it pins nothing; vLLM counts the store dropped);
  a store that reaches the tier past the bound all the same is a failed result;
- blocks of other models and KV layouts are never loaded: vLLM's keys hash tokens only, so a
  tier keeps its blocks under its ``prefix`` or ``directory`` in a folder of their model and
  layout (:func:`namespace`), and engines of other ones find nothing there;
- a promotion loads the keys the tier holds; one whose keys were removed since the lookup (the
  tier evicted them) fails and names the keys that did load (``successful_keys``); a key whose
  load failed is a MISS from then on, for every request (no reload loop);
- ``drain_jobs()`` waits for NIXL, never aborts a running transfer, and leaves every result for
  the next ``get_finished_jobs()``; ``shutdown()`` leaves nothing registered and drops every
  array over the view, so vLLM can unmap its primary;
- ``build_metric_definitions`` / ``get_stats`` report kvfsm's figures as vLLM metrics, and
  ``take_events`` what the tier stored and removed.

This module imports vLLM; ``import kvfsm`` never does.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import re
import sys
import time
import warnings
import weakref
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

# vLLM's own import chain warns about torch APIs it uses (DeprecationWarning): not something a
# kvfsm user can act on, so it is not shown
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
        OffloadingMetricMetadata,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
    )
    from vllm.v1.kv_offload.file_mapper import FileMapper
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector, DropStorePolicy
    from vllm.v1.kv_offload.tiering.base import JobResult as VllmResult
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
    from vllm.v1.kv_offload.tiering.base import TransferJob as VllmJob

from kvfsm import tiers
from kvfsm.contract import DrainTimeout, check_timeout
from kvfsm.driver import MachineRefused
from kvfsm.machines import load_machine, load_steps
from kvfsm.nixl_agents import BucketUnreachable, StoreConfig
from kvfsm.policy import InFlightLimit, RetryPolicy
from kvfsm.tiers.base import Lookup, SecondaryTier, shown_keys
from kvfsm.tiers.object_store import check_key_prefix
from kvfsm.transfer import JobResult, TransferJob

__all__ = ["FileTier", "HandlesHeld", "ObjectStoreTier", "namespace"]

logger = logging.getLogger("kvfsm.vllm")

_LOOKUP = {Lookup.HIT: LookupResult.HIT, Lookup.MISS: LookupResult.MISS,
           Lookup.RETRY: LookupResult.RETRY}

#: the label every kvfsm metric carries: the tier's ``type`` (vLLM's own ``tier`` label is the
#: manager's, which a tier does not know)
TIER = "kvfsm_tier"
_PREFIX = "vllm:kv_offload_kvfsm_"
JOBS = _PREFIX + "jobs"
BYTES = _PREFIX + "bytes"
RETRIES = _PREFIX + "release_retries"
LEAKS = _PREFIX + "leaks"
QUARANTINED = _PREFIX + "quarantined"
IN_FLIGHT = _PREFIX + "in_flight"
SECONDS = _PREFIX + "transfer_seconds"
REMOVED = _PREFIX + "removed_blocks"
HELD = _PREFIX + "held_bytes"

#: the most events kept for ``take_events`` when vLLM does not take them (oldest dropped)
EVENT_LIMIT = 1 << 16


class HandlesHeld(RuntimeError):
    """Shutdown found transfers quarantined with their NIXL handles held: vLLM's CPU cache
    stays registered with NIXL, so it must not be unmapped."""


@dataclass(slots=True)
class _Job:
    """What the adapter remembers of a job it handed to the kvfsm tier."""

    load: bool
    #: the keys given to the kvfsm tier
    moved: list[OffloadKey]
    #: a promotion's keys the tier no longer held (not loaded: the result fails)
    missing: list[OffloadKey] = field(default_factory=list)


#: how much of a model's name a namespace keeps (its digest tells the rest apart)
_MODEL_TEXT = 64


def namespace(offloading_spec: Any, chunk_bytes: int) -> str:
    """The folder a tier keeps its blocks in for one model and KV layout: ``<model>_<digest>``.

    vLLM's block keys are hashes of tokens, so engines serving other models, dtypes, block sizes
    or parallel layouts make the same keys: a block one of them stored would load into the other
    as a success, with the other's bytes (and an object smaller than the chunk fills only part
    of it). A tier therefore keeps its blocks under its ``prefix`` or ``directory`` in a folder
    of their own. The digest is over what vLLM's own storage tiers name their folders by
    (vLLM's ``FileMapper``: the model's name, the KV cache's dtype, tokens per hash, blocks per
    chunk, the KV cache groups and their layers, the canonical format), the parallel layout
    (always: a chunk holds every worker's slice of a block in rank order, so with more than one
    layer tensor-parallel sizes order its bytes differently, even where vLLM calls the layout
    parallelism-agnostic), the KV cache's memory layout (``kv_cache_layout``: NHD, HND...) and
    the chunk's size in bytes. The model's name leads, made one safe folder name, for
    operators. What vLLM's offloading config does not carry cannot count: a model's revision,
    its quantization or RoPE scaling, fp8 scales; engines that differ only there need a
    ``prefix`` or ``directory`` each.
    """
    try:
        mapper = FileMapper.from_offloading_spec(
            "", offloading_spec, blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=False)
        layout = offloading_spec.config.kv_cache_layout
    except AttributeError as error:
        raise ValueError(f"the offloading spec does not say the model and KV layout its tier "
                         f"serves ({error}); a kvfsm tier names its folder by them") from None
    fields = {**mapper.get_run_config(), "kv_cache_layout": layout, "chunk_bytes": chunk_bytes}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", str(fields["model_name"]))
    model = model.lstrip(".")[:_MODEL_TEXT] or "model"
    return f"{model}_{digest}"


class _Adapter(SecondaryTierManager):  # type: ignore[misc]  # vLLM is not type-checked here
    """The vLLM side of one kvfsm tier (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    #: vLLM's manager may also poll the tier from its tier-poll thread between steps (with
    #: ``tier_poll_interval_s`` above 0), always under its lock: kvfsm's tier takes calls from
    #: any thread (one at a time, under the tier's own lock too), so results are collected,
    #: and pins dropped, between scheduler steps rather than at the next one
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, capacity_bytes: int | None = None,
                 retry: Mapping[str, Any] | None = None, shutdown_timeout: float | None = 30.0,
                 enable_kv_events: bool = False, locality: str | None = None,
                 label: str | None = None, in_flight: Mapping[str, Any] | None = None,
                 **settings: Any) -> None:
        who, where = _named_tier(tier_type, label, shutdown_timeout, locality)
        _log_where_vllm_does()
        limit = _limit(who, in_flight)
        if backpressure_detector is None and (limit is not None
                                              or settings.get("read_only") is True):
            backpressure_detector = _Saturation(self)  # (a read-only tier: always declines)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = where
        #: what the tier's metrics and events are labelled with: ``label``, else its type (two
        #: tiers of one type need labels of their own, or vLLM counts them as one)
        self.label = label or tier_type
        _check_label(self, offloading_spec)
        self.shutdown_timeout = shutdown_timeout
        if type(enable_kv_events) is not bool:  # ("false" from a configuration is no False)
            raise ValueError(f"{who}: enable_kv_events must be true or false, got "
                             f"{enable_kv_events!r}")
        events_on = enable_kv_events and bool(getattr(
            getattr(offloading_spec, "kv_events_config", None), "enable_kv_cache_events", False))
        self._events: deque[OffloadingEvent] | None = (
            deque(maxlen=EVENT_LIMIT) if events_on else None)
        #: without a capacity the tier records nothing it holds: stores are reported from here
        self._report_stores = capacity_bytes is None
        policy = _policy(who, retry)
        chunks = len(primary_kv_view)
        chunk_bytes = self.block_size_bytes
        if limit is not None and limit.bytes is not None and limit.bytes < chunk_bytes:
            raise ValueError(f"{who}: in_flight bytes {limit.bytes} is less than one "
                             f"chunk ({chunk_bytes} bytes): every store would be refused")
        # zero copy: the tensor is vLLM's memory (dropped again in shutdown)
        primary = torch.frombuffer(primary_kv_view, dtype=torch.uint8).view(chunks, chunk_bytes)
        #: the folder this tier's blocks go in, under its ``prefix`` or ``directory``: one per
        #: model and KV layout (:func:`namespace`)
        self.namespace = namespace(offloading_spec, chunk_bytes)
        self._check_settings(settings)
        settings = self._named(settings)
        try:
            self._tier: SecondaryTier | None = self._build(
                primary, self.namespace, policy=policy, capacity_bytes=capacity_bytes,
                record_events=capacity_bytes is not None, in_flight=limit, **settings)
        except MachineRefused as error:  # (which of the configuration's tiers refused it)
            raise MachineRefused(f"{who}: {error}") from None
        except (ValueError, BucketUnreachable) as error:  # a setting the tier refused, a
            # store it cannot reach: which tier's, too
            if (len(error.args) == 1 and isinstance(error.args[0], str)
                    and not error.args[0].startswith(f"{who}:")):
                error.args = (f"{who}: {error.args[0]}",)
            raise
        logger.info("%s: blocks kept in the folder %s (this model's and KV layout's)",
                    self.label, self.namespace)
        self._jobs: dict[int, _Job] = {}
        #: results made without a transfer (refused jobs, stores with nothing to move)
        self._ready: list[VllmResult] = []
        #: the tier's results not yet made vLLM's (a Ctrl-C cut the making short), and those
        #: made, with the tier's result each was made of, not yet handed out
        self._taken: deque[JobResult] = deque()
        self._made: list[tuple[JobResult, VllmResult]] = []
        #: what get_stats reported last (its counters report what grew since)
        self._reported: dict[str, float] = {}
        self._observed: list[tuple[str, float]] = []  # (kind, seconds) since get_stats
        self._counts: dict[tuple[str, str], int] = {}  # (kind, outcome) -> jobs
        self._bytes: dict[str, int] = {"store": 0, "load": 0}

    #: the kvfsm tier behind the adapter, whose own keywords are settings too
    _tier_class: ClassVar[type[SecondaryTier]]
    #: what the adapter gives the tier itself, never a setting (retry makes the policy)
    _OWN = frozenset({"policy", "record_events", "store", "key_prefix", "size_folder"})

    def _check_settings(self, settings: Mapping[str, Any]) -> None:
        """Refuse, by name, a setting neither the adapter nor its tier takes (a typo such as
        ``capacity_byte`` would otherwise reach the tier's constructor as a TypeError)."""
        known = {name for function in (type(self).__init__, self._build,
                                       self._tier_class.__init__)
                 for name, parameter in inspect.signature(function).parameters.items()
                 if parameter.kind is inspect.Parameter.KEYWORD_ONLY} - self._OWN
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"{self.label}: unknown setting(s) {', '.join(unknown)}; "
                             f"its settings: {', '.join(sorted(known))}")

    def _named(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """``machine`` and ``steps`` given as text (what a JSON configuration can say) are
        named as ``kvfsm explore`` names them, ``module:ATTRIBUTE`` (a machine also by one of
        kvfsm's names): loaded here, or refused naming the setting and why."""
        named = dict(settings)
        for setting, load in (("machine", load_machine), ("steps", load_steps)):
            if isinstance(named.get(setting), str):
                try:
                    named[setting] = load(named[setting])
                except ValueError as error:
                    raise ValueError(f"{self.label}: {setting}: {error}") from None
        return named

    def _build(self, primary: torch.Tensor, folder: str, **options: Any) -> SecondaryTier:
        raise NotImplementedError

    @property
    def tier(self) -> SecondaryTier:
        """The kvfsm tier behind this adapter (its stats, its state per job)."""
        if self._tier is None:
            raise tiers.TierClosedError(f"{self.tier_type} is shut down")
        return self._tier

    # -- lookups ---------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        tier = self._tier
        if tier is None:
            return LookupResult.MISS
        try:
            return _LOOKUP[tier.lookup(key)]
        except Exception as error:  # a key the tier cannot name, a closed tier: not held
            logger.warning("%s: lookup of %s answered MISS: %s", self.label, key.hex(),
                           error)
            return LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        tier = self._tier
        if tier is not None:
            try:
                tier.touch(list(keys))
            except ValueError as error:
                logger.warning("%s: touch ignored: %s", self.label, error)

    # -- jobs ------------------------------------------------------------------------------

    def submit_store(self, job_metadata: VllmJob) -> None:
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: VllmJob) -> None:
        self._submit(job_metadata, load=True)

    def _submit(self, job: VllmJob, *, load: bool) -> None:
        kind = "load" if load else "store"
        if self._unreported(job.job_id):  # vLLM's ids are unique: a caller's bug, refused
            # without touching the job in flight, and with no result (nor counted): one under
            # the id would be taken for the other's, whose chunks NIXL may still move
            logger.error("%s: %s job %d refused, with no result: a job of that id is in "
                         "flight or its result not yet taken (that result is the one result "
                         "of the id)", self.label, kind, job.job_id)
            return
        try:
            tier = self.tier
            keys = list(job.keys)
            chunks = [int(c) for c in job.chunk_ids]
            if len(keys) != len(chunks):
                raise tiers.InvalidJobError(f"{len(keys)} keys but {len(chunks)} chunk ids")
            pairs: list[tuple[OffloadKey, int]] = []
            missing: list[OffloadKey] = []
            held: list[OffloadKey] = []
            for k, c in zip(keys, chunks, strict=True):
                verdict = tier.verdict(k)
                if load and verdict is Lookup.MISS:  # removed (or failed) since the lookup
                    missing.append(k)
                elif load or verdict is not Lookup.HIT:  # a store skips what the tier holds
                    pairs.append((k, c))
                else:
                    held.append(k)
            if held:  # used now: the room the others make is not made by evicting these
                tier.touch(held)
            if missing:  # (vLLM's result has no reason: the log says why it failed)
                logger.warning("%s: load job %d fails: %d of its keys are no longer in the "
                               "tier (removed, or a transfer of them failed, since vLLM looked "
                               "them up): %s", self.label, job.job_id, len(missing),
                               shown_keys(missing))
            if not pairs:
                self._ready_result(job.job_id, kind, success=not load, outcome=(
                    "missing" if load else "skipped"))
                return
            moved = [k for k, _ in pairs]
            entry = _Job(load, moved, missing)
            self._jobs[job.job_id] = entry  # before the submit: a result may come at once
            try:
                submit = tier.submit_load if load else tier.submit_store
                submit(TransferJob(job.job_id, moved, [c for _, c in pairs],
                                   is_promotion=load))
            except BaseException:
                if not tier.owes(job.job_id):  # (an interrupt may land once the tier took it:
                    self._jobs.pop(job.job_id, None)  # its result comes, and is reported)
                raise
        except Exception as error:  # never into the manager: the job fails, its pins go
            logger.warning("%s: %s job %d refused, reported as failed: %s: %s", self.label,
                           kind, job.job_id, type(error).__name__, error)
            self._ready_result(job.job_id, kind, success=False, outcome="refused")

    def _unreported(self, job_id: int) -> bool:
        """A job of this id is in flight, or its result is made and not yet handed out."""
        return (job_id in self._jobs or any(r.job_id == job_id for r in self._ready)
                or any(r.job_id == job_id for _, r in self._made))

    def _ready_result(self, job_id: int, kind: str, *, success: bool, outcome: str) -> None:
        self._count(kind, outcome)
        self._ready.append(VllmResult(job_id=job_id, success=success,
                                      successful_keys=None if success else [],
                                      transfer_time=0.0, transfer_bytes=0))

    def get_finished_jobs(self) -> Iterable[VllmResult]:
        """The jobs finished since the last call, as vLLM's results. A Ctrl-C landing in the
        call loses none: the tier's results are kept until each is made vLLM's, and a result
        made is kept until handed out, each once (its stats and KV event told at least once:
        a Ctrl-C between telling and keeping it tells them again)."""
        tier = self._tier
        if tier is not None:  # (should it raise, the results ready wait for the next call)
            self._taken.extend(tier.get_finished_jobs())
        taken, made = self._taken, self._made
        while taken:
            done = taken[0]
            if not made or made[-1][0] is not done:  # (else made, its popleft cut short)
                job = self._jobs[done.job_id]
                success = done.success and not job.missing
                self._tell(job, done, success)  # (first: told again, rather than never, if
                # a Ctrl-C comes before the result is kept)
                made.append((done, VllmResult(
                    job_id=done.job_id, success=success,
                    successful_keys=None if success else (list(job.moved) if done.success
                                                          else []),
                    transfer_time=done.transfer_time, transfer_bytes=done.transfer_size)))
            self._jobs.pop(done.job_id, None)
            taken.popleft()
        results = self._ready + [result for _, result in made]
        self._ready, self._made = [], []
        return results

    def _tell(self, job: _Job, done: JobResult, success: bool) -> None:
        """The stats and events of a tier's result, made vLLM's."""
        kind = "load" if job.load else "store"
        self._bytes[kind] += done.transfer_size
        self._observed.append((kind, done.transfer_time))
        self._count(kind, "ok" if success else "failed")
        if success and not job.load and self._report_stores and self._events is not None:
            self._events.append(self._event(job.moved, removed=False))

    def has_pending_work(self) -> bool:
        tier = self._tier
        # a job is pending until vLLM has its result (a tier's progress thread may publish
        # it while another of vLLM's threads is taking results)
        return (bool(self._ready) or bool(self._jobs) or bool(self._taken) or bool(self._made)
                or (tier is not None and tier.has_pending_work()))

    def drain_jobs(self) -> None:
        """Wait until NIXL finished every transfer (never aborting one); the results come
        with the next ``get_finished_jobs()``. Transfers still running are logged (with their
        states, the first five) every 5 s, and waited for; a release that keeps failing ends
        in quarantine as the retry policy says, a failure result like any other."""
        tier = self._tier
        if tier is None:
            return
        started = time.monotonic()
        while True:
            try:
                tier.drain_jobs(DRAIN_LOG_SECONDS)
                return
            except DrainTimeout as waiting:
                logger.warning("%s: drain_jobs still waiting after %.0f s: %s", self.label,
                               time.monotonic() - started, _first_lines(str(waiting)))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def shutdown(self) -> None:
        """Cancel what is unfinished, wait for NIXL up to ``shutdown_timeout`` seconds,
        release every handle and registration, and drop the tensor over vLLM's view.

        Raises:
            DrainTimeout: NIXL still ran transfers at the deadline: the primary stays
                registered and mapped; calling shutdown again waits on.
            HandlesHeld: a transfer was quarantined with its handles held (a release that
                kept failing), so vLLM's memory stays registered with NIXL. vLLM's manager
                re-raises it and so leaves its CPU cache mapped, rather than unmapping memory
                NIXL still knows.
        """
        tier = self._tier
        if tier is None:
            return
        tier.shutdown(self.shutdown_timeout)
        leftover = tier.get_finished_jobs()  # the cancelled jobs' results: nobody asks now
        for done in leftover:
            self._jobs.pop(done.job_id, None)
        figures = tier.stats()
        if figures["quarantined"] or figures["quarantined_running"]:
            raise HandlesHeld(
                f"{self.label}: {figures['quarantined']} quarantined transfer(s) keep NIXL "
                f"handles over vLLM's CPU cache ({figures['quarantined_running']} of them may "
                "still run): it stays registered with NIXL, and must stay mapped")
        self._tier = None  # the tier held the only tensor over the view

    # -- events and metrics ----------------------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        tier, events = self._tier, self._events
        if events is None:
            if tier is not None:
                tier.take_events()  # not wanted: keep the record from growing
            return []
        if tier is not None:
            events.extend(self._event(list(event.keys), removed=event.removed)
                          for event in tier.take_events())
        taken = list(events)
        events.clear()
        return taken

    def _event(self, keys: list[Any], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(keys=keys, medium=self.medium, removed=removed,
                               locality=self.locality, ownership=self.label)

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any],
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return {
            JOBS: OffloadingCounterMetadata(
                "Jobs a kvfsm tier reported, by kind (store, load) and outcome (ok, failed; "
                "refused: never started; skipped: a store of blocks held already; missing: a "
                "load of blocks removed since the lookup).", (TIER, "kind", "outcome")),
            BYTES: OffloadingCounterMetadata(
                "Bytes a kvfsm tier moved, by kind.", (TIER, "kind")),
            RETRIES: OffloadingCounterMetadata(
                "Failed NIXL releases a kvfsm tier retried (bounded by its retry policy).",
                (TIER,)),
            LEAKS: OffloadingCounterMetadata(
                "Best-effort NIXL cleanup calls that failed (metadata, never memory).", (TIER,)),
            QUARANTINED: OffloadingGaugeMetadata(
                "Transfers a kvfsm tier gave up releasing: their handles stay held.", (TIER,)),
            IN_FLIGHT: OffloadingGaugeMetadata(
                "A kvfsm tier's transfers in flight, by lifecycle state.", (TIER, "state")),
            SECONDS: OffloadingHistogramMetadata(
                "Seconds from a kvfsm tier's submit to its transfer's end, by kind.",
                (TIER, "kind"),
                buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30)),
            REMOVED: OffloadingCounterMetadata(
                "Blocks a kvfsm tier removed to stay within its capacity.", (TIER,)),
            HELD: OffloadingGaugeMetadata(
                "Bytes of blocks a kvfsm tier holds (with a capacity).", (TIER,)),
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        tier = self._tier
        stats = OffloadingConnectorStats()
        label = (self.label,)
        for (kind, outcome), count in self._counts.items():
            stats.increase_counter(JOBS, count, (*label, kind, outcome))
        self._counts.clear()
        for kind, moved in self._bytes.items():
            if moved:
                stats.increase_counter(BYTES, moved, (*label, kind))
                self._bytes[kind] = 0
        for kind, seconds in self._observed:
            stats.observe_histogram(SECONDS, seconds, (*label, kind))
        self._observed.clear()
        if tier is None:
            return stats
        figures = tier.stats()
        holdings = figures.get("holdings")
        totals = {RETRIES: figures["retries"], LEAKS: figures["leaks"]}
        if holdings is not None:
            totals[REMOVED] = holdings["removed"]
            stats.set_gauge(HELD, holdings["held_bytes"], label)
        for name, total in totals.items():
            grew = total - self._reported.get(name, 0)
            if grew:
                stats.increase_counter(name, grew, label)
            self._reported[name] = total
        stats.set_gauge(QUARANTINED, figures["quarantined"], label)
        for state in tier.machine.declaration.states:
            stats.set_gauge(IN_FLIGHT, figures["in_flight"].get(state.name, 0),
                            (*label, state.name))
        return stats

    def _count(self, kind: str, outcome: str) -> None:
        self._counts[kind, outcome] = self._counts.get((kind, outcome), 0) + 1

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvfsm_capacity_bytes",)

    def config_info(self) -> Mapping[str, str | int | float | bool]:
        tier = self._tier
        holdings = None if tier is None else tier.stats().get("holdings")
        return {"kvfsm_capacity_bytes": 0 if holdings is None else holdings["capacity_bytes"]}


class ObjectStoreTier(_Adapter):
    """kvfsm's object-store tier (:class:`kvfsm.tiers.ObjectStoreTier`) for vLLM.

    Settings (keywords of the tier's entry in vLLM's ``secondary_tiers``):

    - ``bucket`` (required), ``endpoint`` (``http(s)://host:port``; None for AWS),
      ``access_key``/``secret_key``, ``region``, ``use_virtual_addressing``,
      ``req_checksum``, ``io_threads``: the store (:class:`kvfsm.nixl_agents.StoreConfig`);
    - ``prefix``: the tier's blocks are the objects ``<prefix><namespace>/<key>``, the
      namespace being the folder of the model and KV layout (:func:`namespace`);
    - ``capacity_bytes``: the most bytes of objects kept; the least recently used are deleted
      (with boto3) to make room (None: no bound);
    - ``retry``: the :class:`kvfsm.policy.RetryPolicy` fields, as a dict, but for
      ``max_running_seconds`` (refused: vLLM reuses a job's chunks once it has its result,
      and a transfer given up while NIXL runs it would go on moving them);
    - ``shutdown_timeout``: seconds shutdown waits for NIXL (None: as long as it takes);
    - ``in_flight``: back-pressure, the :class:`kvfsm.policy.InFlightLimit` fields (``jobs``,
      ``bytes``) as a dict: past the bound vLLM's manager does not cascade stores to the tier
      (module docstring);
    - ``enable_kv_events``, ``locality``: as vLLM's own tiers;
    - ``label``: names the tier in metrics and events (by default its ``type``; two tiers of
      one type need labels of their own);
    - ``machine``, ``steps``: the lifecycle the tier runs and the functions behind its own
      effects (:class:`kvfsm.tiers.ObjectStoreTier`), or their ``module:ATTRIBUTE`` names, as
      ``kvfsm explore`` takes them (what a JSON configuration can say);
    - ``poll_interval``: seconds the tier sleeps between polls while ``drain_jobs`` waits;
    - ``agent``, ``probe_agent``, ``remove``: a NIXL agent (and its deleter) to drive instead
      of making them (tests inject faults this way; objects, so a configuration built in
      Python).
    """

    _tier_class = tiers.ObjectStoreTier

    def _build(self, primary: torch.Tensor, folder: str, *, bucket: str | None = None,
               endpoint: str | None = None, access_key: str | None = None,
               secret_key: str | None = None, region: str = "us-east-1",
               use_virtual_addressing: bool = False, req_checksum: str = "required",
               io_threads: int | None = None, prefix: str = "", agent: Any = None,
               probe_agent: Any = None, remove: Any = None,
               **options: Any) -> SecondaryTier:
        check_key_prefix(prefix, "prefix")  # (the user's, before the folder is joined to it)
        prefix = f"{prefix}{folder}/"
        store = None
        if agent is None or (options.get("capacity_bytes") is not None and remove is None):
            if bucket is None:
                raise ValueError(f"{self.label}: the tier's settings need a bucket")
            store = StoreConfig(bucket, endpoint=endpoint, access_key=access_key,
                                secret_key=secret_key, region=region,
                                use_virtual_addressing=use_virtual_addressing,
                                req_checksum=req_checksum, io_threads=io_threads,
                                key_prefix=prefix)
        # the folder's digest covers the chunk's size: no folder of the size under it
        if agent is not None:
            return tiers.ObjectStoreTier(primary, agent=agent, store=store, key_prefix=prefix,
                                         size_folder=False, probe_agent=probe_agent,
                                         remove=remove, **options)
        return tiers.ObjectStoreTier(primary, store=store, probe_agent=probe_agent,
                                     size_folder=False, remove=remove, **options)


class FileTier(_Adapter):
    """kvfsm's file tier (:class:`kvfsm.tiers.FileTier`) for vLLM: one file per block.

    Settings: ``directory`` (required; the blocks are files in ``<directory>/<namespace>``,
    the folder of the model and KV layout: :func:`namespace`), ``durable`` (fsync before a store
    succeeds; default True), ``read_only`` (only load; the folder may not exist yet: MISS until
    other engines' stores make it), ``capacity_bytes``, ``retry``, ``shutdown_timeout``,
    ``in_flight``, ``enable_kv_events``, ``locality``, ``label``, ``machine``, ``steps``,
    ``poll_interval`` (as :class:`ObjectStoreTier`), ``agent`` (a NIXL agent with the POSIX
    backend, instead of one made by the tier). A tier
    that stores removes, as it starts, the temporary files of engines that are gone (a killed
    one's stores in flight: :meth:`kvfsm.tiers.FileTier.remove_stale`).
    """

    _tier_class = tiers.FileTier

    def _build(self, primary: torch.Tensor, folder: str, *, directory: str | None = None,
               durable: bool = True, agent: Any = None, **options: Any) -> SecondaryTier:
        if directory is None:
            raise ValueError(f"{self.label}: the tier's settings need a directory")
        if not isinstance(directory, str | os.PathLike) or not os.fspath(directory):
            raise ValueError(f"{self.label}: directory must be a directory's path, got "
                             f"{directory!r}")
        tier = tiers.FileTier(primary, os.path.join(directory, folder), durable=durable,
                              agent=agent, **options)
        if not tier.read_only:  # a killed engine's temporary files: nobody else removes them
            try:
                removed = tier.remove_stale()
            except OSError as error:  # (another user's file in a shared directory): left
                logger.warning("%s: temporary files of engines gone not removed: %s",
                               self.label, error)
            except BaseException:
                tier.shutdown()
                raise
            else:
                if removed:
                    logger.info("%s: removed %d temporary file(s) of engines gone",
                                self.label, removed)
        return tier


#: the live tiers of each offloading spec (one manager's), by label
_LABELLED: weakref.WeakValueDictionary[tuple[int, str], _Adapter] = (
    weakref.WeakValueDictionary())


def _check_label(adapter: _Adapter, spec: Any) -> None:
    """Warn when another live tier of the same manager (built from the same offloading spec)
    has ``adapter``'s label: vLLM counts their metrics as one, and their gauges overwrite each
    other's."""
    key = (id(spec), adapter.label)
    other = _LABELLED.get(key)
    if other is not None and getattr(other, "_offloading_spec", None) is spec:
        logger.warning("%s: another tier of this engine's is labelled %r too: vLLM counts their "
                       "metrics as one tier's (their gauges overwrite each other); give each "
                       "a \"label\" of its own", adapter.label, adapter.label)
    _LABELLED[key] = adapter


class _Saturation(BackpressureDetector):  # type: ignore[misc]
    """vLLM's back-pressure hook on a kvfsm tier's :class:`~kvfsm.policy.InFlightLimit`: under
    pressure while a store of the blocks asked about would be refused (always, for a
    read-only tier: vLLM then cascades no store to it, where each was a failed job). It holds
    the adapter weakly (the adapter holds it), and nothing once the tier is shut down."""

    def __init__(self, adapter: _Adapter) -> None:
        super().__init__(DropStorePolicy())
        self._adapter = weakref.ref(adapter)
        self._blocks = 0  # of the store asked about now
        self._said_never = False  # (a store larger than the bound allows at all: said once)

    def should_store(self, num_blocks: int) -> bool:
        self._blocks = num_blocks
        try:
            return bool(super().should_store(num_blocks))
        finally:
            self._blocks = 0

    def is_under_pressure(self) -> bool:
        adapter = self._adapter()
        tier = None if adapter is None else adapter._tier
        if tier is None or adapter is None:
            return False
        if getattr(tier, "read_only", False) is True:
            return True
        nbytes = self._blocks * tier.block_bytes
        if not tier.saturated(nbytes):
            return False
        if not self._said_never and not tier.in_flight.admits(0, 0, nbytes):
            self._said_never = True  # (said once: vLLM's backpressure metrics count them)
            logger.warning(
                "%s: a store of %d chunk(s) (%d bytes) is more than in_flight bytes %d allow "
                "with nothing in flight: every such store is dropped (vLLM counts them as "
                "backpressure_stores_dropped); raise in_flight bytes to the largest store "
                "vLLM cascades, or drop the bound", adapter.label, self._blocks, nbytes,
                tier.in_flight.bytes)
        return True

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        """Pressure is what is in flight now, not how long stores took."""

    def reset(self) -> None:
        """Nothing of the detector's own; the policy's dropped-store counts start again (as
        vLLM's own detectors do)."""
        self.policy.reset()

    @property
    def stats(self) -> dict[str, float]:
        """What is in flight and refused, read as such (not the tier's whole stats(), which
        sorts the latency window: vLLM reads this when it records metrics)."""
        adapter = self._adapter()
        tier = None if adapter is None else adapter._tier
        if tier is None:
            return {}
        figures: dict[str, float] = {**tier.in_flight_figures()}
        return figures


#: a drain waiting on NIXL logs what it waits for this often
DRAIN_LOG_SECONDS = 5.0


def _first_lines(text: str, shown: int = 5) -> str:
    """``text``'s first line and ``shown`` more (a DrainTimeout's jobs, one a line), and how
    many more it had."""
    lines = text.split("\n")
    more = len(lines) - 1 - shown
    return "\n".join(lines[:shown + 1]) + (f"\n  ... and {more} more" if more > 0 else "")


class _WhereVllmLogs(logging.Handler):
    """On kvfsm's logger in a vLLM process: each record goes to vLLM's handlers (at their
    levels), or to stderr if vLLM's logging is not configured, for as long as the application
    gave neither the root logger nor kvfsm's (nor the one the record came from, nor one
    between) another handler; from when it does, that handler has it alone (no line told
    twice)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the application's handlers have it
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:  # (from the record's logger up to kvfsm's)
            if any(handler is not self and not isinstance(handler, logging.NullHandler)
                   for handler in logger.handlers):
                return
            logger = logger.parent if logger.name != "kvfsm" else None
        theirs = [handler for handler in logging.getLogger("vllm").handlers
                  if not isinstance(handler, logging.NullHandler)]
        if not theirs:
            try:
                sys.stderr.write(self.format(record) + "\n")
            except Exception:
                self.handleError(record)
            return
        for handler in theirs:
            if record.levelno >= handler.level:
                handler.handle(record)


def _log_where_vllm_does() -> None:
    """In a vLLM process, kvfsm's log goes where vLLM's does: vLLM's result has no reason,
    so kvfsm's log is all an operator has to say why a job failed, why a submit was refused or
    what a drain waits for. vLLM's logging configuration gives its own logger handlers and
    leaves the root logger none, and kvfsm's logger has only its NullHandler, so Python's
    last resort is not used either, and every record of kvfsm's was dropped. So kvfsm's
    logger gets a :class:`_WhereVllmLogs` (once): its records at WARNING and above, as the
    root logger's level says, unless the application sets kvfsm's level."""
    ours = logging.getLogger("kvfsm")
    if not any(isinstance(handler, _WhereVllmLogs) for handler in ours.handlers):
        ours.addHandler(_WhereVllmLogs())


def _named_tier(tier_type: str, label: object, shutdown_timeout: object,
                locality: object) -> tuple[str, Locality | None]:
    """What names the tier in errors (its label, else its type: two tiers of a type are told
    apart by their labels), and its locality; refuses a bad label, shutdown timeout (refused
    here, not at vLLM's shutdown, where the tier would stay open) or locality."""
    if label is not None and (not isinstance(label, str) or not label):
        raise ValueError(f"{tier_type}: label must be a non-empty str, got {label!r}")
    who = label or tier_type
    try:
        check_timeout(shutdown_timeout)
        if shutdown_timeout is not None and shutdown_timeout < 0:  # type: ignore[operator]
            raise ValueError  # (a tier's own takes it as "at once": in a configuration, a slip)
    except ValueError:
        raise ValueError(f"{who}: shutdown_timeout must be a number of seconds >= 0 or None, "
                         f"got {shutdown_timeout!r}") from None
    if locality is None:
        return who, None
    try:
        return who, Locality(locality)
    except ValueError:
        raise ValueError(f"{who}: locality must be one of "
                         f"{', '.join(repr(place.value) for place in Locality)} or None, got "
                         f"{locality!r}") from None


def _limit(who: str, in_flight: Mapping[str, Any] | None) -> InFlightLimit | None:
    """The back-pressure bound from the settings' dict (InFlightLimit's fields)."""
    return (None if in_flight is None
            else _from_fields(who, "in_flight", InFlightLimit, in_flight))


def _policy(who: str, retry: Mapping[str, Any] | None) -> RetryPolicy:
    """The retry policy from the settings' dict (RetryPolicy's fields); never a running bound:
    vLLM reuses a job's chunks once it has the job's result, and a transfer given up while
    NIXL runs it would go on reading or writing them (``JobResult.blocks_in_use``, which
    vLLM's manager cannot be told)."""
    policy = RetryPolicy() if retry is None else _from_fields(who, "retry", RetryPolicy, retry)
    if policy.max_running_seconds is not None:
        raise ValueError(
            f"{who}: retry: max_running_seconds={policy.max_running_seconds!r} is refused under "
            "vLLM: a transfer given up while NIXL still runs it would go on reading or writing "
            "chunks vLLM reuses once it has the job's result (leave it unset; a stuck "
            "transfer is logged by drain_jobs every 5 s)")
    return policy


def _from_fields(who: str, setting: str, cls: Any, given: Any) -> Any:
    """``cls(**given)``, after checking ``given`` is a dict of ``cls``'s fields; the errors
    name the tier (``who``: its label, else its type) and the setting."""
    if not isinstance(given, Mapping):
        raise ValueError(f"{who}: {setting} must be a dict of {cls.__name__} fields, got "
                         f"{given!r}")
    fields = set(cls.__dataclass_fields__)
    unknown = sorted(set(given) - fields)
    if unknown:
        raise ValueError(f"{who}: {setting}: unknown field(s) {', '.join(unknown)}; "
                         f"{cls.__name__} has {', '.join(sorted(fields))}")
    try:
        return cls(**given)
    except ValueError as error:  # (its own checks: which field, and why)
        raise ValueError(f"{who}: {setting}: {error}") from None

