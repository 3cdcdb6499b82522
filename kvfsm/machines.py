"""The machines kvfsm declares, by name, and loading a user's machine from ``module:ATTRIBUTE``."""

from __future__ import annotations

import importlib
from typing import Any

from kvfsm.engine import Declaration

__all__ = ["KVFSM_MACHINES", "kvfsm_machines", "load_machine"]

#: kvfsm's own machines: name -> where the declaration lives
KVFSM_MACHINES = {
    "transfer": "kvfsm.lifecycle:TRANSFER_MACHINE",
}


def load_machine(spec: str) -> Declaration[Any, Any]:
    """The declaration named by ``module:ATTRIBUTE``, or by the name of one of kvfsm's machines.

    Raises:
        ValueError: the spec does not name a declaration.
    """
    spec = KVFSM_MACHINES.get(spec, spec)
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"name a machine as module:ATTRIBUTE or one of "
                         f"{', '.join(KVFSM_MACHINES)}; got {spec!r}")
    try:
        value = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot load machine {spec!r}: {error}") from error
    if not isinstance(value, Declaration):
        raise ValueError(f"{spec} is a {type(value).__name__}, not a kvfsm Declaration")
    return value


def kvfsm_machines() -> dict[str, Declaration[Any, Any]]:
    """kvfsm's own declared machines, by name."""
    return {name: load_machine(spec) for name, spec in KVFSM_MACHINES.items()}
