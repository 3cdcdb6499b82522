"""The driver where mutmut found it untested (docs/testing.md, "Mutation testing").

kvfsm/driver.py makes the NIXL calls and refuses, before any call, a lifecycle it cannot run
(``check_runnable``). The run of every mutant of the module found these untested, each stated
whole here:

* the refusals of ``check_runnable`` no test read whole (a word, a separator or a condition
  changed, and only the first words of the message were matched), and those no test reached
  at all: an initial state that does not wait on ``post``, a running state that waits on
  something else than the state check, ``post`` answering PROC into a state that is not
  running, a driver effect whose event lacks answers the driver gives, a step whose event
  cannot carry RAISED, a state retried in place with no give-up edge at all;
* the state check a transfer gets in the same round when a step sends it back into a running
  state (``TransferDriver._poll_one``: the one maker of the ``poll`` effect), which no shipped
  lifecycle does;
* what ``StorageSide``'s defaults mean to a subclass that calls them;
* a step that answers RAISED itself instead of raising.

Mutant numbers are mutmut's (``cd build/mutation && ../../.venv/bin/mutmut show NAME``).
"""

from __future__ import annotations

import enum
from typing import Any

import pytest
import torch

from examples.verify_lifecycle import VERIFY_MACHINE
from kvfsm import TRANSFER_MACHINE, Declaration, TransferJob
from kvfsm.driver import (
    BULK_CHECKS,
    MachineRefused,
    StorageSide,
    TransferDriver,
    check_runnable,
)
from kvfsm.engine import COMPILE_LISTENERS
from kvfsm.lifecycle import Answer, CallFailed
from kvfsm.machines.transfer import FailureKind, FailureReason
from kvfsm.policy import RetryPolicy
from kvfsm.runner import Outcome
from kvfsm.testing import FakeNixlAgent, Raise
from kvfsm.transfer import Leak, Transfer

from .test_runner import _Tier

A = Answer
ANY_POLICY = RetryPolicy()


# -- check_runnable: every refusal, word for word ----------------------------------------------

class Tiny(enum.Enum):
    """The smallest lifecycle a tier runs: posted, running, over, freed (its handle released),
    gone (its descriptors too), or held (its release given up)."""

    SENT = 1
    RUNNING = 2
    OVER = 3
    GONE = 4
    HELD = 5
    FREED = 6


def tiny(name: str, *, post: tuple[Answer, ...] = (A.PROC, A.DONE, A.ERR, A.RAISED),
         effects: dict[Tiny, str] | None = None, running: tuple[Tiny, ...] = (Tiny.RUNNING,),
         posted: Tiny = Tiny.RUNNING, extra: tuple[dict[str, Any], ...] = (),
         unreachable: tuple[Tiny, ...] = ()) -> Declaration[Any, Any]:
    """:class:`Tiny`'s lifecycle, ``post`` answering PROC leading to ``posted``."""
    return Declaration(
        name, states=Tiny, initial=Tiny.SENT,
        answers={"post": post, "poll": (A.PROC, A.DONE, A.ERR, A.RAISED),
                 "release": (A.OK, A.RAISED, A.EXHAUSTED), "clean": (A.OK, A.LEAKED),
                 "cancel": (A.OK,)},
        guards={"running": (A.PROC,), "posted": tuple(a for a in post if a is not A.PROC),
                "polled": (A.DONE, A.ERR, A.RAISED), "released": (A.OK,),
                "release_raised": (A.RAISED,), "gave_up": (A.EXHAUSTED,),
                "cleaned": (A.OK, A.LEAKED)},
        actions={}, transitions=[
            {"trigger": "post", "source": Tiny.SENT, "dest": posted, "conditions": "running"},
            {"trigger": "post", "source": Tiny.SENT, "dest": Tiny.OVER, "conditions": "posted"},
            {"trigger": "poll", "source": Tiny.RUNNING, "dest": Tiny.RUNNING,
             "conditions": "running"},
            {"trigger": "poll", "source": Tiny.RUNNING, "dest": Tiny.OVER, "conditions": "polled"},
            {"trigger": "cancel", "source": Tiny.RUNNING, "dest": Tiny.RUNNING},
            {"trigger": "release", "source": Tiny.OVER, "dest": Tiny.FREED,
             "conditions": "released"},
            {"trigger": "release", "source": Tiny.OVER, "dest": Tiny.OVER,
             "conditions": "release_raised"},
            {"trigger": "release", "source": Tiny.OVER, "dest": Tiny.HELD,
             "conditions": "gave_up"},
            {"trigger": "cancel", "source": Tiny.OVER, "dest": Tiny.OVER},
            {"trigger": "clean", "source": Tiny.FREED, "dest": Tiny.GONE, "conditions": "cleaned"},
            {"trigger": "cancel", "source": Tiny.FREED, "dest": Tiny.FREED},
            *extra],
        final=(Tiny.GONE, Tiny.HELD), failure_states=(Tiny.HELD,), unreachable=unreachable,
        effects=({Tiny.SENT: "post", Tiny.RUNNING: "poll", Tiny.OVER: "release",
                  Tiny.FREED: "clean"} if effects is None else effects),
        running=running)


def refusal(machine: Declaration[Any, Any], steps: dict[str, Any] | None = None,
            policy: RetryPolicy = ANY_POLICY) -> str:
    with pytest.raises(MachineRefused) as refused:
        check_runnable(machine, steps or {}, policy)
    return str(refused.value)


def test_the_tiny_lifecycle_is_runnable_as_declared() -> None:
    """The base of the refusals below: each changes one thing of a lifecycle that runs."""
    check_runnable(tiny("tiny"), {}, RetryPolicy(max_running_seconds=None))


def test_checking_a_machine_compiles_it_unseen_by_transition_coverage() -> None:
    """``check_runnable`` compiles the declaration only to read its table: the compile is not
    told to the coverage listeners (a mutant that did made every tier's check count as one
    more machine run with no transition taken)."""
    compiled: list[str] = []
    COMPILE_LISTENERS.append(lambda machine: compiled.append(machine.name))
    try:
        check_runnable(tiny("unseen"), {}, ANY_POLICY)
        tiny("seen").compile()
    finally:
        COMPILE_LISTENERS.pop()
    assert compiled == ["seen"]


def test_a_machine_without_effects_is_refused_saying_what_a_tier_needs() -> None:
    """check_runnable 1-...: the second half of the message (a plain string beside the
    f-string) was never read."""
    assert refusal(tiny("bare", effects={}, running=())) == (
        "machine 'bare' declares no effects: a tier needs, for each state a transfer waits "
        "in, the effect it waits on (effects=) and the states NIXL may run it in (running=)")


def test_an_initial_state_that_does_not_wait_on_post_is_refused_naming_what_it_waits_on(
) -> None:
    """No test declared an initial state waiting on anything but ``post``: a mutant that
    compared with ``==`` refused every machine but that one, and one asking the effect of
    another state went unnoticed."""
    machine = tiny("released_first", effects={Tiny.SENT: "release", Tiny.RUNNING: "poll",
                                              Tiny.OVER: "release", Tiny.FREED: "clean"},
                   extra=({"trigger": "release", "source": Tiny.SENT, "dest": Tiny.OVER},))
    assert refusal(machine) == (
        "machine 'released_first': the initial state SENT waits on 'release'; a tier posts a "
        "transfer from its initial state, which waits on 'post'")


def test_post_answering_proc_into_a_state_that_is_not_running_is_refused() -> None:
    """The check after the loop over the states: NIXL runs a transfer once posted, so the
    state it goes to must be polled, never released."""
    machine = tiny("posted_over", posted=Tiny.OVER, unreachable=(Tiny.RUNNING,))
    assert refusal(machine) == (
        "machine 'posted_over': 'post' answering PROC leads SENT to OVER, which is not "
        "running= (NIXL runs the transfer)")


def test_a_running_state_waiting_on_another_effect_than_the_state_check_is_refused() -> None:
    """The other half of ``(state in running) != (effect == poll)``: only a state that polls
    but is not running was refused by a test."""
    machine = tiny("run_release", effects={Tiny.SENT: "post", Tiny.RUNNING: "release",
                                           Tiny.OVER: "release", Tiny.FREED: "clean"},
                   extra=({"trigger": "release", "source": Tiny.RUNNING, "dest": Tiny.OVER},))
    assert refusal(machine) == (
        "machine 'run_release': state RUNNING is running and waits on 'release', not on the "
        "state check 'poll'")


def test_a_state_polled_but_not_running_is_refused_saying_what_would_go_wrong() -> None:
    """The end of the message (the last plain string of it) was never read."""
    assert refusal(tiny("polled_idle", running=())) == (
        "machine 'polled_idle': state RUNNING waits on the state check 'poll' but is not "
        "running= (its transfer would be released while NIXL may run it)")


def test_an_effect_whose_event_lacks_answers_the_driver_gives_is_refused_naming_them() -> None:
    """``post`` carrying only PROC and DONE: the driver also answers ERR and RAISED. Names
    several missing answers, sorted and comma separated."""
    machine = tiny("short_post", post=(A.PROC, A.DONE))
    assert refusal(machine) == (
        "machine 'short_post': state SENT waits on 'post', whose event does not carry ERR, "
        "RAISED: the driver answers it so")


def test_an_effect_nobody_makes_is_refused_naming_the_effects_the_tier_makes() -> None:
    """The effects the driver makes, listed comma separated: the tests matched the start."""
    assert refusal(VERIFY_MACHINE) == (
        "machine 'verify': state VERIFYING waits on effect 'verify', which the tier "
        "does not make (post, poll, release, clean, publish) and no step was given for "
        "(steps={'verify': ...})")


def test_a_state_that_is_over_without_a_cancel_edge_is_refused_saying_what_a_stay_means(
) -> None:
    """The end of the message (the last plain strings of it) was never read."""
    machine = tiny("uncancellable", extra=())
    machine = Declaration(
        "uncancellable", states=Tiny, initial=Tiny.SENT, answers=machine.answers,
        guards=machine.guards, actions={}, final=machine.final, effects=machine.effects,
        running=machine.running,
        transitions=[t for t in machine.transitions
                     if (t["trigger"], t["source"]) != ("cancel", Tiny.OVER)])
    assert refusal(machine) == (
        "machine 'uncancellable': state OVER declares no 'cancel' edge: a cancel() or "
        "shutdown() may come while a transfer waits here, and the table must say what it "
        "means (a stay keeps the outcome)")


class Pending(enum.Enum):
    """What a ``verify`` step answers: the blocks match, or not yet."""

    MATCH = "MATCH"
    PENDING = "PENDING"


def verifying(name: str, answers: tuple[Any, ...],
              transitions: tuple[dict[str, Any], ...] = (),
              guards: dict[str, tuple[Any, ...]] | None = None) -> Declaration[Any, Any]:
    """The lifecycle with a ``verify`` step after NIXL's DONE, carrying ``answers``."""
    base: Declaration[Any, Any] = TRANSFER_MACHINE
    return base.extend(
        name, states=["VERIFYING"],
        replace={("SUBMITTED", "post", "finished"): {"dest": "VERIFYING", "after": []},
                 ("PROCESSING", "poll", "finished"): {"dest": "VERIFYING", "after": []}},
        answers={"verify": answers},
        guards={"matched": (Pending.MATCH,), "pending": (Pending.PENDING,), **(guards or {})},
        transitions=[
            {"trigger": "verify", "source": "VERIFYING", "dest": "DONE",
             "conditions": "matched", "after": "latch_success"},
            {"trigger": "verify", "source": "VERIFYING", "dest": "VERIFYING",
             "conditions": "pending"},
            {"trigger": "cancel", "source": "VERIFYING", "dest": "VERIFYING"},
            *transitions],
        effects={"VERIFYING": "verify"})


def test_a_step_whose_event_cannot_carry_raised_is_refused() -> None:
    """A step that raises answers RAISED: its event must carry it. No test declared a step
    event without it."""
    machine = verifying("verify_unraisable", (Pending.MATCH, Pending.PENDING))
    assert refusal(machine, {"verify": None}) == (
        "machine 'verify_unraisable': state VERIFYING waits on the step 'verify', whose event "
        "does not carry Answer.RAISED: a step that raises answers it")


def test_a_state_retried_in_place_with_no_give_up_edge_at_all_is_refused() -> None:
    """The tests declared a give-up edge that stays (EXHAUSTED answered back into the state);
    none declared no EXHAUSTED edge at all, where ``or`` made ``and`` reads the destination
    of no edge. The message names who needs the edge: the words of ``who`` were never read."""
    machine = verifying("verify_unbounded", (Pending.MATCH, Pending.PENDING, A.RAISED),
                        ({"trigger": "verify", "source": "VERIFYING", "dest": "FAILED",
                          "conditions": "step_raised", "after": "latch_failure"},),
                        {"step_raised": (A.RAISED,)})
    assert refusal(machine, {"verify": None}) == (
        "machine 'verify_unbounded': state VERIFYING has no give-up edge ('verify' answering "
        "EXHAUSTED to another state), which the retry bound and the shutdown deadline need")


# -- a step that sends its transfer back into a running state ----------------------------------

class Again(enum.Enum):
    """What a ``settle`` step answers: the store is settled, or NIXL should be asked again."""

    SETTLED = "SETTLED"
    AGAIN = "AGAIN"


def settle_again() -> Declaration[Any, Any]:
    """The lifecycle with a step ``settle`` after NIXL's DONE that may send the transfer back
    to PROCESSING, to be asked about by the state check again (and a give-up, which fails
    it: a state on a circle needs one)."""
    base: Declaration[Any, Any] = TRANSFER_MACHINE
    return base.extend(
        "settle_again", states=["SETTLING"],
        replace={("SUBMITTED", "post", "finished"): {"dest": "SETTLING", "after": []},
                 ("PROCESSING", "poll", "finished"): {"dest": "SETTLING", "after": []}},
        answers={"settle": (Again.SETTLED, Again.AGAIN, A.RAISED, A.EXHAUSTED)},
        guards={"settled": (Again.SETTLED,), "again": (Again.AGAIN,),
                "step_raised": (A.RAISED, A.EXHAUSTED)},
        transitions=[
            {"trigger": "settle", "source": "SETTLING", "dest": "DONE",
             "conditions": "settled", "after": "latch_success"},
            {"trigger": "settle", "source": "SETTLING", "dest": "PROCESSING",
             "conditions": "again"},
            {"trigger": "settle", "source": "SETTLING", "dest": "FAILED",
             "conditions": "step_raised", "after": "latch_failure"},
            {"trigger": "cancel", "source": "SETTLING", "dest": "SETTLING"}],
        effects={"SETTLING": "settle"})


class CountedSide(StorageSide):
    """Object storage whose commit counts the stores it made visible."""

    mem_type = "OBJ"

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.committed: list[int] = []

    def open(self, transfer: Transfer) -> list[tuple[int, int, int, str]]:
        return [(0, self.block_bytes, index, name) for index, name in enumerate(transfer.names)]

    def commit(self, transfer: Transfer) -> bool:
        self.committed.append(transfer.job_id)
        return True


def test_a_step_sending_its_transfer_back_to_running_gets_a_state_check_in_the_same_round(
) -> None:
    """``due`` yields the ``poll`` effect for a transfer an effect moved back into a running
    state, and the driver's maker for it (``_poll_one``: a batch of one state check, then what
    it answered, the store's commit included) makes it. No shipped lifecycle goes back, so no
    test reached it: mutants that checked no handle, read another answer than the first, or
    dropped the transfer (its commit then reads no job) went unnoticed."""
    answers = [Again.AGAIN, Again.SETTLED]
    settled_in: list[str] = []

    def settle(transfer: Transfer, primary: torch.Tensor) -> Any:
        settled_in.append(transfer.state.name)
        return answers.pop(0)

    agent = FakeNixlAgent("settling")
    primary = torch.arange(32, dtype=torch.float32).view(4, 8)
    side = CountedSide(int(primary[0].nbytes))
    tier = _Tier(primary, agent=agent, remote=side, machine=settle_again(),
                 steps={"settle": settle})
    tier.submit_store(TransferJob(1, ["a"], [2]))
    assert agent.call_count("check_xfer_state") == 0 and side.committed == []

    [result] = tier.get_finished_jobs()  # one round: check, settle, check again, settle, end
    assert result.success and result.reason is None
    assert settled_in == ["SETTLING", "SETTLING"]
    assert agent.call_count("check_xfer_state") == 2
    assert side.committed == [1, 1], "each DONE a state check answered commits the store"
    assert agent.objects["a"] == primary[2].numpy().tobytes()
    tier.shutdown(timeout=5)
    assert agent.misuses == [] and agent.live_xfer_handles() == 0


def check_and_fix() -> Declaration[Any, Any]:
    """The lifecycle with two steps of its own after NIXL's DONE that may go round in a
    circle: ``check`` answers AGAIN to send the transfer to ``fix``, which sends it back; each
    gives up (shutdown's deadline) into FAILED."""
    base: Declaration[Any, Any] = TRANSFER_MACHINE
    return base.extend(
        "check_and_fix", states=["CHECKING", "FIXING"],
        replace={("SUBMITTED", "post", "finished"): {"dest": "CHECKING", "after": []},
                 ("PROCESSING", "poll", "finished"): {"dest": "CHECKING", "after": []}},
        answers={"check": (Again.SETTLED, Again.AGAIN, A.RAISED, A.EXHAUSTED),
                 "fix": (A.OK, A.RAISED, A.EXHAUSTED)},
        guards={"settled": (Again.SETTLED,), "again": (Again.AGAIN,),
                "step_raised": (A.RAISED, A.EXHAUSTED), "fixed": (A.OK,)},
        transitions=[
            {"trigger": "check", "source": "CHECKING", "dest": "DONE",
             "conditions": "settled", "after": "latch_success"},
            {"trigger": "check", "source": "CHECKING", "dest": "FIXING", "conditions": "again"},
            {"trigger": "check", "source": "CHECKING", "dest": "FAILED",
             "conditions": "step_raised", "after": "latch_failure"},
            {"trigger": "fix", "source": "FIXING", "dest": "CHECKING", "conditions": "fixed"},
            {"trigger": "fix", "source": "FIXING", "dest": "FAILED",
             "conditions": "step_raised", "after": "latch_failure"},
            {"trigger": "cancel", "source": "CHECKING", "dest": "CHECKING"},
            {"trigger": "cancel", "source": "FIXING", "dest": "FIXING"}],
        effects={"CHECKING": "check", "FIXING": "fix"})


@pytest.mark.timeout(30)
def test_steps_that_go_round_in_a_circle_make_a_bounded_number_of_calls_a_round() -> None:
    """A lifecycle's own steps may send a transfer round in a circle (check, fix, check...):
    a round once went round for as long as they did, under the tier's lock, and a step that
    never stopped hung get_finished_jobs. A round now makes at most as many calls for one
    transfer as the lifecycle has states, and the next round goes on where it stopped."""
    machine = check_and_fix()
    settle = False
    calls: list[str] = []

    def check(transfer: Transfer, primary: torch.Tensor) -> Any:
        calls.append("check")
        return Again.SETTLED if settle else Again.AGAIN

    def fix(transfer: Transfer, primary: torch.Tensor) -> Any:
        calls.append("fix")
        return A.OK

    agent = FakeNixlAgent("circling")
    primary = torch.arange(32, dtype=torch.float32).view(4, 8)
    tier = _Tier(primary, agent=agent, remote=CountedSide(int(primary[0].nbytes)),
                 machine=machine, steps={"check": check, "fix": fix})
    tier.submit_store(TransferJob(1, ["a"], [2]))
    for _ in range(3):
        before = len(calls)
        assert tier.get_finished_jobs() == []
        assert 0 < len(calls) - before <= len(machine.states), "bounded, and going on"
    settle = True
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    tier.shutdown(timeout=5)
    assert agent.misuses == [] and agent.live_xfer_handles() == 0


# -- StorageSide's defaults ---------------------------------------------------------------------

def test_storage_side_defaults_commit_at_once_notify_nobody_and_close_nothing() -> None:
    """What a remote side gets from :class:`StorageSide` when it calls the defaults
    (``super().commit(transfer)``): the store is visible as soon as NIXL finished (True; False
    would mean "not yet": the store would be polled for ever), no message for a peer, nothing
    to close. The driver skips the defaults it recognizes, so no test called them."""
    transfer = Transfer(TransferJob(1, ["k"], [0]), 64, 0.0, None)
    side = StorageSide()
    assert side.commit(transfer) is True
    assert side.notification(transfer) == b""
    assert side.close(transfer) == []
    assert side.peer is None
    with pytest.raises(NotImplementedError):
        side.open(transfer)


# -- the state checks of a batch, and a release made once ----------------------------------------

class ScriptedChecks(FakeNixlAgent):
    """A fake agent whose state checks answer from a script, by handle, and note each call."""

    def __init__(self, script: dict[str, str | BaseException]) -> None:
        super().__init__("scripted")
        self.script = script
        self.asked: list[str] = []

    def check_xfer_state(self, handle: Any) -> str:
        self.asked.append(handle)
        answer = self.script[handle]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def test_a_batch_of_state_checks_asks_each_handle_once_whatever_some_raise() -> None:
    """``check`` maps the state check over the batch; a call that raises ends ``map``, and
    the batch goes on from the next handle: the raise is that handle's answer only. One
    StopIteration ends ``map`` quietly, and is told apart by its own error. No test read the
    answers of a batch whole: mutants that started again from the first handle, stopped at the
    first raise, or changed the words said of a StopIteration survived."""
    backend = RuntimeError("NIXL_ERR_BACKEND")
    agent = ScriptedChecks({"a": "DONE", "b": StopIteration(), "c": backend, "d": "PROC",
                            "e": "ERR"})
    driver = TransferDriver(agent, CountedSide(64), TRANSFER_MACHINE)
    answers = driver.check(["a", "b", "c", "d", "e"])
    assert agent.asked == ["a", "b", "c", "d", "e"], "each handle asked once, in order"
    assert [type(a).__name__ if isinstance(a, Exception) else a for a in answers] == [
        "DONE", "RuntimeError", "RuntimeError", "PROC", "ERR"]
    assert str(answers[1]) == "check_xfer_state raised StopIteration"
    assert answers[2] is backend and backend.__traceback__ is None
    assert driver.check([]) == [] and agent.asked[5:] == []


def test_a_large_batch_of_every_check_asks_those_before_a_raise_again_and_the_rest_once(
) -> None:
    """A round that checks every running transfer asks a batch of BULK_CHECKS handles or more
    in one list comprehension, which loses the answers before a check that raised: those
    handles are asked again (their answers are then the second ones), the raising one is not,
    and each after it is asked once. A StopIteration there is told apart as in a small batch.
    The poll schedule's batches (``check``) are asked once, whatever their size."""
    size = BULK_CHECKS + 44
    names = [f"h{i}" for i in range(size)]
    backend = RuntimeError("NIXL_ERR_BACKEND")
    script: dict[str, str | BaseException] = dict.fromkeys(names, "PROC")
    script.update({"h3": "DONE", "h100": backend, "h101": "ERR", "h200": StopIteration()})
    agent = ScriptedChecks(script)
    driver = TransferDriver(agent, CountedSide(64), TRANSFER_MACHINE)

    class Later(dict[str, Any]):  # h3 is over by the time it is asked again
        def __getitem__(self, name: str) -> Any:
            if name == "h3" and agent.asked.count("h3") > 1:
                return "ERR"
            return super().__getitem__(name)

    agent.script = Later(script)
    answers = driver.check_all(names)
    assert agent.asked == names[:101] + names[:100] + names[101:], (
        "the ones before the raise asked twice, the raising one once, the rest once")
    assert len(answers) == size
    assert answers[3] == "ERR", "the answer asked last is the one kept"
    assert answers[100] is backend and backend.__traceback__ is None
    assert answers[101] == "ERR"
    assert str(answers[200]) == "check_xfer_state raised StopIteration"
    assert answers.count("PROC") == size - 4

    agent.asked.clear()
    calm = ScriptedChecks(dict.fromkeys(names, "PROC"))
    calm_driver = TransferDriver(calm, CountedSide(64), TRANSFER_MACHINE)
    assert calm_driver.check_all(names) == ["PROC"] * size and calm.asked == names, (
        "nothing raised: each asked once")
    agent.asked.clear()
    assert len(driver.check(names)) == size and agent.asked == names, (
        "the schedule's batches, however large, are asked once whatever raises")


def test_a_transfer_released_once_is_never_handed_to_nixl_again() -> None:
    """The release forgets the handle it released: a later release of the same transfer (a
    cleanup interrupted and resumed) makes no call. A mutant that kept a handle that is no
    None ("") released it again, which NIXL refuses."""
    agent = FakeNixlAgent("release-once", complete_after_polls=0)
    primary = torch.zeros(4, 8)
    side = CountedSide(int(primary[0].nbytes))
    tier = _Tier(primary, agent=agent, remote=side)
    driver = tier._driver
    transfer = Transfer(TransferJob(1, ["a"], [0]), 32, 0.0, TRANSFER_MACHINE.initial)
    transfer.names = ("a",)
    assert driver.post(transfer, tier._local, [0]).answer is A.DONE
    assert driver.release(transfer) == driver.release(transfer) == Outcome(A.OK)
    assert agent.call_count("release_xfer_handle") == 1 and transfer.xfer is None
    assert driver.clean(transfer) == Outcome(A.OK, ())
    assert agent.misuses == []
    tier.shutdown(timeout=5)


# -- what the driver answers when a remote side's commit or close fails, or a post is cut short --

class FailingSide(CountedSide):
    """Object storage whose commit and close fail as told, and whose close reports a leak."""

    def __init__(self, block_bytes: int, *, commit_error: Exception | None = None,
                 close_error: Exception | None = None, close_leaks: tuple[Leak, ...] = ()
                 ) -> None:
        super().__init__(block_bytes)
        self.commit_error, self.close_error, self.close_leaks = (
            commit_error, close_error, close_leaks)
        self.closed: list[int] = []

    def commit(self, transfer: Transfer) -> bool:
        if self.commit_error is not None:
            raise self.commit_error
        return super().commit(transfer)

    def close(self, transfer: Transfer) -> list[Leak]:
        self.closed.append(transfer.job_id)
        if self.close_error is not None:
            raise self.close_error
        return list(self.close_leaks)


def driven(side: CountedSide, agent: FakeNixlAgent | None = None
           ) -> tuple[_Tier, TransferDriver, Transfer]:
    """A tier on ``side`` (for its agent and primary registration), its driver, and a
    transfer of one block that driver may post."""
    agent = agent or FakeNixlAgent("driven", complete_after_polls=0)
    tier = _Tier(torch.zeros(4, 8), agent=agent, remote=side)
    transfer = Transfer(TransferJob(1, ["a"], [0]), 32, 0.0, TRANSFER_MACHINE.initial)
    transfer.names = ("a",)
    return tier, tier._driver, transfer


def test_a_store_whose_commit_raises_fails_naming_the_commit_and_its_error() -> None:
    """NIXL finished the store (DONE at the post) but the remote side's commit raised: the
    answer is RAISED, by ``commit``, with the error itself (no traceback kept). The tests
    reached a commit that raised only through the running bound's own reason."""
    full = OSError("disk full")
    tier, driver, transfer = driven(FailingSide(32, commit_error=full))
    assert driver.post(transfer, tier._local, [0]) == Outcome(A.RAISED, CallFailed("commit", full))
    assert full.__traceback__ is None
    assert driver.end(transfer) == (Outcome(A.OK), Outcome(A.OK, ()))

    tier.submit_store(TransferJob(2, ["b"], [1]))
    [result] = tier.get_finished_jobs()
    assert result.reason == FailureReason(FailureKind.RAISED, "commit", "OSError: disk full",
                                          "OSError")
    tier.shutdown(timeout=5)


def test_a_store_nixl_finished_at_its_post_is_committed_then() -> None:
    """``transfer`` answering DONE at once: the post's answer goes through the commit too,
    for this transfer (a mutant handed the commit no transfer)."""
    side = CountedSide(32)
    tier, driver, transfer = driven(side)
    assert driver.post(transfer, tier._local, [0]) == Outcome(A.DONE)
    assert side.committed == [1]
    driver.end(transfer)
    tier.shutdown(timeout=5)


def test_a_status_that_is_no_known_word_is_an_error_answer_that_keeps_the_word() -> None:
    """Any status but PROC and DONE is an error status, and the reason says which: the
    tests only answered "ERR", which the reason says when it was given none."""
    _, driver, transfer = driven(CountedSide(32))
    assert driver.polled(transfer, "NIXL_ERR_BACKEND") == Outcome(
        A.ERR, CallFailed("check_xfer_state", "NIXL_ERR_BACKEND"))


def test_a_remote_sides_close_is_made_once_after_the_nixl_cleanup_and_its_leaks_kept() -> None:
    """The cleanup releases the descriptor list, deregisters, then closes the remote side:
    the leaks of all three are kept (a mutant kept only the side's), a close that raises is a
    leak of ``close`` with its error, and a cleanup made again (resumed after an interrupt)
    makes no NIXL call twice. The leaks stand on the transfer as each cleanup answers, and a
    cleanup that finds more answers them all."""
    stale = Leak("unlink", "FileNotFoundError: a.tmp")
    side = FailingSide(32, close_leaks=(stale,))
    agent = FakeNixlAgent("cleaning", complete_after_polls=0)
    tier, driver, transfer = driven(side, agent)
    driver.post(transfer, tier._local, [0])
    assert driver.release(transfer) == Outcome(A.OK)
    agent.inject("deregister_memory", Raise("NIXL_ERR_BACKEND"))
    assert driver.clean(transfer) == Outcome(A.LEAKED, (
        Leak("deregister_memory", "FakeNixlError: NIXL_ERR_BACKEND"), stale))
    assert side.closed == [1]

    calls = len(agent.calls)
    side.close_leaks = ()
    assert driver.clean(transfer) == Outcome(A.OK, ()), "nothing left to release"
    assert agent.calls[calls:] == [] and side.closed == [1, 1]

    assert transfer.leaks == (Leak("deregister_memory", "FakeNixlError: NIXL_ERR_BACKEND"),
                              stale)
    side.close_error = OSError("busy")
    assert driver.clean(transfer) == Outcome(A.LEAKED, (
        Leak("deregister_memory", "FakeNixlError: NIXL_ERR_BACKEND"), stale,
        Leak("close", "OSError: busy")))
    tier.shutdown(timeout=5)


class InterruptedAt(FakeNixlAgent):
    """A fake agent on which a Ctrl-C lands during one call, before it did anything."""

    def __init__(self, call: str) -> None:
        super().__init__("interrupted", complete_after_polls=0)
        self.interrupted_call = call
        self.interrupt = KeyboardInterrupt()

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        if self.interrupted_call == "make_prepped_xfer":
            raise self.interrupt
        return super().make_prepped_xfer(*args, **kwargs)

    def transfer(self, *args: Any, **kwargs: Any) -> str:
        if self.interrupted_call == "transfer":
            raise self.interrupt
        return super().transfer(*args, **kwargs)


@pytest.mark.parametrize(("call", "answer"), [("make_prepped_xfer", A.RAISED),
                                               ("transfer", A.PROC)])
def test_an_interrupted_post_answers_with_the_call_it_cut_and_hands_the_interrupt_back(
        call: str, answer: Answer) -> None:
    """An interrupt is no failure of NIXL's, but the post still answers (RAISED before
    ``transfer()`` was called, PROC once it was: NIXL may run it) naming the call it cut, and
    gives the interrupt back to be raised once the answer is taken. No test read the detail
    or the interrupt of that outcome."""
    agent = InterruptedAt(call)
    tier, driver, transfer = driven(CountedSide(32), agent)
    assert driver.post(transfer, tier._local, [0]) == Outcome(
        answer, CallFailed(call, agent.interrupt), agent.interrupt)
    agent.interrupted_call = ""
    driver.end(transfer)
    tier.shutdown(timeout=5)


class PerBlockSide(CountedSide):
    """Object storage whose jobs the driver makes a NIXL transfer per block."""

    transfer_per_block = True


class InterruptedAtNth(FakeNixlAgent):
    """A fake agent on which a Ctrl-C lands during the ``nth`` call of ``call``: before it
    did anything, or (``after``) once NIXL took it, as the call returned."""

    def __init__(self, call: str, nth: int, *, after: bool = False) -> None:
        super().__init__("interrupted-nth")
        self.interrupted_call, self.nth, self.after = call, nth, after
        self.interrupt = KeyboardInterrupt()

    def _cut(self, call: str, made: Any, *args: Any, **kwargs: Any) -> Any:
        if call == self.interrupted_call and self.call_count(call) + 1 == self.nth:
            if not self.after:
                raise self.interrupt
            made(*args, **kwargs)
            raise self.interrupt
        return made(*args, **kwargs)

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        return self._cut("make_prepped_xfer", super().make_prepped_xfer, *args, **kwargs)

    def transfer(self, *args: Any, **kwargs: Any) -> str:
        return self._cut("transfer", super().transfer, *args, **kwargs)


@pytest.mark.parametrize(("call", "nth", "after", "answer", "failed"), [
    ("make_prepped_xfer", 2, False, A.RAISED, False),  # nothing posted: over at once
    ("transfer", 2, False, A.PROC, True),  # block 0 runs, blocks 1 and 2 were never posted
    ("transfer", 3, True, A.PROC, False),  # every block posted: the polls say how it ends
])
def test_an_interrupted_post_of_a_job_made_per_block_answers_as_a_post_of_one_does(
        call: str, nth: int, after: bool, answer: Answer, failed: bool) -> None:
    """A job of three blocks, a transfer per block: the interrupt comes back in the outcome
    with the call it cut, RAISED before any ``transfer()``, PROC once one was called; and
    a job some of whose blocks were never posted has failed already, by that call (whatever
    the posted ones answer), while one whose blocks were all posted has not."""
    agent = InterruptedAtNth(call, nth, after=after)
    tier = _Tier(torch.zeros(4, 8), agent=agent, remote=PerBlockSide(32))
    driver = tier._driver
    transfer = Transfer(TransferJob(1, ["a", "b", "c"], [0, 1, 2]), 96, 0.0,
                        TRANSFER_MACHINE.initial)
    transfer.names = ("a", "b", "c")
    assert driver.post(transfer, tier._local, [0, 1, 2]) == Outcome(
        answer, CallFailed(call, agent.interrupt), agent.interrupt)
    split = transfer.split
    assert split is not None
    assert split.failure == (Outcome(A.RAISED, CallFailed(call, agent.interrupt)) if failed
                             else None)
    agent.interrupted_call = ""
    if answer is A.PROC:  # the polls: the first failure, or DONE once every block is over
        over = driver._poll_one(transfer)
        while over.answer is A.PROC:
            over = driver._poll_one(transfer)
        assert over == (split.failure if failed else Outcome(A.DONE))
    assert driver.release(transfer) == Outcome(A.OK)
    driver.clean(transfer)
    assert agent.live_xfer_handles() == 0 and agent.misuses == []
    tier.shutdown(timeout=5)


class AnswersBusy(FakeNixlAgent):
    """A fake agent whose ``transfer()`` answers a status that is neither PROC, DONE nor ERR,
    without taking the transfer."""

    def transfer(self, *args: Any, **kwargs: Any) -> str:
        self.answered += 1
        return "NIXL_ERR_BUSY"

    answered = 0


def test_a_first_post_of_a_job_made_per_block_answering_an_unknown_status_keeps_it() -> None:
    """The first block's ``transfer()`` answers neither PROC nor DONE: nothing runs, the
    others are never posted, and the answer is ERR with the status answered kept as the
    reason (a mutant put None there, which reads as "ERR" whatever was answered)."""
    agent = AnswersBusy("busy")
    tier = _Tier(torch.zeros(4, 8), agent=agent, remote=PerBlockSide(32))
    driver = tier._driver
    transfer = Transfer(TransferJob(1, ["a", "b"], [0, 1]), 64, 0.0, TRANSFER_MACHINE.initial)
    transfer.names = ("a", "b")
    assert driver.post(transfer, tier._local, [0, 1]) == Outcome(
        A.ERR, CallFailed("transfer", "NIXL_ERR_BUSY"))
    assert agent.answered == 1
    assert driver.release(transfer) == Outcome(A.OK)
    driver.clean(transfer)
    assert agent.live_xfer_handles() == 0 and agent.misuses == []
    tier.shutdown(timeout=5)


class PeerSide(CountedSide):
    """Another agent's memory (``peer`` set): prepped by that agent's name, with a
    notification for it."""

    mem_type = "DRAM"

    def __init__(self, peer: str, base: int, block_bytes: int) -> None:
        super().__init__(block_bytes)
        self._peer, self.base = peer, base

    @property
    def peer(self) -> str | None:  # type: ignore[override]
        return self._peer

    def open(self, transfer: Transfer) -> list[tuple[int, int, int, str]]:
        return [(self.base, self.block_bytes, 0, "")]

    def notification(self, transfer: Transfer) -> bytes:
        raise ConnectionError("no peer listening")


def test_a_post_to_a_peer_names_the_prep_or_the_notification_that_failed() -> None:
    """The peer branch of the post (no registration: the peer's memory is known from its
    metadata) names its own calls: ``prep_xfer_dlist`` by the peer's name, then the side's
    ``notification``. The tests of failed submit calls ran on storage only."""
    agent = FakeNixlAgent("self", complete_after_polls=0)
    primary = torch.zeros(4, 8)
    tier = _Tier(primary, agent=agent, remote=CountedSide(32))
    for peer, call, error in [("stranger", "prep_xfer_dlist", "FakeNixlError: NIXL_ERR_NOT_FOUND"),
                              ("self", "notification", "ConnectionError: no peer listening")]:
        driver = TransferDriver(agent, PeerSide(peer, primary.data_ptr(), 32), TRANSFER_MACHINE)
        transfer = Transfer(TransferJob(1, ["a"], [0]), 32, 0.0, TRANSFER_MACHINE.initial)
        outcome = driver.post(transfer, tier._local, [0])
        assert (outcome.answer, outcome.detail.call, _text(outcome.detail.error)) == (
            A.RAISED, call, error)
        assert transfer.files is None, "nothing registered for a peer's memory"
        driver.clean(transfer)
    tier.shutdown(timeout=5)
    assert agent.misuses == []


def _text(error: BaseException | str) -> str:
    return f"{type(error).__name__}: {error}"
