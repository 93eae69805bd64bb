"""What only the pika driver has, on a real RabbitMQ: pika's own URL parameters, and the
socket I/O tuned on pika's transport.

Everything the pika and kombu drivers share (topology, returns, ``user_id``, confirms,
stats, reconnection, cancelled consumers, refusals, flow control, threads) is in the
contract suite, ``tests/contract/test_amqp_contract.py``, which runs it on both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from reservoir.brokers import connect
from reservoir.brokers.pika_broker import (
    PikaBroker,
    TunedPlaintextTransport,
    strip_reservoir_params,
)

pytestmark = pytest.mark.rabbitmq


def _with_exchange(amqp_url: str, exchange: str) -> str:
    separator = "&" if "?" in amqp_url else "?"
    return f"{amqp_url}{separator}exchange={exchange}"


@pytest.fixture
def open_broker(amqp_url: str, exchange: str) -> Iterator[Callable[..., PikaBroker]]:
    """``open_broker(query="")``: a PikaBroker on this test's exchange, closed afterwards."""
    opened: list[PikaBroker] = []

    def make(query: str = "") -> PikaBroker:
        url = _with_exchange(amqp_url, exchange) + (f"&{query}" if query else "")
        broker = PikaBroker(url)
        opened.append(broker)
        return broker

    yield make
    for broker in opened:
        broker.close()


def test_reservoir_params_are_stripped_and_credentials_masked(
    open_broker: Callable[..., PikaBroker], exchange: str
) -> None:
    url, ours = strip_reservoir_params(f"amqp://u:secret@h/vh?heartbeat=5&exchange={exchange}")
    assert ours == {"exchange": exchange}
    assert url == "amqp://u:secret@h/vh?heartbeat=5"
    broker = open_broker()
    assert broker.exchange == exchange
    assert "guest" not in broker.url.split("@")[0].split(":", 2)[-1]
    assert "***" in broker.url


def test_connect_picks_pika_for_amqp_urls(amqp_url: str, exchange: str) -> None:
    broker = connect(_with_exchange(amqp_url, exchange))
    try:
        assert isinstance(broker, PikaBroker)
    finally:
        broker.close()


def test_connection_is_named_and_heartbeat_comes_from_the_url(
    open_broker: Callable[..., PikaBroker], rabbitmqctl: Callable[..., str]
) -> None:
    broker = open_broker("heartbeat=7")
    lines = rabbitmqctl("list_connections", "--no-table-headers", "timeout", "client_properties")
    ours = [line for line in lines.splitlines() if f'"{broker.connection_name}"' in line]
    assert len(ours) == 1
    assert ours[0].split("\t", 1)[0] == "7"


def test_the_connections_socket_io_is_tuned(open_broker: Callable[..., PikaBroker]) -> None:
    """The tuning reaches the transport pika really opens (if pika renamed the parts it
    hooks, this says so rather than the benchmark quietly slowing down)."""
    broker = open_broker()
    assert type(broker._connection._transport) is TunedPlaintextTransport
