"""``reservoir chaos``: faults on a real RabbitMQ on purpose, then the audit
(:mod:`reservoir.tools.chaos.harness` runs it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from reservoir.cli.options import json_option, stopped_by_sigterm
from reservoir.exit_status import EXIT_INTERRUPTED, EXIT_RUN_FAILED
from reservoir.tools.chaos.harness import COUNTED, run_chaos


@click.command()
@click.option(
    "--broker",
    "broker_url",
    envvar="RESERVOIR_BROKER_URL",
    required=True,
    help="A RabbitMQ on loopback: amqp://user:pass@127.0.0.1:5672/ [env: RESERVOIR_BROKER_URL]",
)
@click.option(
    "--seconds",
    type=click.FloatRange(1),
    default=600.0,
    show_default=True,
    help="Stop placing after this long, even short of --placements.",
)
@click.option("--seed", type=click.IntRange(0), help="Replay a fault schedule [default: random].")
@click.option("--nodes", type=click.IntRange(2, 200), default=30, show_default=True)
@click.option("--requestors", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option(
    "--placements",
    type=click.IntRange(1),
    default=10_000,
    show_default=True,
    help="Placements the requestors make between them.",
)
@click.option(
    "--fault-interval",
    "interval_s",
    type=click.FloatRange(0.1),
    default=1.5,
    show_default=True,
    help="Mean seconds between two faults.",
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep the processes' logs, records and ledgers here [default: a temporary "
    "directory, removed at the end].",
)
@json_option()
def chaos(
    broker_url: str,
    seconds: float,
    seed: int | None,
    nodes: int,
    requestors: int,
    placements: int,
    interval_s: float,
    work_dir: Path | None,
    as_json: bool,
) -> None:
    """Break a real cluster on purpose and audit it: node and requestor processes killed
    with SIGKILL and restarted, connections cut, stalled and closed by the broker, on a
    seeded schedule; then the cluster-wide audit, the nodes' SQLite ledgers and the
    callers' record must all agree that nothing was overcommitted, placed twice, leaked,
    orphaned, hung or failed. Exit status 0 when they do, 2 when not."""

    def progress(line: str) -> None:
        click.echo(line, err=True)

    try:
        with stopped_by_sigterm():
            result = run_chaos(
                broker_url=broker_url,
                seconds=seconds,
                seed=seed,
                nodes=nodes,
                requestors=requestors,
                placements=placements,
                interval_s=interval_s,
                work_dir=work_dir,
                progress=progress,
            )
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    except KeyboardInterrupt:
        click.echo(
            "reservoir chaos: interrupted; processes stopped, the run's vhost removed", err=True
        )
        sys.exit(EXIT_INTERRUPTED)
    if as_json:
        click.echo(json.dumps(result.as_json(), sort_keys=True))
    else:
        summary = result.as_json()
        for key in ("seed", "placements", "faults_injected", "faults", *COUNTED):
            click.echo(f"{key:>22}: {summary[key]}")
        for name, items in summary["details"].items():
            click.echo(f"{name}:")
            for item in items:
                click.echo(f"  {item}")
    if not result.ok:
        sys.exit(EXIT_RUN_FAILED)
