"""One bucket, or one directory, shared by several engine processes on real NIXL (a local S3
server, NIXL's OBJ backend; a temporary directory, its POSIX backend): one stores while the
others look up and load. A block is HIT elsewhere only once it is complete, a load never returns
other bytes than one whole version stored (the same blocks stored again while they are loaded
included), a writer killed at any moment leaves only whole blocks, and the file tier's
stale-file cleanup, run by the others while the writer stores, never removes a live writer's
files, and does remove them once it was killed.

Each engine process runs :func:`engine` below, as a writer or a reader, forked from a process
that imported torch and kvfsm once (:func:`zygote`). The test process only conducts: it tells
the engines when to start and stop on their stdin, hears what they did on their stdout
(:class:`Story`), kills the writer where the story says so, and always kills and waits for
every engine at the end."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfsm import TransferJob
from kvfsm.nixl_agents import StoreConfig, make_agent
from kvfsm.testing import FaultyAgent, StayProc
from kvfsm.tiers import FileTier, Lookup, ObjectStoreTier

from .real_nixl import ACCESS_KEY, SECRET_KEY, S3Server, require_nixl, s3_server

__all__ = ["s3_server"]  # the fixture, imported for pytest

pytestmark = pytest.mark.nixl

BLOCKS, BLOCK_BYTES = 24, 64 * 1024
#: the key prefix of every object-store tier here
KEY_PREFIX = "shared/"
#: what their object names start with: the key prefix, then the folder of their block size
NAME_PREFIX = f"{KEY_PREFIX}{BLOCK_BYTES}-bytes/"


class Eager(ObjectStoreTier):
    """Asks the store again soon after a MISS, so a test need not wait long."""

    probed_miss_seconds = 0.05


def block_bytes(index: int, version: int = 0) -> torch.Tensor:
    """What the writer stores under key ``index`` (in its round ``version``, when it stores the
    blocks again): different for every block, and every version of one."""
    generator = torch.Generator().manual_seed(1000 + index + 1_000_000 * version)
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=generator)


def settle(tier: ObjectStoreTier, key: str, timeout: float = 30) -> Lookup:
    deadline = time.monotonic() + timeout
    answer = tier.lookup(key)
    while answer is Lookup.RETRY and time.monotonic() < deadline:
        time.sleep(0.005)
        answer = tier.lookup(key)
    return answer


def load_one(tier: ObjectStoreTier, key: str, job_id: int, block: int) -> bool:
    tier.submit_load(TransferJob(job_id, [key], [block], is_promotion=True))
    tier.drain_jobs(timeout=30)
    (result,) = tier.get_finished_jobs()
    return result.success


def test_a_block_another_tier_stores_is_found_after_a_miss(s3_server: S3Server) -> None:
    require_nixl()
    config = s3_server.config(s3_server.new_bucket(), key_prefix=KEY_PREFIX)
    writer_cache = torch.stack([block_bytes(0), block_bytes(1)])
    reader_cache = torch.zeros(2, BLOCK_BYTES, dtype=torch.uint8)
    writer = ObjectStoreTier(writer_cache, store=config)
    reader = Eager(reader_cache, store=config)
    try:
        assert settle(reader, "block-0") is Lookup.MISS, "not stored yet"
        writer.submit_store(TransferJob(1, ["block-0"], [0]))
        writer.drain_jobs(timeout=30)
        assert [r.success for r in writer.get_finished_jobs()] == [True]
        deadline = time.monotonic() + 30
        while settle(reader, "block-0") is not Lookup.HIT and time.monotonic() < deadline:
            time.sleep(0.01)
        assert settle(reader, "block-0") is Lookup.HIT, "the MISS was asked again"
        assert load_one(reader, "block-0", 1, 1)
        assert torch.equal(reader_cache[1], block_bytes(0))
    finally:
        writer.shutdown(timeout=30)
        reader.shutdown(timeout=30)


# -- engine processes: each runs engine(), as a writer or a reader -------------------------------

#: the repository: the zygote imports this module from it
ROOT = Path(__file__).resolve().parents[1]
#: seconds an engine process lives at most, whatever it is told (the test ends it long before)
ENGINE_SECONDS = 50
#: seconds a writer spends between submitting a store and polling it: the rest of an engine's
#: scheduler step. NIXL's POSIX backend answers PROC at the post, so a store's temporary file is
#: in the directory all that time, renamed onto its block's name only by the poll after it
STEP = 0.02
PARTIAL = ".kvfsm-partial-"
ALL = set(range(BLOCKS))


def key(index: int) -> str:
    return f"block-{index}"


def say(*words: object) -> None:
    """Tell the test something, in one line marked as ours (NIXL may log to stdout too)."""
    os.write(1, ("kvfsm-test " + " ".join(map(str, words)) + "\n").encode())


def one_word(what: object) -> str:
    return str(what).replace(" ", "_") or "-"


class Orders:
    """What the test told this engine on its stdin, one word a line, heard on a thread of its
    own. The end of stdin (the test went away) counts as "stop"."""

    def __init__(self) -> None:
        self._given: set[str] = set()
        self._changed = threading.Condition()
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        for line in sys.stdin:
            self._hear(line.strip())
        self._hear("stop")

    def _hear(self, word: str) -> None:
        with self._changed:
            self._given.add(word)
            self._changed.notify_all()

    def given(self, word: str) -> bool:
        return word in self._given

    def wait(self, word: str) -> bool:
        """Wait for ``word`` (or "stop", or the end of the engine's life); True if it came."""
        with self._changed:
            self._changed.wait_for(lambda: bool({word, "stop"} & self._given), ENGINE_SECONDS)
            return word in self._given


def engine(spec: dict[str, Any]) -> None:
    """An engine process (a fork of the :func:`zygote`, its stdin and stdout pipes to the test):
    ``spec["role"]`` is writer or reader; ``bucket`` and ``endpoint`` say an
    :class:`ObjectStoreTier` on the local S3 server, ``root`` a :class:`FileTier`; a writer's
    ``pause_at`` and ``hold_after`` and a reader's ``sweep`` are :func:`write`'s and
    :func:`read`'s; ``rounds``
    (1 by default) is how many times the writer stores every block.

    Whatever happens, it drains its tier and shuts it down before it returns, so no exit leaves
    a NIXL transfer in flight (a test may still kill it, which runs no exit at all)."""
    orders = Orders()
    writer = spec["role"] == "writer"
    rounds = spec.get("rounds", 1)
    if writer:
        cache = torch.stack([block_bytes(index) for index in range(BLOCKS)])
    else:
        cache = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    tier: ObjectStoreTier | FileTier
    if "bucket" in spec:
        tier = Eager(cache, store=StoreConfig(spec["bucket"], endpoint=spec["endpoint"],
                                              access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                                              key_prefix=KEY_PREFIX))
    else:
        agent: FaultyAgent | None = None
        if spec.get("pause_at") is not None:
            # NIXL's POSIX backend answered PROC at the post of every store measured here, but
            # may answer DONE at once for a small write, which would commit the store without a
            # poll: the paused store's post answers PROC whatever NIXL says (the write still runs)
            agent = FaultyAgent(make_agent(f"paused-writer-{os.getpid()}", "POSIX"))
            agent.inject("transfer", StayProc(1), at=spec["pause_at"] + 1)
        tier = FileTier(cache, spec["root"], agent=agent)
    try:
        if writer:
            write(tier, cache, orders, rounds=rounds, pause_at=spec.get("pause_at"),
                  hold_after=spec.get("hold_after"))
        else:
            read(tier, cache, orders, rounds=rounds, sweep=spec.get("sweep", False))
    finally:
        try:
            tier.drain_jobs(timeout=30)
        finally:
            tier.shutdown(timeout=30)
    say("done")


def write(tier: ObjectStoreTier | FileTier, cache: torch.Tensor, orders: Orders, *,
          rounds: int, pause_at: int | None, hold_after: int | None = None) -> None:
    """Once told "go", store every block, one job a scheduler step, saying "storing" after each
    submit and "stored" with the round (or "failed" with why) once its result came; ``rounds``
    times over, with the next version of its bytes each round. At block ``pause_at`` (of the
    first round) it stops right after the submit, polling no more (the store under way, its
    temporary file in place) until told "resume": a writer to kill mid-store. After block
    ``hold_after`` of the first round is stored, it waits to be told "resume" (so that a
    reader's load can be made to come while the writer still has blocks to store)."""
    say("ready")
    if not orders.wait("go"):
        return
    deadline = time.monotonic() + ENGINE_SECONDS
    for round_, index in itertools.product(range(rounds), range(BLOCKS)):
        if round_:
            cache[index] = block_bytes(index, round_)  # (its last store's result came)
        tier.submit_store(TransferJob(round_ * BLOCKS + index, [key(index)], [index]))
        say("storing", index, round_)
        if round_ == 0 and index == pause_at:
            orders.wait("resume")
        else:
            time.sleep(STEP)
        tier.drain_jobs(timeout=30)
        (result,) = tier.get_finished_jobs()
        if result.success:
            say("stored", index, round_)
        else:
            say("failed", index, one_word(result.reason))
        if round_ == 0 and index == hold_after:
            orders.wait("resume")
        if orders.given("stop") or time.monotonic() > deadline:
            return


def read(tier: ObjectStoreTier | FileTier, cache: torch.Tensor, orders: Orders, *,
         rounds: int, sweep: bool) -> None:
    """Say "ready" with what the first lookups answered, then until told "stop": look up every
    block not yet loaded in its last version (of ``rounds``), load those HIT at once (one job,
    into zeroed blocks), and say "loaded" for each with the version whose bytes it holds,
    exactly, or "WRONG" when it holds no version's (a part of one, a mix of two); or
    "load-failed" for the job. With
    ``sweep`` (a file tier) each round of lookups ends with the stale-file cleanup, saying how
    many temporary files the directory held just before and how many it removed."""
    keys = [key(index) for index in range(BLOCKS)]
    answers: dict[str, Lookup] = {}  # each key's first answer other than RETRY
    deadline = time.monotonic() + 30
    while len(answers) < BLOCKS and time.monotonic() < deadline:  # the store is being asked
        for name in keys:
            if name not in answers and (answer := tier.lookup(name)) is not Lookup.RETRY:
                answers[name] = answer
        time.sleep(0.005)
    say("ready", *sorted({answer.name for answer in answers.values()}), len(answers))
    versions = [[block_bytes(index, version) for version in range(rounds)]
                for index in range(BLOCKS)]
    pending = set(range(BLOCKS))
    job_ids = itertools.count()
    deadline = time.monotonic() + ENGINE_SECONDS
    while not orders.given("stop") and time.monotonic() < deadline:
        hits = [index for index in sorted(pending) if tier.lookup(keys[index]) is Lookup.HIT]
        if hits:  # one job for the blocks found, as an engine loads a request's blocks
            cache[hits] = 0  # so a load that wrote only part of a block shows
            tier.submit_load(TransferJob(next(job_ids), [keys[index] for index in hits], hits,
                                         is_promotion=True))
            tier.drain_jobs(timeout=30)
            (result,) = tier.get_finished_jobs()
            if not result.success:
                say("load-failed", "+".join(map(str, hits)), one_word(result.reason))
                hits = []
        for index in hits:
            version = next((version for version, stored in enumerate(versions[index])
                            if torch.equal(cache[index], stored)), "WRONG")
            say("loaded", index, version)
            if version == rounds - 1:
                pending.discard(index)
        if sweep:
            assert isinstance(tier, FileTier)
            seen = sum(name.startswith(PARTIAL) for name in os.listdir(tier.root))
            say("swept", seen, tier.remove_stale())
        time.sleep(0.005)


def zygote() -> None:
    """The process engines are forked from: ``python -c "from tests.test_shared_store import
    zygote; zygote()" FD``, FD a SOCK_SEQPACKET socket to the test. Torch and kvfsm are imported
    once, here, so an engine starts in milliseconds rather than seconds of imports on a busy
    machine (nothing here has made a thread, a NIXL agent or a tier yet).

    Each message is a JSON order: ``start`` (an engine's spec; with it come the engine's stdin,
    stdout and stderr descriptors) answers the engine's pid; ``reap`` (a pid) waits for that
    engine and answers its exit status (negative: the signal that killed it). When the test
    goes away (the socket closes), every engine still running is killed and waited for."""
    orders = socket.socket(fileno=int(sys.argv[1]))
    engines: set[int] = set()
    try:
        while True:
            message, fds, _, _ = socket.recv_fds(orders, 65536, 3)
            if not message:
                return
            order = json.loads(message)
            if "reap" in order:
                _, status = os.waitpid(order["reap"], 0)
                engines.discard(order["reap"])
                orders.send(json.dumps(os.waitstatus_to_exitcode(status)).encode())
                continue
            pid = os.fork()
            if pid == 0:  # the engine
                code = 1
                try:
                    orders.close()
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    engine(order["start"])
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stderr.flush()
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            engines.add(pid)
            orders.send(json.dumps(pid).encode())
    finally:
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


# -- the test's side: starting engines, hearing them, ending them --------------------------------

class Zygote:
    """The test's end of the :func:`zygote`: one order at a time, each with its answer."""

    def __init__(self) -> None:
        self._orders, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from tests.test_shared_store import zygote; zygote()",
                 str(theirs.fileno())],
                cwd=ROOT, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
                env={**os.environ, "NIXL_LOG_LEVEL": "WARN"})

    def _ask(self, order: dict[str, Any], fds: list[int] | None = None) -> Any:
        with self._lock:
            socket.send_fds(self._orders, [json.dumps(order).encode()], fds or [])
            answer = self._orders.recv(4096)
        assert answer, f"the zygote exited ({self.process.poll()})"
        return json.loads(answer)

    def fork(self, spec: dict[str, Any], stdin: int, stdout: int, stderr: int) -> int:
        """Start an engine on these descriptors; its pid."""
        pid: int = self._ask({"start": spec}, [stdin, stdout, stderr])
        return pid

    def reap(self, pid: int) -> int:
        """Wait for an engine; its exit status (negative: the signal that killed it)."""
        status: int = self._ask({"reap": pid})
        return status

    def close(self) -> None:
        """End it: it kills and waits for any engine left, then exits; killed if it does not."""
        self._orders.close()
        try:
            self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def zygote_process() -> Iterator[Zygote]:
    require_nixl()
    made = Zygote()
    try:
        yield made
    finally:
        made.close()


#: an engine's exit status when the zygote could not tell it
UNKNOWN_STATUS = -1000


class Engine:
    """An engine process of a story, and what it said so far (heard by :meth:`Story.until`)."""

    def __init__(self, name: str, spec: dict[str, Any], zygote: Zygote,
                 heard: queue.Queue[Any], log: Path) -> None:
        self.name = name
        self.log = log
        self.said: list[list[str]] = []
        self._told: dict[str, list[list[str]]] = {}
        self._loaded: dict[str, set[int]] = {}  # version -> the blocks loaded in it
        #: each cleanup: how many temporary files were there just before, how many it removed
        self.sweeps: list[tuple[int, int]] = []
        #: how many files its cleanups removed
        self.removed = 0
        self.killed = False
        self.status: int | None = None  # once waited for
        self._zygote = zygote
        self._lock = threading.Lock()
        their_stdin, stdin = os.pipe()
        stdout, their_stdout = os.pipe()
        try:
            with log.open("wb") as stderr:
                self.pid = zygote.fork(spec, their_stdin, their_stdout, stderr.fileno())
        except BaseException:
            os.close(stdin)
            os.close(stdout)
            raise
        finally:  # the engine's own now: its exit closes its stdout, which ends _listen
            os.close(their_stdin)
            os.close(their_stdout)
        self._stdin = os.fdopen(stdin, "wb")
        self._stdout = os.fdopen(stdout, "rb")
        threading.Thread(target=self._listen, args=(heard,), daemon=True).start()

    def _listen(self, heard: queue.Queue[Any]) -> None:
        with self._stdout:
            for line in self._stdout:
                words = line.decode(errors="replace").split()
                if words[:1] == ["kvfsm-test"]:
                    heard.put((self, words[1:]))
        try:
            status = self.wait()
        except Exception:  # (the zygote went away: the story is over)
            status = UNKNOWN_STATUS
        heard.put((self, ["exited", str(status)]))

    def wait(self) -> int:
        with self._lock:
            if self.status is None:
                self.status = self._zygote.reap(self.pid)
            return self.status

    def kill(self) -> None:
        """SIGKILL, unless it was waited for already (its pid may be another's by then), and
        wait for it."""
        self.killed = True
        with self._lock:
            if self.status is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.status = self._zygote.reap(self.pid)

    def close(self) -> None:
        try:
            self.kill()
        finally:
            self._stdin.close()

    def tell(self, word: str) -> None:
        self._stdin.write(f"{word}\n".encode())
        self._stdin.flush()

    def hear(self, words: list[str]) -> None:
        """Take a line it said into account."""
        self.said.append(words)
        self._told.setdefault(words[0], []).append(words[1:])
        if words[0] == "loaded":
            self._loaded.setdefault(words[2], set()).add(int(words[1]))
        elif words[0] == "swept":
            seen, removed = int(words[1]), int(words[2])
            self.sweeps.append((seen, removed))
            self.removed += removed

    def told(self, word: str) -> list[list[str]]:
        """What followed ``word`` in each line the engine said starting with it."""
        return list(self._told.get(word, ()))

    def indices(self, word: str) -> list[int]:
        """The blocks of the lines starting with ``word``, in the order they were said."""
        return [int(words[0]) for words in self.told(word)]

    @property
    def loaded(self) -> set[int]:
        """The blocks it loaded, in whatever version."""
        return set().union(*self._loaded.values())

    def loaded_in(self, version: int) -> set[int]:
        """The blocks it loaded in that version of theirs."""
        return self._loaded.get(str(version), set())

    @property
    def exited(self) -> int | None:
        """Its exit status once the test heard it exit (negative: killed by that signal)."""
        return next((int(words[0]) for words in self.told("exited")), None)

    def describe(self) -> str:
        lines = [" ".join(words) for words in self.said[-12:]]
        return (f"{self.name} (pid {self.pid}, status {self.status}), last said:\n    "
                + "\n    ".join(lines) + f"\n  stderr: {self.log.read_text()[-1500:]}")


class Story:
    """Engines sharing one store; what they say is heard in one place, in the order it came."""

    def __init__(self, zygote: Zygote, logs: Path) -> None:
        self._zygote = zygote
        self.engines: list[Engine] = []
        #: every line heard, in the order it came: (who, what it said)
        self.heard: list[tuple[Engine, list[str]]] = []
        self._heard: queue.Queue[Any] = queue.Queue()
        self._logs = logs

    def start(self, name: str, **spec: Any) -> Engine:
        started = Engine(name, spec, self._zygote, self._heard, self._logs / f"{name}.stderr")
        self.engines.append(started)
        return started

    def until(self, what: str, done: Callable[[], bool], timeout: float = 40) -> None:
        """Hear the engines until ``done()``; fails at once when one says what is never right
        here (a store or load that failed, a load of other bytes than stored, an engine that
        exited with an error), and after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"not within {timeout} s: {what}\n{self.transcript()}")
            lines: list[tuple[Engine, list[str]]] = []
            try:
                lines.append(self._heard.get(timeout=min(left, 0.1)))
                while True:  # and all that came meanwhile, before asking done() again
                    lines.append(self._heard.get_nowait())
            except queue.Empty:
                pass
            for speaker, words in lines:
                self._hear(speaker, words, what)

    def _hear(self, speaker: Engine, words: list[str], what: str) -> None:
        speaker.hear(words)
        self.heard.append((speaker, words))
        wrong = (words[0] in ("failed", "load-failed") or words[-1] == "WRONG"
                 or (words[0] == "exited" and words[1] != "0" and not speaker.killed))
        if wrong:
            raise AssertionError(f"{speaker.name} said {' '.join(words)} while waiting until "
                                 f"{what}\n{self.transcript()}")

    def when(self, speaker: Engine, *words: object) -> int:
        """Where, among all the lines heard, is the first line ``speaker`` said that starts
        with ``words``."""
        start = [str(word) for word in words]
        return next(n for n, (who, said) in enumerate(self.heard)
                    if who is speaker and said[:len(start)] == start)

    def transcript(self) -> str:
        return "\n".join(engine.describe() for engine in self.engines)


@contextlib.contextmanager
def story_in(zygote: Zygote, logs: Path) -> Iterator[Story]:
    """A story whose engines are all killed (if still running) and waited for at its end."""
    story = Story(zygote, logs)
    try:
        yield story
    finally:
        with contextlib.ExitStack() as ending:  # each engine is closed, whatever another's did
            for started in story.engines:
                ending.callback(started.close)


def writer_and_two_readers(story: Story, where: dict[str, Any], *, sweep: bool = False,
                           pause_at: int | None = None, hold_after: int | None = None,
                           **spec: Any) -> tuple[Engine, list[Engine]]:
    """Start two readers and a writer on one store (``where``; ``spec`` for all three); once all
    are ready, the readers having found every block a MISS, tell the writer to go."""
    readers = [story.start(f"reader-{n}", role="reader", sweep=sweep, **spec, **where)
               for n in (1, 2)]
    writer = story.start("writer", role="writer", pause_at=pause_at, hold_after=hold_after,
                         **spec, **where)
    story.until("every engine is ready",
                lambda: all(engine.told("ready") for engine in story.engines))
    for reader in readers:
        assert reader.told("ready") == [["MISS", str(BLOCKS)]], "nothing is stored yet"
    writer.tell("go")
    return writer, readers


def stop_readers(story: Story, readers: list[Engine]) -> None:
    for reader in readers:
        reader.tell("stop")
    story.until("the readers exit", lambda: all(r.exited is not None for r in readers))
    for reader in readers:
        assert (reader.exited, reader.said[-2]) == (0, ["done"]), reader.describe()


def sweep_on(story: Story, readers: list[Engine], what: str, times: int = 20) -> None:
    """Hear the readers until each ran the cleanup ``times`` times more."""
    marks = [len(reader.sweeps) for reader in readers]
    story.until(f"each reader swept {times} times more, {what}",
                lambda: all(len(reader.sweeps) >= mark + times
                            for reader, mark in zip(readers, marks, strict=True)))


def removed_by(readers: list[Engine]) -> int:
    """How many files the readers' cleanups removed so far."""
    return sum(reader.removed for reader in readers)


def partial_files(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith(PARTIAL))


def shared_store(shared: str, tmp_path: Path, request: pytest.FixtureRequest,
                 ) -> tuple[dict[str, Any], Callable[[], dict[str, bytes]]]:
    """A new bucket on the session's S3 server (``shared`` "bucket"), or a new directory:
    where the engines find it, and a function reading everything in it (name: bytes; a
    bucket's names without the tiers' :data:`NAME_PREFIX`, a directory's kvfsm files
    included)."""
    if shared == "bucket":
        server: S3Server = request.getfixturevalue("s3_server")
        bucket = server.new_bucket()

        def objects() -> dict[str, bytes]:
            client = server.client()
            listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
            return {o["Key"].removeprefix(NAME_PREFIX):
                    client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
                    for o in listed}

        return {"bucket": bucket, "endpoint": server.endpoint}, objects
    root = tmp_path / "blocks"
    root.mkdir()
    return {"root": str(root)}, lambda: {path.name: path.read_bytes() for path in root.iterdir()}


# -- the stories ----------------------------------------------------------------------------------

def test_a_reader_process_loads_only_whole_blocks_a_writer_process_is_storing(
    s3_server: S3Server, zygote_process: Zygote, tmp_path: Path,
) -> None:
    """The test process reads, as an engine would, while a writer process stores."""
    require_nixl()
    bucket = s3_server.new_bucket()
    reader_cache = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    reader = Eager(reader_cache, store=s3_server.config(bucket, key_prefix=KEY_PREFIX))
    loaded: set[int] = set()
    job_ids = iter(range(10**6))
    try:
        with story_in(zygote_process, tmp_path) as story:
            writer = story.start("writer", role="writer", bucket=bucket,
                                 endpoint=s3_server.endpoint)
            story.until("the writer is ready", lambda: bool(writer.told("ready")))
            writer.tell("go")
            deadline = time.monotonic() + 40
            while len(loaded) < BLOCKS and time.monotonic() < deadline:
                for index in sorted(ALL - loaded):
                    if reader.lookup(key(index)) is Lookup.HIT:
                        # HIT while the writer goes on: the object must already be whole
                        assert load_one(reader, key(index), next(job_ids), index)
                        assert torch.equal(reader_cache[index], block_bytes(index)), index
                        loaded.add(index)
                time.sleep(0.002)
            assert loaded == ALL
            story.until("the writer is done", lambda: writer.exited is not None)
            assert writer.exited == 0 and writer.indices("stored") == list(range(BLOCKS))
    finally:
        reader.shutdown(timeout=30)


def test_one_writer_and_two_reader_processes_share_a_bucket_and_load_only_whole_blocks(
    s3_server: S3Server, zygote_process: Zygote, tmp_path: Path,
) -> None:
    """Three engine processes on one bucket: a writer stores 24 blocks of distinct bytes, one a
    scheduler step, while two readers look every block up and load it as soon as it is HIT.
    Every load succeeds and returns exactly the stored bytes (into a zeroed block), so no HIT
    came before its object was whole; both readers load every block. The writer holds after
    half the blocks until a reader loaded one, so loads come while it still stores (on a busy
    machine the readers could otherwise start loading only after the last store)."""
    require_nixl()
    bucket = s3_server.new_bucket()
    with story_in(zygote_process, tmp_path) as story:
        writer, readers = writer_and_two_readers(
            story, {"bucket": bucket, "endpoint": s3_server.endpoint}, hold_after=BLOCKS // 2)
        story.until("a reader loaded a block", lambda: any(r.loaded for r in readers))
        writer.tell("resume")
        story.until("both readers loaded every block, and the writer is done",
                    lambda: all(r.loaded == ALL for r in readers) and writer.exited is not None)
        assert writer.exited == 0 and writer.indices("stored") == list(range(BLOCKS))
        stop_readers(story, readers)
        for reader in readers:  # each block loaded once, as soon as HIT, whole
            assert sorted(reader.indices("loaded")) == list(range(BLOCKS))
            assert {words[1] for words in reader.told("loaded")} == {"0"}
            assert reader.told("load-failed") == []
        first_load = min(story.when(reader, "loaded") for reader in readers)
        assert first_load < story.when(writer, "stored", BLOCKS - 1), (
            "the readers loaded blocks while the writer was still storing")
    objects = s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]
    assert {o["Key"]: o["Size"] for o in objects} == {
        f"{NAME_PREFIX}{key(index)}": BLOCK_BYTES for index in range(BLOCKS)}


def test_one_writer_and_two_reader_processes_share_a_directory_and_cleanup_spares_the_writer(
    zygote_process: Zygote, tmp_path: Path,
) -> None:
    """The same three engines on one directory, FileTiers on NIXL's POSIX backend, and the
    readers run the stale-file cleanup (remove_stale) after every round of lookups while the
    writer stores, each of its stores' temporary files in the directory for a scheduler step.
    Every store succeeds and every cleanup removes nothing, though many found the live writer's
    temporary files there; both readers load every block whole. Once the writer exited after a
    clean shutdown, the directory holds the blocks and nothing else."""
    root = tmp_path / "blocks"
    root.mkdir()
    with story_in(zygote_process, tmp_path) as story:
        writer, readers = writer_and_two_readers(story, {"root": str(root)}, sweep=True)
        story.until("both readers loaded every block, and the writer is done",
                    lambda: all(r.loaded == ALL for r in readers) and writer.exited is not None)
        assert writer.exited == 0 and writer.indices("stored") == list(range(BLOCKS))
        while_storing = [sweep for reader in readers for sweep in reader.sweeps]
        stop_readers(story, readers)
        for reader in readers:
            assert sorted(reader.indices("loaded")) == list(range(BLOCKS))
            assert {words[1] for words in reader.told("loaded")} == {"0"}
        assert removed_by(readers) == 0, (
            "no cleanup removed a file: the only writer was alive, or gone after a shutdown")
        assert sum(seen > 0 for seen, _ in while_storing) >= 3, (
            "the readers swept while the writer's temporary files were in the directory")
    assert sorted(os.listdir(root)) == sorted(key(index) for index in range(BLOCKS))
    for index in range(BLOCKS):
        assert (root / key(index)).read_bytes() == block_bytes(index).numpy().tobytes()


PAUSE_AT = BLOCKS // 2


def test_a_writer_killed_mid_store_leaves_no_block_and_its_files_to_the_readers_cleanup(
    zygote_process: Zygote, tmp_path: Path,
) -> None:
    """The writer stores half the blocks, submits the next store and polls no more: mid-store,
    its temporary file in the directory. The readers, sweeping all along, load the blocks
    stored and leave the live writer's file where it is. Then the writer is killed (SIGKILL):
    the next cleanup removes its temporary file and its writer file, the block it was storing
    never becomes HIT, and the blocks stored before stay whole."""
    root = tmp_path / "blocks"
    root.mkdir()
    stored = set(range(PAUSE_AT))
    with story_in(zygote_process, tmp_path) as story:
        writer, readers = writer_and_two_readers(story, {"root": str(root)}, sweep=True,
                                                 pause_at=PAUSE_AT)
        story.until("the writer is paused mid-store, and the readers loaded what it stored",
                    lambda: bool(writer.told("storing")[PAUSE_AT:])
                    and all(r.loaded == stored for r in readers))
        (held,) = partial_files(root)
        assert held.endswith(f"-{key(PAUSE_AT)}")
        sweep_on(story, readers, "the writer alive and mid-store")
        assert partial_files(root) == [held], "the live writer's temporary file is left alone"
        assert removed_by(readers) == 0
        assert writer.indices("stored") == list(range(PAUSE_AT))

        writer.kill()
        assert writer.status == -signal.SIGKILL
        story.until("a reader's cleanup removed the killed writer's temporary file",
                    lambda: removed_by(readers) > 0)
        sweep_on(story, readers, "the writer dead")
        stop_readers(story, readers)
        assert removed_by(readers) == 1, "that file only"
        for reader in readers:
            assert sorted(reader.indices("loaded")) == sorted(stored), (
                "each stored block loaded once; the one under way when killed never HIT")
            assert {words[1] for words in reader.told("loaded")} == {"0"}
    assert sorted(os.listdir(root)) == sorted(key(index) for index in stored), (
        "no temporary file, no writer file, and no block of the store killed under way")
    for index in stored:
        assert (root / key(index)).read_bytes() == block_bytes(index).numpy().tobytes()


ROUNDS = 3


@pytest.mark.parametrize("shared", ["bucket", "directory"])
def test_blocks_stored_again_while_two_reader_processes_load_them_load_as_one_whole_version(
    shared: str, zygote_process: Zygote, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """The writer stores every block three times over, other bytes each round, while the two
    readers load every block again and again until they got its last version (and, on a
    directory, sweep): every load is exactly one version the writer stored, never a part of
    one or a mix of two, though loads ran while the same blocks were being replaced; every
    store succeeds, and no cleanup removes anything."""
    where, contents = shared_store(shared, tmp_path, request)
    last = ROUNDS - 1
    with story_in(zygote_process, tmp_path) as story:
        writer, readers = writer_and_two_readers(story, where, sweep=shared == "directory",
                                                 rounds=ROUNDS)
        story.until("both readers loaded the last version of every block, the writer is done",
                    lambda: all(r.loaded_in(last) == ALL for r in readers)
                    and writer.exited is not None)
        assert writer.exited == 0
        assert writer.told("stored") == [[str(index), str(round_)] for round_ in range(ROUNDS)
                                         for index in range(BLOCKS)]
        stop_readers(story, readers)
        for reader in readers:
            assert reader.told("load-failed") == []
            assert {version for _, version in reader.told("loaded")} <= {
                str(version) for version in range(ROUNDS)}
        assert removed_by(readers) == 0
        replaced = {version for reader in readers for _, version in reader.told("loaded")}
        assert len(replaced) > 1, "the readers loaded blocks in more than one version"
    assert contents() == {key(index): block_bytes(index, last).numpy().tobytes()
                          for index in range(BLOCKS)}, "the last version of every block, only"


@pytest.mark.parametrize("shared", ["bucket", "directory"])
def test_a_writer_killed_at_a_random_moment_leaves_only_whole_blocks(
    shared: str, zygote_process: Zygote, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """The writer stores every block round after round, and is killed (SIGKILL) at a random
    moment of a random store (``KVFSM_SEED`` picks it) while the readers load every block
    again and again: no load before the kill or after is anything but one whole version. In
    a directory, the readers' cleanup removes what the writer left (its writer file, and one
    temporary file at most). What stays in the store is every block stored, each whole, in
    the version last stored or the one under way when the writer was killed, and nothing
    else."""
    chance = random.Random(os.environ.get("KVFSM_SEED", "shared-kill"))
    where, contents = shared_store(shared, tmp_path, request)
    sweep = shared == "directory"
    rounds = 8
    stores = chance.randrange(BLOCKS // 2, 3 * BLOCKS)  # the store killed
    with story_in(zygote_process, tmp_path) as story:
        writer, readers = writer_and_two_readers(story, where, sweep=sweep, rounds=rounds)
        story.until(f"the writer submitted its store number {stores}",
                    lambda: len(writer.told("storing")) >= stores)
        time.sleep(chance.uniform(0, 1.5 * STEP))  # in its step, its commit, or just after
        writer.kill()
        assert writer.status == -signal.SIGKILL
        story.until("all the writer said is heard", lambda: writer.exited is not None)
        if sweep:
            story.until("the readers' cleanup removed the killed writer's files",
                        lambda: not any(name.startswith(".")
                                        for name in os.listdir(where["root"])))
        loads = [len(reader.told("loaded")) for reader in readers]
        story.until("each reader loaded every block twice more, the writer dead",
                    lambda: all(len(r.told("loaded")) >= n + 2 * BLOCKS
                                for r, n in zip(readers, loads, strict=True)))
        stop_readers(story, readers)
        assert removed_by(readers) <= 1, "one store was under way at most"
        for reader in readers:
            assert reader.told("load-failed") == []
    # a block holds the version last stored, or the one under way at the kill (in place by
    # then, though the writer never heard its result)
    last_stored = {int(index): int(round_) for index, round_ in writer.told("stored")}
    under_way, its_round = map(int, writer.told("storing")[-1])
    found = contents()
    assert {key(index) for index in last_stored} <= found.keys(), "every block stored is there"
    assert found.keys() <= {key(index) for index in (*last_stored, under_way)}, (
        "no temporary file, no writer file, no block never stored")
    for index in range(BLOCKS):
        if key(index) in found:
            versions = {last_stored.get(index), its_round if index == under_way else None}
            assert found[key(index)] in {block_bytes(index, version).numpy().tobytes()
                                         for version in versions if version is not None}, (
                f"{key(index)} is not whole")
