"""Per-role signing on a real RabbitMQ: with correct keys placement works through both
adapters (HMAC and Ed25519 keys); an award forged with a node's key and an offer sniffed
off the broker and replayed are each dropped and counted in the receiver's metrics; with
keys per node, a node's offer and acceptance in another node's name are dropped as
impersonation and the placement is real."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pytest

from reservoir import NodeAgent, Requestor, audit
from reservoir.broker import Broker, Delivery
from reservoir.brokers import connect
from reservoir.clock import SystemClock
from reservoir.protocol.messages import (
    Accepted,
    AllocationInfo,
    Award,
    Message,
    Offer,
    ReservationRequest,
)
from reservoir.runtime.keys import Keyring, generate, parse_keys
from reservoir.runtime.keys.nodes import add_node_key, load_node_key, write_node_key
from reservoir.runtime.settings import Settings
from reservoir.runtime.wire import Codec

pytestmark = pytest.mark.rabbitmq

NODE_KEYS = "n1:node-secret-0123456789abcdef"
REQUESTOR_KEYS = "r1:requestor-secret-0123456789abcdef"
PER_ROLE = Settings(node_keys=NODE_KEYS, requestor_keys=REQUESTOR_KEYS)


@pytest.fixture(params=["pika", "kombu"])
def any_broker(request: pytest.FixtureRequest, reservoir_amqp_url: str) -> Iterator[Broker]:
    url = reservoir_amqp_url
    with connect(url if request.param == "pika" else "kombu+" + url) as opened:
        yield opened


@pytest.fixture
def broker(reservoir_amqp_url: str) -> Iterator[Broker]:
    with connect(reservoir_amqp_url) as opened:
        yield opened


def wait_for(condition: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("not within the deadline")
        time.sleep(0.02)


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_placement_works_with_per_role_hmac_keys(any_broker: Broker) -> None:
    node = NodeAgent(any_broker, name=name("hmac"), vcpus=8, settings=PER_ROLE)
    try:
        with Requestor(any_broker, settings=PER_ROLE) as requestor:
            placement = requestor.reserve(vcpus=2, timeout_s=15)
            assert placement.nodes == (node.name,)
            assert requestor.metrics.total("dropped") == 0
        audit([node.snapshot()], [placement]).raise_if_failed(allow_orphans=False)
        assert node.metrics.total("dropped") == 0
    finally:
        node.close()


def test_placement_works_with_ed25519_keys_where_nodes_hold_no_requestor_private_key(
    broker: Broker,
) -> None:
    pytest.importorskip("cryptography")
    node_private, node_public = generate("node-1", ed25519=True)
    requestor_private, requestor_public = generate("requestor-1", ed25519=True)
    on_nodes = Settings(node_keys=node_private, requestor_keys=requestor_public)
    on_requestors = Settings(node_keys=node_public, requestor_keys=requestor_private)
    node = NodeAgent(broker, name=name("ed"), vcpus=8, settings=on_nodes)
    try:
        with Requestor(broker, settings=on_requestors) as requestor:
            placement = requestor.reserve(vcpus=2, timeout_s=15)
            assert placement.nodes == (node.name,)
        audit([node.snapshot()], [placement]).raise_if_failed(allow_orphans=False)
    finally:
        node.close()


def test_an_award_forged_with_a_node_key_is_dropped_and_counted_by_the_node(
    broker: Broker,
) -> None:
    node = NodeAgent(broker, name=name("target"), vcpus=8, settings=PER_ROLE)
    node_keys = parse_keys(NODE_KEYS, setting="test")
    # the forger holds a node key and passes it off as a requestor's
    forger = Codec(keys=Keyring(node=node_keys, requestor=node_keys))
    genuine = PER_ROLE.codec()
    clock = SystemClock()
    heard: list[Message] = []

    def hear(delivery: Delivery) -> None:
        heard.append(genuine.decode(delivery.body, clock.wall(), destination=probe.address))

    probe = broker.open_endpoint(hear, name=name("reservoir.probe"))
    try:
        # a genuine request, so that the node holds a reservation an award could claim
        request = ReservationRequest(
            request_id=name("forge"),
            sender=probe.address,
            reply_to=probe.address,
            resources={"VCPU": 2},
            tier=10,
            attempt=1,
            ttl_s=10.0,
            probed_node=node.name,
        )
        probe.send(node.address, genuine.encode(request, clock.wall(), destination=node.address))
        wait_for(lambda: any(isinstance(m, Offer) for m in heard))
        offer = next(m for m in heard if isinstance(m, Offer))
        award = Award(
            request_id=request.request_id,
            sender=probe.address,
            reply_to=probe.address,
            reservation_id=offer.reservation_id,
            slots=1,
        )
        probe.send(node.address, forger.encode(award, clock.wall(), destination=node.address))
        wait_for(lambda: node.metrics.snapshot().get("dropped:wrong_role", 0) == 1)
        assert node.allocations() == []
        # the same award with the requestors' key is taken: only the key was wrong
        probe.send(node.address, genuine.encode(award, clock.wall(), destination=node.address))
        wait_for(lambda: len(node.allocations()) == 1)
        assert node.metrics.snapshot()["dropped:wrong_role"] == 1
    finally:
        probe.close()
        node.close()


def test_an_offer_sniffed_off_the_broker_and_replayed_is_dropped_and_counted_by_the_requestor(
    broker: Broker, reservoir_amqp_broker_url: str
) -> None:
    node = NodeAgent(broker, name=name("replayed"), vcpus=8, settings=PER_ROLE)
    requestor = Requestor(broker, settings=PER_ROLE)
    inbox_exchange: str = broker.inbox_exchange  # type: ignore[attr-defined]
    # someone hostile on the broker binds a queue of its own to the requestor's inbox
    sniffer = pika.BlockingConnection(pika.URLParameters(reservoir_amqp_broker_url))
    try:
        channel = sniffer.channel()
        tap = channel.queue_declare("", exclusive=True).method.queue
        channel.queue_bind(tap, inbox_exchange, routing_key=requestor.address)
        placement = requestor.reserve(vcpus=2, timeout_s=15)
        assert placement.nodes == (node.name,)
        offers: list[bytes] = []
        deadline = time.monotonic() + 10
        while not offers and time.monotonic() < deadline:
            _, _, body = channel.basic_get(tap, auto_ack=True)
            if body is not None and b'"kind":"offer"' in body:
                offers.append(body)
        assert offers, "the sniffer saw no offer"
        received_before = requestor.metrics.snapshot().get("received:offer", 0)
        channel.basic_publish(inbox_exchange, requestor.address, offers[0])
        wait_for(lambda: requestor.metrics.snapshot().get("dropped:replayed", 0) == 1)
        assert requestor.metrics.snapshot().get("received:offer", 0) == received_before
    finally:
        sniffer.close()
        requestor.close()
        node.close()


def test_a_node_forging_another_nodes_offer_and_accepted_is_dropped_and_the_placement_is_real(
    broker: Broker, tmp_path: Path
) -> None:
    pytest.importorskip("cryptography")
    requestor_private, requestor_public = generate("requestor-1", ed25519=True)
    keyring = tmp_path / "keyring"
    suffix = uuid.uuid4().hex[:6]
    names = {role: f"{role}-{suffix}" for role in ("victim", "mallory", "honest")}
    key_files: dict[str, Path] = {}
    for role, name in names.items():
        signing, verifying = generate(f"{role}-1", ed25519=True)
        add_node_key(keyring, name, verifying)
        key_files[role] = tmp_path / f"{role}.key"
        write_node_key(key_files[role], signing, replace=False)

    def node(role: str, vcpus: int) -> NodeAgent:
        settings = Settings(node_key=key_files[role], requestor_keys=requestor_public)
        return NodeAgent(broker, name=names[role], vcpus=vcpus, settings=settings)

    # the victim cannot take the request: believed, the forgery would place it there
    nodes = [node("victim", 1), node("mallory", 8), node("honest", 8)]
    forger = Codec(
        keys=Keyring(
            node=(load_node_key(key_files["mallory"]),),
            requestor=parse_keys(requestor_public, setting="test"),
        ),
        role="node",
    )
    peer = broker.open_endpoint(lambda delivery: None, name=f"reservoir.peer-{suffix}")
    clock = SystemClock()
    victim = names["victim"]
    try:
        with Requestor(
            broker, settings=Settings(node_keyring=keyring, requestor_keys=requestor_private)
        ) as requestor:
            request_id = f"forged-{suffix}"
            future = requestor.submit(request_id=request_id, vcpus=2, timeout_s=15)
            offer = Offer(
                request_id=request_id,
                sender=victim,
                reply_to=f"reservoir.node.{victim}",
                reservation_id="forged-1",
                attempt=1,
                slots=1,
                utilisation=0.0,
                ttl_s=5.0,
            )
            accepted = Accepted(
                request_id=request_id,
                sender=victim,
                reply_to=f"reservoir.node.{victim}",
                reservation_id="forged-1",
                allocations=(AllocationInfo(allocation_id="forged-a1", resources={"VCPU": 2}),),
            )
            for forged in (offer, accepted):
                body = forger.encode(forged, clock.wall(), destination=requestor.address)
                peer.send(requestor.address, body)
            placement = future.result(timeout=20)
            wait_for(lambda: requestor.metrics.get("dropped", "impersonation") == 2)
            assert victim not in placement.nodes
        audit([n.snapshot() for n in nodes], [placement]).raise_if_failed(allow_orphans=False)
        assert nodes[0].allocations() == []
    finally:
        peer.close()
        for n in nodes:
            n.close()
