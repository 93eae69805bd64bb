"""``reservoir free``: free a request's allocations on the nodes that hold them."""

from __future__ import annotations

import sys

import click

from reservoir.cli.options import (
    broker_option,
    ledgers,
    load_settings,
    open_requestor,
    seconds_option,
)
from reservoir.exit_status import EXIT_NOT_PLACED
from reservoir.runtime.settings import Settings


@click.command()
@broker_option()
@click.option("--request-id", required=True, help="The request whose allocations to free.")
@click.option(
    "--node",
    "node_name",
    help="The node holding them [default: every node that holds any, found over the broker].",
)
@click.option(
    "--allocation",
    "allocation_ids",
    multiple=True,
    metavar="ID",
    help="Free only these allocations [default: all of the request on the node].",
)
@seconds_option("--timeout", 30.0, "Give up waiting for the node's confirmation after this.")
def free(
    broker_url: str | None,
    request_id: str,
    node_name: str | None,
    allocation_ids: tuple[str, ...],
    timeout_s: float,
) -> None:
    """Free a request's allocations (its instances were deleted): on --node, or wherever
    the nodes say they hold allocations of the request."""
    from reservoir.runtime.requestor import FreeIncomplete

    settings = load_settings(broker_url=broker_url)
    if node_name is not None:
        holders = [node_name]
    else:
        holders = _nodes_holding(settings, request_id)
        if not holders:
            click.echo(
                f"reservoir free: no node answering holds anything of {request_id}", err=True
            )
            sys.exit(EXIT_NOT_PLACED)
    requestor = open_requestor(settings.broker_url)
    with requestor:
        for holder in holders:
            try:
                requestor.free_future(request_id, holder, allocation_ids).result(timeout_s)
            except FreeIncomplete as error:
                click.echo(f"reservoir free: {holder} did not confirm: {error}", err=True)
                sys.exit(EXIT_NOT_PLACED)
            except TimeoutError:
                click.echo(
                    f"reservoir free: {holder} did not confirm within {timeout_s:g} s "
                    "(is it running? its allocations stay until it is freed)",
                    err=True,
                )
                sys.exit(EXIT_NOT_PLACED)
            click.echo(f"freed {request_id} on {holder}")


def _nodes_holding(settings: Settings, request_id: str, wait_s: float = 1.0) -> list[str]:
    """The live nodes that hold allocations of ``request_id``, asked over the broker (every
    node answers with its ledger: an operator's command, O(N) once, not per placement)."""
    snapshots = ledgers(settings, wait_s)
    return sorted(
        s.name for s in snapshots if any(a.request_id == request_id for a in s.allocations)
    )


# -- inspect -------------------------------------------------------------------------------
