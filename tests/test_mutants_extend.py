"""``Declaration.extend``, called inside the tests (docs/testing.md, "Mutation testing").

The one shipped extension, ``examples.verify_lifecycle.VERIFY_MACHINE``, is built when its module
is imported, and mutmut's workers import the modules once, before a mutant is switched on: so
``extend`` was never run mutated, and every mutant of it survived. These tests build extensions
while they run and check what the new machine is, field by field, and how a wrong extension is
refused. They kill the mutants that drop or swap an argument passed on to the new
``Declaration``, mangle the new Enum's name or hash, apply a replacement to the wrong edge, or
lose the ``DeclarationError`` messages.
"""

from __future__ import annotations

import enum
from typing import Any

import pytest
import torch

from kvfsm import TRANSFER_MACHINE, Declaration, TransferJob
from kvfsm.engine import DeclarationError
from kvfsm.lifecycle import Answer, TransferState
from kvfsm.testing import FakeNixlAgent
from kvfsm.tiers import ObjectStoreTier


class Checked(enum.Enum):
    GOOD = "GOOD"
    BAD = "BAD"


def verify_like(name: str = "check_blocks", **more: Any) -> Declaration[Any, Any]:
    """The example's extension (a VERIFYING state after NIXL's DONE), built in the test."""
    base: Declaration[Any, Any] = TRANSFER_MACHINE
    return base.extend(
        name,
        states=["VERIFYING"],
        replace={("SUBMITTED", "post", "finished"): {"dest": "VERIFYING", "after": []},
                 # a member of the machine's Enum is taken by its name
                 (TransferState.PROCESSING, "poll", "finished"):  # type: ignore[dict-item]
                     {"dest": "VERIFYING", "after": []}},
        answers={"verify": (Checked.GOOD, Checked.BAD, Answer.RAISED)},
        guards={"matched": (Checked.GOOD,), "unverified": (Checked.BAD, Answer.RAISED)},
        transitions=[
            {"trigger": "verify", "source": "VERIFYING", "dest": "DONE",
             "conditions": "matched", "after": "latch_success"},
            {"trigger": "verify", "source": ["VERIFYING"], "dest": "FAILED",
             "conditions": "unverified", "after": "latch_failure"},
            {"trigger": "cancel", "source": "VERIFYING", "dest": "VERIFYING"}],
        effects={"VERIFYING": "verify"},
        calls={"verify": "crc32"},
        **more,
    )


def edge_tuples(declaration: Declaration[Any, Any]) -> set[tuple[str, str, str, tuple[str, ...],
                                                               tuple[str, ...]]]:
    return {(str(e.event), e.source, e.dest, e.conditions, e.actions)
            for e in declaration.edges}


def test_the_extension_has_the_old_states_by_name_then_the_new_ones_in_an_enum_of_its_own() -> None:
    machine = verify_like()
    assert machine.name == "check_blocks"
    assert machine.states.__name__ == "CheckBlocksState"
    assert [s.name for s in machine.states] == [*(s.name for s in TransferState), "VERIFYING"]
    assert machine.states is not TransferState
    assert machine.initial is machine.states.SUBMITTED
    member = machine.states.VERIFYING
    assert hash(member) == object.__hash__(member), "members hash by identity"


def test_the_extension_keeps_every_old_edge_but_the_replaced_ones_and_adds_its_own() -> None:
    machine = verify_like()
    old, new = edge_tuples(TRANSFER_MACHINE), edge_tuples(machine)
    replaced = {("post", "SUBMITTED", "DONE", ("finished",), ("latch_success",)),
                ("poll", "PROCESSING", "DONE", ("finished",), ("latch_success",))}
    assert replaced <= old
    assert new == (old - replaced) | {
        ("post", "SUBMITTED", "VERIFYING", ("finished",), ()),
        ("poll", "PROCESSING", "VERIFYING", ("finished",), ()),
        ("verify", "VERIFYING", "DONE", ("matched",), ("latch_success",)),
        ("verify", "VERIFYING", "FAILED", ("unverified",), ("latch_failure",)),
        ("cancel", "VERIFYING", "VERIFYING", (), ())}
    # the order of the guards on the replaced edges is the old one
    order = {(str(e.event), e.source, e.conditions): e.order for e in TRANSFER_MACHINE.edges}
    for edge in machine.edges:
        if edge.source != "VERIFYING":
            assert edge.order == order[(str(edge.event), edge.source, edge.conditions)]


def test_the_extension_adds_to_the_old_answers_guards_actions_calls_and_effects() -> None:
    machine = verify_like()
    states = machine.states
    assert machine.answers == {**TRANSFER_MACHINE.answers,
                               "verify": frozenset({Checked.GOOD, Checked.BAD, Answer.RAISED})}
    assert machine.guards == {**TRANSFER_MACHINE.guards,
                              "matched": frozenset({Checked.GOOD}),
                              "unverified": frozenset({Checked.BAD, Answer.RAISED})}
    assert machine.actions == TRANSFER_MACHINE.actions
    assert machine.calls == {**TRANSFER_MACHINE.calls, "verify": ("crc32",)}
    assert machine.effects == {**{states[s.name]: e for s, e in TRANSFER_MACHINE.effects.items()},
                               states.VERIFYING: "verify"}
    assert machine.running == {states[s.name] for s in TRANSFER_MACHINE.running}
    assert machine.final == {states[s.name] for s in TRANSFER_MACHINE.final}
    assert machine.failure_states == {states[s.name] for s in TRANSFER_MACHINE.failure_states}
    assert machine.unreachable == frozenset()


def test_the_sets_an_extension_names_are_added_to_the_old_ones() -> None:
    """``final``, ``failure_states`` and ``running`` are added to, never replace."""
    machine = TRANSFER_MACHINE.extend(
        "with_a_limbo", states=["LIMBO"],
        answers={"park": (Answer.OK,)},
        transitions=[{"trigger": "park", "source": "FAILED", "dest": "LIMBO"}],
        final=["LIMBO"], failure_states=["LIMBO"])
    states = machine.states
    assert machine.final == {states.PUBLISHED, states.QUARANTINED, states.LIMBO}
    assert machine.failure_states == {states.FAILED, states.CANCELLING, states.QUARANTINED,
                                      states.LIMBO}
    assert machine.running == {states.PROCESSING, states.CANCELLING}


def test_an_extension_runs_in_a_tier_through_its_own_state() -> None:
    """Built in the test, the machine runs: a store passes VERIFYING, its step answering."""
    seen: list[int] = []

    def verify(transfer: Any, primary: torch.Tensor) -> Checked:
        seen.append(transfer.job.job_id)
        return Checked.GOOD if transfer.job.job_id == 1 else Checked.BAD

    agent = FakeNixlAgent(name="extend")
    tier = ObjectStoreTier(torch.zeros(4, 8), agent=agent, machine=verify_like(),
                           steps={"verify": verify})
    tier.submit_store(TransferJob(1, ["a"], [0]))
    tier.submit_store(TransferJob(2, ["b"], [1]))
    results: dict[int, Any] = {}
    for _ in range(1000):
        results.update((r.job_id, r) for r in tier.get_finished_jobs())
        if len(results) == 2:
            break
    tier.shutdown(timeout=5)
    assert sorted(seen) == [1, 2]
    assert results[1].success
    assert not results[2].success
    assert str(results[2].reason) == "verify answered BAD"
    assert agent.misuses == []


def test_a_state_that_already_exists_is_refused_by_name() -> None:
    with pytest.raises(DeclarationError) as refused:
        TRANSFER_MACHINE.extend("again", states=["DONE", "NEW", "FAILED"])
    message = str(refused.value)
    assert message.startswith("again: states ['DONE', 'FAILED'] "), message
    assert "'transfer'" in message, "names the machine extended"


def test_an_unknown_state_is_refused_with_the_states_there_are() -> None:
    with pytest.raises(DeclarationError) as refused:
        TRANSFER_MACHINE.extend("typo", states=["NEW"],
                                transitions=[{"trigger": "cancel", "source": "NEW",
                                              "dest": "NOWHERE"}])
    names = ", ".join([*(s.name for s in TransferState), "NEW"])
    assert str(refused.value) == f"typo: no state 'NOWHERE' (states: {names})"


def test_replacing_an_edge_that_does_not_exist_is_refused_naming_it() -> None:
    with pytest.raises(DeclarationError) as refused:
        TRANSFER_MACHINE.extend("wrong_edge", replace={
            ("DONE", "post", "finished"): {"dest": "FAILED"},
            ("SUBMITTED", "post", "finished"): {"dest": "FAILED"}})
    assert str(refused.value) == (
        "wrong_edge: replace names edges 'transfer' does not have: "
        "[('DONE', 'post', 'finished')]")


def test_an_extension_without_changes_is_the_same_machine_on_a_new_enum() -> None:
    """No argument but the name: the table, effects and sets are the old ones, renamed."""
    machine = TRANSFER_MACHINE.extend("copy")
    assert edge_tuples(machine) == edge_tuples(TRANSFER_MACHINE)
    assert {s.name: e for s, e in machine.effects.items()} == {
        s.name: e for s, e in TRANSFER_MACHINE.effects.items()}
    assert machine.calls == TRANSFER_MACHINE.calls
    assert machine.answers == TRANSFER_MACHINE.answers
    assert machine.guards == TRANSFER_MACHINE.guards


def test_an_unguarded_edge_is_replaced_by_the_empty_guard_name() -> None:
    """``replace`` names an edge without a guard by ``""``, as the docstring says."""
    machine = TRANSFER_MACHINE.extend(
        "cancel_fails", replace={("DONE", "cancel", ""): {"dest": "FAILED"}})
    assert ("cancel", "DONE", "FAILED", (), ()) in edge_tuples(machine)
    assert ("cancel", "DONE", "DONE", (), ()) not in edge_tuples(machine)


@pytest.mark.parametrize(("replace", "message"), [
    ({("DONE", "cancel"): {"dest": "FAILED"}},
     r"replace key \('DONE', 'cancel'\) must be a \(source, trigger, guard\) triple"),
    ({("DONE", "cancel", ""): "FAILED"},
     r"replace\[\('DONE', 'cancel', ''\)\] must be a dict of what changes .* got str 'FAILED'"),
    ([("DONE", "cancel", "")], "replace must be a dict of"),
])
def test_a_replace_of_the_wrong_shape_is_refused_naming_the_entry(replace: Any,
                                                                  message: str) -> None:
    """A two-part key or a bare state for a value raised a ValueError from unpacking, which
    named neither the entry nor what it should be."""
    with pytest.raises(DeclarationError, match=message):
        TRANSFER_MACHINE.extend("misshapen", replace=replace)
