"""The ``kvfsm demo`` main job, as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfsm.cli import main, parse_fault_spec
from kvfsm.testing import Raise, ReturnErr, StayProc


def test_demo_round_trip_verifies_every_byte(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--blocks", "32", "--block-kib", "4", "--blocks-per-job", "4"]) == 0
    out = capsys.readouterr().out
    assert "verified 32 of 32 blocks byte for byte, 0 mismatched" in out
    assert "every byte verified" in out
    assert "0 duplicated, 0 lost" in out


def test_demo_with_faults_retries_and_still_publishes_each_job_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = "release_xfer_handle:raise*3,check_xfer_state:proc=4@2,deregister_memory:raise@1"
    assert main(["demo", "--blocks", "16", "--block-kib", "1", "--blocks-per-job", "4",
                 "--inject-faults", spec]) == 0
    out = capsys.readouterr().out
    assert "retries: 3 failed release(s) retried; leaks: 1 cleanup call(s) failed" in out
    assert "results: 4 stores (0 failed), 4 loads (0 failed), 0 duplicated, 0 lost" in out
    assert "every byte verified" in out
    assert "PROCESSING --poll [running]" in out


def test_the_fault_spec_grammar() -> None:
    specs = parse_fault_spec("transfer:err@2, check_xfer_state:proc=3*2,release_xfer_handle:raise")
    assert [(s.call, s.fault, s.at, s.times) for s in specs] == [
        ("transfer", ReturnErr(), 2, 1),
        ("check_xfer_state", StayProc(3), None, 2),
        ("release_xfer_handle", Raise(), None, 1),
    ]


@pytest.mark.parametrize("spec", ["transfer", "transfer:explode", "transfer:raise@0"])
def test_a_bad_fault_spec_is_named(spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--blocks", "4", "--inject-faults", spec]) == 2
    assert repr(spec.split(",", maxsplit=1)[0]) in capsys.readouterr().err


def test_python_dash_m_kvfsm_runs_the_same_command() -> None:
    done = subprocess.run([sys.executable, "-m", "kvfsm", "demo", "--blocks", "8",
                           "--block-kib", "1"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "every byte verified" in done.stdout
