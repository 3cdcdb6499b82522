"""kvfsm's public test toolkit: a fake NIXL agent with fault injection, for users' own tests."""

from kvfsm.testing.fake_agent import (
    FakeDlistHandle,
    FakeNixlAgent,
    FakeNixlError,
    FakeRegDList,
    FakeXferDList,
    FakeXferHandle,
    Fault,
    NixlMisuseError,
    Raise,
    ReturnErr,
    StayProc,
)

__all__ = [
    "FakeDlistHandle",
    "FakeNixlAgent",
    "FakeNixlError",
    "FakeRegDList",
    "FakeXferDList",
    "FakeXferHandle",
    "Fault",
    "NixlMisuseError",
    "Raise",
    "ReturnErr",
    "StayProc",
]
