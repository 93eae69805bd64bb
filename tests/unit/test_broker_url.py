"""Broker URLs are parsed once, into a BrokerUrl: its scheme picks the adapter, ``?exchange=``
is read there and stripped from what the client library sees, and the password never shows
in its display form. No broker needed."""

from __future__ import annotations

import pytest

from reservoir.broker import UnsupportedBroker
from reservoir.brokers import BrokerUrl, admin, connect, own_exchange
from reservoir.brokers.admin import TopologyAdmin
from reservoir.brokers.inprocess import InProcessBroker


@pytest.mark.parametrize(
    ("url", "adapter"),
    [
        ("memory://", "memory"),
        ("amqp://guest:guest@127.0.0.1:5672/", "pika"),
        ("amqps://u:p@rabbit.example:5671/prod", "pika"),
        ("kombu+amqp://guest:guest@127.0.0.1:5672//", "kombu"),
        ("KOMBU+pyamqp://guest:guest@127.0.0.1//", "kombu"),
    ],
)
def test_the_scheme_picks_the_adapter(url: str, adapter: str) -> None:
    assert BrokerUrl.parse(url).adapter == adapter


@pytest.mark.parametrize("url", ["redis://localhost", "nats://x", "no scheme at all"])
def test_a_scheme_no_adapter_serves_is_refused(url: str) -> None:
    with pytest.raises(UnsupportedBroker, match="memory://, amqp://"):
        BrokerUrl.parse(url)


def test_the_exchange_is_read_once_and_stripped_from_what_the_client_sees() -> None:
    url = BrokerUrl.parse("amqp://u:secret@h:5672/vh?heartbeat=5&exchange=run-1")
    assert (url.exchange, url.inbox_exchange, url.exchange_given) == ("run-1", "run-1.inbox", True)
    assert url.transport_url == "amqp://u:secret@h:5672/vh?heartbeat=5"
    assert (url.host, url.port, url.vhost, url.username, url.password) == (
        "h",
        5672,
        "vh",
        "u",
        "secret",
    )


def test_without_an_exchange_it_is_reservoir_and_the_url_is_passed_on_untouched() -> None:
    raw = "amqp://u:p@h/%2F?heartbeat=5&ssl_options=%7B%7D"
    url = BrokerUrl.parse(raw)
    assert (url.exchange, url.exchange_given) == ("reservoir", False)
    assert url.transport_url == raw
    assert url.vhost == "/"


def test_a_kombu_url_keeps_its_kombu_form_for_kombu() -> None:
    url = BrokerUrl.parse("kombu+amqp://guest:pw@127.0.0.1:5672//?exchange=x&heartbeat=2")
    assert url.transport_url == "amqp://guest:pw@127.0.0.1:5672//?heartbeat=2"
    assert url.vhost == "/"
    assert url.display == "kombu+amqp://guest:***@127.0.0.1:5672//?exchange=x&heartbeat=2"


@pytest.mark.parametrize(
    "raw",
    [
        "amqp://user:s3cr%40t@h:5672/v?exchange=e",
        "kombu+amqp://user:s3cr%40t@h:5672//",
        "amqps://user:s3cr%40t@h/v#frag",
    ],
)
def test_the_password_never_shows_in_the_display_form_or_the_repr(raw: str) -> None:
    url = BrokerUrl.parse(raw)
    assert url.password == "s3cr@t"
    for shown in (url.display, str(url), repr(url)):
        assert "s3cr" not in shown
    assert ":***@" in url.display


def test_tls_is_told_by_the_scheme_or_kombus_ssl_options() -> None:
    assert BrokerUrl.parse("amqps://h/").tls
    assert BrokerUrl.parse("kombu+amqp://h//?ssl_cert_reqs=0").tls
    assert BrokerUrl.parse("kombu+amqp://h//?ssl_cert_reqs=0").tls_options == (
        ("ssl_cert_reqs", "0"),
    )
    assert not BrokerUrl.parse("amqp://h/").tls


@pytest.mark.parametrize("exchange", ["", "amq.topic"])
def test_an_exchange_reservoir_cannot_use_is_refused(exchange: str) -> None:
    with pytest.raises(ValueError, match="exchange"):
        BrokerUrl.parse(f"amqp://h/?exchange={exchange}")


def test_with_exchange_replaces_the_urls_own() -> None:
    url = BrokerUrl.parse("amqp://u:p@h/?exchange=old&heartbeat=3").with_exchange("new")
    assert (url.exchange, url.exchange_given) == ("new", True)
    assert "exchange=new" in url.display
    assert "old" not in url.display
    assert url.transport_url == "amqp://u:p@h/?heartbeat=3"


def test_parsing_a_parsed_url_returns_it() -> None:
    url = BrokerUrl.parse("memory://")
    assert BrokerUrl.parse(url) is url


def test_connect_takes_a_parsed_url_or_a_string() -> None:
    for url in ("memory://", BrokerUrl.parse("memory://")):
        broker = connect(url)
        try:
            assert isinstance(broker, InProcessBroker)
            assert broker.url == "memory://"
        finally:
            broker.close()


def test_the_in_process_broker_has_no_topology_to_administer_and_rabbitmq_has() -> None:
    assert admin("memory://") is None
    rabbit = admin("kombu+amqp://guest:guest@127.0.0.1:5672//?exchange=x")
    assert isinstance(rabbit, TopologyAdmin)


def test_a_run_of_its_own_on_the_in_process_broker_is_the_url_itself() -> None:
    with own_exchange("memory://", name="mine") as url:
        assert url.adapter == "memory"


def test_the_brokers_of_a_cluster_are_joined_with_semicolons_and_tried_in_order() -> None:
    url = BrokerUrl.parse(
        "amqp://u:secret@127.0.0.1:5681/?exchange=x;amqp://u:secret@127.0.0.1:5682/?exchange=x"
    )
    assert url.addresses == 2
    assert [u.split("@")[1] for u in url.transport_urls] == ["127.0.0.1:5681/", "127.0.0.1:5682/"]
    assert url.exchange == "x"
    assert "secret" not in url.display and url.display.count("***") == 2
    assert url.with_exchange("y").display.count("exchange=y") == 2


def test_the_brokers_of_a_cluster_must_agree_on_vhost_and_exchange() -> None:
    with pytest.raises(ValueError, match="disagree on the vhost"):
        BrokerUrl.parse("amqp://h1:5672/a;amqp://h2:5672/b")
    with pytest.raises(ValueError, match="disagree on the exchange"):
        BrokerUrl.parse("amqp://h1/?exchange=x;amqp://h2/")
