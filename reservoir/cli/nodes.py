"""``reservoir nodes``: every live node's tier and usage, asked over the broker."""

from __future__ import annotations

import json

import click

from reservoir.cli.options import (
    broker_option,
    expect_nodes_option,
    json_option,
    ledgers,
    load_settings,
    seconds_option,
)


@click.command("nodes")
@broker_option()
@seconds_option("--wait", 1.0, "How long to wait for the nodes to answer (seconds).")
@expect_nodes_option("Stop waiting once this many nodes answered.")
@json_option()
def nodes_command(
    broker_url: str | None, wait_s: float, expect_nodes: int | None, as_json: bool
) -> None:
    """List every live node: its tier, and per resource class its capacity, what is
    allocated and what live reservations hold.

    Gathered over the broker (every serving node answers one query with its ledger), so
    it shows what the nodes themselves hold, within --wait seconds."""
    snapshots = ledgers(load_settings(broker_url=broker_url), wait_s, expect_nodes)
    listed = [
        {
            "node": s.name,
            "tier": s.tier,
            "utilisation": round(s.utilisation, 4),
            "usage": {
                rc: {"capacity": u.capacity, "allocated": u.allocated, "reserved": u.reserved}
                for rc, u in s.usages.items()
            },
            "allocations": len(s.allocations),
            "reservations": len(s.reservations),
            "configuration": dict(s.configuration),
        }
        for s in snapshots
    ]
    if as_json:
        click.echo(json.dumps({"nodes": listed}, sort_keys=True))
        return
    if not listed:
        click.echo("no node answered")
        return
    from rich.console import Console
    from rich.table import Table

    classes = sorted({rc for node in listed for rc in node["usage"]})  # type: ignore[attr-defined]
    table = Table(box=None)
    for heading in ("node", "tier", "allocations", "reservations", *classes):
        table.add_column(heading, justify="left" if heading == "node" else "right")
    for node in listed:
        usage: dict[str, dict[str, int]] = node["usage"]  # type: ignore[assignment]
        cells = [
            f"{usage[rc]['allocated'] + usage[rc]['reserved']}/{usage[rc]['capacity']}"
            if rc in usage
            else "-"
            for rc in classes
        ]
        table.add_row(
            str(node["node"]), f"{node['tier']}%", str(node["allocations"]),
            str(node["reservations"]), *cells,
        )  # fmt: skip
    Console().print(table)


# -- audit ---------------------------------------------------------------------------------
