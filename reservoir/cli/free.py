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
    the nodes say they hold allocations of the request.

    Each node answers with what it freed, and that is what is printed. Exit status 1 when
    a node held nothing of the request (or not every --allocation named), saying which
    nodes do hold it, or when a node did not confirm in time."""
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
    unfreed = False
    with requestor:
        for holder in holders:
            try:
                freed = requestor.free_future(request_id, holder, allocation_ids).result(timeout_s)
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
            # The node's answer says what it freed: nothing freed is no "freed".
            if freed:
                click.echo(f"freed {len(freed)} allocation(s) of {request_id} on {holder}")
            missing = [a for a in allocation_ids if a not in freed]
            if freed and not missing:
                continue
            unfreed = True
            what = f"no allocation {', '.join(missing)}" if allocation_ids else "nothing"
            elsewhere = _held_elsewhere(settings, request_id, holder) if node_name else ""
            click.echo(
                f"reservoir free: {holder} holds {what} of {request_id}{elsewhere}", err=True
            )
    if unfreed:
        sys.exit(EXIT_NOT_PLACED)


def _held_elsewhere(settings: Settings, request_id: str, asked: str) -> str:
    """After a --node that did not hold what was asked: the nodes that hold the request,
    if any, so that the next command is the right one."""
    holders = [h for h in _nodes_holding(settings, request_id) if h != asked]
    if not holders:
        return ""
    return (
        f"; it is held on {', '.join(holders)} (give that --node, or none to free it "
        "wherever it is held)"
    )


def _nodes_holding(settings: Settings, request_id: str, wait_s: float = 1.0) -> list[str]:
    """The live nodes that hold allocations of ``request_id``, asked over the broker (every
    node answers with its ledger: an operator's command, O(N) once, not per placement)."""
    snapshots = ledgers(settings, wait_s)
    return sorted(
        s.name for s in snapshots if any(a.request_id == request_id for a in s.allocations)
    )


# -- inspect -------------------------------------------------------------------------------
