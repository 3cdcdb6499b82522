"""Transition coverage as a pytest plugin, and traces that replay against the declaration."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfsm import TRANSFER_MACHINE, TransferJob
from kvfsm.testing import FakeNixlAgent, Raise
from kvfsm.tiers import ObjectStoreTier
from kvfsm.trace import TraceRecorder, read_traces, replay

USER_MACHINE = '''
import enum
from kvfsm import Declaration

class Lamp(enum.Enum):
    OFF = 1
    ON = 2

class Press(enum.Enum):
    OK = 1
    STUCK = 2

LAMP = Declaration(
    "lamp", states=Lamp, initial=Lamp.OFF,
    answers={"press": list(Press)},
    guards={"ok": [Press.OK], "stuck": [Press.STUCK]},
    actions={},
    transitions=[
        {"trigger": "press", "source": Lamp.OFF, "dest": Lamp.ON, "conditions": "ok"},
        {"trigger": "press", "source": Lamp.OFF, "dest": Lamp.OFF, "conditions": "stuck"},
        {"trigger": "press", "source": Lamp.ON, "dest": Lamp.OFF, "conditions": "ok"},
        {"trigger": "press", "source": Lamp.ON, "dest": Lamp.ON, "conditions": "stuck"},
    ])

class Record:
    state = Lamp.OFF
'''

USER_TESTS = '''
from lamp import LAMP, Lamp, Press, Record

def test_switch_on_and_off():
    machine, lamp = LAMP.compile(), Record()
    machine.fire(lamp, "press", Press.OK)
    machine.fire(lamp, "press", Press.STUCK)
    machine.fire(lamp, "press", Press.OK)
    assert lamp.state is Lamp.OFF
'''


@pytest.fixture
def lamp_project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(lamp=USER_MACHINE, test_lamp=USER_TESTS)
    pytester.syspathinsert()
    return pytester


def test_the_plugin_prints_what_a_users_machine_took(lamp_project: pytest.Pytester) -> None:
    result = lamp_project.runpytest("--kvfsm-coverage", "--kvfsm-machine", "lamp:LAMP")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*kvfsm transition coverage*",
        "machine lamp: 3 of 4 transitions taken (75 %)",
        "*OFF -press(STUCK)*-> OFF*0   <- never taken",
        "*ON -press(STUCK)*-> ON*1",
    ])


@pytest.mark.parametrize("selection", [[], ["--deselect", "test_lamp_more.py::test_nothing"],
                                       ["-k", "not test_nothing"]])
def test_the_plugin_fails_a_run_that_missed_a_transition(
    lamp_project: pytest.Pytester, selection: list[str]
) -> None:
    """Whatever the run selected: a --deselect once passed with the table saying FAILED."""
    lamp_project.makepyfile(test_lamp_more="def test_nothing():\n    pass\n")
    result = lamp_project.runpytest("--kvfsm-coverage-fail", "--kvfsm-machine", "lamp:LAMP",
                                    *selection)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*FAILED: 1 declared transition(s) never taken*"])


def test_a_collect_only_run_is_not_failed_for_the_transitions_it_never_ran(
    lamp_project: pytest.Pytester,
) -> None:
    """--collect-only runs no test, so it takes no transition: listing the tests is no failure
    (a CI step that lists them first would fail)."""
    result = lamp_project.runpytest("--collect-only", "--kvfsm-coverage-fail",
                                    "--kvfsm-machine", "lamp:LAMP")
    assert result.ret == pytest.ExitCode.OK


def test_two_machines_of_one_name_are_refused_and_one_never_compiled_is_said(
    lamp_project: pytest.Pytester,
) -> None:
    """The second of two machines named alike replaced the first without a word; a machine
    named but never compiled (imported under another module name, or made in another process)
    showed 0 taken, as if untested."""
    lamp_project.makepyfile(other_lamp=USER_MACHINE)
    result = lamp_project.runpytest("--kvfsm-machine", "lamp:LAMP",
                                    "--kvfsm-machine", "other_lamp:LAMP")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvfsm-machine: lamp:LAMP and other_lamp:LAMP are two "
                                 "machines named 'lamp'; give each a name of its own*"])
    result = lamp_project.runpytest("--kvfsm-machine", "other_lamp:LAMP")
    result.stdout.fnmatch_lines(["machine lamp: 0 of 4 transitions taken (0 %)",
                                 "*(never compiled in this run: a tier made in another process*"])
    # one machine named by two specs is one machine
    lamp_project.makepyfile(alias="from lamp import LAMP as SAME\n")
    result = lamp_project.runpytest("--kvfsm-machine", "lamp:LAMP", "--kvfsm-machine",
                                    "alias:SAME")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["machine lamp: 3 of 4 transitions taken (75 %)"])


def test_the_plugin_passes_a_run_that_took_every_transition(
    lamp_project: pytest.Pytester,
) -> None:
    lamp_project.makepyfile(test_stuck='''
from lamp import LAMP, Press, Record

def test_stuck_while_off():
    LAMP.compile().fire(Record(), "press", Press.STUCK)
''')
    result = lamp_project.runpytest("--kvfsm-coverage-fail", "--kvfsm-machine", "lamp:LAMP",
                                    "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["machine lamp: 4 of 4 transitions taken (100 %)"])


def test_a_machine_that_is_not_a_declaration_is_refused(lamp_project: pytest.Pytester) -> None:
    result = lamp_project.runpytest("--kvfsm-coverage", "--kvfsm-machine", "lamp:Record")
    assert result.ret != 0
    result.stderr.fnmatch_lines(
        ["*--kvfsm-machine: 'lamp:Record' is not a kvfsm Declaration (found type)*"])


# -- traces ---------------------------------------------------------------------------------

def test_every_transfer_keeps_its_trace_and_it_replays_clean(tmp_path: Path) -> None:
    agent = FakeNixlAgent()
    tier = ObjectStoreTier(torch.zeros(4, 16), agent=agent)
    path = tmp_path / "traces.jsonl"
    with TraceRecorder(path) as recorder:
        tier.on_published.append(recorder)
        agent.inject("release_xfer_handle", Raise())
        tier.submit_store(TransferJob(1, ["a"], [0]))
        tier.submit_load(TransferJob(2, ["missing"], [1], is_promotion=True))
        tier.drain_jobs(timeout=5)
    traces = list(read_traces(path))
    assert [t["job_id"] for t in traces] == [2, 1]
    steps = {t["job_id"]: [tuple(step[:4]) for step in t["steps"]] for t in traces}
    assert steps[1] == [
        ("post", "PROC", "SUBMITTED", "PROCESSING"),
        ("poll", "DONE", "PROCESSING", "DONE"),
        ("release", "RAISED", "DONE", "DONE"),
        ("release", "OK", "DONE", "XFER_RELEASED"),
        ("clean", "OK", "XFER_RELEASED", "CLEANED"),
        ("publish", "OK", "CLEANED", "PUBLISHED"),
    ]
    assert all(replay(TRANSFER_MACHINE, trace) is None for trace in traces)
    tier.shutdown()


def test_a_trace_that_departs_from_the_declaration_is_reported_at_its_first_divergence(
    tmp_path: Path,
) -> None:
    steps = [["post", "PROC", "SUBMITTED", "PROCESSING", 0.0],
             ["poll", "PROC", "PROCESSING", "PROCESSING", 0.1],
             ["poll", "RAISED", "PROCESSING", "DONE", 0.2],  # a raise never means DONE
             ["release", "OK", "DONE", "XFER_RELEASED", 0.3]]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"machine": "transfer", "job_id": 4, "success": True,
                                "steps": steps}) + "\n")
    (trace,) = read_traces(path)
    divergence = replay(TRANSFER_MACHINE, trace)
    assert divergence is not None
    assert (divergence.line, divergence.job_id, divergence.step) == (1, 4, 3)
    assert "PROCESSING -poll(RAISED)-> FAILED" in str(divergence)


SUCCESS_STEPS = [["post", "PROC", "SUBMITTED", "PROCESSING", 0.0],
                 ["poll", "DONE", "PROCESSING", "DONE", 0.1],
                 ["release", "OK", "DONE", "XFER_RELEASED", 0.2],
                 ["clean", "OK", "XFER_RELEASED", "CLEANED", 0.3],
                 ["publish", "OK", "CLEANED", "PUBLISHED", 0.4]]
FAILURE_STEPS = [["post", "RAISED", "SUBMITTED", "FAILED", 0.0],
                 ["release", "OK", "FAILED", "XFER_RELEASED", 0.1],
                 ["clean", "OK", "XFER_RELEASED", "CLEANED", 0.2],
                 ["publish", "OK", "CLEANED", "PUBLISHED", 0.3]]


@pytest.mark.parametrize(("steps", "success", "declared"), [
    (SUCCESS_STEPS[:2], True, "step 3: recorded the trace ends in DONE; the declaration: a "
                              "published transfer is in a final state: PUBLISHED, QUARANTINED"),
    ([], True, "step 1: recorded the trace ends in SUBMITTED"),
    (FAILURE_STEPS, True, "step 5: recorded success=true; the declaration: the steps went "
                          "through a failure state (CANCELLING, FAILED, QUARANTINED)"),
])
def test_a_trace_that_ends_short_or_says_another_outcome_than_its_steps_diverges(
    steps: list[list[Any]], success: bool, declared: str
) -> None:
    """Each step declared is not enough: a trace is written as its transfer is published, so
    it ends in a final state, and the outcome it records is the one its steps took (these all
    replayed clean once)."""
    trace = {"machine": "transfer", "job_id": 5, "line": 1, "success": success, "steps": steps}
    divergence = replay(TRANSFER_MACHINE, trace)
    assert divergence is not None and declared in str(divergence), divergence
    assert replay(TRANSFER_MACHINE, {**trace, "steps": SUCCESS_STEPS, "success": True}) is None
    assert replay(TRANSFER_MACHINE, {**trace, "steps": FAILURE_STEPS, "success": False}) is None
    # the outcome is the one the declared actions latch along the steps, whatever states
    # they pass (a failure through no state the declaration calls one, a user's REJECTED
    # say, latches it too): a failure along the steps that latch success diverges
    divergence = replay(TRANSFER_MACHINE, {**trace, "steps": SUCCESS_STEPS, "success": False})
    assert divergence is not None and str(divergence).endswith(
        "recorded success=false; the declaration: the declared actions of these steps latch "
        "success=true"), divergence
    reason = {"kind": "raised", "call": "post", "error": "nixlBackendError: NIXL_ERR_BACKEND"}
    divergence = replay(TRANSFER_MACHINE, {**trace, "steps": SUCCESS_STEPS, "success": True,
                                           "reason": reason})
    assert divergence is not None and str(divergence).endswith(
        "recorded success=true with a failure's reason; the declaration: a success carries no "
        "reason"), divergence


def test_a_trace_whose_reason_its_outcome_or_steps_do_not_allow_diverges() -> None:
    """A failure recorded with no reason, and a reason of kind cancelled on steps that took no
    cancel, replayed clean: every failure kvfsm publishes has its reason, and only a cancel
    gives one of that kind. A trace written before reasons were (no field for one) still
    replays."""
    trace = {"machine": "transfer", "job_id": 5, "line": 1, "success": False,
             "steps": FAILURE_STEPS}
    assert replay(TRANSFER_MACHINE, trace) is None, "no reason field: written before them"
    divergence = replay(TRANSFER_MACHINE, {**trace, "reason": None})
    assert divergence is not None and str(divergence).endswith(
        "recorded success=false with no reason; the declaration: a failure carries its "
        "reason"), divergence
    cancelled = {"kind": "cancelled", "call": None, "error": "cancelled"}
    divergence = replay(TRANSFER_MACHINE, {**trace, "reason": cancelled})
    assert divergence is not None and str(divergence).endswith(
        "recorded a reason of kind cancelled; the declaration: the steps took no cancel, so "
        "nothing cancelled the job"), divergence
    raised = {"kind": "raised", "call": "check_xfer_state", "error": "FakeNixlError: x"}
    assert replay(TRANSFER_MACHINE, {**trace, "reason": raised}) is None


def test_a_trace_naming_a_machine_that_does_not_exist_is_refused_by_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfsm.cli import main  # noqa: PLC0415

    path = tmp_path / "other.jsonl"
    good = {"machine": "transfer", "job_id": 1, "success": True, "steps": SUCCESS_STEPS}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "machine": "lamp"}) + "\n")
    assert main(["replay", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"kvfsm replay: ValueError: {path}:2: ")


def test_a_file_that_is_not_traces_is_refused_by_line(tmp_path: Path) -> None:
    path = tmp_path / "junk.jsonl"
    path.write_text('{"machine": "transfer", "job_id": 1, "success": true, "steps": []}\n'
                    'not json\n')
    with pytest.raises(ValueError, match=r"junk.jsonl:2: not a trace"):
        list(read_traces(path))
    path.write_text("[1, 2]\n")  # (was: "'list' object has no attribute 'get'")
    with pytest.raises(ValueError, match=r"junk.jsonl:1: not a trace \(a JSON list, not an "
                                         r"object\)"):
        list(read_traces(path))
    path.write_text('{"steps": [["post", "PROC", "SUBMITTED"]]}\n')  # (was: "not enough
    with pytest.raises(ValueError, match=r"junk.jsonl:1: not a trace \(step 1 is not \[event, "
                                         r"answer, from, to, seconds\]"):  # values to unpack")
        list(read_traces(path))
    path.write_bytes(b"\xff\xfe\x00binary\n")  # (was: a UnicodeDecodeError naming no file)
    with pytest.raises(ValueError, match=r"junk.jsonl:1: not a trace"):
        list(read_traces(path))


@pytest.mark.parametrize(("changes", "why"), [
    ({"job_id": "x"}, 'job_id must be an int, got "x"'),
    ({"job_id": True}, "job_id must be an int, got true"),
    ({"steps": "post PROC"}, 'steps must be a list of steps, got "post PROC"'),
    ({"steps": [["post", "PROC", "SUBMITTED", "PROCESSING", "soon"]]},
     "step 1 is not [event, answer, from, to, seconds]"),
    # (these three replayed clean: no time kvfsm's monotonic clock gives)
    ({"steps": [[*step[:4], seconds] for step, seconds in zip(
        SUCCESS_STEPS, (0.3, 0.2, 0.4, 0.5, 0.6), strict=True)]},
     "step 2 is at 0.2 s, earlier than step 1's 0.3 s: a trace's times are seconds since its "
     "first step, never decreasing"),
    ({"steps": [[*step[:4], -5.0] for step in SUCCESS_STEPS]},
     "step 1 is at -5.0 s, not a time since the first step"),
    ({"steps": [[*step[:4], float("nan")] for step in SUCCESS_STEPS]},
     "step 1 is at nan s, not a time since the first step"),
], ids=["a job id that is text", "a job id that is a bool", "steps that are text",
        "a step whose time is text", "times that go back", "a negative time", "a NaN time"])
def test_a_trace_with_a_field_of_the_wrong_kind_is_refused_naming_it(
        tmp_path: Path, changes: dict[str, object], why: str) -> None:
    """Each was read as a trace (steps given as text replayed as "no steps")."""
    path = tmp_path / "odd.jsonl"
    good = {"machine": "transfer", "job_id": 1, "success": True, "steps": SUCCESS_STEPS}
    path.write_text(json.dumps({**good, **changes}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"odd.jsonl:1: not a trace ({why}")):
        list(read_traces(path))


# -- the plugin's options: naming a machine asks for its coverage -----------------------------

def test_naming_a_machine_alone_prints_its_coverage(lamp_project: pytest.Pytester) -> None:
    """--kvfsm-machine implies --kvfsm-coverage; before, it silently did nothing."""
    result = lamp_project.runpytest("--kvfsm-machine", "lamp:LAMP")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*kvfsm transition coverage*",
                                 "machine lamp: 3 of 4 transitions taken (75 %)"])


def test_naming_a_machine_that_does_not_exist_alone_is_a_usage_error(
    lamp_project: pytest.Pytester,
) -> None:
    result = lamp_project.runpytest("--kvfsm-machine", "lamp:LAMPS")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--kvfsm-machine: 'lamp:LAMPS': lamp has no attribute 'LAMPS'"])


@pytest.mark.timeout(120)
def test_a_trace_of_a_users_lifecycle_replays_alike_whatever_the_hash_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tutorial's lifecycle answers ``verify`` with its own enum and with RAISED: the replay
    took one of the two enums at random (the hash seed's pick), so one run replayed clean and
    the next diverged. And its traces named kvfsm's transfer machine, which a replay without
    --machine then blamed; they now name the lifecycle's states, and the replay asks for it."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from examples.verify_lifecycle import STEPS, VERIFY_MACHINE  # noqa: PLC0415
    from kvfsm.cli import main  # noqa: PLC0415

    tier = ObjectStoreTier(torch.zeros(4, 16), agent=FakeNixlAgent(), machine=VERIFY_MACHINE,
                           steps=STEPS)
    path = tmp_path / "verify.jsonl"
    with TraceRecorder(path) as recorder:
        tier.on_published.append(recorder)
        tier.submit_store(TransferJob(1, ["a"], [0]))
        tier.drain_jobs(timeout=5)
    tier.shutdown()
    (trace,) = read_traces(path)
    assert trace["machine"] is None
    assert trace["states"] == "examples.verify_lifecycle.VerifyState"
    assert ["verify", "MATCH"] in [step[:2] for step in trace["steps"]]
    assert replay(VERIFY_MACHINE, trace) is None

    assert main(["replay", str(path)]) == 2
    assert ("the trace is of a lifecycle of its own (states examples.verify_lifecycle."
            "VerifyState), which it does not name: replay it with --machine module:ATTRIBUTE"
            in capsys.readouterr().err)
    root = Path(__file__).resolve().parent.parent
    for seed in ("0", "1", "2", "3"):
        replayed = subprocess.run(
            [sys.executable, "-m", "kvfsm", "replay", "--machine",
             "examples.verify_lifecycle:VERIFY_MACHINE", str(path)],
            cwd=root, env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True,
            text=True, timeout=60, check=False)
        assert replayed.returncode == 0, (seed, replayed.stdout, replayed.stderr)
        assert "1 trace (6 steps) replays clean" in replayed.stdout


def test_an_exploration_or_replay_that_found_a_violation_counts_no_transition_as_tested(
) -> None:
    """A test that explores a broken step on purpose (and asserts the violation) counted every
    transition its paths took as tested: with one such test in a suite, the coverage table of
    the machine read 21 of 33 taken, and ``--kvfsm-coverage-fail`` came near to passing. An
    exploration, or a replay, now counts only if it found no violation."""
    from examples.verify_lifecycle import VERIFY_MACHINE, Checksums  # noqa: PLC0415
    from kvfsm.testing.coverage import TransitionCoverage  # noqa: PLC0415
    from kvfsm.testing.explore import explore, parse_path  # noqa: PLC0415
    from kvfsm.testing.explore import replay as replay_path  # noqa: PLC0415

    coverage = TransitionCoverage({"verify": VERIFY_MACHINE})
    coverage.start()
    try:
        broken = explore(VERIFY_MACHINE, steps={"verify": Checksums},  # the class: it raises
                         max_faults=0)
        assert broken.counterexample is not None
        _, violations, _ = replay_path(broken.counterexample, VERIFY_MACHINE,
                                       steps={"verify": Checksums})
        assert violations
        assert sum(coverage.counts(VERIFY_MACHINE).values()) == 0
        assert explore(VERIFY_MACHINE, steps={"verify": Checksums()}, max_faults=0).ok
        counted = coverage.counts(VERIFY_MACHINE)
        assert sum(counted.values()) > 0
        _, violations, _ = replay_path(parse_path("mode=1"), VERIFY_MACHINE,
                                       steps={"verify": Checksums()})
        assert violations == []
        assert sum(coverage.counts(VERIFY_MACHINE).values()) > sum(counted.values())
    finally:
        coverage.stop()


def test_two_explorations_at_once_in_two_threads_each_count_their_own() -> None:
    """The first way of holding an exploration's coverage back swapped the process's
    listeners for its own and put them back at its end: two explorations overlapping in two
    threads counted half their transitions (33 of 66), and left a dead listener keeping every
    machine compiled afterwards. Each now marks what its own thread compiles."""
    import threading  # noqa: PLC0415

    from examples.verify_lifecycle import VERIFY_MACHINE, Verified  # noqa: PLC0415
    from kvfsm.engine import COMPILE_LISTENERS  # noqa: PLC0415
    from kvfsm.testing.coverage import TransitionCoverage  # noqa: PLC0415
    from kvfsm.testing.explore import explore  # noqa: PLC0415

    b_in, a_done = threading.Event(), threading.Event()

    class Step:  # (a lock: not copied, shared by a run's paths as given)
        def __init__(self, first: Any) -> None:
            self.lock, self.first, self.calls = threading.Lock(), first, 0

        def __call__(self, transfer: Any, primary: Any) -> Any:
            self.calls += 1
            if self.calls == 1:
                self.first()
            return Verified.MATCH

    coverage = TransitionCoverage({"verify": VERIFY_MACHINE})
    coverage.start()
    before = list(COMPILE_LISTENERS)
    try:
        alone = explore(VERIFY_MACHINE, steps={"verify": Step(lambda: None)}, max_faults=0)
        once = sum(coverage.counts(VERIFY_MACHINE).values())
        found: dict[str, Any] = {}

        def run(name: str, first: Any) -> None:
            found[name] = explore(VERIFY_MACHINE, steps={"verify": Step(first)}, max_faults=0)
            if name == "a":
                a_done.set()

        threads = [threading.Thread(target=run, args=("a", lambda: b_in.wait(60))),
                   threading.Thread(target=run, args=("b", lambda: (b_in.set(),
                                                                     a_done.wait(60))))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert found["a"].ok and found["b"].ok
        assert found["a"].taken == found["b"].taken == alone.taken
        assert sum(coverage.counts(VERIFY_MACHINE).values()) == 3 * once
        assert before == COMPILE_LISTENERS
    finally:
        coverage.stop()


def test_a_peer_exploration_that_found_a_violation_counts_no_transition_as_tested() -> None:
    """Exploring a broken receiver on purpose counted the peer machines' transitions its paths
    took (53 of the link's, 66 of the receive's) as tested."""
    from kvfsm.machines import kvfsm_machines  # noqa: PLC0415
    from kvfsm.testing.coverage import TransitionCoverage  # noqa: PLC0415
    from kvfsm.testing.explore_peer import BROKEN_RECEIVERS, explore_peer  # noqa: PLC0415

    machines = kvfsm_machines()
    coverage = TransitionCoverage(machines)
    coverage.start()
    try:
        broken = explore_peer(sorted(BROKEN_RECEIVERS)[0], max_faults=0)
        assert broken.counterexample is not None
        assert sum(sum(coverage.counts(machine).values()) for machine in machines.values()) == 0
        assert explore_peer(max_faults=0).counterexample is None
        assert sum(coverage.counts(machines["peer_link"]).values()) > 0
    finally:
        coverage.stop()


def test_a_trace_whose_reason_the_declaration_would_not_latch_diverges() -> None:
    """A checksum mismatch recorded with its reason, replayed against the same lifecycle whose
    mismatch edge no longer latches the failure: that declaration says nothing of why the job
    failed (its reason would be unknown), so the trace diverges where it replayed clean."""
    from examples.verify_lifecycle import VERIFY_MACHINE  # noqa: PLC0415

    trace = {"job_id": 3, "success": False, "reason": {
        "kind": "err", "call": "verify", "error": "answered MISMATCH", "error_type": None},
        "steps": [["post", "PROC", "SUBMITTED", "PROCESSING", 0.0],
                  ["poll", "DONE", "PROCESSING", "VERIFYING", 0.1],
                  ["verify", "MISMATCH", "VERIFYING", "FAILED", 0.2],
                  ["release", "OK", "FAILED", "XFER_RELEASED", 0.3],
                  ["clean", "OK", "XFER_RELEASED", "CLEANED", 0.3],
                  ["publish", "OK", "CLEANED", "PUBLISHED", 0.3]]}
    assert replay(VERIFY_MACHINE, trace) is None
    unlatched = VERIFY_MACHINE.extend("verify_unlatched", replace={
        ("VERIFYING", "verify", "unverified"): {"after": []}})
    diverged = replay(unlatched, trace)
    assert diverged is not None and diverged.step == 7
    assert str(diverged).endswith(
        "recorded a failure's reason of kind err; the declaration: the declared actions of "
        "these steps latch no outcome, so nothing says why the job failed (its reason: "
        "unknown)")
