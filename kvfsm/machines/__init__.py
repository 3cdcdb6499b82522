"""The machines kvfsm declares, by name, and loading a user's machine from ``module:ATTRIBUTE``.

Each machine lives alone in a module of this package, its declaration and nothing else: the
states, events and answers as enums, guards, actions, the table, and the data that couples it
to the others (keyed on NIXL's error types and on states, never on message text):

* :mod:`kvfsm.machines.transfer`: one transfer's lifecycle (``transfer``);
* :mod:`kvfsm.machines.peer_receive`: one expected peer write, on the receiver
  (``peer_receive``); a receive job fails while its sender's link is in
  :data:`~kvfsm.machines.peer_receive.RECEIVE_FAILS_WHEN_LINK_IN`;
* :mod:`kvfsm.machines.peer_link`: the link to one peer agent (``peer_link``); the errors of
  :data:`~kvfsm.machines.peer_link.LINK_LOST_BY` take it to LOST.

What runs them (the driver and tiers, :mod:`kvfsm.peer`, :mod:`kvfsm.peer_link`) imports the
declarations from here; :mod:`kvfsm.lifecycle` re-exports the transfer machine under its first
name. Loading this package imports none of them: :func:`load_machine` does, by name.

Adding a machine to kvfsm is adding a line to :data:`KVFSM_MACHINES`: the diagrams, the
transition-coverage plugin and ``kvfsm replay`` all take their list from here. The steps of a
user's lifecycle (the functions behind its own effects) are loaded the same way
(:func:`load_steps`, for ``kvfsm explore --steps``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvfsm.engine import Declaration

__all__ = ["KVFSM_MACHINES", "kvfsm_machines", "load_machine", "load_steps"]

#: kvfsm's own machines: name -> ``module:ATTRIBUTE`` of the declaration
KVFSM_MACHINES = {
    "transfer": "kvfsm.machines.transfer:TRANSFER_MACHINE",
    "peer_receive": "kvfsm.machines.peer_receive:PEER_RECEIVE",
    "peer_link": "kvfsm.machines.peer_link:PEER_LINK",
}


def load_machine(spec: str) -> Declaration[Any, Any]:
    """The declaration named by ``module:ATTRIBUTE`` (the attribute may be dotted), or by the
    name of one of kvfsm's machines. The current directory is importable meanwhile, as it is
    for ``python -m``.

    Raises:
        ValueError: the spec does not name a declaration; the one-line message says why: no
            such module (or importing it raised, a declaration it makes refused included), no
            such attribute (naming the part that is missing), or not a Declaration.
    """
    if not isinstance(spec, str):
        raise ValueError(f"a machine is named by a str (module:ATTRIBUTE, or one of "
                         f"{', '.join(KVFSM_MACHINES)}), got {spec!r}")
    found = _load(KVFSM_MACHINES.get(spec, spec), "a machine",
                  f"kvfsm.lifecycle:TRANSFER_MACHINE, or one of {', '.join(KVFSM_MACHINES)}")
    if not isinstance(found, Declaration):
        raise ValueError(f"{spec!r} is not a kvfsm Declaration (found {type(found).__name__})")
    return found


def load_steps(spec: str) -> dict[str, Callable[..., Any]]:
    """The steps named by ``module:ATTRIBUTE``: a mapping of effect name to step function, as a
    tier is given them (``steps={"verify": fn}``), loaded as :func:`load_machine` loads a
    machine.

    Raises:
        ValueError: the spec does not name such a mapping; the one-line message says why, as
            :func:`load_machine`'s does, or names the key or value that is not a step.
    """
    if not isinstance(spec, str):
        raise ValueError(f"steps are named by a str (module:ATTRIBUTE), got {spec!r}")
    found = _load(spec, "steps", "examples.verify_lifecycle:STEPS")
    if not isinstance(found, Mapping):
        raise ValueError(f"{spec!r} is not a mapping of effect name to step function "
                         f"(found {type(found).__name__})")
    for effect, step in found.items():
        if not isinstance(effect, str) or not callable(step):
            raise ValueError(f"{spec!r}: {effect!r}: {type(step).__name__} is not a step "
                             "(a mapping of effect name, a str, to a function)")
    return dict(found)


def _load(spec: str, what: str, example: str) -> Any:
    """The attribute ``module:ATTRIBUTE`` names (the attribute may be dotted), the current
    directory importable meanwhile; ``what`` and ``example`` word the error of a spec without
    a colon."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"{spec!r}: name {what} as module:ATTRIBUTE, e.g. {example}")
    with _current_directory_importable():
        try:
            module = importlib.import_module(module_name)
        except (Exception, SystemExit) as error:  # a module that exits on import says so too
            raise ValueError(f"{spec!r}: cannot import {module_name!r}: "
                             f"{_one_line(error)}") from None
    found: Any = module
    walked: list[str] = []  # the dotted attribute's parts found so far
    for part in attribute.split("."):
        where = f"{module_name}:{'.'.join(walked)}" if walked else module_name
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ValueError(f"{spec!r}: {where} has no attribute {part!r}") from None
        except Exception as error:  # a module __getattr__ or a property that fails otherwise
            raise ValueError(f"{spec!r}: reading {part!r} of {where} raised "
                             f"{_one_line(error)}") from None
        walked.append(part)
    return found


def _one_line(error: BaseException) -> str:
    """``Type: message`` on one line: an error message may span several (a traceback of its
    own, a list of problems), and a CLI or pytest usage error prints one line."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def kvfsm_machines() -> dict[str, Declaration[Any, Any]]:
    """kvfsm's own declared machines, by name."""
    return {name: load_machine(spec) for name, spec in KVFSM_MACHINES.items()}


@contextlib.contextmanager
def _current_directory_importable() -> Iterator[None]:
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(here)
