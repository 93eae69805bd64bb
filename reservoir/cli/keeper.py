"""``reservoir keeper``: a roster keeper, until a signal stops it."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from pathlib import Path

import click

from reservoir.broker import BrokerError
from reservoir.cli.options import (
    broker_option,
    broker_problem,
    cannot_reach_broker,
    connect_attempts_option,
    load_settings,
    shown_url,
)
from reservoir.interrupt import stop_on_signals, stopped
from reservoir.version import __version__


@click.command()
@broker_option()
@click.option(
    "--name",
    default=None,
    help="The keeper's name; its inbox is reservoir.requestor.NAME [default: keeper-<random>].",
)
@click.option(
    "--status-file",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    default=None,
    help="Rewrite this JSON file (connected, nodes known, samples sent) every "
    "--status-interval seconds while running: for a health check.",
)
@click.option(
    "--status-interval",
    type=click.FloatRange(0.01),
    default=1.0,
    show_default=True,
    help="With --status-file, how often to rewrite it (seconds).",
)
@connect_attempts_option()
def keeper(
    broker_url: str | None,
    name: str | None,
    status_file: Path | None,
    status_interval: float,
    connect_attempts: int,
) -> None:
    """Run a roster keeper until SIGTERM, SIGINT or SIGHUP; then exit status 130.

    A keeper follows every node's announcements so that requestors need not: every
    requestor (RESERVOIR_ROSTER_FROM=auto, the default) asks a keeper for a sample of the
    nodes rather than hearing every node's every status and roll-calling them all at
    start, so messages per placement do not grow with the requestors (docs/design.md,
    "Many requestors: roster keepers"). It holds nothing a placement depends on: run two
    per cluster, and restart them at will. With none running, requestors follow the
    announcements themselves, and come back to a keeper as one starts (it says so).
    RESERVOIR_ROSTER_FROM=announcements keeps a requestor off keepers (keeper, the
    setting's earlier name, means auto).
    """
    from reservoir.observe.logs import say
    from reservoir.runtime.backoff import quietly_connecting, until_connected
    from reservoir.runtime.keeper import RosterKeeper

    settings = load_settings(broker_url=broker_url)
    name = name or f"keeper-{secrets.token_hex(4)}"
    stop = threading.Event()
    stop_on_signals(stop, hangup=True)

    def start_keeper() -> RosterKeeper:
        with quietly_connecting():
            return RosterKeeper(settings.broker_url, name=name, settings=settings)

    try:
        running = until_connected(start_keeper, connect_attempts, stop, on_wait=_say_waiting(name))
    except BrokerError as error:
        cannot_reach_broker(error)
    if running is None:
        say(f"keeper {name}: stopped before the broker answered")
        stopped()
    say(
        f"keeper {name}: ready on {shown_url(settings.broker_url)}; release {__version__}, "
        f"writing for {settings.compatible_with}"
    )
    try:
        while True:
            if status_file is not None:
                running.write_status(status_file)
            if stop.wait(status_interval if status_file is not None else None):
                break
    finally:
        known = running.nodes_known()
        running.close()
        say(f"keeper {name}: stopped, {known} node(s) known")
    stopped()  # only a signal sets stop


def _say_waiting(name: str) -> Callable[[int, BaseException, float], None]:
    from reservoir.observe.logs import say as say_line

    def say(attempt: int, error: BaseException, wait_s: float) -> None:
        say_line(
            f"keeper {name}: {broker_problem(error)}; "
            f"retrying in {wait_s:.1f} s (attempt {attempt})"
        )

    return say
