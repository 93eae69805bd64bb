"""``reservoir run``: place a request that carries a task, show its output and follow its
states, exit with its exit code; ``reservoir logs`` and ``reservoir wait`` for a task
placed before (``run --detach``, or another process); ``reservoir tasks`` lists them."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import click

from reservoir.cli.formats import Column, emit, format_options, picked
from reservoir.cli.options import (
    broker_option,
    json_option,
    open_requestor,
    parse_pairs,
    seconds_option,
)
from reservoir.cli.shape import request_from_options, shape_options
from reservoir.exit_status import (
    EXIT_BROKER,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_NOT_PLACED,
    EXIT_TASK_NOT_RUN,
)
from reservoir.protocol.messages import TaskSpec, TaskState
from reservoir.protocol.placement import PlacementError

if TYPE_CHECKING:
    from reservoir.runtime.output_reader import OutputReader
    from reservoir.runtime.requestor import Requestor


@click.command(context_settings={"allow_interspersed_args": False})
@broker_option()
@shape_options
@click.option("--image", help="Run COMMAND in a container of this image (the docker driver).")
@click.option(
    "--driver",
    help="The task driver the node runs it with (default: docker with --image, else exec).",
)
@click.option(
    "--env", "env", multiple=True, metavar="KEY=VALUE", help="An environment variable. Repeatable."
)
@click.option("--workdir", help="The task's working directory on the node (default: /).")
@click.option(
    "--keep-allocation",
    is_flag=True,
    help="Keep the allocation after the task ends (free it with reservoir free).",
)
@seconds_option("--grace", 10.0, "On a release, SIGKILL this long after SIGTERM.", minimum=0.0)
@click.option(
    "--detach",
    is_flag=True,
    help="Return once the task runs, printing the request id (then: reservoir logs, "
    "reservoir wait).",
)
@seconds_option("--timeout", 30.0, "Give up placing after this many seconds.")
@json_option(
    "Print each task state as one JSON object per line (the task's output is not shown: "
    "reservoir logs)."
)
@click.argument("command", nargs=-1)
def run(
    broker_url: str | None,
    image: str | None,
    driver: str | None,
    env: tuple[str, ...],
    workdir: str | None,
    keep_allocation: bool,
    grace_s: float,
    detach: bool,
    timeout_s: float,
    as_json: bool,
    command: tuple[str, ...],
    **shape: Any,
) -> None:
    """Place COMMAND on a node with room for it, run it there and follow it: its stdout
    and stderr are shown as it writes them, each state of the task on stderr as it
    changes, and the exit status is the task's (125 when it never started). Put -- before
    COMMAND when it has options:

        reservoir run --vcpus 1 --memory-mb 256 -- sh -c 'echo out; echo err >&2; exit 3'

    The request takes every option of reservoir request (traits, groups, NUMA, PCI
    devices, hints; 1 VCPU when it names no resource); when no node takes it, the nodes'
    reasons are said (--no-explain: only those of the nodes asked directly). Ctrl-C
    releases the placement, which stops the task."""
    from reservoir.runtime.requestor import FreeIncomplete

    if not command and image is None:
        raise click.UsageError("give the COMMAND to run (or an --image, to run its own)")
    variables = parse_pairs(env, "KEY=VALUE", upper=False)
    try:
        task = TaskSpec(
            driver=driver or ("docker" if image else "exec"),
            command=command,
            env=variables,
            workdir=workdir,
            image=image,
            keep_allocation=keep_allocation,
            stop_grace_s=grace_s,
        )
    except ValueError as error:
        raise click.UsageError(f"not a valid task: {error}") from None
    if not any(shape[name] for name in ("vcpus", "memory_mb", "disk_gb", "resources")):
        shape["vcpus"] = DEFAULT_VCPUS  # a task takes some room: one CPU unless told
    spec = request_from_options(task=task, **shape)

    def show(state: TaskState) -> None:
        if as_json:
            click.echo(json.dumps(_record(state), sort_keys=True))
        else:
            click.echo(_line(state), err=True)

    with open_requestor(broker_url) as requestor:
        try:
            # the request carries the task, checked once by request_from_options
            task_run = requestor.run(request=spec, timeout_s=timeout_s, on_change=show)
        except ValueError as error:
            raise click.UsageError(f"not a valid request: {error}") from None
        try:
            placement = task_run.placement.result(timeout=timeout_s + 5.0)
        except PlacementError as error:
            click.echo(f"not placed: {error.explanation}", err=True)
            sys.exit(EXIT_NOT_PLACED)
        if not as_json:
            nodes = ", ".join(sorted(set(placement.nodes)))
            click.echo(f"placed {placement.request_id} on {nodes}", err=True)
        shown = None
        if not detach and not as_json:
            locations = sorted((a.node, a.allocation_id) for a in placement.allocations)
            shown = ShownOutput(requestor, placement.request_id, locations)
        try:
            if detach:
                task_run.wait_started()
                click.echo(placement.request_id)
                return
            task_run.wait()
            if shown is not None:
                shown.finish()
        except KeyboardInterrupt:
            if shown is not None:
                shown.stop()
            click.echo(f"interrupted: releasing {placement.request_id}", err=True)
            try:
                requestor.release(placement)
            except (FreeIncomplete, TimeoutError) as error:
                # said as it is: the task goes on until its node frees the allocation
                click.echo(
                    f"interrupted: the release of {placement.request_id} is not confirmed "
                    f"({error or 'no answer in time'}); free it with reservoir free "
                    f"--request-id {placement.request_id}",
                    err=True,
                )
            sys.exit(EXIT_INTERRUPTED)
    code = task_run.exit_code
    sys.exit(EXIT_TASK_NOT_RUN if code is None else code)


#: what a task asks for when the command names no resource
DEFAULT_VCPUS = 1

#: once the tasks ended, how long their output is still read (what the nodes kept of it)
OUTPUT_DRAIN_S = 30.0


class ShownOutput:
    """The output of a request's tasks, shown as it is written: each instance's stdout on
    stdout and its stderr on stderr (its lines prefixed with the instance when there are
    several), read by a thread per stream and instance."""

    def __init__(
        self,
        requestor: Requestor,
        request_id: str,
        locations: list[tuple[str, str]],
        *,
        prefix: bool | None = None,
    ) -> None:
        self._prefix = len(locations) > 1 if prefix is None else prefix
        self._lock = threading.Lock()
        self.readers: list[OutputReader] = []
        self._threads = []
        for stream in ("stdout", "stderr"):
            for reader in requestor.output_readers(
                request_id, stream=stream, follow=True, locations=locations
            ):
                self.readers.append(reader)
                thread = threading.Thread(
                    target=self._pump, args=(reader,), name=f"output-{stream}", daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def _pump(self, reader: OutputReader) -> None:
        sink = sys.stdout.buffer if reader.stream == "stdout" else sys.stderr.buffer
        lines = _Lines(f"[{reader.allocation_id}] ".encode() if self._prefix else b"")
        try:
            for piece in reader:
                if piece.skipped:
                    self._say(
                        f"reservoir: {piece.skipped} byte(s) of the {reader.stream} of "
                        f"{reader.allocation_id} were no longer kept by {reader.node} when "
                        "they were read"
                    )
                self._write(sink, lines.take(piece.data))
            self._write(sink, lines.rest())
        except Exception as error:  # the node went away: said, the task's state still counts
            if not reader.stopped:  # (stopped: Ctrl-C, said otherwise)
                self._say(f"reservoir: the {reader.stream} of {reader.allocation_id}: {error}")

    def _write(self, sink: Any, data: bytes) -> None:
        if data:
            with self._lock:
                sink.write(data)
                sink.flush()

    def _say(self, line: str) -> None:
        with self._lock:
            sys.stdout.flush()
            click.echo(line, err=True)

    def finish(self, timeout_s: float = OUTPUT_DRAIN_S) -> None:
        """Once the tasks ended: wait for the rest of their output (what their nodes kept)."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        unread = [r for r, t in zip(self.readers, self._threads, strict=True) if t.is_alive()]
        for reader in unread:
            reader.stop()
            self._say(
                f"reservoir: the {reader.stream} of {reader.allocation_id} was not read to its "
                f"end within {timeout_s:g} s ({reader.node} did not answer)"
            )

    def stop(self) -> None:
        for reader in self.readers:
            reader.stop()


class _Lines:
    """Prefixes each line of a stream (nothing when the prefix is empty)."""

    def __init__(self, prefix: bytes) -> None:
        self._prefix = prefix
        self._partial = b""

    def take(self, data: bytes) -> bytes:
        if not self._prefix:
            return data
        *whole, self._partial = (self._partial + data).split(b"\n")
        return b"".join(self._prefix + line + b"\n" for line in whole)

    def rest(self) -> bytes:
        if not self._prefix or not self._partial:
            return b""
        rest, self._partial = self._partial, b""
        return self._prefix + rest + b"\n"


def _line(state: TaskState) -> str:
    where = f"{state.sender} {state.allocation_id}"
    if state.state == "started":
        return f"task started on {where} (limits: {state.limits or 'none'})"
    if state.state == "exited":
        why = f": {state.reason}" if state.reason and state.exit_code is not None else ""
        return f"task exited with {_code(state)} on {where}{why}"
    if state.state == "stopped":
        return f"task stopped on {where}: {state.reason}, exit code {_code(state)}"
    if state.state == "failed":
        return f"task failed to start on {where}: {state.reason}"
    return f"task {state.state} on {where}"


def _code(state: TaskState) -> str:
    if state.exit_code is None:
        return f"an unknown code ({state.reason})" if state.reason else "an unknown code"
    return str(state.exit_code)


def _record(state: TaskState) -> dict[str, object]:
    return {
        "request_id": state.request_id,
        "node": state.sender,
        "allocation_id": state.allocation_id,
        "state": state.state,
        "exit_code": state.exit_code,
        "reason": state.reason,
        "limits": state.limits,
    }


#: a row per task; field names as ``--json`` has them
TASK_COLUMNS = (
    Column("node", "node", numeric=False),
    Column("request_id", "request", numeric=False),
    Column("allocation_id", "allocation", numeric=False),
    Column("state", "state", numeric=False),
    Column("exit_code", "exit code"),
    Column("reason", "reason", numeric=False),
)


@click.command("tasks")
@broker_option()
@click.option("--request-id", help="Only the tasks of this request.")
@seconds_option("--wait", 0.5, "Gather the nodes' answers this long.")
@json_option("Print one JSON object per task, one a line.")
@format_options
def tasks_command(
    broker_url: str | None,
    request_id: str | None,
    wait_s: float,
    as_json: bool,
    output_format: str,
    columns: tuple[str, ...],
) -> None:
    """List the tasks the nodes know of (running, and lately ended): a row per task with
    its node, request, allocation, state, exit code and reason (-f table|json|yaml|csv|
    value, -c COLUMN; --json: a JSON object per line)."""
    from reservoir.broker import BrokerError
    from reservoir.cli.options import cannot_reach_broker, load_settings
    from reservoir.protocol.messages import InvalidField
    from reservoir.runtime.backoff import quietly_connecting
    from reservoir.runtime.task_query import ask_tasks

    picked(TASK_COLUMNS, columns)
    settings = load_settings(broker_url=broker_url)
    try:
        with quietly_connecting():
            states = ask_tasks(settings.broker_url, request_id, wait_s=wait_s, settings=settings)
    except BrokerError as error:
        cannot_reach_broker(error)
    except InvalidField as error:
        raise click.BadParameter(error.problem, param_hint="--request-id") from None
    if as_json:
        for state in states:
            click.echo(json.dumps(_record(state), sort_keys=True))
        return
    if not states and output_format == "table":
        # nodes with no task to tell of stay silent: so much is known, and no more
        click.echo(f"no tasks: no node answered with one within {wait_s:g} s")
        return
    emit([_record(state) for state in states], TASK_COLUMNS, output_format, columns)


def _located(requestor: Requestor, request_id: str, command: str) -> list[tuple[str, str]]:
    """Where the tasks of ``request_id`` are, or the one line and the exit status."""
    from reservoir.protocol.messages import InvalidField
    from reservoir.runtime.requestor import FindIncomplete, NoSuchTask

    try:
        return requestor.task_locations(request_id)
    except InvalidField as error:
        raise click.BadParameter(error.problem, param_hint="REQUEST_ID") from None
    except NoSuchTask as error:
        click.echo(f"reservoir {command}: {error}", err=True)
        sys.exit(EXIT_NOT_FOUND)
    except FindIncomplete as error:
        click.echo(f"reservoir {command}: {error}; try again", err=True)
        sys.exit(EXIT_BROKER)


@click.command("logs")
@broker_option()
@click.option("-f", "--follow", is_flag=True, help="Follow the output until the task ends.")
@click.option("--stderr", "stderr", is_flag=True, help="The task's stderr (default: stdout).")
@click.option("--allocation", "allocation_id", help="Only this instance's task.")
@click.argument("request_id")
def logs(
    broker_url: str | None,
    follow: bool,
    stderr: bool,
    allocation_id: str | None,
    request_id: str,
) -> None:
    """Print the output of the tasks of REQUEST_ID, running or ended (their node keeps it
    for a while after they end): what is kept now, or with -f, as it is written until
    every task ended. Each instance's lines are prefixed with it when there are several.
    Exit status 1 when no node holds a task of the id."""
    from reservoir.runtime.requestor import NoSuchTask

    stream = "stderr" if stderr else "stdout"
    sink = sys.stderr.buffer if stderr else sys.stdout.buffer
    with open_requestor(broker_url) as requestor:
        locations = _located(requestor, request_id, "logs")
        if allocation_id is not None:
            locations = [(node, a) for node, a in locations if a == allocation_id]
            if not locations:
                click.echo(
                    f"reservoir logs: request {request_id} has no instance {allocation_id}",
                    err=True,
                )
                sys.exit(EXIT_NOT_FOUND)
        try:
            readers = requestor.output_readers(
                request_id, stream=stream, follow=follow, locations=locations
            )
        except NoSuchTask as error:
            click.echo(f"reservoir logs: {error}", err=True)
            sys.exit(EXIT_NOT_FOUND)
        prefixes = {
            r.allocation_id: _Lines(f"[{r.allocation_id}] ".encode() if len(readers) > 1 else b"")
            for r in readers
        }
        from reservoir.runtime.output_reader import OutputUnreachable, merged

        try:
            for piece in merged(readers):
                if piece.skipped:
                    sink.flush()
                    click.echo(
                        f"reservoir logs: {piece.skipped} byte(s) of the {stream} of "
                        f"{piece.allocation_id} are no longer kept by {piece.node}",
                        err=True,
                    )
                sink.write(prefixes[piece.allocation_id].take(piece.data))
                sink.flush()
        except OutputUnreachable as error:
            click.echo(f"reservoir logs: {error}", err=True)
            sys.exit(EXIT_BROKER)
        for lines in prefixes.values():
            sink.write(lines.rest())
        sink.flush()
        unknown = [r for r in readers if r.task is None]
        if unknown and len(unknown) == len(readers):
            click.echo(f"reservoir logs: no node keeps a task of {request_id} any more", err=True)
            sys.exit(EXIT_NOT_FOUND)
        for reader in readers:
            if reader.task is not None and not reader.kept:
                click.echo(
                    f"reservoir logs: {reader.node} keeps no output of {reader.allocation_id} "
                    f"(its task {reader.task.state}"
                    + (f": {reader.task.reason})" if reader.task.reason else ")"),
                    err=True,
                )


@click.command("wait")
@broker_option()
@json_option("Print each task's final state as one JSON object per line.")
@click.argument("request_id")
def wait(broker_url: str | None, as_json: bool, request_id: str) -> None:
    """Wait until every task of REQUEST_ID ended (placed by reservoir run --detach, or
    by anyone); exit with the task's exit code, as reservoir run does (125 when it never
    started or its code is unknown; the first non-zero one of several instances). Killed
    and started again, it picks up where the tasks are: their nodes remember them for a
    while after they ended. Exit status 1 when no node holds a task of the id."""
    from reservoir.protocol.messages import InvalidField
    from reservoir.runtime.requestor import FindIncomplete, NoSuchTask

    with open_requestor(broker_url) as requestor:
        try:
            task_run = requestor.attach(request_id)
        except InvalidField as error:
            raise click.BadParameter(error.problem, param_hint="REQUEST_ID") from None
        except NoSuchTask as error:
            click.echo(f"reservoir wait: {error}", err=True)
            sys.exit(EXIT_NOT_FOUND)
        except FindIncomplete as error:
            click.echo(f"reservoir wait: {error}; try again", err=True)
            sys.exit(EXIT_BROKER)
        final = task_run.wait()
        for state in sorted(final.values(), key=lambda s: (s.sender, s.allocation_id)):
            if as_json:
                click.echo(json.dumps(_record(state), sort_keys=True))
            else:
                click.echo(_line(state), err=True)
    code = task_run.exit_code
    sys.exit(EXIT_TASK_NOT_RUN if code is None else code)
