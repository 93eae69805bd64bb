"""Fixtures the integration tests share on a real RabbitMQ.

- ``amqp_url``: the RabbitMQ under test (``reservoir_amqp_broker_url``, which skips without one);
- ``exchange``: a topic exchange name of the test's own; it and its inbox exchange are
  deleted afterwards;
- ``rabbitmqctl``: ``rabbitmqctl -q <args>`` (stdin optional), once it is known to manage
  the RabbitMQ under test (the machine's own, or ``docker exec`` into the testcontainers
  broker); where it cannot, the test is skipped (failed under ``CI``, which must be able
  to run them);
- ``close_connection``: closes one connection by its ``connection_name`` from the server
  side, as an operator would, to make an adapter reconnect.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pika
import pytest

from reservoir.brokers.pika_broker import INBOX_SUFFIX
from reservoir.testing.rabbitmq import rabbitmqctl_command

Rabbitmqctl = Callable[..., str]


@pytest.fixture
def amqp_url(reservoir_amqp_broker_url: str) -> str:
    return reservoir_amqp_broker_url


@pytest.fixture
def exchange(amqp_url: str) -> Iterator[str]:
    """This test's own topic exchange name; it and its inbox exchange are deleted afterwards
    (here rather than by ``delete_exchanges``: some tests declare it themselves, and not
    every test opens a broker)."""
    name = f"it-{uuid.uuid4().hex}"
    yield name
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        for doomed in (name, name + INBOX_SUFFIX):
            connection.channel().exchange_delete(doomed)
    finally:
        connection.close()


def _rabbitmqctl_on(command: list[str]) -> Rabbitmqctl:
    """``rabbitmqctl -q <args>`` through ``command`` (the machine's own, or ``docker exec``
    into the container serving the URL under test)."""

    def run(*args: str, stdin: str | None = None) -> str:
        return _run_rabbitmqctl(command, *args, stdin=stdin)

    return run


def _run_rabbitmqctl(command: list[str], *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        [*command, "-q", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr or done.stdout}")
    return done.stdout


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI must be able to manage its RabbitMQ: {reason}", pytrace=False)
    pytest.skip(f"cannot manage the RabbitMQ under test here: {reason}")


def _where(url: str) -> str:
    """``url`` without its credentials."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 5672}{parts.path}"


@pytest.fixture(scope="session")
def rabbitmqctl(reservoir_amqp_broker_url: str) -> Rabbitmqctl:
    """Runs ``rabbitmqctl -q <args>`` (``stdin=`` optional) and returns its output; raises
    RuntimeError when it fails. Skips (fails under ``CI``) where rabbitmqctl is missing or
    manages another node than the one the URL reaches."""
    command = rabbitmqctl_command(reservoir_amqp_broker_url)
    if shutil.which(command[0]) is None:
        _unavailable(f"{command[0]} is not on PATH")
    rabbitmqctl = _rabbitmqctl_on(command)
    probe_name = f"reservoir-test-probe-{uuid.uuid4().hex}"
    parameters = pika.URLParameters(reservoir_amqp_broker_url)
    parameters.client_properties = {"connection_name": probe_name}
    probe = pika.BlockingConnection(parameters)
    try:
        listing = rabbitmqctl("list_connections", "--no-table-headers", "client_properties")
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        _unavailable(f"rabbitmqctl cannot manage the broker: {error}")
    finally:
        probe.close()
    if probe_name not in listing:
        where = _where(reservoir_amqp_broker_url)
        _unavailable(f"rabbitmqctl manages another RabbitMQ than the one at {where}")
    return rabbitmqctl


@pytest.fixture
def close_connection(rabbitmqctl: Rabbitmqctl) -> Callable[[str], None]:
    """``close_connection(connection_name)``: close the one connection announcing
    ``connection_name`` from the server side (``rabbitmqctl close_connection``)."""

    def close(connection_name: str) -> None:
        lines = rabbitmqctl("list_connections", "--no-table-headers", "pid", "client_properties")
        pids = [
            row.split("\t", 1)[0] for row in lines.splitlines() if f'"{connection_name}"' in row
        ]
        assert len(pids) == 1, f"expected one connection named {connection_name}: {lines}"
        rabbitmqctl("close_connection", pids[0], "reservoir test")

    return close
