"""The shipped RabbitMQ definitions (deploy/rabbitmq/definitions.json) enforce the roles.

The test imports the shipped file itself, only renamed: a vhost and two users of its own
(``reservoir-test-<hex>``, ``reservoir-requestor-<hex>``, ``reservoir-node-<hex>``), with
exactly the permissions, topic permissions, exchanges and password hashes of the file,
through ``rabbitmqctl import_definitions``. Users log in with the example passwords the
deploy README documents, which proves the hashes too. Then, with real connections:

- a node's credentials cannot publish a request, nor send an award to another node, nor
  use the default exchange, nor bind wildcards or other participants' addresses;
- a node may answer a requestor and bind its tiers and its own address;
- a requestor may publish on a tier and send to a node, and nothing else;
- a whole placement works with the pika and the kombu adapter when the node agent holds
  node credentials and the requestor holds requestor credentials (the adapters fall back to
  a passive declare of the exchanges they may not configure), and the node sees the
  requestor's user name as the validated ``user_id``;
- a send the broker refuses comes back to its sender as returned and the adapter carries
  on without reconnecting (a reconnect would replay it, be refused, and loop), for one
  endpoint or many at once; and restricted users reconnect after a forced close.

Refusals are observed with raw pika, where RabbitMQ's ``403 ACCESS_REFUSED`` is plain.
Skipped when ``rabbitmqctl`` cannot manage the RabbitMQ under test (failed under ``CI``).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pika
import pika.exceptions
import pytest

from reservoir import NodeAgent, Requestor, audit
from reservoir.broker import Broker, Delivery, Endpoint, Handler
from reservoir.brokers.kombu_broker import KombuBroker
from reservoir.brokers.pika_broker import PikaBroker
from reservoir.runtime.keeper import RosterKeeper
from reservoir.runtime.settings import Settings

pytestmark = pytest.mark.rabbitmq

DEFINITIONS = Path(__file__).parents[2] / "deploy" / "rabbitmq" / "definitions.json"
#: the example passwords deploy/rabbitmq/README.md documents (and tells operators to change)
EXAMPLE_PASSWORDS = {
    "reservoir-requestor": "requestor-example-change-me",
    "reservoir-node": "node-example-change-me",
    "reservoir-keeper": "keeper-example-change-me",
}
WAIT_S = 10.0


@dataclass(frozen=True)
class Roles:
    """The shipped definitions, imported under names of this test run's own."""

    host: str
    port: int
    vhost: str
    requestor: str
    node: str
    keeper: str
    passwords: dict[str, str]

    def url(self, user: str, scheme: str = "amqp") -> str:
        """``scheme``://``user``:...@host:port/``vhost`` (exchange ``reservoir``, the
        default, as the definitions name it)."""
        userinfo = f"{quote(user, safe='')}:{quote(self.passwords[user], safe='')}"
        return f"{scheme}://{userinfo}@{self.host}:{self.port}/{quote(self.vhost, safe='')}"

    def connect(self, user: str) -> pika.BlockingConnection:
        return pika.BlockingConnection(pika.URLParameters(self.url(user)))


def renamed_definitions(vhost: str, users: dict[str, str]) -> dict[str, Any]:
    """deploy/rabbitmq/definitions.json with its vhost and user names replaced, nothing else
    changed: exchanges keep their names (they live in the renamed vhost), permissions and
    topic permissions keep their patterns, users keep their password hashes."""
    definitions: dict[str, Any] = json.loads(DEFINITIONS.read_text())
    (shipped_vhost,) = (v["name"] for v in definitions["vhosts"])
    assert set(users) == {u["name"] for u in definitions["users"]}

    def rename(entry: dict[str, Any], key: str, mapping: dict[str, str]) -> None:
        if key in entry:
            assert entry[key] in mapping, f"{key} {entry[key]!r} not in the definitions"
            entry[key] = mapping[entry[key]]

    vhosts = {shipped_vhost: vhost}
    for section in (
        "vhosts",
        "users",
        "permissions",
        "topic_permissions",
        "exchanges",
        "queues",
        "bindings",
        "policies",
        "parameters",
    ):
        for entry in definitions.get(section, []):
            rename(entry, "vhost", vhosts)
            if section == "vhosts":
                rename(entry, "name", vhosts)
            elif section == "users":
                rename(entry, "name", users)
            else:
                rename(entry, "user", users)
    return definitions


def _wait_imported(rabbitmqctl: Callable[..., str], vhost: str, topic_permissions: int) -> None:
    """rabbitmqctl calls the import asynchronous: wait (each call takes a fraction of a
    second, which paces this) until the last section imported is there."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            rows = rabbitmqctl("list_topic_permissions", "-p", vhost, "--no-table-headers")
        except RuntimeError:
            continue  # the vhost is not there yet
        if len([row for row in rows.splitlines() if row.strip()]) >= topic_permissions:
            return
    pytest.fail(f"the definitions for vhost {vhost!r} were not imported within 30 s")


@pytest.fixture(scope="module")
def roles(
    reservoir_amqp_broker_url: str,
    rabbitmqctl: Callable[..., str],
) -> Iterator[Roles]:
    run_id = uuid.uuid4().hex[:12]
    vhost = f"reservoir-test-{run_id}"
    users = {
        "reservoir-requestor": f"reservoir-requestor-{run_id}",
        "reservoir-node": f"reservoir-node-{run_id}",
        "reservoir-keeper": f"reservoir-keeper-{run_id}",
    }
    parts = urlsplit(reservoir_amqp_broker_url)
    try:
        definitions = renamed_definitions(vhost, users)
        # On stdin (no file argument): rabbitmqctl may run as the rabbitmq user, who could
        # not read our temporary files.
        rabbitmqctl("import_definitions", stdin=json.dumps(definitions))
        _wait_imported(rabbitmqctl, vhost, len(definitions["topic_permissions"]))
        yield Roles(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 5672,
            vhost=vhost,
            requestor=users["reservoir-requestor"],
            node=users["reservoir-node"],
            keeper=users["reservoir-keeper"],
            passwords={users[name]: password for name, password in EXAMPLE_PASSWORDS.items()},
        )
    finally:
        for user in users.values():
            try:
                rabbitmqctl("delete_user", user)
            except RuntimeError as error:
                print(f"cleanup: {error}")
        try:
            rabbitmqctl("delete_vhost", vhost)
        except RuntimeError as error:
            print(f"cleanup: {error}")


@pytest.fixture
def as_node(roles: Roles) -> Iterator[pika.BlockingConnection]:
    with roles.connect(roles.node) as connection:
        yield connection


@pytest.fixture
def as_requestor(roles: Roles) -> Iterator[pika.BlockingConnection]:
    with roles.connect(roles.requestor) as connection:
        yield connection


def refused(connection: pika.BlockingConnection, act: Callable[[Any], object]) -> str:
    """Run ``act(channel)`` on a new confirm-mode channel; assert RabbitMQ closed the
    channel with 403 ACCESS_REFUSED; return its reply text."""
    channel = connection.channel()
    channel.confirm_delivery()

    def act_and_round_trip() -> None:
        act(channel)
        # Publishes wait for their confirm; a queue.declare makes a bind or a declare
        # surface a close in flight as well.
        channel.queue_declare("", passive=True)

    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
        act_and_round_trip()
    assert closed.value.reply_code == 403, closed.value
    assert "ACCESS_REFUSED" in closed.value.reply_text
    return str(closed.value.reply_text)


def allowed(connection: pika.BlockingConnection, act: Callable[[Any], object]) -> Any:
    """Run ``act(channel)`` on a new confirm-mode channel; it must not be refused."""
    channel = connection.channel()
    channel.confirm_delivery()
    act(channel)
    return channel


# -- the file itself ------------------------------------------------------------------------


def test_definitions_declare_what_the_adapters_expect() -> None:
    definitions = json.loads(DEFINITIONS.read_text())
    exchanges = {(e["vhost"], e["name"]): e for e in definitions["exchanges"]}
    assert set(exchanges) == {("reservoir", "reservoir"), ("reservoir", "reservoir.inbox")}
    for exchange in exchanges.values():
        assert (exchange["type"], exchange["durable"], exchange["auto_delete"]) == (
            "topic",
            True,
            False,
        )
    assert {u["name"] for u in definitions["users"]} == set(EXAMPLE_PASSWORDS)
    for user in definitions["users"]:
        assert user["hashing_algorithm"] == "rabbit_password_hashing_sha256"
        assert user["tags"] == []  # no management or administrator rights


# -- (a), (b): what a node's credentials cannot do -------------------------------------------


def test_node_cannot_publish_a_request(as_node: pika.BlockingConnection) -> None:
    reason = refused(as_node, lambda ch: ch.basic_publish("reservoir", "tier.10", b"request"))
    assert "topic 'tier.10'" in reason
    # Nor a lookup: on the request exchange a node may only announce itself (roster).
    reason = refused(as_node, lambda ch: ch.basic_publish("reservoir", "lookup.00ff", b"lookup"))
    assert "topic 'lookup.00ff'" in reason


def test_node_cannot_send_an_award_to_another_node(as_node: pika.BlockingConnection) -> None:
    reason = refused(
        as_node,
        lambda ch: ch.basic_publish("reservoir.inbox", "reservoir.node.other", b"award"),
    )
    assert "topic 'reservoir.node.other'" in reason
    # Nor through the default exchange, the way sends went before the inbox exchange.
    reason = refused(as_node, lambda ch: ch.basic_publish("", "reservoir.node.other", b"award"))
    assert "amq.default" in reason


def test_node_cannot_listen_in_on_what_is_not_its_own(
    as_node: pika.BlockingConnection, roles: Roles
) -> None:
    name = f"reservoir.node.{uuid.uuid4().hex[:8]}"

    def bind(exchange: str, key: str) -> Callable[[Any], object]:
        def act(channel: Any) -> None:
            channel.queue_declare(name, exclusive=True)
            channel.queue_bind(name, exchange, routing_key=key)

        return act

    refused(as_node, bind("reservoir", "tier.#"))  # every request, whatever its tier
    refused(as_node, bind("reservoir", "lookup.#"))  # every lookup, whatever its bucket
    refused(as_node, bind("reservoir", "roster"))  # other nodes' announcements
    refused(as_node, bind("reservoir.inbox", "reservoir.requestor.x"))  # a requestor's mail
    refused(as_node, bind("reservoir.inbox", "#"))
    # A queue outside its namespace.
    refused(as_node, lambda ch: ch.queue_declare("reservoir.requestor.x", exclusive=True))


# -- (c): what a node may do ----------------------------------------------------------------


def test_node_may_answer_a_requestor_announce_itself_and_bind_its_tiers_and_buckets(
    as_node: pika.BlockingConnection,
) -> None:
    channel = allowed(
        as_node, lambda ch: ch.basic_publish("reservoir.inbox", "reservoir.requestor.x", b"offer")
    )
    channel.basic_publish("reservoir", "roster", b"status")
    name = f"reservoir.node.{uuid.uuid4().hex[:8]}"
    channel.queue_declare(name, exclusive=True)
    channel.queue_bind(name, "reservoir.inbox", routing_key=name)
    for percent in (10, 25, 50, 75, 100):
        channel.queue_bind(name, "reservoir", routing_key=f"tier.{percent}")
    channel.queue_unbind(name, "reservoir", routing_key="tier.10")
    channel.queue_bind(name, "reservoir", routing_key="lookup.0a1b")
    channel.basic_consume(name, lambda *_: None, auto_ack=True)
    # Passive declares need no permission: how an adapter checks the exchanges exist.
    channel.exchange_declare("reservoir", passive=True)
    channel.exchange_declare("reservoir.inbox", passive=True)
    channel.queue_delete(name)


# -- (d): what a requestor may, and may not, do ---------------------------------------------


def test_requestor_may_publish_requests_and_lookups_hear_the_roster_and_send_to_nodes(
    as_requestor: pika.BlockingConnection,
) -> None:
    channel = allowed(as_requestor, lambda ch: ch.basic_publish("reservoir", "tier.10", b"request"))
    channel.basic_publish("reservoir", "lookup.0a1b", b"lookup")
    channel.basic_publish("reservoir", "keeper", b"a roster query")
    channel.basic_publish("reservoir.inbox", "reservoir.node.x", b"award")
    name = f"reservoir.requestor.{uuid.uuid4().hex[:8]}"
    channel.queue_declare(name, exclusive=True)
    channel.queue_bind(name, "reservoir.inbox", routing_key=name)
    channel.queue_bind(name, "reservoir", routing_key="roster")
    channel.queue_bind(name, "reservoir", routing_key="rejoined")
    channel.basic_consume(name, lambda *_: None, auto_ack=True)


def test_requestor_may_do_nothing_else(as_requestor: pika.BlockingConnection) -> None:
    refused(as_requestor, lambda ch: ch.basic_publish("reservoir", "award.x", b"not a tier"))
    refused(as_requestor, lambda ch: ch.basic_publish("reservoir", "roster", b"a fake node"))
    refused(
        as_requestor,
        lambda ch: ch.basic_publish("reservoir.inbox", "reservoir.requestor.y", b"to a peer"),
    )
    refused(as_requestor, lambda ch: ch.basic_publish("", "reservoir.node.x", b"default"))
    name = f"reservoir.requestor.{uuid.uuid4().hex[:8]}"

    def bind_tier(channel: Any) -> None:
        channel.queue_declare(name, exclusive=True)
        channel.queue_bind(name, "reservoir", routing_key="tier.10")

    refused(as_requestor, bind_tier)  # no listening to other requestors' requests

    def bind_keeper_topic(channel: Any) -> None:
        channel.queue_declare(name, exclusive=True)
        channel.queue_bind(name, "reservoir", routing_key="keeper")

    refused(as_requestor, bind_keeper_topic)  # no answering for a keeper
    refused(as_requestor, lambda ch: ch.queue_declare("reservoir.node.x", exclusive=True))
    refused(as_requestor, lambda ch: ch.exchange_delete("reservoir"))


# -- (e), (f): a whole placement with per-role credentials ----------------------------------


class Recording(Broker):
    """A broker that hands every delivery, with the name of the endpoint it reached, to a
    recorder before the real handler."""

    def __init__(self, inner: Broker, record: Callable[[str | None, Delivery], None]) -> None:
        self.inner = inner
        self.url = inner.url
        self._record = record

    def open_endpoint(
        self, handler: Handler, *, name: str | None = None, inline: bool = False
    ) -> Endpoint:
        def recorded(delivery: Delivery) -> None:
            self._record(name, delivery)
            handler(delivery)

        return self.inner.open_endpoint(recorded, name=name, inline=inline)

    def close(self) -> None:
        self.inner.close()


ADAPTERS: dict[str, Callable[[str], Broker]] = {
    "pika": lambda url: PikaBroker(url, connect_attempts=1),
    "kombu": lambda url: KombuBroker(f"kombu+{url}", connect_attempts=1),
}


@pytest.mark.parametrize(
    ("node_adapter", "requestor_adapter"),
    [("pika", "pika"), ("kombu", "kombu"), ("pika", "kombu"), ("kombu", "pika")],
)
def test_a_placement_with_per_role_credentials(
    roles: Roles, node_adapter: str, requestor_adapter: str
) -> None:
    seen: list[tuple[str | None, Delivery]] = []
    lock = threading.Lock()

    def record(name: str | None, delivery: Delivery) -> None:
        with lock:
            seen.append((name, delivery))

    # The receivers check the validated user_id as well (defence in depth).
    settings = Settings(
        requestor_users=frozenset({roles.requestor}), node_users=frozenset({roles.node})
    )
    node_broker = Recording(ADAPTERS[node_adapter](roles.url(roles.node)), record)
    requestor_broker = ADAPTERS[requestor_adapter](roles.url(roles.requestor))
    name = f"roles-{uuid.uuid4().hex[:8]}"
    try:
        node = NodeAgent(node_broker, name=name, vcpus=4, memory_mb=4096, settings=settings)
        try:
            with Requestor(requestor_broker, settings=settings) as requestor:
                assert requestor.address.startswith("reservoir.requestor.")
                placement = requestor.reserve(vcpus=1, timeout_s=WAIT_S)
                assert placement.nodes == (name,)
                audit([node.snapshot()], [placement]).raise_if_failed(allow_orphans=False)
                requestor.release(placement)
            audit([node.snapshot()]).raise_if_failed(allow_orphans=False)
        finally:
            node.close()
    finally:
        requestor_broker.close()
        node_broker.close()

    with lock:
        received = [(address, d) for address, d in seen if not d.returned]
    assert received, "the node received nothing"
    # (f) everything the node heard came from the requestor's user, validated by RabbitMQ:
    # the request on a tier topic, then the award and the free by its address.
    assert {d.user_id for _, d in received} == {roles.requestor}
    assert {address for address, _ in received} == {f"reservoir.node.{name}"}
    assert any(d.topic is not None and d.topic.startswith("tier.") for _, d in received)
    assert any(d.topic is None for _, d in received)


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_placement_through_a_keeper_with_per_role_credentials(roles: Roles) -> None:
    # The keeper's user is listed with the requestors' (it speaks the requestor role).
    # Default settings otherwise: a requestor takes samples while a keeper answers.
    settings = Settings(
        requestor_users=frozenset({roles.requestor, roles.keeper}),
        node_users=frozenset({roles.node}),
    )
    node_broker = PikaBroker(roles.url(roles.node), connect_attempts=1)
    keeper_broker = PikaBroker(roles.url(roles.keeper), connect_attempts=1)
    requestor_broker = PikaBroker(roles.url(roles.requestor), connect_attempts=1)
    name = f"roles-{uuid.uuid4().hex[:8]}"
    try:
        node = NodeAgent(node_broker, name=name, vcpus=4, memory_mb=4096, settings=settings)
        try:
            with Requestor(requestor_broker, settings=settings) as requestor:
                # no keeper yet: it follows the announcements (binds roster, roll-calls)
                wait_for(lambda: requestor.machine.roster_source.state == "announcements")
                with RosterKeeper(keeper_broker, settings=settings) as keeper:
                    wait_for(lambda: keeper.nodes_known() == 1)
                    # the keeper's user may say it is up on roster, the requestor's may
                    # unbind it: back on keepers
                    wait_for(lambda: requestor.machine.roster_source.state == "keepers")
                    assert requestor.metrics.get("received", "keeper_up") == 1
                    assert keeper.metrics.get("returned", "keeper_up") == 0
                    assert requestor.metrics.get("dropped", "untrusted_sender") == 0
                    placement = requestor.reserve(vcpus=1, timeout_s=WAIT_S)
                    assert placement.nodes == (name,)
                    assert requestor.metrics.get("received", "roster_sample") >= 1
                    audit([node.snapshot()], [placement]).raise_if_failed(allow_orphans=False)
                    requestor.release(placement)
            audit([node.snapshot()]).raise_if_failed(allow_orphans=False)
        finally:
            node.close()
    finally:
        requestor_broker.close()
        keeper_broker.close()
        node_broker.close()


class Inbox:
    """A handler that records deliveries and lets the test wait for them."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self.deliveries: list[Delivery] = []

    def __call__(self, delivery: Delivery) -> None:
        with self._condition:
            self.deliveries.append(delivery)
            self._condition.notify_all()

    def wait_for(self, body: bytes, *, returned: bool = False) -> Delivery:
        def found() -> list[Delivery]:
            return [d for d in self.deliveries if d.body == body and d.returned == returned]

        with self._condition:
            if not self._condition.wait_for(found, WAIT_S):
                pytest.fail(f"timed out waiting for {body!r}; got {self.deliveries[-5:]}")
            return found()[0]


@pytest.fixture(params=sorted(ADAPTERS))
def brokers_by_role(
    request: pytest.FixtureRequest, roles: Roles
) -> Iterator[tuple[Broker, Broker]]:
    """A broker with node credentials and one with requestor credentials, through the
    adapter the parameter names; both closed after the test."""
    open_broker = ADAPTERS[request.param]
    node_broker = open_broker(roles.url(roles.node))
    requestor_broker = open_broker(roles.url(roles.requestor))
    try:
        yield node_broker, requestor_broker
    finally:
        requestor_broker.close()
        node_broker.close()


def test_a_refused_send_comes_back_and_the_adapter_carries_on(
    roles: Roles, brokers_by_role: tuple[Broker, Broker]
) -> None:
    """A send the node's permissions forbid (a reply_to outside reservoir.requestor.*, say)
    closes the channel it went out on. It must come back to its sender as returned and cost
    nothing else: no reconnect, so it is not published again and again after each one."""
    node_broker, requestor_broker = brokers_by_role
    run = uuid.uuid4().hex[:8]
    at_node, at_requestor = Inbox(), Inbox()
    node = node_broker.open_endpoint(at_node, name=f"reservoir.node.{run}")
    node.bind("tier.10")
    requestor = requestor_broker.open_endpoint(at_requestor, name=f"reservoir.requestor.{run}")

    node.send(requestor.address, b"before")
    node.send("reservoir.node.other", b"forged award")
    node.send(requestor.address, b"after")
    refused = at_node.wait_for(b"forged award", returned=True)
    assert refused.topic is None
    assert refused.user_id == roles.node
    at_requestor.wait_for(b"before")
    at_requestor.wait_for(b"after")
    # The node still hears its tier and its address, and still answers.
    requestor.publish("tier.10", b"request")
    requestor.send(node.address, b"award")
    at_node.wait_for(b"request")
    at_node.wait_for(b"award")
    node.send(requestor.address, b"accepted")
    at_requestor.wait_for(b"accepted")
    assert [d.body for d in at_requestor.deliveries] == [b"before", b"after", b"accepted"]
    assert [d.body for d in at_node.deliveries if d.returned] == [b"forged award"]
    if isinstance(node_broker, PikaBroker):
        stats = node_broker.stats
        assert (stats.refused, stats.reconnects) == (1, 0)
    else:
        assert isinstance(node_broker, KombuBroker)
        assert node_broker.connections == 1


def test_restricted_users_reconnect(
    brokers_by_role: tuple[Broker, Broker], close_connection: Callable[[str], None]
) -> None:
    """After a forced close, a user without configure permission on the exchanges
    reconnects (declaring them passively again) and restores its queue and bindings."""
    node_broker, requestor_broker = brokers_by_role
    run = uuid.uuid4().hex[:8]
    at_node, at_requestor = Inbox(), Inbox()
    node = node_broker.open_endpoint(at_node, name=f"reservoir.node.{run}")
    node.bind("tier.25")
    requestor = requestor_broker.open_endpoint(at_requestor, name=f"reservoir.requestor.{run}")

    close_connection(getattr(node_broker, "connection_name", ""))
    if isinstance(node_broker, PikaBroker):
        assert node_broker.wait_connected(WAIT_S, min_reconnects=1)
    else:
        assert isinstance(node_broker, KombuBroker)
        assert node_broker.wait_for_connections(2, WAIT_S)

    requestor.publish("tier.25", b"request after")
    requestor.send(node.address, b"award after")
    at_node.wait_for(b"request after")
    at_node.wait_for(b"award after")
    node.send(requestor.address, b"accepted after")
    at_requestor.wait_for(b"accepted after")


def test_refusals_for_many_endpoints_at_once(brokers_by_role: tuple[Broker, Broker]) -> None:
    """Many node endpoints on one broker (as in the demo) refused at the same moment: each
    gets its own message back, the allowed ones all arrive, and nothing loops."""
    node_broker, requestor_broker = brokers_by_role
    run = uuid.uuid4().hex[:8]
    at_requestor = Inbox()
    requestor = requestor_broker.open_endpoint(at_requestor, name=f"reservoir.requestor.{run}")
    nodes = []
    for i in range(10):
        inbox = Inbox()
        nodes.append((inbox, node_broker.open_endpoint(inbox, name=f"reservoir.node.{run}-{i}")))
    for i, (_, node) in enumerate(nodes):
        node.send(f"reservoir.node.victim-{i}", b"forged %d" % i)
        node.send(requestor.address, b"fine %d" % i)
    for i, (inbox, _) in enumerate(nodes):
        assert inbox.wait_for(b"forged %d" % i, returned=True).topic is None
        at_requestor.wait_for(b"fine %d" % i)
    # Still working, on the same connection or (kombu, when a refusal surfaced in the
    # middle of repairing another endpoint) on one more.
    requestor.send(nodes[0][1].address, b"still there")
    nodes[0][0].wait_for(b"still there")
    if isinstance(node_broker, PikaBroker):
        assert node_broker.stats.reconnects == 0
        assert node_broker.stats.refused == 10
    else:
        assert isinstance(node_broker, KombuBroker)
        assert node_broker.connections <= 2
    assert sorted(d.body for d in at_requestor.deliveries) == sorted(
        b"fine %d" % i for i in range(10)
    )
