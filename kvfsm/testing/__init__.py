"""kvfsm's public test toolkit: a fake NIXL agent, fake UCX agents for the peer seam, and fault
injection into fake or real agents."""

from kvfsm.testing.fake_agent import (
    FakeDlistHandle,
    FakeNixlAgent,
    FakeRegDList,
    FakeXferDList,
    FakeXferHandle,
    NixlMisuseError,
)
from kvfsm.testing.fake_ucx import FakeUcxAgent, FakeUcxFabric, fake_ucx_pair
from kvfsm.testing.faults import FakeNixlError, Fault, FaultPlan, Raise, ReturnErr, StayProc
from kvfsm.testing.faulty import FaultyAgent

__all__ = [
    "FakeDlistHandle",
    "FakeNixlAgent",
    "FakeNixlError",
    "FakeRegDList",
    "FakeUcxAgent",
    "FakeUcxFabric",
    "FakeXferDList",
    "FakeXferHandle",
    "Fault",
    "FaultPlan",
    "FaultyAgent",
    "NixlMisuseError",
    "Raise",
    "ReturnErr",
    "StayProc",
    "fake_ucx_pair",
]
