"""``reservoir run``: place a request that carries a task, follow the task, exit with its
exit code."""

from __future__ import annotations

import json
import sys

import click

from reservoir.cli.formats import Column, emit, format_options, picked
from reservoir.cli.options import (
    broker_option,
    json_option,
    open_requestor,
    parse_pairs,
    seconds_option,
    within,
)
from reservoir.exit_status import EXIT_INTERRUPTED, EXIT_NOT_PLACED, EXIT_TASK_NOT_RUN
from reservoir.protocol.messages import TaskState
from reservoir.protocol.placement import PlacementError


@click.command(context_settings={"allow_interspersed_args": False})
@broker_option()
@click.option("--vcpus", type=within("vcpus"), help="VCPUs per instance.")
@click.option("--memory-mb", type=within("memory_mb"), help="Memory per instance, MiB.")
@click.option("--disk-gb", type=within("disk_gb"), help="Disk per instance, GiB.")
@click.option(
    "--count",
    default=1,
    show_default=True,
    type=within("count", minimum=1),
    help="Instances to run.",
)
@click.option("--image", help="Run COMMAND in a container of this image (the docker driver).")
@click.option(
    "--driver",
    help="The task driver the node runs it with (default: docker with --image, else exec).",
)
@click.option(
    "--env", "env", multiple=True, metavar="KEY=VALUE", help="An environment variable. Repeatable."
)
@click.option("--workdir", help="The task's working directory on the node.")
@click.option(
    "--keep-allocation",
    is_flag=True,
    help="Keep the allocation after the task ends (free it with reservoir free).",
)
@seconds_option("--grace", 10.0, "On a release, SIGKILL this long after SIGTERM.", minimum=0.0)
@click.option("--request-id", help="Idempotency key: asking again returns the same placement.")
@click.option("--detach", is_flag=True, help="Return once the task runs, printing the request id.")
@seconds_option("--timeout", 30.0, "Give up placing after this many seconds.")
@json_option("Print each task state as one JSON object per line.")
@click.argument("command", nargs=-1, required=True)
def run(
    broker_url: str | None,
    vcpus: int | None,
    memory_mb: int | None,
    disk_gb: int | None,
    count: int,
    image: str | None,
    driver: str | None,
    env: tuple[str, ...],
    workdir: str | None,
    keep_allocation: bool,
    grace_s: float,
    request_id: str | None,
    detach: bool,
    timeout_s: float,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Place COMMAND on a node with room for it, run it there and follow it: each state
    of the task is shown as it changes (on stderr), and the exit status is the task's
    (125 when it never started). Put -- before COMMAND when it has options:

        reservoir run --vcpus 1 --memory-mb 256 -- sh -c 'exit 3'

    Ctrl-C releases the placement, which stops the task."""
    from reservoir.runtime.requestor import FreeIncomplete

    variables = parse_pairs(env, "KEY=VALUE", upper=False)

    def show(state: TaskState) -> None:
        if as_json:
            click.echo(json.dumps(_record(state), sort_keys=True))
        else:
            click.echo(_line(state), err=True)

    with open_requestor(broker_url) as requestor:
        try:
            task_run = requestor.run(
                command,
                driver=driver or ("docker" if image else "exec"),
                env=variables,
                workdir=workdir,
                image=image,
                keep_allocation=keep_allocation,
                stop_grace_s=grace_s,
                timeout_s=timeout_s,
                on_change=show,
                vcpus=vcpus,
                memory_mb=memory_mb,
                disk_gb=disk_gb,
                count=count,
                request_id=request_id,
            )
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
        try:
            if detach:
                task_run.wait_started()
                click.echo(placement.request_id)
                return
            task_run.wait()
        except KeyboardInterrupt:
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


def _line(state: TaskState) -> str:
    where = f"{state.sender} {state.allocation_id}"
    if state.state == "started":
        return f"task started on {where} (limits: {state.limits or 'none'})"
    if state.state == "exited":
        return f"task exited with {_code(state)} on {where}"
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
