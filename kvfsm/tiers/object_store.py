"""An object-store secondary tier: one object per KV block, over NIXL's OBJ backend."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from kvfsm.agent import NixlAgent
from kvfsm.driver import StorageSide
from kvfsm.engine import Declaration
from kvfsm.lifecycle import Answer, TransferState
from kvfsm.policy import RetryPolicy
from kvfsm.tiers.base import Lookup, SecondaryTier, key_text
from kvfsm.transfer import Transfer

__all__ = ["ObjectStoreTier"]

# NIXL's OBJ backend maps a descriptor's device id to its object key, so every descriptor
# registered at the same time, by any tier of the process, needs its own id; they are reused
# only after 2**31 registrations.
_DEV_ID_SPACE = 2**31
_dev_ids = itertools.count()


class _Objects(StorageSide):
    """The remote side: one object descriptor per block, nothing to open or close."""

    mem_type = "OBJ"

    def __init__(self, tier: ObjectStoreTier) -> None:
        self._tier: ObjectStoreTier = weakref.proxy(tier)  # the tier holds this: no cycle

    def open(self, transfer: Transfer) -> list[tuple[int, int, int, str]]:
        size, dev_ids = self._tier.block_bytes, _dev_ids
        return [(0, size, next(dev_ids) % _DEV_ID_SPACE, name) for name in transfer.names]


class _Prober:
    """Answers lookups off the caller's thread: batches of ``query_memory``.

    On an agent of its own it runs freely; on the tier's agent (``shared``, a lock) each query
    holds the tier's lock, because a NIXL agent is driven by one thread at a time.
    """

    def __init__(self, agent: Any, known: dict[str, Lookup], batch: int,
                 shared: threading.RLock | None) -> None:
        self._agent = agent
        self._shared = shared
        self._known = known
        self._batch = batch
        self._wanted: dict[str, None] = {}  # insertion-ordered set of names to probe
        self._ready = threading.Condition()
        self._stopping = False
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="kvfsm-object-probe",
                                        daemon=True)
        self._thread.start()

    def want(self, name: str) -> None:
        with self._ready:
            if name not in self._wanted:
                self._wanted[name] = None
                self._ready.notify()

    def stop(self) -> None:
        with self._ready:
            self._stopping = True
            self._ready.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._wanted and not self._stopping:
                    self._ready.wait()
                if self._stopping:
                    return
                names = list(itertools.islice(self._wanted, self._batch))
            if self._shared is not None:
                # wait for the tier's lock, but never past stop(): shutdown may hold it
                while not self._shared.acquire(timeout=0.05):
                    if self._stopping:
                        return
            try:
                answers = self._agent.query_memory([(0, 1, 0, name) for name in names],
                                                   "OBJ", "OBJ")
            except Exception:  # the store did not answer: leave the names to be asked again
                self.errors += 1
                answers = None
            finally:
                if self._shared is not None:
                    self._shared.release()
            with self._ready:
                for index, name in enumerate(names):
                    self._wanted.pop(name, None)
                    if answers is not None:
                        # a result the tier recorded meanwhile is newer than this probe
                        self._known.setdefault(
                            name, Lookup.MISS if answers[index] is None else Lookup.HIT)


class ObjectStoreTier(SecondaryTier):
    """Stores each block as one object, named ``key_prefix`` + the block key.

    Built with ``agent=`` it drives that agent (a ``nixl_agent`` with the OBJ backend, or a
    :class:`kvfsm.testing.FakeNixlAgent`). Built with ``store=`` it creates its own real agents
    from the :class:`~kvfsm.nixl_agents.StoreConfig`, checks that the bucket is reachable, and
    releases them in :meth:`shutdown`.

    Args:
        primary: the primary KV cache (contiguous CPU tensor, blocks on the first dimension).
        agent: the NIXL agent to drive; or None with ``store``.
        store: where to create real agents, when ``agent`` is None.
        key_prefix: prepended to every object name (``store.key_prefix`` when built from it).
        probe_agent: the agent lookups query from a background thread; by default a second
            real agent when built from ``store``, else ``agent`` itself, whose queries then
            hold the tier's lock (give real OBJ agents a probe agent of their own: a query of
            many keys takes a while, and would hold up submits and polls meanwhile).
        probe_batch: at most this many keys per ``query_memory`` call.
        poll_interval: seconds :meth:`drain_jobs` sleeps between polls.
        machine: the lifecycle to run (see :class:`~kvfsm.tiers.base.SecondaryTier`).
        policy: retry bounds (:class:`~kvfsm.policy.RetryPolicy`).
    """

    def __init__(
        self,
        primary: torch.Tensor,
        *,
        agent: NixlAgent | None = None,
        store: Any = None,
        key_prefix: str | None = None,
        probe_agent: Any = None,
        probe_batch: int = 256,
        poll_interval: float = 0.0005,
        machine: Declaration[TransferState, Answer] | None = None,
        policy: RetryPolicy | None = None,
    ) -> None:
        if key_prefix is None:
            key_prefix = store.key_prefix if store is not None else ""
        if not isinstance(key_prefix, str):
            raise ValueError(f"key_prefix must be a str, got {type(key_prefix).__name__}")
        self.key_prefix = key_prefix
        if agent is None:
            if store is None:
                raise ValueError("ObjectStoreTier needs agent= (a NIXL agent) or store= "
                                 "(a kvfsm.nixl_agents.StoreConfig)")
            agent, probe_agent = _agents_for(store, probe_agent)
        super().__init__(primary, agent=agent, remote=_Objects(self), poll_interval=poll_interval,
                         machine=machine, policy=policy)
        self._prober = _Prober(probe_agent if probe_agent is not None else agent, self._known,
                               probe_batch, None if probe_agent is not None else self._lock)

    def object_key(self, key: bytes | str) -> str:
        """The object name block ``key`` is stored under: the prefix, then the key as text
        (a str as it is, bytes in hex; see :func:`~kvfsm.tiers.base.key_text`)."""
        return self.key_prefix + key_text(key)

    remote_name = object_key

    def _remote_names(self, keys: Sequence[Any]) -> tuple[str, ...]:
        if type(self).object_key is not ObjectStoreTier.object_key:  # a subclass names them
            return super()._remote_names(keys)
        prefix = self.key_prefix  # a non-empty str key is its own text: no call for it
        return tuple([prefix + key if type(key) is str and key else prefix + key_text(key)
                      for key in keys])

    @property
    def probe_errors(self) -> int:
        """How many background ``query_memory`` calls raised (their keys are asked again)."""
        return self._prober.errors

    def _probe(self, name: str) -> Lookup:
        self._prober.want(name)
        return Lookup.RETRY

    def _stop_probes(self) -> None:
        self._prober.stop()


def _agents_for(store: Any, probe_agent: Any) -> tuple[Any, Any]:
    from kvfsm.nixl_agents import StoreConfig, check_bucket, make_agent  # noqa: PLC0415

    if not isinstance(store, StoreConfig):
        raise ValueError(f"store must be a kvfsm.nixl_agents.StoreConfig, got "
                         f"{type(store).__name__}")
    check_bucket(store)
    threads = store.io_threads or 0
    agent = make_agent(f"kvfsm-obj-{id(store):x}", "OBJ", store.backend_params(), threads)
    if probe_agent is None:
        probe_agent = make_agent(f"kvfsm-obj-probe-{id(store):x}", "OBJ",
                                 store.backend_params(), threads)
    return agent, probe_agent
