"""``reservoir serve``: the placement service over HTTP on uvicorn, one requestor per
process (:mod:`reservoir.service` is the service itself)."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING

import click

from reservoir.broker import Broker, BrokerError
from reservoir.cli.options import (
    broker_option,
    broker_problem,
    cannot_reach_broker,
    connect_attempts_option,
    load_settings,
    set_up_tracing,
    shown_url,
    usage_error,
)
from reservoir.service.reservoir_service import DEFAULT_DRAIN_TIMEOUT_S
from reservoir.service.shapes import DEFAULT_MAX_BODY_BYTES
from reservoir.version import install_hint

if TYPE_CHECKING:
    import uvicorn

    from reservoir.brokers import BrokerUrl


def _stopped(signum: int, frame: FrameType | None) -> None:
    """Stop here with status 0: raised again by uvicorn once its graceful stop is done,
    or a stop before uvicorn took over the signals (the ``finally`` closes the broker)."""
    raise SystemExit(0)


@click.command()
@broker_option()
@click.option(
    "--host",
    envvar="RESERVOIR_SERVE_HOST",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0 in a container) [env: RESERVOIR_SERVE_HOST].",
)
@click.option(
    "--port",
    envvar="RESERVOIR_SERVE_PORT",
    default=8000,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="TCP port to listen on [env: RESERVOIR_SERVE_PORT].",
)
@click.option(
    "--explain/--no-explain",
    envvar="RESERVOIR_SERVE_EXPLAIN",
    default=True,
    show_default=True,
    help="Ask nodes that cannot take a request why, so a 409 names the short resource "
    "[env: RESERVOIR_SERVE_EXPLAIN].",
)
@click.option(
    "--drain-timeout",
    "drain_timeout_s",
    envvar="RESERVOIR_SERVE_DRAIN_TIMEOUT",
    default=DEFAULT_DRAIN_TIMEOUT_S,
    show_default=True,
    type=click.FloatRange(0, 600),
    help="On SIGTERM, seconds requests in flight get to finish before they fail with "
    "503 (new requests get 503 meanwhile); the process exits within this plus a second "
    "[env: RESERVOIR_SERVE_DRAIN_TIMEOUT].",
)
@click.option(
    "--access-log/--no-access-log",
    envvar="RESERVOIR_SERVE_ACCESS_LOG",
    default=False,
    show_default=True,
    help="Log every request (method, path, status, request_id, elapsed_ms) "
    "[env: RESERVOIR_SERVE_ACCESS_LOG].",
)
@click.option(
    "--max-body-bytes",
    envvar="RESERVOIR_SERVE_MAX_BODY_BYTES",
    default=DEFAULT_MAX_BODY_BYTES,
    show_default=True,
    type=click.IntRange(1, 2**30),
    help="Refuse a request body larger than this with 413, before reading it "
    "[env: RESERVOIR_SERVE_MAX_BODY_BYTES].",
)
@connect_attempts_option()
def serve(
    broker_url: str | None,
    host: str,
    port: int,
    explain: bool,
    drain_timeout_s: float,
    access_log: bool,
    max_body_bytes: int,
    connect_attempts: int,
) -> None:
    """Serve placements over HTTP: an ASGI app (FastAPI on uvicorn) embedding one requestor.

    \b
    POST   /v1/reservations        place (Idempotency-Key header or request_id: the key)
    GET    /v1/reservations/{id}   the placement the nodes hold (any replica's)
    DELETE /v1/reservations/{id}   release it (any replica's)
    GET    /v1/nodes               every live node, its tier and usage
    GET    /healthz, /readyz       the process; the broker connection
    GET    /metrics                Prometheus metrics
    GET    /docs                   the OpenAPI documentation

    Errors are application/problem+json (RFC 9457). Settings come from RESERVOIR_*
    environment variables as for every command. A broker that is not up yet (or
    restarting) is waited for, with a line per failed attempt (--connect-attempts), and
    the port is taken meanwhile. SIGTERM stops accepting connections,
    lets requests in flight finish (--drain-timeout; meanwhile new ones get 503), answers
    what is still in flight with 503 and Retry-After, closes the requestor and exits 0.
    """
    try:
        import uvicorn

        from reservoir.service.app import create_app
    except ImportError:
        usage_error(f"needs the api extra: {install_hint('api')}")
    from reservoir.observe.logs import json_logs, say

    settings = load_settings(broker_url=broker_url)
    set_up_tracing("serve")
    try:
        listening = _listen(host, port)
    except OSError as error:
        usage_error(f"cannot listen on {host}:{port}: {error}")
    try:
        broker = _connect(settings.broker_url, connect_attempts)
    except BrokerError as error:
        listening.close()
        # the adapters' errors name the URL with its password masked
        cannot_reach_broker(error)
    if broker is None:
        listening.close()
        say("reservoir serve: stopped before the broker answered")
        sys.exit(0)  # stopped as asked, as a stop once serving is
    # (uvicorn does not say where it listens when it is handed the socket)
    shown = shown_url(settings.broker_url)
    say(f"reservoir serve: listening on http://{host}:{port}, broker {shown}")
    # uvicorn handles SIGTERM and SIGINT itself (stop accepting, finish what is open, run
    # the lifespan's shutdown), then raises the signal again under the handlers it found:
    # with this one, a stop it completed ends in exit status 0, not death by the signal.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, _stopped)
    try:
        app = create_app(
            broker,
            settings=settings,
            explain=explain,
            drain_timeout_s=drain_timeout_s,
            max_body_bytes=max_body_bytes,
        )
        if json_logs():
            # uvicorn's own handlers print text: let its lines reach ours instead
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
                logging.getLogger(name).setLevel(logging.INFO)
        app.state.access_log = access_log
        if access_log:
            # its lines are INFO: shown whatever the verbosity, as uvicorn's were
            logging.getLogger("reservoir.serve.access").setLevel(logging.INFO)
        config = uvicorn.Config(
            app,
            # the app logs each request itself, with its fields (reservoir.service.app)
            access_log=False,
            log_level="info",
            log_config=None if json_logs() else uvicorn.config.LOGGING_CONFIG,
            # what the drain failed has answered by then: this is for writing the answers
            timeout_graceful_shutdown=WRITE_ANSWERS_S,
        )
        draining_server(config, drain_timeout_s).run(sockets=[listening])
    finally:
        listening.close()
        broker.close()


def _connect(url: BrokerUrl | None, attempts: int) -> Broker | None:
    """The broker at ``url``, waited for as ``reservoir node`` waits for it: a line per
    failed attempt, backing off up to 15 s, ``attempts`` of them (0: until stopped).
    None when SIGTERM or SIGINT came meanwhile."""
    from reservoir.brokers import connect
    from reservoir.interrupt import stop_on_signals
    from reservoir.observe.logs import say
    from reservoir.runtime.backoff import quietly_connecting, until_connected

    stop = threading.Event()
    stop_on_signals(stop)

    def connected() -> Broker:
        # the adapters' own line per attempt would repeat ours
        with quietly_connecting():
            return connect(url)

    def waiting(attempt: int, error: BaseException, wait_s: float) -> None:
        say(
            f"reservoir serve: {broker_problem(error)}; retrying in {wait_s:.1f} s "
            f"(attempt {attempt})",
            outcome="retrying",
            attempt=attempt,
            retry_in_s=round(wait_s, 1),
        )

    return until_connected(connected, attempts, stop, on_wait=waiting)


#: after the drain, how long uvicorn waits for the open connections to write their answers
#: before it cancels them (the process exits within the drain plus about this)
WRITE_ANSWERS_S = 1


def draining_server(config: uvicorn.Config, drain_timeout_s: float) -> uvicorn.Server:
    """A uvicorn server that, told to stop, first drains the service (new requests get
    503 meanwhile, and what the drain cannot finish gets a 503 problem), and only then
    does uvicorn's own shutdown, whose graceful timeout would otherwise cancel a request
    in flight into a bare 500 and run the lifespan's drain after it."""
    import uvicorn

    from reservoir.service.reservoir_service import ReservoirService

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            app = self.config.app
            service = getattr(getattr(app, "state", None), "reservoir", None)
            if isinstance(service, ReservoirService) and not self.force_exit:
                await service.stop(drain_timeout_s)
            await super().shutdown(sockets)

    return DrainingServer(config)


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port``, bound here rather than by uvicorn so that a
    port in use is one line and exit status 2, not uvicorn's log and status 1."""
    family, kind, protocol, _name, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    )[0]
    listening = socket.socket(family, kind, protocol)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
    except BaseException:
        listening.close()
        raise
    listening.set_inheritable(True)
    return listening
