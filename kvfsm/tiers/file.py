"""A file secondary tier: one file per KV block under a root directory, over NIXL's POSIX backend.

A store writes each block into a temporary file beside its final name. Only once NIXL answered
DONE does the commit flush the files (``fsync``) and rename them into place, one atomic rename a
block. So a crash at any moment leaves either the old file, or no file, or the complete new one:
never a half-written block under a block's name. Temporary files of a store that failed are
removed when the transfer is cleaned up; those left by a crash never carry a block's name and
are removed by :meth:`FileTier.remove_stale`.
"""

from __future__ import annotations

import hashlib
import os
import re
import urllib.parse
import weakref
from pathlib import Path

import torch

from kvfsm.agent import NixlAgent
from kvfsm.driver import StorageSide
from kvfsm.engine import Declaration
from kvfsm.lifecycle import Answer, TransferState
from kvfsm.policy import RetryPolicy
from kvfsm.tiers.base import Lookup, SecondaryTier, key_text
from kvfsm.transfer import Leak, Transfer

__all__ = ["FileTier"]

_PARTIAL = ".partial-"
_MAX_NAME = 200  # longer names are hashed (file systems allow 255 bytes)
#: a key that quoting leaves as it is and that does not start with a dot
_PLAIN = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9_.~-]*").fullmatch


class _OpenFiles:
    """What a file transfer opened: descriptors, and the temporary paths of a store."""

    __slots__ = ("committed", "fds", "partial")

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.partial: list[tuple[str, str]] = []  # (temporary, final) paths, for a store
        self.committed = False


class _Files(StorageSide):
    """The remote side: one file per block; stores go to temporary files renamed on commit."""

    mem_type = "FILE"

    def __init__(self, tier: FileTier) -> None:
        self._tier: FileTier = weakref.proxy(tier)  # the tier holds this side: no cycle

    def open(self, transfer: Transfer) -> list[tuple[int, int, int, str]]:
        tier = self._tier
        opened = transfer.opened = _OpenFiles()
        descs = []
        directory, size, fds = tier.directory, tier.block_bytes, opened.fds
        for name in transfer.names:
            final = directory + name
            if transfer.job.is_promotion:
                fd = os.open(final, os.O_RDONLY | os.O_CLOEXEC)
            else:
                partial = f"{final}{_PARTIAL}{transfer.job_id}"
                fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                             0o644)
                opened.partial.append((partial, final))
            fds.append(fd)
            descs.append((0, size, fd, ""))
        return descs

    def commit(self, transfer: Transfer) -> None:
        opened: _OpenFiles = transfer.opened
        if self._tier.durable:
            for fd in opened.fds:
                os.fsync(fd)
        for partial, final in opened.partial:
            os.replace(partial, final)
        opened.committed = True
        if self._tier.durable and opened.partial:
            _fsync_dir(self._tier.root)

    def close(self, transfer: Transfer) -> list[Leak]:
        opened: _OpenFiles | None = transfer.opened
        leaks: list[Leak] = []
        if opened is None:
            return leaks
        for fd in opened.fds:
            try:
                os.close(fd)
            except OSError as error:
                leaks.append(Leak("close", f"fd {fd}: {error}"))
        if not opened.committed:
            for partial, _ in opened.partial:
                try:
                    os.unlink(partial)
                except FileNotFoundError:
                    pass
                except OSError as error:
                    leaks.append(Leak("unlink", f"{partial}: {error}"))
        transfer.opened = None
        return leaks


class FileTier(SecondaryTier):
    """Stores each block as one file under ``root``.

    Args:
        primary: the primary KV cache (contiguous CPU tensor, blocks on the first dimension).
        root: the directory holding the block files (created if missing).
        agent: a NIXL agent with the POSIX backend; None creates one.
        durable: ``fsync`` files and directory before a store succeeds, so a finished store
            survives a power loss too (a process crash never needs it).
        poll_interval: seconds :meth:`drain_jobs` sleeps between polls.
        machine: the lifecycle to run (see :class:`~kvfsm.tiers.base.SecondaryTier`).
        policy: retry bounds (:class:`~kvfsm.policy.RetryPolicy`).
    """

    def __init__(
        self,
        primary: torch.Tensor,
        root: str | os.PathLike[str],
        *,
        agent: NixlAgent | None = None,
        durable: bool = True,
        poll_interval: float = 0.0005,
        machine: Declaration[TransferState, Answer] | None = None,
        policy: RetryPolicy | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        #: the root as text, ending in a separator: a block's path is this and its name
        self.directory = os.path.join(self.root, "")
        self.durable = durable
        if agent is None:
            from kvfsm.nixl_agents import make_agent  # noqa: PLC0415 - NIXL is optional

            agent = make_agent(f"kvfsm-file-{id(self):x}", "POSIX")
        super().__init__(primary, agent=agent, remote=_Files(self), poll_interval=poll_interval,
                         machine=machine, policy=policy)

    def path_of(self, key: bytes | str) -> Path:
        """The file block ``key`` is stored in."""
        return self.root / self.remote_name(key)

    def remote_name(self, key: bytes | str) -> str:
        """The file name of block ``key``: its text (:func:`~kvfsm.tiers.base.key_text`) quoted
        for a file name; long names hashed."""
        if type(key) is str and len(key) <= _MAX_NAME and _PLAIN(key):
            return key  # nothing to quote, not hidden, not too long: the name as it is
        name = urllib.parse.quote(key_text(key), safe="")
        if len(name) > _MAX_NAME or name.startswith("."):
            name = "h-" + hashlib.sha256(name.encode()).hexdigest()
        return name

    def remove_stale(self) -> int:
        """Remove temporary files a crashed store left behind; returns how many."""
        in_flight = {p for t in self._transfers.values() if t.opened is not None
                     for p, _ in t.opened.partial}
        removed = 0
        for path in self.root.glob(f"*{_PARTIAL}*"):
            if self.directory + path.name not in in_flight:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def _probe(self, name: str) -> Lookup:
        # a stat of a local file is the cheapest probe there is; its answer is not cached, so
        # a file that appears later (another process stored it) is found
        return Lookup.HIT if (self.root / name).is_file() else Lookup.MISS


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
