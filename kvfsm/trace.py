"""Transfer traces: recorded as transfers run, written as JSON lines, replayed against a machine.

Every transfer keeps its trace (:attr:`kvfsm.transfer.Transfer.trace`): each step the compiled
machine took, with the time (a :class:`~kvfsm.engine.Chain` of steps taken in one go is kept
once, and read back as its steps, all at that time). A :class:`TraceRecorder` attached to a
tier writes one JSON line a transfer as it is published::

    {"machine": "transfer", "job_id": 3, "success": false,
     "reason": {"kind": "raised", "call": "check_xfer_state",
                "error": "nixlBackendError: NIXL_ERR_BACKEND"},
     "steps": [["post", "PROC", "SUBMITTED", "PROCESSING", 0.0], ...]}

(each step: event, answer, from, to, seconds since the first step). ``success`` and ``reason``
are the job's result (:class:`~kvfsm.transfer.JobResult`; ``reason`` is null for a success, see
:class:`~kvfsm.machines.transfer.FailureReason`), so a trace says why a job failed without a log.
Traces written before they were recorded have neither, and replay all the same.
:func:`replay` runs a trace against a machine's declaration and reports the first step where
the declaration would not have done what the trace says, so a trace from any run, on any
version, can be checked against the lifecycle as declared now.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvfsm.engine import Chain, Declaration, InvalidTransition
from kvfsm.machines.transfer import FailureKind, FailureReason
from kvfsm.transfer import Transfer, TransferJob

#: kvfsm's machines by their state enums, once a recorder needs them
_KVFSM_STATES: dict[type, str] = {}

__all__ = ["Divergence", "TraceRecorder", "read_traces", "replay", "trace_reason", "trace_steps"]


def trace_steps(transfer: Transfer) -> list[list[Any]]:
    """A transfer's trace as ``[event, answer, from, to, seconds]`` rows."""
    trace = transfer.trace
    if not trace:
        return []
    start = trace[1]
    return [[step.edge.event, step.answer.name, step.source.name, step.dest.name,
             round(moment - start, 6)]
            for entry, moment in zip(trace[::2], trace[1::2], strict=True)
            for step in (entry.traced if isinstance(entry, Chain) else (entry,))]


class BareRecord:
    """A bare record a declaration's table runs on (the table explorer, :func:`replay`): a
    state, a latched outcome, and the fields the shipped actions write."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.success: bool | None = None
        self.error: str | None = None
        self.reason: Any = None
        self.retries = 0
        self.leaks: tuple[Any, ...] = ()
        self.finished_at = 0.0
        self.job = TransferJob(0, (), ())
        self.trace: list[Any] = []

    def key(self) -> tuple[Any, bool | None]:
        return self.state, self.success


def _kvfsm_states() -> dict[type, str]:
    """The state enum of each of kvfsm's machines, to its name."""
    from kvfsm.machines import kvfsm_machines  # noqa: PLC0415 - it imports the machines

    return {declaration.states: name for name, declaration in kvfsm_machines().items()}


class TraceRecorder:
    """Writes the trace of every transfer a tier publishes, one JSON line each.

    Use ``tier.on_published.append(recorder)``; :meth:`close` (or a ``with`` block) closes the
    file.
    """

    def __init__(self, path: str | Path, machine: str | None = None) -> None:
        #: where the traces go
        self.path = Path(path)
        #: the machine each line names, for ``kvfsm replay`` (``module:ATTRIBUTE``, or one of
        #: kvfsm's machines); None: kvfsm's transfer machine for a transfer in its states, else
        #: none (the line names the transfer's states instead, and a replay asks for
        #: ``--machine``)
        self.machine = machine
        if machine is None and not _KVFSM_STATES:
            _KVFSM_STATES.update(_kvfsm_states())
        self.count = 0
        self._file: IO[str] = self.path.open("w", encoding="utf-8")

    def __call__(self, transfer: Transfer) -> None:
        result = transfer.result()
        machine, states = self.machine, type(transfer.state)
        if machine is None:
            machine = _KVFSM_STATES.get(states)
        line: dict[str, Any] = {"machine": machine}
        if machine is None:  # a lifecycle of the user's own: say which, for the replay
            line["states"] = f"{states.__module__}.{states.__qualname__}"
        line.update({"job_id": transfer.job_id, "success": result.success,
                     "reason": None if result.reason is None else result.reason.as_dict(),
                     "steps": trace_steps(transfer)})
        try:
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        except OSError as error:
            raise self._named(error) from error
        self.count += 1

    def close(self) -> None:
        """Flush and close the file."""
        try:
            self._file.close()
        except OSError as error:
            raise self._named(error) from error

    def _named(self, error: OSError) -> OSError:
        """``error`` saying which file it is about (a full disk says only that it is full)."""
        return OSError(error.errno, f"{error.strerror}: writing traces to {self.path}")

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_traces(path: str | Path) -> Iterator[dict[str, Any]]:
    """The traces of a file written by :class:`TraceRecorder`.

    Raises:
        ValueError: a line is not a trace (no steps, a step that is not one, a success that
            is not true or false; one written before outcomes were has none, and is read),
            or its reason is not one (the message names the line).
    """
    with Path(path).open(encoding="utf-8", errors="surrogateescape") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                trace = json.loads(line)
                if not isinstance(trace, dict):
                    raise ValueError(f"a JSON {type(trace).__name__}, not an object")
                if "steps" not in trace:
                    raise ValueError("no steps")
                if not isinstance(trace["steps"], list):
                    raise ValueError(f"steps must be a list of steps, got "
                                     f"{json.dumps(trace['steps'])[:80]}")
                job_id = trace.get("job_id")
                if job_id is not None and type(job_id) is not int:  # (JSON: no bool is one)
                    raise ValueError(f"job_id must be an int, got {json.dumps(job_id)[:80]}")
                _check_steps(trace["steps"])
                if "success" in trace and type(trace["success"]) is not bool:  # (checked
                    # against the steps; a trace written before outcomes were has none)
                    raise ValueError(f"success must be true or false, got "
                                     f"{json.dumps(trace['success'])}")
                trace_reason(trace)
            except json.JSONDecodeError as error:  # (its own "line 2" is the file line's end)
                raise ValueError(f"{path}:{number}: not a trace (not JSON: {error.msg} at "
                                 f"character {error.pos + 1} of the line; a line cut short?)"
                                 ) from None
            except (ValueError, AttributeError) as error:
                raise ValueError(f"{path}:{number}: not a trace ({error})") from None
            trace["line"] = number
            yield trace


def _check_steps(steps: list[Any]) -> None:
    """Each step is [event, answer, from, to] and, in a trace that times them, the seconds
    since the first step: a finite number, never below the step's before (a time that goes
    back, or is negative or NaN, is no time kvfsm's monotonic clock gave)."""
    before = 0.0
    for index, row in enumerate(steps, start=1):
        if (not isinstance(row, list) or len(row) < 4
                or not all(isinstance(part, str) for part in row[:4])
                or (len(row) > 4 and type(row[4]) not in (int, float))):
            raise ValueError(f"step {index} is not [event, answer, from, to, seconds]: "
                             f"{row!r}")
        if len(row) > 4:
            seconds = row[4]
            if not before <= seconds < math.inf:
                raise ValueError(f"step {index} is at {seconds!r} s, "
                                 + (f"earlier than step {index - 1}'s {before!r} s"
                                    if 0 <= seconds < before
                                    else "not a time since the first step")
                                 + ": a trace's times are seconds since its first step, "
                                 "never decreasing")
            before = seconds


def trace_reason(trace: dict[str, Any]) -> FailureReason | None:
    """Why a traced job failed; None for a success, or a trace written before reasons were.

    Raises:
        ValueError: the trace's ``reason`` is not one.
    """
    reason = trace.get("reason")
    return None if reason is None else FailureReason.from_dict(reason)


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a recorded trace and a declaration part ways."""

    job_id: Any
    line: int
    step: int
    recorded: str
    declared: str

    def __str__(self) -> str:
        return (f"line {self.line}, job {self.job_id}, step {self.step}: recorded "
                f"{self.recorded}; the declaration: {self.declared}")


def replay(declaration: Declaration[Any, Any], trace: dict[str, Any]) -> Divergence | None:
    """Run ``trace`` against ``declaration``; the first divergence, or None when it replays."""
    machine = declaration.compile(listen=False)
    # an event's answers may come from several enums (a step's own answers and RAISED, say):
    # every answer of that name is tried, in one order whatever the hash seed
    answers_named: dict[str, dict[str, list[Any]]] = {}
    for event, answers in declaration.answers.items():
        named = answers_named[event] = {}
        for answer in sorted(answers, key=lambda a: (type(a).__qualname__, a.name)):
            named.setdefault(answer.name, []).append(answer)
    state = declaration.initial
    failed = False
    record: BareRecord | None = BareRecord(state)  # what the declared actions latch

    def diverged(index: int, recorded: str, declared: str) -> Divergence:
        return Divergence(trace.get("job_id"), trace.get("line", 0), index, recorded, declared)

    for index, row in enumerate(trace["steps"], start=1):
        event, answer_name, source, dest = row[:4]
        recorded = f"{source} -{event}({answer_name})-> {dest}"
        taken = _step_of(machine, answers_named, state, row)
        if isinstance(taken, str):
            return diverged(index, recorded, taken)
        state = taken.dest
        failed = failed or state in declaration.failure_states
        if record is not None:
            record.state = state
            try:
                for action in taken.actions:
                    action(record, taken.answer, None)
            except Exception:  # an action that needs what a bare record lacks: the outcome
                record = None  # the steps latch is not known, and not compared
    end = len(trace["steps"]) + 1
    if state not in declaration.final:  # a trace is written as its transfer is published
        return diverged(end, f"the trace ends in {state.name}",
                        "a published transfer is in a final state: "
                        + ", ".join(sorted(s.name for s in declaration.final)))
    if trace.get("success") is True and failed:  # (a failure may end in a state of a
        # user's own that the declaration does not name a failure state: not the converse)
        names = ", ".join(sorted(s.name for s in declaration.failure_states))
        return diverged(end, "success=true",
                        f"the steps went through a failure state ({names})")
    reasoned = _reason_diverges(trace)
    if reasoned is not None:
        return diverged(end, *reasoned)
    latched = _latched_diverges(declaration, trace, record, state)
    return None if latched is None else diverged(end, *latched)


def _latched_diverges(declaration: Declaration[Any, Any], trace: dict[str, Any],
                      record: BareRecord | None, state: Any) -> tuple[str, str] | None:
    """What a trace's outcome records against what the declared actions of its steps latch
    (recorded, declared), or None; nothing is compared where an action needed more than a
    bare record (``record`` None)."""
    if record is None or not isinstance(trace.get("success"), bool):
        return None
    latched = bool(record.success) and state not in (
        declaration.final & declaration.failure_states)
    if trace["success"] is not latched:
        return (f"success={str(trace['success']).lower()}",
                f"the declared actions of these steps latch success={str(latched).lower()}")
    reason = trace.get("reason")
    kind = reason.get("kind") if isinstance(reason, dict) else None
    if (record.success is None and record.reason is None
            and kind not in (None, FailureKind.UNKNOWN.value)
            and state not in declaration.failure_states):
        return (f"a failure's reason of kind {kind}",
                "the declared actions of these steps latch no outcome, so nothing says why "
                "the job failed (its reason: unknown)")
    return None


def _reason_diverges(trace: dict[str, Any]) -> tuple[str, str] | None:
    """What a trace's reason records against what its outcome and steps allow (recorded,
    declared), or None: a success has no reason, a failure has one (a trace written before
    reasons were has no field for one), and a reason of kind cancelled comes of a cancel."""
    success, reason = trace.get("success"), trace.get("reason")
    if success is True and reason is not None:
        return "success=true with a failure's reason", "a success carries no reason"
    if success is False and "reason" in trace and reason is None:
        return "success=false with no reason", "a failure carries its reason"
    if (reason is not None and reason.get("kind") == FailureKind.CANCELLED.value
            and not any(row[0] == "cancel" for row in trace["steps"])):
        return ("a reason of kind cancelled",
                "the steps took no cancel, so nothing cancelled the job")
    return None


def _step_of(machine: Any, answers_named: dict[str, dict[str, list[Any]]], state: Any,
             row: list[Any]) -> Any:
    """The declared step a trace's row took from ``state``, or what the declaration says
    instead (a str)."""
    event, answer_name, source, dest = row[:4]
    if source != state.name:
        return f"the transfer is in {state.name}"
    candidates = answers_named.get(event, {}).get(answer_name)
    if not candidates:
        return f"no event {event!r} with answer {answer_name}"
    steps, refusal = [], None
    for answer in candidates:
        try:
            steps.append(machine.step(state, event, answer))
        except InvalidTransition as error:
            refusal = refusal or error
    if not steps:
        return str(refusal)
    step = next((s for s in steps if s.dest.name == dest), steps[0])
    if step.dest.name != dest:
        return f"{source} -{event}({answer_name})-> {step.dest.name}"
    return step


#: what ``kvfsm replay --help`` says of its exit status
EXIT_STATUS = """\
exit status:
  0  every trace in the file replays clean
  1  a trace diverges from its declaration (the first divergence is printed)
  2  bad input: the file cannot be read (missing, a directory, no permission), holds no
     trace, or has a line that is not one; a --machine, or a machine a trace names, that
     does not load"""


def add_arguments(parser: Any) -> None:
    """The ``kvfsm replay`` options, and its exit status in its help."""
    parser.add_argument("file", help="a trace file (kvfsm demo --trace FILE, or TraceRecorder)")
    parser.add_argument("--machine", metavar="SPEC",
                        help="replay against this declaration (module:ATTRIBUTE); by default "
                             "the kvfsm machine each trace names")
    parser.epilog = EXIT_STATUS


def run(args: Any) -> int:
    """``kvfsm replay``: 0 when every trace replays, 1 at the first divergence.

    Raises:
        ValueError: the file cannot be read (the CLI's bad input, exit 2, not a divergence),
            holds no trace (an empty file would "replay clean" while checking nothing), or has
            a line that is not one.
    """
    from kvfsm.machines import load_machine  # noqa: PLC0415 - the CLI's own import

    if not args.file:
        raise ValueError("replay needs a trace file's path, got ''")
    if args.machine == "":
        raise ValueError("--machine needs module:ATTRIBUTE, got ''")
    fixed = load_machine(args.machine) if args.machine else None
    machines: dict[str, Declaration[Any, Any]] = {}
    count = steps = 0
    for trace in _readable_traces(args.file):
        named = trace.get("machine")
        if fixed is not None and named is not None and named != fixed.name:
            raise ValueError(f"{args.file}:{trace.get('line', '?')}: the trace is of machine "
                             f"{named!r}, not of --machine {args.machine} ({fixed.name!r}): "
                             "replay it without --machine, or with the machine it names")
        declaration = fixed or machines.get(trace.get("machine", ""))
        if declaration is None and trace.get("machine") is None and "states" in trace:
            raise ValueError(f"{args.file}:{trace.get('line', '?')}: the trace is of a "
                             f"lifecycle of its own (states {trace['states']}), which it does "
                             "not name: replay it with --machine module:ATTRIBUTE")
        if declaration is None:
            try:
                declaration = load_machine(str(trace.get("machine", "")))
            except ValueError as error:  # where it is said, as for a line that is no trace
                raise ValueError(f"{args.file}:{trace.get('line', '?')}: {error}") from None
            machines[trace.get("machine", "")] = declaration
        divergence = replay(declaration, trace)
        if divergence is not None:
            print(f"kvfsm replay: {args.file}: diverges from {declaration.name} at {divergence}")
            return 1
        count += 1
        steps += len(trace["steps"])
    if not count:
        raise ValueError(f"{args.file}: no traces in the file: nothing to replay")
    print(f"kvfsm replay: {args.file}: {count} trace{'s' if count != 1 else ''} ({steps} "
          f"step{'s' if steps != 1 else ''}) replay{'s' if count == 1 else ''} clean")
    return 0


def _readable_traces(path: str) -> Iterator[dict[str, Any]]:
    """:func:`read_traces`, with a file that cannot be read (missing, a directory, no
    permission, a read that fails) refused as bad input, naming it and why."""
    try:
        yield from read_traces(path)
    except OSError as error:
        raise ValueError(f"{path}: cannot read the trace file: "
                         f"{error.strerror or error}") from None
