"""A Ctrl-C lands wherever the interpreter is: a signal handler's ``KeyboardInterrupt`` is
raised between two lines, inside kvfsm's own bookkeeping too. Raised at each line of it a
poll runs (the runner's filing, the engine, the books, the tier's rounds), in turn, it must
lose nothing: afterwards a drain publishes every job once, a shutdown succeeds, NIXL is never
misused, and a parent's pins all come back. (Before the runner mended its books after an
interrupt, 134 of 413 such lines left a job that no drain finished, or a result lost.)

A trace function raises it at the start of each line, which reaches two places no signal
does in CPython 3.11 (it runs a handler on entering a function, on a loop's jump back and
after a call returns): a ``try:`` line, whose instruction no handler covers, and a ``with``
line as the block ends, before its exit is called. Those are left out, and so is the first
line of a ``finally:`` block: a signal checked before it is raised into the block, which then
runs that line all the same. The NIXL calls' own interrupts are the driver's and the fake
agent's tests'."""

from __future__ import annotations

import _thread
import collections
import inspect
import linecache
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest
import torch

import kvfsm
import kvfsm.driver
import kvfsm.tiers
import kvfsm.transfer
from kvfsm import TransferJob
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, Raise, ReturnErr
from kvfsm.tiering import CPUPrimaryTier, TieringManager
from kvfsm.tiers import ObjectStoreTier

from .test_tiering import BLOCK_BYTES, write

pytestmark = pytest.mark.timeout(300)

KVFSM = os.path.dirname(kvfsm.__file__)
#: the files whose lines are interrupted
BOOKKEEPING = tuple(os.path.join(KVFSM, *name.split("/")) for name in (
    "runner.py", "engine.py", "contract.py", "tiers/base.py"))


def interruptible(frame: Any) -> bool:
    """Whether a signal could land at ``frame``'s line (see the module's notes). Not inside a
    peer receiver's hold of SIGINT's handler (``_HeldSigint``): from the moment it is held
    until it is put back, a Ctrl-C only marks that it came, and raises nothing."""
    if frame.f_code.co_qualname.startswith("_HeldSigint."):
        return False
    filename, number = frame.f_code.co_filename, frame.f_lineno
    line = linecache.getline(filename, number).lstrip()
    if line.startswith(("try:", "with ")):
        return False
    before = ""
    while number > 1 and not before:
        number -= 1
        before = linecache.getline(filename, number).split("#")[0].strip()
    return before != "finally:"


@contextmanager
def interrupted_at(line: int | None, files: tuple[str, ...] = BOOKKEEPING
                   ) -> Iterator[list[int]]:
    """Count the lines kvfsm runs in ``files`` (returned, in a list of one); with ``line``,
    raise a KeyboardInterrupt at that one, as a signal handler would."""
    count = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and interruptible(frame):
            count[0] += 1
            if count[0] == line:
                raise KeyboardInterrupt
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename in files else None

    sys.settrace(calls)
    try:
        yield count
    finally:
        sys.settrace(None)


@contextmanager
def ctrl_c_entering(function: Any, called_from: str | None = None) -> Iterator[None]:
    """The block raises KeyboardInterrupt as ``function`` is entered (where a signal handler
    runs; only from a function of that name, with ``called_from``), once; the block must
    raise it."""
    def trace(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is function.__code__ and (
                called_from is None or frame.f_back.f_code.co_name == called_from):
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        sys.settrace(None)


@contextmanager
def _ctrl_c_inside(function: Any, when: Callable[[Any, str], bool]) -> Iterator[None]:
    """The block raises KeyboardInterrupt at the first trace event of ``function``'s frames
    that ``when(frame, event)`` picks, once; the block must raise it."""
    def local(frame: Any, event: str, arg: Any) -> Any:
        if when(frame, event):
            sys.settrace(None)
            raise KeyboardInterrupt
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code is function.__code__ else None)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        sys.settrace(None)


def ctrl_c_returning(function: Any) -> Any:
    """The block raises KeyboardInterrupt as ``function`` returns, its work done (where a
    signal handler runs once the last C call it makes returns), once; the block must raise
    it."""
    return _ctrl_c_inside(function, lambda frame, event: event == "return")


def ctrl_c_at_second_pass(function: Any) -> Any:
    """The block raises KeyboardInterrupt as ``function``'s first loop comes round the second
    time (its backward jump, where a signal handler runs), once; the block must raise it."""
    lines, start = inspect.getsourcelines(function)
    loop = next(start + index for index, line in enumerate(lines)
                if line.lstrip().startswith("for "))
    passes = [0]

    def second(frame: Any, event: str) -> bool:
        if event == "line" and frame.f_lineno == loop:
            passes[0] += 1
        return passes[0] == 2

    return _ctrl_c_inside(function, second)


def tier_with_stores_over(blocks: int, failing_release: bool
                          ) -> tuple[ObjectStoreTier, FakeNixlAgent]:
    """Three stores NIXL finishes by the next state check (a first release raising once)."""
    agent = FakeNixlAgent(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(16, 8), agent=agent)
    for job_id in range(3):
        tier.submit_store(TransferJob(job_id, [f"k{job_id}-{b}" for b in range(blocks)],
                                      [job_id * blocks + b for b in range(blocks)]))
    if failing_release:
        agent.inject("release_xfer_handle", Raise(), times=1)
    return tier, agent


def sweep(run: Callable[[int | None], list[str]], files: tuple[str, ...] = BOOKKEEPING,
          least: int = 100) -> dict[tuple[str, ...], list[int]]:
    """``run`` with its interrupt at each line of an uninterrupted run's, in turn: the lines
    after which something was wrong, by what was."""
    with interrupted_at(None, files) as count:
        assert run(-1) == []  # (-1: no interrupt, and the lines are counted)
    lines = count[0]
    assert lines > least
    wrong: dict[tuple[str, ...], list[int]] = collections.defaultdict(list)
    for line in range(1, lines + 1):
        problems = run(line)
        if problems:
            wrong[tuple(problems)].append(line)
    return dict(wrong)


@pytest.mark.parametrize(("blocks", "failing_release"), [(1, False), (1, True), (2, False)],
                         ids=["stores", "a-release-raising", "a-transfer-per-block"])
def test_an_interrupt_at_any_line_of_a_poll_loses_no_job(blocks: int,
                                                           failing_release: bool) -> None:
    def run(line: int | None) -> list[str]:
        tier, agent = tier_with_stores_over(blocks, failing_release)
        results = []
        with interrupted_at(line if line != -1 else None), suppress(KeyboardInterrupt):
            results += tier.get_finished_jobs()
        problems = []
        try:
            tier.drain_jobs(timeout=0.5)
        except Exception as error:
            problems.append(f"drain: {type(error).__name__}")
        results += tier.get_finished_jobs()
        try:
            tier.shutdown(timeout=0.5)
        except Exception as error:
            problems.append(f"shutdown: {type(error).__name__}")
        results += tier.get_finished_jobs()
        published = collections.Counter(result.job_id for result in results)
        if published != collections.Counter(range(3)):
            problems.append(f"results: {dict(published)}")
        if agent.misuses:
            problems.append(f"NIXL misused: {agent.misuses[0]}")
        return problems

    assert sweep(run) == {}


def test_an_interrupt_at_any_line_of_a_poll_leaves_no_failed_store_vouched_for() -> None:
    """Three stores NIXL fails (ERR): each must forget its keys, so that no load reads the
    copy the tier held before as the engine's new bytes. An interrupt while a store's books
    were written skipped the forget (4 lines a job), and the next mend wrote no book again."""
    def run(line: int | None) -> list[str]:
        agent = FakeNixlAgent(complete_after_polls=1)
        tier = ObjectStoreTier(torch.zeros(16, 8), agent=agent)
        for job_id in range(3):
            tier.submit_store(TransferJob(job_id, [f"k{job_id}"], [job_id]))
        agent.inject("check_xfer_state", ReturnErr(), times=3)
        with interrupted_at(line if line != -1 else None), suppress(KeyboardInterrupt):
            tier.get_finished_jobs()
        tier.drain_jobs(timeout=0.5)
        for job_id in range(3):
            tier.submit_load(TransferJob(10 + job_id, [f"k{job_id}"], [8 + job_id],
                                         is_promotion=True))
        tier.drain_jobs(timeout=0.5)
        reasons = {result.job_id: result.reason and result.reason.error_type
                   for result in tier.get_finished_jobs() if result.job_id >= 10}
        tier.shutdown(timeout=0.5)
        return [f"job {job_id}'s load: {why}" for job_id, why in sorted(reasons.items())
                if why != "ForgottenKeyError"]

    assert sweep(run) == {}


def test_a_failed_stores_books_cut_short_do_not_undo_a_later_store_of_its_keys() -> None:
    """Store 1 of "k" fails; a Ctrl-C lands in its books, once its result is queued. Store 2
    of "k", which NIXL finishes at its post, is published before the next poll mends the
    books. The mend forgot the failed store's keys again, undoing store 2's HIT: the key was
    refused to every load though the tier held its newest bytes. The forget is made before
    the failure is queued now, and the mend writes no book of a published job again."""
    agent = FakeNixlAgent(complete_after_polls=1)
    primary = torch.zeros(16, 8)
    tier = ObjectStoreTier(primary, agent=agent)
    tier.submit_store(TransferJob(1, ["k"], [0]))
    agent.inject("check_xfer_state", ReturnErr(), times=1)
    armed = [True]

    def ctrl_c(transfer: Any, result: Any) -> None:  # a signal, landing among the books
        if armed:
            armed.pop()
            raise KeyboardInterrupt

    tier._runner.on_final.append(ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        tier.get_finished_jobs()
    primary[1] = 2
    agent.complete_after_polls = 0  # over at its post: published without a poll
    tier.submit_store(TransferJob(2, ["k"], [1]))
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False), (2, True)]
    assert tier.lookup("k") is kvfsm.tiers.Lookup.HIT
    tier.submit_load(TransferJob(3, ["k"], [5], is_promotion=True))
    tier.drain_jobs(timeout=5)
    [loaded] = tier.get_finished_jobs()
    assert loaded.success, loaded.reason
    assert torch.equal(primary[5], primary[1])
    tier.shutdown(timeout=5)


def test_a_result_an_interrupt_left_queued_is_handed_out_once_with_a_progress_thread() -> None:
    """A store fails at its post; a Ctrl-C lands in its finish once its failure is queued. With
    a progress thread running, get_finished_jobs() handed the result out without mending the
    books, and the thread's next poll, mending them, found no result queued and published the
    job again. A damaged runner is now mended first, under the lock, by that call too."""
    import inspect  # noqa: PLC0415

    import kvfsm.runner  # noqa: PLC0415

    lines, start = inspect.getsourcelines(kvfsm.runner.Runner._finish)
    target = start + next(index for index, line in enumerate(lines)
                          if "self.bytes_in_flight -= transfer.nbytes" in line)

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not kvfsm.runner.Runner._finish.__code__:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == target:
                sys.settrace(None)
                raise KeyboardInterrupt
            return local
        return local

    agent = FakeNixlAgent(complete_after_polls=0)
    tier = ObjectStoreTier(torch.zeros(16, 8), agent=agent,
                           policy=RetryPolicy(progress_interval=0.05))
    agent.inject("transfer", ReturnErr(), times=1)
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            tier.submit_store(TransferJob(1, ["k"], [0]))
    finally:
        sys.settrace(None)
    results = tier.get_finished_jobs()
    tier.drain_jobs(timeout=5)
    results += tier.get_finished_jobs()
    tier.shutdown(timeout=5)
    results += tier.get_finished_jobs()
    assert [(result.job_id, result.success) for result in results] == [(1, False)]


def test_an_interrupt_at_any_line_of_a_step_loses_no_pin() -> None:
    """The same through a tiering manager's step: afterwards every job is finalized once and
    every block's pins are back to zero."""
    def run(line: int | None) -> list[str]:
        agent = FakeNixlAgent(complete_after_polls=1)
        primary = CPUPrimaryTier(8, BLOCK_BYTES, torch.uint8)
        manager = TieringManager(primary, {"objects": ObjectStoreTier(primary.cache,
                                                                      agent=agent)})
        submitted = [job for block in write(primary, "a", "b", "c")
                     for job in manager.store([block])]
        done = []
        with interrupted_at(line if line != -1 else None), suppress(KeyboardInterrupt):
            done += manager.step()
        problems = []
        try:
            done += manager.drain(timeout=0.5)
        except Exception as error:
            problems.append(f"drain: {type(error).__name__}")
        try:
            done += manager.shutdown(timeout=0.5)
        except Exception as error:
            problems.append(f"shutdown: {type(error).__name__}")
        finalized = collections.Counter(finished.job_id for finished in done)
        if finalized != collections.Counter(submitted):
            problems.append(f"finalized: {dict(finalized)}")
        pins = [primary.pin_count(block) for block in range(8)]
        if any(pins):
            problems.append(f"pins: {pins}")
        if agent.misuses:
            problems.append(f"NIXL misused: {agent.misuses[0]}")
        return problems

    assert sweep(run) == {}



class InterruptedAcquire(_thread.RLock):  # type: ignore[misc]
    """The tier's lock, whose next ``acquire`` (armed by the test) takes it and then raises
    KeyboardInterrupt: a Ctrl-C landing as the call returns, which is where CPython runs a
    signal handler. (A ``with`` block's entry does not call this ``acquire``.)"""

    armed = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        taken = super().acquire(blocking, timeout)
        if self.armed and taken:
            self.armed = False
            raise KeyboardInterrupt
        return taken


@pytest.mark.parametrize("call", ["drain_jobs", "shutdown"])
def test_a_ctrl_c_as_the_tiers_lock_is_taken_leaves_it_free(call: str) -> None:
    """A drain's or a shutdown's wait for the tier's lock is bounded, so it takes the lock
    with a timed ``acquire``; a Ctrl-C lands as that returns. The call raises
    KeyboardInterrupt, and the lock is free: another thread's submit returns, the jobs'
    results come, and shutdown ends. (The caller's thread used to keep the lock for good,
    without knowing it: every other thread's call, the progress thread's polls and the
    interpreter's exit waited for ever, and shutdown waited out its whole timeout.)"""
    tier = ObjectStoreTier(torch.zeros(8, 16), agent=FakeNixlAgent(complete_after_polls=2))
    tier._lock = lock = InterruptedAcquire()
    tier.submit_store(TransferJob(1, ["k1"], [1]))
    lock.armed = True
    with pytest.raises(KeyboardInterrupt):
        getattr(tier, call)(timeout=5)
    assert not lock.armed, "the interrupt came as the lock was taken"

    other = threading.Thread(target=tier.submit_store, args=(TransferJob(2, ["k2"], [2]),),
                             daemon=True)
    other.start()
    other.join(5)
    assert not other.is_alive(), "another thread's submit waited for the tier's lock"
    tier.drain_jobs(timeout=5)  # (the interrupted shutdown changed nothing yet: open)
    assert sorted((r.job_id, r.success) for r in tier.get_finished_jobs()) == [
        (1, True), (2, True)]
    tier.shutdown(timeout=5)
    assert tier.closed


def test_a_ctrl_c_as_a_submit_files_its_posted_transfer_loses_it_not() -> None:
    """A Ctrl-C lands as a submit, its post made, starts to file the transfer: the submit
    raises, and the job is NIXL's (``owes``). The next call files it from where the
    interrupt left it (posted: it has a handle), so a drain publishes it with NIXL's
    answer, its success (it stayed in its initial state for good: the drain ran out, and
    shutdown published it as cancelled)."""
    from kvfsm.runner import Runner  # noqa: PLC0415

    tier = ObjectStoreTier(torch.zeros(4, 8), agent=FakeNixlAgent(complete_after_polls=1))

    with ctrl_c_entering(Runner.take):
        tier.submit_store(TransferJob(1, ["k"], [0]))
    assert tier.owes(1)
    tier.drain_jobs(timeout=5)
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    tier.shutdown(timeout=1)


@pytest.mark.parametrize("call", ["drain_jobs", "shutdown"])
def test_a_ctrl_c_as_any_function_of_a_drain_or_a_shutdown_starts_leaves_the_lock_free(
    call: str,
) -> None:
    """A signal handler also runs as a Python function starts: a Ctrl-C raised at the start of
    each function kvfsm's books run in a drain or a shutdown, in turn, never leaves the tier's
    lock held by the interrupted thread (a release made in a context manager's ``__exit__``,
    a function starting, did, once the block was over)."""
    def run(interrupt_at: int) -> tuple[int, bool]:
        tier = ObjectStoreTier(torch.zeros(8, 16), agent=FakeNixlAgent(complete_after_polls=2))
        tier.submit_store(TransferJob(1, ["k1"], [1]))
        calls = [0]

        def trace(frame: Any, event: str, arg: Any) -> Any:
            if event == "call" and frame.f_code.co_filename in BOOKKEEPING:
                calls[0] += 1
                if calls[0] == interrupt_at:
                    raise KeyboardInterrupt
            return None

        sys.settrace(trace)
        try:
            getattr(tier, call)(timeout=2)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        held = tier._lock._is_owned()
        while tier._lock._is_owned():  # (so that the tier can be shut down)
            tier._lock.release()
        tier.shutdown(timeout=2)
        return calls[0], held

    calls, _ = run(0)
    assert calls > 20
    assert [at for at in range(1, calls + 1) if run(at)[1]] == []


def _ctrl_c_in_thread_start() -> Any:
    """A trace function raising KeyboardInterrupt once, in ``Thread.start``, once the thread
    runs and ``start`` waits for it to say so (where a signal handler would run)."""
    start, armed = threading.Thread.start.__code__, [True]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and armed[0] and "_started.wait" in linecache.getline(
                frame.f_code.co_filename, frame.f_lineno):
            armed[0] = False
            raise KeyboardInterrupt
        return local

    return lambda frame, event, arg: local if frame.f_code is start else None


def test_a_ctrl_c_as_the_progress_thread_starts_leaves_no_thread_shutdown_misses() -> None:
    """A Ctrl-C lands in ``Thread.start`` as the progress thread starts, once the thread runs:
    the tier knows of it all the same, so shutdown wakes it and it ends (a thread the tier
    did not know of took shutdown's wake, and the one it knew slept out its whole pause)."""
    tier = ObjectStoreTier(torch.zeros(8, 16), agent=FakeNixlAgent(complete_after_polls=1),
                           policy=RetryPolicy(progress_interval=30))
    sys.settrace(_ctrl_c_in_thread_start())
    try:
        with pytest.raises(KeyboardInterrupt):
            tier.submit_store(TransferJob(1, ["k1"], [1]))
    finally:
        sys.settrace(None)
    tier.submit_store(TransferJob(2, ["k2"], [2]))
    tier.drain_jobs(timeout=5)
    assert sorted(r.job_id for r in tier.get_finished_jobs()) == [1, 2]
    tier.shutdown(timeout=5)
    assert not [t for t in threading.enumerate() if t.name.startswith("kvfsm-progress")]


def test_a_ctrl_c_as_the_flusher_starts_leaves_no_thread_its_stop_misses(
    tmp_path: Any,
) -> None:
    """The same in the file tier's flusher, ten times: its stop ends the thread it knows of,
    and lets the directory's writer claim go (the thread started under the interrupt, unknown
    to it, took the stop's one wake in some of them, and the other waited for ever)."""
    from kvfsm.tiers.file import _Flusher  # noqa: PLC0415

    for trial in range(10):
        flusher = _Flusher(str(tmp_path))
        sys.settrace(_ctrl_c_in_thread_start())
        try:
            with pytest.raises(KeyboardInterrupt):
                flusher.hand([], [])
        finally:
            sys.settrace(None)
        flushed = threading.Event()
        flusher.hand([], [], flushed.set)
        assert flushed.wait(5), f"trial {trial}: the next commit was flushed"
        released = threading.Event()
        assert flusher.stop(2.0, released.set), f"trial {trial}"
        assert released.is_set(), "the writer's claim is let go of"


def test_a_ctrl_c_before_a_listeners_call_takes_the_lock_leaves_the_rounds_hold() -> None:
    """A listener, called inside a poll that holds the tier's lock, touches blocks; a Ctrl-C
    lands before its call takes the lock again (as the deadline's arithmetic starts). The
    poll's own hold stays: the poll lets go of the lock once, as it should, and the tier
    goes on (the listener's call let go of the poll's hold, and the poll's own
    release then raised RuntimeError in the interrupt's place)."""
    from kvfsm import contract  # noqa: PLC0415

    agent = FakeNixlAgent(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(8, 16), agent=agent, capacity_bytes=8 * 16 * 4,
                           remove=agent.remove_objects)
    tier.submit_store(TransferJob(1, ["k1"], [1]))
    held: list[bool] = []

    def listener(transfer: Any) -> None:
        try:
            with ctrl_c_entering(contract.seconds_left):
                tier.touch(["k1"])
        finally:
            held.append(tier._lock._is_owned())

    tier.on_published.append(listener)
    results = [r.job_id for r in tier.get_finished_jobs()]  # (the listener caught it)
    assert held == [True], "the poll still held the lock after the listener's call"
    assert not tier._lock._is_owned()
    tier.on_published.remove(listener)
    tier.submit_store(TransferJob(2, ["k2"], [2]))
    tier.drain_jobs(timeout=5)
    assert results + [r.job_id for r in tier.get_finished_jobs()] == [1, 2]
    tier.shutdown(timeout=5)


def test_a_ctrl_c_as_the_progress_thread_is_recorded_leaves_none_that_never_started() -> None:
    """A Ctrl-C lands as the tier records its progress thread, before the thread starts: the
    record goes again, so the next submit starts one, the jobs advance and shutdown ends (a
    thread that never started stayed recorded: no poll was made again, and every shutdown
    raised RuntimeError)."""
    import weakref  # noqa: PLC0415

    tier = ObjectStoreTier(torch.zeros(8, 16), agent=FakeNixlAgent(complete_after_polls=1),
                           policy=RetryPolicy(progress_interval=0.01))
    with ctrl_c_entering(weakref.WeakSet.add, called_from="_start_progress"):
        tier.submit_store(TransferJob(1, ["k1"], [1]))
    tier.submit_store(TransferJob(2, ["k2"], [2]))
    results: list[int] = []
    for _ in range(500):
        results += [r.job_id for r in tier.get_finished_jobs()]
        if len(results) == 2:
            break
        time.sleep(0.01)
    assert sorted(results) == [1, 2]
    tier.shutdown(timeout=5)
    assert tier.closed


def test_two_ctrl_cs_as_the_progress_thread_starts_leave_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C lands as ``Thread.start`` waits for the progress thread, and a second as the
    tier starts to check whether it runs: the thread runs, recorded but not yet saying so.
    The next submit waits for it to say so instead of starting another: one thread polls,
    and shutdown's wake ends it (two ran, and the one recorded slept out its pause)."""
    from kvfsm.tiers import base  # noqa: PLC0415

    tier = ObjectStoreTier(torch.zeros(8, 16), agent=FakeNixlAgent(complete_after_polls=50),
                           policy=RetryPolicy(progress_interval=3))
    real_started = base.started

    def ctrl_c_started(*args: Any) -> bool:  # the second Ctrl-C, as started() is entered
        monkeypatch.setattr(base, "started", real_started)
        raise KeyboardInterrupt

    monkeypatch.setattr(base, "started", ctrl_c_started)
    with ctrl_c_entering(threading.Event.wait, called_from="start"):
        tier.submit_store(TransferJob(1, ["k1"], [1]))
    tier.submit_store(TransferJob(2, ["k2"], [2]))

    def progress_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("kvfsm-progress")]

    assert len(progress_threads()) == 1
    tier.shutdown(timeout=5)
    for thread in progress_threads():
        thread.join(1)
    assert progress_threads() == [], "shutdown's wake ended the one thread"


@contextmanager
def ctrl_c_as_c_call_returns(function: Any, called: str) -> Iterator[None]:
    """The block raises KeyboardInterrupt as the first C call named ``called`` that a frame of
    ``function`` makes returns (a signal is checked there), once; the block must raise it."""
    def profile(frame: Any, event: str, arg: Any) -> None:
        if (event == "c_return" and frame.f_code is function.__code__
                and getattr(arg, "__name__", None) == called):
            sys.setprofile(None)
            raise KeyboardInterrupt

    sys.setprofile(profile)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        sys.setprofile(None)


def _sender_with_a_store_over() -> tuple[Any, Any]:
    """A peer sender whose store NIXL finished and published, not yet handed out."""
    from .test_peer import FakePair  # noqa: PLC0415

    pair = FakePair()
    pair.receiver.expect(TransferJob(1, ["3"], [3], is_promotion=True), pair.name)
    pair.sender.submit_store(TransferJob(1, ["3"], [0]))
    pair.sender.drain_jobs(5)
    return pair.sender, pair


@pytest.mark.parametrize("where", ["get_finished_jobs", "drain poll", "peer sender"])
def test_a_ctrl_c_as_a_tier_lets_go_of_its_lock_loses_no_result(where: str) -> None:
    """A Ctrl-C lands as a kvfsm tier's poll lets go of its lock (the release, a C call,
    returns), its stores over and published: the next call hands the results out. (They were
    taken under the lock, and lost with the call the Ctrl-C cut short: the job outstanding in
    the manager for good, its block pinned.)"""
    from kvfsm.contract import JobSide  # noqa: PLC0415
    from kvfsm.peer import PeerSender  # noqa: PLC0415

    other: Any = None
    if where == "peer sender":
        tier, other = _sender_with_a_store_over()
        call, function, released = tier.get_finished_jobs, PeerSender.get_finished_jobs, "__exit__"
    else:
        tier = ObjectStoreTier(torch.zeros(8, 16), agent=FakeNixlAgent())
        tier.submit_store(TransferJob(1, ["k1"], [1]))
        tier.drain_jobs(5)
        if where == "drain poll":
            call, function, released = (lambda: tier._drain_poll(None), JobSide._drain_poll,
                                        "release")
        else:
            call, function, released = (tier.get_finished_jobs, JobSide.get_finished_jobs,
                                        "__exit__")
    with ctrl_c_as_c_call_returns(function, released):
        call()
    assert [(result.job_id, result.success) for result in call()] == [(1, True)]
    assert not tier.has_pending_work()
    tier.shutdown(5)
    if other is not None:
        other.receiver.shutdown(5)


@pytest.mark.parametrize("progress", [False, True], ids=["caller-polls", "progress-thread"])
def test_a_result_whose_finish_a_ctrl_c_cut_short_is_handed_out_once_beside_another_caller(
    monkeypatch: pytest.MonkeyPatch, progress: bool
) -> None:
    """Another thread W is about to take a tier's results, the lock let go of, when the
    caller's poll publishes job 1's result and a Ctrl-C lands as it is queued (its record not
    yet taken out). W does not take that result: it waits until the books are mended, and
    the job is handed out once. (W took it, and the mend, finding it no longer queued,
    published it again: handed out twice.)"""
    from kvfsm.contract import Books  # noqa: PLC0415
    from kvfsm.runner import Runner  # noqa: PLC0415

    policy = RetryPolicy(progress_interval=30) if progress else RetryPolicy()
    tier = ObjectStoreTier(torch.zeros(8, 16), agent=FakeNixlAgent(complete_after_polls=1),
                           policy=policy)
    at_take, go = threading.Event(), threading.Event()
    real_take = Books.take_results

    def take_results(self: Books) -> list[Any]:
        if threading.current_thread().name == "W":
            at_take.set()
            go.wait(10)  # W waits here, the lock let go of
        return real_take(self)

    monkeypatch.setattr(Runner, "take_results", take_results)
    handed: list[tuple[str, int]] = []
    worker = threading.Thread(target=lambda: handed.extend(
        ("W", result.job_id) for result in tier.get_finished_jobs()), name="W")
    worker.start()
    assert at_take.wait(10)
    tier.submit_store(TransferJob(1, ["k1"], [1]))  # PROC; the next check says DONE
    with ctrl_c_as_c_call_returns(Books.publish, "append"):
        tier._drain_poll(None)  # the caller's poll finds it DONE and publishes it
    go.set()
    worker.join(10)
    for _ in range(3):
        handed.extend(("M", result.job_id) for result in tier.get_finished_jobs())
    assert [job for _, job in handed] == [1], handed
    assert not tier.has_pending_work()
    tier.shutdown(5)


def _two_stores_over() -> ObjectStoreTier:
    """A tier whose two stores NIXL finished and published, not yet handed out."""
    tier = ObjectStoreTier(torch.zeros(8, 16), agent=FakeNixlAgent(complete_after_polls=1))
    tier.submit_store(TransferJob(1, ["k1"], [1]))
    tier.submit_store(TransferJob(2, ["k2"], [2]))
    with tier._lock:
        tier._poll(everything=True)
    assert [result.job_id for result in tier._books.results] == [1, 2]
    return tier


@pytest.mark.parametrize("returning", ["popleft", "append"])
def test_a_ctrl_c_as_a_result_is_taken_from_the_queue_loses_no_result(returning: str) -> None:
    """A Ctrl-C lands as a call handing a result out returns (taking it from the queue, or
    keeping it for the caller): the next call hands out both results, once. (It landed as the
    queue's ``popleft`` returned the result, which was then in neither: a job outstanding for
    good, its blocks pinned; a signal sent at random into the take lost a result in a third of
    the interrupts that landed there.) The ``append`` case holds the give-back to a result
    kept and still queued, which goes back once; CPython's specialized ``list.append`` checks
    no signal once warmed up, so it is the profile hook's landing more than a signal's."""
    from kvfsm.contract import Books  # noqa: PLC0415

    tier = _two_stores_over()
    with ctrl_c_as_c_call_returns(Books.take_results, returning):
        tier.get_finished_jobs()
    assert [(result.job_id, result.success) for result in tier.get_finished_jobs()] == [
        (1, True), (2, True)]
    assert tier.get_finished_jobs() == [] and not tier.has_pending_work()
    tier.shutdown(5)


def test_a_taker_coming_between_a_look_and_a_take_hands_out_no_result_whose_record_is_kept(
) -> None:
    """Two results are queued, job 2's finish still under way (its record kept). A second
    taker comes while the first has looked at job 1's record and not yet taken the result (a
    signal handler's call on this thread; another thread on an interpreter without the GIL):
    it gets nothing, and the first takes job 1 and leaves job 2 for later. (The second took
    job 1, and the first then took job 2 without looking: a result its finish could publish
    again, handed out twice.)"""
    from kvfsm.contract import Books  # noqa: PLC0415
    from kvfsm.transfer import JobResult  # noqa: PLC0415

    books = Books()
    books.records[2] = "job 2's record"
    books.publish(JobResult(1, True))
    books.publish(JobResult(2, True))
    second: list[JobResult] = []

    class ComesBetween(collections.deque):  # type: ignore[type-arg]
        def __getitem__(self, index: Any) -> Any:
            looked = super().__getitem__(index)
            if not second:
                second.append(JobResult(0, False))  # (once)
                second.extend(books.take_results())
            return looked

    books.results = ComesBetween(books.results)
    first = books.take_results()
    assert [result.job_id for result in first] == [1]
    assert [result.job_id for result in second[1:]] == []
    assert [result.job_id for result in books.results] == [2] and books.unreported == {2}
    del books.records[2]  # its finish is over: the next call hands it out
    assert [result.job_id for result in books.take_results()] == [2]
    assert books.take_results() == [] and books.unreported == set()


def test_a_second_ctrl_c_as_a_take_gives_its_results_back_loses_none() -> None:
    """A Ctrl-C as the queue hands a result over, and a second one as the take gives back
    what it took, as the job ids are marked again: the next call hands out both results,
    once. (The ids were marked first, then the results went back: a second Ctrl-C between
    the two lost the results, their ids marked as awaiting a result for good.)"""
    from kvfsm.contract import Books  # noqa: PLC0415

    tier = _two_stores_over()

    class FirstCtrlC(collections.deque):  # type: ignore[type-arg]
        """The first Ctrl-C, as the queue's popleft returns (a profile hook unsets itself
        once it raised: it makes the second)."""

        def popleft(self) -> Any:
            super().popleft()
            self.popleft = super().popleft  # type: ignore[method-assign]  # (once)
            raise KeyboardInterrupt

    tier._books.results = FirstCtrlC(tier._books.results)
    with ctrl_c_as_c_call_returns(Books.take_results, "update"):
        tier.get_finished_jobs()
    assert [(result.job_id, result.success) for result in tier.get_finished_jobs()] == [
        (1, True), (2, True)]
    assert tier.get_finished_jobs() == [] and not tier.has_pending_work()
    assert not tier._books.unreported
    tier.shutdown(5)


@pytest.mark.parametrize("where", ["before", "release_dlist_handle", "deregister_memory",
                                   "release_dlist_handle returned"])
def test_a_ctrl_c_as_shutdown_releases_the_caches_registration_asks_nixl_nothing_twice(
        where: str) -> None:
    """A Ctrl-C lands as shutdown releases the tier's registration of the primary cache (the
    tier is closed by then). Before the calls, the next shutdown makes them, each once (it did
    nothing, the tier being closed: the registration was held for good, silently). In a call
    (as it starts, or as it returns, when NIXL may have released it), that call is never made
    again (twice is a crash with NIXL's binding), and it is a leak saying so; so is the
    registration under a descriptor list so cut short, which is kept (the list may hold it)."""
    from kvfsm.tiers.base import SecondaryTier  # noqa: PLC0415

    call, _, returned = where.partition(" ")

    class CtrlCOnce(FakeNixlAgent):
        armed = False

        def _enter(self, name: str) -> Any:
            fault = super()._enter(name)
            if self.armed and name == call and not returned:
                self.armed = False
                raise KeyboardInterrupt
            return fault

        def release_dlist_handle(self, handle: Any) -> None:
            super().release_dlist_handle(handle)
            if self.armed and returned:
                self.armed = False
                raise KeyboardInterrupt

    agent = CtrlCOnce(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent)
    tier.submit_store(TransferJob(1, ["k"], [0]))
    tier.drain_jobs(timeout=5)
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]

    def cleanup_calls() -> int:
        return agent.faults.count("release_dlist_handle") + agent.faults.count(
            "deregister_memory")

    before = cleanup_calls()
    if where == "before":
        with ctrl_c_entering(SecondaryTier._release_primary):
            tier.shutdown(timeout=1)
    else:
        agent.armed = True
        with pytest.raises(KeyboardInterrupt):
            tier.shutdown(timeout=1)
    assert tier.closed
    tier.shutdown(timeout=1)
    tier.shutdown(timeout=1)  # nothing left: no call at all
    leaked = [(leak.call, leak.error) for _, leak in tier.stats()["leaked"]]
    assert agent.misuses == []
    if where == "before":
        assert cleanup_calls() == before + 2
        assert agent.live_dlist_handles() == 0 and agent.live_registrations() == 0
        assert leaked == []
        return
    assert cleanup_calls() == before + (1 if call == "release_dlist_handle" else 2)
    assert leaked[0] == (call, "cut short by an interrupt: whether NIXL released it is "
                               "unknown, so it is not asked again")
    if call == "release_dlist_handle":
        assert leaked[1] == ("deregister_memory", "not asked: the descriptor list on the "
                             "registration may still hold it")
        assert agent.live_registrations() == 1
        assert agent.live_dlist_handles() == (0 if returned else 1)
    else:
        assert len(leaked) == 1 and agent.live_dlist_handles() == 0


@pytest.mark.parametrize("call", ["release_dlist_handle", "deregister_memory"])
def test_a_ctrl_c_as_a_jobs_cleanup_call_returns_never_makes_it_again(call: str) -> None:
    """A Ctrl-C lands as a job's cleanup call returns (NIXL made it: where CPython raises a
    signal that came during a call). The cleanup goes on at the next poll without making that
    call again (it released the descriptor list a second time: NIXL's binding crashes on
    that), and the job's leaks say so; a descriptor list so cut short keeps its registration
    (not deregistered under it), a leak too; the tier's leaks say both."""

    class CtrlCAsItReturns(FakeNixlAgent):
        armed = False

        def release_dlist_handle(self, handle: Any) -> None:
            super().release_dlist_handle(handle)
            self._cut("release_dlist_handle")

        def deregister_memory(self, dereg_list: Any, backends: Any = ()) -> None:
            super().deregister_memory(dereg_list, backends)
            self._cut("deregister_memory")

        def _cut(self, name: str) -> None:
            if self.armed and name == call:
                self.armed = False
                raise KeyboardInterrupt

    agent = CtrlCAsItReturns(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent)
    tier.submit_store(TransferJob(1, ["k"], [0]))
    agent.armed = True
    with pytest.raises(KeyboardInterrupt):
        while not tier.get_finished_jobs():
            pass
    made = agent.faults.count(call)
    [result] = tier.get_finished_jobs()
    assert (result.job_id, result.success) == (1, True)
    assert agent.faults.count(call) == made and agent.misuses == []
    cut = ("cut short by an interrupt: whether NIXL released it is unknown, so it is not "
           "asked again")
    expected = [(call, cut)] + ([("deregister_memory", "not asked: the descriptor list on the "
                                  "registration may still hold it")]
                                if call == "release_dlist_handle" else [])
    assert [(job, leak.call, leak.error) for job, leak in tier.stats()["leaked"]] == [
        (1, *leak) for leak in expected]
    tier.shutdown(timeout=1)


@pytest.mark.parametrize(("entering", "called_from"), [("Outcome", "clean"), ("file", "_end")])
def test_a_ctrl_c_once_a_cleanup_made_its_calls_loses_none_of_its_leaks(
        entering: str, called_from: str) -> None:
    """A cleanup's descriptor list release raised (a leak); a Ctrl-C lands before the runner
    took its answer (as the answer is made, or as it is filed). The job still publishes that
    leak (it published none, the handle leaked all the same: the cleanup made again had
    nothing left to release and answered OK)."""
    from kvfsm.runner import Outcome, Runner  # noqa: PLC0415

    function = Outcome.__init__ if entering == "Outcome" else Runner.file
    agent = FakeNixlAgent(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent)
    agent.inject("release_dlist_handle", Raise(), times=1)
    tier.submit_store(TransferJob(1, ["k"], [0]))
    with ctrl_c_entering(function, called_from=called_from):
        for _ in range(6):
            tier.get_finished_jobs()
    results = []
    for _ in range(6):
        results += tier.get_finished_jobs()
    assert [(r.job_id, r.success) for r in results] == [(1, True)]
    assert [(job, leak.call) for job, leak in tier.stats()["leaked"]] == [
        (1, "release_dlist_handle")]
    tier.shutdown(timeout=1)


@pytest.mark.parametrize("raising", [False, True])
def test_a_ctrl_c_as_a_file_tiers_close_returns_leaves_nothing_behind(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, raising: bool) -> None:
    """A Ctrl-C lands as the file tier's close of a stored job's files returns (whatever it
    could not release, in its answer, lost with it): the job publishes, its leaks saying the
    close was cut short, and the driver keeps nothing of it afterwards. (A close whose leaks
    were lost so published none; one that found none left the driver holding the published
    transfer for the tier's life.)"""
    from kvfsm.tiers import FileTier  # noqa: PLC0415
    from kvfsm.tiers.file import _Files  # noqa: PLC0415

    real = _Files.close
    armed = [True]

    def close(self: Any, transfer: Any) -> Any:
        leaks = real(self, transfer)
        if raising and armed[0]:  # (what this close could not release: lost with it)
            leaks = [*leaks, kvfsm.transfer.Leak("close", "OSError: injected")]
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return leaks

    monkeypatch.setattr(_Files, "close", close)
    tier = FileTier(torch.zeros(4, 8), str(tmp_path), agent=FakeNixlAgent(complete_after_polls=1),
                    durable=False)
    tier.submit_store(TransferJob(1, ["k"], [0]))
    results: list[Any] = []
    for _ in range(10):
        with suppress(KeyboardInterrupt):
            results += tier.get_finished_jobs()
    assert not armed[0]
    assert [(r.job_id, r.success) for r in results] == [(1, True)]
    assert [(job, leak.call, leak.error) for job, leak in tier.stats()["leaked"]] == [
        (1, "close", "cut short by an interrupt: what it could not release is unknown")]
    assert tier._driver._cut_short == {}
    tier.shutdown(timeout=1)


def test_a_ctrl_c_once_a_raising_release_is_kept_counts_its_leak_once() -> None:
    """A descriptor list's release raised, and its leak is kept; a Ctrl-C lands as the keeping
    returns. The leak is counted once, and the registration is deregistered on the next poll
    as it would have been (the call was counted again as cut short, the registration kept and
    a third leak said so)."""
    agent = FakeNixlAgent(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent)
    agent.inject("release_dlist_handle", Raise(), times=1)
    tier.submit_store(TransferJob(1, ["k"], [0]))
    clean = kvfsm.driver.TransferDriver.clean.__code__
    armed = [True]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if (armed[0] and event == "c_return" and frame.f_code is clean
                and getattr(arg, "__name__", "") == "append"):
            armed[0] = False
            sys.setprofile(None)
            raise KeyboardInterrupt

    results: list[Any] = []
    sys.setprofile(profile)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in range(10):
                results += tier.get_finished_jobs()
    finally:
        sys.setprofile(None)
    for _ in range(10):
        results += tier.get_finished_jobs()
    assert [(r.job_id, r.success) for r in results] == [(1, True)]
    assert [(job, leak.call, leak.error) for job, leak in tier.stats()["leaked"]] == [
        (1, "release_dlist_handle", "FakeNixlError: NIXL_ERR_BACKEND")]
    assert agent.faults.count("deregister_memory") == 1 and agent.misuses == []
    tier.shutdown(timeout=1)


@pytest.mark.parametrize("blocks", [1, 2])
def test_a_ctrl_c_as_a_transfer_handles_release_returns_never_releases_it_again(
        blocks: int) -> None:
    """A Ctrl-C lands as NIXL's release of a transfer handle returns (NIXL released it; a job
    of two blocks has a handle per block). The next poll goes on without asking NIXL to
    release it again (it did, on every poll: the fake agent refused each as a misuse, and
    the job was never published)."""
    method = (kvfsm.driver.TransferDriver._release_others if blocks > 1
              else kvfsm.driver.TransferDriver.release)
    agent = FakeNixlAgent(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(8, 8), agent=agent)
    tier.submit_store(TransferJob(1, [f"k{b}" for b in range(blocks)], list(range(blocks))))
    armed = [True]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if (armed[0] and event == "return" and frame.f_code.co_name == "release_xfer_handle"
                and frame.f_back is not None and frame.f_back.f_code is method.__code__):
            armed[0] = False
            raise KeyboardInterrupt

    results: list[Any] = []
    sys.setprofile(profile)
    try:
        for _ in range(3):
            with suppress(KeyboardInterrupt):
                results += tier.get_finished_jobs()
    finally:
        sys.setprofile(None)
    assert not armed[0]
    tier.drain_jobs(timeout=5)
    results += tier.get_finished_jobs()
    assert [(r.job_id, r.success) for r in results] == [(1, True)]
    assert agent.faults.count("release_xfer_handle") == blocks and agent.misuses == []
    tier.shutdown(timeout=1)


def test_a_ctrl_c_at_each_line_never_publishes_a_short_object_nor_leaves_a_mark() -> None:
    """Loads on an object store tier, two of them reading an object shorter than a block,
    with a Ctrl-C at each line of the bookkeeping in turn: no load of a short object is
    published as a success, every job gets one result, and no block of a load that did not
    succeed keeps the tier's mark. (An interrupt as a failure was latched left the outcome
    unset at the cleanup, which then took no mark off.)"""
    jobs = {0: (["full-1", "short-1"], [0, 1]), 1: (["short-2"], [2]), 2: (["full-2"], [3])}

    def run(line: int | None) -> list[str]:
        agent = FakeNixlAgent(complete_after_polls=1)
        cache = torch.full((4, 8), 7.0)
        tier = ObjectStoreTier(cache, agent=agent)
        size = tier.block_bytes
        for key in ("full-1", "full-2"):
            agent.objects[tier.object_key(key)] = b"\x41" * size
        for key in ("short-1", "short-2"):
            agent.objects[tier.object_key(key)] = b"\x42" * 5
        results = []
        with interrupted_at(line), suppress(KeyboardInterrupt):
            for job_id, (keys, blocks) in jobs.items():
                tier.submit_load(TransferJob(job_id, keys, blocks, is_promotion=True))
            results += tier.get_finished_jobs()
        tier.shutdown(timeout=5)
        results += tier.get_finished_jobs()
        problems = []
        counted = collections.Counter(result.job_id for result in results)
        if any(count > 1 for count in counted.values()):
            problems.append(f"twice: {sorted(counted.elements())}")
        if any(result.success and result.job_id in (0, 1) for result in results):
            problems.append("a short object published as a success")
        mark = tier._driver.remote.mark  # type: ignore[attr-defined]
        raw = cache.view(torch.uint8)
        if any(raw[block, -8:].numpy().tobytes() == mark for block in range(4)):
            problems.append("a mark left in a block")
        if agent.misuses:
            problems.append("misuse")
        return problems

    assert dict(sweep(run)) == {}
