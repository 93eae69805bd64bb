"""What both RabbitMQ drivers promise beyond the broker contract, tested alike for each.

pika and kombu drive one session (:mod:`reservoir.brokers.amqp.session`), so they must behave, count
and report readiness identically: the topology and its inbox exchange, returns to their own
sender, the validated ``user_id``, confirms and stats, the bounded buffer, recovery after
the broker closes the connection, a consumer the broker cancels, a refused (403) publish in
a batch, flow control, threads. Each test has its own exchange (deleted afterwards), names,
and, where it needs one, its own RabbitMQ user (deleted afterwards); it closes only its own
connections, found by their ``connection_name``.

Flow control is simulated, not provoked: a real ``connection.blocked`` needs a resource
alarm (``rabbitmqctl set_vm_memory_high_watermark 0``), which blocks every publisher of the
shared RabbitMQ, other people's tests included. The test reports ``connection.blocked``
and ``unblocked`` to the driver on its IO thread, where the client library's callback
reports them, and everything after that is the real driver on the real broker.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pika
import pika.exceptions
import pytest

from reservoir.broker import BrokerError, Delivery, Endpoint
from reservoir.brokers import BrokerUrl, ExchangeInUse, admin, own_exchange
from reservoir.brokers.amqp.session import Session
from reservoir.brokers.amqp.threaded import AmqpBroker
from reservoir.brokers.kombu_broker import KombuBroker
from reservoir.brokers.pika_broker import PikaBroker

if TYPE_CHECKING:
    from conftest import Collector, Ctl, OpenAmqp, RestrictedUser

    NewCollector = Callable[[], Collector]

pytestmark = pytest.mark.rabbitmq

WAIT_S = 10.0
DRIVERS: dict[str, type[AmqpBroker]] = {"pika": PikaBroker, "kombu": KombuBroker}


@pytest.fixture
def ns() -> str:
    return f"ac{uuid.uuid4().hex[:12]}"


@pytest.fixture
def plain(reservoir_amqp_broker_url: str) -> Any:
    """A plain pika connection, for doing what the drivers would not (or must not) do."""
    connection = pika.BlockingConnection(pika.URLParameters(reservoir_amqp_broker_url))
    yield connection
    if connection.is_open:
        connection.close()


def _open(broker: AmqpBroker, collector: Collector, name: str | None = None) -> Endpoint:
    endpoint = broker.open_endpoint(collector, name=name)
    collector.endpoint = endpoint
    return endpoint


def _get_one(channel: Any, queue_name: str) -> tuple[Any, Any, bytes]:
    """The next message on ``queue_name`` (waits through consume, without sleeping)."""
    for method, properties, body in channel.consume(queue_name, inactivity_timeout=WAIT_S):
        assert method is not None, f"nothing arrived on {queue_name} in {WAIT_S}s"
        channel.basic_ack(method.delivery_tag)
        channel.cancel()
        return method, properties, body
    raise AssertionError("unreachable")


# -- configuration ------------------------------------------------------------------------


def test_the_url_is_shown_with_its_password_masked(
    open_amqp: OpenAmqp, amqp_exchange: str, reservoir_amqp_broker_url: str
) -> None:
    broker = open_amqp()
    assert broker.exchange == amqp_exchange
    assert f"exchange={amqp_exchange}" in broker.url
    password = urlsplit(reservoir_amqp_broker_url).password
    assert password and f":{password}@" not in broker.url
    assert ":***@" in broker.url


def test_an_unreachable_broker_fails_the_constructor(driver: str) -> None:
    url = "amqp://guest:guest@127.0.0.1:1/"  # port 1 refuses at once
    with pytest.raises(BrokerError, match="connect"):
        DRIVERS[driver](driver_url_of(driver, url), connect_attempts=2, reconnect_initial_s=0.01)


def test_wrong_credentials_fail_at_once_without_retrying(
    driver: str, reservoir_amqp_broker_url: str
) -> None:
    parts = urlsplit(reservoir_amqp_broker_url)
    wrong = parts._replace(netloc=f"nobody:wrong@{parts.hostname}:{parts.port or 5672}")
    with pytest.raises(BrokerError, match="ACCESS_REFUSED"):
        # Five attempts five seconds apart would outlast the test's timeout.
        DRIVERS[driver](
            driver_url_of(driver, wrong.geturl()), connect_attempts=5, reconnect_initial_s=5.0
        )


def test_an_exchange_of_another_type_is_refused_at_once(
    open_amqp: OpenAmqp, plain: Any, amqp_exchange: str
) -> None:
    plain.channel().exchange_declare(amqp_exchange, "direct")
    with pytest.raises(BrokerError, match="PRECONDITION_FAILED"):
        open_amqp(connect_attempts=5, reconnect_initial_s=5.0)


def test_amq_exchanges_are_refused(driver: str, reservoir_amqp_broker_url: str) -> None:
    url = BrokerUrl.parse(driver_url_of(driver, reservoir_amqp_broker_url))
    with pytest.raises(ValueError, match=r"amq\.topic\.inbox"):
        url.with_exchange("amq.topic")


def test_the_connection_is_named_and_the_name_survives_a_reconnect(
    open_amqp: OpenAmqp, ctl: Ctl
) -> None:
    broker = open_amqp(reconnect_initial_s=0.01)
    assert broker.connection_name.startswith(f"reservoir-{broker.driver}:")
    assert len(ctl.pids_named(broker.connection_name)) == 1
    ctl.close_connection(broker.connection_name)
    assert broker.wait_ready(WAIT_S, min_reconnects=1)
    assert len(ctl.pids_named(broker.connection_name)) == 1


# -- topology ------------------------------------------------------------------------------


def test_sends_go_through_the_inbox_exchange_by_address(
    open_amqp: OpenAmqp, plain: Any, amqp_exchange: str, ns: str, new_collector: NewCollector
) -> None:
    broker = open_amqp()
    assert broker.inbox_exchange == f"{amqp_exchange}.inbox"
    # Both durable topic exchanges: an equivalent active declare is accepted.
    for name in (amqp_exchange, f"{amqp_exchange}.inbox"):
        plain.channel().exchange_declare(name, "topic", durable=True, auto_delete=False)

    # What the driver sends reaches whatever is bound to the inbox exchange by address ...
    channel = plain.channel()
    spy = channel.queue_declare(f"{ns}-spy", exclusive=True).method.queue
    channel.queue_bind(spy, f"{amqp_exchange}.inbox", routing_key=f"{ns}-spy")
    sent = new_collector()
    sender = _open(broker, sent)
    sender.send(f"{ns}-spy", b"to the spy")
    method, properties, body = _get_one(channel, spy)
    assert (method.exchange, method.routing_key, body) == (
        f"{amqp_exchange}.inbox",
        f"{ns}-spy",
        b"to the spy",
    )
    assert properties.user_id == "guest"

    # ... and an endpoint is bound there by its own address (and only that: no wildcard).
    receiver = new_collector()
    _open(broker, receiver, name=f"{ns}.node.a")
    channel.basic_publish(f"{amqp_exchange}.inbox", f"{ns}.node.a", b"via inbox")
    channel.basic_publish("", f"{ns}.node.a", b"via the default exchange")
    assert receiver.wait_for_body(b"via inbox").topic is None
    assert receiver.wait_for_body(b"via the default exchange").topic is None
    sender.send(f"{ns}.node.b", b"to a sibling")
    assert sent.wait_for_return(b"to a sibling").topic is None
    assert all(d.body != b"to a sibling" for d in receiver.deliveries)
    assert (broker.stats.sent, broker.stats.published) == (2, 0)


@pytest.mark.parametrize("name", ["node.*", "node.#", "#", "a*b"])
def test_endpoint_names_with_wildcards_are_refused(
    open_amqp: OpenAmqp, new_collector: NewCollector, name: str
) -> None:
    broker = open_amqp()
    with pytest.raises(ValueError, match=r"'\*' or '#'"):
        broker.open_endpoint(new_collector(), name=name)
    broker.open_endpoint(new_collector())  # and the broker carries on


def test_generated_addresses_have_one_shape(
    open_amqp: OpenAmqp, new_collector: NewCollector
) -> None:
    address = open_amqp().open_endpoint(new_collector()).address
    assert address.startswith("inbox.")
    assert len(address) == len("inbox.") + 32


def test_delete_exchanges_deletes_both_before_or_after_close_and_is_idempotent(
    driver: str, reservoir_amqp_broker_url: str, ns: str, new_collector: NewCollector
) -> None:
    for when in ("open", "closed"):
        url = BrokerUrl.parse(driver_url_of(driver, reservoir_amqp_broker_url)).with_exchange(
            f"contract-delete-{when}-{uuid.uuid4().hex}"
        )
        topology = admin(url)
        assert topology is not None
        assert not topology.exchange_exists(url.exchange)
        broker = DRIVERS[driver](url)
        try:
            broker.open_endpoint(new_collector(), name=f"{ns}-{when}").bind(f"{ns}.t")
            assert topology.exchange_exists(url.exchange)
            assert topology.exchange_exists(url.inbox_exchange)
            if when == "closed":
                broker.close()
            broker.delete_exchanges()
            assert not topology.exchange_exists(url.exchange)
            assert not topology.exchange_exists(url.inbox_exchange)
            broker.delete_exchanges()  # already gone: no error
        finally:
            broker.close()


def test_a_name_held_by_another_connection_is_refused_and_the_broker_carries_on(
    open_amqp: OpenAmqp, new_collector: NewCollector, ns: str
) -> None:
    first, second = open_amqp(), open_amqp()
    first.open_endpoint(new_collector(), name=f"{ns}-taken")
    with pytest.raises(BrokerError, match="405"):
        second.open_endpoint(new_collector(), name=f"{ns}-taken")
    # The refused declare cost its control channel only: the broker still works.
    receiver = new_collector()
    _open(second, receiver, name=f"{ns}-free").bind(f"{ns}.t")
    second.open_endpoint(new_collector()).publish(f"{ns}.t", b"still working")
    receiver.wait_for_body(b"still working")
    assert second.stats.reconnects == 0


# -- returns, user_id, confirms ---------------------------------------------------------------


def test_returns_reach_their_own_sender_with_the_topic(
    open_amqp: OpenAmqp, new_collector: NewCollector, ns: str
) -> None:
    broker = open_amqp()
    a, b = new_collector(), new_collector()
    a_ep, b_ep = _open(broker, a), _open(broker, b)
    a_ep.publish(f"{ns}.tier.10", b"a-publish")
    b_ep.publish(f"{ns}.tier.50", b"b-publish")
    a_ep.send(f"{ns}-nobody", b"a-send")
    returned = a.wait_for_return(b"a-publish")
    assert returned.topic == f"{ns}.tier.10"
    assert returned.user_id == "guest"
    assert a.wait_for_return(b"a-send").topic is None
    assert b.wait_for_return(b"b-publish").topic == f"{ns}.tier.50"
    assert [d.body for d in a.returned] == [b"a-publish", b"a-send"]
    assert [d.body for d in b.returned] == [b"b-publish"]
    assert broker.stats.returned == 3


def test_user_id_is_the_authenticated_user_and_rabbitmq_checks_it(
    open_amqp: OpenAmqp, plain: Any, amqp_exchange: str, ns: str, new_collector: NewCollector
) -> None:
    broker = open_amqp()
    receiver = new_collector()
    _open(broker, receiver, name=f"{ns}-inbox").bind(f"{ns}.t")
    broker.open_endpoint(new_collector()).publish(f"{ns}.t", b"from the driver")
    assert receiver.wait_for_body(b"from the driver").user_id == "guest"

    channel = plain.channel()
    channel.basic_publish(amqp_exchange, f"{ns}.t", b"anonymous")
    assert receiver.wait_for_body(b"anonymous").user_id is None
    # A forged user_id never reaches anyone: RabbitMQ closes the channel instead.
    channel.basic_publish(
        amqp_exchange, f"{ns}.t", b"forged", pika.BasicProperties(user_id="mallory")
    )
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        channel.queue_declare("", exclusive=True)  # any round trip surfaces the close
    assert refused.value.reply_code == 406
    broker.open_endpoint(new_collector()).send(f"{ns}-inbox", b"marker")
    receiver.wait_for_body(b"marker")
    assert all(d.body != b"forged" for d in receiver.deliveries)


def test_a_nacked_publish_is_counted_not_retried(
    open_amqp: OpenAmqp, plain: Any, amqp_exchange: str, ns: str, new_collector: NewCollector
) -> None:
    broker = open_amqp()
    channel = plain.channel()
    # A queue that refuses every message: RabbitMQ nacks what is routed to it.
    full = channel.queue_declare(
        f"{ns}-full", exclusive=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
    ).method.queue
    channel.queue_bind(full, amqp_exchange, f"{ns}.full")
    sender = new_collector()
    sender_ep = _open(broker, sender)
    sender_ep.publish(f"{ns}.full", b"refused")
    sender_ep.publish(f"{ns}.nobody", b"marker")
    sender.wait_for_return(b"marker")
    broker.close()  # waits for every confirm
    stats = broker.stats
    assert (stats.nacked, stats.confirmed, stats.abandoned) == (1, 1, 0)
    assert [d.body for d in sender.returned] == [b"marker"]  # routed, so not returned


def test_eight_threads_publishing_through_one_endpoint_keep_each_order_and_all_confirm(
    open_amqp: OpenAmqp, new_collector: NewCollector, ns: str
) -> None:
    broker = open_amqp()
    receiver = new_collector()
    _open(broker, receiver).bind(f"{ns}.seq")
    shared = broker.open_endpoint(new_collector())
    threads_n, per_thread = 8, 500
    start = threading.Barrier(threads_n)

    def run(index: int) -> None:
        start.wait(timeout=WAIT_S)
        for i in range(per_thread):
            shared.publish(f"{ns}.seq", f"{index}:{i}".encode())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    received = receiver.wait_for_count(threads_n * per_thread)
    for index in range(threads_n):
        prefix = f"{index}:".encode()
        sequence = [int(d.body[len(prefix) :]) for d in received if d.body.startswith(prefix)]
        assert sequence == list(range(per_thread))
    broker.close()
    stats = broker.stats
    assert stats.published == stats.confirmed == threads_n * per_thread
    assert stats.nacked == stats.abandoned == stats.returned == 0


def test_publishes_beyond_max_pending_fail_fast(
    open_amqp: OpenAmqp, new_collector: NewCollector, ns: str
) -> None:
    broker = open_amqp(max_pending=3)
    receiver = new_collector()
    _open(broker, receiver).bind(f"{ns}.t")
    sender = broker.open_endpoint(new_collector())
    # Hold the IO thread, as a long outage would: nothing gets confirmed meanwhile.
    release = threading.Event()
    broker.call_on_io_thread(lambda: release.wait(WAIT_S) and None)
    try:
        for i in range(3):
            sender.publish(f"{ns}.t", b"%d" % i)
        with pytest.raises(BrokerError, match="waiting for RabbitMQ"):
            sender.publish(f"{ns}.t", b"one too many")
    finally:
        release.set()
    assert [d.body for d in receiver.wait_for_count(3)] == [b"0", b"1", b"2"]


# -- what the broker does to us -------------------------------------------------------------


def test_after_the_broker_closes_the_connection_addresses_bindings_and_replies_come_back(
    open_amqp: OpenAmqp, ctl: Ctl, new_collector: NewCollector, ns: str
) -> None:
    broker = open_amqp(reconnect_initial_s=0.05)
    node = new_collector()
    node_ep = _open(broker, node, name=f"{ns}-node")
    node_ep.bind(f"{ns}.tier.#")
    requestor = new_collector()
    requestor_ep = _open(broker, requestor)
    requestor_ep.publish(f"{ns}.tier.10", b"before")
    node.wait_for_body(b"before")

    ctl.close_connection(broker.connection_name)
    # Straight after the close, before or after the driver noticed: a publish is buffered
    # (or republished unconfirmed) and a bind waits for the reconnect or is redone by it.
    requestor_ep.publish(f"{ns}.tier.10", b"during")
    node_ep.bind(f"{ns}.extra")
    assert broker.wait_ready(WAIT_S, min_reconnects=1)

    requestor_ep.publish(f"{ns}.tier.25", b"after, on the old binding")
    requestor_ep.publish(f"{ns}.extra", b"after, on the new binding")
    requestor_ep.send(f"{ns}-node", b"after, by address")
    requestor_ep.publish(f"{ns}.nobody", b"after, unroutable")
    for body in (b"during", b"after, on the old binding", b"after, on the new binding"):
        node.wait_for_body(body)
    node.wait_for_body(b"after, by address")
    requestor.wait_for_return(b"after, unroutable")
    # The requestor's generated address survived too: the node can still answer it.
    node_ep.send(requestor_ep.address, b"reply")
    requestor.wait_for_body(b"reply")
    assert broker.stats.reconnects == 1
    assert broker.connections == 2


def test_a_consumer_the_broker_cancels_gets_its_queue_and_bindings_back(
    open_amqp: OpenAmqp, ctl: Ctl, new_collector: NewCollector, ns: str
) -> None:
    broker = open_amqp()
    node = new_collector()
    node_ep = _open(broker, node, name=f"{ns}-node")
    node_ep.bind(f"{ns}.tier.#")
    # The sender hands its returns to the node's collector: one place to wait on.
    sender_ep = broker.open_endpoint(node)

    vhost = broker.broker_url.vhost
    ctl("delete_queue", "-p", vhost, node_ep.address)  # an operator deletes it under us
    # Until the driver has re-created the queue, a send comes back unroutable: send again
    # until one arrives (each attempt waits for its own answer; nothing sleeps).
    for attempt in range(100):
        body = b"by address %d" % attempt
        sender_ep.send(node_ep.address, body)
        arrived = node.wait_until(lambda ds, b=body: any(d.body == b for d in ds), repr(body))
        if not any(d.body == body and d.returned for d in arrived):
            break
    else:
        pytest.fail("the queue never came back")
    sender_ep.publish(f"{ns}.tier.10", b"on the old binding")
    node.wait_for_body(b"on the old binding")
    assert broker.stats.cancelled == 1
    assert broker.stats.reconnects == 0


def test_a_refused_send_in_a_batch_comes_back_and_the_rest_arrive_in_order(
    open_amqp: OpenAmqp,
    restricted_user: Callable[[str], RestrictedUser],
    new_collector: NewCollector,
    ns: str,
) -> None:
    """A send this user may not make closes the channel it went out on; RabbitMQ ignores
    what followed it on that channel. The refused ones come back to their sender as
    returned, the others arrive in order, and nothing reconnects (a reconnect would replay
    the refused send, be refused again, and loop)."""
    user = restricted_user(f"^{ns}-ok")
    receiver_broker = open_amqp()
    receiver = new_collector()
    _open(receiver_broker, receiver, name=f"{ns}-ok-receiver")
    broker = open_amqp(user.url)
    sender = new_collector()
    sender_ep = _open(broker, sender, name=f"{ns}-ok-sender")

    batch = [
        (f"{ns}-ok-receiver", b"1 before"),
        (f"{ns}-forbidden", b"2 forged"),
        (f"{ns}-ok-receiver", b"3 after"),
        (f"{ns}-forbidden", b"4 forged again"),
        (f"{ns}-ok-receiver", b"5 last"),
    ]
    for address, body in batch:
        sender_ep.send(address, body)
    assert sender.wait_for_return(b"2 forged").topic is None
    sender.wait_for_return(b"4 forged again")
    assert sender.wait_for_return(b"2 forged").user_id == user.name
    receiver.wait_for_body(b"5 last")
    assert receiver.bodies == [b"1 before", b"3 after", b"5 last"]
    # Still working, on the same connection.
    sender_ep.send(f"{ns}-ok-receiver", b"6 still there")
    receiver.wait_for_body(b"6 still there")
    stats = broker.stats
    assert (stats.refused, stats.reconnects) == (2, 0)
    assert [d.body for d in sender.returned] == [b"2 forged", b"4 forged again"]


def test_publishes_wait_while_rabbitmq_blocks_publishing_and_go_out_in_order_after(
    open_amqp: OpenAmqp, new_collector: NewCollector, ns: str
) -> None:
    broker = open_amqp()
    receiver = new_collector()
    receiving = _open(broker, receiver)
    receiving.bind(f"{ns}.a")
    sender = broker.open_endpoint(new_collector())

    def report(event: Callable[..., None], *args: str) -> None:
        reported = threading.Event()

        def on_io_thread() -> None:
            broker.report(event, *args)
            reported.set()

        broker.call_on_io_thread(on_io_thread)
        assert reported.wait(WAIT_S)

    report(Session.blocked, "memory alarm (simulated)")
    for i in range(3):
        sender.publish(f"{ns}.a", b"held %d" % i)
    receiving.bind(f"{ns}.b")  # control methods go on meanwhile
    # A marker on another connection shows the held ones really were not sent.
    other = open_amqp()
    other.open_endpoint(new_collector()).publish(f"{ns}.a", b"marker")
    receiver.wait_for_body(b"marker")
    assert receiver.bodies == [b"marker"]
    assert broker.stats.blocked == 1

    report(Session.unblocked)
    sender.publish(f"{ns}.b", b"after")
    receiver.wait_for_count(5)
    assert receiver.bodies == [b"marker", b"held 0", b"held 1", b"held 2", b"after"]


# -- threads --------------------------------------------------------------------------------


def test_a_handler_may_rebind_its_endpoint(
    open_amqp: OpenAmqp, new_collector: NewCollector, ns: str
) -> None:
    # A node crossing a tier boundary re-binds from within its message handler.
    broker = open_amqp()
    moved = threading.Event()
    node: list[Endpoint] = []
    seen = new_collector()

    def handler(delivery: Delivery) -> None:
        seen(delivery)
        if delivery.body == b"move":
            node[0].unbind(f"{ns}.tier.10")
            node[0].bind(f"{ns}.tier.50")
            moved.set()

    node.append(broker.open_endpoint(handler))
    node[0].bind(f"{ns}.tier.10")
    sender = new_collector()
    sender_ep = _open(broker, sender)
    sender_ep.publish(f"{ns}.tier.10", b"move")
    assert moved.wait(WAIT_S)
    sender_ep.publish(f"{ns}.tier.10", b"old tier")
    sender_ep.publish(f"{ns}.tier.50", b"new tier")
    seen.wait_for_body(b"new tier")
    sender.wait_for_return(b"old tier")


def test_close_joins_its_two_threads_even_from_a_handler(
    open_amqp: OpenAmqp, new_collector: NewCollector, ns: str
) -> None:
    broker = open_amqp()
    prefix = f"{broker.connection_name}:"
    mine = [t for t in threading.enumerate() if t.name.startswith(prefix)]
    assert sorted(t.name.removeprefix(prefix) for t in mine) == ["dispatch", "io"]
    closed = threading.Event()

    def close_broker(delivery: Delivery) -> None:
        broker.close()  # from the dispatcher thread: must not join itself
        closed.set()

    endpoint = broker.open_endpoint(close_broker, name=f"{ns}-closer")
    broker.open_endpoint(new_collector()).send(endpoint.address, b"close")
    assert closed.wait(WAIT_S)
    for thread in mine:
        thread.join(WAIT_S)  # the dispatcher finishes the handler, then stops
        assert not thread.is_alive(), thread.name
    broker.close()  # idempotent
    assert broker.closed


def driver_url_of(driver: str, amqp_url: str) -> str:
    return f"kombu+{amqp_url}" if driver == "kombu" else amqp_url


# -- administration -------------------------------------------------------------------------


def test_a_run_of_its_own_refuses_an_exchange_that_exists_and_leaves_it_alone(
    driver: str, reservoir_amqp_broker_url: str, amqp_exchange: str, open_amqp: OpenAmqp
) -> None:
    someone_else = open_amqp()  # a live deployment on the exchange
    url = BrokerUrl.parse(driver_url_of(driver, reservoir_amqp_broker_url)).with_exchange(
        amqp_exchange
    )
    with pytest.raises(ExchangeInUse, match=amqp_exchange), own_exchange(url, name="unused"):
        pytest.fail("the run must not start")
    topology = admin(url)
    assert topology is not None
    assert topology.exchange_exists(amqp_exchange)
    assert someone_else.connected


def test_a_run_of_its_own_makes_and_deletes_a_private_exchange(
    driver: str, reservoir_amqp_broker_url: str, new_collector: NewCollector
) -> None:
    name = f"contract-own-{uuid.uuid4().hex}"
    with own_exchange(driver_url_of(driver, reservoir_amqp_broker_url), name=name) as url:
        assert url.exchange == name
        broker = DRIVERS[driver](url)
        try:
            broker.open_endpoint(new_collector())
        finally:
            broker.close()
        topology = admin(url)
        assert topology is not None
        assert topology.exchange_exists(name)
    assert not topology.exchange_exists(name)
    assert not topology.exchange_exists(f"{name}.inbox")


# -- claims across connections ----------------------------------------------------------------


def test_a_claim_held_on_one_connection_is_refused_on_another_until_let_go(
    open_amqp: OpenAmqp, ns: str
) -> None:
    """RabbitMQ's exclusive queues: a second connection's declare is refused (405)."""
    first, second = open_amqp(), open_amqp()
    holder = first.open_endpoint(lambda delivery: None)
    other = second.open_endpoint(lambda delivery: None)
    assert holder.claim(f"{ns}-order-1") is True
    assert other.claim(f"{ns}-order-1") is False
    # the refusal cost the control channel, which is reopened: the connection carries on
    other.bind(f"{ns}.after.refusal")
    holder.unclaim(f"{ns}-order-1")
    assert other.claim(f"{ns}-order-1") is True
    # a connection that closes lets go of what it held
    second.close()
    assert holder.claim(f"{ns}-order-1") is True


def test_claims_are_scoped_to_the_exchange(
    open_amqp: OpenAmqp, reservoir_amqp_broker_url: str, driver: str, ns: str
) -> None:
    """Two deployments (two exchanges) sharing a RabbitMQ claim their keys apart."""
    here = open_amqp().open_endpoint(lambda delivery: None)
    base = BrokerUrl.parse(driver_url_of(driver, reservoir_amqp_broker_url))
    elsewhere = DRIVERS[driver](base.with_exchange(f"{ns}-elsewhere"))
    try:
        there = elsewhere.open_endpoint(lambda delivery: None)
        assert here.claim(f"{ns}-order-1") is True
        assert there.claim(f"{ns}-order-1") is True
    finally:
        elsewhere.close()
        topology = admin(base.with_exchange(f"{ns}-elsewhere"))
        assert topology is not None
        topology.delete_reservoir_exchanges()
