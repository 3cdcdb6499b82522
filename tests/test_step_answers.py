"""What a user's step returns, as the driver takes it (``TransferDriver.step``).

A step returns one of its event's answers, or ``(answer, why)`` (``why`` None: none). Anything
else fails its job (the step's event answering RAISED) with a reason saying what the step
returned and what it may return (ERR, the step as the call: it returned, it did not raise): the
answers its event takes, by name. The mistakes a newcomer makes are named as such: a tuple of
three, the answer's name instead of the answer, RAISED returned instead of raised, and a member
of a copy of the answers' Enum (a class of the same name in another module: both modules are
named, as the two read alike).
"""

from __future__ import annotations

import enum
from typing import Any

import pytest
import torch

from kvfsm import FailureKind, TransferJob
from kvfsm.lifecycle import Answer
from kvfsm.testing import FakeNixlAgent
from kvfsm.tiers import ObjectStoreTier

from . import test_mutants_extend
from .test_mutants_lifecycle import run_one_store


class Checked(enum.Enum):
    """A copy of the Enum the machine's ``verify`` answers are members of, in another module."""

    GOOD = "GOOD"
    BAD = "BAD"


#: the result of one store through a tier whose ``verify`` step is the one given (released and
#: cleaned up as any failed job: no misuse of the agent)
store_with = run_one_store


def refused(returned: Any) -> str:
    """Why a store whose step returned ``returned`` failed."""
    result = store_with(lambda transfer, primary: returned)
    assert not result.success
    assert result.reason.kind is FailureKind.ERR and result.reason.call == "verify"
    assert str(result.reason) == f"verify {result.reason.error}", "it says what it did"
    return f"step 'verify' {result.reason.error}"


THEIRS = test_mutants_extend.Checked  # the class the machine's answers are members of


def test_a_step_returning_three_things_is_told_what_it_may_return() -> None:
    assert refused((THEIRS.GOOD, "matched", 3)) == (
        "step 'verify' returned (<Checked.GOOD: 'GOOD'>, 'matched', 3), a tuple of 3 items; a "
        "step returns its answer (Checked.BAD, Checked.GOOD), or (answer, why)")


def test_a_pair_the_wrong_way_round_is_told_the_answer_goes_first() -> None:
    """``(why, answer)``: it was told only that the why is no answer."""
    assert refused(("matched", THEIRS.GOOD)) == (
        "step 'verify' answered str 'matched', which is not one of its event's answers "
        "(Checked.BAD, Checked.GOOD); it returned ('matched', <Checked.GOOD: 'GOOD'>): a step "
        "returns (answer, why), the answer first")


def test_a_why_of_any_kind_is_kept_as_text_and_none_is_no_why() -> None:
    """A why is what the step says of its answer: a number is kept as text, as a str is."""
    said = store_with(lambda transfer, primary: (THEIRS.BAD, 3))
    assert str(said.reason) == "verify answered BAD: 3"
    assert store_with(lambda transfer, primary: (THEIRS.GOOD, None)).success
    assert store_with(lambda transfer, primary: (THEIRS.GOOD, "all blocks match")).success


def test_a_why_whose_truth_value_raises_is_kept_as_text() -> None:
    """A tensor of the blocks that differ, given as the why: its truth value raises, and every
    poll raised with it, the job never published; it is kept as text."""
    said = store_with(lambda transfer, primary: (THEIRS.BAD, torch.tensor([0, 3])))
    assert str(said.reason) == "verify answered BAD: tensor([0, 3])"


class Valued(enum.StrEnum):
    MATCH = "match"
    MISMATCH = "mismatch"


def test_a_value_equal_to_an_answer_is_that_answer() -> None:
    """A StrEnum's member equals its value: a step returning "match" answered MATCH (as it
    did before answers were checked by their class)."""
    from kvfsm import TRANSFER_MACHINE  # noqa: PLC0415

    machine = TRANSFER_MACHINE.extend(
        "valued", states=["VERIFYING"],
        replace={("SUBMITTED", "post", "finished"): {"dest": "VERIFYING", "after": []},
                 ("PROCESSING", "poll", "finished"): {"dest": "VERIFYING", "after": []}},
        answers={"verify": (Valued.MATCH, Valued.MISMATCH, Answer.RAISED)},
        guards={"matched": (Valued.MATCH,), "unmatched": (Valued.MISMATCH, Answer.RAISED)},
        transitions=[
            {"trigger": "verify", "source": "VERIFYING", "dest": "DONE",
             "conditions": "matched", "after": "latch_success"},
            {"trigger": "verify", "source": "VERIFYING", "dest": "FAILED",
             "conditions": "unmatched", "after": "latch_failure"},
            {"trigger": "cancel", "source": "VERIFYING", "dest": "VERIFYING"},
        ],
        effects={"VERIFYING": "verify"})

    def store(returned: Any) -> Any:
        tier = ObjectStoreTier(torch.zeros(4, 8), agent=FakeNixlAgent(), machine=machine,
                               steps={"verify": lambda transfer, primary: returned})
        tier.submit_store(TransferJob(1, ["a"], [0]))
        tier.drain_jobs(timeout=5)
        [result] = tier.get_finished_jobs()
        tier.shutdown(timeout=5)
        return result

    assert store("match").success
    failed = store("mismatch")
    assert str(failed.reason) == "verify answered MISMATCH"


def test_a_member_of_a_copy_of_the_answers_enum_is_named_with_both_modules() -> None:
    message = (
        "step 'verify' answered tests.test_step_answers.Checked.GOOD, which is not one of its "
        "event's answers (Checked.BAD, Checked.GOOD): the event takes "
        "tests.test_mutants_extend.Checked members, another class of the same name; answer "
        "with the class the machine declares")
    assert refused(Checked.GOOD) == message
    assert refused((Checked.GOOD, "matched")) == message


@pytest.mark.parametrize(("returned", "message"), [
    ("GOOD", "step 'verify' answered str 'GOOD', which is not one of its event's answers "
             "(Checked.BAD, Checked.GOOD); answer the member Checked.GOOD, not its name"),
    (Answer.RAISED, "step 'verify' answered Answer.RAISED, which a step answers by raising an "
                    "exception, not by returning it; it returns one of Checked.BAD, "
                    "Checked.GOOD"),
    (Answer.OK, "step 'verify' answered Answer.OK, which is not one of its event's answers "
                "(Checked.BAD, Checked.GOOD)"),
    (["GOOD"], "step 'verify' answered list ['GOOD'], which is not one of its event's answers "
               "(Checked.BAD, Checked.GOOD)"),
    (None, "step 'verify' answered NoneType None, which is not one of its event's answers "
           "(Checked.BAD, Checked.GOOD)"),
], ids=["a name", "RAISED", "another event's answer", "a list", "nothing"])
def test_what_is_not_an_answer_is_named_with_the_answers_the_event_takes(
        returned: Any, message: str) -> None:
    assert refused(returned) == message
