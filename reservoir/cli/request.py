"""``reservoir request``: place one request, or with ``--dry-run`` only ask where it would fit."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import click

from reservoir.broker import BrokerError
from reservoir.cli.formats import Column, emit, format_options, picked
from reservoir.cli.options import (
    broker_option,
    cannot_reach_broker,
    json_option,
    load_settings,
    open_requestor,
    seconds_option,
    set_up_tracing,
)
from reservoir.cli.shape import request_from_options, shape_options
from reservoir.exit_status import EXIT_NOT_PLACED
from reservoir.interrupt import deferred
from reservoir.protocol.placement import (
    Placement,
    PlacementError,
    PlacementRequest,
    PlacementTimeout,
)
from reservoir.runtime.checked_request import CheckedRequest


@click.command()
@broker_option()
@shape_options
@seconds_option("--timeout", 30.0, "Give up after this many seconds.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Only ask: list the nodes that would take it and why the others would not, "
    "reserving nothing (answers gathered for 1 s, or --timeout if shorter); exit status "
    "1 when there is not room enough.",
)
@json_option()
@format_options
def request(
    broker_url: str | None,
    vcpus: int | None,
    memory_mb: int | None,
    disk_gb: int | None,
    resources: tuple[str, ...],
    count: int,
    min_count: int | None,
    required: tuple[str, ...],
    forbidden: tuple[str, ...],
    any_of: tuple[str, ...],
    group: str | None,
    group_policy: str | None,
    numa_nodes: int | None,
    pinned: bool,
    hugepage_kb: int | None,
    pci: tuple[str, ...],
    numa_policy: str | None,
    hints: tuple[str, ...],
    request_id: str | None,
    explain: bool,
    timeout_s: float,
    dry_run: bool,
    as_json: bool,
    output_format: str,
    columns: tuple[str, ...],
) -> None:
    """Place one request and print the placement, or the failure with its explanation
    (exit status 1): -f json|yaml|csv|value and -c COLUMN print a row per allocation
    (request_id, node, allocation_id, resources, numa_cells, pci_devices); --json the
    whole placement record. With --dry-run, only say where it would fit: a row per node
    that answered (-f, -c likewise; --json: the whole report).

    Resource classes and traits are written as the nodes know them (VCPU, CUSTOM_GPU,
    HW_CPU_X86_AVX2), exactly as in the library and the HTTP API."""
    spec = request_from_options(
        vcpus=vcpus, memory_mb=memory_mb, disk_gb=disk_gb, resources=resources, count=count,
        min_count=min_count, required=required, forbidden=forbidden, any_of=any_of,
        group=group, group_policy=group_policy, numa_nodes=numa_nodes, pinned=pinned,
        hugepage_kb=hugepage_kb, pci=pci, numa_policy=numa_policy, hints=hints,
        request_id=request_id, explain=explain,
    )  # fmt: skip
    if dry_run:
        _dry_run(
            spec.request,
            broker_url,
            min(timeout_s, DRY_RUN_WAIT_S),
            as_json,
            output_format,
            columns,
        )
        return
    set_up_tracing("request")
    shown = Shown(as_json, output_format, columns)
    if not as_json:
        picked(PLACEMENT_COLUMNS, columns)  # an unknown -c is said before anything is placed
    _place_and_print(spec, broker_url, timeout_s, shown)


@dataclass(frozen=True)
class Shown:
    """How the outcome is printed: ``--json`` (the whole record), else ``-f``/``-c``."""

    as_json: bool
    output_format: str = "table"
    columns: tuple[str, ...] = ()

    @property
    def as_text(self) -> bool:
        """The human lines: the table format with no columns picked."""
        return not self.as_json and self.output_format == "table" and not self.columns


#: a placement's row per allocation; field names as in ``--json``'s ``allocations``
PLACEMENT_COLUMNS = (
    Column("request_id", "request", numeric=False),
    Column("node", "node", numeric=False),
    Column("allocation_id", "allocation", numeric=False),
    Column("resources", "resources", show=lambda v: _amounts_shown(v), numeric=False),
    Column("numa_cells", "NUMA cells", show=lambda v: ",".join(map(str, v)), numeric=False),
    Column("pci_devices", "PCI devices", show=lambda v: " ".join(v), numeric=False),
)


def _amounts_shown(resources: dict[str, int]) -> str:
    return ", ".join(f"{rc}={n}" for rc, n in sorted(resources.items()))


def _place_and_print(
    spec: CheckedRequest, broker_url: str | None, timeout_s: float, shown: Shown
) -> None:
    """The placement printed, or the failure printed and exit status 1. Ctrl-C or SIGTERM
    while it is placed ends it (the requestor's close releases what it holds); once it is
    placed, the signal waits until the placement is printed (then exit status 130), so a
    placement made is never lost unprinted."""
    requestor = open_requestor(broker_url)
    try:
        placement = requestor.reserve(spec, timeout_s=timeout_s)
    except PlacementError as error:
        requestor.close()
        _print_failure(error, shown)
        sys.exit(EXIT_NOT_PLACED)
    except BaseException:
        requestor.close()
        raise
    with deferred():
        requestor.close()
        _print_placement(placement, shown)


def _print_failure(error: PlacementError, shown: Shown) -> None:
    explanation = error.explanation
    if not shown.as_json:
        click.echo(f"not placed: {explanation}", err=True)
        if not shown.as_text:
            # what the format prints for no allocation at all (json: [], csv: the header)
            emit([], PLACEMENT_COLUMNS, shown.output_format, shown.columns)
        return
    failure = {
        "placed": False,
        "request_id": explanation.request_id,
        "explanation": str(explanation),
        "reasons": dict(explanation.reasons),
        "tiers_tried": list(explanation.tiers_tried),
        "offers_received": explanation.offers_received,
        "timed_out": isinstance(error, PlacementTimeout),
    }
    click.echo(json.dumps(failure, sort_keys=True))


def _print_placement(placement: Placement, shown: Shown) -> None:
    if shown.as_json:
        from reservoir.runtime.auditor import placement_record

        click.echo(json.dumps(placement_record(placement), sort_keys=True))
        return
    if not shown.as_text:
        rows = [
            {
                "request_id": placement.request_id,
                "node": a.node,
                "allocation_id": a.allocation_id,
                "resources": dict(sorted(a.resources.items())),
                "numa_cells": list(a.numa.cells) if a.numa is not None else None,
                "pci_devices": list(a.numa.devices) if a.numa is not None else None,
            }
            for a in placement.allocations
        ]
        emit(rows, PLACEMENT_COLUMNS, shown.output_format, shown.columns)
        return
    placed = len(placement.allocations)
    partly = f" (partial: {placed} of {placement.requested} asked for)" if placement.partial else ""
    click.echo(
        f"placed {placement.request_id}: {placed} instance(s){partly} "
        f"after tiers {', '.join(f'{t}%' for t in placement.tiers_tried)}"
    )
    for allocation in placement.allocations:
        resources = _amounts_shown(dict(allocation.resources))
        numa = allocation.numa
        if numa is not None and numa.devices:
            cells = ",".join(map(str, numa.cells)) or "-"
            resources += f"; PCI {' '.join(numa.devices)} (NUMA cell {cells})"
        click.echo(f"  {allocation.node}  {allocation.allocation_id}  {resources}")


#: a dry run's row per node; field names as in ``--json``'s ``nodes``
DRY_RUN_COLUMNS = (
    Column("name", "node", numeric=False),
    Column("slots", "instances it could take"),
    Column("utilisation", "utilisation %", show=lambda v: f"{v:.0%}"),
    Column("tier", "tier %"),
    Column("score", "score", show=lambda v: f"{v:.2f}"),
    Column("busy", "busy (others' reservations)", show=lambda v: "yes" if v else "no"),
    Column("reasons", "why not", show=lambda v: "; ".join(v) or "-", numeric=False),
)

#: how long a dry run gathers the nodes' answers
DRY_RUN_WAIT_S = 1.0


def _dry_run(
    spec: PlacementRequest,
    broker_url: str | None,
    wait_s: float,
    as_json: bool,
    output_format: str = "table",
    columns: tuple[str, ...] = (),
) -> None:
    from reservoir.runtime.backoff import quietly_connecting
    from reservoir.runtime.dry_run import DryRun

    settings = load_settings(broker_url=broker_url)
    try:
        with quietly_connecting():
            asking = DryRun(spec, settings.broker_url, settings=settings)
    except BrokerError as error:
        cannot_reach_broker(error)
    with asking:
        asking.ask()
        report = asking.collect(wait_s=wait_s)
    if as_json:
        click.echo(json.dumps(report.as_json(), sort_keys=True))
    else:
        if output_format == "table":
            shape = ", ".join(f"{rc}={n}" for rc, n in sorted(spec.resources.items()) if n)
            if not report.answers:
                click.echo(f"dry run of {spec.count} instance(s) of {shape}: no node answered")
            else:
                click.echo(
                    f"dry run of {spec.count} instance(s) of {shape}: "
                    f"{len(report.takers)} of {len(report.answers)} node(s) could take it, "
                    f"room for {report.room} instance(s) (wanted {report.wanted}); "
                    "nothing was reserved"
                )
        if report.answers or output_format != "table":
            rows = [answer.as_json() for answer in report.answers]
            emit(rows, DRY_RUN_COLUMNS, output_format, columns)
    if not report.would_place:
        sys.exit(EXIT_NOT_PLACED)


# -- free ----------------------------------------------------------------------------------
