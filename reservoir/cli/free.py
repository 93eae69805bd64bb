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
    wanted = set(allocation_ids)
    if node_name is not None:
        asked = {node_name: allocation_ids}
    else:
        held = _held_by_node(settings, request_id)
        # each holder is asked for the named allocations it holds (all of them without any)
        asked = {
            node: tuple(a for a in allocation_ids if a in ids) if wanted else ()
            for node, ids in held.items()
            if not wanted or wanted & set(ids)
        }
        if not asked:
            what = f"allocation {', '.join(allocation_ids)}" if wanted else "anything"
            click.echo(f"reservoir free: no node answering holds {what} of {request_id}", err=True)
            sys.exit(EXIT_NOT_PLACED)
    requestor = open_requestor(settings.broker_url)
    freed_in_all: set[str] = set()
    with requestor:
        for holder, ids in asked.items():
            try:
                freed = requestor.free_future(request_id, holder, ids).result(timeout_s)
            except (FreeIncomplete, TimeoutError):
                click.echo(f"reservoir free: {_unconfirmed(settings, holder, timeout_s)}", err=True)
                sys.exit(EXIT_NOT_PLACED)
            # The node's answer says what it freed: nothing freed is no "freed".
            if freed:
                click.echo(f"freed {len(freed)} allocation(s) of {request_id} on {holder}")
            elif node_name is None and not wanted:
                # held a moment ago, freed meanwhile (by someone else): said, not counted
                click.echo(f"nothing of {request_id} held on {holder} any more (freed meanwhile)")
            freed_in_all.update(freed)
    missing = [a for a in allocation_ids if a not in freed_in_all]
    if node_name is not None and (not freed_in_all or missing):
        what = f"no allocation {', '.join(missing)}" if wanted else "nothing"
        elsewhere = _held_elsewhere(settings, request_id, node_name)
        click.echo(f"reservoir free: {node_name} holds {what} of {request_id}{elsewhere}", err=True)
        sys.exit(EXIT_NOT_PLACED)
    if missing:
        click.echo(
            f"reservoir free: no node answering holds allocation {', '.join(missing)} of "
            f"{request_id}",
            err=True,
        )
        sys.exit(EXIT_NOT_PLACED)


def _unconfirmed(settings: Settings, node: str, timeout_s: float) -> str:
    """Why ``node`` did not confirm, as far as can be told: it is not there at all (no
    node of that name answers on the broker), or it did not answer in time."""
    if node not in {s.name for s in ledgers(settings, 1.0)}:
        return (
            f"no node named {node} answers on this broker (is it running, and is the name "
            "right?); nothing was freed"
        )
    return (
        f"{node} did not confirm within {timeout_s:g} s; its allocations stay until it is "
        "freed (the command can be run again)"
    )


def _held_elsewhere(settings: Settings, request_id: str, asked: str) -> str:
    """After a --node that did not hold what was asked: the nodes that hold the request,
    if any, so that the next command is the right one."""
    holders = [h for h in _held_by_node(settings, request_id) if h != asked]
    if not holders:
        return ""
    return (
        f"; it is held on {', '.join(holders)} (give that --node, or none to free it "
        "wherever it is held)"
    )


def _held_by_node(
    settings: Settings, request_id: str, wait_s: float = 1.0
) -> dict[str, tuple[str, ...]]:
    """The live nodes that hold allocations of ``request_id`` and the ids of those, asked
    over the broker (every node answers with its ledger: an operator's command, O(N)
    once, not per placement)."""
    held: dict[str, tuple[str, ...]] = {}
    for snapshot in sorted(ledgers(settings, wait_s), key=lambda s: s.name):
        ids = tuple(a.allocation_id for a in snapshot.allocations if a.request_id == request_id)
        if ids:
            held[snapshot.name] = ids
    return held


# -- inspect -------------------------------------------------------------------------------
