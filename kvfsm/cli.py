"""The ``kvfsm`` command.

``kvfsm demo`` stores a KV cache, wipes it, loads it back and verifies every byte.
``kvfsm diagrams`` draws the declared machines to diagrams/NAME.dot and .svg; ``--check`` fails
when a committed drawing no longer matches its declaration.
``kvfsm explore`` makes every NIXL call fail at every step and checks the invariants on every path.
``kvfsm replay FILE`` replays recorded transfer traces against the declared lifecycle.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "console", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``kvfsm`` argument parser (its commands' modules, torch among what they import, are
    imported here: within :func:`console`'s hold on Ctrl-C)."""
    from kvfsm import demo, diagrams, trace  # noqa: PLC0415
    from kvfsm.testing import explore  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="kvfsm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(commands.add_parser(
        "demo", help="store, wipe, load and verify a KV cache", description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    diagrams.add_arguments(commands.add_parser(
        "diagrams", help="draw the declared machines (DOT and SVG); --check them",
        description=diagrams.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    explore.add_arguments(commands.add_parser(
        "explore", help="fail every NIXL call at every step; check the invariants on every path",
        description=explore.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    trace.add_arguments(commands.add_parser(
        "replay", help="replay recorded transfer traces against the declared lifecycle",
        description=trace.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvfsm`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    check = getattr(args, "check_arguments", None)  # what argparse cannot say: a usage error
    if check is not None:
        check(args)
    from kvfsm import demo, diagrams, trace  # noqa: PLC0415 - imported by build_parser
    from kvfsm.testing import explore  # noqa: PLC0415

    if args.command == "diagrams":
        return diagrams.run(args)
    commands = {"demo": demo.run, "explore": explore.run, "replay": trace.run}
    try:
        return commands[args.command](args)
    except Exception as error:  # a user-facing command: say what went wrong, in one line
        print(f"kvfsm {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    except KeyboardInterrupt:  # (the command cleaned up on its way out): no traceback
        print(f"kvfsm {args.command}: interrupted", file=sys.stderr)
        return 130


def console() -> int:
    """The ``kvfsm`` command (and ``python -m kvfsm``): :func:`main`, then kvfsm's warnings
    and errors on stderr while the process exits. The exit waits for the transfers NIXL still
    runs, up to :data:`~kvfsm.tiers.base.EXIT_WAIT_SECONDS`, and says so there (a phase of
    the demo past ``--timeout`` leaves them): the wait is not a silent one. A second Ctrl-C
    stops it.

    A Ctrl-C before the command runs (as its modules are imported) or once it returned is one
    line and status 130, no traceback: what the command dropped (its NIXL agents) is collected
    here, not in the interpreter's exit, where Python prints an interrupt as ignored and the
    status stays 0."""
    try:
        status = main()
        gc.collect()
    except KeyboardInterrupt:
        print("kvfsm: interrupted", file=sys.stderr)
        status = 130
    library = logging.getLogger("kvfsm")
    if not any(isinstance(handler, _ExitHandler) for handler in library.handlers):
        library.addHandler(_ExitHandler())
    return status


class _ExitHandler(logging.Handler):
    """kvfsm's warnings and errors, a line each on the process's stderr (whichever it is when
    one is written)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("kvfsm: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)
