"""``reservoir inspect``: a node's durable ledger, read from its state directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import msgspec.structs

from reservoir.cli.options import (
    json_option,
)
from reservoir.exit_status import EXIT_USAGE


@click.command()
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    required=True,
    envvar="RESERVOIR_STATE_DIR",
    help="The node's state directory.",
)
@click.option("--name", required=True, help="The node's name.")
@json_option()
def inspect(state_dir: Path, name: str, as_json: bool) -> None:
    """Show the allocations a node's durable ledger holds (the node may be stopped)."""
    from reservoir.runtime.store import SqliteStore, StateError

    path = state_dir / f"{name}.sqlite3"
    if not path.exists():
        click.echo(f"reservoir inspect: no state file {path}", err=True)
        sys.exit(EXIT_USAGE)
    try:
        store = SqliteStore(path, node_name=name)
        allocations = store.load()
        store.close()
    except StateError as error:
        click.echo(f"reservoir inspect: {error}", err=True)
        sys.exit(EXIT_USAGE)
    status_path = state_dir / f"{name}.status.json"
    status = json.loads(status_path.read_text()) if status_path.exists() else None
    if as_json:
        click.echo(
            json.dumps(
                {
                    "node": name,
                    "status": status,
                    "allocations": [
                        {
                            "allocation_id": a.allocation_id,
                            "request_id": a.request_id,
                            "resources": dict(a.resources),
                            "group": a.group,
                            **({"numa": msgspec.structs.asdict(a.numa)} if a.numa else {}),
                        }
                        for a in allocations
                    ],
                },
                sort_keys=True,
            )
        )
        return
    click.echo(f"node {name}: {len(allocations)} allocation(s)")
    if status is not None:
        click.echo(
            f"  last status: utilisation {status['utilisation']:.0%}, tier {status['tier']}%, "
            f"{len(status['reservations'])} live reservation(s)"
        )
    for a in allocations:
        shown = ", ".join(f"{rc}={n}" for rc, n in sorted(a.resources.items()))
        click.echo(f"  {a.allocation_id}  request {a.request_id}  {shown}")


# -- nodes ---------------------------------------------------------------------------------
