"""Every code block in README.md and docs/*.md runs as a reader would run it (issue 14).

A block is classified by the first word of its fence's info string:

* ``python``: written to ``block.py`` in a temporary directory of its own and run there by this
  interpreter, in a process of its own. When the next block is a ``text`` block and the only
  prose between them is one line ending in "prints:", that block is what it must print;
* ``sh``: run by bash in a temporary directory of its own that holds what the docs name of the
  repository (:data:`REPOSITORY_LINKS`, as symbolic links), so ``.venv/bin/kvfsm ...`` is the
  installed CLI and ``examples.verify_lifecycle`` the tutorial's machine, as written.
  Each command's exit status is checked; the commands in :data:`NOT_RUN` are not run, each for
  the reason given there;
* ``text``: shown output or a drawing, never run (the case fails if it starts like a command);
* anything else, or no info string: the case fails and asks for one of the three.

What the docs assume the reader has is supplied:

* the S3 server. The docs use a local one, ``http://127.0.0.1:9000`` with the bucket
  ``my-bucket``, which reads plainly and runs verbatim against e.g. ``moto_server -p 9000``; a
  block that names it runs against a moto server this module starts on a free port, with those
  two strings rewritten to its endpoint and a new bucket, and the credentials in
  ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, where the README says they are read;
* ``mypkg.machines``, the reader's own package, in the working directory: here it exports
  kvfsm's transfer machine under the names the docs give the reader's machines.

Each block is one test case, named ``file:line`` of its opening fence. The blocks are independent
and most of each is importing torch and NIXL, so all of them start together when the first case
needs them; each case then waits for its own block and, when it fails, names it and shows its
output.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfsm.nixl_agents import nixl_available

from .real_nixl import ACCESS_KEY, SECRET_KEY, S3Server, free_port, require_nixl

ROOT = Path(__file__).resolve().parent.parent

# all blocks start together when the first case runs, so a case may wait for the others' share
# of the two cores; a block that hangs still fails in minutes, naming itself (WAIT_SECONDS)
pytestmark = pytest.mark.timeout(300)

#: what a block's info string says it is
PYTHON, SHELL, OUTPUT = "python", "sh", "text"

#: commands of ``sh`` blocks that are not run, and why; each must still be in a block
NOT_RUN = {
    "make demo": "sets .venv up and runs `kvfsm demo`, which the README's next block runs as "
                 "written; scripts/setup would reinstall into the .venv this suite runs from",
    "make test": "runs this test suite, and so this module: it would run itself",
    '.venv/bin/pip install -e ".[bench]"': "installs from the package index into the .venv "
                                           "this suite runs from; only bench/overhead.py's plot "
                                           "needs it",
    ".venv/bin/python bench/overhead.py": "a benchmark of about 5 minutes (the doc says so), to be "
                                          "run alone on an idle machine",
    ".venv/bin/python bench/real_nixl.py": "a benchmark of about 2 minutes (the doc says so), to "
                                           "be run alone on an idle machine",
    ".venv/bin/python bench/step.py": "a benchmark of about 10 minutes (the doc says so), to be "
                                      "run alone on an idle machine",
    ".venv/bin/python bench/vllm_tiers.py": "a benchmark of about 6 minutes (the doc says so), "
                                            "to be run alone on an idle machine",
    "make mutation": "mutation testing, tens of minutes on demand (docs/testing.md says so); it "
                     "installs mutmut into the .venv this suite runs from",
    "make mutation MUTANTS='kvfsm.runner.*'": "the same, for one module",
}

_NOT_RUN = {shlex.join(shlex.split(command)): why for command, why in NOT_RUN.items()}

#: the local S3 server and bucket the docs use; a block naming them runs against a moto server
LOCAL_S3, LOCAL_BUCKET = "http://127.0.0.1:9000", "my-bucket"

#: the reader's own package the docs name, as this module lays it in a block's directory
READER_PACKAGE = {
    "mypkg/__init__.py": '"""The reader\'s own package, as the docs call it."""\n',
    "mypkg/machines.py": textwrap.dedent('''\
        """The reader's own machines: here kvfsm's transfer machine, under the docs' names."""

        from kvfsm.lifecycle import TRANSFER_MACHINE

        MY_LIFECYCLE = MY_MACHINE = TRANSFER_MACHINE
        '''),
}

#: what a block's directory links to in the repository (the docs' paths are relative to it):
#: the tutorial imports ``examples`` (whose tests import ``tests``) and runs pytest as configured
REPOSITORY_LINKS = (".venv", "bench", "examples", "tests", "pyproject.toml")

#: seconds a case waits for its block (which started with all the others), within this module's
#: 300 s per test
WAIT_SECONDS = 240

_FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a doc."""

    path: str  # the doc, relative to the repository
    line: int  # the line of the opening fence, from 1
    info: str  # the first word of the info string; "" when there is none
    text: str  # the content
    closed: bool = True
    end: int = 0  # the line of the closing fence
    prints: str | None = None  # a python block's output, as the doc shows it

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def runs(self) -> bool:
        """A closed python block, or a closed sh block with a command not in NOT_RUN."""
        if not self.closed:
            return False
        if self.info == SHELL:
            return any(not_run(command) is None for command in self.commands())
        return self.info == PYTHON

    @property
    def needs_s3(self) -> bool:
        return LOCAL_S3 in self.text

    def commands(self) -> list[str]:
        """A sh block's commands: its lines joined where they end in a backslash, without blank
        lines and comment lines."""
        joined = re.sub(r"\\\n", " ", self.text)
        return [line for line in joined.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]


def _command_key(command: str) -> str:
    """A command without its comment, its words as the shell reads them."""
    return shlex.join(shlex.split(command, comments=True))


def not_run(command: str) -> str | None:
    """Why a sh block's command is not run, or None when it is."""
    return _NOT_RUN.get(_command_key(command))


def doc_paths() -> list[str]:
    return ["README.md", *sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md"))]


def blocks_of(path: str, markdown: str | None = None) -> list[Block]:
    """The fenced code blocks of a Markdown file (CommonMark fences: ``` or ~~~, 3 or more)."""
    blocks: list[Block] = []
    lines = (markdown if markdown is not None else (ROOT / path).read_text()).splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        index += 1
        if opening is None:
            continue
        fence, start = opening["fence"], index
        words = opening["info"].split()
        while index < len(lines) and not _closes(lines[index], fence):
            index += 1
        blocks.append(Block(path, start, words[0] if words else "",
                            "\n".join(lines[start:index]) + "\n", closed=index < len(lines),
                            end=index + 1))
        index += 1
    for number, (code, shown) in enumerate(itertools.pairwise(blocks)):
        between = [line for line in lines[code.end:shown.line - 1] if line.strip()]
        if (code.info == PYTHON and shown.info == OUTPUT and len(between) == 1
                and between[0].rstrip().endswith("prints:")):
            blocks[number] = dataclasses.replace(code, prints=shown.text)
    return blocks


def _closes(line: str, fence: str) -> bool:
    stripped = line.strip()
    return (len(line) - len(line.lstrip(" ")) <= 3 and stripped.startswith(fence)
            and set(stripped) == {fence[0]})


BLOCKS = [block for path in doc_paths() for block in blocks_of(path)]


def shell_script(block: Block) -> str:
    """The bash script for a sh block: its commands in order, each shown as it starts, the run
    stopping at the first that fails and naming it."""
    script = ["set -o pipefail"]
    for command in block.commands():
        quoted = shlex.quote(command)
        if not_run(command) is not None:
            script.append(f"printf 'not run: %s\\n' {quoted}")
            continue
        script += [f"printf '$ %s\\n' {quoted}", command,
                   f'status=$?; if [ "$status" != 0 ]; then '
                   f"printf 'exit status %s: %s\\n' \"$status\" {quoted}; exit \"$status\"; fi"]
    return "\n".join(script) + "\n"


@dataclass
class Run:
    """A block running in a directory of its own; its stdout and stderr go to files there."""

    directory: Path
    source: str  # what was run: the block, rewritten for the S3 server where it names it
    process: subprocess.Popen[bytes]
    started: float

    def wait(self) -> int | None:
        """The exit status, or None when the block ran out of time (it is then killed)."""
        try:
            return self.process.wait(timeout=WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # bash and the commands it started
            self.process.wait(timeout=10)

    def stdout(self) -> str:
        return (self.directory / "stdout").read_text(errors="replace")

    def report(self, lines: int = 40) -> str:
        """The last lines of stdout and stderr, and the block as run."""
        parts = []
        for name in ("stdout", "stderr"):
            text = (self.directory / name).read_text(errors="replace").splitlines()
            parts.append(f"--- {name} (last {lines} lines) ---\n" + "\n".join(text[-lines:]))
        return "\n".join([*parts, f"--- the block as run, in {self.directory} ---\n{self.source}"])


def start(block: Block, directory: Path, s3: S3Server | None) -> Run:
    """Start a block in ``directory``: a python block by this interpreter, a sh block by bash."""
    for name, content in READER_PACKAGE.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(content)
    for name in REPOSITORY_LINKS:
        (directory / name).symlink_to(ROOT / name, target_is_directory=(ROOT / name).is_dir())
    env = dict(os.environ)
    source = block.text
    if block.needs_s3:
        assert s3 is not None
        assert LOCAL_BUCKET in source, (
            f"{block.id} names the local S3 server {LOCAL_S3} but not the bucket {LOCAL_BUCKET}")
        source = source.replace(LOCAL_S3, s3.endpoint).replace(LOCAL_BUCKET, s3.new_bucket())
        env |= {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    if block.info == PYTHON:
        (directory / "block.py").write_text(source)
        argv = [sys.executable, "block.py"]
    else:
        (directory / "block.sh").write_text(shell_script(dataclasses.replace(block, text=source)))
        argv = ["bash", "block.sh"]
    with (directory / "stdout").open("wb") as stdout, (directory / "stderr").open("wb") as stderr:
        process = subprocess.Popen(argv, cwd=directory, env=env, stdin=subprocess.DEVNULL,
                                   stdout=stdout, stderr=stderr, start_new_session=True)
    return Run(directory, source, process, time.monotonic())


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """The runnable blocks this session selected, all started at once; killed at the end."""
    here = Path(__file__).resolve()
    selected = [item.callspec.params["block"] for item in request.session.items
                if isinstance(item, pytest.Function) and item.path.resolve() == here
                and item.originalname == "test_block"]
    started: dict[str, Run] = {}
    s3 = None
    wanted = [block for block in selected if block.runs] if nixl_available() else []
    for block in sorted(wanted, key=lambda block: block.needs_s3):  # those first run meanwhile
        if block.needs_s3 and s3 is None:
            s3 = S3Server(free_port())
            s3.start()
        directory = tmp_path_factory.mktemp(re.sub(r"\W", "_", block.id))
        started[block.id] = start(block, directory, s3)
    yield started
    for run in started.values():
        run.kill()
    if s3 is not None:
        s3.stop()


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_block(block: Block, runs: dict[str, Run]) -> None:
    if not block.closed:
        pytest.fail(f"{block.id}: the code block is never closed")
    if block.info == OUTPUT:
        first = block.text.split(maxsplit=1)[:1]
        assert not first or not re.match(r"(\.venv/|make$|import$|from$|\$)", first[0]), (
            f"{block.id} is marked ```text (output, not run) but starts like code: "
            f"mark it ```python or ```sh")
        return
    if block.info not in {PYTHON, SHELL}:
        pytest.fail(f"{block.id}: the fence's info string is {block.info!r}: mark the block "
                    f"```python or ```sh (run by this test) or ```text (output, not run)")
    if not block.runs:
        pytest.skip("; ".join(f"`{_command_key(command)}`: {not_run(command)}"
                              for command in block.commands()))
    require_nixl()
    run = runs[block.id]
    status = run.wait()
    if status != 0:
        how = (f"did not finish within {time.monotonic() - run.started:.0f} s" if status is None
               else f"failed with exit status {status}")
        pytest.fail(f"{block.id} ({block.info}) {how}\n{run.report()}", pytrace=False)
    if block.prints is not None and run.stdout().rstrip() != block.prints.rstrip():
        pytest.fail(f"{block.id} printed other than the doc shows:\n{block.prints}"
                    f"\n{run.report()}", pytrace=False)
    for claim in path_counts(block, run.stdout()):
        pytest.fail(f"{block.id}: {claim}\n{run.report()}", pytrace=False)


def path_counts(block: Block, stdout: str) -> list[str]:
    """Where a sh block's comment says how many paths an explore command explores ("2206
    paths"), what that command printed instead, if it differs."""
    wrong = []
    sections = re.split(r"(?m)^\$ ", stdout)  # the script shows each command as it starts
    for command in block.commands():
        said = re.search(r"#.*?\b(\d[\d,]*) paths", command)
        if said is None:
            continue
        shown = next((section for section in sections if section.startswith(command)), "")
        printed = re.search(r"explored (\d+) paths", shown)
        count = said.group(1).replace(",", "")
        if printed is None or printed.group(1) != count:
            wrong.append(f"`{_command_key(command)}`: the doc says {said.group(1)} paths; it "
                         f"printed {printed.group(0) if printed else 'no path count'}")
    return wrong


def test_the_docs_are_all_read() -> None:
    assert {"README.md", "docs/lifecycle.md", "docs/operations.md", "docs/peer.md",
            "docs/performance.md", "docs/tutorial.md"} <= set(doc_paths())
    assert {PYTHON, SHELL, OUTPUT} <= {block.info for block in BLOCKS}
    assert any(block.needs_s3 and block.prints for block in BLOCKS), "the README's example"


def test_every_command_not_run_is_in_a_block() -> None:
    """A stale entry in NOT_RUN would skip nothing, but would say something untrue."""
    shown = {_command_key(command) for block in BLOCKS if block.info == SHELL
             for command in block.commands()}
    assert set(_NOT_RUN) <= shown, sorted(set(_NOT_RUN) - shown)


def test_a_failing_command_fails_its_block(tmp_path: Path) -> None:
    """The shell runner stops at the first command that fails, also inside ``a && b``."""
    block = Block("doc.md", 1, SHELL, "true  # fine\nfalse && true\necho never\n")
    (tmp_path / "block.sh").write_text(shell_script(block))
    done = subprocess.run(["bash", "block.sh"], cwd=tmp_path, capture_output=True, text=True,
                          check=False, timeout=10)
    assert done.returncode == 1
    assert "exit status 1: false && true" in done.stdout
    assert "$ echo never" not in done.stdout


def test_fences_are_read_as_commonmark_reads_them() -> None:
    markdown = "a\n```python title\nx = 1\n````\n~~~\n```\n~~~\n```sh\nnever closed\n"
    assert [(b.id, b.info, b.text, b.closed) for b in blocks_of("doc.md", markdown)] == [
        ("doc.md:2", "python", "x = 1\n", True), ("doc.md:5", "", "```\n", True),
        ("doc.md:8", "sh", "never closed\n", False)]


def test_a_commands_path_count_in_its_comment_is_held_to_what_it_printed() -> None:
    block = Block("doc.md", 1, SHELL, ".venv/bin/kvfsm explore   # every call failing: 2206 "
                                      "paths, 0 violations\nmake other\n")
    printed = ("$ .venv/bin/kvfsm explore   # every call failing: 2206 paths, 0 violations\n"
               "explored {} paths (64055 NIXL calls) in 3.43 s: 0 violations\n$ make other\n")
    assert path_counts(block, printed.format(2206)) == []
    assert path_counts(block, printed.format(2300)) == [
        "`.venv/bin/kvfsm explore`: the doc says 2206 paths; it printed explored 2300 paths"]


def test_a_python_block_is_held_to_the_output_shown_after_it() -> None:
    markdown = ("```python\nprint(1)\n```\n\nIt prints:\n\n```text\n1\n```\n"
                "```python\nprint(2)\n```\nand then\n```text\n3\n```\n")
    assert [block.prints for block in blocks_of("doc.md", markdown)] == ["1\n", None, None, None]
