"""The explorer finds no violation in the shipped lifecycle, and catches each broken variant."""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

import pytest

from kvfsm import TRANSFER_MACHINE, Declaration, FailureKind, FailureReason, TransferState
from kvfsm.driver import MachineRefused, check_runnable
from kvfsm.lifecycle import ACTIONS, ANSWERS, GUARDS, TRANSITIONS
from kvfsm.policy import RetryPolicy
from kvfsm.testing.explore import Invariant, explore, explore_table, parse_path, replay

S = TransferState


def variant(name: str, replace: dict[tuple[TransferState, str, str], dict[str, Any]],
            actions: dict[str, Any] | None = None,
            unreachable: tuple[TransferState, ...] = ()) -> Declaration[Any, Any]:
    """The shipped lifecycle with the edges keyed (source, trigger, guard) replaced; a variant
    whose replaced edges leave a state unentered names it in ``unreachable``."""
    transitions = []
    for transition in TRANSITIONS:
        key = (transition["source"], str(transition["trigger"]),
               transition.get("conditions", ""))
        transitions.append({**transition, **replace.pop(key)} if key in replace else transition)
    assert not replace, f"no such edges: {list(replace)}"
    return Declaration(name, states=TransferState, initial=S.SUBMITTED, answers=ANSWERS,
                       guards=GUARDS, actions={**ACTIONS, **(actions or {})},
                       transitions=transitions, final=TRANSFER_MACHINE.final,
                       failure_states=TRANSFER_MACHINE.failure_states,
                       effects=TRANSFER_MACHINE.effects, running=TRANSFER_MACHINE.running,
                       unreachable=unreachable)


def overwrite_outcome(success: bool) -> Any:
    def action(transfer: Any, answer: Any, detail: Any) -> None:
        transfer.success = success  # recomputed on every visit: the F3 bug
        if not success:  # (with a reason: the bug is the outcome, not a missing why)
            transfer.reason = FailureReason(FailureKind.ERR, "check_xfer_state", str(answer))

    return action


BROKEN = {
    "publish_before_release": (
        variant("publish_before_release", {
            (S.DONE, "release", "release_raised"): {"dest": S.CLEANED, "after": []}}),
        Invariant.RELEASE_BEFORE_PUBLISH),
    "drop_on_failed_release": (
        variant("drop_on_failed_release", {
            (S.DONE, "release", "release_raised"): {"dest": S.SUBMITTED, "after": []},
            (S.FAILED, "release", "release_raised"): {"dest": S.SUBMITTED, "after": []}}),
        Invariant.LIVENESS),
    "recompute_outcome_on_retry": (
        variant("recompute_outcome_on_retry", {
            (S.DONE, "release", "release_raised"): {"dest": S.PROCESSING, "after": []},
            (S.PROCESSING, "poll", "finished"): {"after": "set_success"},
            (S.PROCESSING, "poll", "errored"): {"after": "set_failure"}},
            actions={"set_success": overwrite_outcome(True),
                     "set_failure": overwrite_outcome(False)}),
        Invariant.OUTCOME),
    "deregister_before_release": (
        variant("deregister_before_release", {
            (S.DONE, "release", "release_raised"): {"dest": S.XFER_RELEASED, "after": []}}),
        Invariant.RELEASE_BEFORE_CLEANUP),
    "release_on_cancel": (
        variant("release_on_cancel", {
            (S.PROCESSING, "cancel", ""): {"dest": S.FAILED, "after": "latch_failure"}},
            unreachable=(S.CANCELLING,)),  # cancelling no longer waits for NIXL
        Invariant.RELEASE_WHEN_OVER),
    "clean_past_the_retry_bound": (
        variant("clean_past_the_retry_bound", {
            (S.DONE, "release", "exhausted"): {"dest": S.XFER_RELEASED, "after": []}}),
        Invariant.RELEASE_BEFORE_CLEANUP),
    "swallow_submit_error": (
        variant("swallow_submit_error", {
            (S.SUBMITTED, "post", "errored"): {"dest": S.SUBMITTED, "after": []}}),
        Invariant.LIVENESS),
    "fail_without_a_reason": (  # an error answered, and nothing latches the failure's why
        variant("fail_without_a_reason", {
            (S.PROCESSING, "poll", "errored"): {"after": []}}),
        Invariant.REASON),
    "release_what_it_gave_up_on": (  # past the running bound, a transfer NIXL still runs
        # is failed instead of quarantined: its handle is then released under NIXL
        variant("release_what_it_gave_up_on", {
            (S.PROCESSING, "poll", "exhausted"): {"dest": S.FAILED, "after": "latch_failure"}}),
        Invariant.RELEASE_WHEN_OVER),
    "skip_the_cleanup": (  # every released transfer leaves its descriptors registered
        variant("skip_the_cleanup", {
            (S.DONE, "release", "released"): {"dest": S.CLEANED},
            (S.FAILED, "release", "released"): {"dest": S.CLEANED}},
            unreachable=(S.XFER_RELEASED,)),
        Invariant.DESCRIPTOR_LEAK),
}
#: the variants that go wrong without a fault: their shortest counterexample is fault-free
FAULT_FREE = {"skip_the_cleanup"}
#: the variants a tier refuses before it runs them (kvfsm.driver.check_runnable), and why; the
#: explorer catches them as they run all the same, in a tier whose checks were bypassed
REFUSED = {
    "publish_before_release": "PUBLISHED, a final state that is no failure state, is reached "
                              "without a 'release'",
    "deregister_before_release": "PUBLISHED, a final state that is no failure state, is "
                                 "reached without a 'release'",
    "clean_past_the_retry_bound": "PUBLISHED, a final state that is no failure state, is "
                                  "reached without a 'release'",
    "drop_on_failed_release": "leads back to the initial state",
    "release_on_cancel": "PROCESSING -cancel(OK)-> FAILED leaves a running state on an answer "
                         "that does not say NIXL's transfer is over",
    "release_what_it_gave_up_on": "PROCESSING -poll(EXHAUSTED)-> FAILED leaves a running state",
    "skip_the_cleanup": "PUBLISHED, a final state, is reached after the release without a "
                        "'clean' (SUBMITTED -> DONE -> CLEANED -> PUBLISHED)",
    "recompute_outcome_on_retry": "PROCESSING -cancel(OK)-> CANCELLING runs latch_cancelled, "
                                  "but a transfer may come to PROCESSING with its outcome "
                                  "latched already (SUBMITTED -> DONE -> PROCESSING)",
}


@pytest.fixture
def unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiers that take what check_runnable refuses for the structure of its table alone (a
    way past the release into a final state, or one skipping the cleanup; an edge back into
    the initial state; a running state left before NIXL's end; a latch where an outcome may
    be latched already): the
    explorer's own checks are then what stands between them and a green run."""
    import kvfsm.driver  # noqa: PLC0415

    for check in ("_check_released_before_final", "_check_initial_left_for_good",
                  "_check_running_left_when_over", "_check_latched_once"):
        monkeypatch.setattr(kvfsm.driver, check, lambda *args: None)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_broken_variant_a_tier_can_tell_from_its_table_is_refused_before_it_runs(
    name: str,
) -> None:
    with pytest.raises(MachineRefused, match=re.escape(REFUSED[name])):
        check_runnable(BROKEN[name][0], {}, RetryPolicy())


def test_the_shipped_lifecycle_violates_nothing_on_any_path() -> None:
    found = explore(max_faults=2, stop_at_first=False)
    assert found.ok, found.report()
    assert found.paths > 1000
    assert "0 violations" in found.report()


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_broken_variant_is_caught_by_name(name: str, request: pytest.FixtureRequest
                                               ) -> None:
    if name in REFUSED:
        request.getfixturevalue("unchecked")
    machine, invariant = BROKEN[name]
    found = explore(machine, max_faults=2)
    assert not found.ok, f"{name} went unnoticed over {found.paths} paths"
    assert invariant in {v.invariant for v in found.violations}, found.report()
    assert found.counterexample is not None
    assert (len(found.counterexample.choices) == 0) == (name in FAULT_FREE), found.report()


@pytest.mark.usefixtures("unchecked")
def test_the_shortest_counterexample_replays_to_the_same_violation() -> None:
    machine, invariant = BROKEN["publish_before_release"]
    found = explore(machine)
    assert found.counterexample is not None
    printed = str(found.counterexample)
    assert printed == "mode=1;release_xfer_handle:raise@1"
    path = parse_path(printed)
    assert path == found.counterexample
    calls, violations, taken = replay(path, machine)
    assert invariant in {v.invariant for v in violations}
    assert taken["DONE -release[release_raised]-> CLEANED"] == 1
    assert calls.count("release_xfer_handle") >= 1


def test_a_bad_path_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="starts with mode=N"):
        parse_path("release_xfer_handle:raise@1")
    with pytest.raises(ValueError, match="names its call number"):
        parse_path("mode=1;release_xfer_handle:raise")
    for late in ("release_xfer_handle:late@1", "check_xfer_state:late@0",
                 "check_xfer_state:late", "check_xfer_state:late@1*2"):
        with pytest.raises(ValueError, match="late applies to check_xfer_state@N, N from 1"):
            parse_path(f"mode=1;{late}")
    with pytest.raises(ValueError, match=r"an interrupt is CALL:interrupt@N, N from 1"):
        parse_path("mode=1;verify:interrupt@0")
    # a mistyped kind names every kind a path takes (it named the demo's three only)
    with pytest.raises(ValueError, match=re.escape(
            "bad fault 'verify:intrupt@1': a path's fault is CALL:raise@N, CALL:err@N, "
            "CALL:proc=K@N, CALL:interrupt@N, check_xfer_state:late@N or round:cancel@N")):
        parse_path("mode=1;verify:intrupt@1")


def test_a_transfer_still_running_past_the_bound_is_given_up_and_its_handle_kept() -> None:
    """``late``: after the first state check the clock has passed ``max_running_seconds``, so
    the next poll gives up the transfer NIXL still runs. It is published as a failure that
    says so, its handle never released while NIXL runs it, and every path holds the
    invariants with it."""
    path = parse_path("mode=1;check_xfer_state:raise@2,check_xfer_state:late@1")
    assert str(path) == "mode=1;check_xfer_state:raise@2,check_xfer_state:late@1"
    for parent in (False, True):
        _, violations, taken = replay(path, parent=parent)
        assert violations == [], violations
        assert taken["PROCESSING -poll[exhausted]-> QUARANTINED"] >= 1
    found = explore(max_faults=1, stop_at_first=False)
    assert found.ok, found.report()


def test_a_transfer_given_up_before_its_own_bound_passed_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier that, once it gave one transfer up, gives up every transfer NIXL still runs,
    those submitted after the clock passed the bound too: a job published while NIXL may still
    write its blocks, before its bound. Only jobs submitted before a ``late`` check are past it."""
    from kvfsm.runner import Runner  # noqa: PLC0415

    overdue = Runner.overdue

    def gives_up_too_many(self: Runner) -> list[Any]:
        moved = overdue(self)
        if self.may_run:
            for transfer in list(self.records.values()):
                if transfer.state in self.running_states and transfer not in self.may_run:
                    self.give_up(transfer, "not past its bound")
        return moved

    monkeypatch.setattr(Runner, "overdue", gives_up_too_many)
    _, violations, _ = replay(parse_path("mode=1;check_xfer_state:late@2,"
                                         "check_xfer_state:proc=1@4"))
    assert [(v.invariant, v.job_id) for v in violations] == [(Invariant.RELEASE_BEFORE_PUBLISH, 2)]
    found = explore(max_faults=2)
    assert Invariant.RELEASE_BEFORE_PUBLISH in {v.invariant for v in found.violations}

@pytest.mark.parametrize("says", [False, True], ids=["never-in-use", "always-in-use"])
def test_a_result_that_says_its_blocks_are_in_use_wrongly_is_caught(
        monkeypatch: pytest.MonkeyPatch, says: bool) -> None:
    """A tier whose quarantined jobs never say their blocks are in use lets the parent reuse
    a block NIXL may still read or write (the job given up past its running bound); one whose
    jobs always say so holds blocks for good that NIXL is done with (a release that kept
    failing). Each is caught, with the parent and without."""
    from kvfsm.runner import Runner  # noqa: PLC0415

    monkeypatch.setattr(Runner, "_held_result", lambda self, transfer: dataclasses.replace(
        transfer.result(), blocks_in_use=says))
    for parent in (False, True):
        found = explore(parent=parent, max_faults=2)
        assert Invariant.BLOCKS_IN_USE in {v.invariant for v in found.violations}, found.report()
        what = "was done with its blocks" if says else "may still run its transfer"
        assert f"blocks_in_use={says} while NIXL {what}" in found.report()


def test_through_the_parent_every_pin_returns_to_zero_on_every_path() -> None:
    found = explore(parent=True, max_faults=2, stop_at_first=False)
    assert found.ok, found.report()
    assert found.paths > 1000


@pytest.mark.usefixtures("unchecked")
def test_a_dropped_transfer_leaves_its_block_pinned_and_the_explorer_says_so() -> None:
    machine, _ = BROKEN["drop_on_failed_release"]
    found = explore(machine, parent=True)
    assert {Invariant.PINS, Invariant.LIVENESS} <= {v.invariant for v in found.violations}
    assert "has count 1" in found.report()


#: a broken variant by name, for ``kvfsm explore --machine tests.test_explore:...``
PUBLISH_BEFORE_RELEASE = BROKEN["publish_before_release"][0]


class Step(enum.Enum):
    START = 1
    MIDDLE = 2
    END = 3


class Go(enum.Enum):
    OK = 1


def boom(record: Any, answer: Any, detail: Any) -> None:
    raise RuntimeError("boom")


def test_an_action_that_raises_is_named_and_its_edge_still_counts_for_reachability() -> None:
    """Table level: the raising action is named with its step, and the states past its edge
    are no dead ends (the edge was once left out of the graph, which made them look so)."""
    machine = Declaration(
        "boom", states=Step, initial=Step.START, answers={"go": list(Go)},
        guards={"ok": [Go.OK]}, actions={"boom": boom},
        transitions=[
            {"trigger": "go", "source": Step.START, "dest": Step.MIDDLE, "conditions": "ok",
             "after": "boom"},
            {"trigger": "go", "source": Step.MIDDLE, "dest": Step.END, "conditions": "ok"}],
        final={Step.END})
    found = explore_table(machine)
    assert [v.invariant for v in found.violations] == [Invariant.ACTION_RAISED]
    assert "action 'boom'" in found.violations[0].detail


def test_an_action_that_raises_in_a_tier_is_named_with_its_step() -> None:
    """Tier level: the NO_ESCAPE line carries the engine's note naming the action and the
    step, which only a traceback showed before."""
    machine = variant("latch_raises", {
        (S.PROCESSING, "poll", "finished"): {"after": "boom"}}, actions={"boom": boom})
    found = explore(machine, max_faults=0)
    escaped = [v for v in found.violations if v.invariant is Invariant.NO_ESCAPE]
    assert escaped, found.report()
    assert "action 'boom'" in escaped[0].detail and "PROCESSING" in escaped[0].detail


def test_a_step_answering_a_failure_alone_is_a_failure_with_its_reason() -> None:
    """A user's step may answer a failing answer without a why (a bare MISMATCH): its failure
    says what it answered, which is a reason; only a failure with nothing latched is not."""
    from examples.verify_lifecycle import VERIFY_MACHINE, Verified  # noqa: PLC0415

    found = explore(VERIFY_MACHINE, steps={"verify": lambda primary, transfer: Verified.MISMATCH},
                    max_faults=1)
    assert found.ok, found.report()


# -- steps of a user's own: which of their answers decide a job's outcome ----------------------

def _verify_machine(name: str, raised_dest: str, spent_dest: str) -> Declaration[Any, Any]:
    """The tutorial's checksum lifecycle, with a ``verify`` that raised retried in place
    (``count_retry``) and given up (EXHAUSTED) to ``spent_dest``."""
    from examples.verify_lifecycle import Verified  # noqa: PLC0415
    from kvfsm.lifecycle import Answer  # noqa: PLC0415

    after = "latch_success" if spent_dest == "DONE" else "latch_failure"
    return TRANSFER_MACHINE.extend(
        name, states=["VERIFYING"],
        replace={("SUBMITTED", "post", "finished"): {"dest": "VERIFYING", "after": []},
                 ("PROCESSING", "poll", "finished"): {"dest": "VERIFYING", "after": []}},
        answers={"verify": (Verified.MATCH, Verified.MISMATCH, Answer.RAISED,
                            Answer.EXHAUSTED)},
        guards={"matched": (Verified.MATCH,), "mismatch": (Verified.MISMATCH,),
                "raised": (Answer.RAISED,), "spent": (Answer.EXHAUSTED,)},
        transitions=[
            {"trigger": "verify", "source": "VERIFYING", "dest": "DONE",
             "conditions": "matched", "after": "latch_success"},
            {"trigger": "verify", "source": "VERIFYING", "dest": "FAILED",
             "conditions": "mismatch", "after": "latch_failure"},
            {"trigger": "verify", "source": "VERIFYING", "dest": raised_dest,
             "conditions": "raised", "after": "count_retry"},
            {"trigger": "verify", "source": "VERIFYING", "dest": spent_dest,
             "conditions": "spent", "after": after},
            {"trigger": "cancel", "source": "VERIFYING", "dest": "VERIFYING"}],
        effects={"VERIFYING": "verify"}, calls={"verify": "crc32"})


def test_a_step_retried_in_place_fails_its_job_only_when_given_up() -> None:
    """Any step that raised made the explorer expect its job to fail, so a lifecycle that
    retries a step in place (as the shipped one retries a release) was reported as a
    violation; now a retry is no verdict, and the give-up (EXHAUSTED) is."""
    from examples.verify_lifecycle import Checksums  # noqa: PLC0415

    retried = _verify_machine("verify_retried", "VERIFYING", "FAILED")
    assert explore(retried, steps={"verify": Checksums()}, max_faults=2).violations == []
    raises = parse_path("mode=1;" + ",".join(f"verify:raise@{n}" for n in range(1, 5)))
    _, violations, taken = replay(raises, retried, steps={"verify": Checksums()})
    assert violations == []
    assert taken["VERIFYING -verify[raised]-> VERIFYING"] == 3
    assert taken["VERIFYING -verify[spent]-> FAILED"] == 1, "one job's tries given up"
    # given up to DONE, latching success: the job the step never verified publishes success
    gives_up_to_done = _verify_machine("verify_spent_done", "VERIFYING", "DONE")
    _, violations, _ = replay(raises, gives_up_to_done, steps={"verify": Checksums()})
    assert [(v.invariant, v.job_id) for v in violations] == [(Invariant.OUTCOME, 0)]


def test_a_step_failing_out_of_a_state_named_a_failure_state_is_its_jobs_failure() -> None:
    """A user names a step's own state a failure state too (it only changes the drawing):
    the step's failing answers were then not counted as failing, since the drawing's rule
    skips the edges out of a failure state, and a MISMATCH that failed a load on the path
    with no fault injected was reported as a violation. An answer whose edge latches failure
    fails its job, wherever it starts."""
    from examples.verify_lifecycle import Checksums  # noqa: PLC0415

    declared = _verify_machine("verify_failure_state", "VERIFYING", "FAILED")
    named = TRANSFER_MACHINE.extend(
        "verifying_failure_state", states=["VERIFYING"],
        replace={("SUBMITTED", "post", "finished"): {"dest": "VERIFYING", "after": []},
                 ("PROCESSING", "poll", "finished"): {"dest": "VERIFYING", "after": []}},
        answers=dict(declared.answers), guards={
            name: accepted for name, accepted in declared.guards.items()
            if name in ("matched", "mismatch", "raised", "spent")},
        transitions=[{"trigger": e.event, "source": e.source, "dest": e.dest,
                      "conditions": e.conditions[0], "after": list(e.actions)}
                     for e in declared.edges if e.source == "VERIFYING" and e.conditions]
        + [{"trigger": "cancel", "source": "VERIFYING", "dest": "VERIFYING"}],
        effects={"VERIFYING": "verify"}, calls={"verify": "crc32"},
        failure_states=["VERIFYING"])
    path = parse_path("mode=1;check_xfer_state:proc=2@3")  # a load verified before its store
    _, violations, taken = replay(path, named, steps={"verify": Checksums()})
    assert taken["VERIFYING -verify[mismatch]-> FAILED"] == 1
    assert violations == []


def test_a_step_answer_into_a_failure_state_the_job_leaves_for_a_success_fails_nothing(
) -> None:
    """A first check that is unsure sends the job to a second (both states named failure
    states, to draw the suspicious path so), which matches: the job succeeds. An answer was
    taken as failing its job when its edge entered a state named a failure state, and the
    explorer reported the success as a violation; one into a failure state fails its job only
    when the job can take no step latching success from there."""
    from examples.verify_lifecycle import Verified  # noqa: PLC0415
    from kvfsm.lifecycle import Answer  # noqa: PLC0415

    match, mismatch, raised = Verified.MATCH, Verified.MISMATCH, Answer.RAISED
    recheck = TRANSFER_MACHINE.extend(
        "recheck", states=["VERIFYING", "RECHECKING"],
        replace={("SUBMITTED", "post", "finished"): {"dest": "VERIFYING", "after": []},
                 ("PROCESSING", "poll", "finished"): {"dest": "VERIFYING", "after": []}},
        answers={"verify": (match, mismatch, raised), "recheck": (match, mismatch, raised)},
        guards={"matched": (match,), "mismatch": (mismatch,), "raised": (raised,),
                "unverified": (mismatch, raised)},
        transitions=[
            {"trigger": "verify", "source": "VERIFYING", "dest": "DONE",
             "conditions": "matched", "after": "latch_success"},
            {"trigger": "verify", "source": "VERIFYING", "dest": "RECHECKING",
             "conditions": "mismatch"},
            {"trigger": "verify", "source": "VERIFYING", "dest": "FAILED",
             "conditions": "raised", "after": "latch_failure"},
            {"trigger": "recheck", "source": "RECHECKING", "dest": "DONE",
             "conditions": "matched", "after": "latch_success"},
            {"trigger": "recheck", "source": "RECHECKING", "dest": "FAILED",
             "conditions": "unverified", "after": "latch_failure"},
            {"trigger": "cancel", "source": "VERIFYING", "dest": "VERIFYING"},
            {"trigger": "cancel", "source": "RECHECKING", "dest": "RECHECKING"}],
        effects={"VERIFYING": "verify", "RECHECKING": "recheck"},
        calls={"verify": "crc32", "recheck": "crc32"}, failure_states=["RECHECKING"])
    steps = {"verify": lambda transfer, primary: mismatch,
             "recheck": lambda transfer, primary: match}
    _, violations, taken = replay(parse_path("mode=1"), recheck, steps=steps)
    assert taken["RECHECKING -recheck[matched]-> DONE"] == 3
    assert violations == []
    assert explore(recheck, steps=steps, max_faults=1).ok


def _verify_then(name: str, failed: dict[str, Any], more: list[dict[str, Any]] | None = None,
                 **options: Any) -> Declaration[Any, Any]:
    """The tutorial's checksum lifecycle with its failing answers' edge ``failed`` (its dest
    and actions), and ``more`` transitions."""
    from examples.verify_lifecycle import Verified  # noqa: PLC0415
    from kvfsm.lifecycle import Answer  # noqa: PLC0415

    return TRANSFER_MACHINE.extend(
        name, replace={("SUBMITTED", "post", "finished"): {"dest": "VERIFYING", "after": []},
                       ("PROCESSING", "poll", "finished"): {"dest": "VERIFYING", "after": []}},
        answers={"verify": (Verified.MATCH, Verified.MISMATCH, Answer.RAISED)},
        guards={"matched": (Verified.MATCH,), "unverified": (Verified.MISMATCH, Answer.RAISED)},
        transitions=[
            {"trigger": "verify", "source": "VERIFYING", "dest": "DONE",
             "conditions": "matched", "after": "latch_success"},
            {"trigger": "verify", "source": "VERIFYING", "conditions": "unverified", **failed},
            {"trigger": "cancel", "source": "VERIFYING", "dest": "VERIFYING"}, *(more or [])],
        effects={"VERIFYING": "verify", **options.pop("effects", {})},
        calls={"verify": "crc32"}, **options)


def _release_out_of(state: str, *released: str) -> list[dict[str, Any]]:
    """The release out of ``state`` (a state an answer leads to), as DONE's: ``released``
    the actions of its OK edge; and a cancel there, a stay."""
    return [
        {"trigger": "release", "source": state, "dest": "XFER_RELEASED",
         "conditions": "released", "after": list(released)},
        {"trigger": "release", "source": state, "dest": state,
         "conditions": "release_raised", "after": "count_retry"},
        {"trigger": "release", "source": state, "dest": "QUARANTINED",
         "conditions": "exhausted", "after": "quarantine"},
        {"trigger": "cancel", "source": state, "dest": state}]


def test_a_failure_latched_by_an_action_a_bare_record_cannot_run_or_on_the_next_edge_counts(
) -> None:
    """The step answers MISMATCH on every path with no fault: each job must fail, and does.
    Judged by running the edge's actions on a bare record, the failure was missed (and the
    job's failure reported as a violation) when an action after the latch needed what a bare
    record lacks (a job id), and when the next edge, the release out of a failure state the
    answer led to, latched it."""
    from examples.verify_lifecycle import Verified  # noqa: PLC0415

    def log_mismatch(transfer: Any, answer: Any, detail: Any) -> None:
        assert transfer.job_id >= 0  # (a transfer has one; a bare record has none)

    logged = _verify_then("verify_logged", {"dest": "FAILED",
                                            "after": ["latch_failure", "log_mismatch"]},
                          states=["VERIFYING"], actions={"log_mismatch": log_mismatch})
    deferred = _verify_then(
        "verify_deferred", {"dest": "REJECTED"}, _release_out_of("REJECTED", "latch_failure"),
        states=["VERIFYING", "REJECTED"], effects={"REJECTED": "release"},
        failure_states=["REJECTED"])
    steps = {"verify": lambda transfer, primary: Verified.MISMATCH}
    for machine in (logged, deferred):
        _, violations, taken = replay(parse_path("mode=1"), machine, steps=steps)
        assert violations == [], machine.name
        # (jobs 0 and 1 verified, and failed; job 2's load of job 0's key then failed at
        # open: the tier forgot the key its failed store held)
        assert sum(count for edge, count in taken.items()
                   if edge.startswith("VERIFYING -verify[unverified]")) == 2, taken
        assert explore(machine, steps=steps, max_faults=1).ok, machine.name


def test_a_step_answer_is_judged_by_what_kvfsms_actions_on_its_edge_latch() -> None:
    """An answer whose own edge latches success into a state named a failure state (to draw
    it red) succeeds, and one running kvfsm's latch_failure under a name of the machine's
    own, into a state no failure state, fails: each was reported as a violation by a rule
    reading where the edge goes, or an action's name."""
    from examples.verify_lifecycle import Verified  # noqa: PLC0415
    from kvfsm.machines.transfer import latch_failure  # noqa: PLC0415

    release_out_of = _release_out_of("DEGRADED")
    degraded = _verify_then("verify_degraded", {"dest": "DEGRADED", "after": "latch_success"},
                            release_out_of, states=["VERIFYING", "DEGRADED"],
                            effects={"DEGRADED": "release"}, failure_states=["DEGRADED"])
    renamed = _verify_then("verify_renamed", {"dest": "DEGRADED", "after": "fail_check"},
                           release_out_of, states=["VERIFYING", "DEGRADED"],
                           effects={"DEGRADED": "release"},
                           actions={"fail_check": latch_failure})
    steps = {"verify": lambda transfer, primary: Verified.MISMATCH}
    for machine in (degraded, renamed):
        _, violations, taken = replay(parse_path("mode=1"), machine, steps=steps)
        assert violations == [], machine.name
        assert taken["VERIFYING -verify[unverified]-> DEGRADED"] >= 2, taken
        # (no fault: a raise of the step takes the same edge, and a raise latching success
        # is one the explorer reports, as a raise is taken to fail its job)
        assert explore(machine, steps=steps, max_faults=0).ok, machine.name


def test_a_cancel_failing_a_job_whose_outcome_a_step_decides_is_the_lifecycles_choice(
) -> None:
    """A lifecycle whose cancel fails a job in the state of a step that decides its outcome
    once NIXL finished (nothing latched yet): the declared cancel edge says what a cancel
    means there, and the explorer reads it. A cancel keeps an outcome latched, and none is.
    (The explorer said OUTCOME, that the job must publish success, on a path where the check
    never answered, while the tier ran the lifecycle as declared.)"""
    from examples.verify_lifecycle import Checksums  # noqa: PLC0415

    declared = _verify_machine("verify_cancel", "VERIFYING", "FAILED")
    fails = TRANSFER_MACHINE.extend(
        "verify_cancel_fails", states=["VERIFYING"],
        replace={("SUBMITTED", "post", "finished"): {"dest": "VERIFYING", "after": []},
                 ("PROCESSING", "poll", "finished"): {"dest": "VERIFYING", "after": []}},
        answers=dict(declared.answers), guards=dict(declared.guards),
        transitions=[{"trigger": e.event, "source": e.source, "dest": e.dest,
                      "conditions": e.conditions[0], "after": list(e.actions)}
                     for e in declared.edges if e.source == "VERIFYING" and e.conditions]
        + [{"trigger": "cancel", "source": "VERIFYING", "dest": "FAILED",
            "after": "latch_cancelled"}],
        effects={"VERIFYING": "verify"}, calls={"verify": "crc32"})
    check_runnable(fails, {"verify": Checksums()}, RetryPolicy())  # a tier runs it
    # a Ctrl-C cuts the first verify short: job 1, NIXL's transfer over, is cancelled there
    _, violations, _ = replay(parse_path("mode=1;verify:interrupt@1"), fails,
                              steps={"verify": Checksums()})
    assert violations == []
    found = explore(fails, steps={"verify": Checksums()})
    assert found.ok, found.report()


def test_a_best_effort_step_after_the_outcome_is_latched_decides_nothing() -> None:
    """A notice sent after the cleanup, whose failure the lifecycle lets go by (as the shipped
    one lets a leaked cleanup go by), was reported as failing its job."""
    from kvfsm.lifecycle import Answer  # noqa: PLC0415

    notify = _notifying("notify", {"any_notify": (Answer.OK, Answer.RAISED)},
                        [{"dest": "CLEANED", "conditions": "any_notify"}])
    found = explore(notify, steps={"notify": lambda transfer, primary: Answer.OK},
                    max_faults=1)
    assert found.violations == []


def _notifying(name: str, guards: dict[str, Any], moves: list[dict[str, Any]],
               ) -> Declaration[Any, Any]:
    """The transfer lifecycle with a notice sent after the cleanup (``notify``, made in
    NOTIFYING), its answers those its ``guards`` take, each of ``moves`` an edge from it."""
    answers = tuple(dict.fromkeys(a for accepted in guards.values() for a in accepted))
    return TRANSFER_MACHINE.extend(
        name, states=["NOTIFYING"],
        replace={("XFER_RELEASED", "clean", "cleaned"): {"dest": "NOTIFYING"},
                 ("XFER_RELEASED", "clean", "leaked"): {"dest": "NOTIFYING"}},
        answers={"notify": answers}, guards=guards,
        transitions=[*({"trigger": "notify", "source": "NOTIFYING", **move} for move in moves),
                     {"trigger": "cancel", "source": "NOTIFYING", "dest": "NOTIFYING"}],
        effects={"NOTIFYING": "notify"}, calls={"notify": "send"})


def test_a_path_replays_as_it_ran_whatever_ran_before_it_with_the_same_steps() -> None:
    """Paths shared one step object: the checksums one path recorded were found by the
    next, so a printed path replayed otherwise than it had run (a load of a block whose
    store failed matched a checksum another path had recorded)."""
    from examples.verify_lifecycle import VERIFY_MACHINE, Checksums  # noqa: PLC0415

    steps = {"verify": Checksums()}
    path = parse_path("mode=1;verify:raise@1")
    first = replay(path, VERIFY_MACHINE, steps=steps)
    explore(VERIFY_MACHINE, steps=steps, max_faults=1)  # every other path, the same steps
    assert replay(path, VERIFY_MACHINE, steps=steps)[2] == first[2]
    assert replay(path, VERIFY_MACHINE, steps={"verify": Checksums()})[2] == first[2]
    assert steps["verify"].crcs == {}, "the steps given are left as they were"


def test_a_best_effort_step_given_up_after_the_outcome_is_latched_decides_nothing() -> None:
    """A notice after the cleanup that is retried and then given up (EXHAUSTED to CLEANED):
    its give-up was taken as failing a job whose outcome was latched long before."""
    from kvfsm.lifecycle import Answer  # noqa: PLC0415

    notify = _notifying(
        "notify_retried",
        {"sent": (Answer.OK,), "raised": (Answer.RAISED,), "spent": (Answer.EXHAUSTED,)},
        [{"dest": "CLEANED", "conditions": "sent"},
         {"dest": "NOTIFYING", "conditions": "raised", "after": "count_retry"},
         {"dest": "CLEANED", "conditions": "spent"}])
    found = explore(notify, steps={"notify": lambda transfer, primary: Answer.OK},
                    max_faults=2)
    assert found.violations == []


def test_steps_sharing_an_object_share_its_copy_and_the_steps_given_are_not_called() -> None:
    """Each step was copied on its own: two methods of one object got an object each, and
    what one kept the other never saw."""
    from kvfsm.testing.explore import _fresh  # noqa: PLC0415

    class Book:
        def __init__(self) -> None:
            self.kept: list[int] = []

        def stamp(self, transfer: Any, primary: Any) -> None:
            self.kept.append(transfer)

        def verify(self, transfer: Any, primary: Any) -> bool:
            return transfer in self.kept

    book = Book()
    copied = _fresh({"stamp": book.stamp, "verify": book.verify})
    copied["stamp"](1, None)
    assert copied["verify"](1, None) is True, "one object behind both copies"
    assert book.kept == [], "the object given is left as it was"


class Stuck(enum.Enum):
    START = 1
    END = 2
    STUCK = 3


class Maybe(enum.Enum):
    OK = 1
    NO = 2


def test_a_state_from_which_no_final_state_can_be_reached_is_a_dead_end() -> None:
    """An answer that leads to a state whose every edge comes back to it: a job there never
    ends. The table explorer names the state (liveness, before any tier runs it)."""
    machine = Declaration(
        "stuck", states=Stuck, initial=Stuck.START, answers={"go": list(Maybe)},
        guards={"ok": [Maybe.OK], "no": [Maybe.NO]}, actions={},
        transitions=[
            {"trigger": "go", "source": Stuck.START, "dest": Stuck.END, "conditions": "ok"},
            {"trigger": "go", "source": Stuck.START, "dest": Stuck.STUCK, "conditions": "no"},
            {"trigger": "go", "source": Stuck.STUCK, "dest": Stuck.STUCK}],
        final={Stuck.END})
    found = explore_table(machine)
    assert [(v.invariant, v.detail) for v in found.violations] == [
        (Invariant.DEAD_END, "from STUCK no final state can be reached")]


def test_the_explorer_catches_a_driver_that_releases_a_handle_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No declared lifecycle can release a handle twice (the driver lets go of it once NIXL
    released it); a driver that did would crash real NIXL. The explorer's agent says so on
    the first path, by name, and as the misuse the fake agent flags."""
    from kvfsm.driver import TransferDriver  # noqa: PLC0415
    from kvfsm.lifecycle import Answer  # noqa: PLC0415

    releasing = TransferDriver.release

    def twice(self: TransferDriver, transfer: Any) -> Any:
        handle = transfer.xfer
        outcome = releasing(self, transfer)
        if handle is not None and outcome.answer is Answer.OK:
            self.agent.release_xfer_handle(handle)  # the broken driver's second release
        return outcome

    monkeypatch.setattr(TransferDriver, "release", twice)
    found = explore(max_faults=0)
    caught = {violation.invariant for violation in found.violations}
    assert {Invariant.RELEASE_ONCE, Invariant.NO_MISUSE} <= caught, found.report()


def test_the_explorer_catches_a_tier_that_counts_a_released_transfer_as_quarantined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tier that took a job ending in a final failure state for a quarantine after its
    handle was released kept the primary cache's registration at shutdown, and the explorer
    believed its count. It now counts the jobs it saw published still holding a handle."""
    from kvfsm.runner import Runner  # noqa: PLC0415

    from .test_own_lifecycles import LATE_CHECK, Checked, always  # noqa: PLC0415

    settle = Runner._settle_failed

    def held_always(transfer: Any) -> bool:
        settle(transfer)
        return True

    monkeypatch.setattr(Runner, "_settle_failed", staticmethod(held_always))
    found = explore(LATE_CHECK, steps={"check": always(Checked.MISMATCH)}, max_faults=0)
    assert any(v.invariant is Invariant.HANDLE_LEAK and "0 published still holding" in v.detail
               for v in found.violations), found.report()


# -- the path with no fault injected: what a step does there by itself -------------------------

def index_gone(transfer: Any, primary: Any) -> Any:
    """A ``verify`` step that raises on every call, fault or none: a broken step."""
    raise OSError("the checksum index is gone")


def mismatching(transfer: Any, primary: Any) -> Any:
    """A ``verify`` step that answers MISMATCH on every call: a test of the mismatch path."""
    from examples.verify_lifecycle import Verified  # noqa: PLC0415

    return Verified.MISMATCH


#: steps for ``kvfsm explore --machine examples.verify_lifecycle:VERIFY_MACHINE --steps ...``
BROKEN_STEPS = {"verify": index_gone}
MISMATCHING_STEPS = {"verify": mismatching}


def test_a_step_given_as_its_class_instead_of_an_instance_is_caught_on_the_first_path() -> None:
    """``steps={"verify": Checksums}`` (the class, not ``Checksums()``): every call of the
    step raised TypeError, so every job failed on every path, and the explorer reported
    2437 paths and 0 violations, as for the right steps. A step that raises by itself where
    no fault was injected is now a violation naming what it raised. (The load of a block
    whose store failed is refused by the tier, which forgot the block: its step never runs.)"""
    from examples.verify_lifecycle import VERIFY_MACHINE, Checksums, Verified  # noqa: PLC0415

    found = explore(VERIFY_MACHINE, steps={"verify": Checksums})
    assert not found.ok, found.report()
    assert found.counterexample == parse_path("mode=1;"), "the path with no fault injected"
    raised = [v for v in found.violations if v.invariant is Invariant.STEP_RAISED]
    assert [v.job_id for v in raised] == [0, 1], found.report()
    assert raised[0].detail == ("verify raised TypeError('Checksums.__init__() takes 1 "
                                "positional argument but 3 were given')"), found.report()
    assert ("on the path with no fault injected, NIXL ending each transfer at its first "
            "state check (mode=1), 2 of 2 jobs whose transfers NIXL "
            "finished failed: jobs 0, 1: verify raised TypeError: Checksums.__init__() "
            "takes 1 positional argument but 3 were given") in found.report()

    class StrictChecksums(Checksums):
        """Raises where Checksums answers MISMATCH: on a load of a block never recorded."""

        def __call__(self, transfer: Any, primary: Any) -> Any:
            answered = super().__call__(transfer, primary)
            if isinstance(answered, tuple) and answered[0] is Verified.MISMATCH:
                raise KeyError(answered[1])
            return answered

    assert explore(VERIFY_MACHINE, steps={"verify": StrictChecksums()}, max_faults=1).ok
    _, violations, taken = replay(parse_path("mode=1;verify:raise@1"), VERIFY_MACHINE,
                                  steps={"verify": StrictChecksums()})
    assert violations == []
    assert taken["VERIFYING -verify[unverified]-> FAILED"] == 1, \
        "the store's verify failed; the load of its block was refused, its verify never ran"
    assert taken["SUBMITTED -post[errored]-> FAILED"] == 1, "the load, refused at its post"


def test_a_step_raising_by_itself_is_a_violation_only_when_it_decides_the_outcome() -> None:
    """Every raise on the path with no fault injected was a violation, even one the lifecycle
    retries in place (a transient error: the job then succeeded). Now a raise retried is
    none; a step that raises until its tries are given up (EXHAUSTED) still is one."""
    from examples.verify_lifecycle import Checksums  # noqa: PLC0415

    class BusyOnce(Checksums):
        """Raises on each job's first verify (its index busy), then checks as Checksums."""

        def __init__(self) -> None:
            super().__init__()
            self.tried: set[int] = set()

        def __call__(self, transfer: Any, primary: Any) -> Any:
            if transfer.job_id not in self.tried:
                self.tried.add(transfer.job_id)
                raise TimeoutError("block index busy, try again")
            return super().__call__(transfer, primary)

    retried = _verify_machine("verify_retried", "VERIFYING", "FAILED")
    found = explore(retried, steps={"verify": BusyOnce()}, max_faults=1)
    assert found.ok, found.report()
    assert [[r.success for r in run.results] for run in found.fault_free] == 2 * [3 * [True]]

    found = explore(retried, steps={"verify": index_gone}, max_faults=0)
    raised = [v for v in found.violations if v.invariant is Invariant.STEP_RAISED]
    assert [v.job_id for v in raised] == [0, 1, 2], found.report()
    assert raised[0].detail == ("verify raised OSError('the checksum index is gone') (and 1 "
                                "more time(s))"), "the raise retried, and the one given up"


def test_a_best_effort_step_raising_by_itself_after_the_outcome_is_latched_is_no_violation(
        ) -> None:
    """A notice after the cleanup whose endpoint is down raises on every call, and the
    lifecycle lets it go (RAISED to CLEANED): every job succeeds as NIXL said, yet each raise
    was reported as the step's fault, with the parent or without."""
    from kvfsm.lifecycle import Answer  # noqa: PLC0415

    def endpoint_down(transfer: Any, primary: Any) -> Any:
        raise ConnectionRefusedError("notification endpoint down")

    notify = _notifying("notify", {"any_notify": (Answer.OK, Answer.RAISED)},
                        [{"dest": "CLEANED", "conditions": "any_notify"}])
    for parent in (False, True):
        found = explore(notify, steps={"notify": endpoint_down}, max_faults=1, parent=parent)
        assert found.ok, found.report()
        assert [[r.success for r in run.results] for run in found.fault_free] == 2 * [3 * [True]]


def test_a_step_failing_its_jobs_on_purpose_is_no_violation_and_the_report_says_so() -> None:
    """A step that answers MISMATCH on every call tests the mismatch path: no violation. But
    no path then has a job succeed, and the report says so, with what the step answered."""
    from examples.verify_lifecycle import VERIFY_MACHINE, Checksums  # noqa: PLC0415

    found = explore(VERIFY_MACHINE, steps=MISMATCHING_STEPS, max_faults=1)
    assert found.ok, found.report()
    assert [(run.path, [r.job_id for r in run.failed], len(run.results))
            for run in found.fault_free] == [(parse_path("mode=1;"), [0, 1], 2),
                                             (parse_path("mode=0;"), [0, 1], 2)]
    assert ("on the path with no fault injected, NIXL ending each transfer at its first "
            "state check (mode=1), 2 of 2 jobs whose transfers NIXL "
            "finished failed: jobs 0, 1: verify answered MISMATCH") in found.report()
    assert ("on the path with no fault injected, NIXL ending each transfer as it is posted "
            "(mode=0), 2 of 2 jobs") in found.report()
    right = explore(VERIFY_MACHINE, steps={"verify": Checksums()}, max_faults=0)
    assert [run.failed for run in right.fault_free] == [(), ()], right.report()
    assert "no fault injected" not in right.report()


def test_a_step_answering_what_its_event_does_not_carry_is_named_as_the_steps_fault() -> None:
    """The tier takes such an answer as RAISED; the explorer expected the job to succeed, and
    reported an OUTCOME violation of the lifecycle, naming neither the step nor its answer.
    It now says what the tier said (the driver's words), which the job's reason says too."""
    from examples.verify_lifecycle import VERIFY_MACHINE  # noqa: PLC0415

    found = explore(VERIFY_MACHINE, steps={"verify": lambda transfer, primary: "MATCH"},
                    max_faults=0)
    assert {v.invariant for v in found.violations} == {Invariant.STEP_ANSWER}, found.report()
    assert found.violations[0].detail == (
        "step 'verify' answered str 'MATCH', which is not one of its event's answers "
        "(Verified.MATCH, Verified.MISMATCH); answer the member Verified.MATCH, not its name")
    assert [str(r.reason) for r in found.fault_free[0].failed] == 2 * [
        "verify answered str 'MATCH', which is not one of its event's answers "
        "(Verified.MATCH, Verified.MISMATCH); answer the member Verified.MATCH, not its name"]


@pytest.mark.parametrize("returns", ["a list", "a tuple of three", "RAISED"])
def test_whatever_the_tier_refuses_of_what_a_step_returned_is_a_step_answer(returns: str,
                                                                           ) -> None:
    """The explorer checked a step's answer with a copy of the tier's check, and judged
    otherwise than the tier: a list made its own check raise TypeError (unhashable) inside
    the step, so the job failed by the explorer's error, reported as OUTCOME; of a tuple of
    three it took the first item as the answer; of RAISED returned it listed RAISED among
    the answers. Now it asks the tier's own check, and says what the tier says."""
    from examples.verify_lifecycle import VERIFY_MACHINE, Verified  # noqa: PLC0415
    from kvfsm.lifecycle import Answer  # noqa: PLC0415

    answered = {"a list": [Verified.MATCH], "a tuple of three": (Verified.MATCH, "ok", 1),
                "RAISED": Answer.RAISED}[returns]
    found = explore(VERIFY_MACHINE, steps={"verify": lambda transfer, primary: answered},
                    max_faults=0)
    assert {(v.invariant, v.job_id) for v in found.violations} == {
        (Invariant.STEP_ANSWER, job) for job in (0, 1)}, found.report()
    said = found.violations[0].detail
    assert said.startswith("step 'verify' "), said
    assert {str(r.reason) for r in found.fault_free[0].failed} == {
        "verify " + said.removeprefix("step 'verify' ")}, "the tier's words, the job's reason"


#: a lifecycle that fails a job NIXL finished, for ``kvfsm explore --machine ...``
FAIL_WHEN_DONE = variant("fail_when_done", {
    (S.PROCESSING, "poll", "finished"): {"dest": S.FAILED, "after": "latch_failure"}})


def test_a_violation_about_a_failure_a_job_published_shows_the_jobs_reason(
        capsys: pytest.CaptureFixture[str]) -> None:
    """OUTCOME said the job published success=False where NIXL said DONE, and never what the
    job gave as its reason, which says why it failed."""
    from kvfsm.cli import main  # noqa: PLC0415

    found = explore(FAIL_WHEN_DONE, max_faults=0)
    outcome = found.violations[0]
    assert (outcome.invariant, outcome.reason) == (Invariant.OUTCOME, "failed: DONE")
    assert str(outcome).endswith("it published success=False (its reason: failed: DONE)")
    assert str(outcome) in found.report()
    options = ["--machine", "tests.test_explore:FAIL_WHEN_DONE"]
    assert main(["explore", *options, "--max-faults", "0"]) == 1
    assert "it published success=False (its reason: failed: DONE)" in capsys.readouterr().out
    assert main(["explore", *options, "--replay", "mode=1;"]) == 1
    assert "it published success=False (its reason: failed: DONE)" in capsys.readouterr().out


def test_kvfsm_explore_fails_on_a_step_that_always_raises_and_reports_one_failing_on_purpose(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvfsm.cli import main  # noqa: PLC0415

    machine = ["--machine", "examples.verify_lifecycle:VERIFY_MACHINE", "--max-faults", "1"]
    assert main(["explore", *machine, "--steps", "tests.test_explore:BROKEN_STEPS"]) == 1
    out = capsys.readouterr().out
    assert ("STEP_RAISED (job 0): a step of the machine's own raised by itself on the path with "
            "no fault injected (a step broken, or given wrongly): verify raised "
            "OSError('the checksum index is gone')") in out, out
    assert "--replay 'mode=1;'" in out
    assert main(["explore", *machine, "--steps", "tests.test_explore:MISMATCHING_STEPS"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"explored \d+ paths \(\d+ NIXL calls\) in [\d.]+ s: 0 violations\n"
                     r"on the path with no fault injected, NIXL ending each transfer at its "
                     r"first state check \(mode=1\), 2 of 2 jobs whose "
                     r"transfers NIXL finished failed: jobs 0, 1: verify answered MISMATCH\n",
                     out), out


def test_the_report_names_the_transitions_no_path_took_and_cancels_reach_every_round(
) -> None:
    """Every unpublished job is cancelled before one poll round or another, so a job is
    cancelled in CANCELLING too (that edge was never taken: the one cancel of the scenario
    came before the load's submit); what no path takes is named in the report, so a reader
    knows what the invariants were never put to (XFER_RELEASED and CLEANED are passed within
    a poll: only a Ctrl-C in a cleanup call leaves a job in XFER_RELEASED for a cancel to find,
    and no NIXL call comes between CLEANED and its publish)."""
    found = explore(max_faults=2, stop_at_first=False)
    assert found.ok, found.report()
    taken = {(edge.source, str(edge.event), answer): count
             for (edge, answer), count in found.taken.items()}
    assert taken[("CANCELLING", "cancel", "OK")] > 0
    assert taken[("PROCESSING", "cancel", "OK")] > 0
    assert taken[("XFER_RELEASED", "cancel", "OK")] > 0
    untaken = {(edge.source, str(edge.event)) for edge, _ in found.untaken}
    assert ("CLEANED", "cancel") in untaken
    assert len(found.taken) == 29 and len(untaken) < 4
    assert (f"{len(found.untaken)} of 29 declared transitions no path took (nothing was "
            "checked of them): ") in found.report()
    assert "CLEANED -cancel(OK)-> CLEANED" in found.report()
    assert str(parse_path("mode=1;round:cancel@2")) == "mode=1;round:cancel@2"
    with pytest.raises(ValueError, match="a round is cancelled as round:cancel@N, N from 1"):
        parse_path("mode=1;round:raise@2")


def test_a_step_answering_otherwise_from_run_to_run_stops_the_exploration_saying_so() -> None:
    """A step whose answers come from one counter shared by every path (a lambda over it:
    the explorer cannot copy it per path) answers "not yet" on one run of a path and "match"
    on the next: the fault the explorer meant for a call lands elsewhere. It stops, naming
    the path and where the runs parted. (It crashed: "inject: register_memory calls #4-#4
    already have Raise(...) armed".)"""
    import itertools  # noqa: PLC0415

    from kvfsm.testing.explore import NotRepeatable  # noqa: PLC0415

    from .test_own_lifecycles import CHECK_UNTIL_GIVEN_UP, Pending  # noqa: PLC0415

    answers = itertools.cycle([Pending.NOT_YET, Pending.MATCH, Pending.MATCH])
    with pytest.raises(NotRepeatable, match=r"path mode=\d;\S+: run again, it made \w+ as call "
                                            r"\d+, where the run it came from made \w+"):
        explore(CHECK_UNTIL_GIVEN_UP, steps={"check": lambda transfer, primary: next(answers)})


def test_a_cancel_that_latches_again_in_a_steps_state_is_caught_once_a_ctrl_c_leaves_a_job_there(
    request: pytest.FixtureRequest,
) -> None:
    """The tutorial's checksum lifecycle, broken: a cancel in VERIFYING latches a failure
    (its outcome latched already by then, or the step's match latching success after it).
    A job waits in VERIFYING only when a Ctrl-C cut its step short; the explorer now makes
    one at each step call, and the scenario's cancel finds the job there: the next match
    raises out of the tier. (2195 paths said 0 violations: no path took that edge.) A tier
    refuses it before it runs, now, from its table: the explorer catches it all the same, in
    a tier whose checks were bypassed."""
    from examples.verify_lifecycle import VERIFY_MACHINE, Checksums  # noqa: PLC0415
    from kvfsm.testing.explore import Interrupt  # noqa: PLC0415

    broken = VERIFY_MACHINE.extend("cancel_latches_in_verifying", replace={
        ("VERIFYING", "cancel", ""): {"after": "latch_cancelled"}})
    with pytest.raises(MachineRefused, match=re.escape(
            "VERIFYING -cancel(OK)-> VERIFYING runs latch_cancelled, but a transfer may come to "
            "VERIFYING with its outcome latched already (SUBMITTED -> VERIFYING -> VERIFYING)")):
        check_runnable(broken, {"verify": Checksums()}, RetryPolicy())
    request.getfixturevalue("unchecked")
    found = explore(broken, steps={"verify": Checksums()})
    assert not found.ok
    assert found.counterexample is not None
    assert any(isinstance(choice.fault, Interrupt) for choice in found.counterexample.choices)
    assert Invariant.NO_ESCAPE in {v.invariant for v in found.violations}, found.report()
    assert "OutcomeAlreadyLatched" in found.report()
    assert str(parse_path("mode=1;verify:interrupt@2")) == "mode=1;verify:interrupt@2"
    with pytest.raises(ValueError, match="a Ctrl-C cuts short a NIXL call or a step of the "
                                         "machine's own"):
        replay(parse_path("mode=1;frobnicate:interrupt@1"))


@pytest.mark.parametrize("path", [
    # the shutdown's release of the primary cache's descriptor list (call 4: jobs' three
    # cleanups came first), then the shutdown made again: it left the list and the
    # registration held for good (the tier was closed already, so it did nothing more)
    "mode=1;release_dlist_handle:interrupt@4",
    # a cleanup whose descriptor list's release raised (a leak), cut short at the
    # deregistration: the leak was forgotten as the cleanup went on
    "mode=1;release_dlist_handle:raise@1,deregister_memory:interrupt@1",
])
def test_a_ctrl_c_in_a_nixl_call_loses_no_release_and_no_leak(path: str) -> None:
    """The explorer cuts NIXL's own calls short with a Ctrl-C too: two faults it found, each
    a descriptor list still held after the shutdown that no recorded leak accounted for."""
    assert replayed_with_its_ctrl_cs(path) == []


def replayed_with_its_ctrl_cs(text: str) -> list[Any]:
    """The violations of the path ``text``, once it is shown its Ctrl-Cs landed: its calls or
    its transitions are not those of the same path without them."""
    from kvfsm.testing.explore import Interrupt, Path  # noqa: PLC0415

    path = parse_path(text)
    calls, violations, taken = replay(path)
    without = Path(path.polls, tuple(choice for choice in path.choices
                                     if not isinstance(choice.fault, Interrupt)))
    unchanged, _, untouched = replay(without)
    assert (calls, taken) != (unchanged, untouched), f"{text}: no Ctrl-C landed"
    return violations


def test_an_answer_a_ctrl_c_kept_from_the_tier_is_not_expected_of_it() -> None:
    """A poll's state checks, cut short by a Ctrl-C at the third: NIXL said job 1's transfer
    is DONE at the second, but the tier never heard it (it asks again on its next poll), so
    the scenario's cancel is of a transfer running as far as the tier knows, and its failure
    is expected; and a post cut short before NIXL had it, then answered PROC by a stall past
    the running bound, is given up with its blocks said to be in use, as NIXL's answer says."""
    for path in ("mode=1;check_xfer_state:interrupt@3",
                 "mode=1;transfer:interrupt@1,check_xfer_state:late@1"):
        assert replayed_with_its_ctrl_cs(path) == [], path


def test_the_explorer_cuts_nixl_calls_short_too() -> None:
    """Each kind of NIXL call the scenario makes after the tier is built is cut short by a
    Ctrl-C (its first call after that, say), not the machine's own steps only, and the
    shipped lifecycle holds: every job one result, nothing leaked."""
    calls, _, _ = replay(parse_path("mode=1;"))
    made = [call for call in calls[2:] if call != "round"]
    assert set(made) == {"register_memory", "prep_xfer_dlist", "make_prepped_xfer", "transfer",
                         "check_xfer_state", "release_xfer_handle", "release_dlist_handle",
                         "deregister_memory"}
    for call in sorted(set(made)):
        path = f"mode=1;{call}:interrupt@{calls[:2].count(call) + 1}"
        assert replayed_with_its_ctrl_cs(path) == [], path


def test_a_job_cancelled_while_running_then_again_once_over_is_expected_to_fail() -> None:
    """Job 1 is cancelled while NIXL runs it (the scenario's cancel), NIXL then says DONE, and a
    cancel-all round cancels it again: it fails (cancelled while running), and the explorer
    expects so. (The second cancel made it expect success: a false OUTCOME violation on the
    shipped lifecycle, three faults deep.)"""
    _, violations, taken = replay(parse_path(
        "mode=1;transfer:proc=2@3,release_xfer_handle:raise@3,round:cancel@2"))
    assert violations == [], violations
    assert taken["PROCESSING -cancel[]-> CANCELLING"] == 1  # the first cancel, while it ran


def test_a_lifecycle_whose_give_up_waits_for_nixls_end_explores_clean() -> None:
    """The running bound gives a store up into CANCELLING, which waits for NIXL's end; an
    error then holds its handle for good. The explorer expects a failure of a job given up,
    whatever NIXL said after (it expected success of one NIXL then finished: a false
    OUTCOME violation on the first path with a late check), and the tier's result says its
    blocks are free once NIXL said it is over (it said they were in use: BLOCKS_IN_USE)."""
    machine = TRANSFER_MACHINE.extend("given_up_then_waited", replace={
        (S.PROCESSING, "poll", "exhausted"): {"dest": S.CANCELLING,
                                              "after": ["latch_cancelled"]},
        (S.CANCELLING, "poll", "errored"): {"dest": S.QUARANTINED, "after": ["quarantine"]}})
    found = explore(machine, stop_at_first=False)
    assert found.ok, found.report()

