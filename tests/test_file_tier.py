"""The file tier: one file per key, temporary files of their own per writer, stale files only
of dead writers, durable commits off the caller's thread, and processes killed mid-store.

NIXL's POSIX backend is real here: the fake agent has no FILE memory, so every test that moves
bytes runs on real NIXL (skipped without it, failing under ``CI=true``).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import inspect
import itertools
import os
import random
import re
import select
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from kvfsm import JobResult, TransferJob, TransferState
from kvfsm.nixl_agents import make_agent
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, FaultyAgent, Raise, StayProc
from kvfsm.tiering import CPUPrimaryTier, TieringManager
from kvfsm.tiers import DrainTimeout, FileTier, InvalidJobError, Lookup, ObjectStoreTier
from kvfsm.tiers import file as file_tier

from . import test_tiering as tiering
from .real_nixl import require_nixl

BLOCKS, BLOCK_BYTES = 8, 4096
real_nixl = pytest.mark.nixl
_agent_names = itertools.count()


@pytest.fixture
def cache() -> torch.Tensor:
    generator = torch.Generator().manual_seed(13)
    return torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=generator)


@pytest.fixture
def tiers() -> Iterator[list[FileTier]]:
    """Tiers a test makes: each must end with nothing in flight, and is shut down."""
    made: list[FileTier] = []
    yield made
    for tier in made:
        tier.drain_jobs(timeout=30)
        tier.shutdown()
        assert tier.closed


def posix(faulty: bool = False) -> Any:
    """A real agent with the POSIX backend (wrapped for fault injection if ``faulty``)."""
    require_nixl()
    agent = make_agent(f"file-tier-test-{next(_agent_names)}", "POSIX")
    return FaultyAgent(agent) if faulty else agent


def results_of(tier: FileTier, timeout: float = 30) -> dict[int, JobResult]:
    tier.drain_jobs(timeout=timeout)
    return {r.job_id: r for r in tier.get_finished_jobs()}


def block(cache: torch.Tensor, index: int) -> bytes:
    return cache[index].numpy().tobytes()


def temporary_files(root: Path, blocks: tuple[str, ...] = ()) -> list[str]:
    """Every file in ``root`` but the ``blocks`` (names of keys' files) and writer files."""
    return sorted(p.name for p in root.iterdir()
                  if p.name not in blocks and not p.name.startswith(".kvfsm-writer-"))


# -- names: one key, one file ---------------------------------------------------------------------

def old_hash_name(key: str) -> str:
    """The name the first file tier gave a hidden or long key: a plain name, another key's."""
    return "h-" + hashlib.sha256(urllib.parse.quote(key, safe="").encode()).hexdigest()


@pytest.fixture(scope="module")
def naming(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FileTier]:
    tier = FileTier(torch.zeros(1, 8), tmp_path_factory.mktemp("names"), agent=FakeNixlAgent())
    yield tier
    tier.shutdown()


@example(".hidden")
@example("." + "k" * 198)  # quoted: 199 characters, and 201 with its dot quoted: hashed
@example("." + "k" * 197)
@example("%h-0")
@given(st.text(min_size=1, max_size=260) | st.from_regex(r"\.?[a-z%.]{1,8}", fullmatch=True)
       | st.builds(lambda s: s * 80, st.sampled_from(["k", ".", "%", "é"])))
def test_every_key_has_a_file_name_of_its_own_and_none_is_kvfsms(
    naming: FileTier, key: str
) -> None:
    tier = naming
    try:
        name = tier.remote_name(key)
    except ValueError:  # text that is not UTF-8 (a lone surrogate) is refused as a key
        return
    assert not name.startswith("."), "names starting with a dot are kvfsm's own files"
    assert len(name.encode()) <= 200
    if name.startswith("%h-"):  # hashed: only when quoting (a leading dot too) is too long
        assert len(urllib.parse.quote(key, safe="")) + 2 * key.startswith(".") > 200
    else:  # quoted: decoding gives the key back, so no other key has this name
        assert urllib.parse.unquote(name, errors="strict") == key
    # the name, taken as a key, is that key's own name only when it is the key itself
    assert (tier.remote_name(name) == name) == (name == key)


@real_nixl
@pytest.mark.parametrize("key", [".hidden", "k" * 300], ids=["hidden key", "long key"])
def test_a_hashed_key_and_the_plain_key_spelled_like_its_hash_are_two_blocks(
    key: str, cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier]
) -> None:
    tier = FileTier(cache, tmp_path, agent=posix())
    tiers.append(tier)
    tier.submit_store(TransferJob(1, [key], [0]))
    assert results_of(tier)[1].success
    other = old_hash_name(key)
    assert tier.path_of(other) != tier.path_of(key)
    assert tier.lookup(other) is Lookup.MISS, "only the other key was stored"
    tier.submit_load(TransferJob(2, [other], [1], is_promotion=True))
    assert results_of(tier)[2].success is False, "its load must not read the other key's bytes"
    tier.submit_load(TransferJob(3, [key], [2], is_promotion=True))
    assert results_of(tier)[3].success
    assert block(cache, 2) == block(cache, 0)


@real_nixl
def test_a_plain_key_spelled_like_a_temporary_file_is_a_block_of_its_own(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier]
) -> None:
    """The first file tier wrote key ``x``'s job 2 into ``x.partial-2``: a plain key's file."""
    original = cache.clone()
    tier = FileTier(cache, tmp_path, agent=posix())
    tiers.append(tier)
    tier.submit_store(TransferJob(1, ["x.partial-2"], [0]))
    assert results_of(tier)[1].success
    tier.submit_store(TransferJob(2, ["x"], [1]))
    assert results_of(tier)[2].success
    assert tier.remove_stale() == 0, "a block is not a temporary file"
    assert tier.path_of("x.partial-2").read_bytes() == block(original, 0)
    assert tier.path_of("x").read_bytes() == block(original, 1)


def test_a_file_of_another_size_than_a_block_is_a_miss(cache: torch.Tensor, tmp_path: Path) -> None:
    """A 0-byte or short file under a key's name (written outside kvfsm, or by a store whose
    temporary file was shared) is no block: HIT only for a whole one."""
    tier = FileTier(cache, tmp_path, agent=FakeNixlAgent())
    for key, size in (("empty", 0), ("short", BLOCK_BYTES - 1), ("long", BLOCK_BYTES + 1),
                      ("whole", BLOCK_BYTES)):
        tier.path_of(key).write_bytes(b"\1" * size)
    tier.path_of("a directory").mkdir()
    assert {key: tier.lookup(key) for key in ("empty", "short", "long", "whole", "a directory",
                                              "absent")} == {
        "empty": Lookup.MISS, "short": Lookup.MISS, "long": Lookup.MISS, "whole": Lookup.HIT,
        "a directory": Lookup.MISS, "absent": Lookup.MISS}
    tier.shutdown()


@real_nixl
def test_a_relative_root_stays_where_it_was_when_the_process_changes_directory(
    cache: torch.Tensor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiers: list[FileTier],
) -> None:
    """An engine given ``root="kv"`` that later changes its working directory still stores and
    loads in the directory it named then (with the root kept relative, every store failed
    with FileNotFoundError while lookups answered HIT from the old directory's files)."""
    monkeypatch.chdir(tmp_path)
    tier = FileTier(cache, "kv", agent=posix(), durable=False)
    tiers.append(tier)
    assert tier.root == tmp_path / "kv"
    tier.submit_store(TransferJob(1, ["a"], [0]))
    assert results_of(tier)[1].success
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    tier.submit_store(TransferJob(2, ["b"], [1]))
    assert results_of(tier)[2].success
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()
                  if not p.name.startswith(".")) == ["a", "b"]
    target = cache.clone()
    cache.zero_()
    tier.submit_load(TransferJob(3, ["a", "b"], [2, 3], is_promotion=True))
    assert results_of(tier)[3].success
    assert torch.equal(cache[2], target[0]) and torch.equal(cache[3], target[1])
    assert not any((tmp_path / "elsewhere").iterdir())

    # a ".." after a symlink is the OS's to follow, as any path's: mnt/shared, not ./shared
    (tmp_path / "mnt" / "kv").mkdir(parents=True)
    (tmp_path / "elsewhere" / "link").symlink_to(tmp_path / "mnt" / "kv")
    linked = FileTier(cache, "link/../shared", agent=posix(), durable=False)
    tiers.append(linked)
    linked.submit_store(TransferJob(4, ["c"], [2]))
    assert results_of(linked)[4].success
    assert (tmp_path / "mnt" / "shared" / "c").is_file()
    assert not (tmp_path / "elsewhere" / "shared").exists()


# -- two tiers, one directory ---------------------------------------------------------------------

@real_nixl
def test_two_tiers_storing_one_key_in_one_directory_each_write_a_file_of_their_own(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier]
) -> None:
    """Two engines (or an engine and its restarted self) store the same key with the same job
    id at once: each store writes its own temporary file, both succeed, and the block's file is
    whole, the last one renamed."""
    other_cache = torch.flip(cache, [1]).contiguous()
    first = FileTier(cache, tmp_path, agent=posix(faulty=True))
    second = FileTier(other_cache, tmp_path, agent=posix(faulty=True))
    tiers += [first, second]
    for tier in (first, second):
        tier.agent.inject("transfer", StayProc(1))  # posted; not committed before its poll
        tier.submit_store(TransferJob(1, ["k"], [3]))
    assert len(temporary_files(tmp_path)) == 2, "one temporary file per store"
    assert results_of(first)[1].success
    assert results_of(second)[1].success
    assert first.path_of("k").read_bytes() == block(other_cache, 3)
    assert first.lookup("k") is Lookup.HIT
    assert temporary_files(tmp_path, ("k",)) == []


@real_nixl
def test_a_block_of_another_tiers_size_in_a_shared_directory_is_never_loaded_as_this_ones(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier]
) -> None:
    """Two tiers share a root, one with blocks twice the other's size, and both store key k:
    the small tier still answers HIT (its own store finished), but its load finds a file of
    another size under k's name and fails by ``open``, naming the file; its block keeps its
    bytes, and k is a MISS from then on. (NIXL read the first block's bytes of the big file
    and answered DONE: the load once published them as a success.)"""
    big_cache = torch.randint(0, 256, (BLOCKS, 2 * BLOCK_BYTES), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(5))
    small = FileTier(cache, tmp_path, agent=posix(), durable=False)
    big = FileTier(big_cache, tmp_path, agent=posix(), durable=False)
    tiers += [small, big]
    small.submit_store(TransferJob(1, ["k"], [0]))
    assert results_of(small)[1].success
    big.submit_store(TransferJob(1, ["k"], [0]))
    assert results_of(big)[1].success
    assert small.lookup("k") is Lookup.HIT  # the verdict its own store left

    before = block(cache, 5)
    small.submit_load(TransferJob(2, ["k"], [5], is_promotion=True))
    result = results_of(small)[2]
    assert not result.success
    assert str(result.reason) == (f"open raised OSError: {small.path_of('k')} holds "
                                  f"{2 * BLOCK_BYTES} bytes, not a block of {BLOCK_BYTES}")
    assert block(cache, 5) == before
    assert small.lookup("k") is Lookup.MISS


def interrupt_once_at(function: Callable[..., Any], line: str) -> Callable[[], None]:
    """Trace ``function``: a KeyboardInterrupt is raised once at its line ``line`` (as a
    signal handler raises one between two calls); returns what stops the tracing."""
    lines, first = inspect.getsourcelines(function)
    (at,) = [first + n for n, text in enumerate(lines) if text.strip() == line]
    code, armed = function.__code__, [True]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == at and armed:
            armed.clear()
            raise KeyboardInterrupt
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code is code else None

    sys.settrace(calls)
    return lambda: sys.settrace(None)


def test_a_cleanup_cut_short_by_an_interrupt_never_closes_another_transfers_files(
        cache: torch.Tensor, tmp_path: Path) -> None:
    """A cleanup an interrupt cut short once its files were closed is made again next poll:
    it closed the same fd numbers again, which the kernel had given a later load's files, and
    a load after that got them once more; NIXL moves a transfer's blocks through the fd numbers
    it was given (past its first 64 I/Os, at a later state check), so the first load published
    the second's bytes as a success."""
    agent = FakeNixlAgent(name="fd-numbers")
    tier = FileTier(cache, tmp_path, agent=agent, durable=False)
    tier.submit_store(TransferJob(1, ["a0", "a1"], [0, 1]))
    tier.submit_store(TransferJob(2, ["b0", "b1"], [2, 3]))
    assert all(r.success for r in results_of(tier).values())

    tier.submit_store(TransferJob(3, ["c0", "c1"], [4, 5]))
    stop = interrupt_once_at(file_tier._Files.close, "flush = opened.flush")
    try:
        with pytest.raises(KeyboardInterrupt):  # its files closed, the cleanup cut short
            tier.get_finished_jobs()
    finally:
        stop()
    assert tier.state_of(3) is TransferState.XFER_RELEASED

    agent.complete_after_polls = 3  # the loads run for a few polls
    tier.submit_load(TransferJob(4, ["a0", "a1"], [6, 7], is_promotion=True))
    first = list(tier._runner.records[4].opened.fds)
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(3, True)], \
        "job 3's cleanup made again and published; the load still runs"
    for fd in first:
        os.fstat(fd)  # still the load's: raises if the cleanup closed it
    tier.submit_load(TransferJob(5, ["b0", "b1"], [4, 5], is_promotion=True))
    results = results_of(tier)

    assert {job: r.success for job, r in results.items()} == {4: True, 5: True}
    assert [block(cache, 6), block(cache, 7)] == [block(cache, 0), block(cache, 1)]
    assert [block(cache, 4), block(cache, 5)] == [block(cache, 2), block(cache, 3)]
    tier.shutdown()
    assert agent.misuses == []


@real_nixl
def test_a_fifo_under_a_blocks_name_fails_its_load_at_once_and_holds_nothing_up(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier]
) -> None:
    """Something not a block under k's name, a FIFO nobody writes to: the load's open does not
    wait for a writer (it once blocked the submit, holding the tier's lock, for good); the job
    fails naming it, and the tier goes on."""
    tier = FileTier(cache, tmp_path, agent=posix(), durable=False)
    tiers.append(tier)
    os.mkfifo(tier.path_of("k"))
    done = threading.Event()

    def load() -> None:
        tier.submit_load(TransferJob(1, ["k"], [0], is_promotion=True))
        done.set()

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        assert done.wait(10), "the submit waited for a writer of the FIFO"
    finally:  # a submit stuck in the open (holding the tier's lock) is let go, so the test ends
        if not done.is_set():
            os.close(os.open(tier.path_of("k"), os.O_WRONLY | os.O_NONBLOCK))
            loader.join(10)
    result = results_of(tier)[1]
    assert str(result.reason) == (
        f"open raised OSError: {tier.path_of('k')} is not a regular file: not a block")


@real_nixl
def test_remove_stale_leaves_the_temporary_files_of_a_live_tier_alone(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier]
) -> None:
    writing = FileTier(cache, tmp_path, agent=posix(faulty=True))
    cleaning = FileTier(cache, tmp_path, agent=FakeNixlAgent())
    tiers += [writing, cleaning]
    writing.agent.inject("transfer", StayProc(1))
    writing.submit_store(TransferJob(1, ["a", "b"], [0, 1]))
    assert len(temporary_files(tmp_path)) == 2
    assert cleaning.remove_stale() == 0, "the writer of these files is alive"
    assert writing.remove_stale() == 0, "and they are in flight"
    assert results_of(writing)[1].success
    assert writing.path_of("b").read_bytes() == block(cache, 1)


# -- durability off the caller's thread -----------------------------------------------------------

class BlockingFsync:
    """Stands in for ``os.fsync`` (the environment): records the thread of each call, and holds
    calls made off the test's thread until released."""

    def __init__(self, real: Callable[[int], None]) -> None:
        self.real = real
        self.caller = threading.get_ident()
        self.on_caller = 0
        self.elsewhere = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, fd: int) -> None:
        if threading.get_ident() == self.caller:
            self.on_caller += 1
            self.entered.set()
        else:
            self.elsewhere += 1
            self.entered.set()
            self.release.wait(30)
        self.real(fd)


@pytest.fixture
def fsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[BlockingFsync]:
    fake = BlockingFsync(os.fsync)
    monkeypatch.setattr(os, "fsync", fake)
    yield fake
    fake.release.set()


def test_a_flush_tells_the_tier_only_once_it_is_over() -> None:
    """The flusher tells the tier a store's flush is over only once the flush says so (its
    error final): a poll that takes the telling at once finds the flush over. The flush then
    lets go of whom it told (it holds the store's transfer, which holds the flush)."""
    told: list[tuple[bool, Exception | None]] = []
    flush = file_tier._Flush([], [], wake=lambda: told.append((flush.done, flush.error)))
    flush.error = OSError("disk gone")
    flush.over()
    assert told == [(True, flush.error)]
    assert flush.wake is None


@real_nixl
def test_a_durable_store_is_flushed_off_the_callers_thread(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier], fsync: BlockingFsync
) -> None:
    fsync.release.set()
    tier = FileTier(cache, tmp_path, agent=posix())
    tiers.append(tier)
    for job in range(4):
        tier.submit_store(TransferJob(job, [f"k{2 * job}", f"k{2 * job + 1}"],
                                      [2 * job, 2 * job + 1]))
    assert all(r.success for r in results_of(tier).values())
    assert fsync.on_caller == 0, "no fsync on the thread that submits and polls"
    assert fsync.elsewhere >= BLOCKS + 1, "each file, and the directory, was flushed"
    assert [tier.path_of(f"k{b}").read_bytes() for b in range(BLOCKS)] == [
        block(cache, b) for b in range(BLOCKS)]


@real_nixl
def test_a_store_is_published_only_once_flushed_and_no_poll_waits_for_the_flush(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier], fsync: BlockingFsync
) -> None:
    tier = FileTier(cache, tmp_path, agent=posix())
    tiers.append(tier)
    tier.submit_store(TransferJob(1, ["a", "b"], [0, 1]))
    while not fsync.entered.is_set():  # NIXL's copy is over once the flush began
        assert tier.get_finished_jobs() == []
    assert fsync.on_caller == 0
    for _ in range(3):  # the flush is held: polls return, with nothing to publish
        assert tier.get_finished_jobs() == []
    assert tier.state_of(1) is TransferState.PROCESSING
    assert not tier.path_of("a").exists()
    assert tier.lookup("a") is Lookup.MISS
    with pytest.raises(DrainTimeout) as drained:
        tier.drain_jobs(timeout=0.01)
    assert [(t.job_id, t.state) for t in drained.value.stuck] == [(1, TransferState.PROCESSING)]
    fsync.release.set()
    assert results_of(tier)[1].success
    assert tier.path_of("b").read_bytes() == block(cache, 1)
    assert tier.lookup("b") is Lookup.HIT
    assert fsync.on_caller == 0


@real_nixl
def test_shutdown_waits_for_a_flush_under_way_as_for_a_running_transfer(
    cache: torch.Tensor, tmp_path: Path, fsync: BlockingFsync
) -> None:
    """Cancelled during its flush (its renames not begun), a store fails; its flush is
    abandoned (no block of it is put in place, its temporary file goes), and shutdown waits
    for it like for a transfer NIXL still runs."""
    tier = FileTier(cache, tmp_path, agent=posix())
    tier.submit_store(TransferJob(1, ["a"], [0]))
    while not fsync.entered.is_set():
        tier.get_finished_jobs()
    with pytest.raises(DrainTimeout) as shut:
        tier.shutdown(timeout=0.01)
    assert [(t.job_id, t.state) for t in shut.value.stuck] == [(1, TransferState.CANCELLING)]
    assert not tier.closed, "the tier stays open: shutdown may be called again to wait longer"
    fsync.release.set()
    tier.shutdown(timeout=30)
    assert tier.closed
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
    assert not tier.path_of("a").exists(), "the abandoned flush renamed"
    assert temporary_files(tmp_path, ("a",)) == []
    assert fsync.on_caller == 0


@real_nixl
@pytest.mark.parametrize("durable", [True, False])
def test_a_store_cancelled_before_nixl_finished_it_leaves_no_new_block(
    durable: bool, cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier]
) -> None:
    tier = FileTier(cache, tmp_path, agent=posix(faulty=True), durable=durable)
    tiers.append(tier)
    tier.agent.inject("transfer", StayProc(3))  # NIXL answers PROC until after the cancel
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.cancel(1)
    assert results_of(tier)[1].success is False
    assert not tier.path_of("a").exists()
    assert temporary_files(tmp_path) == []


@real_nixl
def test_a_flushing_tier_leaks_no_descriptor_or_thread_and_is_freed_at_once(
    cache: torch.Tensor, tmp_path: Path
) -> None:
    agent = posix()
    before = len(os.listdir("/proc/self/fd"))
    for shut_down in (True, False):
        tier = FileTier(cache, tmp_path / str(shut_down), agent=agent)
        for job in range(4):
            tier.submit_store(TransferJob(job, [f"k{job}"], [job]))
        assert all(r.success for r in results_of(tier).values())
        flushers = [t for t in threading.enumerate() if t.name == "kvfsm-file-flush"]
        assert len(flushers) == 1
        if shut_down:
            tier.shutdown()
            assert not flushers[0].is_alive(), "shutdown ends the flusher"
        gone = weakref.ref(tier)
        gc.disable()
        try:
            del tier
            assert gone() is None, "something holds the tier in a cycle"
        finally:
            gc.enable()
        flushers[0].join(10)  # a dropped tier's flusher ends by itself
        assert not flushers[0].is_alive()
        assert sorted(p.name for p in (tmp_path / str(shut_down)).iterdir()) == sorted(
            f"k{job}" for job in range(4)), "no temporary file, no writer file left"
    assert len(os.listdir("/proc/self/fd")) == before


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def flusher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvfsm-file-flush"]


@real_nixl
def test_shutdown_leaves_the_flush_of_a_published_store_to_end_by_itself_at_its_deadline(
    cache: torch.Tensor, tmp_path: Path, fsync: BlockingFsync
) -> None:
    """A store whose state check fails once NIXL finished it is published (failed) while its
    flush is still under way: shutdown returns at its deadline without waiting for that flush
    (it never touches the primary cache). The flusher ends by itself, closes its descriptors,
    holds no tier, and keeps the writer's lock until it ended, so no tier's remove_stale
    takes the writer's temporary files for stale meanwhile."""
    tier = FileTier(cache, tmp_path, agent=posix(faulty=True))
    before = open_fds()
    tier.submit_store(TransferJob(1, ["a"], [0]))
    while not fsync.entered.is_set():
        assert tier.get_finished_jobs() == []
    tier.agent.inject("check_xfer_state", Raise())  # after NIXL's DONE: the store fails
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
    [flusher] = flusher_threads()
    writer_id = tier.writer_id
    writer = tmp_path / f".kvfsm-writer-{writer_id}"
    in_use = tmp_path / f".kvfsm-partial-{writer_id}-99-b"  # stands for a file it may rename
    in_use.touch()
    tier.shutdown(timeout=0.01)
    assert tier.closed
    assert flusher.is_alive() and not fsync.release.is_set(), "the fsync is still held"
    assert tier.writer_id is None
    assert writer.exists(), "the writer's lock is held while its flusher runs"
    cleaning = FileTier(cache, tmp_path, agent=FakeNixlAgent())
    assert cleaning.remove_stale() == 0
    assert tier.remove_stale() == 0
    assert in_use.exists()
    gone = weakref.ref(tier)
    gc.disable()
    try:
        del tier
        assert gone() is None, "the flusher left running keeps the tier alive"
    finally:
        gc.enable()
    fsync.release.set()
    flusher.join(30)
    assert not flusher.is_alive()
    assert not writer.exists(), "the flusher gave the writer's claim up as it ended"
    assert cleaning.remove_stale() == 1, "its files are stale now"
    cleaning.shutdown()
    assert temporary_files(tmp_path) == []
    assert not (tmp_path / "a").exists(), "the failed store's file was removed, not renamed"
    assert open_fds() == before, "the flusher closed its copies of the descriptors"


@real_nixl
def test_a_flusher_thread_that_fails_to_start_fails_only_that_store(
    cache: torch.Tensor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread that cannot start (a thread limit) fails the store that needed it, leaking
    no descriptor; the next store starts one and is published, and shutdown ends it."""
    real_start = threading.Thread.start
    refused: list[threading.Thread] = []

    def start(thread: threading.Thread) -> None:
        if thread.name == "kvfsm-file-flush" and not refused:
            refused.append(thread)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    tier = FileTier(cache, tmp_path, agent=posix())
    before = open_fds()
    tier.submit_store(TransferJob(1, ["a"], [0]))
    failed = results_of(tier, timeout=10)[1]
    assert refused and not failed.success
    assert failed.reason is not None and failed.reason.call == "commit"
    assert "can't start new thread" in failed.reason.error
    tier.submit_store(TransferJob(2, ["b"], [1]))
    assert results_of(tier, timeout=10)[2].success
    assert tier.path_of("b").read_bytes() == block(cache, 1)
    [flusher] = flusher_threads()
    tier.shutdown(timeout=10)
    assert tier.closed and not flusher.is_alive()
    assert temporary_files(tmp_path, ("b",)) == []
    assert open_fds() == before, "the copies made for the thread that never ran were closed"


@real_nixl
def test_a_flusher_thread_that_died_is_replaced_and_no_store_waits_for_it(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flusher thread that ended by an error (only a bug makes one) is started again by
    the next store, which is published."""
    real_flush = file_tier._flush
    died: list[threading.Thread] = []
    uncaught: list[type[BaseException] | None] = []

    class Bug(Exception):
        pass

    def flush_then_die(batch: list[Any], root: str, lock: Any) -> None:
        real_flush(batch, root, lock)
        if not died:
            died.append(threading.current_thread())
            raise Bug  # ends the thread, after the batch it took

    monkeypatch.setattr(file_tier, "_flush", flush_then_die)
    monkeypatch.setattr(threading, "excepthook", lambda args: uncaught.append(args.exc_type))
    tier = FileTier(cache, tmp_path, agent=posix())
    tiers.append(tier)
    tier.submit_store(TransferJob(1, ["a"], [0]))
    assert results_of(tier, timeout=10)[1].success
    died[0].join(10)
    assert not died[0].is_alive() and uncaught == [Bug]
    tier.submit_store(TransferJob(2, ["b"], [1]))
    assert results_of(tier, timeout=10)[2].success
    assert tier.path_of("b").read_bytes() == block(cache, 1)


@real_nixl
def test_max_running_seconds_bounds_a_store_whose_flush_hangs_and_releases_its_handle(
    cache: torch.Tensor, tmp_path: Path, fsync: BlockingFsync
) -> None:
    """NIXL answered DONE, so the store is not quarantined: it fails as a commit that raised,
    its handles released (nothing is held at shutdown)."""
    tier = FileTier(cache, tmp_path, agent=posix(), policy=RetryPolicy(max_running_seconds=60))
    tier.submit_store(TransferJob(1, ["a"], [0]))
    while not fsync.entered.is_set():
        assert tier.get_finished_jobs() == []
    assert tier.get_finished_jobs() == [] and tier.state_of(1) is TransferState.PROCESSING
    transfer = tier.transfer_of(1)
    assert transfer is not None
    transfer.started_at -= 120  # submitted long ago: past the bound (no sleeping for it)
    [result] = tier.get_finished_jobs()
    assert not result.success
    assert result.reason is not None and result.reason.call == "commit"
    assert "max_running_seconds" in result.reason.error
    assert tier.stats()["quarantined"] == 0 and tier.stats()["quarantined_running"] == 0
    fsync.release.set()
    tier.shutdown(timeout=30)
    assert tier.closed
    assert tier.stats()["quarantined"] == 0
    assert temporary_files(tmp_path) == []


@real_nixl
@pytest.mark.parametrize("fails_by", ["a state check", "the running bound"])
def test_a_failed_stores_flush_never_lands_over_another_tiers_later_store_of_its_block(
    fails_by: str, cache: torch.Tensor, tmp_path: Path, fsync: BlockingFsync
) -> None:
    """Two tiers share a root (an engine whose tier was made again). The first tier's durable
    store of "a" finishes in NIXL, and its flush waits on the disk; then the store fails
    (a state check raises, or the running bound passes) and its release keeps raising, so it
    waits in FAILED. The second tier stores "a" from another block, succeeds, and vouches
    for it. The disk then lets the first flush go on: it was abandoned, so it renames
    nothing over the second store's block, and the second tier loads what it stored. (It
    renamed its temporary file onto "a", and the load published the failed store's bytes.)"""
    old = FileTier(cache, tmp_path, agent=posix(faulty=True), policy=RetryPolicy(
        max_seconds=None, max_running_seconds=60 if fails_by == "the running bound" else None))
    old.submit_store(TransferJob(1, ["a"], [0]))
    while not fsync.entered.is_set():
        assert old.get_finished_jobs() == []
    old.agent.inject("release_xfer_handle", Raise(), times=10**6)
    if fails_by == "a state check":
        old.agent.inject("check_xfer_state", Raise())
    else:
        transfer = old.transfer_of(1)
        assert transfer is not None
        transfer.started_at -= 120  # submitted long ago: past the bound
    for _ in range(3):
        assert old.get_finished_jobs() == []
    assert old.state_of(1) is TransferState.FAILED

    new = FileTier(cache, tmp_path, agent=posix(), durable=False)
    new.submit_store(TransferJob(1, ["a"], [1]))
    assert results_of(new)[1].success and new.lookup("a") is Lookup.HIT
    transfer = old.transfer_of(1)
    assert transfer is not None
    flush = transfer.opened.flush  # (the flush goes on, and is over, before the release)
    fsync.release.set()
    deadline = time.monotonic() + 10
    while not flush.done:
        assert time.monotonic() < deadline, "the flush never ended"
        time.sleep(0.001)
    old.agent.faults.clear()
    old.shutdown(timeout=30)  # (after the flush: it waits for it)
    assert new.path_of("a").read_bytes() == block(cache, 1), "the failed store's flush renamed"
    new.submit_load(TransferJob(2, ["a"], [5], is_promotion=True))
    assert results_of(new)[2].success and torch.equal(cache[5], cache[1])
    new.shutdown(timeout=30)
    assert temporary_files(tmp_path, ("a",)) == []


@real_nixl
def test_a_store_quarantined_before_its_commit_removes_no_file_it_did_not_write(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier]
) -> None:
    """Another tier stored k. This tier (with a capacity) stores k too, and NIXL keeps
    answering PROC past ``max_running_seconds``: the store is quarantined, published as failed,
    having renamed nothing (its commit never ran), so the other tier's k stays."""
    other = FileTier(cache, tmp_path, agent=posix(), durable=False)
    faulty = posix(faulty=True)
    tier = FileTier(cache, tmp_path, agent=faulty, durable=False, capacity_bytes=4 * BLOCK_BYTES,
                    policy=RetryPolicy(max_running_seconds=60))
    tiers += [other, tier]
    other.submit_store(TransferJob(1, ["k"], [3]))
    assert results_of(other)[1].success
    faulty.inject("check_xfer_state", StayProc(5))
    tier.submit_store(TransferJob(2, ["k"], [5]))
    assert tier.get_finished_jobs() == []
    transfer = tier.transfer_of(2)
    assert transfer is not None
    transfer.started_at -= 120  # submitted long ago: past the bound (no sleeping for it)
    [result] = tier.get_finished_jobs()
    assert (result.success, str(result.reason)) == (
        False, "quarantined waiting on check_xfer_state: still running after 60 s")
    assert tier.path_of("k").read_bytes() == block(cache, 3), "the other tier's block"
    # the stall ends (its last held answers are asked here): NIXL is over with the
    # quarantined store, so the process need not wait for it as it exits
    answers = [faulty.check_xfer_state(transfer.xfer) for _ in range(5)]
    assert answers[-1] == "DONE", answers


# -- other processes: alive, and killed mid-store -------------------------------------------------

HEADER = 32

ZYGOTE = textwrap.dedent("""
    import hashlib, os, signal, sys, time
    import torch
    from kvfsm import TransferJob
    from kvfsm.tiers import FileTier

    BLOCKS, BLOCK_BYTES, HEADER = %d, %d, %d

    def content(writer, round_, index):
        header = f"{writer}:{round_}:{index}:".encode().ljust(HEADER)
        return header + hashlib.shake_128(header).digest(BLOCK_BYTES - HEADER)

    def fill(cache, writer, round_):
        for index in range(BLOCKS):
            cache[index] = torch.frombuffer(bytearray(content(writer, round_, index)),
                                            dtype=torch.uint8)

    def say(*words):
        os.write(1, ("kvfsm-test " + " ".join(map(str, words)) + "\\n").encode())

    def store_forever(root, writer, durable):
        cache = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
        tier = FileTier(cache, root, durable=durable)
        deadline = time.monotonic() + 60  # killed long before, unless the test failed
        for round_ in range(10**9):
            if time.monotonic() > deadline:
                return
            fill(cache, writer, round_)
            half = BLOCKS // 2
            for job, blocks in ((2 * round_, range(half)), (2 * round_ + 1, range(half, BLOCKS))):
                tier.submit_store(TransferJob(job, [f"k{b}" for b in blocks], list(blocks)))
            tier.drain_jobs(timeout=30)
            if not all(r.success for r in tier.get_finished_jobs()):
                raise RuntimeError("a store failed")
            if round_ == 0:
                say("ready", os.getpid())

    def hold(root, go):
        from kvfsm.nixl_agents import make_agent
        from kvfsm.testing import FaultyAgent, StayProc
        cache = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
        fill(cache, "held", 0)
        agent = FaultyAgent(make_agent(f"held-{os.getpid()}", "POSIX"))
        tier = FileTier(cache, root, agent=agent)
        agent.inject("transfer", StayProc(1))
        tier.submit_store(TransferJob(1, ["held"], [0]))  # not committed before a poll
        say("held", os.getpid())
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.005)
        tier.drain_jobs(timeout=30)
        say("stored", os.getpid(), [r.success for r in tier.get_finished_jobs()])

    children = set()
    for line in sys.stdin:
        command, *args = line.split()
        if command == "reap":
            os.waitpid(int(args[0]), 0)
            children.discard(int(args[0]))
            say("reaped", args[0])
            continue
        pid = os.fork()
        children.add(pid)
        if pid == 0:
            try:
                if command == "store":
                    store_forever(args[0], args[1], args[2] == "1")
                else:
                    hold(args[0], args[1])
            except BaseException as error:
                say("failed", os.getpid(), repr(error).replace(" ", "_"))
            finally:
                os._exit(0)
    for pid in children:  # the test is over: no writer outlives it
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
""") % (BLOCKS, BLOCK_BYTES, HEADER)


def content(writer: str, round_: int, index: int) -> bytes:
    header = f"{writer}:{round_}:{index}:".encode().ljust(HEADER)
    return header + hashlib.shake_128(header).digest(BLOCK_BYTES - HEADER)


class Zygote:
    """A child process that imported torch and kvfsm once and forks a writer per command, so a
    writer starts in milliseconds and can be killed at any moment."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "NIXL_LOG_LEVEL": "WARN"})
        self._buffer = b""

    def send(self, *words: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((" ".join(map(str, words)) + "\n").encode())
        self.process.stdin.flush()

    def expect(self, word: str, timeout: float = 60) -> list[str]:
        """The next line the zygote or a writer said; it must start with ``word``."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while True:
            line, found, rest = self._buffer.partition(b"\n")
            if found:
                self._buffer = rest
                words = line.decode().split()
                if words[:1] != ["kvfsm-test"]:
                    continue  # not ours (a library's log line)
                assert words[1] == word, f"expected {word!r}, the child said {words[1:]}"
                return words[2:]
            ready, _, _ = select.select([fd], [], [], timeout)
            assert ready, f"no {word!r} from the child within {timeout} s"
            chunk = os.read(fd, 65536)
            assert chunk, "the child process exited"
            self._buffer += chunk

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        self.send("reap", pid)
        self.expect("reaped")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            assert self.process.stdout is not None
            self.process.stdout.close()


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    require_nixl()
    made = Zygote()
    yield made
    made.close()


def check_blocks(root: Path, writers: list[str]) -> int:
    """Every block file is whole and holds what one writer stored under its key; how many."""
    found = 0
    for index in range(BLOCKS):
        path = root / f"k{index}"
        if not path.exists():
            continue
        data = path.read_bytes()
        assert len(data) == BLOCK_BYTES, f"{path.name}: {len(data)} bytes"
        writer, round_, stored_index, _ = data[:HEADER].decode().split(":")
        assert writer in writers and int(stored_index) == index, data[:HEADER]
        assert data == content(writer, int(round_), index), f"{path.name}: torn"
        found += 1
    return found


@real_nixl
def test_writers_killed_at_random_moments_leave_whole_blocks_or_none_and_stale_files_go(
    zygote: Zygote, cache: torch.Tensor, tmp_path: Path
) -> None:
    """Three writers store the same keys into one directory, durably or not, and are killed
    with SIGKILL at random moments, twice over; after each wave every block file is whole and
    holds what some writer stored, and a new tier's remove_stale removes what they left."""
    chance = random.Random(os.environ.get("KVFSM_SEED", "kill"))
    writers: list[str] = []
    for wave in range(2):
        wave_writers = [f"w{wave}{n}" for n in range(3)]
        writers += wave_writers
        for n, writer in enumerate(wave_writers):
            zygote.send("store", tmp_path, writer, n % 2)
        pids = [int(zygote.expect("ready")[0]) for _ in wave_writers]
        for pid in pids:
            threading.Event().wait(chance.uniform(0, 0.05))
            zygote.kill(pid)
        assert check_blocks(tmp_path, writers) > 0
        cleaning = FileTier(cache, tmp_path, agent=FakeNixlAgent())
        cleaning.remove_stale()
        assert temporary_files(tmp_path, tuple(f"k{b}" for b in range(BLOCKS))) == []
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], (
            "the dead writers' files are gone (and a tier that never stored made none)")
        cleaning.shutdown()
        assert check_blocks(tmp_path, writers) > 0


@real_nixl
def test_a_live_writer_in_another_process_keeps_its_temporary_files(
    zygote: Zygote, cache: torch.Tensor, tmp_path: Path
) -> None:
    blocks = tmp_path / "blocks"
    blocks.mkdir()
    go = tmp_path / "go"
    zygote.send("hold", blocks, go)
    pid = int(zygote.expect("held")[0])
    assert len(temporary_files(blocks)) == 1
    cleaning = FileTier(cache, blocks, agent=FakeNixlAgent())
    assert cleaning.remove_stale() == 0, "its writer lives, in another process"
    go.touch()
    assert zygote.expect("stored") == [str(pid), "[True]"]
    zygote.send("reap", pid)
    zygote.expect("reaped")
    assert (blocks / "held").read_bytes() == content("held", 0, 0)
    assert cleaning.remove_stale() == 0  # (it exited without shutdown: its writer file goes)
    assert [p.name for p in blocks.iterdir()] == ["held"]
    cleaning.shutdown()


@pytest.mark.parametrize(("options", "message"), [
    ({"poll_interval": -1.0}, "poll_interval must be"),
    ({"capacity_bytes": 10}, "capacity_bytes must be an int of at least one block "
                             f"({BLOCK_BYTES} bytes), got 10"),
    ({"record_events": True}, "record_events=True needs capacity_bytes"),
    ({"durable": "false"}, "durable must be True or False, got 'false'"),
    ({"primary": torch.zeros(0)}, "primary"),
])
def test_bad_input_is_refused_before_the_root_is_made(
    cache: torch.Tensor, tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    root = tmp_path / "not yet"
    primary = options.pop("primary", cache)
    with pytest.raises(ValueError, match=re.escape(message)):
        FileTier(primary, root, agent=FakeNixlAgent(), **options)
    assert not root.exists()


# -- the root: refused at once when a tier could never use it ------------------------------------

def test_a_root_that_is_a_file_is_refused_by_name_and_nothing_is_created(
    cache: torch.Tensor, tmp_path: Path
) -> None:
    regular = tmp_path / "a_regular_file"
    regular.write_bytes(b"not a directory")
    agent = FakeNixlAgent(name="root-check")
    with pytest.raises(ValueError, match=r"'.*a_regular_file' exists and is not a directory"):
        FileTier(cache, regular, agent=agent)
    with pytest.raises(ValueError, match=r"'.*a_regular_file/blocks' cannot be created"):
        FileTier(cache, regular / "blocks", agent=agent)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_regular_file"]
    assert agent.live_registrations() == 0, "nothing registered with NIXL either"
    agent.close()


def test_a_read_only_root_that_does_not_exist_yet_answers_miss_until_stores_make_it(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier]
) -> None:
    """An engine that only loads from a shared directory may start before any engine of its
    model stored there: its root is missing, its lookups answer MISS, and it finds the blocks
    once a writing tier made the root. A root whose parent is missing too is a mistyped path,
    refused by name."""
    root = tmp_path / "model-folder"
    reader = FileTier(cache, root, agent=posix(), read_only=True)
    tiers.append(reader)
    assert not root.exists() and reader.lookup("k") is Lookup.MISS
    assert reader.remove_stale() == 0, "nothing in a root no store made yet"
    reader.submit_load(TransferJob(1, ["other"], [0], is_promotion=True))
    assert not results_of(reader)[1].success

    writer = FileTier(cache, root, agent=posix(), durable=False)
    tiers.append(writer)
    writer.submit_store(TransferJob(2, ["k"], [1]))
    assert results_of(writer)[2].success
    cache[3] = 0
    assert reader.lookup("k") is Lookup.HIT
    reader.submit_load(TransferJob(3, ["k"], [3], is_promotion=True))
    assert results_of(reader)[3].success and block(cache, 3) == block(cache, 1)

    agent = FakeNixlAgent(name="mistyped")
    with pytest.raises(ValueError, match=r"'.*/missing/folder' does not exist, nor does its "
                                         r"parent"):
        FileTier(cache, tmp_path / "missing" / "folder", agent=agent, read_only=True)
    assert agent.live_registrations() == 0
    agent.close()


def test_a_root_that_cannot_be_written_is_refused_unless_the_tier_only_loads(
    cache: torch.Tensor,
) -> None:
    """/proc/sys takes no new files, even from root (as CI runs): a tier that could never
    store is refused at once instead of failing every store later; one that says it only
    loads is made, and refuses stores by name."""
    agent = FakeNixlAgent(name="read-only")
    with pytest.raises(ValueError, match=r"'/proc/sys' cannot be written to .* read_only=True"):
        FileTier(cache, "/proc/sys", agent=agent)
    assert agent.live_registrations() == 0
    tier = FileTier(cache, "/proc/sys", agent=agent, read_only=True)
    with pytest.raises(InvalidJobError, match=r"job 1: this FileTier only loads from /proc/sys"):
        tier.submit_store(TransferJob(1, ["k"], [0]))
    assert not tier.has_pending_work() and tier.state_of(1) is None
    assert tier.lookup("kernel") is Lookup.MISS, "a directory is not a block"
    tier.shutdown(timeout=5)
    with pytest.raises(ValueError, match="read_only must be a bool"):
        FileTier(cache, "/proc/sys", agent=agent, read_only="yes")  # type: ignore[arg-type]
    agent.close()


class DirectoryFsyncFails:
    """Stands in for ``os.fsync`` (the environment): a file's flush goes through, the
    directory's raises EIO, as on a disk that failed after the renames."""

    def __init__(self, real: Callable[[int], None]) -> None:
        self.real = real
        self.directories = 0

    def __call__(self, fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            self.directories += 1
            raise OSError(errno.EIO, "Input/output error (the directory's flush)")
        self.real(fd)


@real_nixl
def test_a_durable_store_whose_directory_flush_fails_is_no_success(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file of the store was flushed and renamed into place, then the directory's flush
    failed: the renames may not survive a power loss, so the store fails, saying why."""
    failing = DirectoryFsyncFails(os.fsync)
    monkeypatch.setattr(os, "fsync", failing)
    tier = FileTier(cache, tmp_path, agent=posix())
    tiers.append(tier)
    tier.submit_store(TransferJob(1, ["a", "b"], [0, 1]))
    result = results_of(tier)[1]
    assert not result.success
    assert "the directory's flush" in str(result.reason), result.reason
    assert failing.directories >= 1


def test_remove_stale_keeps_the_files_of_a_writer_it_cannot_tell_is_gone(
    cache: torch.Tensor, tmp_path: Path
) -> None:
    """A writer's lock file that cannot be opened (here a directory in its place; another
    user's file would do the same) says nothing of whether its tier lives: its temporary files
    stay. Only a writer whose lock file is gone, or is not held, is taken for dead."""
    writer_id = "0123456789abcdef"
    (tmp_path / f".kvfsm-writer-{writer_id}").mkdir()
    kept = tmp_path / f".kvfsm-partial-{writer_id}-1-a"
    kept.write_bytes(b"whatever it was writing")
    stale = tmp_path / ".kvfsm-partial-fedcba9876543210-1-a"  # no writer file: gone
    stale.write_bytes(b"left by a dead tier")
    cleaning = FileTier(cache, tmp_path, agent=FakeNixlAgent(), durable=False)
    try:
        assert cleaning.remove_stale() == 1
        assert kept.exists() and not stale.exists()
    finally:
        cleaning.shutdown()


def test_a_manager_stores_nothing_to_a_read_only_tier_and_loads_from_it(tmp_path: Path) -> None:
    """Engine A stores a block into a directory it shares. Engine B's manager has an object
    store of its own and that directory read-only: B's stores go to its object store alone
    (each raised TierSubmitError, the read-only tier refusing its job, though the other tier
    took its own), and B loads A's block from the shared directory, A's bytes. Once B writes
    bytes of its own under that key and stores them, the shared directory forgets it: B loads
    its own bytes, never A's copy."""
    engine_a = CPUPrimaryTier(4, tiering.BLOCK_BYTES, torch.uint8)
    a = TieringManager(engine_a, {"shared": FileTier(engine_a.cache, tmp_path, agent=posix(),
                                                     durable=False)})
    a.store(tiering.write(engine_a, "seq0/blk0"))
    assert [done.success for done in a.drain(timeout=10)] == [True]
    engine_b = CPUPrimaryTier(4, tiering.BLOCK_BYTES, torch.uint8)
    b = TieringManager(engine_b, {
        "objects": ObjectStoreTier(engine_b.cache, agent=FakeNixlAgent("engine-b")),
        "shared": FileTier(engine_b.cache, tmp_path, agent=posix(), read_only=True)})

    assert len(b.store(tiering.write(engine_b, "seq1/blk0"))) == 1
    assert b.stats()["stores_skipped"] == {"objects": 0, "shared": 0}
    assert [(done.tier, done.success) for done in b.drain(timeout=10)] == [("objects", True)]
    assert b.load(["seq0/blk0"]) is not None
    [loaded] = b.drain(timeout=10)
    assert (loaded.tier, loaded.success) == ("shared", True)
    assert torch.equal(engine_b.cache[loaded.job.block_ids[0]], tiering.content("seq0/blk0"))

    # B writes other bytes under a key A stored there (its keys do not name their content):
    # the shared directory's copy is not B's, so B never loads it as B's block
    engine_b.free(loaded.job.block_ids)
    (mine,) = engine_b.allocate(["seq0/blk0"])
    engine_b.cache[mine] = tiering.content("engine B's own bytes")
    engine_b.complete_write([mine], success=True)
    assert len(b.store([mine])) == 1
    assert [(done.tier, done.success) for done in b.drain(timeout=10)] == [("objects", True)]
    engine_b.free([mine])
    assert b.tiers["shared"].lookup("seq0/blk0") is Lookup.MISS
    assert b.load(["seq0/blk0"]) is not None
    [loaded] = b.drain(timeout=10)
    assert (loaded.tier, loaded.success) == ("objects", True)
    assert torch.equal(engine_b.cache[loaded.job.block_ids[0]],
                       tiering.content("engine B's own bytes"))
    b.shutdown(timeout=10)
    a.shutdown(timeout=10)


class InterruptedEnter(threading.Condition):
    """The flusher's condition, whose next ``with`` (armed by the test) takes its lock and then
    raises KeyboardInterrupt: a Ctrl-C landing inside ``Condition.__enter__``, Python code,
    once the lock is taken."""

    armed = False

    def __enter__(self) -> bool:
        entered = super().__enter__()
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return entered


@real_nixl
def test_a_ctrl_c_as_a_durable_store_is_handed_to_the_flusher_leaves_it_flushing(
    cache: torch.Tensor, tmp_path: Path
) -> None:
    """A durable store's commit is handed to the flusher under the flusher's own lock, and a
    Ctrl-C may land as the caller's thread takes it. The lock is taken by a ``with`` on the
    lock itself, whose entry runs no Python code once it holds it, so there is no such
    place: the store and the next one are published, and shutdown ends. (Taken through the
    condition, whose ``__enter__`` is Python code, an interrupt there left the lock held by
    the caller's thread for good, and the flusher waiting for it: no durable store was
    published again.)"""
    tier = FileTier(cache, tmp_path, agent=posix(), durable=True)
    flusher = tier._flusher
    lock = getattr(flusher, "_lock", None) or threading.RLock()
    flusher._ready = ready = InterruptedEnter(lock)
    tier.submit_store(TransferJob(1, ["a"], [0]))
    ready.armed = True
    results: list[JobResult] = []
    with contextlib.suppress(KeyboardInterrupt):  # (where the condition's entry is used)
        while tier.state_of(1) is not None:
            results += tier.get_finished_jobs()
            time.sleep(0.001)
    tier.submit_store(TransferJob(2, ["b"], [1]))
    tier.drain_jobs(timeout=10)
    results += tier.get_finished_jobs()
    assert sorted((r.job_id, r.success) for r in results) == [(1, True), (2, True)]
    tier.shutdown(timeout=10)
    assert tier.closed


# -- the primary cache's memory moved -------------------------------------------------------------

@real_nixl
@pytest.mark.parametrize("move", ["share_memory_", "resize_", "data"])
def test_a_cache_whose_memory_moved_since_its_tier_was_made_is_refused_not_stored_from_old_memory(
    tmp_path: Path, cache: torch.Tensor, tiers: list[FileTier], move: str
) -> None:
    """The engine moves its cache after making the tier (into shared memory to hand it to a
    worker, a resize, another tensor's memory set as its data). NIXL has the old memory
    registered: a store would write what lies there (freed memory) to the file and succeed, a
    load would fill memory the cache left. Each is refused, naming the move, and nothing is
    written. (Both were published as successes: a file of other bytes, a HIT anywhere.)"""
    tier = FileTier(cache, tmp_path, agent=posix(), durable=False)
    tiers.append(tier)
    tier.submit_store(TransferJob(1, ["before"], [0]))
    assert results_of(tier)[1].success
    if move == "share_memory_":
        cache.share_memory_()
    elif move == "resize_":
        cache.resize_(BLOCKS * 4, BLOCK_BYTES)
    else:
        cache.data = cache.clone()
    for job, load in ((TransferJob(2, ["after"], [1]), False),
                      (TransferJob(3, ["before"], [2], is_promotion=True), True)):
        with pytest.raises(InvalidJobError,
                           match=rf"job {job.job_id} refused: the primary cache's memory moved "
                                 r"since this FileTier was made \(from 0x"):
            (tier.submit_load if load else tier.submit_store)(job)
    assert not tier.has_pending_work()
    assert not tier.path_of("after").exists()
    assert tier.get_finished_jobs() == []


@real_nixl
@pytest.mark.parametrize("load", [False, True], ids=["store", "load"])
def test_jobs_running_as_the_caches_memory_moves_fail_and_say_why(
    tmp_path: Path, cache: torch.Tensor, tiers: list[FileTier], load: bool,
    caplog: pytest.LogCaptureFixture
) -> None:
    """Two jobs NIXL runs as the cache's memory moves (its old memory kept alive here, so
    NIXL's copies land somewhere): the next poll cancels them, and each fails, saying the
    memory moved; an error says so once. (Both were published as successes: the store of the
    old memory's bytes, the load into memory the cache no longer has.)"""
    agent = posix(faulty=True)
    tier = FileTier(cache, tmp_path, agent=agent, durable=False)
    tiers.append(tier)
    if load:
        tier.submit_store(TransferJob(9, ["k1", "k2"], [0, 1]))
        assert results_of(tier)[9].success
    agent.inject("check_xfer_state", StayProc(5), times=2)
    for job_id, name, block_id in ((1, "k1", 2), (2, "k2", 3)):
        job = TransferJob(job_id, [name], [block_id], is_promotion=load)
        (tier.submit_load if load else tier.submit_store)(job)
    old = cache.data
    cache.data = cache.clone()  # (old keeps the memory NIXL copies alive)
    results = results_of(tier)
    assert sorted(results) == [1, 2]
    for result in results.values():
        assert not result.success
        assert result.reason is not None
        assert "the primary cache's memory moved" in str(result.reason)
    assert sum("unpublished job(s) are cancelled" in record.message
               for record in caplog.records) == 1
    del old


def test_a_read_only_tier_looks_for_a_block_again_once_a_failed_loads_miss_is_old(
    cache: torch.Tensor, tmp_path: Path, tiers: list[FileTier]
) -> None:
    """A read-only tier never stores, so a failed load's MISS that lasted until a store of its
    own lasted for good: the block was lost to that engine while others stored it again. It
    lasts ``failed_load_miss_seconds`` now; then the block is looked for, and loaded, again
    (a writing tier's MISS stays until it stores the block: no load is made again and again)."""
    class Reader(FileTier):
        failed_load_miss_seconds = 0.2

    writer = FileTier(cache, tmp_path, agent=posix(), durable=False)
    reader = Reader(cache, tmp_path, agent=posix(), read_only=True)
    tiers += [writer, reader]
    writer.submit_store(TransferJob(1, ["k"], [1]))
    assert results_of(writer)[1].success
    path = tmp_path / writer.remote_name("k")
    moved = path.rename(tmp_path / "elsewhere")  # (an eviction by the writer, say)
    assert reader.lookup("k") is Lookup.MISS
    reader.submit_load(TransferJob(2, ["k"], [3], is_promotion=True))
    assert not results_of(reader)[2].success
    moved.rename(path)  # stored again
    assert reader.lookup("k") is Lookup.MISS, "not at once: the failed load is that recent"
    time.sleep(0.25)
    assert reader.lookup("k") is Lookup.HIT
    cache[3] = 0
    reader.submit_load(TransferJob(3, ["k"], [3], is_promotion=True))
    assert results_of(reader)[3].success and block(cache, 3) == block(cache, 1)
