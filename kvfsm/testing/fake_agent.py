"""An in-memory stand-in for NIXL's ``nixl_agent``, for unit tests and fault injection.

:class:`FakeNixlAgent` serves the prepped-dlist call sequence of an object-store tier with the
call shapes of the real wrapper (``nixl._api.nixl_agent``) and moves real bytes between registered
host memory, addressed by raw pointers such as ``tensor.data_ptr()``, and
:attr:`FakeNixlAgent.objects`, an in-memory object store (``dict[str, bytes]``), or files, as
NIXL's POSIX backend does: a FILE descriptor ``(offset, length, fd, meta)`` addresses ``length``
bytes at ``offset`` of the open file ``fd`` (a :class:`~kvfsm.tiers.FileTier` runs on it).
Files fail as NIXL 1.5.1's POSIX backend fails them (checked against it): a descriptor whose fd
is closed or open for the other operation fails the post when it is the first, else the blocks
before it move and the transfer fails (NIXL_ERR_BACKEND); a READ of a file shorter than it asks
for fails too, having copied what it read; what a failed transfer moved stays moved. Where they
differ: NIXL hands a transfer's first 64 reads or writes to the kernel when it is posted and the
rest at later state checks, through the fd numbers it was given; the fake makes them all when
the transfer completes, through the fd numbers. So a test that closes (or reopens) a file's
descriptor while a transfer of a few blocks runs sees the fake fail (or write the reopened file)
where NIXL finishes the transfer as posted; past 64 blocks both use the fd numbers late.

Timing: ``complete_after_polls`` is the number of ``check_xfer_state`` calls a posted transfer
needs. With 0, ``transfer`` completes it at once and answers "DONE" (or, if it failed,
"PROC", the next check raising its failure, as NIXL answers a failed read). With ``n >= 1``,
``transfer`` answers "PROC", the first ``n - 1`` checks answer "PROC" and the n-th check
completes it. Bytes move at completion, all at once, and a failed transfer of objects moves
none. A completed transfer keeps answering "DONE"; a failed one keeps failing the same way;
either may be posted again.

Failures: what real NIXL reports becomes :class:`FakeNixlError` (or the ``TypeError``,
``KeyError`` or ``IndexError`` the real wrapper raises for malformed arguments). What would crash
or corrupt a real process becomes :class:`NixlMisuseError`, which is not a ``FakeNixlError``.
So does breaking the order kvfsm keeps, where NIXL 1.5.1 itself lets some pass: a descriptor
list released, or memory deregistered, before a transfer handle made from it (NIXL returns
normally once that transfer is over), and a second release of a handle (NIXL's Python wrapper
ignores it): a test that drives NIXL directly gets a misuse for either.

Faults: :meth:`FakeNixlAgent.inject` arms :data:`Fault` values for numbered calls. Every call of
a NIXL method is numbered per method name from 1 when it starts, failed calls included, and the
fault armed for that number is consumed then. After :meth:`FakeNixlAgent.close` every call raises
``NixlMisuseError`` at once; otherwise arguments are checked first, then misuse, then the fault
fires, then the call behaves as normal. A call that raises ``NixlMisuseError`` (or an
argument error) still consumes its fault. The only effect of ``Raise`` is the raise, except
on ``check_xfer_state`` of a running transfer: a raised state check ends the transfer as failed,
so its handle may then be released. (That holds in real NIXL for a transfer of one descriptor.
NIXL 1.5.1's OBJ backend answers a transfer of several with the error of one failed request while
its other requests still run, which this fake does not model: kvfsm's object-store tier makes a
transfer per block for that reason, and so must a test's own code that drives NIXL directly.)

Bookkeeping: the agent keeps only what is live (unreleased handles, registered descriptors,
running transfers), indexed so that every call costs the same however many calls ran before and
however many transfers are in flight. A released handle is forgotten; the handle object itself
says it was released (as NIXL's Python wrapper's do) and which agent made it, which is how a
second release is still told apart from a foreign handle. What grows is only what the caller
asked to keep: :attr:`FakeNixlAgent.objects`, :attr:`FakeNixlAgent.calls` and
:attr:`FakeNixlAgent.misuses`.

Interrupts: CPython runs a signal handler (whose KeyboardInterrupt then surfaces) only at a few
bytecodes: where a function starts, where a loop jumps back, right after a call returned; never
inside a C call, so a real NIXL call has happened whole or not at all. The fake's calls are
Python and pass many such points, so each one undoes what it did when an exception other than
its own answer (a FakeNixlError) escapes it: interrupted anywhere, it has had no effect on
handles, registrations, transfer states or the object store, and a caller that never got its
handle owes nothing. It is still numbered (it started) and may have consumed its fault. The one
exception is the bytes of a READ: an interrupted completion may have written part of its
destination, as a running transfer does, while the transfer stays where it was; an interrupted
WRITE to files puts back what the files held (their size, and what it could read of them: a
file opened write-only gets its size back only).

Not thread safe: drive one agent from one thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import operator
import os
from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import TracebackType
from typing import Any, SupportsIndex, TypeAlias, TypeVar

from kvfsm.testing.faults import FakeNixlError, Fault, FaultPlan, Raise, ReturnErr, StayProc

__all__ = [
    "FakeDlistHandle",
    "FakeNixlAgent",
    "FakeNixlError",
    "FakeRegDList",
    "FakeXferDList",
    "FakeXferHandle",
    "Fault",
    "NixlMisuseError",
    "Raise",
    "ReturnErr",
    "StayProc",
]

#: a registration descriptor: (addr, length, dev_id, meta)
RegDesc: TypeAlias = tuple[int, int, int, str]
#: a transfer descriptor: (addr, length, dev_id)
XferDesc: TypeAlias = tuple[int, int, int]

_LOCAL_AGENT = "NIXL_INIT_AGENT"
_MEM_TYPES = {
    "DRAM": "DRAM",
    "VRAM": "VRAM",
    "FILE": "FILE",
    "BLOCK": "BLOCK",
    "OBJ": "OBJ",
    "cpu": "DRAM",
    "cuda": "VRAM",
}
_SUPPORTED_MEM_TYPES = frozenset({"DRAM", "OBJ", "FILE"})
#: the memory types the remote side of a transfer may be
_REMOTE_TYPES = frozenset({"OBJ", "FILE"})
_OPERATIONS = frozenset({"WRITE", "READ"})
_handle_ids = itertools.count(0x1000)
#: each agent's serial number, kept on the handles it makes (an int, not the agent: a handle
#: that referred to its agent would keep it alive in a cycle through the agent's tables)
_agent_ids = itertools.count(1)
_Key = TypeVar("_Key")


class NixlMisuseError(Exception):
    """A call that would crash or corrupt a process using real NIXL."""


class FakeRegDList:
    """Registration descriptors ``(addr, length, dev_id, meta)`` of one memory type.

    Args:
        mem_type: "DRAM" or "OBJ".
        descs: the descriptors.
    """

    __slots__ = ("descs", "mem_type")

    def __init__(self, mem_type: str, descs: Iterable[RegDesc]) -> None:
        self.mem_type = mem_type
        self.descs: tuple[RegDesc, ...] = tuple(descs)

    def __len__(self) -> int:
        """Number of descriptors."""
        return len(self.descs)

    def __iter__(self) -> Iterator[RegDesc]:
        """The descriptors in order."""
        return iter(self.descs)

    def __repr__(self) -> str:
        return f"FakeRegDList({self.mem_type!r}, {list(self.descs)!r})"

    def trim(self) -> FakeXferDList:
        """The same descriptors without their meta, as a transfer descriptor list."""
        trimmed = FakeXferDList(self.mem_type, (d[:3] for d in self.descs))
        trimmed._metas = tuple(d[3] for d in self.descs)
        return trimmed


class FakeXferDList:
    """Transfer descriptors ``(addr, length, dev_id)`` of one memory type.

    One made by :meth:`FakeRegDList.trim` remembers the meta strings it was trimmed from
    (:attr:`metas`). The object key a prepped OBJ descriptor addresses is still resolved through its
    dev_id, as the real OBJ backend does.

    Args:
        mem_type: "DRAM" or "OBJ".
        descs: the descriptors.
    """

    __slots__ = ("_metas", "descs", "mem_type")

    def __init__(self, mem_type: str, descs: Iterable[XferDesc]) -> None:
        self.mem_type = mem_type
        self.descs: tuple[XferDesc, ...] = tuple(descs)
        self._metas: tuple[str, ...] | None = None

    @property
    def metas(self) -> tuple[str, ...] | None:
        """The meta strings of the registration this list was trimmed from, if any."""
        return self._metas

    def __len__(self) -> int:
        """Number of descriptors."""
        return len(self.descs)

    def __iter__(self) -> Iterator[XferDesc]:
        """The descriptors in order."""
        return iter(self.descs)

    def __repr__(self) -> str:
        return f"FakeXferDList({self.mem_type!r}, {list(self.descs)!r})"


class FakeDlistHandle:
    """Opaque handle to a prepped descriptor list; release it with the agent that made it.

    The agent forgets a handle once released; the handle keeps its released flag (as NIXL's
    Python wrapper's do) and its agent's serial number, so a second release is still told apart
    from another agent's handle without the agent keeping every handle it ever made.
    """

    __slots__ = ("_handle", "_owner", "_released")

    def __init__(self, value: int, owner: int = 0) -> None:
        self._handle = value
        self._owner = owner
        self._released = False

    def __repr__(self) -> str:
        return f"FakeDlistHandle(0x{self._handle:x}, released={self._released})"


class FakeXferHandle:
    """Opaque handle to a transfer; release it with the agent that made it.

    Forgotten by the agent once released, like :class:`FakeDlistHandle`.
    """

    __slots__ = ("_handle", "_owner", "_released")

    def __init__(self, value: int, owner: int = 0) -> None:
        self._handle = value
        self._owner = owner
        self._released = False

    def __repr__(self) -> str:
        return f"FakeXferHandle(0x{self._handle:x}, released={self._released})"


@dataclass(eq=False, slots=True)
class _Entry:
    """One registered descriptor (hashed by identity: the agent's indexes are keyed by it)."""

    mem_type: str
    addr: int
    length: int
    dev_id: int
    meta: str
    owner: FakeRegDList
    #: when it was registered on its agent: among descriptors that match, the latest wins
    seq: int
    live: bool = True
    #: the unreleased prepped lists that rely on it, by handle value
    lists: dict[int, _Prepped] = field(default_factory=dict)

    @property
    def desc(self) -> RegDesc:
        """The descriptor as registered."""
        return (self.addr, self.length, self.dev_id, self.meta)

    def covers(self, desc: XferDesc) -> bool:
        """Whether ``desc`` lies inside this registered descriptor."""
        addr, length, dev_id = desc
        return (
            self.live
            and dev_id == self.dev_id
            and addr >= self.addr
            and addr + length <= self.addr + self.length
        )


@dataclass(eq=False, slots=True)
class _Prepped:
    """A prepped descriptor list and what it relies on."""

    handle: FakeDlistHandle
    local: bool
    mem_type: str
    descs: tuple[XferDesc, ...]
    entries: tuple[_Entry, ...]
    keys: tuple[str, ...]
    #: the distinct registered descriptors in ``entries`` (a DRAM list of n blocks has one)
    unique: tuple[_Entry, ...]
    #: the unreleased transfer handles made from it, by handle value
    users: dict[int, FakeXferHandle] = field(default_factory=dict)


class _State(Enum):
    MADE = "made"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False, slots=True)
class _Xfer:
    """A transfer request and its progress."""

    handle: FakeXferHandle
    operation: str
    local: _Prepped
    remote: _Prepped
    #: (local DRAM address, length, where) per descriptor pair: an object key, or for a FILE
    #: descriptor (fd, offset)
    moves: tuple[tuple[int, int, Any], ...]
    state: _State = _State.MADE
    polls_left: int = 0
    hold: int = 0
    #: a NIXL code to raise again, or "ERR" to answer again, once failed
    failure: str | None = None
    #: the first FILE descriptor whose fd cannot do the operation (None: none), found when
    #: posted: the blocks before it move, and the transfer then fails, as in NIXL's POSIX
    stop_at: int | None = None
    #: while a call completes a WRITE: what the objects it writes held before (None: absent),
    #: or what the files it writes held, to put back if that call is interrupted; None again
    #: once the call returns
    overwritten: dict[str, bytes | None] | _FilesHeld | None = None


#: what a call may change on a transfer, saved to put back if the call is interrupted
_Progress: TypeAlias = tuple[_State, int, int, str | None]


def _index(value: object, what: str) -> int:
    """An unsigned integer field of a descriptor; TypeError otherwise (as pybind11 does)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r}") from None
    if number < 0:
        raise TypeError(f"{what} must not be negative, got {number}")
    return number


def _mem_type(call: str, mem_type: str | None) -> str:
    """The canonical memory type name; TypeError if missing, KeyError if unknown (as real)."""
    if mem_type is None:
        raise TypeError(f"{call}: a mem_type is needed with a list of tuples")
    return _MEM_TYPES[mem_type]


def _reg_descs(
    call: str, reg_list: object, mem_type: str | None
) -> tuple[str, tuple[RegDesc, ...]]:
    """Memory type and descriptors of a registration-style argument."""
    if isinstance(reg_list, FakeRegDList):
        return _MEM_TYPES[reg_list.mem_type], reg_list.descs
    if not isinstance(reg_list, list | tuple):
        raise TypeError(
            f"{call}: expected a FakeRegDList or a list of (addr, len, dev_id, meta) tuples, "
            f"got {type(reg_list).__name__}"
        )
    if not reg_list:
        raise IndexError(f"{call}: empty descriptor list")
    canonical = _mem_type(call, mem_type)
    descs: list[RegDesc] = []
    for desc in reg_list:
        if not isinstance(desc, tuple) or len(desc) != 4:
            raise TypeError(f"{call}: expected (addr, len, dev_id, meta) 4-tuples, got {desc!r}")
        addr, length, dev_id, meta = desc
        if not isinstance(meta, str):
            raise TypeError(f"{call}: meta must be a str, got {meta!r}")
        descs.append(
            (_index(addr, "addr"), _index(length, "length"), _index(dev_id, "dev_id"), meta)
        )
    return canonical, tuple(descs)


def _xfer_descs(
    call: str, xfer_list: object, mem_type: str | None
) -> tuple[str, tuple[XferDesc, ...]]:
    """Memory type and descriptors of a transfer-style argument."""
    if isinstance(xfer_list, FakeXferDList):
        return _MEM_TYPES[xfer_list.mem_type], xfer_list.descs
    if not isinstance(xfer_list, list | tuple):
        raise TypeError(
            f"{call}: expected a FakeXferDList or a list of (addr, len, dev_id) tuples, "
            f"got {type(xfer_list).__name__}"
        )
    if not xfer_list:
        raise IndexError(f"{call}: empty descriptor list")
    canonical = _mem_type(call, mem_type)
    descs: list[XferDesc] = []
    for desc in xfer_list:
        if not isinstance(desc, tuple) or len(desc) != 3:
            raise TypeError(f"{call}: expected (addr, len, dev_id) 3-tuples, got {desc!r}")
        addr, length, dev_id = desc
        descs.append((_index(addr, "addr"), _index(length, "length"), _index(dev_id, "dev_id")))
    return canonical, tuple(descs)


def _seq(entry: _Entry) -> int:
    return entry.seq


def _add(index: dict[_Key, dict[_Entry, None]], key: _Key, entry: _Entry) -> None:
    """File ``entry`` under ``key`` (a no-op if it is there)."""
    group = index.get(key)
    if group is None:
        index[key] = {entry: None}
    else:
        group[entry] = None


def _drop(index: dict[_Key, dict[_Entry, None]], key: _Key, entry: _Entry) -> None:
    """Take ``entry`` out from under ``key``, and the key once nothing is left (a no-op if it
    is not there)."""
    group = index.get(key)
    if group is not None:
        group.pop(entry, None)
        if not group:
            del index[key]


def _resort(index: dict[_Key, dict[_Entry, None]], key: _Key) -> None:
    """Put the group under ``key`` back in registration order."""
    index[key] = dict.fromkeys(sorted(index[key], key=_seq))


def _first_unusable(xfer: _Xfer) -> int | None:
    """The index of the first FILE descriptor of ``xfer`` whose fd is closed or not open for
    its operation (a WRITE through a read-only fd, say); None when every one can do it."""
    wanted = (os.O_WRONLY, os.O_RDWR) if xfer.operation == "WRITE" else (os.O_RDONLY, os.O_RDWR)
    for index, (_, _, (fd, _)) in enumerate(xfer.moves):
        try:
            mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        except OSError:
            return index
        if mode not in wanted:
            return index
    return None


def _file_status(path: str) -> dict[str, str] | None:
    """What NIXL's POSIX backend answers a query of ``path`` with (None: no such file)."""
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return None
    return {"mtime": str(int(status.st_mtime)), "mode": str(status.st_mode),
            "size": str(status.st_size)}


@dataclass(eq=False, slots=True)
class _FilesHeld:
    """What the files a WRITE writes held before it, to put back if its call is interrupted:
    each file's size, and each range it writes, read before any is written (none from a file
    opened write-only)."""

    #: fd -> size
    sizes: dict[int, int] = field(default_factory=dict)
    #: (fd, offset, bytes) of each range the WRITE writes
    ranges: list[tuple[int, int, bytes]] = field(default_factory=list)

    @classmethod
    def before(cls, blocks: Sequence[tuple[int, int, bytes]]) -> _FilesHeld:
        """What the files of ``blocks`` ((fd, offset, bytes) each) hold now."""
        held = cls()
        for fd, offset, data in blocks:
            if fd not in held.sizes:
                try:
                    held.sizes[fd] = os.fstat(fd).st_size
                except OSError:  # (a closed descriptor: the write fails, nothing to put back)
                    continue
            if offset < held.sizes[fd]:
                with contextlib.suppress(OSError):
                    held.ranges.append((fd, offset, os.pread(fd, len(data), offset)))
        return held

    def put_back(self) -> None:
        """The ranges (each read before any was written, so where two overlap both hold what
        was there), then each file's size (best effort: a descriptor closed meanwhile has
        nothing to put back into)."""
        for fd, offset, old in self.ranges:
            with contextlib.suppress(OSError):
                os.pwrite(fd, old, offset)
        for fd, size in self.sizes.items():
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)


class FakeNixlAgent:
    """An in-memory NIXL agent with a loopback object-store backend ("OBJ") and a file one
    ("POSIX", memory type FILE).

    Args:
        name: the agent's name; ``prep_xfer_dlist(name, ...)`` preps the loopback (remote) side.
        complete_after_polls: how many ``check_xfer_state`` calls a posted transfer needs; 0 makes
            ``transfer`` complete it at once (see the module docstring).
        objects: an object store to use (shared, not copied), e.g. another agent's ``objects``.
    """

    def __init__(
        self,
        name: str = "fake-agent",
        *,
        complete_after_polls: int = 1,
        objects: dict[str, bytes] | None = None,
    ) -> None:
        if (
            isinstance(complete_after_polls, bool)
            or not isinstance(complete_after_polls, int)
            or complete_after_polls < 0
        ):
            raise ValueError(
                f"complete_after_polls must be an int >= 0, got {complete_after_polls!r}"
            )
        if objects is not None and not isinstance(objects, MutableMapping):
            raise ValueError(f"objects must be a dict of object names to bytes (another "
                             f"agent's objects, say), got {type(objects).__name__} {objects!r}")
        self.name = name
        self.complete_after_polls = complete_after_polls
        #: the object store: object key -> bytes
        self.objects: dict[str, bytes] = {} if objects is None else objects
        #: backend name -> handle, like the real agent's ``backends``
        self.backends: dict[str, int] = {"OBJ": 1, "POSIX": 2}
        #: the fault schedule, and the record of every call made
        self.faults = FaultPlan("FakeNixlAgent")
        #: the name of every NIXL call made, in order, failed ones included
        self.calls: list[str] = self.faults.calls
        self._serial = next(_agent_ids)
        self._seq = itertools.count()
        # only what is live, each table keyed so that a call finds what it needs at once:
        # unreleased transfers and those of them running, unreleased prepped lists (all by
        # handle value), and registered descriptors by memory type, by (memory type, dev_id)
        # and by (memory type, descriptor), each group in registration order
        self._xfers: dict[int, _Xfer] = {}
        self._running: dict[int, _Xfer] = {}
        self._dlists: dict[int, _Prepped] = {}
        self._by_type: dict[str, dict[_Entry, None]] = {}
        self._by_dev: dict[tuple[str, int], dict[_Entry, None]] = {}
        self._by_desc: dict[tuple[str, RegDesc], dict[_Entry, None]] = {}
        self._closed = False
        #: every misuse detected, also when the caller caught the NixlMisuseError it raised
        self.misuses: list[str] = []

    def _misuse(self, message: str) -> NixlMisuseError:
        """Record a misuse and return the error to raise."""
        self.misuses.append(message)
        return NixlMisuseError(message)

    # -- fault injection and introspection ------------------------------------------------

    def remove_objects(self, names: Sequence[str]) -> int:
        """Delete objects from the store (what an S3 client would do: NIXL cannot), e.g. as
        an :class:`~kvfsm.tiers.ObjectStoreTier`'s ``remove=``; returns 0 (none failed), and
        deleting an absent object is no error, as in S3."""
        for name in names:
            self.objects.pop(name, None)
        return 0

    def inject(self, call: str, fault: Fault, *, at: int | None = None, times: int = 1) -> None:
        """Arm ``fault`` for ``times`` calls of ``call`` (see :meth:`FaultPlan.inject`)."""
        self.faults.inject(call, fault, at=at, times=times)

    def chaos(self, rate: float, *, seed: int = 0, **options: Any) -> None:
        """Fail calls at random, reproducibly for a seed (see :meth:`FaultPlan.chaos`), as
        :class:`~kvfsm.testing.FaultyAgent` does on a real agent."""
        self.faults.chaos(rate, seed=seed, **options)

    def clear_faults(self) -> None:
        """Disarm every injected fault that has not fired yet."""
        self.faults.clear()

    def pending_faults(self) -> list[tuple[str, int, Fault]]:
        """What is still armed: one ``(call, call_number, fault)`` per call it will hit."""
        return self.faults.pending()

    def call_count(self, name: str) -> int:
        """How many calls of ``name`` were made, failed ones included."""
        return self.faults.count(name)

    def live_xfer_handles(self) -> int:
        """Transfer handles made and not yet released."""
        return len(self._xfers)

    def live_dlist_handles(self) -> int:
        """Prepped descriptor list handles made and not yet released."""
        return len(self._dlists)

    def live_registrations(self, mem_type: str | None = None) -> int:
        """Registered descriptors not yet deregistered, optionally of one memory type."""
        if mem_type is None:
            return sum(len(group) for group in self._by_type.values())
        return len(self._by_type.get(_MEM_TYPES.get(mem_type, mem_type), ()))

    def running_transfers(self) -> int:
        """Transfers posted and not yet seen DONE or failed."""
        return len(self._running)

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Tear the agent down; every later call raises NixlMisuseError.

        Raises:
            NixlMisuseError: a transfer is still running, or the agent is already closed.
        """
        self._enter("close")
        running = [xfer.handle for xfer in self._running.values()]
        if running:
            raise self._misuse(
                f"close: agent {self.name!r} still has running transfers {running!r}; "
                "poll them to DONE or failure first"
            )
        self._closed = True

    def __enter__(self) -> FakeNixlAgent:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._closed:
            self.close()

    # -- registration -------------------------------------------------------------------------

    def register_memory(
        self,
        reg_list: FakeRegDList | Sequence[RegDesc],
        mem_type: str | None = None,
        backends: Sequence[str] = (),
    ) -> FakeRegDList:
        """Register ``(addr, len, dev_id, meta)`` descriptors; for OBJ, meta is the object key.

        Raises:
            TypeError: not 4-tuples, or no mem_type with a list of tuples.
            KeyError: an unknown memory type or backend name.
            IndexError: an empty list.
            FakeNixlError: NIXL_ERR_NOT_FOUND for a memory type other than DRAM, OBJ and FILE.
        """
        fault = self._enter("register_memory")
        canonical, descs = _reg_descs("register_memory", reg_list, mem_type)
        self._check_backends(backends)
        self._fire_raise(fault)
        if canonical not in _SUPPORTED_MEM_TYPES:
            raise FakeNixlError("NIXL_ERR_NOT_FOUND")
        registered = FakeRegDList(canonical, descs)
        seq = self._seq
        entries = [_Entry(canonical, *desc, owner=registered, seq=next(seq)) for desc in descs]
        try:
            for entry in entries:
                self._file(entry)
            return registered
        except BaseException:  # interrupted: undone (see the module docstring)
            for entry in entries:
                self._unfile(entry)
            raise

    def deregister_memory(self, dereg_list: FakeRegDList, backends: Sequence[str] = ()) -> None:
        """Deregister descriptors registered by :meth:`register_memory` (matched by content).

        Raises:
            TypeError: not a FakeRegDList.
            NixlMisuseError: an unreleased transfer handle relies on one of the descriptors.
            FakeNixlError: NIXL_ERR_NOT_FOUND if a descriptor is not registered (nothing changes).
        """
        fault = self._enter("deregister_memory")
        if not isinstance(dereg_list, FakeRegDList):
            raise TypeError(
                f"deregister_memory: expected a FakeRegDList, got {type(dereg_list).__name__}"
            )
        self._check_backends(backends)
        canonical = _MEM_TYPES[dereg_list.mem_type]
        chosen: dict[_Entry, None] = {}  # in descriptor order
        missing = False
        for desc in dereg_list.descs:
            entry = self._match_entry(canonical, desc, dereg_list, chosen)
            if entry is None:
                missing = True
                continue
            user = self._user_of(entry)
            if user is not None:
                raise self._misuse(
                    f"deregister_memory: {canonical} descriptor {desc!r} is still used by "
                    f"unreleased {user!r}; release the transfer handle first"
                )
            chosen[entry] = None
        self._fire_raise(fault)
        if missing:
            raise FakeNixlError("NIXL_ERR_NOT_FOUND")
        try:
            for entry in chosen:
                self._unfile(entry)
        except BaseException:  # interrupted: undone (see the module docstring)
            self._refile(chosen)
            raise

    def query_memory(
        self,
        reg_list: FakeRegDList | Sequence[RegDesc],
        backend: str,
        mem_type: str | None = None,
    ) -> list[dict[str, str] | None]:
        """Whether objects exist: ``{}`` for a present key (the meta), ``None`` for an absent one;
        for FILE, the meta is a path, answered as NIXL's POSIX backend does: its ``mtime``,
        ``mode`` and ``size`` as text, or ``None`` where there is no such file.

        Raises:
            TypeError: not 4-tuples, or no mem_type with a list of tuples.
            ValueError: an unknown backend.
            FakeNixlError: NIXL_ERR_NOT_SUPPORTED for a memory type other than OBJ and FILE.
        """
        fault = self._enter("query_memory")
        canonical, descs = _reg_descs("query_memory", reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(
                f"Backend '{backend}' not found. Available backends: {list(self.backends)}"
            )
        self._fire_raise(fault)
        if canonical == "FILE":
            return [_file_status(desc[3]) for desc in descs]
        if canonical != "OBJ":
            raise FakeNixlError("NIXL_ERR_NOT_SUPPORTED")
        return [{} if desc[3] in self.objects else None for desc in descs]

    # -- descriptor lists and transfers --------------------------------------------------------

    def prep_xfer_dlist(
        self,
        agent_name: str,
        xfer_list: FakeXferDList | Sequence[XferDesc],
        mem_type: str | None = None,
        backends: Sequence[str] = (),
    ) -> FakeDlistHandle:
        """Prep descriptors: local side with "NIXL_INIT_AGENT", loopback side with ``self.name``.

        OBJ descriptors are resolved to object keys now, through their dev_id: the most recent
        live OBJ registration covering the descriptor wins.

        Raises:
            TypeError: not 3-tuples, or no mem_type with a list of tuples.
            IndexError: an empty list.
            NixlMisuseError: a DRAM descriptor outside every registered DRAM region (real NIXL
                refuses it with NIXL_ERR_NOT_FOUND; the fake treats it as a bug).
            FakeNixlError: NIXL_ERR_NOT_FOUND for another agent's name, an OBJ descriptor with no
                registration, or a memory type other than DRAM, OBJ and FILE.
        """
        fault = self._enter("prep_xfer_dlist")
        canonical, descs = _xfer_descs("prep_xfer_dlist", xfer_list, mem_type)
        self._check_backends(backends)
        entries: list[_Entry] = []
        if canonical == "DRAM":
            for desc in descs:
                entry = self._covering(canonical, desc)
                if entry is None:
                    raise self._misuse(
                        f"prep_xfer_dlist: DRAM descriptor {desc!r} lies outside every "
                        "registered DRAM region; a transfer would touch unregistered memory"
                    )
                entries.append(entry)
        self._fire_raise(fault)
        local = agent_name in (_LOCAL_AGENT, "")
        if not local and agent_name != self.name:
            raise FakeNixlError("NIXL_ERR_NOT_FOUND")
        if canonical not in _SUPPORTED_MEM_TYPES:
            raise FakeNixlError("NIXL_ERR_NOT_FOUND")
        keys: tuple[Any, ...] = ("",) * len(descs)
        if canonical in _REMOTE_TYPES:
            for desc in descs:
                entry = self._covering(canonical, desc)
                if entry is None:
                    raise FakeNixlError("NIXL_ERR_NOT_FOUND")
                entries.append(entry)
            keys = (tuple(entry.meta for entry in entries) if canonical == "OBJ"
                    else tuple((desc[2], desc[0]) for desc in descs))  # FILE: (fd, offset)
        handle = FakeDlistHandle(next(_handle_ids), self._serial)
        unique = tuple(dict.fromkeys(entries))
        prepped = _Prepped(handle, local, canonical, descs, tuple(entries), keys, unique)
        value = handle._handle
        try:
            self._dlists[value] = prepped
            for entry in unique:
                entry.lists[value] = prepped
            return handle
        except BaseException:  # interrupted: undone (see the module docstring)
            self._dlists.pop(value, None)
            for entry in unique:
                entry.lists.pop(value, None)
            raise

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: FakeDlistHandle,
        local_indices: Iterable[SupportsIndex],
        remote_xfer_side: FakeDlistHandle,
        remote_indices: Iterable[SupportsIndex],
        notif_msg: bytes | str = b"",
        backends: Sequence[str] = (),
        skip_desc_merge: bool = False,
    ) -> FakeXferHandle:
        """Make a WRITE (local DRAM to objects or files) or READ (back to local DRAM) transfer.

        Raises:
            KeyError: an operation other than "WRITE" and "READ", or an unknown backend.
            NixlMisuseError: a handle this agent did not make, one already released, or one whose
                registered memory was deregistered.
            FakeNixlError: NIXL_ERR_INVALID_PARAM for index lists of different or zero length,
                an index out of range, sides prepped the wrong way round, or descriptor pairs of
                different lengths; NIXL_ERR_NOT_SUPPORTED unless local is DRAM and remote OBJ
                or FILE; NIXL_ERR_BACKEND for a notification (the fake supports none).
        """
        call = "make_prepped_xfer"
        fault = self._enter(call)
        if operation not in _OPERATIONS:
            raise KeyError(operation)
        self._check_backends(backends)
        local_idx = [operator.index(i) for i in local_indices]
        remote_idx = [operator.index(i) for i in remote_indices]
        local = self._dlist(call, local_xfer_side)
        remote = self._dlist(call, remote_xfer_side)
        for prepped in (local, remote):
            if not all(entry.live for entry in prepped.unique):
                raise self._misuse(
                    f"{call}: {prepped.handle!r} refers to memory that was deregistered"
                )
        self._fire_raise(fault)
        if len(local_idx) != len(remote_idx) or not local_idx:
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM")
        if not local.local or remote.local:
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM")
        for indices, prepped in ((local_idx, local), (remote_idx, remote)):
            if any(not 0 <= i < len(prepped.descs) for i in indices):
                raise FakeNixlError("NIXL_ERR_INVALID_PARAM")
        pairs = [
            (local.descs[i], remote.descs[j], remote.keys[j])
            for i, j in zip(local_idx, remote_idx, strict=True)
        ]
        if any(ldesc[1] != rdesc[1] for ldesc, rdesc, _ in pairs):
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM")
        if local.mem_type != "DRAM" or remote.mem_type not in _REMOTE_TYPES:
            raise FakeNixlError("NIXL_ERR_NOT_SUPPORTED")
        if notif_msg:
            raise FakeNixlError("NIXL_ERR_BACKEND")
        handle = FakeXferHandle(next(_handle_ids), self._serial)
        moves = tuple((ldesc[0], ldesc[1], key) for ldesc, _, key in pairs)
        xfer = _Xfer(handle, operation, local, remote, moves)
        value = handle._handle
        try:
            self._xfers[value] = xfer
            local.users[value] = handle
            remote.users[value] = handle
            return handle
        except BaseException:  # interrupted: undone, so no handle the caller never got is live
            self._xfers.pop(value, None)
            local.users.pop(value, None)
            remote.users.pop(value, None)
            raise

    def transfer(self, handle: FakeXferHandle, notif_msg: bytes | str = b"") -> str:
        """Post a transfer: "PROC", or "DONE" with ``complete_after_polls=0``.

        Raises:
            NixlMisuseError: a handle this agent did not make, or one already released.
            FakeNixlError: NIXL_ERR_REPOST_ACTIVE if it is still running; NIXL_ERR_BACKEND for a
                notification, a transfer of files whose first descriptor's fd cannot do the
                operation (closed, or opened for the other one). (With
                ``complete_after_polls=0``, which completes it here, a transfer that fails
                then answers "PROC", and the next check raises its failure, as NIXL's.)
        """
        fault = self._enter("transfer")
        xfer = self._xfer("transfer", handle)
        self._fire_raise(fault)
        if isinstance(fault, ReturnErr):
            return "ERR"
        if notif_msg:
            raise FakeNixlError("NIXL_ERR_BACKEND")
        if xfer.state is _State.RUNNING:
            raise FakeNixlError("NIXL_ERR_REPOST_ACTIVE")
        saved = self._progress(xfer)
        answer = "PROC"  # (returned by name: see _restore)
        try:
            self._set_state(xfer, _State.RUNNING)
            xfer.failure = None
            xfer.hold = 0
            xfer.polls_left = max(self.complete_after_polls - 1, 0)
            if xfer.remote.mem_type == "FILE":
                xfer.stop_at = _first_unusable(xfer)
                if xfer.stop_at == 0:  # NIXL's POSIX backend refuses the post itself
                    error = FakeNixlError("NIXL_ERR_BACKEND")
                    self._fail(xfer, "NIXL_ERR_BACKEND")
                    raise error
            if isinstance(fault, StayProc):
                xfer.hold = fault.polls - 1
            elif self.complete_after_polls == 0:
                # posted, and failed at once: as NIXL, which answers the post PROC and the
                with contextlib.suppress(FakeNixlError):  # failure on the next check
                    answer = self._complete(xfer)
                xfer.overwritten = None
            return answer
        except FakeNixlError:  # refused at the post: posted, and over
            raise
        except BaseException:  # interrupted: not posted (see the module docstring)
            self._restore(xfer, saved)
            raise

    def check_xfer_state(self, handle: FakeXferHandle) -> str:
        """Poll a transfer: "PROC" while it runs, "DONE" once it completed.

        Raises:
            NixlMisuseError: a handle this agent did not make, or one already released.
            FakeNixlError: NIXL_ERR_BACKEND when the transfer failed (a READ of a missing object
                or of one whose length differs from the descriptor), again on every later check;
                NIXL_ERR_NOT_POSTED for a transfer never posted.
        """
        fault = self._enter("check_xfer_state")
        xfer = self._xfer("check_xfer_state", handle)
        saved = self._progress(xfer)
        try:
            answer = self._check(xfer, fault)
            xfer.overwritten = None
            return answer
        except FakeNixlError:  # the answer: the transfer failed (or was never posted)
            raise
        except BaseException:  # interrupted: the transfer is where it was
            self._restore(xfer, saved)
            raise

    def _check(self, xfer: _Xfer, fault: Fault | None) -> str:
        """What :meth:`check_xfer_state` answers, and what it does to the transfer."""
        if isinstance(fault, StayProc):
            xfer.hold = fault.polls - 1
            return "PROC"
        if isinstance(fault, Raise | ReturnErr):
            outcome = fault.code if isinstance(fault, Raise) else "ERR"
            if xfer.state is _State.RUNNING:
                self._fail(xfer, outcome)
            return self._answer_failure(outcome)
        if xfer.hold:
            xfer.hold -= 1
            return "PROC"
        if xfer.state is _State.MADE:
            raise FakeNixlError("NIXL_ERR_NOT_POSTED")
        if xfer.state is _State.DONE:
            return "DONE"
        if xfer.state is _State.FAILED:
            return self._answer_failure(xfer.failure or "NIXL_ERR_BACKEND")
        if xfer.polls_left:
            xfer.polls_left -= 1
            return "PROC"
        return self._complete(xfer)

    def release_xfer_handle(self, handle: FakeXferHandle) -> None:
        """Release a transfer handle whose transfer is not running; the agent forgets it.

        Raises:
            NixlMisuseError: released already, not made by this agent, or its transfer may still
                be running (posted and not yet seen DONE or failed).
        """
        fault = self._enter("release_xfer_handle")
        xfer = self._xfer("release_xfer_handle", handle)
        if xfer.state is _State.RUNNING:
            raise self._misuse(
                f"release_xfer_handle: the transfer of {handle!r} may still be running; poll "
                "check_xfer_state until DONE or an error first"
            )
        self._fire_raise(fault)
        value = handle._handle
        try:
            handle._released = True
            self._xfers.pop(value, None)
            xfer.local.users.pop(value, None)
            xfer.remote.users.pop(value, None)
        except BaseException:  # interrupted: still held (see the module docstring)
            handle._released = False
            self._xfers[value] = xfer
            xfer.local.users[value] = handle
            xfer.remote.users[value] = handle
            raise

    def release_dlist_handle(self, handle: FakeDlistHandle) -> None:
        """Release a prepped descriptor list handle no unreleased transfer handle relies on.

        Raises:
            NixlMisuseError: released already, not made by this agent, or an unreleased transfer
                handle was made from it.
        """
        fault = self._enter("release_dlist_handle")
        prepped = self._dlist("release_dlist_handle", handle)
        if prepped.users:
            raise self._misuse(
                f"release_dlist_handle: {handle!r} is still used by unreleased "
                f"{list(prepped.users.values())!r}; release the transfer handles first"
            )
        self._fire_raise(fault)
        value = handle._handle
        try:
            handle._released = True
            self._dlists.pop(value, None)
            for entry in prepped.unique:
                entry.lists.pop(value, None)
        except BaseException:  # interrupted: still held (see the module docstring)
            handle._released = False
            self._dlists[value] = prepped
            for entry in prepped.unique:
                entry.lists[value] = prepped
            raise

    # -- internals ----------------------------------------------------------------------------

    def _enter(self, call: str) -> Fault | None:
        """Record and number a call, consume its fault, and refuse calls after close."""
        fault = self.faults.take(call)
        if self._closed:
            raise self._misuse(f"{call}: agent {self.name!r} is closed")
        return fault

    @staticmethod
    def _fire_raise(fault: Fault | None) -> None:
        """Raise the injected error of a Raise fault."""
        if isinstance(fault, Raise):
            raise FakeNixlError(fault.code)

    def _check_backends(self, backends: Sequence[str]) -> None:
        """KeyError for a backend this agent does not have (as the real wrapper)."""
        for backend in backends:
            if backend not in self.backends:
                raise KeyError(backend)

    def _xfer(self, call: str, handle: object) -> _Xfer:
        """The live transfer behind ``handle``, or NixlMisuseError."""
        xfer: _Xfer = self._live(call, handle, FakeXferHandle, self._xfers, "transfer")
        return xfer

    def _dlist(self, call: str, handle: object) -> _Prepped:
        """The live prepped list behind ``handle``, or NixlMisuseError."""
        prepped: _Prepped = self._live(call, handle, FakeDlistHandle, self._dlists, "dlist")
        return prepped

    def _live(self, call: str, handle: object,
              kind: type[FakeXferHandle] | type[FakeDlistHandle], table: dict[int, Any],
              what: str) -> Any:
        """What ``table`` keeps live behind ``handle`` (a handle of ``kind`` this agent made
        and has not released), or NixlMisuseError saying which it is not."""
        if isinstance(handle, kind):
            found = table.get(handle._handle)
            if found is not None and found.handle is handle:
                return found
            if handle._released and handle._owner == self._serial:
                raise self._misuse(f"{call}: {handle!r} was already released")
        raise self._misuse(
            f"{call}: {handle!r} is not a {what} handle made by agent {self.name!r}"
        )

    def _file(self, entry: _Entry) -> None:
        """Index a registered descriptor as live (a no-op where it is indexed already)."""
        entry.live = True
        _add(self._by_type, entry.mem_type, entry)
        _add(self._by_dev, (entry.mem_type, entry.dev_id), entry)
        _add(self._by_desc, (entry.mem_type, entry.desc), entry)

    def _unfile(self, entry: _Entry) -> None:
        """Forget a descriptor: deregistered (a no-op where it is gone already)."""
        entry.live = False
        _drop(self._by_type, entry.mem_type, entry)
        _drop(self._by_dev, (entry.mem_type, entry.dev_id), entry)
        _drop(self._by_desc, (entry.mem_type, entry.desc), entry)

    def _refile(self, entries: Iterable[_Entry]) -> None:
        """Put deregistered descriptors back where they were, in registration order (after an
        interrupted deregistration: rare, so it may sort)."""
        for entry in entries:
            self._file(entry)
            _resort(self._by_dev, (entry.mem_type, entry.dev_id))
            _resort(self._by_desc, (entry.mem_type, entry.desc))

    def _covering(self, mem_type: str, desc: XferDesc) -> _Entry | None:
        """The most recent live registration of ``mem_type`` that covers ``desc``."""
        group = self._by_dev.get((mem_type, desc[2]))
        if group:
            for entry in reversed(group):
                if entry.covers(desc):
                    return entry
        return None

    def _match_entry(
        self, mem_type: str, desc: RegDesc, owner: FakeRegDList, taken: dict[_Entry, None]
    ) -> _Entry | None:
        """A live registered descriptor equal to ``desc``, not ``taken``, preferring ones
        ``owner`` registered, else the most recent."""
        latest = None
        for entry in self._by_desc.get((mem_type, desc), ()):
            if entry in taken:
                continue
            if entry.owner is owner:
                return entry
            latest = entry
        return latest

    @staticmethod
    def _user_of(entry: _Entry) -> FakeXferHandle | None:
        """An unreleased transfer handle that relies on ``entry`` (through either of its lists),
        if any."""
        for prepped in entry.lists.values():
            for handle in prepped.users.values():
                return handle
        return None

    def _set_state(self, xfer: _Xfer, state: _State) -> None:
        """Move a transfer to ``state``, keeping the table of running ones."""
        xfer.state = state
        if state is _State.RUNNING:
            self._running[xfer.handle._handle] = xfer
        else:
            self._running.pop(xfer.handle._handle, None)

    @staticmethod
    def _progress(xfer: _Xfer) -> _Progress:
        """What a call may change on ``xfer``, to put back if it is interrupted."""
        return (xfer.state, xfer.polls_left, xfer.hold, xfer.failure)

    def _restore(self, xfer: _Xfer, saved: _Progress) -> None:
        """Put a transfer back as :meth:`_progress` saw it, and the objects its WRITE wrote.

        The calls that may change a transfer call this from a ``try`` around everything they
        change, up to their answer, which they return by name (``answer = self._check(...)``,
        ``return answer``): in ``return self._check(...)`` the call returns, a point where a
        signal may be handled, outside the ``try``, which ends before its ``RETURN_VALUE``.
        """
        overwritten, objects = xfer.overwritten, self.objects
        if overwritten is not None:
            if isinstance(overwritten, _FilesHeld):
                overwritten.put_back()
            else:
                for key, old in overwritten.items():
                    if old is None:
                        objects.pop(key, None)
                    else:
                        objects[key] = old
            xfer.overwritten = None
        state, xfer.polls_left, xfer.hold, xfer.failure = saved
        self._set_state(xfer, state)

    def _complete(self, xfer: _Xfer) -> str:
        """Move the bytes of a transfer; "DONE", or fail it with NIXL_ERR_BACKEND.

        A WRITE reads every block first, notes what it overwrites (for :meth:`_restore`, if
        the call is interrupted) and stores them all at once. A READ of a missing object
        fails; one of an object of another size reads what real NIXL's OBJ backend reads
        (measured with NIXL 1.5.1 against an S3 server): its first bytes, up to the block's
        length, leaving the rest of a larger block as it was, and answers DONE.
        """
        if xfer.remote.mem_type == "FILE":
            return self._complete_files(xfer)
        objects = self.objects
        if xfer.operation == "WRITE":
            written = {key: ctypes.string_at(addr, length) for addr, length, key in xfer.moves}
            xfer.overwritten = {key: objects.get(key) for key in written}
            objects.update(written)
            self._set_state(xfer, _State.DONE)
            return "DONE"
        for _, _, key in xfer.moves:
            if key not in objects:
                self._fail(xfer, "NIXL_ERR_BACKEND")
                raise FakeNixlError("NIXL_ERR_BACKEND")
        for addr, length, key in xfer.moves:
            data = objects[key]
            ctypes.memmove(addr, data, min(length, len(data)))
        self._set_state(xfer, _State.DONE)
        return "DONE"

    def _complete_files(self, xfer: _Xfer) -> str:
        """Move the bytes of a transfer to or from files, as NIXL 1.5.1's POSIX backend does:
        the blocks before the first whose fd cannot do the operation (found when posted) are
        read or written at their offsets, the rest are not; a READ copies what each read
        returned, a WRITE keeps what it wrote; a short block, or a stop, fails the transfer
        (NIXL_ERR_BACKEND). A WRITE first notes what the files held (for :meth:`_restore`,
        if the call is interrupted)."""
        stop = len(xfer.moves) if xfer.stop_at is None else xfer.stop_at
        moves, failed = xfer.moves[:stop], stop < len(xfer.moves)
        if xfer.operation == "WRITE":
            blocks = [(fd, offset, ctypes.string_at(addr, length))
                      for addr, length, (fd, offset) in moves]
            xfer.overwritten = _FilesHeld.before(blocks)
            for fd, offset, data in blocks:
                try:
                    failed = os.pwrite(fd, data, offset) != len(data) or failed
                except OSError:  # (a full disk; closed since the post: where the fake and
                    failed = True  # NIXL differ, see the module docstring)
        else:
            for addr, length, (fd, offset) in moves:
                try:
                    data = os.pread(fd, length, offset)
                except OSError:  # (closed since the post: see the module docstring)
                    data = b""
                ctypes.memmove(addr, data, len(data))
                failed = failed or len(data) != length
        if failed:  # what a failed transfer moved stays moved, as in NIXL (unless this call is
            error = FakeNixlError("NIXL_ERR_BACKEND")  # interrupted: then it is put back)
            self._fail(xfer, "NIXL_ERR_BACKEND")
            xfer.overwritten = None
            raise error
        self._set_state(xfer, _State.DONE)
        return "DONE"

    def _fail(self, xfer: _Xfer, outcome: str) -> None:
        """End a transfer as failed with ``outcome`` (a NIXL code, or "ERR")."""
        self._set_state(xfer, _State.FAILED)
        xfer.failure = outcome
        xfer.hold = 0

    @staticmethod
    def _answer_failure(outcome: str) -> str:
        """Answer "ERR", or raise the NIXL error ``outcome``."""
        if outcome == "ERR":
            return "ERR"
        raise FakeNixlError(outcome)
