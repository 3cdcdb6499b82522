"""The ``kvfsm demo`` main job, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvfsm.cli import main
from kvfsm.demo import parse_fault_spec
from kvfsm.testing import Raise, ReturnErr, StayProc

from .real_nixl import require_nixl

SMALL = ["--blocks", "32", "--block-kib", "4", "--blocks-per-job", "4"]


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
    assert "4 block(s) not verified" in out


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
    (["--inject-faults", "teleport:raise"], "'teleport' is not a NIXL call"),
    (["--blocks", "0"], "--blocks must be at least 1"),
    (["--bucket", "b"], "--s3-endpoint and --bucket go together"),
])
def test_bad_options_are_named(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--fake", "--blocks", "4", *args]) == 2
    assert message in capsys.readouterr().err


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


def test_kvfsm_explore_reports_a_broken_users_machine_with_a_replayable_path(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["explore", "--machine",
                 "tests.test_explore:PUBLISH_BEFORE_RELEASE"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION" in out
    assert "replay it with: kvfsm explore --replay 'mode=1;release_xfer_handle:raise@1'" in out
    assert main(["explore", "--machine", "tests.test_explore:PUBLISH_BEFORE_RELEASE",
                 "--replay", "mode=1;release_xfer_handle:raise@1"]) == 1
    assert "RELEASE_BEFORE_PUBLISH" in capsys.readouterr().out


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
