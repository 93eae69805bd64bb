"""The broker contract: what every adapter promises, tested the same way for each.

Topics and names carry a per-test prefix (the ``ns`` fixture) so a run against a shared
RabbitMQ never hears another run. Where a test shows that something did *not* arrive, it
sends a marker after it on the same path and waits for the marker.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from reservoir.broker import Broker, BrokerClosed, BrokerError, Delivery, Endpoint
from reservoir.brokers.amqp.threaded import AmqpBroker
from reservoir.brokers.inprocess import InProcessBroker

if TYPE_CHECKING:
    # For annotations only: pytest imports conftest itself, and fixtures hand out instances.
    from conftest import Collector

    Inbox = Callable[..., Collector]
    NewCollector = Callable[[], Collector]


def assert_only_marker_arrived(receiver: Collector, marker: bytes) -> None:
    """After waiting for ``marker``, nothing else may have arrived before it."""
    receiver.wait_for_body(marker)
    assert receiver.bodies == [marker]


# -- claims -------------------------------------------------------------------------------------


def test_a_claim_is_held_by_one_endpoint_until_it_lets_go(inbox: Inbox, ns: str) -> None:
    holder, other = inbox(), inbox()
    assert holder.ep.claim(f"{ns}-key") is True
    assert holder.ep.claim(f"{ns}-key") is True  # held here already
    assert other.ep.claim(f"{ns}-key") is False
    assert other.ep.claim(f"{ns}-another") is True  # keys are claimed one by one
    holder.ep.unclaim(f"{ns}-key")
    assert other.ep.claim(f"{ns}-key") is True
    holder.ep.unclaim(f"{ns}-key")  # not held there: nothing happens
    assert holder.ep.claim(f"{ns}-key") is False


def test_closing_an_endpoint_lets_go_of_its_claims(inbox: Inbox, ns: str) -> None:
    holder, other = inbox(), inbox()
    assert holder.ep.claim(f"{ns}-key") is True
    holder.ep.close()
    assert other.ep.claim(f"{ns}-key") is True


def test_what_follows_an_ordered_bind_leaves_once_the_binding_is_in_place(
    inbox: Inbox, ns: str
) -> None:
    """A node binds an id's topic and sends its offer at once, without waiting: whoever
    hears the offer and publishes on the topic must reach the node."""
    node, asker = inbox(), inbox()
    for round_ in range(20):
        node.ep.bind_ordered(f"{ns}.lookup.{round_}")
        node.ep.send(asker.address, f"offer {round_}".encode())
        asker.wait_for_body(f"offer {round_}".encode())
        asker.ep.publish(f"{ns}.lookup.{round_}", f"lookup {round_}".encode())
        node.wait_for_body(f"lookup {round_}".encode())
    assert not [d for d in asker.deliveries if d.returned]
    node.ep.unbind_ordered(f"{ns}.lookup.0")
    node.ep.bind(f"{ns}.marker")  # waits: the broker's control calls go one at a time
    asker.ep.publish(f"{ns}.lookup.0", b"after the unbind")
    asker.wait_for_return(b"after the unbind")


# -- topic routing ----------------------------------------------------------------------------


def test_exact_topic_reaches_its_binding(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.a.b"])
    sender = inbox()
    sender.ep.publish(f"{ns}.a.b", b"hello")
    delivery = receiver.wait_for_body(b"hello")
    assert delivery.topic == f"{ns}.a.b"
    assert not delivery.returned


def test_star_matches_exactly_one_word(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.*.end"])
    sender = inbox()
    sender.ep.publish(f"{ns}.one.end", b"one word")
    sender.ep.publish(f"{ns}.end", b"zero words")
    sender.ep.publish(f"{ns}.two.words.end", b"two words")
    sender.ep.publish(f"{ns}.marker.end", b"marker")
    receiver.wait_for_body(b"marker")
    assert receiver.bodies == [b"one word", b"marker"]


def test_star_matches_an_empty_word(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.*.end"])
    sender = inbox()
    sender.ep.publish(f"{ns}..end", b"empty word")
    assert receiver.wait_for_body(b"empty word").topic == f"{ns}..end"


def test_star_does_not_cross_dots(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.*"])
    sender = inbox()
    sender.ep.publish(f"{ns}.a.b", b"crosses a dot")
    sender.ep.publish(f"{ns}.marker", b"marker")
    assert_only_marker_arrived(receiver, b"marker")
    # Nobody else is bound, so it came back instead.
    sender.wait_for_return(b"crosses a dot")


def test_hash_matches_zero_words(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.tier.#"])
    sender = inbox()
    sender.ep.publish(f"{ns}.tier", b"zero words")
    assert receiver.wait_for_body(b"zero words").topic == f"{ns}.tier"


def test_hash_matches_many_words(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.tier.#"])
    sender = inbox()
    for topic in (f"{ns}.tier.10", f"{ns}.tier.10.x", f"{ns}.tier.a.b.c.d"):
        sender.ep.publish(topic, topic.encode())
    received = receiver.wait_for_count(3)
    assert [d.topic for d in received] == [
        f"{ns}.tier.10",
        f"{ns}.tier.10.x",
        f"{ns}.tier.a.b.c.d",
    ]


def test_hash_between_words_matches_zero_or_more_in_between(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.a.#.z"])
    sender = inbox()
    sender.ep.publish(f"{ns}.a.z", b"none between")
    sender.ep.publish(f"{ns}.a.b.c.z", b"two between")
    sender.ep.publish(f"{ns}.a.b.c", b"wrong end")
    sender.ep.publish(f"{ns}.a.marker.z", b"marker")
    receiver.wait_for_body(b"marker")
    assert receiver.bodies == [b"none between", b"two between", b"marker"]


def test_wildcards_inside_a_word_are_literal(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.a*", f"{ns}.b#"])
    sender = inbox()
    sender.ep.publish(f"{ns}.ab", b"not a wildcard")
    sender.ep.publish(f"{ns}.bc", b"not a wildcard either")
    sender.ep.publish(f"{ns}.a*", b"literal star")
    sender.ep.publish(f"{ns}.b#", b"literal hash")
    receiver.wait_for_count(2)
    assert receiver.bodies == [b"literal star", b"literal hash"]


def test_publish_reaches_every_bound_endpoint_once(inbox: Inbox, ns: str) -> None:
    # Three of the first endpoint's patterns match; it still gets one copy (RabbitMQ).
    overlapping = inbox(bind=[f"{ns}.x.y", f"{ns}.x.*", f"{ns}.#"])
    other = inbox(bind=[f"{ns}.x.y"])
    sender = inbox()
    sender.ep.publish(f"{ns}.x.y", b"once")
    sender.ep.publish(f"{ns}.x.y", b"marker")
    for receiver in (overlapping, other):
        receiver.wait_for_body(b"marker")
        assert receiver.bodies == [b"once", b"marker"]


def test_binding_the_same_pattern_twice_is_one_binding(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.t", f"{ns}.t"])
    sender = inbox()
    sender.ep.publish(f"{ns}.t", b"once")
    sender.ep.publish(f"{ns}.t", b"marker")
    receiver.wait_for_body(b"marker")
    assert receiver.bodies == [b"once", b"marker"]


def test_publisher_bound_to_the_topic_hears_its_own_publish(inbox: Inbox, ns: str) -> None:
    node = inbox(bind=[f"{ns}.tier.#"])
    node.ep.publish(f"{ns}.tier.10", b"echo")
    assert not node.wait_for_body(b"echo").returned


def test_unroutable_publish_comes_back_to_sender(inbox: Inbox, ns: str) -> None:
    sender = inbox()
    sender.ep.publish(f"{ns}.tier.10", b"anyone?")
    returned = sender.wait_for_return(b"anyone?")
    assert returned.topic == f"{ns}.tier.10"
    assert returned.returned


def test_routable_publish_does_not_come_back(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.t"])
    sender = inbox()
    sender.ep.publish(f"{ns}.t", b"routed")
    receiver.wait_for_body(b"routed")
    # A return would reach the sender before its own later publish comes back to it.
    sender.ep.publish(f"{ns}.nobody", b"unroutable marker")
    sender.wait_for_return(b"unroutable marker")
    assert [d.body for d in sender.returned] == [b"unroutable marker"]


def test_unbind_stops_delivery(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.t", f"{ns}.marker"])
    sender = inbox()
    sender.ep.publish(f"{ns}.t", b"before")
    receiver.wait_for_body(b"before")
    receiver.ep.unbind(f"{ns}.t")
    sender.ep.publish(f"{ns}.t", b"after")
    sender.ep.publish(f"{ns}.marker", b"marker")
    receiver.wait_for_body(b"marker")
    assert receiver.bodies == [b"before", b"marker"]
    sender.wait_for_return(b"after")


def test_unbinding_a_pattern_never_bound_is_a_no_op(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.t"])
    receiver.ep.unbind(f"{ns}.never")
    inbox().ep.publish(f"{ns}.t", b"still bound")
    receiver.wait_for_body(b"still bound")


def test_fanout_to_many_subscribers(inbox: Inbox, ns: str) -> None:
    receivers = [inbox(bind=[f"{ns}.tier.#"]) for _ in range(50)]
    sender = inbox()
    messages = [f"m{i}".encode() for i in range(10)]
    for body in messages:
        sender.ep.publish(f"{ns}.tier.10", body)
    sender.ep.publish(f"{ns}.tier.10", b"marker")
    for receiver in receivers:
        receiver.wait_for_body(b"marker")
        assert receiver.bodies == [*messages, b"marker"]
    assert sender.returned == []


# -- direct addressing ------------------------------------------------------------------------


def test_send_reaches_the_named_address(inbox: Inbox, ns: str) -> None:
    receiver = inbox(name=f"{ns}-node-a")
    assert receiver.address == f"{ns}-node-a"
    inbox().ep.send(f"{ns}-node-a", b"direct")
    delivery = receiver.wait_for_body(b"direct")
    assert delivery.topic is None
    assert not delivery.returned


def test_send_reaches_an_unnamed_endpoint_by_its_address(inbox: Inbox) -> None:
    receiver = inbox()
    inbox().ep.send(receiver.address, b"reply")
    receiver.wait_for_body(b"reply")


def test_send_reaches_only_the_addressed_endpoint(inbox: Inbox, ns: str) -> None:
    target = inbox(name=f"{ns}-a")
    bystander = inbox(name=f"{ns}-b")
    sender = inbox()
    sender.ep.send(target.address, b"for a")
    sender.ep.send(bystander.address, b"marker")
    target.wait_for_body(b"for a")
    assert_only_marker_arrived(bystander, b"marker")


def test_send_to_unknown_address_comes_back(inbox: Inbox, ns: str) -> None:
    sender = inbox()
    sender.ep.send(f"{ns}-nobody-here", b"hello?")
    returned = sender.wait_for_return(b"hello?")
    assert returned.topic is None
    assert returned.returned


def test_send_to_a_closed_address_comes_back(inbox: Inbox, ns: str) -> None:
    gone = inbox(name=f"{ns}-gone")
    gone.ep.close()
    sender = inbox()
    sender.ep.send(f"{ns}-gone", b"too late")
    sender.wait_for_return(b"too late")
    assert gone.deliveries == []


# -- ordering ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["publish", "send"])
def test_messages_from_one_sender_arrive_in_order(inbox: Inbox, ns: str, path: str) -> None:
    receiver = inbox(name=f"{ns}-receiver", bind=[f"{ns}.seq"])
    sender = inbox()
    messages = [f"{i:04d}".encode() for i in range(500)]
    for body in messages:
        if path == "publish":
            sender.ep.publish(f"{ns}.seq", body)
        else:
            sender.ep.send(receiver.address, body)
    assert [d.body for d in receiver.wait_for_count(500)] == messages


def test_concurrent_senders_each_keep_their_order(inbox: Inbox, ns: str) -> None:
    receiver = inbox(bind=[f"{ns}.seq"])
    senders = [inbox() for _ in range(8)]
    per_sender = 100
    start = threading.Barrier(len(senders))

    def run(index: int, sender: Collector) -> None:
        start.wait(timeout=10)
        for i in range(per_sender):
            sender.ep.publish(f"{ns}.seq", f"{index}:{i}".encode())

    threads = [
        threading.Thread(target=run, args=(index, sender)) for index, sender in enumerate(senders)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    received = receiver.wait_for_count(len(senders) * per_sender)
    for index in range(len(senders)):
        sequence = [
            int(d.body.split(b":")[1]) for d in received if d.body.startswith(b"%d:" % index)
        ]
        assert sequence == list(range(per_sender))


def test_what_a_batch_sends_arrives_in_order_with_a_bind_among_it(inbox: Inbox, ns: str) -> None:
    receiver = inbox(name=f"{ns}-receiver", bind=[f"{ns}.seq"])
    sender = inbox()
    with sender.ep.batch():
        sender.ep.send(receiver.address, b"1")
        sender.ep.publish(f"{ns}.seq", b"2")
        with sender.ep.batch():  # blocks nest
            sender.ep.send(receiver.address, b"3")
        sender.ep.bind(f"{ns}.own")  # waits for the broker, within the batch
        sender.ep.publish(f"{ns}.seq", b"4")
    assert [d.body for d in receiver.wait_for_count(4)] == [b"1", b"2", b"3", b"4"]


def test_what_a_batch_sent_leaves_even_when_the_block_raises(inbox: Inbox, ns: str) -> None:
    receiver = inbox(name=f"{ns}-receiver")
    sender = inbox()

    def send_then_fail() -> None:
        with sender.ep.batch():
            sender.ep.send(receiver.address, b"sent before the error")
            raise RuntimeError("the caller's own")

    with pytest.raises(RuntimeError, match="the caller's own"):
        send_then_fail()
    receiver.wait_for_body(b"sent before the error")


# -- endpoints --------------------------------------------------------------------------------


def test_unnamed_endpoints_get_distinct_addresses(inbox: Inbox) -> None:
    addresses = {inbox().address for _ in range(20)}
    assert len(addresses) == 20


def test_second_live_endpoint_with_the_same_name_is_refused(
    broker: Broker, inbox: Inbox, new_collector: NewCollector, ns: str
) -> None:
    inbox(name=f"{ns}-node")
    with pytest.raises(BrokerError):
        broker.open_endpoint(new_collector(), name=f"{ns}-node")


def test_closed_endpoint_refuses_use(inbox: Inbox, ns: str) -> None:
    endpoint = inbox(name=f"{ns}-closing").ep
    endpoint.close()
    with pytest.raises(BrokerClosed):
        endpoint.bind(f"{ns}.t")
    with pytest.raises(BrokerClosed):
        endpoint.unbind(f"{ns}.t")
    with pytest.raises(BrokerClosed):
        endpoint.publish(f"{ns}.t", b"x")
    with pytest.raises(BrokerClosed):
        endpoint.send(f"{ns}-closing", b"x")
    endpoint.close()  # idempotent


def test_closing_an_endpoint_removes_its_bindings(inbox: Inbox, ns: str) -> None:
    closing = inbox(bind=[f"{ns}.t"])
    closing.ep.close()
    sender = inbox()
    sender.ep.publish(f"{ns}.t", b"nobody bound now")
    sender.wait_for_return(b"nobody bound now")
    assert closing.deliveries == []


def test_close_and_reopen_with_same_name(broker: Broker, inbox: Inbox, ns: str) -> None:
    first = inbox(name=f"{ns}-node")
    first.ep.close()
    second = inbox(name=f"{ns}-node")
    assert second.address == f"{ns}-node"
    inbox().ep.send(f"{ns}-node", b"to the new one")
    second.wait_for_body(b"to the new one")
    assert first.deliveries == []


def test_endpoint_is_a_context_manager(
    broker: Broker, new_collector: NewCollector, ns: str
) -> None:
    sender_collector = new_collector()
    with broker.open_endpoint(sender_collector) as sender:
        with broker.open_endpoint(new_collector(), name=f"{ns}-ctx") as endpoint:
            assert endpoint.address == f"{ns}-ctx"
        sender.send(f"{ns}-ctx", b"after exit")
        sender_collector.wait_for_return(b"after exit")
    with pytest.raises(BrokerClosed):
        sender.send(f"{ns}-ctx", b"x")


# -- handlers ---------------------------------------------------------------------------------

#: every handler test runs on the dispatcher thread and inline, on the IO thread
on_either_thread = pytest.mark.parametrize("inline", [False, True], ids=["dispatched", "inline"])


@on_either_thread
def test_handler_exception_does_not_stop_delivery(
    broker: Broker, inbox: Inbox, new_collector: NewCollector, ns: str, inline: bool
) -> None:
    seen = new_collector()

    def failing_first(delivery: Delivery) -> None:
        seen(delivery)
        if delivery.body == b"boom":
            raise RuntimeError("handler bug")

    failing = broker.open_endpoint(failing_first, inline=inline)
    try:
        failing.bind(f"{ns}.t")
        healthy = inbox(bind=[f"{ns}.t"])
        sender = inbox()
        sender.ep.publish(f"{ns}.t", b"boom")
        sender.ep.publish(f"{ns}.t", b"after")
        seen.wait_for_body(b"after")
        healthy.wait_for_body(b"after")
        assert seen.bodies == [b"boom", b"after"]
        assert healthy.bodies == [b"boom", b"after"]
        assert isinstance(broker, InProcessBroker | AmqpBroker)
        assert broker.stats.handler_errors == 1  # counted where it runs, either thread
    finally:
        failing.close()


@on_either_thread
def test_handler_can_reply_from_inside_the_handler(
    broker: Broker, inbox: Inbox, ns: str, inline: bool
) -> None:
    # A node answers a broadcast with a direct send from within its handler.
    node_ref: list[Endpoint] = []

    def answer(delivery: Delivery) -> None:
        requestor_address = delivery.body.decode()
        node_ref[0].send(requestor_address, b"offer")

    node = broker.open_endpoint(answer, name=f"{ns}-node", inline=inline)
    node_ref.append(node)
    try:
        node.bind(f"{ns}.tier.#")
        requestor = inbox()
        requestor.ep.publish(f"{ns}.tier.10", requestor.address.encode())
        requestor.wait_for_body(b"offer")
    finally:
        node.close()


@on_either_thread
def test_handler_can_close_its_own_endpoint(
    broker: Broker, inbox: Inbox, ns: str, inline: bool
) -> None:
    closed = threading.Event()
    holder: list[Endpoint] = []

    def close_self(delivery: Delivery) -> None:
        holder[0].close()
        closed.set()

    endpoint = broker.open_endpoint(close_self, name=f"{ns}-self-closing", inline=inline)
    holder.append(endpoint)
    sender = inbox()
    sender.ep.send(f"{ns}-self-closing", b"close yourself")
    assert closed.wait(10)
    with pytest.raises(BrokerClosed):
        endpoint.send(sender.address, b"from a closed endpoint")
    if not inline or not isinstance(broker, AmqpBroker):
        sender.ep.send(f"{ns}-self-closing", b"after close")
        sender.wait_for_return(b"after close")
        return
    # On the IO thread close() cannot wait for RabbitMQ to delete the queue; it is gone soon
    # after, and then what is sent to its address comes back.
    for attempt in range(100):
        body = f"after close {attempt}".encode()
        sender.ep.send(f"{ns}-self-closing", body)
        if sender.arrives(lambda ds, body=body: any(d.returned and d.body == body for d in ds)):
            return
    pytest.fail("nothing sent to the closed endpoint's address came back")


@on_either_thread
def test_what_a_handler_sends_keeps_its_order(
    broker: Broker, inbox: Inbox, ns: str, inline: bool
) -> None:
    # Each request is answered with three sends; 50 requests must come back as 150 answers
    # in the order they were asked and sent.
    holder: list[Endpoint] = []

    def answer_thrice(delivery: Delivery) -> None:
        for part in (b"a", b"b", b"c"):
            holder[0].send(f"{ns}-asker", delivery.body + part)

    answering = broker.open_endpoint(answer_thrice, name=f"{ns}-answering", inline=inline)
    holder.append(answering)
    try:
        asker = inbox(name=f"{ns}-asker")
        for number in range(50):
            asker.ep.send(f"{ns}-answering", str(number).encode())
        answers = asker.wait_for_count(150)
        assert [d.body for d in answers] == [
            str(n).encode() + part for n in range(50) for part in (b"a", b"b", b"c")
        ]
    finally:
        answering.close()


def test_a_handler_knows_whether_it_may_wait_for_the_broker(
    broker: Broker, inbox: Inbox, ns: str
) -> None:
    # An inline handler on a broker with an IO thread must not make a call that waits for
    # that thread: blocking_allowed() says so, and such a call raises rather than hang.
    # Elsewhere (the test's thread, any dispatched handler) waiting is allowed.
    seen: list[tuple[bool, bool, str | None]] = []
    done = threading.Event()
    holders: dict[bool, Endpoint] = {}

    def probe(inline: bool) -> Callable[[Delivery], None]:
        def handler(delivery: Delivery) -> None:
            endpoint = holders[inline]
            allowed = endpoint.blocking_allowed()
            refusal = None
            if not allowed:
                try:
                    endpoint.bind(f"{ns}.refused")
                except RuntimeError as error:
                    refusal = str(error)
                try:
                    broker.open_endpoint(lambda delivery: None)
                except RuntimeError as error:
                    refusal = f"{refusal}; {error}"
            seen.append((inline, allowed, refusal))
            if len(seen) == 2:
                done.set()

        return handler

    for inline in (False, True):
        holders[inline] = broker.open_endpoint(probe(inline), name=f"{ns}-{inline}", inline=inline)
    try:
        assert all(endpoint.blocking_allowed() for endpoint in holders.values())
        sender = inbox()
        for inline in (False, True):
            sender.ep.send(f"{ns}-{inline}", b"may you wait?")
        assert done.wait(10)
        by_kind = {inline: (allowed, refusal) for inline, allowed, refusal in seen}
        assert by_kind[False] == (True, None)
        allowed, refusal = by_kind[True]
        if isinstance(broker, AmqpBroker):
            assert not allowed
            assert refusal is not None and refusal.count("would hang") == 2
        else:  # no IO thread (the in-process broker): inline is moot
            assert (allowed, refusal) == (True, None)
    finally:
        for endpoint in holders.values():
            endpoint.close()


# -- bodies -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="empty"),
        pytest.param(bytes(range(256)), id="every-byte"),
        pytest.param(b"\x00" * 17, id="nul-bytes"),
        pytest.param("schön ☃ 中文".encode(), id="utf-8"),
        pytest.param(random.Random(7).randbytes(1 << 20), id="one-mib-random"),
    ],
)
def test_bodies_arrive_byte_for_byte(inbox: Inbox, ns: str, body: bytes) -> None:
    receiver = inbox(name=f"{ns}-bytes", bind=[f"{ns}.bytes"])
    sender = inbox()
    sender.ep.publish(f"{ns}.bytes", body)
    sender.ep.send(receiver.address, body)
    received = receiver.wait_for_count(2)
    assert len(received) == 2
    published = next(d for d in received if d.topic is not None)
    sent = next(d for d in received if d.topic is None)
    assert type(published.body) is bytes
    assert published.body == body
    assert sent.body == body


@pytest.mark.parametrize(
    "body",
    ["text", bytearray(b"mutable"), memoryview(b"view"), None, 42],
    ids=["str", "bytearray", "memoryview", "none", "int"],
)
def test_non_bytes_body_is_refused(inbox: Inbox, ns: str, body: object) -> None:
    sender = inbox()
    with pytest.raises(TypeError):
        sender.ep.publish(f"{ns}.t", body)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        sender.ep.send(sender.address, body)  # type: ignore[arg-type]


# -- the broker -------------------------------------------------------------------------------


def test_closed_broker_refuses_everything(
    broker: Broker, new_collector: NewCollector, ns: str
) -> None:
    endpoint = broker.open_endpoint(new_collector(), name=f"{ns}-before-close")
    broker.close()
    with pytest.raises(BrokerClosed):
        broker.open_endpoint(new_collector())
    with pytest.raises(BrokerClosed):
        endpoint.bind(f"{ns}.t")
    with pytest.raises(BrokerClosed):
        endpoint.publish(f"{ns}.t", b"x")
    with pytest.raises(BrokerClosed):
        endpoint.send(f"{ns}-before-close", b"x")
    endpoint.close()
    broker.close()  # idempotent


def test_broker_has_a_url(broker: Broker) -> None:
    assert isinstance(broker.url, str)
    assert broker.url
