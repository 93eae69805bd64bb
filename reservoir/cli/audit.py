"""``reservoir audit``: every live node's ledger, checked against the invariants."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from reservoir.broker import BrokerError
from reservoir.cli.options import (
    broker_option,
    cannot_reach_broker,
    json_option,
    load_settings,
    seconds_option,
)
from reservoir.exit_status import EXIT_RUN_FAILED


@click.command("audit")
@broker_option()
@click.option(
    "--placements",
    "record_path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="The callers' record: JSON lines as `reservoir request --json` prints them. With "
    "it, every placement a caller heard of must be on the nodes, and allocations no caller "
    "heard of are listed as orphans with the command that frees each.",
)
@seconds_option("--wait", 2.0, "How long to wait for the nodes' ledgers (seconds).")
@click.option(
    "--expect-nodes",
    type=click.IntRange(0),
    help="Stop waiting once this many nodes answered; fewer is a failure. Without it, no "
    "node answering is a failure too (nothing was audited); 0 says none should be running.",
)
@json_option()
def audit_command(
    broker_url: str | None,
    record_path: Path | None,
    wait_s: float,
    expect_nodes: int | None,
    as_json: bool,
) -> None:
    """Ask every live node for its ledger and check the invariants across the cluster.

    Checks: no resource class overcommitted on any node; no request id holding more
    instances across nodes than it asked for; no reservation alive more than a second past
    its deadline; with --placements, every placement callers were told of held by the nodes,
    and every allocation accounted for. Exit status 0 when every check holds, 2 when one
    does not, when fewer nodes than --expect-nodes answered, or when no node answered at
    all (an audit of nothing is no pass: say --expect-nodes 0 if none should be running),
    3 when the broker is unreachable.
    """
    from reservoir.runtime.auditor import audit_cluster, read_placements_file

    settings = load_settings(broker_url=broker_url)
    try:
        record = read_placements_file(record_path) if record_path is not None else None
    except (OSError, ValueError) as error:
        raise click.BadParameter(str(error), param_hint="--placements") from None
    try:
        found = audit_cluster(
            settings.broker_url,
            settings=settings,
            placements=record,
            wait_s=wait_s,
            expect_nodes=expect_nodes,
        )
    except BrokerError as error:
        cannot_reach_broker(error)
    missing = expect_nodes is not None and len(found.nodes) < expect_nodes
    # Nobody answering is no evidence that the invariants hold: a cron check must not
    # stay green while the cluster is down.
    unaudited = not found.nodes and expect_nodes != 0
    if as_json:
        shown = {**found.as_json(), "expected_nodes": expect_nodes}
        if unaudited:
            shown["ok"] = False
        click.echo(json.dumps(shown, sort_keys=True))
    if unaudited:
        click.echo(
            f"reservoir audit: no node answered within {wait_s:g} s: nothing was audited "
            "(give --expect-nodes 0 if no node should be running)",
            err=True,
        )
        sys.exit(EXIT_RUN_FAILED)
    if not as_json:
        click.echo(
            f"{len(found.nodes)} node(s) answered: {found.allocations} allocation(s), "
            f"{found.reservations} live reservation(s)"
        )
        for title, items in (
            ("overcommitted", found.report.overcommitted),
            ("placed more than once", found.report.duplicate_placements),
            ("leaked reservations", found.report.leaked_reservations),
            ("answered in part only", found.incomplete_nodes),
            ("orphaned allocations", found.orphans),
        ):
            if items:
                click.echo(f"{title}: {len(items)}")
                for item in items:
                    click.echo(f"  {item}")
        if missing:
            click.echo(f"expected {expect_nodes} node(s), {len(found.nodes)} answered")
        click.echo("invariants hold" if found.ok and not missing else "invariants BROKEN")
    if not found.ok or missing:
        sys.exit(EXIT_RUN_FAILED)


# -- simulate ------------------------------------------------------------------------------
