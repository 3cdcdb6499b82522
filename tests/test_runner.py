"""The runner alone: the declaration drives it, and it makes no call of its own.

These stories drive :class:`kvfsm.runner.Runner` by hand, as a tier's I/O part does: they ask
what is due, answer it with an :class:`~kvfsm.runner.Outcome` and hand it back. No agent is
involved, so a story may stop between any two steps, which is how a cancel that arrives at
each of those points is checked here.
"""

from __future__ import annotations

import ast
import enum
import itertools
import pathlib
import threading
import time
from typing import Any

import pytest
import torch

import kvfsm.runner as kvfsm_runner
import kvfsm.tiers.base as kvfsm_base
from examples.verify_lifecycle import VERIFY_MACHINE, Verified, VerifyState
from kvfsm import Declaration, TransferJob
from kvfsm.driver import MachineRefused, StorageSide
from kvfsm.lifecycle import TRANSFER_MACHINE, Answer, CallFailed, TransferState
from kvfsm.machines.transfer import FailureKind
from kvfsm.policy import RetryPolicy
from kvfsm.runner import END, Outcome, Runner
from kvfsm.testing import FakeNixlAgent, Raise, StayProc
from kvfsm.tiers import ObjectStoreTier
from kvfsm.tiers.base import Lookup, SecondaryTier, key_text
from kvfsm.transfer import Leak, Transfer

S = TransferState
OK, CLEAN_OK = Outcome(Answer.OK), Outcome(Answer.OK, ())
KVFSM = pathlib.Path(__file__).resolve().parent.parent / "kvfsm"


def runner(policy: RetryPolicy | None = None) -> Runner:
    return Runner(TRANSFER_MACHINE.compile(), policy or RetryPolicy())


def submitted(books: Runner, job_id: int = 1) -> Transfer:
    transfer = Transfer(TransferJob(job_id, ["k"], [0]), 64, 0.0, books.initial)
    transfer.xfer = f"handle-{job_id}"  # what the I/O part would have made
    books.add(transfer)
    return transfer


def answer_due(books: Runner, answers: dict[str, Any]) -> list[str]:
    """Answer every due effect from ``answers``; the effects made, in order."""
    made = []
    for transfer, effect in books.due():
        made.append(effect)
        books.take(transfer, effect, answers[effect])
    return made


def test_a_transfer_runs_its_whole_way_on_answers_alone() -> None:
    books = runner()
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.PROC))
    assert books.handles == ["handle-1"] and books.in_state[S.PROCESSING] == 1

    # NIXL still runs it: nothing to fire, the stay is only counted
    assert books.take_checks(["PROC"]) == []
    assert books.table[S.PROCESSING]["poll"][Answer.PROC].taken == 1

    # NIXL says DONE: that answer comes back to be fired, then its release and cleanup are due
    assert books.take_checks(["DONE"]) == [(transfer, "DONE")]
    books.take(transfer, "poll", Outcome(Answer.DONE))
    assert list(books.waiting) == [1] and books.handles == []
    assert answer_due(books, {END: (OK, CLEAN_OK)}) == [END]

    [result] = books.take_results()
    assert result.success and result.job_id == 1
    assert not books.records and books.counts()["in_flight"] == {}


def test_a_cleanup_that_leaks_is_fired_step_by_step_and_the_transfer_still_publishes() -> None:
    books = runner()
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.DONE))
    leak = Leak("deregister_memory", "RuntimeError: gone")
    made = answer_due(books, {END: (OK, Outcome(Answer.LEAKED, (leak,))), "publish": OK})
    assert made == [END, "publish"]  # it paused in CLEANED between the two
    [result] = books.take_results()
    assert result.success
    assert books.counts()["leaks"] == 1 and books.counts()["leaked"] == [(1, leak)]


def test_a_release_that_raises_stays_and_is_bounded_by_the_policy() -> None:
    books = runner(RetryPolicy(max_attempts=3, max_seconds=None))
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.DONE))
    raised = Outcome(Answer.RAISED, CallFailed("release_xfer_handle", RuntimeError("busy")))
    for attempt in (1, 2):
        assert answer_due(books, {END: (raised, Outcome(None))}) == [END]
        assert transfer.state is S.DONE and transfer.attempts == attempt
    answer_due(books, {END: (raised, Outcome(None))})
    [result] = books.take_results()
    assert transfer.state is S.QUARANTINED and not result.success
    assert result.reason is not None and result.reason.kind is FailureKind.QUARANTINED
    assert result.reason.call == "release_xfer_handle"
    assert books.counts()["retries"] == 2 and books.counts()["quarantined"] == 1


# Each pause is (the answers given before the cancel, the state the cancel finds the transfer
# in, whether the job then succeeds). The cancel comes between two effects, where the runner
# hands control back; the story then answers whatever is due until the job is published.
PAUSES = [
    ([], S.PROCESSING, False),                                   # NIXL still runs it
    (["DONE"], S.DONE, True),                                    # over: its outcome is kept
    (["DONE", "interrupted cleanup"], S.XFER_RELEASED, True),    # released, not cleaned yet
    (["DONE", "leaked cleanup"], S.CLEANED, True),               # about to publish
]


@pytest.mark.parametrize(("before", "found_in", "succeeds"), PAUSES,
                         ids=[state.name for _, state, _ in PAUSES])
def test_a_cancel_between_any_two_steps_keeps_one_result_and_an_outcome_already_latched(
    before: list[str], found_in: TransferState, succeeds: bool,
) -> None:
    books = runner()
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.PROC))
    leak = Leak("release_dlist_handle", "RuntimeError: gone")
    for step in before:
        if step == "DONE":
            books.take_checks(["DONE"])
            books.take(transfer, "poll", Outcome(Answer.DONE))
        elif step == "interrupted cleanup":
            with pytest.raises(KeyboardInterrupt):
                books.take(transfer, END, (OK, Outcome(None, None, KeyboardInterrupt())))
        else:
            books.take(transfer, END, (OK, Outcome(Answer.LEAKED, (leak,))))
    assert transfer.state is found_in

    books.cancel(transfer)
    books.cancel(transfer)  # twice: still one result

    if found_in is S.PROCESSING:  # cancelled while running: NIXL must still say it is over
        assert transfer.state is S.CANCELLING and books.handles == ["handle-1"]
        books.take_checks(["DONE"])
        books.take(transfer, "poll", Outcome(Answer.DONE))
    answer_due(books, {END: (OK, CLEAN_OK), "clean": CLEAN_OK, "publish": OK})
    results = books.take_results()
    assert [(r.job_id, r.success) for r in results] == [(1, succeeds)]
    if not succeeds:
        assert results[0].reason is not None
        assert results[0].reason.kind is FailureKind.CANCELLED


def test_the_running_bound_costs_the_transfers_it_finds_not_those_in_flight() -> None:
    books = runner(RetryPolicy(max_running_seconds=5.0))
    old = submitted(books, 1)
    fresh = [submitted(books, job_id) for job_id in range(2, 6)]
    for transfer in (old, *fresh):
        transfer.started_at = time.monotonic()
        books.take(transfer, "post", Outcome(Answer.PROC))
    old.started_at -= 100.0  # submitted long ago
    assert books.overdue() == []  # given up at once: no call to make
    assert old.state is S.QUARANTINED
    assert all(t.state is S.PROCESSING for t in fresh)
    assert books.counts()["quarantined_running"] == 1
    assert len(books._by_start or ()) == len(fresh)  # the old one was taken off the front


def failing_verify_machine() -> Declaration[Any, Any]:
    """The verify lifecycle, with a step that raises retried in place (and a give-up edge)."""
    verifying = VerifyState.VERIFYING
    transitions = [t for t in VERIFY_MACHINE.transitions
                   if not (t["source"] is verifying and t.get("conditions") == "unverified")]
    transitions += [
        {"trigger": "verify", "source": verifying, "dest": VerifyState.FAILED,
         "conditions": "mismatched", "after": "latch_failure"},
        {"trigger": "verify", "source": verifying, "dest": verifying,
         "conditions": "raised", "after": "count_retry"},
        {"trigger": "verify", "source": verifying, "dest": VerifyState.QUARANTINED,
         "conditions": "exhausted", "after": "quarantine"}]
    return Declaration(
        "verify_retried", states=VerifyState, initial=VerifyState.SUBMITTED,
        answers={**VERIFY_MACHINE.answers,
                 "verify": (Verified.MATCH, Verified.MISMATCH, Answer.RAISED, Answer.EXHAUSTED)},
        guards={**VERIFY_MACHINE.guards, "mismatched": (Verified.MISMATCH,),
                "raised": (Answer.RAISED,)},
        actions=VERIFY_MACHINE.actions, transitions=transitions, final=VERIFY_MACHINE.final,
        failure_states=VERIFY_MACHINE.failure_states, calls=VERIFY_MACHINE.calls,
        effects=VERIFY_MACHINE.effects, running=VERIFY_MACHINE.running)


def test_a_users_step_retried_in_place_is_bounded_by_the_policy_and_named_in_the_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def flaky_verify(transfer: Transfer, primary: torch.Tensor) -> Any:
        calls.append(transfer.job_id)
        raise OSError("checksum index unreachable")

    agent = FakeNixlAgent()
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent, machine=failing_verify_machine(),
                           steps={"verify": flaky_verify},
                           policy=RetryPolicy(max_attempts=3, max_seconds=None))
    tier.submit_store(TransferJob(1, ["a"], [0]))
    results = []
    for _ in range(10):
        results += tier.get_finished_jobs()
    assert calls == [1, 1, 1]  # tried three times, then given up: not retried forever
    [result] = results
    assert not result.success and result.reason is not None
    assert result.reason.kind is FailureKind.QUARANTINED
    assert result.reason.call == "verify"  # the step it waited on, not a NIXL call
    assert "checksum index unreachable" in result.reason.error
    assert tier.stats()["retries"] == 2 and tier.stats()["quarantined"] == 1
    # the log lines name the step too (it makes no NIXL call to name)
    said = [record.getMessage() for record in caplog.records]
    assert "job 1: verify failed (retry 1): OSError: checksum index unreachable" in said
    assert ("job 1 quarantined after 3 failed verify(s): OSError: checksum index unreachable"
            in said)
    tier.shutdown()


def test_a_step_retried_in_place_without_a_give_up_edge_is_refused_at_construction() -> None:
    machine = failing_verify_machine()
    no_give_up = Declaration(
        "verify_forever", states=VerifyState, initial=VerifyState.SUBMITTED,
        answers=machine.answers, guards=machine.guards, actions=machine.actions,
        transitions=[{**t, "dest": VerifyState.VERIFYING, "after": []}  # EXHAUSTED stays
                     if t.get("conditions") == "exhausted" and t["source"] is VerifyState.VERIFYING
                     else t for t in machine.transitions],
        final=machine.final, failure_states=machine.failure_states,
        effects=machine.effects, running=machine.running)
    agent = FakeNixlAgent()
    with pytest.raises(MachineRefused, match="'verify_forever': state VERIFYING has no give-up"):
        ObjectStoreTier(torch.zeros(4, 8), agent=agent, machine=no_give_up,
                        steps={"verify": lambda transfer, primary: Answer.RAISED})
    assert agent.calls == []


def test_a_machine_whose_give_ups_go_round_in_a_circle_is_refused_at_construction() -> None:
    """VERIFYING gives up to RECHECK, and RECHECK back to VERIFYING: once a job's retry bound
    (``max_seconds`` spans states) is spent, each try there would give up at once, and a poll
    would go round for ever. The tier refuses the machine, naming the circle; no NIXL call."""
    machine = failing_verify_machine()
    circle = machine.extend(
        "verify_circle", states=["RECHECK"],
        replace={("VERIFYING", "verify", "exhausted"): {"dest": "RECHECK", "after": []}},
        answers={"recheck": (Answer.RAISED, Answer.EXHAUSTED)},
        transitions=[
            {"trigger": "recheck", "source": "RECHECK", "dest": "RECHECK",
             "conditions": "raised", "after": "count_retry"},
            {"trigger": "recheck", "source": "RECHECK", "dest": "VERIFYING",
             "conditions": "exhausted"},
            {"trigger": "cancel", "source": "RECHECK", "dest": "RECHECK"}],
        effects={"RECHECK": "recheck"})
    agent = FakeNixlAgent()
    with pytest.raises(MachineRefused, match="'verify_circle': giving up goes round in a "
                                             "circle, VERIFYING -> RECHECK -> VERIFYING"):
        ObjectStoreTier(torch.zeros(4, 8), agent=agent, machine=circle,
                        steps={"verify": lambda transfer, primary: Answer.RAISED,
                               "recheck": lambda transfer, primary: Answer.RAISED})
    assert agent.calls == []


def _names_outside(attribute_of: str, allowed: set[str]) -> list[str]:
    """``attribute_of.X`` attribute reads in kvfsm's modules outside ``allowed``."""
    found = []
    for path in sorted(KVFSM.rglob("*.py")):
        relative = path.relative_to(KVFSM.parent).as_posix()
        if relative in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == attribute_of and node.attr.isupper()):
                found.append(f"{relative}:{node.lineno}: {attribute_of}.{node.attr}")
    return found


def test_no_module_but_the_declaration_names_a_state_of_the_transfer_machine() -> None:
    assert _names_outside("TransferState", {"kvfsm/machines/transfer.py"}) == []


def test_one_place_asks_nixl_about_a_running_transfer() -> None:
    """``check_xfer_state`` is called in kvfsm's execution layer in one place (the fakes in
    kvfsm.testing implement it, which is another matter)."""
    callers = []
    for path in sorted(KVFSM.rglob("*.py")):
        relative = path.relative_to(KVFSM.parent).as_posix()
        if relative.startswith("kvfsm/testing/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "check_xfer_state":
                callers.append(relative)
    assert callers == ["kvfsm/driver.py"]


# -- found by review: each is a story that failed before its fix --------------------------------

class _Side(StorageSide):
    """Object-like remote side whose commit says whether a finished store is in place yet."""

    mem_type = "OBJ"

    def __init__(self, block_bytes: int, committed: bool = True) -> None:
        self.block_bytes, self.committed = block_bytes, committed
        self.opened = 0

    def open(self, transfer: Transfer) -> list[tuple[int, int, int, str]]:
        self.opened += len(transfer.names)
        return [(0, self.block_bytes, self.opened, name) for name in transfer.names]

    def commit(self, transfer: Transfer) -> bool:
        return self.committed


class _Tier(SecondaryTier):
    def remote_name(self, key: bytes | str) -> str:
        return key_text(key)

    def _probe(self, name: str) -> Lookup:
        return Lookup.MISS


def test_an_interrupt_in_one_overdue_transfer_leaves_the_bound_on_the_others() -> None:
    """Job 1's commit never ends and job 2 never finishes; past the running bound a listener
    interrupts the poll at job 2's quarantine. Job 1 must still be failed by the bound on a
    later poll, not left running for good."""
    agent = FakeNixlAgent(complete_after_polls=1)
    primary = torch.zeros(8, 16)
    tier = _Tier(primary, agent=agent, remote=_Side(int(primary[0].nbytes), committed=False),
                 policy=RetryPolicy(max_running_seconds=0.05))
    tier.submit_store(TransferJob(1, ["a"], [0]))
    agent.inject("check_xfer_state", StayProc(10**6), at=2)
    tier.submit_store(TransferJob(2, ["b"], [1]))
    assert tier.get_finished_jobs() == []
    time.sleep(0.1)
    interrupted: list[int] = []

    def interrupt_once(transfer: Transfer) -> None:
        if not interrupted:
            interrupted.append(transfer.job_id)
            raise KeyboardInterrupt

    tier.on_published.append(interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        tier.get_finished_jobs()
    results = {r.job_id: r for r in tier.get_finished_jobs() + tier.get_finished_jobs()}
    assert sorted(results) == [1, 2] and not tier.unpublished()
    assert results[1].reason is not None and results[1].reason.call == "commit"
    assert results[2].reason is not None and results[2].reason.kind is FailureKind.QUARANTINED


def test_the_running_bound_keeps_no_published_transfer() -> None:
    """The submit-order queue of the running bound held every transfer until the bound
    expired (an hour here): 1 KB a job, unbounded at a high job rate."""
    books = runner(RetryPolicy(max_running_seconds=3600.0))
    for job_id in range(2000):
        transfer = submitted(books, job_id)
        books.take(transfer, "post", Outcome(Answer.DONE))
        answer_due(books, {END: (OK, CLEAN_OK)})
    assert len(books.take_results()) == 2000 and not books.records
    assert len(books._by_start or ()) <= 64


class Pending(enum.Enum):
    """What the ``verify`` step of :func:`verify_pending` answers."""

    MATCH = "MATCH"
    PENDING = "PENDING"


def verify_pending() -> Declaration[Any, Any]:
    """The lifecycle with a user step ``verify`` after NIXL's DONE that may answer "not yet"
    (a retry, so the state has a give-up edge: EXHAUSTED quarantines)."""
    return with_verify("verify_pending", Pending.MATCH, Pending.PENDING, "pending",
                       "VERIFYING", after_post=True)


class Again(enum.Enum):
    """What the ``verify`` step of :func:`verify_again` answers."""

    MATCH = "MATCH"
    AGAIN = "AGAIN"


def verify_again() -> Declaration[Any, Any]:
    """The lifecycle with a step ``verify`` after NIXL's DONE whose answer AGAIN sends the
    transfer back to PROCESSING, a running state: an effect that leads back to NIXL."""
    return with_verify("verify_again", Again.MATCH, Again.AGAIN, "again", "PROCESSING",
                       after_post=False)


def with_verify(name: str, match: Any, other: Any, guard: str, other_dest: str, *,
                after_post: bool) -> Declaration[Any, Any]:
    """The transfer lifecycle with a user step ``verify`` in a state VERIFYING after NIXL's
    DONE (after a post that finished at once too, with ``after_post``): ``match`` succeeds,
    ``other`` (guard ``guard``) leads to ``other_dest``, a raise fails, EXHAUSTED quarantines."""
    base: Declaration[Any, Any] = TRANSFER_MACHINE  # its answers are not only Answer's
    replace = {("PROCESSING", "poll", "finished"): {"dest": "VERIFYING", "after": []}}
    if after_post:
        replace[("SUBMITTED", "post", "finished")] = {"dest": "VERIFYING", "after": []}
    return base.extend(
        name, states=["VERIFYING"], replace=replace,
        answers={"verify": (match, other, Answer.RAISED, Answer.EXHAUSTED)},
        guards={"matched": (match,), guard: (other,), "step_raised": (Answer.RAISED,)},
        transitions=[
            {"trigger": "verify", "source": "VERIFYING", "dest": "DONE",
             "conditions": "matched", "after": "latch_success"},
            {"trigger": "verify", "source": "VERIFYING", "dest": other_dest,
             "conditions": guard},
            {"trigger": "verify", "source": "VERIFYING", "dest": "FAILED",
             "conditions": "step_raised", "after": "latch_failure"},
            {"trigger": "verify", "source": "VERIFYING", "dest": "QUARANTINED",
             "conditions": "exhausted", "after": "quarantine"},
            {"trigger": "cancel", "source": "VERIFYING", "dest": "VERIFYING"}],
        effects={"VERIFYING": "verify"})


def test_a_step_answering_not_yet_in_place_is_bounded_and_named(
        caplog: pytest.LogCaptureFixture) -> None:
    """A step whose plain answer is a self-loop (no exception): once the bound is spent the
    reason names the step, not a NIXL call; the backoff spaces the tries."""

    machine = verify_pending()
    tries: list[float] = []

    def not_yet(transfer: Transfer, primary: torch.Tensor) -> Any:
        tries.append(time.monotonic())
        return Pending.PENDING

    tier = ObjectStoreTier(torch.zeros(4, 8), agent=FakeNixlAgent(), machine=machine,
                           steps={"verify": not_yet},
                           policy=RetryPolicy(max_attempts=3, backoff=0.02, max_backoff=0.02))
    tier.submit_store(TransferJob(1, ["a"], [0]))
    results = []
    deadline = time.monotonic() + 5
    while not results and time.monotonic() < deadline:
        results += tier.get_finished_jobs()
    [result] = results
    assert len(tries) == 3 and all(b - a >= 0.02 for a, b in itertools.pairwise(tries))
    assert result.reason is not None and result.reason.kind is FailureKind.QUARANTINED
    assert result.reason.call == "verify"
    said = [record.getMessage() for record in caplog.records]
    assert "job 1: verify failed (retry 1): answered PENDING" in said  # what it answered
    tier.shutdown()


@pytest.mark.parametrize("has_handle", [False, True], ids=["before-a-handle", "with-a-handle"])
def test_a_cancel_of_a_transfer_whose_post_never_answered_publishes_one_failure(
    has_handle: bool,
) -> None:
    """An interrupt between a submit's bookkeeping and its post's answer leaves a transfer in
    SUBMITTED; cancel (and so shutdown) must settle it, not raise. One with a handle may be
    running: it is waited for as any cancelled running transfer is."""
    books = runner()
    transfer = submitted(books)
    if not has_handle:
        transfer.xfer = None
    books.cancel(transfer)
    if has_handle:
        assert transfer.state is S.CANCELLING and books.handles == ["handle-1"]
        books.take_checks(["DONE"])
        books.take(transfer, "poll", Outcome(Answer.DONE))
    answer_due(books, {END: (OK, CLEAN_OK)})
    [result] = books.take_results()
    assert not result.success



@pytest.mark.parametrize("machine", ["shipped", "verify"])
def test_a_poll_takes_each_transfer_it_finds_over_as_far_as_it_goes_in_that_round(
    machine: str,
) -> None:
    """One ``get_finished_jobs()``: the state checks find two stores over; for each, what
    follows NIXL's DONE (with the verify machine, the user's step first), its release, cleanup
    and publish, are made in that same round, each once. A release that raises stays for a
    later round: it is not tried a second time in the round that found the transfer over,
    even with no backoff."""
    agent = FakeNixlAgent(complete_after_polls=1)
    verified: list[int] = []

    def verify(transfer: Transfer, primary: torch.Tensor) -> Verified:
        verified.append(transfer.job_id)
        return Verified.MATCH

    extra: dict[str, Any] = ({"machine": VERIFY_MACHINE, "steps": {"verify": verify}}
                             if machine == "verify" else {})
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent, policy=RetryPolicy(backoff=0.0),
                           **extra)
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.submit_store(TransferJob(2, ["b"], [1]))
    agent.inject("release_xfer_handle", Raise(), at=agent.call_count("release_xfer_handle") + 2)

    first = tier.get_finished_jobs()

    assert [r.job_id for r in first] == [1], "job 1 went all the way in the round"
    assert verified == ([1, 2] if machine == "verify" else [])
    assert agent.call_count("check_xfer_state") == 2
    assert agent.call_count("release_xfer_handle") == 2, "job 2's release raised, tried once"
    assert tier.state_of(2).name == "DONE"
    assert tier.stats()["retries"] == 1
    (second,) = tier.get_finished_jobs()
    assert (second.job_id, second.success) == (2, True)
    assert agent.call_count("release_xfer_handle") == 3
    assert agent.call_count("check_xfer_state") == 2, "an outcome latched is never checked again"
    tier.shutdown()


def three_stores_done_at_the_next_check() -> tuple[FakeNixlAgent, ObjectStoreTier]:
    """Jobs 1, 2 and 3, one-block stores NIXL says are DONE at their next state check."""
    agent = FakeNixlAgent(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent)
    for job_id in (1, 2, 3):
        tier.submit_store(TransferJob(job_id, [f"k{job_id}"], [job_id]))
    return agent, tier


def test_a_listener_that_cancels_a_job_found_done_in_the_same_round_leaves_it_its_success(
) -> None:
    """Every answer of a round's state checks is fired before any release is made: a listener
    of the first job published (which may call back into the tier) finds the others already
    over, so cancelling one of them keeps the success NIXL reported, and nothing is asked of
    NIXL twice."""
    agent, tier = three_stores_done_at_the_next_check()
    seen: list[str] = []
    counted: list[dict[str, int]] = []

    def listener(transfer: Transfer) -> None:
        if transfer.job_id == 1:
            seen.append(tier.state_of(2).name)
            counted.append(tier.stats()["in_flight"])
            tier.cancel(2)

    tier.on_published.append(listener)
    results = tier.get_finished_jobs()

    assert seen == ["DONE"], "job 2's DONE was taken before job 1 was published"
    assert counted == [{"DONE": 2}], "stats count each job where it is"
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True), (3, True)]
    assert agent.call_count("check_xfer_state") == 3
    tier.shutdown()


def test_a_listener_that_drains_finishes_the_jobs_found_done_with_its_own() -> None:
    """A round's state checks find three stores over. A listener of the first one published
    drains the tier from inside that round: the other two, found DONE but not yet taken on by
    the round, are released and published by the drain (it does not wait for them until its
    deadline), each once, and the round that found them makes no call for them again."""
    agent, tier = three_stores_done_at_the_next_check()
    drained: list[bool] = []

    def listener(transfer: Transfer) -> None:
        if transfer.job_id == 1:
            tier.drain_jobs(timeout=2)
            drained.append(not tier.unpublished())

    tier.on_published.append(listener)
    results = tier.get_finished_jobs()

    assert drained == [True], "the drain inside the listener returned, every job published"
    assert sorted((r.job_id, r.success) for r in results) == [(1, True), (2, True), (3, True)]
    assert agent.call_count("release_xfer_handle") == 3
    assert agent.call_count("check_xfer_state") == 3, "nothing is asked of NIXL twice"
    assert agent.misuses == []
    tier.shutdown()


def test_an_action_that_raises_at_one_jobs_done_leaves_no_job_of_its_round_behind() -> None:
    """A round's state checks find three stores over. An action of the user's on NIXL's DONE
    raises for the second one, once: the round raises it, and each job it had taken out of the
    running states is filed where its state says, so the next round releases and publishes
    all three, each once, asking NIXL about none of the first two again."""
    raised: list[int] = []

    def audit(transfer: Transfer, answer: Any, detail: Any) -> None:
        if transfer.job_id == 2 and not raised:
            raised.append(2)
            raise RuntimeError("audit log unavailable")

    machine = TRANSFER_MACHINE.extend(
        "audited", replace={("PROCESSING", "poll", "finished"): {
            "after": ["latch_success", "audit"]}}, actions={"audit": audit})
    agent = FakeNixlAgent(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent, machine=machine)
    for job_id in (1, 2, 3):
        tier.submit_store(TransferJob(job_id, [f"k{job_id}"], [job_id]))

    with pytest.raises(RuntimeError, match="audit log unavailable"):
        tier.get_finished_jobs()

    assert [tier.state_of(job_id).name for job_id in (1, 2, 3)] == ["DONE", "DONE", "PROCESSING"]
    assert tier.stats()["in_flight"] == {"DONE": 2, "PROCESSING": 1}, "each counted where it is"
    results = tier.get_finished_jobs()
    assert sorted((r.job_id, r.success) for r in results) == [(1, True), (2, True), (3, True)]
    assert agent.call_count("check_xfer_state") == 4, "jobs 1 and 2 were not asked again"
    assert agent.call_count("release_xfer_handle") == 3, "each handle released once"
    assert not tier.has_pending_work() and agent.misuses == []
    tier.shutdown()


def test_an_action_that_raises_on_a_done_that_ends_the_job_leaves_it_published(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lifecycle of the user's whose DONE leads straight to a final state, with an action
    there that raises once: the round raises it, and the job is filed where its state says,
    final, so it is published (it stayed in the running list, in a final state, for good:
    drain never ended, stats counted it as running, and shutdown raised). A tier refuses
    this lifecycle now (a final failure state entered on DONE holds the handle for nothing):
    its check is bypassed, for the runner's books are what is tested."""
    import kvfsm.driver  # noqa: PLC0415

    monkeypatch.setattr(kvfsm.driver, "_check_released_before_final", lambda *args: None)
    raised: list[int] = []

    def audit(transfer: Transfer, answer: Any, detail: Any) -> None:
        if not raised:
            raised.append(transfer.job_id)
            raise RuntimeError("audit log unavailable")

    machine = TRANSFER_MACHINE.extend(
        "done-quarantines", replace={("PROCESSING", "poll", "finished"): {
            "dest": "QUARANTINED", "after": ["latch_success", "audit"]}},
        actions={"audit": audit})
    agent = FakeNixlAgent(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent, machine=machine)
    tier.submit_store(TransferJob(1, ["k1"], [1]))

    with pytest.raises(RuntimeError, match="audit log unavailable"):
        tier.get_finished_jobs()

    assert tier.state_of(1) is None and tier.stats()["in_flight"] == {}
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
    tier.shutdown(timeout=1)
    assert tier.closed


def test_stats_read_at_any_line_of_a_round_count_each_job_once_and_none_as_published() -> None:
    """stats() takes no lock: a monitoring thread reads it at any moment of another thread's
    round. Read at each line a round finding three stores over runs in kvfsm's books, on the
    round's own thread (a listener would be) and on another thread at that moment, it never
    counts a job under a final state or below zero, nor more jobs than are unpublished."""
    import sys  # noqa: PLC0415
    books = {pathlib.Path(module.__file__).resolve() for module in (kvfsm_runner, kvfsm_base)}
    final = {state.name for state in TRANSFER_MACHINE.final}
    wrong: list[tuple[int, str, dict[str, int]]] = []

    _, tier = three_stores_done_at_the_next_check()
    lines = [0]

    def check(where: str) -> None:
        counted = tier.stats()["in_flight"]
        if (set(counted) & final or any(n < 0 for n in counted.values())
                or sum(counted.values()) > 3):
            wrong.append((lines[0], where, counted))

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            lines[0] += 1
            check("the round's thread")
            other = threading.Thread(target=check, args=("another thread",))
            other.start()
            other.join()
        return local

    sys.settrace(lambda frame, event, arg: local if pathlib.Path(
        frame.f_code.co_filename).resolve() in books else None)
    try:
        results = tier.get_finished_jobs()
    finally:
        sys.settrace(None)
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True), (3, True)]
    tier.shutdown(timeout=1)
    assert lines[0] > 100 and wrong == [], wrong[:3]


class CleanupInterruptedOnce(FakeNixlAgent):
    """The fake agent, with its next ``deregister_memory`` cut short by a KeyboardInterrupt
    (armed by the test), as a Ctrl-C landing in NIXL's call would."""

    armed = False

    def deregister_memory(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return super().deregister_memory(*args, **kwargs)


def test_an_interrupt_in_one_cleanup_loses_none_of_the_rounds_other_answers() -> None:
    """The state checks of a round find three stores over; the first one's cleanup is
    interrupted. The other two were taken already (DONE, waiting on their release), so the
    next round finishes all three without asking NIXL about any of them again, and the
    interrupted cleanup goes on where it stopped."""
    agent = CleanupInterruptedOnce(complete_after_polls=1)
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent)
    for job_id in (1, 2, 3):
        tier.submit_store(TransferJob(job_id, [f"k{job_id}"], [job_id]))
    agent.armed = True

    with pytest.raises(KeyboardInterrupt):
        tier.get_finished_jobs()

    assert [tier.state_of(job_id) for job_id in (1, 2, 3)] == [S.XFER_RELEASED, S.DONE, S.DONE]
    checks = agent.call_count("check_xfer_state")
    assert checks == 3
    results = tier.get_finished_jobs()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True), (3, True)]
    assert agent.call_count("check_xfer_state") == checks, "no answer was asked for again"
    assert agent.call_count("release_xfer_handle") == 3, "each handle released once"
    assert agent.misuses == []
    tier.shutdown()
