"""``reservoir nodes``: every live node's inventory and usage, asked over the broker."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from reservoir.cli.formats import Column, emit, format_options, picked
from reservoir.cli.options import (
    broker_option,
    expect_nodes_option,
    ledgers,
    load_settings,
    seconds_option,
)
from reservoir.exit_status import EXIT_RUN_FAILED

#: resource classes' units, for the table's unit column
UNITS = {"MEMORY_MB": "MiB", "DISK_GB": "GiB"}


def _compact_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _readable(value: Any) -> str:
    """A configuration value in words: mappings as ``key value`` (nested ones in
    parentheses), lists joined with ``;``, nothing as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(
            f"{k} ({_readable(v)})" if isinstance(v, dict) else f"{k} {_readable(v)}"
            for k, v in sorted(value.items())
        )
    if isinstance(value, list):
        return "; ".join(_readable(v) for v in value) or "none"
    return str(value)


def _configuration_lines(configuration: Any) -> str:
    """A node's configuration as a table cell: a line per setting, wrapped, never cut."""
    return "\n".join(f"{key}: {_readable(value)}" for key, value in sorted(configuration.items()))


def _percent(value: Any) -> str:
    return f"{value:.0%}"


#: one row per node and resource class; field names as ``GET /v1/nodes`` has them
COLUMNS = (
    Column("name", "node", numeric=False),
    Column("release", "release", numeric=False),
    Column("class", "class", numeric=False),
    Column("unit", "unit", numeric=False),
    Column("total", "total"),
    Column("reserved", "host-reserved"),
    Column("allocation_ratio", "alloc. ratio"),
    Column("capacity", "capacity"),
    Column("used", "used"),
    Column("held", "held (reservations)"),
    Column("free", "free"),
    Column("tier", "tier %"),
    Column("utilisation", "utilisation %", show=_percent),
    Column("allocations", "allocations"),
    Column("reservations", "reservations"),
)

#: ``--configuration``: a row per node
CONFIGURATION_COLUMNS = (
    Column("name", "node", numeric=False),
    Column(
        "configuration",
        "configuration",
        show=_configuration_lines,
        numeric=False,
        plain=_compact_json,
    ),
)


@click.command("nodes")
@broker_option()
@seconds_option("--wait", 1.0, "How long to wait for the nodes to answer (seconds).")
@expect_nodes_option("Stop waiting once this many nodes answered; fewer is a failure.")
@format_options
@click.option("--json", "as_json", is_flag=True, help="The same as -f json.")
@click.option(
    "--configuration",
    "show_configuration",
    is_flag=True,
    help="Show each node's configuration instead (what it runs with: inventory, NUMA "
    "cells, PCI devices and aliases, its configuration file), as the node sends it.",
)
def nodes_command(
    broker_url: str | None,
    wait_s: float,
    expect_nodes: int | None,
    output_format: str,
    columns: tuple[str, ...],
    as_json: bool,
    show_configuration: bool,
) -> None:
    """List every live node's inventory and usage: a row per node and resource class,
    with its total, host-reserved amount, allocation ratio, capacity ((total -
    host-reserved) x ratio), what allocations use, what live reservations hold, what is
    free; and the node's release, tier, utilisation and counts of allocations and
    reservations.

    Gathered over the broker (every serving node answers one query with its ledger), so
    it shows what the nodes themselves hold, within --wait seconds; with --expect-nodes,
    fewer nodes answering is exit status 2, after listing those that did. The field names
    are those of GET /v1/nodes."""
    from reservoir.runtime.auditor import node_fields

    picked(CONFIGURATION_COLUMNS if show_configuration else COLUMNS, columns)
    snapshots = ledgers(load_settings(broker_url=broker_url), wait_s, expect_nodes)
    output_format = "json" if as_json else output_format
    if not snapshots and output_format == "table":
        click.echo(f"no node answered within {wait_s:g} s")
    elif show_configuration:
        configured = [{"name": s.name, "configuration": dict(s.configuration)} for s in snapshots]
        emit(configured, CONFIGURATION_COLUMNS, output_format, columns)
    else:
        rows = []
        for snapshot in snapshots:
            node = node_fields(snapshot)
            usage: dict[str, dict[str, Any]] = node.pop("usage")
            for rc, amounts in usage.items():
                rows.append({**node, "class": rc, "unit": UNITS.get(rc, "units"), **amounts})
        emit(rows, COLUMNS, output_format, columns)
    if expect_nodes is not None and len(snapshots) < expect_nodes:
        # what is listed is all that answered: the ones expected and missing are said
        click.echo(
            f"reservoir nodes: expected {expect_nodes} node(s), {len(snapshots)} answered "
            f"within {wait_s:g} s",
            err=True,
        )
        sys.exit(EXIT_RUN_FAILED)
