"""What a tier runs is read from the declaration: effects and running states are validated when
declared, and a machine a tier cannot run is refused when the tier is built, before NIXL."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from kvfsm import TRANSFER_MACHINE, Declaration, DeclarationError, TransferState
from kvfsm.driver import MachineRefused
from kvfsm.lifecycle import ACTIONS, ANSWERS, GUARDS, TRANSITIONS
from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent
from kvfsm.tiers import FileTier, ObjectStoreTier

S = TransferState


def lifecycle(name: str = "variant", *, drop: tuple[tuple[Any, str, str], ...] = (),
              **changes: Any) -> Declaration[Any, Any]:
    """The shipped lifecycle, without the edges keyed (source, trigger, guard) in ``drop``."""
    transitions = [t for t in TRANSITIONS
                   if (t["source"], str(t["trigger"]), t.get("conditions", "")) not in drop]
    arguments: dict[str, Any] = {
        "states": TransferState, "initial": S.SUBMITTED, "answers": ANSWERS, "guards": GUARDS,
        "actions": ACTIONS, "transitions": transitions, "final": TRANSFER_MACHINE.final,
        "failure_states": TRANSFER_MACHINE.failure_states,
        "effects": TRANSFER_MACHINE.effects, "running": TRANSFER_MACHINE.running}
    return Declaration(name, **{**arguments, **changes})


def test_the_transfer_machine_declares_what_each_state_waits_on() -> None:
    assert TRANSFER_MACHINE.effects[S.PROCESSING] == "poll"
    assert TRANSFER_MACHINE.effects[S.DONE] == "release"
    assert TRANSFER_MACHINE.running == {S.PROCESSING, S.CANCELLING}
    assert not TRANSFER_MACHINE.final & TRANSFER_MACHINE.effects.keys()


@pytest.mark.parametrize(("changes", "message"), [
    ({"effects": {s: e for s, e in TRANSFER_MACHINE.effects.items() if s is not S.CLEANED}},
     "state CLEANED waits on no effect"),
    ({"effects": {**TRANSFER_MACHINE.effects, S.PUBLISHED: "publish"}},
     "final state PUBLISHED waits on effect 'publish'"),
    ({"effects": {**TRANSFER_MACHINE.effects, S.DONE: "clean"}},
     "state DONE waits on effect 'clean', but declares no event 'clean'"),
    ({"effects": {**TRANSFER_MACHINE.effects, S.DONE: 3}}, "must be an event's name"),
    ({"running": (S.PROCESSING, S.DONE)}, "running states wait on one effect"),
    ({"running": (S.PROCESSING, S.PUBLISHED)}, "both running and final"),
    ({"running": ("PROCESSED",)}, "running names 'PROCESSED', which is not a state of "
                                  "TransferState"),
])
def test_effects_and_running_states_are_checked_when_declared(changes: dict[str, Any],
                                                              message: str) -> None:
    with pytest.raises(DeclarationError, match=message):
        lifecycle(**changes)


@pytest.mark.parametrize(("machine", "policy", "message"), [
    (lifecycle("no_effects", effects=None, running=()), RetryPolicy(),
     "machine 'no_effects' declares no effects"),
    (lifecycle("no_cancel", drop=((S.CANCELLING, "cancel", ""),)), RetryPolicy(),
     "machine 'no_cancel': state CANCELLING declares no 'cancel' edge: cancel.. and "
     "shutdown.. could not end its jobs"),
    (lifecycle("no_cancel_when_over", drop=((S.XFER_RELEASED, "cancel", ""),)), RetryPolicy(),
     "machine 'no_cancel_when_over': state XFER_RELEASED declares no 'cancel' edge: a cancel.. "
     "or shutdown.. may come while a transfer waits here"),
    (lifecycle("release_while_running", effects={**TRANSFER_MACHINE.effects,
                                                  S.DONE: "poll"},
               transitions=[*TRANSITIONS, {"trigger": "poll", "source": S.DONE,
                                           "dest": S.DONE}]),
     RetryPolicy(), "machine 'release_while_running': state DONE waits on the state check "
     "'poll' but is not running="),
    (lifecycle("no_give_up", drop=((S.PROCESSING, "poll", "exhausted"),),
               transitions=[*(t for t in TRANSITIONS if (t["source"], t.get("conditions"))
                              != (S.PROCESSING, "exhausted")),
                            {"trigger": "poll", "source": S.PROCESSING,
                             "dest": S.PROCESSING, "conditions": "exhausted"}]),
     RetryPolicy(max_running_seconds=5.0),
     "machine 'no_give_up': state PROCESSING has no give-up edge .'poll' answering EXHAUSTED "
     "to another state., which the policy's max_running_seconds need"),
])
def test_a_machine_a_tier_cannot_run_is_refused_before_any_nixl_call(
        primary: torch.Tensor, machine: Declaration[Any, Any], policy: RetryPolicy,
        message: str, tmp_path: Any) -> None:
    agent = FakeNixlAgent(name="refusing")
    with pytest.raises(MachineRefused, match=message):
        ObjectStoreTier(primary, agent=agent, machine=machine, policy=policy)
    with pytest.raises(MachineRefused, match=message):
        FileTier(primary, tmp_path / "blocks", agent=agent, machine=machine, policy=policy)
    assert agent.calls == [], "refused before register_memory"
    assert not (tmp_path / "blocks").exists(), "nothing made on disk either"


def test_a_user_state_whose_effect_nobody_makes_is_refused_instead_of_leaking(
        primary: torch.Tensor) -> None:
    """The issue's case: an extra state after DONE used to be posted, then raise
    InvalidTransition with its handle unreleased and has_pending_work() true for ever."""
    import examples.verify_lifecycle as example  # noqa: PLC0415

    agent = FakeNixlAgent(name="refusing")
    with pytest.raises(MachineRefused, match="state VERIFYING waits on effect 'verify'"):
        ObjectStoreTier(primary, agent=agent, machine=example.VERIFY_MACHINE)
    with pytest.raises(MachineRefused, match="a step 'check' was given, but no state waits"):
        ObjectStoreTier(primary, agent=agent, machine=example.VERIFY_MACHINE,
                        steps={"verify": example.Checksums(), "check": example.Checksums()})
    # a mistyped step's name: the refusal names the state and the step it waits on (it said
    # only that no state waits on the one given)
    with pytest.raises(MachineRefused, match=re.escape(
            "a step 'verfy' was given, but no state waits on it (the machine's own steps: "
            "VERIFYING wait(s) on 'verify', for which no step was given)")):
        ObjectStoreTier(primary, agent=agent, machine=example.VERIFY_MACHINE,
                        steps={"verfy": example.Checksums()})
    assert agent.calls == []
