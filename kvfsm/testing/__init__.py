"""kvfsm's public test toolkit: a fake NIXL agent, and fault injection into fake or real agents."""

from kvfsm.testing.fake_agent import (
    FakeDlistHandle,
    FakeNixlAgent,
    FakeRegDList,
    FakeXferDList,
    FakeXferHandle,
    NixlMisuseError,
)
from kvfsm.testing.faults import FakeNixlError, Fault, FaultPlan, Raise, ReturnErr, StayProc
from kvfsm.testing.faulty import FaultyAgent

__all__ = [
    "FakeDlistHandle",
    "FakeNixlAgent",
    "FakeNixlError",
    "FakeRegDList",
    "FakeXferDList",
    "FakeXferHandle",
    "Fault",
    "FaultPlan",
    "FaultyAgent",
    "NixlMisuseError",
    "Raise",
    "ReturnErr",
    "StayProc",
]
