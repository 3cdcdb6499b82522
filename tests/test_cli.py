"""The ``kvfsm demo`` main job, ``kvfsm explore`` and ``kvfsm replay``, as a user runs them."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvfsm.demo
from examples.verify_lifecycle import VERIFY_MACHINE, VerifyState
from kvfsm import TRANSFER_MACHINE, Declaration, TransferState
from kvfsm.cli import main
from kvfsm.demo import parse_fault_spec
from kvfsm.lifecycle import ACTIONS, ANSWERS, GUARDS, TRANSITIONS
from kvfsm.testing import FakeNixlAgent, Raise, ReturnErr, StayProc

from .real_nixl import S3Server, free_port, no_aws_credentials, require_nixl

SMALL = ["--blocks", "32", "--block-kib", "4", "--blocks-per-job", "4"]


def read_only_dir() -> str:
    """A directory that exists and takes no new file, even for root (CI runs as root, where
    permissions stop nothing): sysfs and procfs refuse it."""
    for candidate in ("/sys/kernel", "/proc/self"):
        probe = os.path.join(candidate, ".kvfsm-probe")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError:
            return candidate
        os.unlink(probe)
    pytest.skip("no read-only directory found")


def _publish_before_release() -> Declaration[Any, Any]:
    """The shipped lifecycle, broken: a release that raises goes on to CLEANED."""
    transitions = [
        {**t, "dest": TransferState.CLEANED, "after": []}
        if (t["source"], str(t["trigger"]), t.get("conditions")) == (
            TransferState.DONE, "release", "release_raised") else t
        for t in TRANSITIONS]
    return Declaration("publish_before_release", states=TransferState,
                       initial=TransferState.SUBMITTED, answers=ANSWERS, guards=GUARDS,
                       actions=ACTIONS, transitions=transitions, final=TRANSFER_MACHINE.final,
                       failure_states=TRANSFER_MACHINE.failure_states,
                       effects=TRANSFER_MACHINE.effects, running=TRANSFER_MACHINE.running)


#: a user's broken machine, for ``kvfsm explore --machine tests.test_cli:PUBLISH_BEFORE_RELEASE``
PUBLISH_BEFORE_RELEASE = _publish_before_release()


def _lenient_verify() -> Declaration[Any, Any]:
    """The verify lifecycle, broken: a checksum mismatch latches success."""
    return Declaration(
        "lenient_verify", states=VerifyState, initial=VerifyState.SUBMITTED,
        answers=VERIFY_MACHINE.answers, guards=VERIFY_MACHINE.guards,
        actions=VERIFY_MACHINE.actions,
        transitions=[{**t, "dest": VerifyState.DONE, "after": "latch_success"}
                     if t.get("conditions") == "unverified" else t
                     for t in VERIFY_MACHINE.transitions],
        final=VERIFY_MACHINE.final, failure_states=VERIFY_MACHINE.failure_states,
        effects=VERIFY_MACHINE.effects, running=VERIFY_MACHINE.running)


#: a user's broken machine with a step of its own, for ``kvfsm explore --machine
#: tests.test_cli:LENIENT_VERIFY --steps examples.verify_lifecycle:STEPS``
LENIENT_VERIFY = _lenient_verify()
#: not steps: a list, and a mapping whose value is no function
NOT_STEPS, STEPS_OF_NOTHING = ["verify"], {"verify": 3}
#: a cancel while the user's step runs sends the job on to FAILED latching nothing (it fails
#: saying no reason): found on the path where the step is interrupted (a cancel latching
#: again there is refused by the tier now, from its table)
CANCEL_LATCHES_AGAIN = VERIFY_MACHINE.extend(
    "cancel_latches_nothing",
    replace={("VERIFYING", "cancel", ""): {"dest": "FAILED", "after": []}})


def test_the_default_demo_verifies_every_byte_through_real_nixl_files() -> None:
    require_nixl()
    done = subprocess.run([sys.executable, "-m", "kvfsm", "demo", *SMALL],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "file tier on real NIXL (POSIX)" in done.stdout
    assert "verified 32 of 32 blocks byte for byte, 0 mismatched" in done.stdout
    assert done.stdout.rstrip().endswith("every byte verified")


def test_injected_faults_on_real_nixl_are_retried_and_each_job_publishes_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    require_nixl()
    spec = "release_xfer_handle:raise*3,check_xfer_state:proc=4@2,deregister_memory:raise@1"
    assert main(["demo", *SMALL, "--inject-faults", spec]) == 0
    out = capsys.readouterr().out
    assert "retries: 3 failed release(s) retried; leaks: 1 cleanup call(s) failed" in out
    assert "results: 8 stores (0 failed), 8 loads (0 failed), 0 duplicated, 0 lost" in out
    assert "PROCESSING --poll [running]" in out
    assert "every byte verified" in out


def test_a_failed_state_check_fails_that_store_and_the_rest_still_verifies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", *SMALL, "--fake", "--inject-faults", "check_xfer_state:err@3"]) == 0
    out = capsys.readouterr().out
    assert "8 stores (1 failed), 8 loads (1 failed)" in out
    assert "verified 28 of 32 blocks byte for byte, 0 mismatched" in out
    assert "4 block(s) not verified: their store or load failed from the injected faults" in out
    # the failures, by cause, each with one example: the load fails because its store did
    assert "failed jobs by cause:\n" in out
    assert "      1 store: check_xfer_state answered 'ERR' (injected)\n" in out
    assert "        e.g. job 2: check_xfer_state answered 'ERR'\n" in out
    assert "      1 load: the store of its blocks failed (injected)\n" in out
    assert ("        e.g. job 13 (after store job 2): open raised ForgottenKeyError: the tier "
            "forgot 'block-8', 'block-9', 'block-10' and 1 more (a store failed") in out


def test_a_load_of_blocks_whose_store_was_quarantined_is_refused_and_blamed_on_that_store(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every release raises: each store moves its bytes, then is quarantined on its release,
    a failure. The tier forgot their keys, so each load is refused without a NIXL call (it
    would have read bytes the engine was told were not stored), and is grouped under the
    failed store it follows from, the example saying why it was refused."""
    assert main(["demo", "--fake", "--blocks", "2", "--blocks-per-job", "1", "--no-progress",
                 "--inject-faults", "release_xfer_handle:raise*1000000",
                 "--retry-seconds", "0.5"]) == 0
    out = capsys.readouterr().out
    quarantined = ("quarantined waiting on release_xfer_handle: retry bound spent; last error: "
                   "FakeNixlError: NIXL_ERR_BACKEND")
    assert "results: 2 stores (2 failed), 2 loads (2 failed)" in out
    assert f"      2 stores: {quarantined} (injected)\n        e.g. job 0: {quarantined}\n" in out
    assert ("      2 loads: the store of its blocks failed (injected)\n        e.g. job 2 (after "
            "store job 1): open raised ForgottenKeyError: the tier forgot 'block-1'") in out


# -- a job that fails for a real reason: the demo says why, and fails -----------------------------

def test_a_read_only_directory_fails_the_demo_and_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    require_nixl()
    root = read_only_dir()
    assert main(["demo", *SMALL, "--dir", root]) == 1
    out = capsys.readouterr().out
    assert "results: 8 stores (8 failed), 8 loads (8 failed)" in out
    cause = re.search(r"^ +8 stores: open raised (\w+Error): .* \(NOT injected\)$", out, re.M)
    assert cause is not None, out
    assert re.search(rf"^ +e\.g\. job 0: open raised {cause[1]}: .*'{root}/", out, re.M), out
    assert "      8 loads: the store of its blocks failed (NOT injected)" in out
    assert re.search(r"^kvfsm demo: 16 job\(s\) failed for a reason that was not injected "
                     rf"\(job 0: open raised {cause[1]}: .*\): exit 1$", out, re.M), out
    assert "every byte verified" not in out


def test_a_directory_on_a_read_only_file_system_is_a_bad_option_named_as_the_demos(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """/proc/sys is mounted read-only: the tier refuses it before any job runs, and the demo
    says so in its own terms (the tier's advice, read_only=True, is not a demo option)."""
    require_nixl()
    assert main(["demo", *SMALL, "--dir", "/proc/sys"]) == 2
    captured = capsys.readouterr()
    assert "results:" not in captured.out, "no job ran"
    assert captured.err == ("kvfsm demo: ValueError: --dir /proc/sys: cannot be written to (a "
                            "read-only file system or no permission); the demo stores its "
                            "blocks there\n")


def test_a_directory_that_cannot_be_made_or_is_a_file_is_a_bad_option_named_as_the_demos(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A --dir under a directory that takes no new one, or a path that is a file: refused as the
    demo's option before any job runs, saying why, and nothing is made."""
    under = os.path.join(read_only_dir(), "kvfsm-demo")
    assert main(["demo", *SMALL, "--dir", under]) == 2
    captured = capsys.readouterr()
    assert "results:" not in captured.out, "no job ran"
    assert re.fullmatch(rf"kvfsm demo: ValueError: --dir {re.escape(under)}: cannot be "
                        r"created \([^)]+\); the demo stores its blocks there\n",
                        captured.err), captured.err
    assert not os.path.exists(under)
    a_file = tmp_path / "blocks"
    a_file.write_text("not a directory")
    assert main(["demo", *SMALL, "--dir", str(a_file)]) == 2
    assert capsys.readouterr().err == (f"kvfsm demo: ValueError: --dir {a_file}: exists and is "
                                       "not a directory (the demo stores its blocks in one)\n")
    assert a_file.read_text() == "not a directory"


@pytest.mark.parametrize(("argv", "message"), [
    (["demo", "--dir", ""], "kvfsm demo: error: --dir needs a directory's path, got ''\n"),
    (["demo", "--fake", "--trace", ""], "kvfsm demo: error: --trace needs a file's path, got "
     "''\n"),  # (ran, and wrote no trace)
    (["demo", "--s3-endpoint", "", "--bucket", ""], "kvfsm demo: error: --s3-endpoint needs a "
     "URL, got ''\n"),  # (ran on files, in a temporary directory)
    (["diagrams", "--out", ""], "kvfsm diagrams: --out needs a directory's path, got ''\n"),
    (["replay", ""], "kvfsm replay: ValueError: replay needs a trace file's path, got ''\n"),
    (["replay", "t.jsonl", "--machine", ""], "kvfsm replay: ValueError: --machine needs "
     "module:ATTRIBUTE, got ''\n"),
], ids=["demo --dir", "demo --trace", "demo --s3-endpoint", "diagrams --out", "replay FILE",
        "replay --machine"])
def test_an_empty_path_is_a_bad_option_not_the_default_place(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An unset variable in a script gives ``--dir ""``: the demo ran in a temporary directory
    of its own, and ``kvfsm diagrams --out ""`` drew into the current one; ``kvfsm replay ""``
    said ": cannot read the trace file: Is a directory". Refused, naming the option, nothing
    made."""
    monkeypatch.chdir(tmp_path)
    try:
        status = main(argv)
    except SystemExit as usage:  # (argparse's usage error)
        status = usage.code
    assert status == 2
    assert capsys.readouterr().err.endswith(message)
    assert list(tmp_path.iterdir()) == []


def test_the_command_shows_kvfsms_warnings_once_however_often_it_is_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """The command's entry point adds a handler for kvfsm's warnings (the exit's wait is said
    there) once: run twice in a process, it printed each warning twice."""
    import logging  # noqa: PLC0415

    from kvfsm.cli import console  # noqa: PLC0415

    monkeypatch.setattr(sys, "argv", ["kvfsm", "replay", ""])
    library = logging.getLogger("kvfsm")
    before = list(library.handlers)
    try:
        assert console() == 2 and console() == 2
        capsys.readouterr()
        library.warning("interpreter exit: one warning")
        assert capsys.readouterr().err == "kvfsm: interpreter exit: one warning\n"
    finally:
        library.handlers[:] = before


@pytest.mark.parametrize("when", ["imports", "collect"])
def test_a_ctrl_c_before_or_after_the_command_is_one_line_and_status_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], when: str,
) -> None:
    """A Ctrl-C as the command's modules are imported (torch's import takes a second or two),
    or as what it dropped is collected once it returned: one line, status 130 (a traceback,
    or an interrupt Python printed as ignored in a NIXL agent's teardown, with status 0)."""
    import logging  # noqa: PLC0415

    import kvfsm.cli  # noqa: PLC0415
    import kvfsm.demo  # noqa: PLC0415

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    if when == "imports":
        monkeypatch.setattr(kvfsm.demo, "add_arguments", interrupted)
    else:
        monkeypatch.setattr(kvfsm.cli.gc, "collect", interrupted)
    monkeypatch.setattr(sys, "argv", ["kvfsm", "replay", ""])
    before = list(logging.getLogger("kvfsm").handlers)
    try:
        assert kvfsm.cli.console() == 130
    finally:
        logging.getLogger("kvfsm").handlers[:] = before
    err = capsys.readouterr().err
    assert err.endswith("kvfsm: interrupted\n") and "Traceback" not in err


#: the ``kvfsm`` command as its entry point runs it, with the exit's wait for NIXL cut to 3 s
COMMAND_WITH_A_SHORT_EXIT_WAIT = """
import sys
import kvfsm.tiers.base
from kvfsm.cli import console
kvfsm.tiers.base.EXIT_WAIT_SECONDS = {wait}
sys.argv = ["kvfsm", *sys.argv[1:]]
sys.exit(console())
"""


def _demo_nixl_never_ends(wait: float, *options: str) -> subprocess.Popen[str]:
    """The demo on real NIXL files, every state check answered PROC: its store phase never
    ends."""
    require_nixl()
    return subprocess.Popen(
        [sys.executable, "-c", COMMAND_WITH_A_SHORT_EXIT_WAIT.format(wait=wait), "demo",
         *SMALL, "--no-progress", "--inject-faults", "check_xfer_state:proc=100000000",
         *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_demo_past_its_timeout_says_that_its_exit_waits_for_nixl(tmp_path: Path) -> None:
    """A phase past ``--timeout`` leaves transfers NIXL runs (so the fault says): the exit
    waits for them, up to EXIT_WAIT_SECONDS, and the command says so on stderr, then what it
    gave up on. (It waited 60 s in silence, the warnings to a logger nobody showed.)"""
    demo = _demo_nixl_never_ends(3, "--timeout", "1", "--dir", str(tmp_path))
    _, err = demo.communicate(timeout=120)
    assert demo.returncode == 1, err
    assert err.splitlines()[-4:] == [
        "kvfsm demo: DrainTimeout: store phase: 1 transfer(s) not published",
        "  job 0: PROCESSING, retries=0, last error: None",
        "kvfsm: interpreter exit: FileTier was not shut down (or its shutdown timed out), with "
        "1 job(s) unpublished; waiting up to 3 s for NIXL to end their transfers",
        "kvfsm: interpreter exit: FileTier: NIXL still runs 1 transfer(s) (jobs [0]) at the "
        "exit's deadline (EXIT_WAIT_SECONDS, 3 s); exiting with them in flight",
    ], err
    assert "Traceback" not in err


def test_a_ctrl_c_during_the_exits_wait_for_nixl_stops_it_and_prints_no_traceback(
    tmp_path: Path,
) -> None:
    """A phase past ``--timeout``: the exit waits for NIXL, saying so, and a Ctrl-C (after a
    first one, whose shutdown timed out, say) stops that wait: one line says what it left in
    flight, no traceback (the exit's hook printed one)."""
    lines = []
    with _demo_nixl_never_ends(120, "--timeout", "1", "--dir", str(tmp_path)) as demo:
        assert demo.stderr is not None
        try:
            for line in demo.stderr:  # (the store phase never ends: its DrainTimeout at 1 s)
                lines.append(line)
                if "waiting up to" in line:  # the exit's wait, said
                    break
            demo.send_signal(signal.SIGINT)
            lines.append(demo.communicate(timeout=60)[1])
        finally:
            demo.kill()
    err = "".join(lines)
    assert demo.returncode == 1, err
    assert err.splitlines()[-2:] == [
        "kvfsm: interpreter exit: FileTier was not shut down (or its shutdown timed out), with "
        "1 job(s) unpublished; waiting up to 120 s for NIXL to end their transfers",
        "kvfsm: interpreter exit: interrupted while waiting for NIXL to end its transfers; "
        "exiting with those it still runs in flight"], err
    assert "Traceback" not in err and "Exception ignored" not in err


def test_ctrl_c_during_the_demo_shuts_the_tier_down_and_prints_no_traceback(
    tmp_path: Path,
) -> None:
    """An interrupt while releases are retried (the likeliest moment: the demo waits for the
    retry bound) shuts the tier down, waiting for NIXL, and exits 130 with one line; the
    traces of the jobs that shutdown publishes are written (the trace file was once closed
    first)."""
    traces = tmp_path / "t.jsonl"
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvfsm", "demo", "--fake", *SMALL, "--no-progress",
         "--inject-faults", "release_xfer_handle:raise*100000", "--retry-seconds", "60",
         "--trace", str(traces)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # the phases begin once the tier is made
            if "tier on" in line:
                break
        time.sleep(0.5)  # the stores are over; their releases raise, again and again
        demo.send_signal(signal.SIGINT)
        _, err = demo.communicate(timeout=60)
    finally:
        demo.kill()
    assert demo.returncode == 130
    assert err == ("kvfsm demo: interrupted; shutting the tier down (waiting for NIXL)\n"
                   "kvfsm demo: interrupted\n")
    assert len(traces.read_text().splitlines()) == 8, "every store's trace, the last included"


@pytest.fixture
def s3_refusing_credentials(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[S3Server, str]]:
    """An S3 server that checks credentials (moto, past its first two requests: the bucket's
    creation and the demo's unsigned check that it exists), and a bucket on it."""
    require_nixl()
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "2")  # read by the server at start
    server = S3Server(free_port())
    server.start()
    monkeypatch.delenv("INITIAL_NO_AUTH_ACTION_COUNT")
    try:
        yield server, server.new_bucket()
    finally:
        server.stop()


def test_an_object_store_that_refuses_the_credentials_fails_the_demo_and_says_why(
    s3_refusing_credentials: tuple[S3Server, str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, bucket = s3_refusing_credentials
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")  # every request answered 403
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    assert main(["demo", "--blocks", "8", "--block-kib", "4", "--blocks-per-job", "4",
                 "--s3-endpoint", server.endpoint, "--bucket", bucket,
                 "--inject-faults", "release_xfer_handle:raise@1"]) == 1
    out = capsys.readouterr().out
    assert "results: 2 stores (2 failed), 2 loads (2 failed)" in out
    assert re.search(r"^ +2 stores: (transfer|check_xfer_state) raised nixl\w+: NIXL_ERR_\w+ "
                     r"\(NIXL's OBJ backend says no more: the bucket may be missing or "
                     r"unreachable, or the credentials refused\) \(NOT injected\)$", out, re.M), out
    assert "failed for a reason that was not injected" in out


def test_an_object_store_demo_without_credentials_says_so_before_any_job(
    s3_refusing_credentials: tuple[S3Server, str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Without credentials NIXL's OBJ backend signs nothing, and every transfer failed with
    NIXL_ERR_BACKEND, naming no cause (the README's moto server took a newcomer there). The
    demo says what is missing, and what a local server takes, before it makes an agent."""
    server, bucket = s3_refusing_credentials
    no_aws_credentials(monkeypatch, tmp_path)
    assert main(["demo", *SMALL, "--s3-endpoint", server.endpoint, "--bucket", bucket]) == 2
    captured = capsys.readouterr()
    assert "results:" not in captured.out, "no job ran"
    assert captured.err == (
        "kvfsm demo: ValueError: no S3 credentials found (AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY, a profile, or ~/.aws/credentials); a local server such as "
        "moto takes any, e.g. AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test; the demo "
        f"needs them for {server.endpoint}\n")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")  # (so that the server answers 403)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    assert main(["demo", *SMALL, "--s3-endpoint", server.endpoint, "--bucket", bucket]) == 1


@pytest.mark.parametrize("source", ["keys", "env", "profile", "file", "config-process", "none",
                                    "empty-env", "empty-keys", "config-region-only"])
def test_credentials_are_found_where_the_default_chain_looks(
    source: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kvfsm.nixl_agents import StoreConfig, credentials_found  # noqa: PLC0415

    no_aws_credentials(monkeypatch, tmp_path)
    keys = {"keys": {"access_key": "a", "secret_key": "s"},
            "empty-keys": {"access_key": "", "secret_key": ""}}.get(source, {})
    if source in ("env", "empty-env"):
        value = "a" if source == "env" else ""
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", value)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", value)
    if source == "profile":
        monkeypatch.setenv("AWS_PROFILE", "work")
    if source == "file":
        (tmp_path / "credentials").write_text("[default]\naws_access_key_id = a\n")
    if source == "config-process":
        (tmp_path / "config").write_text("[default]\ncredential_process = /bin/creds\n")
    if source == "config-region-only":  # a file that gives no credentials is none
        (tmp_path / "config").write_text("[default]\nregion = us-east-1\n")
    found = source in ("keys", "env", "profile", "file", "config-process")
    assert credentials_found(StoreConfig("b", **keys)) is found


@pytest.mark.parametrize(("extra", "named"), [
    (["--s3-endpoint", "http://127.0.0.1:9", "--bucket", "b"], "--s3-endpoint and --bucket"),
    (["--bucket", "b"], "--bucket"),
    (["--dir", "/nonexistent/kvfsm"], "--dir"),
])
def test_options_for_another_store_are_a_usage_error_and_nothing_runs(
    extra: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--fake", *SMALL, *extra])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "", "nothing ran"
    assert (f"kvfsm demo: error: --fake runs on kvfsm's in-memory store; {named} would be "
            "ignored: give one place for the blocks\n") in captured.err


def test_a_directory_and_an_s3_store_together_are_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--dir", "/nonexistent/kvfsm", "--s3-endpoint", "http://127.0.0.1:9",
              "--bucket", "b"])
    assert exited.value.code == 2
    assert "kvfsm demo: error: --dir keeps the blocks in files" in capsys.readouterr().err


# -- progress, and a verification that keeps up -------------------------------------------------

def test_progress_goes_to_stderr_when_asked_and_is_off_when_stderr_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--fake", *SMALL]) == 0
    assert capsys.readouterr().err == "", "stderr is no terminal here: no bars"
    assert main(["demo", "--fake", *SMALL, "--progress"]) == 0
    captured = capsys.readouterr()
    for phase in ("fill", "store submit", "store", "load submit", "load", "verify"):
        assert f"\r{phase}: " in captured.err or captured.err.startswith(f"{phase}: "), phase
    assert re.search(r"verify: 100%.*128k/128k \[[\d:]+<[\d:]+, [\d.]+\w?B/s\]",
                     captured.err), captured.err
    assert "%|" not in captured.out, "progress never goes to stdout"


def test_a_release_that_keeps_raising_shows_the_wait_for_its_retry_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--fake", *SMALL, "--progress", "--retry-seconds", "0.5",
                 "--inject-faults", "release_xfer_handle:raise*100000000"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"waiting out release retries: +\d+%\|.*\| \d/0 s \[.*8 job\(s\) "
                     r"retried up to \d+ times, last error: FakeNixlError: NIXL_ERR_BACKEND",
                     captured.err), captured.err
    assert ("      8 stores: quarantined waiting on release_xfer_handle: retry bound spent; "
            "last error: FakeNixlError: NIXL_ERR_BACKEND (injected)") in captured.out


class _Corrupting(FakeNixlAgent):
    """Flips a byte of blocks 9 and 5 in the object store before the first load."""

    def make_prepped_xfer(self, operation: str, *args: Any, **kwargs: Any) -> Any:
        if operation == "READ" and not getattr(self, "corrupted", False):
            self.corrupted = True
            size = len(next(iter(self.objects.values())))  # the demo's block size
            for key in (f"demo/{size}-bytes/block-9", f"demo/{size}-bytes/block-5"):
                data = bytearray(self.objects[key])
                data[100] ^= 0xFF
                self.objects[key] = bytes(data)
        return super().make_prepped_xfer(operation, *args, **kwargs)


def test_verification_compares_whole_chunks_and_names_the_first_bad_block(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    compared: list[int] = []
    equal = torch.equal

    def counting(a: torch.Tensor, b: torch.Tensor) -> bool:
        compared.append(a.numel())
        return equal(a, b)

    monkeypatch.setattr(kvfsm.demo, "FakeNixlAgent", _Corrupting)
    monkeypatch.setattr(torch, "equal", counting)
    assert main(["demo", "--fake", *SMALL]) == 1
    out = capsys.readouterr().out
    assert "verified 32 of 32 blocks byte for byte, 2 mismatched (the first: block 5)" in out
    assert len(compared) == 1, "the 32 blocks are one chunk: one comparison, not one a block"


def test_the_demo_makes_one_random_block_not_a_random_cache(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch.randint over the whole cache is what kept a 2 GiB demo silent for 20 s before
    its first transfer (and a clone of it, to verify against, 2 GiB more)."""
    drawn: list[int] = []
    randint = torch.randint

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        numbers = randint(*args, **kwargs)
        drawn.append(numbers.numel())
        return numbers

    monkeypatch.setattr(torch, "randint", counting)
    assert main(["demo", "--fake", *SMALL]) == 0
    assert "every byte verified" in capsys.readouterr().out
    assert drawn == [4 * 1024], "one block's random bytes"


def test_the_fault_spec_grammar() -> None:
    specs = parse_fault_spec("transfer:err@2, check_xfer_state:proc=3*2,release_xfer_handle:raise")
    assert [(s.call, s.fault, s.at, s.times) for s in specs] == [
        ("transfer", ReturnErr(), 2, 1),
        ("check_xfer_state", StayProc(3), None, 2),
        ("release_xfer_handle", Raise(), None, 1),
    ]


@pytest.mark.parametrize(("args", "message"), [
    (["--inject-faults", "transfer"], "bad fault 'transfer'"),
    (["--inject-faults", "transfer:explode"], "bad fault 'transfer:explode'"),
    (["--inject-faults", "transfer:raise@0"], "count from 1"),
    (["--inject-faults", "teleport:raise"], "bad fault for 'teleport': not a NIXL call"),
    (["--blocks", "0"], "--blocks must be at least 1"),
    (["--retry-seconds", "0"], "--retry-seconds must be positive"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
    (["--timeout", "-1"], "--timeout must be a positive number of seconds, got -1.0"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds, got nan"),
    (["--inject-faults", "release_xfer_handle:err"], "bad fault for 'release_xfer_handle': err "
     "only applies to check_xfer_state and transfer; other calls take raise"),
    (["--inject-faults", "deregister_memory:proc=2"], "proc only applies to check_xfer_state"),
    (["--inject-faults", "RELEASE_XFER_HANDLE:raise"], "bad fault for 'RELEASE_XFER_HANDLE': not "
     "a NIXL call kvfsm can fail (NIXL's calls are lowercase: 'release_xfer_handle')"),
    (["--trace", "/no-such-directory/t.jsonl"], "--trace /no-such-directory/t.jsonl: there is no "
     "directory '/no-such-directory' to write it in"),
    (["--trace", "/"], "--trace /: is a directory; name a file to write"),
    (["--trace", "/proc/kvfsm-trace.jsonl"], "--trace /proc/kvfsm-trace.jsonl: cannot write it"),
    (["--inject-faults", "check_xfer_state:proc=0"], "bad fault 'check_xfer_state:proc=0': "
     "proc=N keeps a transfer running for N polls, N from 1"),  # (was: "StayProc: polls...")
    (["--inject-faults", "query_memory:raise"], "bad fault for 'query_memory': the demo never "
     "calls it (it makes no lookup), so the fault would never fire"),  # (was: taken, unfired)
])
def test_bad_options_are_named(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--fake", "--blocks", "4", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == "", "refused before the demo began"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["register_memory", "prep_xfer_dlist"])
def test_a_fault_that_stops_the_tier_starting_is_named_as_the_injected_one(
    call: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tier's first register_memory and prep_xfer_dlist are the primary cache's: a fault
    there ended the demo with a bare "FakeNixlError: NIXL_ERR_BACKEND", naming neither the
    call nor the fault; @2 fails a job's, as the rest of the demo's faults do."""
    assert main(["demo", "--fake", "--blocks", "4", "--inject-faults", f"{call}:raise"]) == 2
    assert (f"the tier could not start: FakeNixlError: NIXL_ERR_BACKEND, the injected fault "
            f"{call}@1: a tier's first {call} is the primary cache's, made as it starts, before "
            f"any job; inject it @2 or later to fail a job's") in capsys.readouterr().err
    assert main(["demo", "--fake", "--blocks", "4", "--blocks-per-job", "1",
                 "--inject-faults", f"{call}:raise@2"]) == 0
    capsys.readouterr()
    # a tier that could not start for a reason of its own (a read-only directory) is not
    # blamed on the fault
    assert main(["demo", "--blocks", "4", "--dir", "/proc/sys",
                 "--inject-faults", f"{call}:raise@1"]) == 2
    error = capsys.readouterr().err
    assert "--dir /proc/sys: cannot be written to" in error
    assert "injected" not in error


def test_a_cache_larger_than_the_machine_is_refused_by_its_options_before_allocating(
        capsys: pytest.CaptureFixture[str]) -> None:
    """torch's allocator said "DefaultCPUAllocator: can't allocate memory", naming no option
    (or, on a machine with room for its one-block pattern, filled that first)."""
    assert main(["demo", "--fake", "--block-kib", str(2**40)]) == 2  # 1 PiB a block
    assert ("--blocks 256 x --block-kib 1099511627776: a cache of 274,877,906,944 MiB is more "
            "than this machine's memory (") in capsys.readouterr().err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_a_trace_file_that_fills_up_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk under the trace said only "[Errno 28] No space left on device"."""
    assert main(["demo", "--fake", "--blocks", "4", "--no-progress", "--trace",
                 "/dev/full"]) == 1
    assert ("OSError: [Errno 28] No space left on device: writing traces to /dev/full"
            in capsys.readouterr().err)


def test_a_trace_into_a_pipe_reaches_its_reader(tmp_path: Path) -> None:
    """``--trace`` into a named pipe that a reader consumes: the check that the trace can be
    written must not open and close the pipe (that ends the reader, and the demo's own open
    then waits for a reader for ever)."""
    import threading  # noqa: PLC0415

    pipe = tmp_path / "trace.fifo"
    os.mkfifo(pipe)
    lines: list[bytes] = []

    def read() -> None:
        with pipe.open("rb") as trace:
            lines.extend(trace)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    done = subprocess.run([sys.executable, "-m", "kvfsm", "demo", "--fake", *SMALL, "--trace",
                           str(pipe)], capture_output=True, text=True, timeout=50, check=False)
    assert done.returncode == 0, done.stderr
    reader.join(10)
    assert len(lines) == 16 and all(b'"success":true' in line for line in lines), lines[:2]


def test_a_bucket_without_an_endpoint_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--blocks", "4", "--bucket", "b"]) == 2
    assert "--s3-endpoint and --bucket go together" in capsys.readouterr().err


def test_a_run_that_cannot_finish_stops_at_its_timeout_and_names_the_stuck_jobs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--fake", *SMALL, "--timeout", "0.2",
                 "--inject-faults", "release_xfer_handle:raise*100000000"]) == 1
    err = capsys.readouterr().err
    assert "DrainTimeout: store phase: 8 transfer(s) not published" in err
    assert "job 0: DONE" in err


def test_kvfsm_explore_finds_no_violation_in_the_shipped_lifecycle() -> None:
    done = subprocess.run([sys.executable, "-m", "kvfsm", "explore", "--max-faults", "1"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 violations" in done.stdout
    assert done.stderr == "", "a library logs nowhere unless the application says so"


def test_kvfsm_explore_refuses_a_users_machine_a_tier_would_refuse_naming_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["explore", "--machine", "tests.test_cli:PUBLISH_BEFORE_RELEASE"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert ("kvfsm explore: MachineRefused: machine 'publish_before_release': PUBLISHED, a "
            "final state that is no failure state, is reached without a 'release'") in (
        captured.err)


@pytest.mark.parametrize("parent", [[], ["--parent"]], ids=["tier", "parent"])
def test_kvfsm_explore_reports_a_broken_users_machine_with_a_command_that_replays_it(
    parent: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The machine runs in tiers whose check of the table's structure was bypassed (it is
    refused before it runs, above): the explorer catches it as it runs all the same."""
    import kvfsm.driver  # noqa: PLC0415

    monkeypatch.setattr(kvfsm.driver, "_check_released_before_final", lambda *args: None)
    options = ["--machine", "tests.test_cli:PUBLISH_BEFORE_RELEASE", *parent]
    assert main(["explore", *options]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION" in out
    (command,) = (line.removeprefix("replay it with: ") for line in out.splitlines()
                  if line.startswith("replay it with: "))
    assert command == ("kvfsm explore " + " ".join(options)
                       + " --replay 'mode=1;release_xfer_handle:raise@1'")
    argv = shlex.split(command)
    assert main(argv[1:]) == 1, "the printed command replays the violation, on that machine"
    assert "RELEASE_BEFORE_PUBLISH" in capsys.readouterr().out


@pytest.mark.parametrize(("path", "says"), [
    # an unset variable in a script: it explored every path, and exited 0
    ("", "a path starts with mode=N; got ''"),
    # a user machine's path, replayed without naming its machine: the fault injector's words
    ("mode=1;verify:raise@1", "'verify' is neither a NIXL call (one of check_xfer_state, "
     "deregister_memory,"),
])
def test_kvfsm_explore_refuses_a_replay_path_it_cannot_run_saying_why(
    capsys: pytest.CaptureFixture[str], path: str, says: str,
) -> None:
    assert main(["explore", "--replay", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    choice = path.partition(";")[2]  # (the choice is named, not the whole path)
    assert f"kvfsm explore: ValueError: {choice + ': ' if choice else ''}{says}" in captured.err
    if path:
        assert captured.err.rstrip().endswith("a path of another machine replays with its "
                                              "--machine and --steps")


def test_kvfsm_explore_runs_a_users_lifecycle_with_the_steps_it_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = ["--machine", "examples.verify_lifecycle:VERIFY_MACHINE", "--max-faults", "1"]
    assert main(["explore", *options]) == 2, "without its step, the machine is refused"
    captured = capsys.readouterr()
    assert captured.out == ""
    assert ("kvfsm explore: MachineRefused: machine 'verify': state VERIFYING waits on effect "
            "'verify'") in captured.err
    assert captured.err.rstrip().endswith("name them with --steps module:ATTRIBUTE")
    assert main(["explore", *options, "--steps", "examples.verify_lifecycle:STEPS"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kvfsm explore: machine verify, up to 1 fault(s) a path\n")
    explored = re.search(r"explored (\d+) paths \(\d+ NIXL calls\) in [\d.]+ s: 0 violations",
                         out)
    assert explored is not None, out
    plain = main(["explore", "--max-faults", "1"])
    assert plain == 0
    shipped = re.search(r"explored (\d+) paths", capsys.readouterr().out)
    assert shipped is not None
    assert int(explored[1]) > int(shipped[1]), "the verify step fails at every step too"


@pytest.mark.parametrize("parent", [[], ["--parent"]], ids=["tier", "parent"])
def test_the_replay_command_of_a_broken_lifecycle_with_steps_names_its_steps(
    parent: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    options = ["--machine", "tests.test_cli:LENIENT_VERIFY",
               "--steps", "examples.verify_lifecycle:STEPS", *parent]
    assert main(["explore", *options]) == 1
    out = capsys.readouterr().out
    (command,) = (line.removeprefix("replay it with: ") for line in out.splitlines()
                  if line.startswith("replay it with: "))
    assert command == ("kvfsm explore " + " ".join(options)
                       + " --replay 'mode=1;verify:raise@1'")
    assert main(shlex.split(command)[1:]) == 1, "the printed command replays the violation"
    replayed = capsys.readouterr().out
    assert "VERIFYING -verify[unverified]-> DONE" in replayed
    assert "OUTCOME" in replayed


@pytest.mark.parametrize(("steps", "message"), [
    ("examples.verify_lifecycle", "'examples.verify_lifecycle': name steps as "
                                  "module:ATTRIBUTE, e.g. examples.verify_lifecycle:STEPS"),
    ("examples.verify_lifecycle:CHECKS", "'examples.verify_lifecycle:CHECKS': "
                                         "examples.verify_lifecycle has no attribute 'CHECKS'"),
    ("tests.test_cli:NOT_STEPS", "'tests.test_cli:NOT_STEPS' is not a mapping of effect name "
                                 "to step function (found list)"),
    ("tests.test_cli:STEPS_OF_NOTHING", "'tests.test_cli:STEPS_OF_NOTHING': 'verify': int is "
                                        "not a step"),
])
def test_steps_that_name_no_steps_are_a_usage_error_naming_why(
    steps: str, message: str, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["explore", "--machine", "examples.verify_lifecycle:VERIFY_MACHINE",
                 "--steps", steps]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"kvfsm explore: ValueError: {message}"), captured.err


@pytest.mark.parametrize(("options", "named"), [
    (["--machine", "peer_link", "--steps", "examples.verify_lifecycle:STEPS"], "--steps"),
    (["--machine", "peer_receive", "--parent"], "--parent"),
    (["--machine", "peer_link", "--replay", "mode=1;"], "--replay"),
    (["--machine", "peer_link", "--max-faults", "7", "--max-stall", "9", "--all"],
     "--max-faults, --max-stall, --all"),
])
def test_options_for_a_machine_no_tier_runs_are_a_usage_error(
        options: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    """They were once dropped without a word, and the table explored as if not given."""
    assert main(["explore", *options]) == 2
    machine = options[1]
    assert (f"kvfsm explore: ValueError: {named}: machine {machine!r} declares no effects"
            in capsys.readouterr().err)


@pytest.mark.parametrize(("options", "named"), [
    (["--machine", "examples.verify_lifecycle:VERIFY_MACHINE"], "--machine"),
    (["--parent"], "--parent"),
    (["--steps", "examples.verify_lifecycle:STEPS", "--parent"], "--steps, --parent"),
])
def test_options_the_peer_explorer_does_not_take_are_a_usage_error(
        options: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explore", "--peer", *options]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"kvfsm explore: ValueError: {named}: not with --peer"), \
        captured.err


def test_a_replayed_path_whose_fault_never_fires_fails_saying_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A replay naming a fault past the calls the path makes printed "0 violations" and
    exited 0, as if it had checked that fault; a step fault other than raise acted as one."""
    assert main(["explore", "--replay", "mode=1;release_xfer_handle:raise@99"]) == 1
    out = capsys.readouterr().out
    assert "release_xfer_handle:raise@99 never fired (the path made 4 release_xfer_handle " \
           "call(s))" in out
    assert "0 violations (1 fault(s) never fired: the path checked less than it names)" in out
    assert main(["explore", "--replay", "mode=1;release_xfer_handle:raise@1"]) == 0
    capsys.readouterr()
    assert main(["explore", "--machine", "examples.verify_lifecycle:VERIFY_MACHINE", "--steps",
                 "examples.verify_lifecycle:STEPS", "--replay", "mode=1;verify:err@1"]) == 2
    assert ("--replay: verify:err@1: a step of the machine's own takes raise or interrupt "
            "only" in capsys.readouterr().err)
    assert main(["explore", "--replay", "mode=1;check_xfer_state:proc=100@1"]) == 0, \
        "a stall longer than a run's polls is waited out, not taken for a job that never ends"
    assert "0 violations" in capsys.readouterr().out
    assert main(["explore", "--replay", "mode=38"]) == 2  # no transfer ends in a replay's polls
    assert capsys.readouterr().err == (
        "kvfsm explore: ValueError: a path's mode is 0 (transfers complete at once) or 1 (on "
        "their first poll), the two the explorer runs; got mode=38\n")


def test_kvfsm_explore_shows_progress_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explore", "--max-faults", "1", "--progress"]) == 0
    captured = capsys.readouterr()
    assert "explore mode=1, 1 fault(s): " in captured.err
    assert re.search(r"\d+/\d+ \[[\d:]+<[\d:]+, +[\d.]+path/s\]", captured.err), captured.err
    assert "0 violations" in captured.out


def test_kvfsm_replay_checks_a_demo_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    traces = tmp_path / "t.jsonl"
    assert main(["demo", "--fake", *SMALL, "--trace", str(traces)]) == 0
    assert main(["replay", str(traces)]) == 0
    assert "16 traces (80 steps) replay clean" in capsys.readouterr().out
    tampered = traces.read_text().replace('"DONE","XFER_RELEASED"', '"DONE","CLEANED"', 1)
    traces.write_text(tampered)
    assert main(["replay", str(traces)]) == 1
    assert "diverges from transfer at line 1" in capsys.readouterr().out


def test_kvfsm_replay_of_a_file_it_cannot_read_is_bad_input_not_a_divergence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CI script tells a missing trace from a bad one by the exit status: a file that cannot
    be read is bad input (2), named with why, as a file holding no trace is; a divergence is 1."""
    missing = tmp_path / "missing.jsonl"
    assert main(["replay", str(missing)]) == 2
    assert capsys.readouterr().err == (f"kvfsm replay: ValueError: {missing}: cannot read the "
                                       "trace file: No such file or directory\n")
    assert main(["replay", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"kvfsm replay: ValueError: {tmp_path}: cannot read the "
                                       "trace file: Is a directory\n")


def test_kvfsm_replay_help_says_what_each_exit_status_means(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["replay", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "exit status:\n  0  every trace in the file replays clean\n" in out
    assert "\n  1  a trace diverges from its declaration" in out
    assert "\n  2  bad input: the file cannot be read (missing, a directory, no permission)" in out


@pytest.mark.parametrize("success", ['"false"', "null", "0"])
def test_kvfsm_replay_of_a_trace_whose_outcome_is_no_bool_is_bad_input_naming_it(
    success: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """The outcome is checked against the steps only when it is true or false: one written
    otherwise was skipped, and the trace replayed clean. (A trace written before outcomes
    were recorded has none, and still replays: tests/test_reasons.py.)"""
    traces = tmp_path / "t.jsonl"
    assert main(["demo", "--fake", *SMALL, "--trace", str(traces)]) == 0
    capsys.readouterr()
    first, *rest = traces.read_text().splitlines()
    changed = first.replace('"success":false', '"success":true').replace(
        '"success":true', f'"success":{success}')
    traces.write_text("\n".join([changed, *rest]) + "\n")
    assert main(["replay", str(traces)]) == 2
    assert capsys.readouterr().err == (f"kvfsm replay: ValueError: {traces}:1: not a trace "
                                       f"(success must be true or false, got {success})\n")


def test_kvfsm_replay_of_a_trace_of_another_machine_or_a_line_cut_short_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A transfer trace replayed with ``--machine`` of another machine diverged at its first
    step (exit 1, as if the trace were wrong); a last line cut short was reported with JSON's
    own "line 2" beside the file's line number."""
    traces = tmp_path / "t.jsonl"
    assert main(["demo", "--fake", *SMALL, "--trace", str(traces)]) == 0
    capsys.readouterr()
    assert main(["replay", str(traces), "--machine", "peer_link"]) == 2
    assert capsys.readouterr().err == (
        f"kvfsm replay: ValueError: {traces}:1: the trace is of machine 'transfer', not of "
        "--machine peer_link ('peer_link'): replay it without --machine, or with the machine "
        "it names\n")
    lines = traces.read_text().splitlines()
    traces.write_text("\n".join([*lines[:-1], lines[-1][:40]]) + "\n")
    assert main(["replay", str(traces)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvfsm replay: ValueError: {traces}:{len(lines)}: not a trace (not "
                          "JSON: ") and err.endswith(" of the line; a line cut short?)\n"), err
    assert "line 2" not in err


def test_kvfsm_replay_of_a_file_with_no_trace_is_an_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["replay", str(empty)]) == 2
    captured = capsys.readouterr()
    assert "replay clean" not in captured.out
    assert f"kvfsm replay: ValueError: {empty}: no traces in the file" in captured.err


def test_the_replay_command_of_a_path_interrupting_a_step_replays_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The command printed for a violation on a path that interrupts a user step (``verify:
    interrupt@1``) replays it; it was refused ("a step of the machine's own takes raise
    only"), exit 2."""
    options = ["--machine", "tests.test_cli:CANCEL_LATCHES_AGAIN",
               "--steps", "examples.verify_lifecycle:STEPS"]
    assert main(["explore", *options]) == 1
    out = capsys.readouterr().out
    (command,) = (line.removeprefix("replay it with: ") for line in out.splitlines()
                  if line.startswith("replay it with: "))
    assert "verify:interrupt@" in command
    assert main(shlex.split(command)[1:]) == 1, "the printed command replays the violation"
    assert "nothing latched why it failed" in capsys.readouterr().out


def test_a_ctrl_c_as_the_demo_ends_is_no_traceback_and_no_success() -> None:
    """A Ctrl-C as the demo ends, once it verified the blocks (its tier and NIXL agent being
    torn down, the process exiting): status 130 (or killed by the signal, as the interpreter
    exits), never a traceback; it printed one, or "Exception ignored" in the agent's
    ``__del__`` and exited 0."""
    require_nixl()
    demo = subprocess.Popen([sys.executable, "-m", "kvfsm", "demo", *SMALL, "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            if line.startswith("verified"):
                demo.send_signal(signal.SIGINT)
                break
        _, err = demo.communicate(timeout=60)
    finally:
        demo.kill()
    assert demo.returncode in (130, -signal.SIGINT), err
    assert "Traceback" not in err and "Exception ignored" not in err, err
