"""Lifecycles of a user's own, run through kvfsm's tiers: what the tier does with the states,
steps and answers a user declares, and what it refuses before any NIXL call."""

from __future__ import annotations

import contextlib
import enum
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.verify_lifecycle import VERIFY_MACHINE, Checksums
from kvfsm import TRANSFER_MACHINE, Declaration, TransferJob
from kvfsm.driver import MachineRefused
from kvfsm.lifecycle import Answer
from kvfsm.machines.transfer import FailureKind, latch_failure
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent, Raise
from kvfsm.tiers import FileTier
from kvfsm.trace import TraceRecorder, read_traces, replay


class Checked(enum.Enum):
    MATCH = "MATCH"
    MISMATCH = "MISMATCH"


def reject(transfer: Any, answer: Any, detail: Any) -> None:
    """The user's own action: a block that does not check out fails its job."""
    transfer.success = False


#: a check made once the transfer is released and cleaned: a mismatch ends in REJECTED, a
#: final failure state of the user's own, with every NIXL handle already let go
LATE_CHECK = TRANSFER_MACHINE.extend(
    "late_check", states=["CHECKING", "REJECTED"],
    replace={("CLEANED", "publish", ""): {"dest": "CHECKING"}},
    answers={"check": (Checked.MATCH, Checked.MISMATCH, Answer.RAISED)},
    guards={"matched": (Checked.MATCH,), "unmatched": (Checked.MISMATCH, Answer.RAISED)},
    actions={"reject": reject},
    transitions=[
        {"trigger": "check", "source": "CHECKING", "dest": "PUBLISHED", "conditions": "matched"},
        {"trigger": "check", "source": "CHECKING", "dest": "REJECTED", "conditions": "unmatched",
         "after": "reject"},
        {"trigger": "cancel", "source": "CHECKING", "dest": "CHECKING"},
    ],
    effects={"CHECKING": "check"}, final=["REJECTED"], failure_states=["REJECTED"])


def file_tier(tmp_path: Path, machine: Declaration[Any, Any], steps: dict[str, Any],
              **options: Any) -> tuple[FileTier, FakeNixlAgent]:
    agent = FakeNixlAgent("own")
    primary = (torch.arange(8 * 64, dtype=torch.int32).view(8, 64) % 251).contiguous()
    return FileTier(primary, tmp_path, agent=agent, machine=machine, steps=steps,
                    durable=False, **options), agent


def finished(tier: FileTier) -> list[Any]:
    tier.drain_jobs(timeout=5)
    return sorted(tier.get_finished_jobs(), key=lambda result: result.job_id)


def test_a_final_failure_state_reached_after_the_release_fails_the_job_and_holds_nothing(
    tmp_path: Path,
) -> None:
    """A check after the cleanup rejects the block: the job fails in REJECTED, a final failure
    state, with every handle already released. It used to be taken for a quarantine (a final
    failure state was held by definition): counted quarantined, and the primary cache's
    registration was never released at shutdown, as if a transfer still held it."""
    tier, agent = file_tier(tmp_path, LATE_CHECK, {"check": lambda transfer, primary:
                                                     Checked.MISMATCH})
    tier.submit_store(TransferJob(1, ["a"], [0]))
    [result] = finished(tier)
    assert not result.success
    assert result.reason is not None and result.reason.kind is not FailureKind.QUARANTINED
    assert result.reason.error == "ended in REJECTED, a failure state", "says why"
    assert (agent.live_xfer_handles(), tier.stats()["quarantined"]) == (0, 0)
    tier.shutdown(timeout=2)
    assert (agent.live_registrations(), agent.live_dlist_handles()) == (0, 0), (
        "nothing holds the primary cache's registration: released at shutdown")
    assert agent.misuses == []


def test_a_job_quarantined_in_a_lifecycles_own_state_is_traced_as_the_failure_it_published(
    tmp_path: Path,
) -> None:
    """The verify lifecycle latches success, then the release keeps raising and is given up:
    the job is quarantined in the lifecycle's own QUARANTINED and published as a failure. Its
    trace said success=true (the recorder judged the state against the shipped machine's
    enum, which a lifecycle's own states never match), and kvfsm replay then refused a
    correct run."""
    tier, agent = file_tier(tmp_path, VERIFY_MACHINE, {"verify": Checksums()},
                            policy=RetryPolicy(max_attempts=1, max_seconds=None))
    traces = tmp_path / "traces.jsonl"
    with TraceRecorder(traces, machine="examples.verify_lifecycle:VERIFY_MACHINE") as recorder:
        tier.on_published.append(recorder)
        agent.inject("release_xfer_handle", Raise())
        tier.submit_store(TransferJob(1, ["a"], [0]))
        [result] = finished(tier)
    assert not result.success and result.reason is not None
    assert result.reason.kind is FailureKind.QUARANTINED
    [trace] = read_traces(traces)
    assert (trace["success"], trace["reason"]) == (False, result.reason.as_dict())
    assert replay(VERIFY_MACHINE, trace) is None
    tier.shutdown(timeout=1)
    assert tier.stats()["quarantined"] == 1, "its handle is held for good"


class Sent(enum.Enum):
    SENT = "SENT"


class Pending(enum.Enum):
    MATCH = "MATCH"
    NOT_YET = "NOT_YET"


class Waited(enum.Enum):
    WAITED = "WAITED"


#: a notice sent once the transfer is cleaned, before it is published
NOTIFY = TRANSFER_MACHINE.extend(
    "notify", states=["NOTIFYING"],
    replace={("CLEANED", "publish", ""): {"dest": "NOTIFYING"}},
    answers={"notify": (Sent.SENT, Answer.RAISED)},
    guards={"notified": (Sent.SENT, Answer.RAISED)},
    transitions=[
        {"trigger": "notify", "source": "NOTIFYING", "dest": "PUBLISHED",
         "conditions": "notified"},
        {"trigger": "cancel", "source": "NOTIFYING", "dest": "NOTIFYING"},
    ],
    effects={"NOTIFYING": "notify"})

def checked(name: str, mismatch_to: str, **more: Any) -> Any:
    """The transfer lifecycle with a check made as soon as NIXL finished, before the release:
    a match goes on to DONE (success latched), a mismatch to ``mismatch_to`` (failure
    latched)."""
    return TRANSFER_MACHINE.extend(
        name, states=["CHECKING", *more.pop("states", [])],
        replace={("PROCESSING", "poll", "finished"): {"dest": "CHECKING", "after": []},
                 ("SUBMITTED", "post", "finished"): {"dest": "CHECKING", "after": []}},
        answers={"check": (Checked.MATCH, Checked.MISMATCH, Answer.RAISED)},
        guards={"matched": (Checked.MATCH,), "unmatched": (Checked.MISMATCH, Answer.RAISED)},
        transitions=[
            {"trigger": "check", "source": "CHECKING", "dest": "DONE", "conditions": "matched",
             "after": "latch_success"},
            {"trigger": "check", "source": "CHECKING", "dest": mismatch_to,
             "conditions": "unmatched", "after": "latch_failure"},
            {"trigger": "cancel", "source": "CHECKING", "dest": "CHECKING"},
        ],
        effects={"CHECKING": "check"}, **more)


#: a check made as soon as NIXL finished, before the release, whose mismatch ends the job in
#: REJECTED: a final state, but no failure state
CHECK_THEN_PUBLISH = checked("check_then_publish", "REJECTED", states=["REJECTED"],
                             final=["REJECTED"])

#: a wait written as a circle of two states: not yet, wait, check again
CHECK_IN_A_CIRCLE = TRANSFER_MACHINE.extend(
    "check_in_a_circle", states=["CHECKING", "WAITING"],
    replace={("PROCESSING", "poll", "finished"): {"dest": "CHECKING", "after": []},
             ("SUBMITTED", "post", "finished"): {"dest": "CHECKING", "after": []}},
    answers={"check": (Pending.MATCH, Pending.NOT_YET, Answer.RAISED),
             "wait": (Waited.WAITED, Answer.RAISED)},
    guards={"matched": (Pending.MATCH,), "pending": (Pending.NOT_YET,),
            "raised": (Answer.RAISED,), "waited": (Waited.WAITED, Answer.RAISED)},
    transitions=[
        {"trigger": "check", "source": "CHECKING", "dest": "DONE", "conditions": "matched",
         "after": "latch_success"},
        {"trigger": "check", "source": "CHECKING", "dest": "WAITING", "conditions": "pending"},
        {"trigger": "check", "source": "CHECKING", "dest": "FAILED", "conditions": "raised",
         "after": "latch_failure"},
        {"trigger": "cancel", "source": "CHECKING", "dest": "CHECKING"},
        {"trigger": "wait", "source": "WAITING", "dest": "CHECKING", "conditions": "waited"},
        {"trigger": "cancel", "source": "WAITING", "dest": "WAITING"},
    ],
    effects={"CHECKING": "check", "WAITING": "wait"})

#: "not yet: ask NIXL again": a check whose "not yet" sends the transfer back to PROCESSING,
#: without a give-up
CHECK_AND_POLL_AGAIN = TRANSFER_MACHINE.extend(
    "check_and_poll_again", states=["CHECKING"],
    replace={("PROCESSING", "poll", "finished"): {"dest": "CHECKING", "after": []},
             ("SUBMITTED", "post", "finished"): {"dest": "CHECKING", "after": []}},
    answers={"check": (Pending.MATCH, Pending.NOT_YET, Answer.RAISED)},
    guards={"matched": (Pending.MATCH,), "pending": (Pending.NOT_YET,),
            "raised": (Answer.RAISED,)},
    transitions=[
        {"trigger": "check", "source": "CHECKING", "dest": "DONE", "conditions": "matched",
         "after": "latch_success"},
        {"trigger": "check", "source": "CHECKING", "dest": "PROCESSING", "conditions": "pending"},
        {"trigger": "check", "source": "CHECKING", "dest": "FAILED", "conditions": "raised",
         "after": "latch_failure"},
        {"trigger": "cancel", "source": "CHECKING", "dest": "CHECKING"},
    ],
    effects={"CHECKING": "check"})

#: a check made as soon as NIXL finished whose mismatch ends the job in CORRUPT, a final
#: failure state, before the release
CHECK_INTO_CORRUPT = checked("check_into_corrupt", "CORRUPT", states=["CORRUPT"],
                             final=["CORRUPT"], failure_states=["CORRUPT"])

#: "a cancel after NIXL's end quarantines the job": a finished store's handle held for good
CANCEL_INTO_QUARANTINE = TRANSFER_MACHINE.extend(
    "cancel_into_quarantine",
    replace={("DONE", "cancel", ""): {"dest": "QUARANTINED", "after": "quarantine"}})

#: "post again after an error": a state other than the initial one waiting on the post
REPOST = TRANSFER_MACHINE.extend(
    "repost", states=["REPOSTING"],
    replace={("PROCESSING", "poll", "errored"): {"dest": "REPOSTING", "after": []}},
    transitions=[
        {"trigger": "post", "source": "REPOSTING", "dest": "PROCESSING", "conditions": "running"},
        {"trigger": "post", "source": "REPOSTING", "dest": "DONE", "conditions": "finished",
         "after": "latch_success"},
        {"trigger": "post", "source": "REPOSTING", "dest": "FAILED", "conditions": "errored",
         "after": "latch_failure"},
        {"trigger": "cancel", "source": "REPOSTING", "dest": "FAILED",
         "after": "latch_cancelled"},
    ],
    effects={"REPOSTING": "post"})


def always(answer: Any) -> Any:
    return lambda transfer, primary: answer


class Audited(enum.Enum):
    GOOD = "GOOD"
    BAD = "BAD"


#: an audit once the transfer is released, failing the job on BAD: but the outcome was
#: latched as NIXL ended, and is latched once
AUDIT_AFTER_RELEASE = TRANSFER_MACHINE.extend(
    "audit_after_release", states=["AUDITING"],
    replace={("XFER_RELEASED", "clean", "cleaned"): {"dest": "AUDITING"},
             ("XFER_RELEASED", "clean", "leaked"): {"dest": "AUDITING"}},
    answers={"audit": (Audited.GOOD, Audited.BAD, Answer.RAISED)},
    guards={"good": (Audited.GOOD,), "bad": (Audited.BAD, Answer.RAISED)},
    transitions=[
        {"trigger": "audit", "source": "AUDITING", "dest": "CLEANED", "conditions": "good"},
        {"trigger": "audit", "source": "AUDITING", "dest": "CLEANED", "conditions": "bad",
         "after": "latch_failure"},
        {"trigger": "cancel", "source": "AUDITING", "dest": "AUDITING"},
    ],
    effects={"AUDITING": "audit"})


@pytest.mark.parametrize(("machine", "steps", "refusal"), [
    # a "hook on release" took the place of the tier's own release on every path that made
    # the release by itself: the job published success, its transfer handle never released
    (NOTIFY, {"notify": always(Sent.SENT), "release": always(Answer.OK)},
     "a step 'release' was given, but 'release' is a call the tier makes itself"),
    (NOTIFY, {"notify": always(Sent.SENT), "publish": always(Answer.OK)},
     "a step 'publish' was given, but 'publish' is a call the tier makes itself"),
    # a mismatch published its job (a failure) before its release: the handle stayed live and
    # shutdown deregistered the memory under it
    (CHECK_THEN_PUBLISH, {"check": always(Checked.MISMATCH)},
     "REJECTED, a final state that is no failure state, is reached without a 'release' "
     r"\(SUBMITTED -> CHECKING -> REJECTED\)"),
    # shutdown gave the transfer up by an EXHAUSTED no state of the circle carried: it raised
    # InvalidTransition, and the tier stayed open with the job unpublished
    (CHECK_IN_A_CIRCLE, {"check": always(Pending.NOT_YET), "wait": always(Waited.WAITED)},
     "state CHECKING is on a circle of waits, CHECKING -> WAITING -> CHECKING, and has no "
     "give-up edge"),
    # a check answering "not yet" for good sent its job round PROCESSING and CHECKING some
    # 3,000 times a second, for ever: the circle ran through a running state, which the check
    # of circles left out
    (CHECK_AND_POLL_AGAIN, {"check": always(Pending.NOT_YET)},
     "state CHECKING is on a circle of waits, CHECKING -> PROCESSING -> CHECKING, and has no "
     "give-up edge"),
    # each mismatch held its finished transfer's handle for good, and the primary cache
    # registered (quarantined), though nothing had given up
    (CHECK_INTO_CORRUPT, {"check": always(Checked.MISMATCH)},
     r"CORRUPT, a final failure state, is entered holding the transfer handle on the step "
     r"'check' answering MISMATCH \(SUBMITTED -> CHECKING -> CORRUPT\): NIXL's transfer is "
     r"over"),
    # a store NIXL had finished, its release raising once, then cancelled: it published
    # "quarantined ... retry bound spent", untrue, and held its handle for good
    (CANCEL_INTO_QUARANTINE, {},
     r"QUARANTINED, a final failure state, is entered holding the transfer handle on a "
     r"'cancel' answering OK \(SUBMITTED -> DONE -> QUARANTINED\): NIXL's transfer is over, "
     r".* lead the cancel elsewhere \(a stay, as the shipped lifecycle's in DONE: the job "
     r"keeps its outcome\)"),
    # a transfer whose state check raised sat in REPOSTING until its drain timed out
    (REPOST, {}, "state REPOSTING waits on 'post', but a tier posts a transfer once, from the "
                 "initial state SUBMITTED"),
    # an audit answering BAD raised OutcomeAlreadyLatched into the caller's poll, and the next
    # poll published the success latched as NIXL ended: the audit's failure never published
    (AUDIT_AFTER_RELEASE, {"audit": always(Audited.BAD)},
     r"AUDITING -audit\(BAD\)-> CLEANED runs latch_failure, but a transfer may come to "
     r"AUDITING with its outcome latched already \(SUBMITTED -> DONE -> XFER_RELEASED -> "
     r"AUDITING\): an outcome is latched once"),
    # the same, kvfsm's latch given under a name of the user's: known by the function
    (AUDIT_AFTER_RELEASE.extend("audit_renamed", actions={"fail_it": latch_failure}, replace={
        ("AUDITING", "audit", "bad"): {"after": "fail_it"}}), {"audit": always(Audited.BAD)},
     r"AUDITING -audit\(BAD\)-> CLEANED runs latch_failure, but a transfer may come to "
     r"AUDITING with its outcome latched already"),
])
def test_a_lifecycle_a_tier_could_not_run_safely_is_refused_before_any_nixl_call(
    tmp_path: Path, machine: Declaration[Any, Any], steps: dict[str, Any], refusal: str,
) -> None:
    agent = FakeNixlAgent("refused")
    with pytest.raises(MachineRefused, match=refusal):
        FileTier(torch.zeros(4, 16), tmp_path, agent=agent, machine=machine, steps=steps)
    assert (agent.live_registrations(), agent.live_dlist_handles()) == (0, 0)


#: a check that may answer "not yet" as long as it likes (a self-loop), and gives up into
#: FAILED, a state that waits on the release: not a final one
CHECK_UNTIL_GIVEN_UP = TRANSFER_MACHINE.extend(
    "check_until_given_up", states=["CHECKING"],
    replace={("PROCESSING", "poll", "finished"): {"dest": "CHECKING", "after": []},
             ("SUBMITTED", "post", "finished"): {"dest": "CHECKING", "after": []}},
    answers={"check": (Pending.MATCH, Pending.NOT_YET, Answer.RAISED, Answer.EXHAUSTED)},
    guards={"matched": (Pending.MATCH,), "again": (Pending.NOT_YET, Answer.RAISED),
            "gave_up": (Answer.EXHAUSTED,)},
    transitions=[
        {"trigger": "check", "source": "CHECKING", "dest": "DONE", "conditions": "matched",
         "after": "latch_success"},
        {"trigger": "check", "source": "CHECKING", "dest": "CHECKING", "conditions": "again"},
        {"trigger": "check", "source": "CHECKING", "dest": "FAILED", "conditions": "gave_up",
         "after": "latch_failure"},
        {"trigger": "cancel", "source": "CHECKING", "dest": "CHECKING"},
    ],
    effects={"CHECKING": "check"})


def test_shutdown_gives_up_a_step_whose_give_up_leads_to_another_wait_and_publishes_it(
    tmp_path: Path,
) -> None:
    """The check never stops answering "not yet" and the policy sets no bound. At shutdown's
    deadline it is given up into FAILED, which waits on the release: shutdown makes that too
    and publishes the failure. It raised DrainTimeout ("NIXL still runs these") with nothing
    running, and the tier stayed open until shutdown was called again."""
    tier, agent = file_tier(tmp_path, CHECK_UNTIL_GIVEN_UP,
                            {"check": always(Pending.NOT_YET)},
                            policy=RetryPolicy(max_attempts=None, max_seconds=None))
    tier.submit_store(TransferJob(1, ["a"], [0]))
    for _ in range(20):  # until NIXL finished it, and the check answers "not yet"
        assert tier.get_finished_jobs() == []
    state = tier.state_of(1)
    assert state is not None and state.name == "CHECKING"
    tier.shutdown(timeout=0.2)
    assert tier.closed
    [result] = tier.get_finished_jobs()
    assert not result.success and result.reason is not None
    assert "shutdown deadline passed" in str(result.reason)
    assert (agent.live_xfer_handles(), agent.live_registrations()) == (0, 0)


def test_a_step_whose_tries_are_given_up_fails_its_job_saying_how_many_and_what_it_answered(
    tmp_path: Path,
) -> None:
    """The check answers "not yet" until the policy's two tries are spent; its give-up edge
    latches a failure. The reason names the check, the tries and the last answer, as an
    error of the step's (it said "check answered 'retry bound spent'", an answer the check
    never gave, of kind unknown)."""
    tier, _ = file_tier(tmp_path, CHECK_UNTIL_GIVEN_UP, {"check": always(Pending.NOT_YET)},
                        policy=RetryPolicy(max_attempts=2, max_seconds=None))
    tier.submit_store(TransferJob(1, ["a"], [0]))
    [result] = finished(tier)
    assert not result.success and result.reason is not None
    assert (result.reason.kind, result.reason.call, result.reason.error) == (
        FailureKind.ERR, "check", "gave up after 2 tries, the last answered NOT_YET")


def test_a_steps_retry_bound_before_the_latch_counts_from_nixls_end_not_the_submit(
    tmp_path: Path,
) -> None:
    """The check runs as soon as NIXL finished, before the outcome is latched, and answers
    "not yet" twice. NIXL took longer than the policy's max_seconds: the bound counted from the
    submit (the latch stamps the end, and none had come), so the first "not yet" gave up."""
    answers = [Pending.NOT_YET, Pending.NOT_YET, Pending.MATCH]
    tier, _ = file_tier(tmp_path, CHECK_UNTIL_GIVEN_UP,
                        {"check": lambda transfer, primary: answers.pop(0)},
                        policy=RetryPolicy(max_seconds=5.0, backoff=0.001))
    tier.submit_store(TransferJob(1, ["a"], [0]))
    [submitted] = tier.unpublished()
    submitted.started_at = submitted.finished_at = submitted.started_at - 10.0  # NIXL ran 10 s
    [result] = finished(tier)
    assert result.success, result.reason
    assert answers == [], "tried until it matched"


def test_a_release_given_up_that_leads_on_to_the_publish_is_refused_as_no_release(
    tmp_path: Path,
) -> None:
    """Only a release NIXL answered OK lets the handle go: a lifecycle whose give-up of the
    release (EXHAUSTED) leads on to XFER_RELEASED, and so to PUBLISHED, publishes success with
    the handle held (the cleanup then deregistered memory under it). It was taken, as if any
    edge of the release event were a release."""
    machine = TRANSFER_MACHINE.extend(
        "give_up_and_go_on",
        replace={("DONE", "release", "exhausted"): {"dest": "XFER_RELEASED", "after": []},
                 ("FAILED", "release", "exhausted"): {"dest": "XFER_RELEASED", "after": []}})
    with pytest.raises(MachineRefused, match=r"PUBLISHED, a final state that is no failure "
                                             r"state, is reached without a 'release' \("
                                             r"SUBMITTED -> DONE -> XFER_RELEASED -> CLEANED "
                                             r"-> PUBLISHED\)"):
        FileTier(torch.zeros(4, 16), tmp_path, agent=FakeNixlAgent(), machine=machine)


def test_a_failure_in_a_final_failure_state_names_the_state_before_an_older_error(
    tmp_path: Path,
) -> None:
    """The release raised once, then went through; the late check rejects the block. The job
    failed because it ended in REJECTED, which its reason says first: it used to say only the
    release's error, which had nothing to do with it any more."""
    tier, agent = file_tier(tmp_path, LATE_CHECK, {"check": always(Checked.MISMATCH)})
    agent.inject("release_xfer_handle", Raise())
    tier.submit_store(TransferJob(1, ["a"], [0]))
    [result] = finished(tier)
    assert result.reason is not None
    assert result.reason.error.startswith("ended in REJECTED, a failure state; last error: ")
    tier.shutdown(timeout=2)


#: a scrub of the blocks after the cleanup, whose leaks are kept as the cleanup's are
#: (``record_leaks``, which takes the leaks as its detail)
SCRUB = TRANSFER_MACHINE.extend(
    "with_scrub", states=["SCRUBBING"],
    replace={("XFER_RELEASED", "clean", "cleaned"): {"dest": "SCRUBBING"}},
    answers={"scrub": (Answer.OK, Answer.LEAKED, Answer.RAISED)},
    guards={"scrubbed": (Answer.OK,), "scrub_leaked": (Answer.LEAKED,),
            "scrub_raised": (Answer.RAISED,)},
    transitions=[
        {"trigger": "scrub", "source": "SCRUBBING", "dest": "CLEANED", "conditions": "scrubbed"},
        {"trigger": "scrub", "source": "SCRUBBING", "dest": "CLEANED",
         "conditions": "scrub_leaked", "after": "record_leaks"},
        {"trigger": "scrub", "source": "SCRUBBING", "dest": "CLEANED",
         "conditions": "scrub_raised"},
        {"trigger": "cancel", "source": "SCRUBBING", "dest": "CLEANED"}],
    effects={"SCRUBBING": "scrub"}, calls={"scrub": "scrub"})


def test_a_step_answering_what_is_no_failure_alone_hands_its_actions_no_detail(
    tmp_path: Path,
) -> None:
    """The scrub answers LEAKED alone into ``record_leaks``: the job publishes its success with
    nothing leaked. (A step's answer given alone once reached every action naming the step,
    which ``record_leaks`` took for its leaks: every poll raised and the job was never
    published.)"""
    tier, _ = file_tier(tmp_path, SCRUB, {"scrub": always(Answer.LEAKED)})
    tier.submit_store(TransferJob(1, ["a"], [0]))
    [result] = finished(tier)
    assert result.success and tier.stats()["leaks"] == 0
    tier.shutdown(timeout=2)


#: a check made as NIXL finished whose mismatch latches failure on its way to DONE (no failure
#: state: the job waits on its release as a success does)
CHECK_INTO_DONE = checked("check_into_done", "DONE")


def test_a_mismatch_latched_on_the_way_to_done_names_the_step(tmp_path: Path) -> None:
    """The mismatch, given alone, fails the job naming the check, whether or not its edge
    enters a failure state (it read "failed: MISMATCH", naming no step, when it did not)."""
    tier, _ = file_tier(tmp_path, CHECK_INTO_DONE, {"check": always(Checked.MISMATCH)})
    tier.submit_store(TransferJob(1, ["a"], [0]))
    [result] = finished(tier)
    assert str(result.reason) == "check answered MISMATCH"
    tier.shutdown(timeout=2)


@pytest.mark.parametrize("replace", [
    # a release that raised holds the handle for good at once (no retry)
    {("DONE", "release", "release_raised"): {"dest": "QUARANTINED", "after": "quarantine"},
     ("FAILED", "release", "release_raised"): {"dest": "QUARANTINED", "after": "quarantine"}},
    # an error NIXL answered holds the handle for good (other requests may still run)
    {("PROCESSING", "poll", "errored"): {"dest": "QUARANTINED", "after": "quarantine"}},
], ids=["release_raised", "poll_err"])
def test_holding_the_handle_for_good_on_nixls_own_answers_is_the_lifecycles_choice(
    tmp_path: Path, replace: dict[Any, Any],
) -> None:
    """Entering a final failure state with the handle held is refused on a step's own answer
    (NIXL's transfer is over), not on NIXL's answers once it is over, where holding it is the
    cautious choice (such lifecycles were refused as 'not by giving up', the advice
    impossible)."""
    machine = TRANSFER_MACHINE.extend("held_" + "_".join(key[0] for key in replace),
                                      replace=replace)
    tier, _ = file_tier(tmp_path, machine, {})
    tier.shutdown(timeout=5)


@pytest.mark.parametrize(("replace", "edge"), [
    ({("PROCESSING", "cancel", ""): {"dest": "QUARANTINED", "after": "quarantine"}},
     "PROCESSING -cancel(OK)-> QUARANTINED"),
    ({("PROCESSING", "poll", "running"): {"dest": "QUARANTINED", "after": "quarantine"}},
     "PROCESSING -poll(PROC)-> QUARANTINED"),
], ids=["cancel", "poll_proc"])
def test_a_transfer_nixl_runs_ended_in_a_final_failure_state_but_by_a_give_up_is_refused(
    tmp_path: Path, replace: dict[Any, Any], edge: str,
) -> None:
    """A cancel (or a PROC) while NIXL runs the transfer that ends it in QUARANTINED at once:
    only a give-up tells the runner NIXL may still run it, so its result said its blocks
    were free (blocks_in_use false) and the parent reused them under the running transfer
    (the explorer's first path). Refused, naming the edge."""
    machine = TRANSFER_MACHINE.extend("ended_running", replace=replace,
                                      unreachable=["CANCELLING"] if "cancel" in edge else [])
    with pytest.raises(MachineRefused, match=re.escape(edge) + " ends a transfer NIXL may "
                       "still run in a final failure state on an answer that is no give-up"):
        file_tier(tmp_path, machine, {})


def test_a_lifecycle_retrying_its_cleanup_on_a_leak_ends_once_nothing_is_left() -> None:
    """A lifecycle that makes its cleanup again when it leaked (a loop on LEAKED, bounded by
    the policy, giving up into CLEANED): the second cleanup has nothing left to release and
    answers OK. (When a cleanup started from the leaks the transfer had recorded, every later
    one answered LEAKED again, and the job took the policy's whole minute to end.)"""
    from kvfsm import JobResult  # noqa: PLC0415
    from kvfsm.tiers import ObjectStoreTier  # noqa: PLC0415

    retry_clean = TRANSFER_MACHINE.extend(
        "retry_clean",
        replace={("XFER_RELEASED", "clean", "leaked"): {"dest": "XFER_RELEASED",
                                                         "after": ["record_leaks"]}},
        answers={"clean": (Answer.OK, Answer.LEAKED, Answer.EXHAUSTED)},
        transitions=[{"trigger": "clean", "source": "XFER_RELEASED", "dest": "CLEANED",
                      "conditions": "exhausted"}])
    agent = FakeNixlAgent(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent, machine=retry_clean,
                           policy=RetryPolicy(max_attempts=4, backoff=0))
    agent.inject("release_dlist_handle", Raise(), times=1)  # the first cleanup leaks once
    tier.submit_store(TransferJob(1, ["k"], [0]))
    results: list[JobResult] = []
    polls = 0
    while not results and polls < 10:
        results += tier.get_finished_jobs()
        polls += 1
    assert [(r.job_id, r.success) for r in results] == [(1, True)]
    assert polls <= 3, polls
    assert agent.faults.count("release_dlist_handle") == 1, "released once, never twice"
    tier.shutdown(1)

    # its cleanup given up on its first leak (one try), a descriptor list's release cut short
    # by a Ctrl-C: the leaks stand (they were the LEAKED answer's, which the give-up dropped)
    agent = FakeNixlAgent(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent, machine=retry_clean,
                           policy=RetryPolicy(max_attempts=1, backoff=0))
    tier.submit_store(TransferJob(2, ["k"], [0]))
    real = agent.release_dlist_handle

    def ctrl_c(handle: Any) -> None:
        agent.release_dlist_handle = real  # type: ignore[method-assign]
        raise KeyboardInterrupt

    agent.release_dlist_handle = ctrl_c  # type: ignore[method-assign]
    results = []
    for _ in range(10):
        with contextlib.suppress(KeyboardInterrupt):
            results += tier.get_finished_jobs()
    assert [(r.job_id, r.success) for r in results] == [(2, True)]
    assert [(job, leak.call) for job, leak in tier.stats()["leaked"]] == [
        (2, "release_dlist_handle"), (2, "deregister_memory")]
    tier.shutdown(1)


@pytest.mark.parametrize("posted", ["PROC", "DONE"])
def test_a_submit_whose_lifecycle_action_raises_once_it_took_the_job_stands(
    tmp_path: Path, posted: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """An action of the user's on the post's edge raises: the tier took the job already (NIXL
    may be moving its blocks), so the submit does not raise, as a submit that raises has taken
    nothing (a caller would reuse the blocks; vLLM's manager then got the job twice, failed
    and done). The error is logged, and the job has one result: NIXL's outcome, or, when the
    action raised before the outcome was latched, a failure naming the action (it said "no
    reason recorded")."""
    raised = []

    def note_started(transfer: Any, answer: Any, detail: Any) -> None:
        if not raised:
            raised.append(transfer.job_id)
            raise RuntimeError("the user's action failed")

    edge = ("SUBMITTED", "post", "running" if posted == "PROC" else "finished")
    noting = TRANSFER_MACHINE.extend(
        "noting", replace={edge: {"dest": "PROCESSING" if posted == "PROC" else "DONE",
                                  "after": ["note_started"]
                                  + ([] if posted == "PROC" else ["latch_success"])}},
        actions={"note_started": note_started})
    tier, agent = file_tier(tmp_path, noting, {})
    agent.complete_after_polls = 0 if posted == "DONE" else 1
    with caplog.at_level("ERROR", logger="kvfsm"):
        tier.submit_store(TransferJob(1, ["k"], [0]))  # does not raise
    assert raised == [1] and tier.owes(1)
    assert "job 1: an action of the lifecycle raised as its post was filed" in caplog.text
    tier.drain_jobs(timeout=5)
    [result] = tier.get_finished_jobs()
    if posted == "PROC":  # (its success is latched as NIXL's DONE comes)
        assert (result.job_id, result.success) == (1, True)
    else:  # (the latch after it never ran: the safe side, saying why)
        assert (result.job_id, result.success) == (1, False)
        assert str(result.reason).endswith(
            "action 'note_started' of machine 'noting', firing SUBMITTED -post(DONE)-> DONE "
            "raised RuntimeError: the user's action failed")
    assert not tier.owes(1)
    tier.shutdown(5)
