"""Finding a real RabbitMQ for tests: ``RESERVOIR_TEST_AMQP_URL`` first, then a
testcontainers ``RabbitMqContainer``, else skip (or fail, when ``CI`` is set)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["RABBITMQ_IMAGE", "amqp_url_for_tests"]

#: pinned so a test run does not change under us when the image moves
RABBITMQ_IMAGE = "rabbitmq:4.1.4-management"


def _container_class() -> Any:
    try:  # testcontainers >= 4.15
        from testcontainers.community.rabbitmq import RabbitMqContainer
    except ImportError:
        from testcontainers.rabbitmq import RabbitMqContainer
    return RabbitMqContainer


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI needs a RabbitMQ and has none: {reason}", pytrace=False)
    pytest.skip(f"no RabbitMQ for this test: {reason}")


@contextlib.contextmanager
def amqp_url_for_tests() -> Iterator[str]:
    url = os.environ.get("RESERVOIR_TEST_AMQP_URL")
    if url:
        yield url
        return
    try:
        container_class = _container_class()
    except ImportError as error:
        _unavailable(f"RESERVOIR_TEST_AMQP_URL is unset and testcontainers is missing ({error})")
        return
    try:
        container = container_class(RABBITMQ_IMAGE)
        container.start()
    except Exception as error:  # docker missing, image not pullable, ...
        _unavailable(f"RESERVOIR_TEST_AMQP_URL is unset and no container could start: {error}")
        return
    try:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(container.port)
        yield f"amqp://{container.username}:{container.password}@{host}:{port}/"
    finally:
        container.stop()
