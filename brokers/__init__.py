"""Broker adapters behind reservoir's one small interface (:mod:`reservoir.broker`).

One module per transport: :mod:`brokers.inprocess` (the embedded default, ``memory://``),
:mod:`brokers.pika_broker` (RabbitMQ, ``amqp://`` and ``amqps://``) and
:mod:`brokers.kombu_broker` (``kombu+<kombu URL>``). :func:`connect` picks one by URL.
The rules they share, each in one place, live in :mod:`brokers._rules`.
"""

from __future__ import annotations

import os

from reservoir.broker import Broker, UnsupportedBroker

__all__ = ["DEFAULT_BROKER_URL", "connect"]

DEFAULT_BROKER_URL = "memory://"


def connect(url: str | None = None) -> Broker:
    """Open a broker for ``url``; without one, ``RESERVOIR_BROKER_URL`` or ``memory://``.

    Every ``memory://`` broker is a new, isolated in-process broker: to let participants in
    one process talk, give them the same broker object rather than the same URL.
    """
    url = url or os.environ.get("RESERVOIR_BROKER_URL") or DEFAULT_BROKER_URL
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "memory":
        from brokers.inprocess import InProcessBroker

        return InProcessBroker(url=url)
    if scheme in ("amqp", "amqps"):
        from brokers.pika_broker import PikaBroker

        return PikaBroker(url)
    if scheme.startswith("kombu+"):
        from brokers.kombu_broker import KombuBroker

        return KombuBroker(url)
    raise UnsupportedBroker(
        f"no broker adapter for {url!r}: use memory://, amqp://, amqps:// or kombu+<kombu URL>"
    )
