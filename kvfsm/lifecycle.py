"""The transfer lifecycle, under the name it had first: :mod:`kvfsm.machines.transfer`.

The transfer machine's declaration (its states, events, answers, guards, actions, the table and
why a job failed) lives alone in :mod:`kvfsm.machines.transfer`, beside kvfsm's other machines;
its docstring is the lifecycle's theory of operation. This module re-exports it, so code that
imports ``kvfsm.lifecycle`` (and ``kvfsm.lifecycle:TRANSFER_MACHINE``) keeps working; kvfsm
itself imports the declaration module.
"""

from __future__ import annotations

from kvfsm.machines import transfer as _transfer
from kvfsm.machines.transfer import *  # noqa: F403 - every public name, under this one too

__all__ = list(_transfer.__all__)
