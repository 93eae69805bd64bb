"""Broker adapters behind reservoir's one small interface (:mod:`reservoir.broker`).

One module per transport: :mod:`reservoir.brokers.inprocess` (the embedded default, ``memory://``),
:mod:`reservoir.brokers.pika_broker` (RabbitMQ, ``amqp://`` and ``amqps://``) and
:mod:`reservoir.brokers.kombu_broker` (``kombu+<kombu URL>``). :func:`connect` picks one by URL.
The two RabbitMQ drivers share one sans-I/O session (:mod:`reservoir.brokers.amqp`). URLs are parsed
once, into a :class:`~reservoir.brokers.url.BrokerUrl`; exchange administration, which the Broker
contract leaves out, is :func:`admin` (:mod:`reservoir.brokers.admin`). The small rules every
adapter shares live in :mod:`reservoir.brokers._rules`.
"""

from __future__ import annotations

import os

from reservoir.broker import Broker
from reservoir.brokers.admin import ExchangeInUse, TopologyAdmin, admin, own_exchange
from reservoir.brokers.url import DEFAULT_BROKER_URL, BrokerUrl

__all__ = [
    "DEFAULT_BROKER_URL",
    "BrokerUrl",
    "ExchangeInUse",
    "TopologyAdmin",
    "admin",
    "connect",
    "own_exchange",
]


def connect(url: str | BrokerUrl | None = None) -> Broker:
    """Open a broker for ``url`` (a string or a :class:`BrokerUrl`); without one,
    ``RESERVOIR_BROKER_URL`` or ``memory://``.

    Every ``memory://`` broker is a new, isolated in-process broker: to let participants in
    one process talk, give them the same broker object rather than the same URL.
    """
    url = url or os.environ.get("RESERVOIR_BROKER_URL") or DEFAULT_BROKER_URL
    parsed = BrokerUrl.parse(url)
    if parsed.adapter == "memory":
        from reservoir.brokers.inprocess import InProcessBroker

        return InProcessBroker(url=parsed.display)
    if parsed.adapter == "pika":
        from reservoir.brokers.pika_broker import PikaBroker

        return PikaBroker(parsed)
    from reservoir.brokers.kombu_broker import KombuBroker

    return KombuBroker(parsed)
