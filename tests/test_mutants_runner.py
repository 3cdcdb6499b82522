"""The runner's counts, log lines and bounds where mutmut found them untested (docs/testing.md,
"Mutation testing").

A running transfer that NIXL says is still running (PROC) stays where it is; the runner does
not fire that stay but counts it, once per transfer per poll round, so transition coverage and
``transition_counts`` see it. mutmut found that no test checked the counts in a round where
some transfers answered and others stayed, or over more than one round: mutants that counted
the answered ones too, counted a round instead of adding it, or subtracted it, survived.

The run of every mutant of kvfsm/runner.py at e69b250 found more, each stated whole here: the
warning of a retried release (on its 1st, 2nd, 4th... failure only) and the error of its
quarantine; the warning of a failed job (store or load, how many blocks, its reason); the
latency percentiles of ``counts()``; the reason a step's spent retry bound gives (the step
named, its own error kept unwrapped); the reason of a job cancelled before its post answered;
and the running bound after the submit-order queue was compacted.
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import time
from typing import Any

import pytest

import kvfsm.runner
from kvfsm import TRANSFER_MACHINE, Declaration, FailureKind, FailureReason, TransferJob
from kvfsm.driver import Outcome
from kvfsm.lifecycle import Answer, CallFailed
from kvfsm.policy import RetryPolicy
from kvfsm.runner import COMMITTING, END, Runner
from kvfsm.transfer import Leak, Transfer

from .test_poll_schedule import Clock
from .test_runner import (
    CLEAN_OK,
    OK,
    Again,
    Pending,
    S,
    answer_due,
    failing_verify_machine,
    runner,
    submitted,
    verify_again,
    verify_pending,
)


def test_each_poll_round_counts_one_stay_per_transfer_still_running_in_its_state() -> None:
    books = runner()
    transfers = [submitted(books, job_id) for job_id in (1, 2, 3, 4)]
    for transfer in transfers:
        books.take(transfer, "post", Outcome(Answer.PROC))
    books.cancel(transfers[3])
    assert books.in_state[S.PROCESSING] == 3 and books.in_state[S.CANCELLING] == 1
    processing = books.table[S.PROCESSING]["poll"][Answer.PROC]
    cancelling = books.table[S.CANCELLING]["poll"][Answer.PROC]

    for _ in range(2):  # everything still runs, twice
        assert books.take_checks(["PROC"] * len(books.handles)) == []
    assert (processing.taken, cancelling.taken) == (6, 2)

    answers = ["DONE" if handle == "handle-1" else "PROC" for handle in books.handles]
    assert books.take_checks(answers) == [(transfers[0], "DONE")]
    assert (processing.taken, cancelling.taken) == (8, 3)

    answers = ["DONE" if handle == "handle-4" else "PROC" for handle in books.handles]
    assert [t.job_id for t, _ in books.take_checks(answers)] == [4]
    assert (processing.taken, cancelling.taken) == (11, 3)



# -- the run at e69b250: what the log says, and the figures of counts() ----------------------

FIELDS = ("kvfsm_job_id", "kvfsm_state", "kvfsm_nixl_error")


def logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str, list[Any]]]:
    """Each line kvfsm logged: its level, its text and its structured fields."""
    return [(record.levelno, record.getMessage(),
             [getattr(record, field, None) for field in FIELDS])
            for record in caplog.records if record.name == "kvfsm"]


def test_a_release_retried_is_logged_on_its_1st_2nd_and_4th_failure_then_its_quarantine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Six failed releases under ``max_attempts=6``: the 1st, 2nd and 4th retries are logged
    as warnings naming the NIXL call, the retry and the error (not the 3rd or the 5th: a
    retry on every round would flood the log), and the 6th quarantines with one error line;
    each line carries the transfer's structured fields."""
    caplog.set_level(logging.DEBUG, logger="kvfsm")
    books = runner(RetryPolicy(max_attempts=6, max_seconds=None))
    transfer = submitted(books, 3)
    books.take(transfer, "post", Outcome(Answer.DONE))
    raised = Outcome(Answer.RAISED, CallFailed("release_xfer_handle", RuntimeError("busy")))
    for attempt in range(1, 6):
        assert answer_due(books, {END: (raised, Outcome(None))}) == [END]
        assert (transfer.state, transfer.attempts, transfer.retry_at) == (S.DONE, attempt, 0.0)
    assert transfer.retries == 5 and books.counts()["retries"] == 5
    answer_due(books, {END: (raised, Outcome(None))})
    assert transfer.state is S.QUARANTINED

    busy = "RuntimeError: busy"
    assert logged(caplog)[:4] == [
        (logging.WARNING, f"job 3: release_xfer_handle failed (retry {n}): {busy}",
         [3, "DONE", busy]) for n in (1, 2, 4)] + [
        (logging.ERROR, f"job 3 quarantined after 6 failed release_xfer_handle(s): {busy}",
         [3, "QUARANTINED", busy])]
    [result] = books.take_results()
    assert result.reason == FailureReason(
        FailureKind.QUARANTINED, "release_xfer_handle",
        f"retry bound spent; last error: {busy}", "RuntimeError")


def test_a_release_retried_waits_for_the_backoff_doubled_after_each_failure() -> None:
    """``retry_at`` is the policy's next attempt after this failure: the backoff, then twice
    it (nothing is due before it)."""
    books = runner(RetryPolicy(max_attempts=None, max_seconds=None, backoff=30.0,
                               max_backoff=100.0))
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.DONE))
    raised = Outcome(Answer.RAISED, CallFailed("release_xfer_handle", RuntimeError("busy")))
    before = time.monotonic()
    books.take(transfer, END, (raised, Outcome(None)))
    assert before + 30.0 <= transfer.retry_at <= time.monotonic() + 30.0
    assert list(books.due()) == [], "backing off: nothing due"
    transfer.retry_at = 0.0
    before = time.monotonic()
    books.take(transfer, END, (raised, Outcome(None)))
    assert transfer.attempts == 2
    assert before + 60.0 <= transfer.retry_at <= time.monotonic() + 60.0


def test_the_retry_bound_counts_from_when_the_transfer_ended() -> None:
    """``max_seconds`` is measured from ``finished_at``: a transfer that ended long ago is
    quarantined at its first failed release, one that ended now is retried."""
    raised = Outcome(Answer.RAISED, CallFailed("release_xfer_handle", RuntimeError("busy")))
    books = runner(RetryPolicy(max_attempts=None, max_seconds=50.0))
    old, new = submitted(books, 1), submitted(books, 2)
    for transfer in (old, new):
        books.take(transfer, "post", Outcome(Answer.DONE))
    old.finished_at -= 100.0
    books.take(old, END, (raised, Outcome(None)))
    books.take(new, END, (raised, Outcome(None)))
    assert (old.state, new.state) == (S.QUARANTINED, S.DONE)
    assert new.attempts == 1 and new.retries == 1


def test_a_failed_job_is_logged_with_what_it_moved_and_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failed store and a failed load each log one warning: the job, store or load, how many
    blocks, and the reason (not the bare last error), with the structured fields."""
    caplog.set_level(logging.DEBUG, logger="kvfsm")
    books = runner()
    store = submitted(books, 1)
    store.names = ("a", "b")
    load = Transfer(TransferJob(2, ["c"], [0], is_promotion=True), 64, 0.0, books.initial)
    load.names = ("c",)
    books.add(load)
    for transfer in (store, load):
        books.take(transfer, "post", Outcome(Answer.RAISED, CallFailed(
            "register_memory", OSError("no space"))))
        answer_due(books, {END: (OK, CLEAN_OK)})
    results = books.take_results()
    assert [r.success for r in results] == [False, False]
    reasons = [str(r.reason) for r in results]
    assert reasons[0] != store.error
    assert logged(caplog) == [
        (logging.WARNING, f"job 1: store of 2 block(s) failed: {reasons[0]}",
         [1, store.state.name, store.error]),
        (logging.WARNING, f"job 2: load of 1 block(s) failed: {reasons[1]}",
         [2, load.state.name, load.error])]


@pytest.mark.parametrize(("count", "expected"), [
    (1, {"p50": 0.0, "p90": 0.0, "p99": 0.0}),
    (10, {"p50": 5.0, "p90": 9.0, "p99": 9.0}),
    (1000, {"p50": 500.0, "p90": 900.0, "p99": 990.0}),
])
def test_the_latency_percentiles_are_read_from_the_sorted_latencies(
    count: int, expected: dict[str, float],
) -> None:
    """The p50, p90 and p99 of ``count`` latencies 0, 1, ... (kept in any order): the one at
    ``int(q * count)``, the last one at most."""
    books = runner()
    assert books.counts()["latency"] == {}
    books.latencies.extend(float((i * 7) % count) for i in range(count))  # 7 is prime to them
    assert sorted(books.latencies) == [float(i) for i in range(count)]
    assert books.counts()["latency"] == expected


def test_a_users_step_whose_retry_bound_is_spent_is_quarantined_naming_the_step() -> None:
    """A step answering "not yet" (no detail) is quarantined with how many tries were given
    up and what it answered last, said of the step; one that raised keeps what it raised as
    the last error, named once (the ``CallFailed`` the driver made is passed on, not wrapped
    in another)."""
    books = Runner(verify_pending().compile(listen=False),
                   RetryPolicy(max_attempts=2, max_seconds=None))
    pending = submitted(books, 1)
    books.take(pending, "post", Outcome(Answer.DONE))
    for _ in range(2):
        assert answer_due(books, {"verify": Outcome(Pending.PENDING)}) == ["verify"]
    [result] = books.take_results()
    assert result.reason == FailureReason(FailureKind.QUARANTINED, "verify",
                                          "gave up after 2 tries, the last answered PENDING",
                                          None)

    books = Runner(failing_verify_machine().compile(listen=False),
                   RetryPolicy(max_attempts=2, max_seconds=None))
    raising = submitted(books, 2)
    books.take(raising, "post", Outcome(Answer.DONE))
    raised = Outcome(Answer.RAISED, CallFailed("verify", OSError("gone")))
    for _ in range(2):
        assert answer_due(books, {"verify": raised}) == ["verify"]
    [result] = books.take_results()
    assert result.reason == FailureReason(FailureKind.QUARANTINED, "verify",
                                          "retry bound spent; last error: OSError: gone",
                                          "OSError")


def test_a_cancel_before_the_post_answered_fails_the_post_as_interrupted() -> None:
    """A transfer with no handle yet (an interrupt came before NIXL answered its post) is
    failed by the cancel as a post that was interrupted: its reason names ``post`` and says
    so, as an error it raised (PostInterrupted), not as something NIXL answered."""
    books = runner()
    transfer = submitted(books)
    transfer.xfer = None
    books.cancel(transfer)
    assert transfer.state is S.FAILED
    answer_due(books, {END: (OK, CLEAN_OK)})
    [result] = books.take_results()
    assert result.reason == FailureReason(
        FailureKind.RAISED, "post",
        "PostInterrupted: the submit was interrupted before NIXL answered the post",
        "PostInterrupted")


def test_the_running_bound_still_applies_after_the_submit_order_queue_is_compacted() -> None:
    """Hundreds of transfers published while one still runs make the runner compact its
    submit-order queue; the one still running stays in it, and is given up once overdue."""
    books = runner(RetryPolicy(max_running_seconds=5.0))
    slow = submitted(books, 0)
    slow.started_at = time.monotonic()
    books.take(slow, "post", Outcome(Answer.PROC))
    for job_id in range(1, 200):
        transfer = submitted(books, job_id)
        transfer.started_at = time.monotonic()
        books.take(transfer, "post", Outcome(Answer.DONE))
        answer_due(books, {END: (OK, CLEAN_OK)})
    assert len(books.take_results()) == 199
    queue = list(books._by_start or ())
    assert queue[:1] == [slow] and len(queue) < 100, "compacted, the one in flight kept"
    slow.started_at -= 100.0
    assert books.overdue() == []
    assert slow.state is S.QUARANTINED and books.may_run == {slow}


def verifying(books: Runner, job_id: int) -> Transfer:
    """A transfer of :func:`verify_again` that NIXL finished: waiting on ``verify``."""
    transfer = submitted(books, job_id)
    books.take(transfer, "post", Outcome(Answer.PROC))
    books.take(transfer, "poll", Outcome(Answer.DONE))
    assert transfer.state.name == "VERIFYING"
    return transfer


def one_round(books: Runner, answers: dict[str, list[Outcome | tuple[Outcome, Outcome]]],
              ) -> list[tuple[int, str]]:
    """Make every call ``due()`` asks for, each answered by the next of its effect's
    ``answers``; the (job, effect) made, in order (bounded: a loop would show)."""
    made = []
    for transfer, effect in itertools.islice(books.due(), 20):
        made.append((transfer.job_id, effect))
        books.take(transfer, effect, answers[effect].pop(0))
    return made


def test_one_round_goes_on_past_each_transfer_that_stops_and_checks_one_sent_back_to_nixl(
) -> None:
    """One round over four waiting transfers: one whose post was never made (it is made once,
    at submit), one backing off after a failed release, one whose ``verify`` answers AGAIN
    (back into PROCESSING: one state check this round, then no more while NIXL says it still
    runs) and one that is over: each that stops leaves the round to go on with the next."""
    books = Runner(verify_again().compile(listen=False),
                   RetryPolicy(backoff=60.0, max_backoff=60.0))
    unposted = submitted(books, 1)
    books.take(unposted, "post", Outcome(None))
    backing_off = submitted(books, 2)
    books.take(backing_off, "post", Outcome(Answer.DONE))
    books.take(backing_off, END, (Outcome(Answer.RAISED, CallFailed(
        "release_xfer_handle", RuntimeError("busy"))), Outcome(None)))
    again = verifying(books, 3)
    over = submitted(books, 4)
    books.take(over, "post", Outcome(Answer.DONE))
    assert list(books.waiting) == [1, 2, 3, 4]

    made = one_round(books, {"verify": [Outcome(Again.AGAIN)], "poll": [Outcome(Answer.PROC)],
                             END: [(OK, CLEAN_OK)]})
    assert made == [(3, "verify"), (3, "poll"), (4, END)]
    assert again.state.name == "PROCESSING" and books.handles == ["handle-3"]
    assert list(books.waiting) == [1, 2] and [r.job_id for r in books.take_results()] == [4]
    assert list(books.due()) == []


def test_a_transfer_sent_back_to_nixl_that_finished_goes_on_in_the_same_round() -> None:
    """``verify`` answers AGAIN, the state check then says DONE: the transfer is verified
    again and published in the same round."""
    books = Runner(verify_again().compile(listen=False), RetryPolicy())
    verifying(books, 1)
    made = one_round(books, {"verify": [Outcome(Again.AGAIN), Outcome(Again.MATCH)],
                             "poll": [Outcome(Answer.DONE)], END: [(OK, CLEAN_OK)]})
    assert made == [(1, "verify"), (1, "poll"), (1, "verify"), (1, END)]
    [result] = books.take_results()
    assert result.success


def test_due_goes_through_the_transfers_it_is_given_only() -> None:
    """Two transfers wait on their release; ``due([first])`` makes the first's calls only."""
    books = runner()
    first, second = submitted(books, 1), submitted(books, 2)
    for transfer in (first, second):
        books.take(transfer, "post", Outcome(Answer.DONE))
    assert list(books.due([first])) == [(first, END)]
    assert list(books.due()) == [(first, END), (second, END)]


def test_the_running_bound_leaves_a_transfer_that_is_no_longer_running_alone() -> None:
    """A transfer submitted long ago whose release is being retried is past the running
    bound's cutoff but NIXL no longer runs it: the bound does not give it up (the retry
    bound does), it only leaves the submit-order queue."""
    books = runner(RetryPolicy(max_running_seconds=5.0))
    transfer = submitted(books)
    transfer.started_at = time.monotonic() - 100.0
    books.take(transfer, "post", Outcome(Answer.DONE))
    books.take(transfer, END, (Outcome(Answer.RAISED, CallFailed(
        "release_xfer_handle", RuntimeError("busy"))), Outcome(None)))
    assert transfer.state is S.DONE and list(books.waiting) == [1]
    assert books.overdue() == []
    assert transfer.state is S.DONE and books.take_results() == [] and books.may_run == set()
    assert not books._by_start


def test_a_store_whose_commit_outlives_the_running_bound_fails_as_a_commit_timeout() -> None:
    """NIXL finished the store but its commit is not over (the driver's COMMITTING): past the
    running bound it fails as a commit that raised ``TimeoutError``, is handed back for its
    release this round, and its reason says so."""
    books = runner(RetryPolicy(max_running_seconds=5.0))
    transfer = submitted(books)
    transfer.started_at = time.monotonic() - 100.0
    books.take(transfer, "post", Outcome(Answer.PROC))
    books.take(transfer, "poll", Outcome(Answer.PROC, COMMITTING))
    assert transfer.state is S.PROCESSING

    assert books.overdue() == [transfer]
    assert transfer.state is S.FAILED and books.may_run == set()
    answer_due(books, {END: (OK, CLEAN_OK)})
    [result] = books.take_results()
    assert result.reason == FailureReason(
        FailureKind.RAISED, "commit",
        "TimeoutError: not committed 5.0 s after submit (max_running_seconds)", "TimeoutError")


def test_a_release_that_succeeds_at_last_starts_the_next_effect_with_a_fresh_count() -> None:
    """A release that raised once, then succeeds while its cleanup is interrupted: the
    transfer waits in XFER_RELEASED with no failed tries and no backoff left from the
    release."""
    books = runner(RetryPolicy(backoff=0.5, max_backoff=1.0))
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.DONE))
    books.take(transfer, END, (Outcome(Answer.RAISED, CallFailed(
        "release_xfer_handle", RuntimeError("busy"))), Outcome(None)))
    assert transfer.attempts == 1 and transfer.retry_at > 0.0
    with pytest.raises(KeyboardInterrupt):
        books.take(transfer, END, (OK, Outcome(None, None, KeyboardInterrupt())))
    assert transfer.state is S.XFER_RELEASED
    assert (transfer.attempts, transfer.retry_at) == (0, 0.0)


def noisy(heard: list[tuple[int, Any]]) -> Declaration[Any, Any]:
    """The lifecycle with an action on NIXL's PROC (it notes the job and the answer in
    ``heard``): every state check's answer is then fired."""
    def note(transfer: Any, answer: Any, detail: Any) -> None:
        heard.append((transfer.job_id, answer))

    return TRANSFER_MACHINE.extend(
        "noisy", actions={"note": note},
        replace={("PROCESSING", "poll", "running"): {"after": "note"}})


@pytest.mark.parametrize("fired", [False, True], ids=["stays", "fired"])
def test_state_checks_that_do_not_match_the_running_transfers_are_refused(fired: bool) -> None:
    """``take_checks`` takes one answer per handle of :attr:`Runner.handles`: fewer is a
    caller's mistake, refused (a ``ValueError``), not answers paired with the wrong
    transfers. On a machine with an action on PROC, every answer is fired."""
    heard: list[tuple[int, Any]] = []
    machine = noisy(heard) if fired else TRANSFER_MACHINE
    books = Runner(machine.compile(listen=False), RetryPolicy())
    first, second = submitted(books, 1), submitted(books, 2)
    for transfer in (first, second):
        books.take(transfer, "post", Outcome(Answer.PROC))
    with pytest.raises(ValueError, match="zip"):
        books.take_checks(["DONE"])
    answered = books.take_checks(["PROC", "DONE"])
    if not fired:
        assert answered == [(second, "DONE")]
        return
    assert answered == [(first, "PROC"), (second, "DONE")]
    books.take(first, "poll", Outcome(Answer.PROC))
    assert heard == [(1, Answer.PROC)] and first.state.name == "PROCESSING"


def test_a_leak_and_a_listener_that_raised_are_logged_with_the_transfers_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cleanup that leaked logs a warning naming the job, the call and what it raised, with
    that error as the line's NIXL error; a listener that raised logs the exception, naming
    the job; the job is published all the same."""
    caplog.set_level(logging.DEBUG, logger="kvfsm")
    books = runner()

    def broken(transfer: Transfer) -> None:
        raise RuntimeError("listener broke")

    books.on_published.append(broken)
    transfer = submitted(books, 5)
    books.take(transfer, "post", Outcome(Answer.DONE))
    leak = Leak("deregister_memory", "RuntimeError: gone")
    answer_due(books, {END: (OK, Outcome(Answer.LEAKED, (leak,))), "publish": OK})
    [result] = books.take_results()
    assert result.success
    assert logged(caplog) == [
        (logging.WARNING, "job 5 leaked: deregister_memory raised RuntimeError: gone",
         [5, "PUBLISHED", "RuntimeError: gone"]),
        (logging.ERROR, "job 5: an on_published listener raised", [5, "PUBLISHED", None])]
    assert caplog.records[-1].exc_info is not None
    assert str(caplog.records[-1].exc_info[1]) == "listener broke"


def test_a_store_given_up_while_committing_leaves_nothing_behind_for_its_job_id() -> None:
    """A store whose commit was not over is given up (the shutdown deadline): its job id is
    not left marked as committing, so a later job with that id, still running past the
    running bound, is given up as running, not failed as a commit timeout."""
    books = runner(RetryPolicy(max_running_seconds=5.0))
    first = submitted(books, 1)
    books.take(first, "post", Outcome(Answer.PROC))
    books.take(first, "poll", Outcome(Answer.PROC, COMMITTING))
    books.give_up(first, "shutdown deadline passed")
    [result] = books.take_results()
    assert result.reason is not None and result.reason.kind is FailureKind.QUARANTINED

    again = submitted(books, 1)
    again.started_at = time.monotonic() - 100.0
    books.take(again, "post", Outcome(Answer.PROC))
    assert books.overdue() == []
    assert again.state is S.QUARANTINED
    [result] = books.take_results()
    assert result.reason == FailureReason(FailureKind.QUARANTINED, "check_xfer_state",
                                          "still running after 5.0 s", None)


def test_the_submit_order_queue_stays_within_twice_the_transfers_in_flight_and_64() -> None:
    """With 100 transfers running, 300 more are submitted and published one by one: the
    running bound's queue grows to twice the unpublished transfers and 64, never past it, and
    is compacted only then (a compaction costs the queue's length: not one per publish)."""
    books = runner(RetryPolicy(max_running_seconds=3600.0))
    for job_id in range(100):
        books.take(submitted(books, job_id), "post", Outcome(Answer.PROC))
    longest = 0
    for job_id in range(100, 400):
        books.take(submitted(books, job_id), "post", Outcome(Answer.DONE))
        answer_due(books, {END: (OK, CLEAN_OK)})
        assert len(books.records) == 100
        longest = max(longest, len(books._by_start or ()))
    assert longest == 2 * 100 + 64


def test_a_transfer_of_a_machine_of_its_own_quarantined_after_it_succeeded_fails() -> None:
    """A machine extending the lifecycle has states of its own: its QUARANTINED, entered
    after the outcome was latched a success (verified, then the release kept raising), is
    held, and the job fails, as the runner's declaration says; the record, settled as it is
    published, says so too."""
    books = Runner(verify_pending().compile(listen=False),
                   RetryPolicy(max_attempts=1, max_seconds=None))
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.DONE))
    answer_due(books, {"verify": Outcome(Pending.MATCH), END: (Outcome(Answer.RAISED, CallFailed(
        "release_xfer_handle", RuntimeError("busy"))), Outcome(None))})
    assert transfer.state.name == "QUARANTINED" and transfer.success is False
    [result] = books.take_results()
    assert not result.success and result.transfer_size == 0
    assert books.quarantined == [transfer]
    assert result.reason is not None and result.reason.kind is FailureKind.QUARANTINED


def test_a_step_that_moves_on_after_not_yet_leaves_the_release_its_whole_retry_bound() -> None:
    """``verify`` answers "not yet" once, then MATCH: the count of failed tries and the
    backoff start afresh for the release, which is then retried up to its own bound."""
    books = Runner(verify_pending().compile(listen=False),
                   RetryPolicy(max_attempts=2, max_seconds=None, backoff=0.5, max_backoff=0.5))
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.DONE))
    books.take(transfer, "verify", Outcome(Pending.PENDING))
    assert transfer.attempts == 1 and transfer.retry_at > 0.0
    books.take(transfer, "verify", Outcome(Pending.MATCH))
    assert transfer.state.name == "DONE"
    assert (transfer.attempts, transfer.retry_at) == (0, 0.0)
    books.take(transfer, END, (Outcome(Answer.RAISED, CallFailed(
        "release_xfer_handle", RuntimeError("busy"))), Outcome(None)))
    assert transfer.state.name == "DONE" and transfer.attempts == 1


def test_a_users_step_retried_is_logged_under_its_own_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A step's retries and its quarantine name the step, as the NIXL calls name theirs."""
    caplog.set_level(logging.DEBUG, logger="kvfsm")
    books = Runner(failing_verify_machine().compile(listen=False),
                   RetryPolicy(max_attempts=2, max_seconds=None))
    transfer = submitted(books, 4)
    books.take(transfer, "post", Outcome(Answer.DONE))
    raised = Outcome(Answer.RAISED, CallFailed("verify", OSError("gone")))
    books.take(transfer, "verify", raised)
    books.take(transfer, "verify", raised)
    assert [line[:2] for line in logged(caplog)[:2]] == [
        (logging.WARNING, "job 4: verify failed (retry 1): OSError: gone"),
        (logging.ERROR, "job 4 quarantined after 2 failed verify(s): OSError: gone")]


def test_the_runner_says_where_a_posted_transfer_waits_and_keeps_bounded_records() -> None:
    """``posted`` is where post answering PROC leads; the latencies kept are the last 4096,
    the leaks listed the last 256 (all of them counted)."""
    books = runner()
    assert books.posted is S.PROCESSING
    books.latencies.extend(float(i) for i in range(5000))
    assert list(books.latencies) == [float(i) for i in range(904, 5000)]
    leaks = [Leak("deregister_memory", f"error {i}") for i in range(300)]
    books.record_leaks(7, leaks)
    counts = books.counts()
    assert counts["leaks"] == 300 and counts["leaked"] == [(7, leak) for leak in leaks[44:]]


def test_a_store_that_committed_and_went_back_to_nixl_is_not_taken_for_committing() -> None:
    """A store whose commit took a poll more finishes, is sent back to PROCESSING by its
    ``verify`` step and outlives the running bound: it is given up as running, not failed as
    a commit that never ended (its commit mark went with it when it left the running list)."""
    books = Runner(verify_again().compile(listen=False),
                   RetryPolicy(max_running_seconds=5.0))
    transfer = submitted(books)
    transfer.started_at = time.monotonic()
    books.take(transfer, "post", Outcome(Answer.PROC))
    books.take(transfer, "poll", Outcome(Answer.PROC, COMMITTING))
    books.take(transfer, "poll", Outcome(Answer.DONE))
    books.take(transfer, "verify", Outcome(Again.AGAIN))
    assert transfer.state.name == "PROCESSING"
    transfer.started_at -= 100.0
    assert books.overdue() == []
    [result] = books.take_results()
    assert result.reason == FailureReason(FailureKind.QUARANTINED, "check_xfer_state",
                                          "still running after 5.0 s", None)


# -- the poll schedule, counted exactly: one runner, its checks answered and its clock moved --

class Nixl:
    """The state checks of a poll schedule story: each handle answers PROC until the story
    ends it; what each poll asked about is kept (``raise_on``: the calls, counted from 1, that
    raise KeyboardInterrupt, as a signal arriving inside NIXL's call would)."""

    def __init__(self) -> None:
        self.ended: set[str] = set()
        self.asked: list[str] = []
        self.calls = 0
        self.raise_on: set[int] = set()
        self.short = False  # answer one status fewer than the handles asked about

    def __call__(self, handles: list[Any]) -> list[str | Exception]:
        self.calls += 1
        if self.calls in self.raise_on:
            raise KeyboardInterrupt
        self.asked += handles
        answers: list[str | Exception] = [
            "DONE" if handle in self.ended else "PROC" for handle in handles]
        return answers[:-1] if self.short else answers


@pytest.fixture
def moved(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The runner's clock, moved by the story (binary fractions of a second: exact)."""
    clock = Clock()
    monkeypatch.setattr(kvfsm.runner, "time", clock)
    return clock


def scheduled(n: int, limit: float = 1.0, machine: Any = None, first: int = 0,
              books: Runner | None = None) -> tuple[Runner, list[Transfer]]:
    """A runner (every poll scheduled: ``check_all_below=0``) with ``n`` more transfers
    running, job ids from ``first``, in that order."""
    if books is None:
        books = Runner((machine or TRANSFER_MACHINE).compile(listen=False),
                       RetryPolicy(max_unpolled=limit, check_all_below=0))
    transfers = []
    for job_id in range(first, first + n):
        transfer = submitted(books, job_id)
        books.take(transfer, "post", Outcome(Answer.PROC))
        transfers.append(transfer)
    return books, transfers


def poll(books: Runner, nixl: Nixl, everything: bool = False,
         verify: Any = None) -> list[int]:
    """One scheduled poll (a drain's with ``everything``) and the calls due after it, as the
    tier makes them; the job ids asked about, in order. ``verify`` answers the ``verify``
    steps (None: the step is not made this round)."""
    nixl.asked = []
    for transfer, status in books.check_round(nixl, everything):
        books.take(transfer, "poll", Outcome(Answer.DONE if status == "DONE" else status))
    for transfer, effect in books.due():
        if effect == "poll":
            nixl.asked.append(transfer.xfer)
            status = "DONE" if transfer.xfer in nixl.ended else "PROC"
            books.take(transfer, effect, Outcome(Answer.DONE if status == "DONE" else
                                                 Answer.PROC))
        elif effect == "verify":
            if verify is not None:
                books.take(transfer, effect, Outcome(verify(transfer)))
        else:
            books.take(transfer, effect, (OK, CLEAN_OK) if effect == END else OK)
    return [int(handle.rsplit("-", 1)[1]) for handle in nixl.asked]


def assert_queued_as_marked(books: Runner, transfers: list[Transfer]) -> None:
    """The schedule's books: each running transfer is queued once in the oldest-first queue
    and once in the sweep; any transfer's marks say where it is queued."""
    front = collections.Counter(map(id, books._front))
    swept = collections.Counter(id(t) for _, batch in books._sweep for t in batch)
    swept.update(map(id, books._joined))
    for transfer in transfers:
        where = (front[id(transfer)], swept[id(transfer)])
        assert where == (transfer.queued & 1, transfer.queued >> 1), (transfer.job_id, where)
        assert transfer.queued in (0, 1, 2, 3), (transfer.job_id, transfer.queued)
        if transfer.slot >= 0:
            assert transfer.queued == 3, transfer.job_id


def test_a_poll_asks_the_oldest_batch_until_none_ended_and_hands_back_only_what_ended(
        moved: Clock) -> None:
    """With 100 running and no time passed (no share for the sweep), a poll asks about the 16
    oldest; once one of them ended, the next 16 too. Only the one that ended comes back, and
    each of the others is counted as one stay. Kills check_round 1 (everything by default),
    28 and 56 (the PROC answers handed back too) and 64 (the ended one counted as a stay)."""
    books, transfers = scheduled(100)
    nixl = Nixl()
    stay = books.table[S.PROCESSING]["poll"][Answer.PROC]

    assert books.check_round(nixl) == []
    assert nixl.asked == [f"handle-{i}" for i in range(16)] and stay.taken == 16

    nixl.asked = []
    nixl.ended.add("handle-3")
    assert books.check_round(nixl) == [(transfers[3], "DONE")]
    assert nixl.asked == [f"handle-{i}" for i in range(32)]
    assert stay.taken == 16 + 31


@pytest.mark.parametrize("fired", [False, True], ids=["stays", "fired"])
def test_a_poll_whose_answers_do_not_match_what_it_asked_is_refused(
        moved: Clock, fired: bool) -> None:
    """A scheduled poll whose state checks answer one status fewer than the handles asked
    about is refused (a ``ValueError``), not paired with the wrong transfers; on a machine with
    an action on PROC every answer comes back with its transfer. Kills check_round 29-36
    (the fired answers lost or mispaired; the length not checked) and 45, 48, 49 (the
    length not checked where PROC is a stay)."""
    heard: list[tuple[int, Any]] = []
    books, transfers = scheduled(40, machine=noisy(heard) if fired else None)
    nixl = Nixl()
    nixl.ended.add("handle-1")
    answered = books.check_round(nixl)
    if fired:
        assert answered == [(t, "DONE" if t.job_id == 1 else "PROC") for t in transfers[:32]]
    else:
        assert answered == [(transfers[1], "DONE")]
    nixl.short = True
    with pytest.raises(ValueError, match="zip"):
        books.check_round(nixl)


def test_with_a_few_running_each_poll_asks_every_one_once_after_the_oldest_ended(
        moved: Clock) -> None:
    """Five running, none due in the sweep for an hour: each poll asks about all five (the
    oldest-first checks are one short batch). The oldest ends and is published; the newest
    takes its place in the running list, and every later poll still asks about each of the
    four left. Kills _drop_dead_front 5 and 6 (the one in the running list's first place
    taken for ended, and dropped from the oldest-first queue)."""
    books, transfers = scheduled(5, limit=3600.0)
    nixl = Nixl()
    assert poll(books, nixl) == [0, 1, 2, 3, 4]
    nixl.ended.add("handle-0")
    assert poll(books, nixl) == [0, 1, 2, 3, 4]
    assert [r.job_id for r in books.take_results()] == [0]
    for _ in range(3):
        assert poll(books, nixl) == [1, 2, 3, 4]
    assert_queued_as_marked(books, transfers)


def test_the_sweeps_share_goes_on_into_the_next_turn_for_what_it_still_wants_only(
        moved: Clock) -> None:
    """100 running, ``max_unpolled`` 1 s, a poll every 1/4 s: each poll's sweep asks about a
    quarter of them in turn (the 16 oldest are asked first anyway). Ten in the middle end
    without the schedule (a drain found them); the next share walks past them and takes what
    it still wants from the next turn, not more: 23 of the 90 left. Every running transfer
    is still asked about within 1 s. Kills _sweep_share 28 (more taken from the next turn)
    and 43 (the transfers taken from the first turn lost from the sweep)."""
    books, transfers = scheduled(100)
    nixl = Nixl()
    last = {t.job_id: moved.now for t in transfers}

    def asked() -> list[int]:
        job_ids = poll(books, nixl)
        last.update(dict.fromkeys(job_ids, moved.now))
        return job_ids

    assert asked() == list(range(16))
    moved.advance(0.25)
    assert asked() == list(range(25))
    moved.advance(0.25)
    assert asked() == list(range(16)) + list(range(25, 50))
    for transfer in transfers[50:60]:
        books.take(transfer, "poll", Outcome(Answer.DONE))
    answer_due(books, {END: (OK, CLEAN_OK)})
    assert len(books.take_results()) == 10
    moved.advance(0.25)
    # a share of ceil(90 / 4) = 23: the 13 running of 50..72, then 10 of the next turn
    assert asked() == list(range(16)) + list(range(60, 83))
    for _ in range(12):
        moved.advance(0.25)
        asked()
        assert all(moved.now - last[t.job_id] <= 1.0 for t in transfers if t.slot >= 0)
    assert_queued_as_marked(books, transfers)


def test_a_share_the_state_checks_never_answered_is_asked_about_at_the_next_poll(
        moved: Clock) -> None:
    """The sweep's state checks raise KeyboardInterrupt: the share they did not answer is
    due at once, so the next poll, with no time passed (no share of its own), asks about it
    all. Kills _sweep_undo 2 (that share put last in turn instead)."""
    books, _ = scheduled(64)
    nixl = Nixl()
    assert poll(books, nixl) == list(range(16))
    moved.advance(0.5)
    nixl.raise_on = {nixl.calls + 2}  # the oldest batch is answered, the sweep's share not
    with pytest.raises(KeyboardInterrupt):
        poll(books, nixl)
    assert poll(books, nixl) == list(range(32))
    assert poll(books, nixl) == list(range(16))  # nothing more is due


@pytest.mark.timeout(10)
def test_a_turn_comes_max_unpolled_after_the_first_of_its_batch_started_running(
        moved: Clock) -> None:
    """One transfer starts running, half a second later 63 more; a drain asks about them all
    just then, and a second later once more, so the polls right after each have no share of
    their own. The 64 turns are due one second after the first of them started: the poll at
    exactly that time asks about all 64 (the bound is inclusive), not only the oldest 16.
    Kills _schedule 9 (the batch timed from its last transfer), _sweep_share 24 (a turn due
    exactly now left for later) and 30 (a turn due now cut to the share: a loop that never
    ends)."""
    books, transfers = scheduled(1)
    moved.advance(0.5)
    books, more = scheduled(63, first=1, books=books)
    nixl = Nixl()
    assert len(poll(books, nixl, everything=True)) == 64
    assert poll(books, nixl) == list(range(16))
    moved.advance(0.5)
    assert len(poll(books, nixl, everything=True)) == 64
    assert poll(books, nixl) == list(range(64))
    assert_queued_as_marked(books, transfers + more)


def test_a_transfer_running_exactly_max_running_seconds_is_given_up(moved: Clock) -> None:
    """The running bound is inclusive: a transfer submitted exactly ``max_running_seconds``
    ago is given up, one submitted a moment later is not. Kills overdue 9."""
    books = runner(RetryPolicy(max_running_seconds=5.0))
    first, second = submitted(books, 1), submitted(books, 2)
    first.started_at, second.started_at = moved.now - 5.0, moved.now - 4.75
    for transfer in (first, second):
        books.take(transfer, "post", Outcome(Answer.PROC))
    assert books.overdue() == []
    assert (first.state, second.state) == (S.QUARANTINED, S.PROCESSING)


def test_a_release_is_retried_once_exactly_its_backoff_has_passed(moved: Clock) -> None:
    """A release that raised waits out its backoff (1/2 s): nothing is due a moment before,
    the retry is due at exactly its time. Kills due 23."""
    books = runner(RetryPolicy(backoff=0.5, max_backoff=0.5))
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.DONE))
    books.take(transfer, END, (Outcome(Answer.RAISED, CallFailed(
        "release_xfer_handle", RuntimeError("busy"))), Outcome(None)))
    assert transfer.retry_at == moved.now + 0.5
    moved.advance(0.25)
    assert list(books.due()) == []
    moved.advance(0.25)
    assert list(books.due()) == [(transfer, END)]


def test_transfers_that_leave_the_running_states_and_come_back_stay_on_schedule(
        moved: Clock) -> None:
    """A story of 300 polls, 1/8 s apart, ``max_unpolled`` 1 s, about 40 transfers running:
    NIXL says some are done, in any order; their ``verify`` step keeps them a few polls, then
    sends them back to NIXL (AGAIN) or lets them succeed (a new transfer starts in place of
    each). Every poll asks about each transfer at most once (one the step sends back to NIXL:
    once more, in the same round); each running transfer is asked about within 1 s and the
    gap between polls; and a transfer that left and came back, met while away by the
    oldest-first checks, the sweep or both, is queued once in each, its marks saying so.
    Kills _drop_dead_front 8, 9 and 10 and _sweep_share 35-42 (a mark lost, or set for a
    queue that no longer holds the transfer, or a running one dropped from the sweep: a
    transfer queued twice, or nowhere)."""
    rng = random.Random(7)
    books, transfers = scheduled(40, machine=verify_again())
    nixl = Nixl()
    tick, limit = 0.125, 1.0
    away: dict[int, int] = {}  # job id: polls left in VERIFYING
    last = {t.job_id: moved.now for t in transfers}
    next_job = 40
    sent_back: set[int] = set()  # this poll's

    def verify(transfer: Transfer) -> Any:
        left = away.setdefault(transfer.job_id, rng.choice([0, 1, 2, 3, 5, 8, 13]))
        if left:
            away[transfer.job_id] = left - 1
            return None  # not this round
        del away[transfer.job_id]
        if rng.random() < 0.2:
            return Again.MATCH
        nixl.ended.discard(transfer.xfer)
        sent_back.add(transfer.job_id)
        return Again.AGAIN

    for _ in range(300):
        moved.advance(tick)
        running = [t for t in transfers if t.slot >= 0]
        nixl.ended.update(t.xfer for t in rng.sample(running, 3))
        sent_back.clear()
        asked = poll(books, nixl, verify=verify)
        twice = collections.Counter(asked) - collections.Counter(set(asked))
        # only one sent back to NIXL this poll is asked about again (by the step's round)
        assert set(twice) <= sent_back and set(twice.values()) <= {1}, twice
        last.update(dict.fromkeys(asked, moved.now))
        late = [t.job_id for t in transfers
                if t.slot >= 0 and moved.now - last[t.job_id] > limit + tick]
        assert late == []
        for result in books.take_results():
            assert result.success
            _, [started] = scheduled(1, first=next_job, books=books)
            transfers.append(started)
            last[next_job] = moved.now
            next_job += 1
        assert_queued_as_marked(books, transfers)
    assert next_job > 60, "transfers were published and replaced"


def test_the_schedules_queues_are_compacted_at_twice_what_runs_and_64_keeping_each_turn(
        moved: Clock) -> None:
    """100 transfers run (two turns in the sweep after two polls); one more left for its
    ``verify`` step. Then 300 more start and end one by one with no poll between: the
    oldest-first queue grows to twice the running transfers and 64, never past it, and is
    then compacted: it holds the running transfers, oldest first; the sweep keeps its turns
    with what runs in them, the batch that joined since the last poll only the one running;
    every transfer dropped is unmarked. The one that was away comes back, is queued again,
    and every running transfer is asked about within ``max_unpolled``. Kills _schedule 14-18
    (another bound) and _compact_schedule 1-6, 9, 15, 20, 22 and 26 (a running transfer
    dropped, an ended one kept, a mark wrong, a turn lost or broken)."""
    books, transfers = scheduled(101, machine=verify_again())
    away = transfers[100]
    nixl = Nixl()
    poll(books, nixl)
    moved.advance(0.5)
    poll(books, nixl)  # a share of 51: the turns of 0..50 are now due 1/2 s after 51..100
    books.take(away, "poll", Outcome(Answer.DONE))
    assert away.state.name == "VERIFYING" and away.queued == 3
    longest, compacted = 0, False
    for job_id in range(1000, 1300):
        _, [transfer] = scheduled(1, first=job_id, books=books)
        transfers.append(transfer)
        front = [t.job_id for t in books._front]
        longest = max(longest, len(front))
        if not compacted and len(front) < longest:
            compacted = True
            assert front == [*range(100), job_id]
            assert [t.job_id for t in books._joined] == [job_id]
            assert [(due, [t.job_id for t in batch]) for due, batch in books._sweep] == [
                (1001.0, list(range(51, 100))), (1001.5, list(range(51)))]
            assert away.queued == 0
            assert_queued_as_marked(books, transfers)
        books.take(transfer, "poll", Outcome(Answer.DONE))
        books.take(transfer, "verify", Outcome(Again.MATCH))
        books.take(transfer, END, (OK, CLEAN_OK))
    assert compacted and longest == 2 * 101 + 64
    assert len(books.take_results()) == 300

    books.take(away, "verify", Outcome(Again.AGAIN))
    assert away.slot >= 0 and books._front[-1] is away
    assert_queued_as_marked(books, transfers)
    last = {t.job_id: moved.now for t in transfers}
    for _ in range(24):
        moved.advance(0.125)
        asked = poll(books, nixl)
        assert len(asked) == len(set(asked))
        last.update(dict.fromkeys(asked, moved.now))
        assert all(moved.now - last[t.job_id] <= 1.125 for t in transfers if t.slot >= 0)
    assert_queued_as_marked(books, transfers)


def audited() -> Declaration[Any, Any]:
    """The lifecycle with a user step ``audit`` between the release and the cleanup of a
    transfer that succeeded (whose state also answers a ``clean``, as its effect does not),
    and a failed transfer's release that publishes it at once."""
    return TRANSFER_MACHINE.extend(
        "audited", states=["AUDITING"],
        replace={("DONE", "release", "released"): {"dest": "AUDITING"},
                 ("FAILED", "release", "released"): {"dest": "PUBLISHED"}},
        answers={"audit": (Answer.OK, Answer.RAISED, Answer.EXHAUSTED)},
        guards={"audited": (Answer.OK,), "audit_raised": (Answer.RAISED,)},
        transitions=[
            {"trigger": "audit", "source": "AUDITING", "dest": "XFER_RELEASED",
             "conditions": "audited"},
            {"trigger": "audit", "source": "AUDITING", "dest": "AUDITING",
             "conditions": "audit_raised"},
            {"trigger": "audit", "source": "AUDITING", "dest": "QUARANTINED",
             "conditions": "exhausted", "after": "quarantine"},
            {"trigger": "clean", "source": "AUDITING", "dest": "CLEANED",
             "conditions": "cleaned"},
            {"trigger": "clean", "source": "AUDITING", "dest": "CLEANED",
             "conditions": "leaked", "after": "record_leaks"},
            {"trigger": "cancel", "source": "AUDITING", "dest": "AUDITING"}],
        effects={"AUDITING": "audit"})


def test_an_ending_the_table_does_not_lead_through_release_clean_and_publish_runs_by_steps(
) -> None:
    """A machine whose release leads to a step of the user's (the state it waits in answers a
    ``clean`` too, though its effect is ``audit``), or straight to a final state: no ending is
    one chain; the runner is built, and each transfer's calls come one by one as the table
    says. Kills _ending_chain 6, 8, 10 and 12 (a state, or an event, missing from the table
    taken for a table) and 14 (an edge taken for the ending though the state waits on
    another effect)."""
    books = Runner(audited().compile(listen=False), RetryPolicy())
    assert books._ending == {}
    done, failed = submitted(books, 1), submitted(books, 2)
    books.take(done, "post", Outcome(Answer.DONE))
    books.take(failed, "post", Outcome(Answer.ERR, CallFailed("post", "ERR")))
    made = answer_due(books, {"release": OK, "audit": OK, "clean": CLEAN_OK, "publish": OK})
    assert made == ["release", "audit", "clean", "publish", "release"]
    assert [(r.job_id, r.success) for r in books.take_results()] == [(1, True), (2, False)]
