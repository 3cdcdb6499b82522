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

import itertools
import logging
import time
from typing import Any

import pytest

from kvfsm import TRANSFER_MACHINE, Declaration, FailureKind, FailureReason, TransferJob
from kvfsm.driver import Outcome
from kvfsm.lifecycle import Answer, CallFailed
from kvfsm.policy import RetryPolicy
from kvfsm.runner import COMMITTING, END, Runner
from kvfsm.transfer import Leak, Transfer

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
    """A step answering "not yet" (no detail) is quarantined with "retry bound spent" said of
    the step; one that raised keeps what it raised as the last error, named once (the
    ``CallFailed`` the driver made is passed on, not wrapped in another)."""
    books = Runner(verify_pending().compile(listen=False),
                   RetryPolicy(max_attempts=2, max_seconds=None))
    pending = submitted(books, 1)
    books.take(pending, "post", Outcome(Answer.DONE))
    for _ in range(2):
        assert answer_due(books, {"verify": Outcome(Pending.PENDING)}) == ["verify"]
    [result] = books.take_results()
    assert result.reason == FailureReason(FailureKind.QUARANTINED, "verify",
                                          "retry bound spent", None)

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
    assert slow.state is S.QUARANTINED and books.may_run == {0}


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
    held, and the job fails, as the runner's declaration says."""
    books = Runner(verify_pending().compile(listen=False),
                   RetryPolicy(max_attempts=1, max_seconds=None))
    transfer = submitted(books)
    books.take(transfer, "post", Outcome(Answer.DONE))
    answer_due(books, {"verify": Outcome(Pending.MATCH), END: (Outcome(Answer.RAISED, CallFailed(
        "release_xfer_handle", RuntimeError("busy"))), Outcome(None))})
    assert transfer.state.name == "QUARANTINED" and transfer.success is True
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
