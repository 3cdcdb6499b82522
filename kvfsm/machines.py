"""The machines kvfsm declares, by name, and loading a user's machine from ``module:ATTRIBUTE``.

Adding a machine to kvfsm is adding a line to :data:`KVFSM_MACHINES`: the diagrams, the
transition-coverage plugin and ``kvfsm replay`` all take their list from here.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from kvfsm.engine import Declaration

__all__ = ["KVFSM_MACHINES", "kvfsm_machines", "load_machine"]

#: kvfsm's own machines: name -> ``module:ATTRIBUTE`` of the declaration
KVFSM_MACHINES = {
    "transfer": "kvfsm.lifecycle:TRANSFER_MACHINE",
    "peer_receive": "kvfsm.peer:PEER_RECEIVE",
    "peer_link": "kvfsm.peer_link:PEER_LINK",
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
    spec = KVFSM_MACHINES.get(spec, spec)
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"{spec!r}: name a machine as module:ATTRIBUTE, e.g. "
                         f"kvfsm.lifecycle:TRANSFER_MACHINE, or one of {', '.join(KVFSM_MACHINES)}")
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
    if not isinstance(found, Declaration):
        raise ValueError(f"{spec!r} is not a kvfsm Declaration (found {type(found).__name__})")
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
