"""Finding a real RabbitMQ for tests: ``RESERVOIR_TEST_AMQP_URL`` first (checked once: a URL
where nothing answers fails the fixture with one line), then a throwaway
testcontainers ``RabbitMqContainer``, else skip (or fail, when ``CI`` is set).

This module owns that choice and the container's whole life:

- which image (:func:`rabbitmq_image`): ``RESERVOIR_TEST_RABBITMQ_IMAGE`` if set, else the
  newest ``reservoir/rabbitmq:<version>`` built on this machine from Debian's packages by
  ``deploy/ci/docker.sh rabbitmq-image``, else the pinned upstream :data:`RABBITMQ_IMAGE`;
- how testcontainers is set up (:func:`configure_testcontainers`), here rather than in the
  user's environment: no reaper (Ryuk's own image must be pulled, and removing what we
  start is done here), and a local engine reached on 127.0.0.1;
- the container: its port published on 127.0.0.1 only, labelled
  ``org.reservoir.test-run=<RESERVOIR_TEST_RUN>`` so a CI run can remove whatever a
  crashed test left, and removed when the fixture ends;
- :func:`rabbitmqctl_command`: how to run ``rabbitmqctl`` on the broker a URL reaches
  (``docker exec`` into our container, or the machine's own ``rabbitmqctl``);
- :func:`private_exchange`: the found broker's URL on exchanges of one test's own
  (``?exchange=reservoir-test-<random>``), deleted when the test ends: what the users'
  ``reservoir_amqp_url`` hands out, so that a test never reaches the nodes of a
  deployment that shares the broker, nor leaves anything on it.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = [
    "IMAGE_ENV",
    "LOCAL_IMAGE_REPOSITORY",
    "PRIVATE_EXCHANGE_PREFIX",
    "RABBITMQ_IMAGE",
    "RUN_ENV",
    "RUN_LABEL",
    "amqp_url_for_tests",
    "configure_testcontainers",
    "private_exchange",
    "rabbitmq_image",
    "rabbitmqctl_command",
    "run_id",
]

#: the upstream image used when none is named or built here; pinned so a test run does not
#: change under us when the image moves
RABBITMQ_IMAGE = "rabbitmq:4.1.4-management"
#: names the image to use instead of the default
IMAGE_ENV = "RESERVOIR_TEST_RABBITMQ_IMAGE"
#: the repository deploy/ci/docker.sh builds RabbitMQ from Debian's packages into, tagged
#: with the RabbitMQ version it holds
LOCAL_IMAGE_REPOSITORY = "reservoir/rabbitmq"
#: every container started here carries this label, valued :func:`run_id`
RUN_LABEL = "org.reservoir.test-run"
#: names the run (.ci/run sets it); a fresh id per process otherwise
RUN_ENV = "RESERVOIR_TEST_RUN"

_PROCESS_RUN = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
#: the start of the name of every exchange :func:`private_exchange` makes
PRIVATE_EXCHANGE_PREFIX = "reservoir-test-"
#: URL -> the container serving it, while it runs (for rabbitmqctl_command)
_RUNNING: dict[str, Any] = {}


def run_id() -> str:
    """The value of :data:`RUN_LABEL` on the containers this process starts."""
    return os.environ.get(RUN_ENV) or _PROCESS_RUN


def _version_key(tag: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", tag))


def rabbitmq_image(client: Any | None = None) -> str:
    """The image a RabbitMQ container is started from (see the module docstring).
    ``client``: a ``docker.DockerClient`` to look for local images with (default: one from
    the environment); an engine that does not answer means the upstream default."""
    named = os.environ.get(IMAGE_ENV)
    if named:
        return named
    try:
        if client is None:
            import docker

            client = docker.from_env()
        images = client.images.list(name=LOCAL_IMAGE_REPOSITORY)
    except Exception:  # no docker package, no engine: the start will say so
        return RABBITMQ_IMAGE
    tags: list[str] = [
        str(tag)
        for image in images
        for tag in image.tags
        if tag.startswith(LOCAL_IMAGE_REPOSITORY + ":")
    ]
    if not tags:
        return RABBITMQ_IMAGE
    return max(tags, key=lambda tag: _version_key(tag.rpartition(":")[2]))


def _local_engine() -> bool:
    """Whether the Docker engine is on this machine (a unix socket), so its published
    ports are reached on loopback."""
    host = os.environ.get("DOCKER_HOST", "")
    return host == "" or host.startswith("unix://")


def configure_testcontainers() -> None:
    """Set testcontainers up for the containers started here. An explicit
    ``TESTCONTAINERS_RYUK_DISABLED``, ``TESTCONTAINERS_HOST_OVERRIDE`` (or ``TC_HOST``) or
    ``TESTCONTAINERS_CONNECTION_MODE`` in the environment is left as it is."""
    from testcontainers.core.config import ConnectionMode, testcontainers_config

    if "TESTCONTAINERS_RYUK_DISABLED" not in os.environ:
        # The reaper is a container of its own whose image is pulled from Docker Hub: where
        # nothing can be pulled, the first container fails. The fixture removes its
        # container itself, and CI removes a crashed run's by RUN_LABEL.
        testcontainers_config.ryuk_disabled = True
    if not _local_engine():
        return
    if not (os.environ.get("TESTCONTAINERS_HOST_OVERRIDE") or os.environ.get("TC_HOST")):
        testcontainers_config.tc_host_override = "127.0.0.1"
    if "TESTCONTAINERS_CONNECTION_MODE" not in os.environ:
        # Inside a container of its own (/.dockerenv), testcontainers would otherwise reach
        # containers through the bridge's gateway address; ours are published on loopback.
        testcontainers_config.connection_mode_override = ConnectionMode.docker_host


def _container_class() -> Any:
    # testcontainers 4.15 warns, when the module is imported, of a decorator of its own
    # that it still uses: nothing a test of ours could act on
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:  # testcontainers >= 4.15
            from testcontainers.community.rabbitmq import RabbitMqContainer
        except ImportError:
            from testcontainers.rabbitmq import RabbitMqContainer
    return RabbitMqContainer


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI needs a RabbitMQ and has none: {reason}", pytrace=False)
    pytest.skip(f"no RabbitMQ for this test: {reason}")


def rabbitmqctl_command(url: str) -> list[str]:
    """The command line that runs ``rabbitmqctl`` on the RabbitMQ ``url`` reaches:
    ``docker exec -i <container> rabbitmqctl`` for a container started here, else the
    machine's own ``rabbitmqctl`` (which may manage another broker: callers check)."""
    container = _RUNNING.get(url)
    if container is None:
        return ["rabbitmqctl"]
    return ["docker", "exec", "-i", container.get_container_id(), "rabbitmqctl"]


def _unanswered(url: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers at ``url`` (one TCP connection to its first broker), or None.
    Said once, at the fixture, rather than by every test's client library in turn (pika
    logs a page per failed connection)."""
    from reservoir.brokers import BrokerUrl

    try:
        parsed = BrokerUrl.parse(url)
    except Exception as error:  # a URL no broker can have: one line saying so
        return str(error)
    if parsed.adapter == "memory":
        return None
    host = parsed.host or "localhost"
    port = parsed.port or (5671 if parsed.tls else 5672)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as error:
        because = error.strerror or type(error).__name__
        return f"nothing answers at {parsed.display} ({host}:{port}: {because.lower()})"


@contextlib.contextmanager
def amqp_url_for_tests() -> Iterator[str]:
    url = os.environ.get("RESERVOIR_TEST_AMQP_URL")
    if url:
        problem = _unanswered(url)
        if problem is not None:
            # pytrace=False: the one line, not the fixture's frames
            pytest.fail(f"RESERVOIR_TEST_AMQP_URL: {problem}", pytrace=False)
        yield url
        return
    try:
        container_class = _container_class()
        configure_testcontainers()
    except ImportError as error:
        _unavailable(f"RESERVOIR_TEST_AMQP_URL is unset and testcontainers is missing ({error})")
        return
    image = rabbitmq_image()
    container = None
    try:
        container = container_class(image)  # connects to the engine already
        # Published on loopback only (an unbound port would be published on every
        # interface), on a port the engine picks.
        container.ports[str(container.port)] = ("127.0.0.1", None)
        container.with_kwargs(labels={RUN_LABEL: run_id()})
        container.start()
    except Exception as error:  # no engine, an image that cannot be pulled, ...
        if container is not None:
            with contextlib.suppress(Exception):
                container.stop()  # created but never ready: removed all the same
        _unavailable(
            f"RESERVOIR_TEST_AMQP_URL is unset and no container of {image} could start: {error}"
        )
        return
    served = ""
    try:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(container.port)
        served = f"amqp://{container.username}:{container.password}@{host}:{port}/"
        _RUNNING[served] = container
        yield served
    finally:
        _RUNNING.pop(served, None)
        container.stop()


@contextlib.contextmanager
def private_exchange(url: str) -> Iterator[str]:
    """``url`` on a fresh exchange of the caller's own, with its inbox exchange: the URL
    names it (``?exchange=reservoir-test-<random>``, replacing any exchange ``url``
    names), and both are deleted when the block ends. Every reservoir participant and
    command given the URL publishes and binds on that exchange alone, so nodes of
    another deployment on the same broker (on their own exchange, ``reservoir`` by
    default) neither take its requests nor answer them. A ``memory://`` URL comes back as
    it is."""
    from reservoir.brokers import BrokerUrl, own_exchange

    name = f"{PRIVATE_EXCHANGE_PREFIX}{uuid.uuid4().hex[:16]}"
    with own_exchange(BrokerUrl.parse(url).with_exchange(name), name=name) as private:
        yield private.given
