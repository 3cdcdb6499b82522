"""A file secondary tier: one file per KV block under a root directory, over NIXL's POSIX backend.

Names. A block's file name is its key's text (:func:`~kvfsm.tiers.base.key_text`) when that is a
plain name (letters, digits, ``_ . ~ -``, not starting with a dot, at most 200 characters);
otherwise the text percent-quoted, with a leading dot quoted too (``%2E``); a quoted name longer
than 200 characters is ``%h-`` and the SHA-256 of the quoted name. Plain names hold no ``%``,
quoting always puts two hex digits after one, and ``%h`` never comes out of quoting, so two keys
never share a file (short of a SHA-256 collision), and no key's file starts with a dot: names
starting with ``.`` belong to kvfsm (temporary files, writer files). Bytes keys share the str
keys' names (``b"k"`` is ``"6b"``). Names keep the keys' case: on a root that folds case (vfat,
an SMB share, a casefold directory) keys differing only in case would share a file, so such a
root takes keys of one case only (docs/operations.md, "Names").

Stores. A store writes each block into a temporary file of its own,
``.kvfsm-partial-<writer>-<n>-<name>``, created with ``O_EXCL``: ``<writer>`` is a random id per
tier instance and ``<n>`` counts that tier's temporary files, so two tiers sharing a directory
(two engines, or a restarted engine whose old process is still exiting) never write into one
file; the last rename of a block wins, with a whole block either way. Only once NIXL answered
DONE is a file renamed onto its block's name, one atomic rename a block, so a crash at any
moment leaves the old file, no file, or the whole new one; and a lookup says HIT only for a file
of exactly one block's size.

Durability. With ``durable=True`` the commit (``fsync`` of each file, the renames, ``fsync`` of
the directory) runs on the tier's flusher thread, never on the caller's: the poll that sees NIXL
finish hands the files over and the driver answers the machine PROC (the declared stay in
PROCESSING: for the machine the store runs until its commit is over); the flusher tells the
tier when the flush is over (:attr:`~kvfsm.runner.Runner.commits_over`), and the next poll checks
that store first and fires DONE, or RAISED with the flush's error (meanwhile the poll
schedule asks about it only at its turns in the sweep; a drain, and a poll with few running,
ask about every running transfer). The directory is flushed once per
batch of stores, however many. So a poll, a submit, ``drain_jobs(timeout)`` and
``shutdown(timeout)`` never wait on the disk; a store's result waits for its flush instead, and
``shutdown`` waits for a store being flushed as for one NIXL still runs (the flusher takes no
lock of the tier's). A flush still under way for a store already published (one that failed
meanwhile: cancelled during its flush, a state check that failed after NIXL's DONE, past
``max_running_seconds``) is waited for only up to ``shutdown``'s deadline: it never touches the
primary cache, so past the deadline the flusher is left to end by itself (it holds no reference
to the tier, and closes its copies of the descriptors). With ``durable=False`` the renames are
made inline (a rename is cheap) and nothing is flushed: a process crash keeps every finished
store, a power loss may not.

Cancel. A store cancelled before NIXL finished it is not committed: it fails and leaves no new
block. One cancelled while its flush is under way fails too, and its flush is abandoned: no
rename is made, and the flusher removes its temporary files, unless the renames had begun, which
are not undone (its blocks, whole, may then be in place). So is the flush of a store whose state
check fails after NIXL had answered DONE (a fault only injection makes), and of a store failed
past :attr:`~kvfsm.policy.RetryPolicy.max_running_seconds` while its flush was under way: a
rename made later, after a store of the same block by another tier on the root succeeded,
would put the failed store's bytes under a name that tier vouches for.

Stale files. Each tier holds an exclusive ``flock`` on its writer file ``.kvfsm-writer-<writer>``
from its first store until shutdown; the kernel drops the lock when the process dies, whatever
killed it. A temporary file is stale once its writer's lock can be taken (or its writer file is
gone), and only then does :meth:`FileTier.remove_stale` remove it: another live tier's files, in
this process or another, are left alone. A pid would not do: it is reused, and it does not tell
two tiers of one process apart. This needs every process sharing the directory to see the
others' ``flock`` locks (a local file system does; over NFS it is as good as the lock
emulation), and a process forked without ``exec`` shares its parent's lock, so its parent's
files count as live while either runs. The lock is given up only once the tier's flusher
ended: a flusher left running past ``shutdown``'s deadline (or by a tier dropped mid-flush)
keeps it, and gives it up as it ends, so no other tier removes a file it may still rename (and
the tier's own :meth:`~FileTier.remove_stale`, after shutdown, counts them as another live
writer's). Temporary files of a store that failed are removed when its transfer is cleaned up.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import itertools
import logging
import os
import re
import secrets
import stat
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvfsm.agent import NixlAgent
from kvfsm.contract import check_interval
from kvfsm.driver import StepFunction, StorageSide
from kvfsm.engine import Declaration
from kvfsm.policy import InFlightLimit, RetryPolicy
from kvfsm.tiers.base import (
    InvalidJobError,
    Lookup,
    SecondaryTier,
    check_tier_options,
    key_text,
    started,
)
from kvfsm.transfer import Leak, Transfer, TransferJob

__all__ = ["FileTier", "RootNotWritableError"]

_MAX_NAME = 200  # longer names are hashed (names may have 255 bytes; a temporary one adds <= 53)
#: a key that quoting leaves as it is and that does not start with a dot
_PLAIN = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9_.~-]*").fullmatch
#: the start of a hashed name: quoting never puts a non-hex character after a "%"
_HASHED = "%h-"
#: kvfsm's own files start with a dot, which no block's name does
_PARTIAL = ".kvfsm-partial-"
_WRITER = ".kvfsm-writer-"
_WRITER_ID = re.compile(r"[0-9a-f]{16}")
#: a temporary file's name: the writer that created it is the first group
_PARTIAL_NAME = re.compile(re.escape(_PARTIAL) + r"([0-9a-f]{16})-").match

logger = logging.getLogger("kvfsm")


class RootNotWritableError(ValueError):
    """A FileTier that stores was given a root it cannot write to (a read-only file system,
    or no permission)."""


class _OpenFiles:
    """What a file transfer opened: descriptors, and the temporary paths of a store."""

    __slots__ = ("committed", "fds", "flush", "partial")

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.partial: list[tuple[str, str]] = []  # (temporary, final) paths, for a store
        self.committed = False  # renamed into place: nothing left to remove
        self.flush: _Flush | None = None  # the commit handed to the flusher, once it is


class _Files(StorageSide):
    """The remote side: one file per block; stores go to temporary files renamed on commit."""

    mem_type = "FILE"

    def __init__(self, directory: str, block_bytes: int, writer: _Writer, durable: bool,
                 flusher: _Flusher) -> None:
        self.directory = directory
        self.block_bytes = block_bytes
        self.durable = durable
        self._writer = writer
        self._flusher = flusher
        self._partials = itertools.count()

    def open(self, transfer: Transfer) -> list[tuple[int, int, int, str]]:
        opened = transfer.opened = _OpenFiles()
        if not transfer.job.is_promotion:  # nothing of a store is under a block's name
            transfer.landed = False  # until its commit renames (or hands the renames over)
        descs = []
        directory, size, fds = self.directory, self.block_bytes, opened.fds
        for name in transfer.names:
            final = directory + name
            if transfer.job.is_promotion:
                # (non-blocking: a FIFO under a block's name must not hold the tier up)
                fd = os.open(final, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
                fds.append(fd)  # (closed at the cleanup, whatever follows)
                _check_block(fd, final, size)
                # a block file: read as any (io_uring answers EAGAIN for O_NONBLOCK reads
                # that would wait for the disk, where it would otherwise wait)
                fcntl.fcntl(fd, fcntl.F_SETFL, os.O_RDONLY)
            else:
                # a name no other tier, and no earlier store of this one, ever used: O_EXCL
                # says so, rather than truncating a file someone else may still commit
                partial = f"{self._writer.claim()}{next(self._partials)}-{name}"
                fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             0o644)
                opened.partial.append((partial, final))
                fds.append(fd)
            descs.append((0, size, fd, ""))
        return descs

    def commit(self, transfer: Transfer) -> bool:
        """Rename a finished store's files into place; False while its flush is under way.

        A store cancelled before NIXL finished it (its outcome latched as failure) is not
        committed: it fails, so it leaves no new block (its temporary files go at cleanup). One
        cancelled while its flush is under way waits for the flush, abandoned unless its
        renames began (those are not undone: its blocks, complete, may then be in place).
        """
        opened: _OpenFiles = transfer.opened
        flush = opened.flush
        if flush is None:
            if transfer.success is False or not opened.partial:
                return True
            if not self.durable:
                transfer.landed = True  # the renames begin
                for partial, final in opened.partial:
                    os.replace(partial, final)
                opened.committed = True
                return True
            over = self.commit_over
            opened.flush = self._flusher.hand(
                opened.fds, opened.partial,
                None if over is None else functools.partial(over, transfer))
            transfer.landed = True  # the renames are the flusher's now
            return False
        if not flush.done:
            return False
        if flush.error is not None:
            raise flush.error
        opened.committed = True
        return True

    def close(self, transfer: Transfer) -> list[Leak]:
        opened: _OpenFiles | None = transfer.opened
        leaks: list[Leak] = []
        if opened is None:
            return leaks
        fds = opened.fds
        while fds:  # each taken off before it is closed: a cleanup an interrupt cut short is
            fd = fds.pop()  # made again, and must not close a number the kernel gave a new
            try:  # file meanwhile (NIXL would move another transfer's blocks through it)
                os.close(fd)
            except OSError as error:
                leaks.append(Leak("close", f"fd {fd}: {error}"))
        flush = opened.flush
        if flush is not None and (flush.done or flush.abandoned) and not flush.placing:
            transfer.landed = False  # the flush failed, or was abandoned, before its renames
        if not opened.committed:
            # (a flush still under way, for a store that failed after NIXL finished it, owns
            # copies of the descriptors; it was abandoned unless its renames had begun, and a
            # rename it makes later finds its file gone, or puts a complete block in place)
            for partial, _ in opened.partial:
                try:
                    os.unlink(partial)
                except FileNotFoundError:
                    pass
                except OSError as error:
                    leaks.append(Leak("unlink", f"{partial}: {error}"))
        transfer.opened = None
        return leaks


class _Flush:
    """One store's commit, handed to the flusher: its descriptors (copies the flusher closes),
    its renames, how it went, and who to tell. ``done`` is set once ``error`` is final, and
    ``wake`` called after it (so whoever it tells finds the flush over)."""

    __slots__ = ("abandoned", "done", "error", "fds", "placing", "renames", "wake")

    def __init__(self, fds: list[int], renames: list[tuple[str, str]],
                 wake: Callable[[], None] | None = None) -> None:
        self.fds = fds
        self.renames = renames
        self.wake = wake
        self.error: Exception | None = None
        self.done = False
        self.placing = False  # renames begun: a block under its name may be this store's
        #: the store failed before its renames began (:meth:`_Flusher.abandon`): none is made
        self.abandoned = False

    def over(self) -> None:
        """Mark the flush done (its error final), then tell the tier's runner."""
        self.done = True
        wake, self.wake = self.wake, None
        if wake is not None:
            try:
                wake()
            except Exception:  # (a deque's append): never let it stop the batch's other
                # flushes being marked done; the store's sweep turn finds this one
                logger.exception("a flush's end could not be told to the tier")


class _Flusher:
    """Flushes finished stores on a thread of its own: ``fsync`` each file, rename it into
    place, then ``fsync`` the directory once for all the stores taken together.

    It knows nothing of the tier (no lock of the tier's, no reference to it: a dropped tier is
    freed at once) and owns only the copies of the descriptors it was handed, which it closes.
    The thread starts with the first commit (again with the next one, should it have failed to
    start or have died) and ends at :meth:`stop`, after the flushes it was handed: a commit
    handed over is never dropped halfway, and never left to a thread that is gone.
    """

    def __init__(self, root: str) -> None:
        self._root = root
        self._queue: list[_Flush] = []
        #: its own lock, never the tier's; taken as it is (``with self._lock``), not through
        #: the condition, whose ``__enter__`` is Python code an interrupt may land in once
        #: the lock is taken, leaving it held for good (the flusher then waits for ever)
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)
        #: the thread, once started (None before, and once it ended)
        self._thread: threading.Thread | None = None
        self._stopping = False
        #: called by the thread as it ends, when stop() left it running (the writer's release)
        self._at_end: Callable[[], None] | None = None

    def hand(self, fds: list[int], renames: list[tuple[str, str]],
             wake: Callable[[], None] | None = None) -> _Flush:
        """Queue a store's commit; its descriptors are duplicated, so closing the transfer's
        own never pulls a descriptor from under an ``fsync``. ``wake`` is called (on the
        flusher's thread) once the flush is over.

        Raises:
            Exception: the copies or the thread could not be made (a thread limit, say);
                nothing was queued, no copy is left open, and the next commit tries again.
        """
        copies: list[int] = []
        try:
            for fd in fds:
                copies.append(os.dup(fd))
            flush = _Flush(copies, list(renames), wake)
            with self._lock:
                if self._stopping:  # (shutdown waits for every store first: never the case)
                    raise RuntimeError("the file tier is shut down: it commits no more stores")
                if self._thread is None or not self._thread.is_alive():
                    self._start()
                self._queue.append(flush)
                self._ready.notify()
        except BaseException:
            for fd in copies:
                os.close(fd)
            raise
        return flush

    def abandon(self, flush: _Flush) -> None:
        """The store of ``flush`` failed: its renames are not made, unless they began. Its
        temporary files are then removed by the flusher, or by the transfer's cleanup,
        whichever comes first."""
        with self._lock:  # (the flusher decides under it whether the renames begin)
            if not flush.placing:
                flush.abandoned = True

    def _start(self) -> None:
        """Start a thread (with ``_ready`` held); it is recorded before it starts (an
        interrupt inside ``start`` may leave it running: a thread nobody knows of would
        take a flush, or a stop's wake, meant for another), and forgotten again if it never
        started, so a start that fails leaves no thread that never runs and no flush nobody
        takes."""
        thread = threading.Thread(target=self._run, name="kvfsm-file-flush", daemon=True)
        self._thread = thread
        try:
            thread.start()  # (its first step waits for the lock held here)
        except BaseException as error:  # (only an interrupt may have left it running)
            if not started(thread, 0.0 if isinstance(error, Exception) else 0.5):
                self._thread = None
            raise

    def stop(self, timeout: float | None, at_end: Callable[[], None]) -> bool:
        """End the thread once the flushes handed over are done, waiting up to ``timeout``
        seconds for it (None: as long as it takes), and call ``at_end`` once no flush runs:
        here if the thread ended in time (or never ran), else on the thread as it ends.

        Returns:
            True when the thread ended (or never ran); False when it was left running.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._stopping = True
            self._ready.notify_all()  # (every thread that waits: one is all there should be)
        while True:
            with self._lock:  # the thread takes _at_end under this lock as it ends: one call
                thread = self._thread
                if thread is None or not thread.is_alive():
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if thread is threading.current_thread() or (left is not None and left <= 0):
                    self._at_end = at_end
                    return False
            thread.join(left)
        at_end()
        return True

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._queue and not self._stopping:
                        self._ready.wait()
                    if not self._queue:
                        return
                    batch, self._queue = self._queue, []
                _flush(batch, self._root, self._lock)
        finally:
            abandoned: list[_Flush] = []
            at_end = None
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None
                if self._queue:  # died (only a bug, or an exit, does that): another thread
                    try:         # takes the flushes left, or they fail: none waits for ever
                        self._start()
                    except Exception:
                        abandoned, self._queue = self._queue, []
                if self._thread is None:
                    at_end, self._at_end = self._at_end, None
            for flush in abandoned:
                for fd in flush.fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                flush.fds = []
                flush.error = RuntimeError("the flusher thread ended before this flush")
                flush.over()
            if at_end is not None:
                at_end()


def _abandon_flush(flusher: _Flusher, transfer: Transfer) -> None:
    """(a book of a failure, as it is latched) A store that fails while its flush is under
    way has the flush abandoned, unless its renames began: a rename made later, after another
    store of the block succeeded (in another tier on this root: this tier's own flush in
    order), would put the failed store's bytes under a name that store vouches for."""
    opened = transfer.opened
    flush = opened.flush if isinstance(opened, _OpenFiles) else None
    if flush is not None and not flush.done:
        flusher.abandon(flush)


def _flush(batch: list[_Flush], root: str, lock: threading.RLock) -> None:
    """Commit each store of ``batch``: its files flushed, then renamed; the directory flushed
    once after all renames. A store whose flush or rename fails gets that error, and so does
    every store the batch renamed when the directory's flush fails."""
    completed = False
    try:
        renamed = [flush for flush in batch if _rename(flush, lock)]
        if renamed:
            try:
                _fsync_dir(root)
            except Exception as error:
                for flush in renamed:
                    flush.error = error.with_traceback(None)  # its text, not this frame
        completed = True
    finally:  # whatever happened, no store waits for this batch for ever
        for flush in batch:
            if not completed and flush.error is None:
                flush.error = RuntimeError("the flush was interrupted")
            flush.over()


def _rename(flush: _Flush, lock: threading.RLock) -> bool:
    """Flush one store's files and rename them into place; True when all were. A store that
    failed before its renames began (:meth:`_Flusher.abandon`, decided under ``lock``) has
    them removed instead. Its copies of the descriptors are closed either way."""
    try:
        for fd in flush.fds:
            os.fsync(fd)
        with lock:
            if not flush.abandoned:
                flush.placing = True
        if flush.abandoned:
            for partial, _ in flush.renames:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
            raise RuntimeError("the store failed before its renames: none was made")
        for partial, final in flush.renames:
            os.replace(partial, final)
    except Exception as error:  # that store's failure; the others go on
        flush.error = error.with_traceback(None)  # its text is kept, not this frame
        return False
    finally:
        fds, flush.fds = flush.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    return True


class _Writer:
    """This tier's claim on its temporary files: an exclusive ``flock`` held on its writer file
    ``.kvfsm-writer-<id>`` from the first store until :meth:`release` (or until the process
    dies, when the kernel drops it). A tier that only loads makes no file (its directory may be
    read-only). At shutdown the writer is retired at once (it claims nothing any more) but
    released only once the flusher ended, which may be later (see :meth:`_Flusher.stop`).

    The file is created with ``O_EXCL`` and locked, and then checked to be still in place: a
    :func:`_writer_gone` check in another tier may take the lock between the two, find the file
    unlocked, and remove it as a dead writer's. A tier that finds its file gone takes another
    id, before it created any temporary file. So a writer file in place and unlocked, or no
    writer file at all, proves that no live tier writes temporary files under that id.
    """

    def __init__(self, directory: str) -> None:
        self._directory = directory
        #: the process that made it (a forked child leaves the claim to its parent)
        self.pid = os.getpid()
        #: the writer id, once claimed (None before the first store, and once released)
        self.id: str | None = None
        #: every temporary file of this writer starts with this path, a number and a "-"
        self.prefix = ""
        self._path = ""
        self._fd = -1
        #: shut down: no temporary file is claimed any more (the lock may still be held)
        self.retired = False

    def claim(self) -> str:
        """The prefix of this writer's temporary files; the claim is made on the first call."""
        if self.retired:
            raise RuntimeError("the file tier is shut down: it writes no more files")
        if self.id is not None:
            return self.prefix
        while True:
            writer_id = secrets.token_hex(8)
            path = self._directory + _WRITER + writer_id
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # waits only for a check in progress
                if _in_place(fd, path):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # removed as a dead writer's before it was locked: another id
        self._path, self._fd = path, fd
        self.prefix = f"{self._directory}{_PARTIAL}{writer_id}-"
        self.id = writer_id
        return self.prefix

    def release(self) -> None:
        """Give the claim up: remove the writer file while still holding its lock, so a check
        that opened it meanwhile finds it removed. Idempotent."""
        self.retired = True
        fd, self._fd, self.id = self._fd, -1, None
        if fd < 0:
            return
        try:
            os.unlink(self._path)
        except OSError:
            pass
        finally:
            os.close(fd)


def _in_place(fd: int, path: str) -> bool:
    """True when ``path`` still names the file open as ``fd``."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _writer_gone(directory: str, writer_id: str) -> bool:
    """True when no live tier writes under ``writer_id``; its writer file, if left by a dead
    tier, is removed (while locked, see :class:`_Writer`)."""
    path = directory + _WRITER + writer_id
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # released, or removed as a dead writer's: its tier created no file since
    except OSError:
        return False  # cannot tell (another user's file, say): keep its files
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its tier holds the lock: alive
        if _in_place(fd, path):
            os.unlink(path)  # a dead writer's; a tier still about to lock it takes another id
            return True
        # (the lock was taken on a file removed meanwhile: gone, unless a file of the same
        # id, another tier's, took its place)
        return not os.path.lexists(path)
    finally:
        os.close(fd)  # drops the lock


class FileTier(SecondaryTier):
    """Stores each block as one file under ``root``.

    Several tiers (in one process or several) may share ``root``: each writes temporary files
    of its own, and the last rename of a block wins, with a complete block either way (tiers
    of different block sizes may share it too: a load checks that the file holds exactly one
    block of its own tier's size, and fails otherwise). A tier with a capacity removes the file
    of a block it evicts, whoever renamed it last, and the files of a store that failed once
    its renames began (all of them: a flush still under way counts as renaming); a store that
    failed before them (NIXL's error, an open that failed, a flush that failed before its
    first rename) leaves whatever is under its blocks' names, another tier's say, alone. Keys
    are named as the module docstring says; bytes keys share the str keys' names through
    :func:`~kvfsm.tiers.base.key_text` (``b"k"`` and ``"6b"`` are one block).

    Args:
        primary: the primary KV cache (contiguous CPU tensor, blocks on the first dimension).
        root: the directory holding the block files (created if missing); a relative one
            is taken from the working directory now (:attr:`root` is absolute), so a
            later ``os.chdir`` moves nothing.
        read_only: only load from ``root`` (stores are refused); a root that cannot be
            written to must say so, so a tier that could never store is refused at once
            rather than failing every store later. A read-only root need not exist yet if
            its parent does: its lookups answer MISS until other tiers' stores make it. A
            failed load's blocks answer MISS for :attr:`failed_load_miss_seconds`, and are
            then looked for again (a writing tier's stay MISS until it stores them again).
        agent: a NIXL agent with the POSIX backend; None creates one.
        durable: ``fsync`` files and directory before a store succeeds, so a finished store
            survives a power loss too (a process crash never needs it). The flush runs on the
            tier's own thread: a store's result waits for it, the caller never does.
        poll_interval: seconds :meth:`drain_jobs` sleeps between polls.
        machine: the lifecycle to run (see :class:`~kvfsm.tiers.base.SecondaryTier`).
        policy: retry bounds (:class:`~kvfsm.policy.RetryPolicy`).
        steps: the functions behind the machine's own effects (see
            :class:`~kvfsm.tiers.base.SecondaryTier`).
        capacity_bytes: the most bytes of block files the tier keeps (None: no bound); past
            it a store first deletes the least recently used files no transfer uses
            (:mod:`kvfsm.tiers.holdings`). Files it did not store itself are not counted.
        record_events: keep what the tier stored and removed for
            :meth:`~kvfsm.tiers.base.SecondaryTier.take_events`.
        in_flight: back-pressure, the bound on jobs and bytes in flight past which a store is
            refused (:class:`~kvfsm.policy.InFlightLimit`).
    """

    #: (read_only) seconds the blocks of a failed load answer MISS before they are looked for
    #: again: another engine may store them again meanwhile, and a read-only tier never does,
    #: so a MISS that lasted until a store of its own would last for good; a load that keeps
    #: failing is made at most once in this time, not again and again (F11)
    failed_load_miss_seconds: float = 10.0

    def __init__(
        self,
        primary: torch.Tensor,
        root: str | os.PathLike[str],
        *,
        read_only: bool = False,
        agent: NixlAgent | None = None,
        durable: bool = True,
        poll_interval: float = 0.0005,
        machine: Declaration[Any, Any] | None = None,
        policy: RetryPolicy | None = None,
        steps: Mapping[str, StepFunction] | None = None,
        capacity_bytes: int | None = None,
        record_events: bool = False,
        in_flight: InFlightLimit | None = None,
    ) -> None:
        # everything that can be refused, before the root is made
        check_tier_options(primary, agent=agent, machine=machine, steps=steps, policy=policy,
                           in_flight=in_flight, capacity_bytes=capacity_bytes,
                           record_events=record_events,
                           mem_type="FILE", tier="FileTier")
        check_interval("poll_interval", poll_interval)
        if type(durable) is not bool:  # ("false" from a configuration file is no False)
            raise ValueError(f"durable must be True or False, got {durable!r}")
        if not isinstance(root, str | os.PathLike) or not os.fspath(root):
            raise ValueError(f"root must be a directory's path, got {root!r}")
        if agent is None:  # NIXL is optional: without it, refused before the root is made
            from kvfsm.nixl_agents import _api  # noqa: PLC0415

            _api()  # raises NixlUnavailable, saying how to install it
        self.root = Path(root).absolute()  # (its '..' left to the OS: a symlink's parent)
        self.read_only = _check_root(self.root, read_only)
        #: the root as text, ending in a separator: a block's path is this and its name
        self.directory = os.path.join(self.root, "")
        self.durable = durable
        self._writer = _Writer(self.directory)
        self._flusher = _Flusher(str(self.root))
        # a tier dropped without shutdown still ends its thread and gives its claim up (the
        # finalizer holds neither the tier nor its agent)
        self._release_at_drop = weakref.finalize(self, _release, self._flusher, self._writer, 0.0)
        try:
            if agent is None:
                from kvfsm.nixl_agents import make_agent  # noqa: PLC0415 - NIXL is optional

                agent = make_agent(f"kvfsm-file-{id(self):x}", "POSIX")
            files = _Files(self.directory, int(primary[0].nbytes), self._writer, durable,
                           self._flusher)
            super().__init__(primary, agent=agent, remote=files,
                             poll_interval=poll_interval, machine=machine, policy=policy,
                             steps=steps, capacity_bytes=capacity_bytes,
                             record_events=record_events, in_flight=in_flight,
                             remove=functools.partial(_unlink, self.directory))
        except BaseException:
            self._release_at_drop()
            raise
        self._runner.on_failed.append(functools.partial(_abandon_flush, self._flusher))
        if self.read_only:  # it never stores: others store a block again, not it
            self._known.failed_load_miss = self.failed_load_miss_seconds

    def _submit(self, job: TransferJob, *, load: bool) -> None:
        if self.read_only and not load:
            raise InvalidJobError(f"job {getattr(job, 'job_id', job)!r}: this FileTier only "
                                  f"loads from {self.root} (read_only=True); stores are refused")
        super()._submit(job, load=load)

    @property
    def writer_id(self) -> str | None:
        """The ``<writer>`` in this tier's temporary files' names; None before its first store
        (and after shutdown)."""
        writer = self._writer
        return None if writer.retired else writer.id

    def path_of(self, key: bytes | str) -> Path:
        """The file block ``key`` is stored in."""
        return self.root / self.remote_name(key)

    def remote_name(self, key: bytes | str) -> str:
        """The file name of block ``key``: its text (:func:`~kvfsm.tiers.base.key_text`) as it
        is when plain, else quoted (a leading dot too), and hashed when long; never two keys'
        one name, never a name starting with a dot (see the module docstring)."""
        if type(key) is str and len(key) <= _MAX_NAME and _PLAIN(key):
            return key  # nothing to quote, not hidden, not too long: the name as it is
        text = key_text(key)
        if len(text) <= _MAX_NAME and _PLAIN(text):
            return text  # bytes, in hex
        name = urllib.parse.quote(text, safe="")
        if name.startswith("."):  # quoting leaves dots; "%2E" keeps the name out of kvfsm's
            name = "%2E" + name[1:]
        if len(name) > _MAX_NAME:
            name = _HASHED + hashlib.sha256(name.encode()).hexdigest()
        return name

    def remove_stale(self) -> int:
        """Remove temporary files whose writer is gone (a crashed or killed process, a tier
        dropped mid-store), and this tier's own that no transfer holds; returns how many.

        Temporary files of tiers still alive, in this process or another, are left alone; so
        are the writer files of live tiers (a dead tier's is removed).
        """
        directory = self.directory
        own = self.writer_id
        by_writer: dict[str, list[str]] = {}
        writers: set[str] = set()
        try:
            entries = os.scandir(directory)
        except FileNotFoundError:
            if self.read_only:
                return 0  # a read-only root no store made yet: nothing in it
            raise
        with entries:
            for entry in entries:
                name = entry.name
                if name.startswith(_PARTIAL):
                    match = _PARTIAL_NAME(name)
                    if match is not None:
                        by_writer.setdefault(match[1], []).append(directory + name)
                elif name.startswith(_WRITER) and _WRITER_ID.fullmatch(name[len(_WRITER):]):
                    writers.add(name[len(_WRITER):])
        # taken after the listing: a file of ours listed and still in flight is in here
        with self._lock:
            in_flight = {p for t in self.unpublished() if t.opened is not None
                         for p, _ in t.opened.partial}
        removed = 0
        for writer_id in writers | by_writer.keys():
            paths = by_writer.get(writer_id, ())
            if writer_id == own:
                paths = [p for p in paths if p not in in_flight]
            elif not _writer_gone(directory, writer_id):
                continue
            for path in paths:
                try:
                    os.unlink(path)
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def _probe(self, name: str) -> Lookup:
        # a stat of a local file is the cheapest probe there is; its answer is not cached, so
        # a file that appears later (another process stored it) is found. Only a file of one
        # block's size is a block: anything else was not written by a finished store
        try:
            found = os.stat(self.directory + name)
        except OSError:
            return Lookup.MISS
        if stat.S_ISREG(found.st_mode) and found.st_size == self.block_bytes:
            return Lookup.HIT
        return Lookup.MISS

    def _stop_probes(self) -> None:
        # shutdown found nothing in flight (a store being flushed counts as running), but a
        # flush may still run for a store published meanwhile (one that failed during its
        # flush): it is waited for up to shutdown's deadline only, as it never touches the
        # primary cache; left running, it ends by itself and gives the writer's claim up then
        self._release_at_drop.detach()
        deadline = self._stop_by
        if not _release(self._flusher, self._writer,
                        None if deadline is None else max(0.0, deadline - time.monotonic())):
            logger.warning("shutdown: a flush of a store already published is still under "
                           "way; the flusher ends by itself (this tier's writer lock is held "
                           "until then)")


def _check_block(fd: int, path: str, size: int) -> None:
    """Refuse to load from ``fd`` unless it is a regular file of exactly one block: a finished
    store leaves nothing else, and anything else (a block of another tier's size in a shared
    root, a file cut short, a FIFO) is not this tier's block.

    Raises:
        OSError: naming the file and what it is (the load fails by ``open``).
    """
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode):
        raise OSError(f"{path} is not a regular file: not a block")
    if found.st_size != size:
        raise OSError(f"{path} holds {found.st_size} bytes, not a block of {size}")


def _unlink(directory: str, names: Sequence[str]) -> int:
    """Delete the block files ``names``; returns how many could not be deleted (one already
    gone counts as deleted), logging the first failure."""
    failed = 0
    first: OSError | None = None
    for name in names:
        try:
            os.unlink(directory + name)
        except FileNotFoundError:
            pass
        except OSError as error:
            failed += 1
            first = first or error
    if first is not None:
        logger.warning("%d of %d evicted block file(s) in %s not deleted, left there; the "
                       "first: %s", failed, len(names), directory, first)
    return failed


def _release(flusher: _Flusher, writer: _Writer, timeout: float | None) -> bool:
    """Stop the flusher, waiting up to ``timeout`` seconds for it (None: as long as it takes),
    and give the writer's claim up once it ended: at once, or by the flusher as it ends, so no
    file it may still rename counts as stale before (another tier's
    :meth:`FileTier.remove_stale` leaves the files of a locked writer alone). True when the
    flusher ended in time. In a forked child, nothing: the claim and the flusher are the
    parent's (the child's copy gave the parent's claim up, and its partial files were then
    taken for stale)."""
    if os.getpid() != writer.pid:
        return True
    writer.retired = True
    return flusher.stop(timeout, writer.release)


def _check_root(root: Path, read_only: object) -> bool:
    """Make sure ``root`` is a directory the tier can use; returns ``read_only`` as a bool.

    Raises:
        ValueError: it is not a directory, cannot be created, or cannot be written to while
            ``read_only`` is False; nothing was created.
    """
    if not isinstance(read_only, bool):
        raise ValueError(f"read_only must be a bool, got {read_only!r}")
    if root.exists() and not root.is_dir():
        raise ValueError(f"FileTier root {str(root)!r} exists and is not a directory")
    if not root.exists():
        if read_only:  # nothing to load yet: found once other tiers' stores make it, unless
            if root.parent.is_dir():  # its parent is missing too (a mistyped path)
                return True
            raise ValueError(f"FileTier root {str(root)!r} does not exist, nor does its "
                             "parent (read_only=True: nothing to load)")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"FileTier root {str(root)!r} cannot be created: "
                             f"{error.strerror or error}") from None
    if read_only:
        return True
    if not os.access(root, os.W_OK | os.X_OK) or os.statvfs(root).f_flag & os.ST_RDONLY:
        raise RootNotWritableError(f"FileTier root {str(root)!r} cannot be written to (a "
                                   "read-only file system or no permission); pass "
                                   "read_only=True to only load from it")
    return False


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
