"""The runner's count of the stays it never fires (docs/testing.md, "Mutation testing").

A running transfer that NIXL says is still running (PROC) stays where it is; the runner does
not fire that stay but counts it, once per transfer per poll round, so transition coverage and
``transition_counts`` see it. mutmut found that no test checked the counts in a round where
some transfers answered and others stayed, or over more than one round: mutants that counted
the answered ones too, counted a round instead of adding it, or subtracted it, survived.
"""

from __future__ import annotations

from kvfsm.driver import Outcome
from kvfsm.lifecycle import Answer

from .test_runner import S, runner, submitted


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

