"""The sans-I/O AMQP session, driven by hand on a fake clock: no broker, no threads, no sleep.

A test plays the client library: it feeds the session events (connected, channel opened,
replies, confirms, a channel closed with a reply code, the connection lost, time passing)
and reads the actions the session returns. ``Link`` answers the routine ones (channels open,
control methods succeed) so that each test spells out only what it is about.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from reservoir.broker import BrokerClosed, BrokerError
from reservoir.brokers.amqp.session import (
    TRANSITIONS,
    Action,
    BindQueue,
    ClaimedElsewhere,
    CloseConnection,
    Connect,
    Consume,
    DeclareExchange,
    DeclareQueue,
    DeleteQueue,
    Deliver,
    Message,
    OpenChannel,
    Publish,
    Resolve,
    Session,
    SetTimer,
    State,
    Stop,
    UnbindQueue,
    claim_queue,
)

EXCHANGE = "reservoir"
INBOX = "reservoir.inbox"
REFUSED_SEND = (
    "ACCESS_REFUSED - write access to topic 'reservoir.node.other' in exchange "
    "'reservoir.inbox' in vhost 'v' refused for user 'node'"
)


class Link:
    """A fake connection: the session, a clock, and the actions seen so far."""

    def __init__(self, **options: float) -> None:
        settings: dict[str, float] = {
            "max_pending": 100,
            "timeout_s": 10.0,
            "close_timeout_s": 5.0,
            "connect_attempts": 3,
            "reconnect_initial_s": 0.1,
            "reconnect_max_s": 10.0,
        }
        settings.update(options)
        self.now_s = 1000.0
        self.session: Session[str] = Session(
            exchange=EXCHANGE,
            inbox_exchange=INBOX,
            max_pending=int(settings["max_pending"]),
            timeout_s=settings["timeout_s"],
            close_timeout_s=settings["close_timeout_s"],
            connect_attempts=int(settings["connect_attempts"]),
            reconnect_initial_s=settings["reconnect_initial_s"],
            reconnect_max_s=settings["reconnect_max_s"],
            jitter=lambda: 0.5,
        )
        self.gen = 0
        self.log: list[Action[str]] = []

    # -- what the session decided -------------------------------------------------------

    def actions(self) -> list[Action[str]]:
        taken = self.session.take_actions()
        self.log.extend(taken)
        for action in taken:
            if isinstance(action, Connect):
                self.gen = action.gen
        return taken

    def of(self, kind: type) -> list[Action[str]]:
        return [a for a in self.actions() if isinstance(a, kind)]

    def resolved(self) -> dict[str, BrokerError | None]:
        return {a.waiter: a.error for a in self.log if isinstance(a, Resolve)}

    # -- playing the client library -------------------------------------------------------

    def connect(self) -> None:
        """Start (or let the backoff pass) and answer every routine step until ready."""
        if self.session.state is State.IDLE:
            self.session.start(self.now_s)
        self.actions()
        self.session.connected(self.gen, self.now_s, "guest")
        self.settle()
        assert self.session.state is State.READY

    def settle(self, refuse: Callable[[Action[str]], tuple[int, str] | None] = lambda a: None):
        """Answer what the session asks for: channels open, control methods succeed (or,
        where ``refuse`` says so, the control channel closes with that reply code)."""
        for _ in range(1000):
            pending = [a for a in self.actions() if not isinstance(a, Publish | SetTimer)]
            answerable = [
                a
                for a in pending
                if isinstance(
                    a,
                    OpenChannel
                    | DeclareExchange
                    | DeclareQueue
                    | BindQueue
                    | UnbindQueue
                    | DeleteQueue
                    | Consume,
                )
            ]
            if not answerable:
                return
            for action in answerable:
                if isinstance(action, OpenChannel):
                    self.session.channel_opened(self.gen, action.role)
                elif (code := refuse(action)) is not None:
                    self.session.channel_closed(self.gen, "control", *code)
                else:
                    self.session.replied(self.gen)
        raise AssertionError("the session never settled")

    def publish(self, token: str, key: str, body: bytes, *, send: bool = False) -> None:
        self.session.accept(Message(token, INBOX if send else EXCHANGE, key, body))

    def published(self) -> list[Publish]:
        return [a for a in self.actions() if isinstance(a, Publish)]


def ready_link(**options: float) -> Link:
    link = Link(**options)
    link.connect()
    return link


def open_endpoint(link: Link, token: str, address: str, waiter: str | None = None) -> None:
    link.session.open_endpoint(token, address, waiter or f"open {address}")
    link.settle()


# -- the state table ----------------------------------------------------------------------


def test_every_state_but_closed_can_be_left_and_closed_is_final() -> None:
    sources = {state for state, _ in TRANSITIONS}
    assert sources == set(State) - {State.CLOSED}
    assert all(state is not State.CLOSED for state, _ in TRANSITIONS)


def test_a_first_connection_declares_both_exchanges_actively_then_is_ready() -> None:
    link = Link()
    link.session.start(link.now_s)
    assert link.of(Connect) == [Connect(1)]
    link.session.connected(1, link.now_s, "guest")
    link.settle()
    declares = [a for a in link.log if isinstance(a, DeclareExchange)]
    assert declares == [DeclareExchange(EXCHANGE, False), DeclareExchange(INBOX, False)]
    assert link.session.ready


def test_nothing_is_published_until_the_publish_channel_is_in_confirm_mode() -> None:
    link = Link()
    link.session.start(link.now_s)
    link.actions()
    link.session.connected(1, link.now_s, "guest")
    link.publish("1", "t", b"early")
    for action in link.actions():
        if isinstance(action, OpenChannel) and action.role != "publish":
            link.session.channel_opened(1, action.role)
    for _ in range(3):
        link.session.replied(1)
        assert link.published() == []
    link.session.channel_opened(1, "publish")
    assert [p.message.body for p in link.published()] == [b"early"]


# -- endpoints and bindings ---------------------------------------------------------------


def test_opening_an_endpoint_declares_its_queue_binds_its_address_then_consumes() -> None:
    link = ready_link()
    link.session.open_endpoint("1", "node-a", "opened")
    link.settle()
    calls = [a for a in link.log if isinstance(a, DeclareQueue | BindQueue | Consume)]
    assert calls == [
        DeclareQueue("node-a"),
        BindQueue("node-a", INBOX, "node-a"),
        Consume("1", "node-a"),
    ]
    assert link.resolved() == {"opened": None}


def test_control_methods_go_out_one_at_a_time() -> None:
    link = ready_link()
    link.session.open_endpoint("1", "node-a", "opened")
    first = link.actions()
    assert [a for a in first if isinstance(a, DeclareQueue | BindQueue | Consume)] == [
        DeclareQueue("node-a")
    ]
    link.session.replied(link.gen)
    assert link.of(BindQueue) == [BindQueue("node-a", INBOX, "node-a")]


def test_a_name_locked_by_another_connection_fails_that_open_only() -> None:
    link = ready_link()
    link.session.open_endpoint("1", "taken", "opened")
    link.settle(refuse=lambda a: (405, "RESOURCE_LOCKED") if isinstance(a, DeclareQueue) else None)
    error = link.resolved()["opened"]
    assert isinstance(error, BrokerError)
    assert "405" in str(error)
    assert not link.session.address_in_use("taken")
    assert link.session.ready  # no reconnect: the control channel was reopened
    assert OpenChannel("control") in link.log


def test_a_second_endpoint_with_a_name_in_use_is_refused_at_once() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    with pytest.raises(BrokerError, match="already open"):
        link.session.open_endpoint("2", "node-a", "second")


def test_binding_twice_asks_rabbitmq_once_and_unbinding_an_unbound_pattern_asks_nothing() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    link.session.bind("1", "tier.10", "first")
    link.settle()
    link.session.bind("1", "tier.10", "second")
    link.session.unbind("1", "never", "unbind")
    link.settle()
    assert [a for a in link.log if isinstance(a, BindQueue) and a.exchange == EXCHANGE] == [
        BindQueue("node-a", EXCHANGE, "tier.10")
    ]
    assert not any(isinstance(a, UnbindQueue) for a in link.log)
    assert link.resolved() == {"open node-a": None, "first": None, "second": None, "unbind": None}


def test_closing_an_endpoint_deletes_its_queue_and_frees_its_name() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    link.session.close_endpoint("1", "closed")
    assert link.of(DeleteQueue) == [DeleteQueue("node-a")]
    assert not link.session.address_in_use("node-a")
    link.session.replied(link.gen)
    link.actions()
    assert link.resolved()["closed"] is None


# -- publishing and confirms --------------------------------------------------------------


def test_publishes_get_increasing_tags_and_a_multiple_ack_settles_every_tag_up_to_it() -> None:
    link = ready_link()
    for i in range(5):
        link.publish("1", "t", b"%d" % i)
    assert [p.tag for p in link.published()] == [1, 2, 3, 4, 5]
    link.session.confirmed(link.gen, 3, multiple=True, ack=True)
    assert link.session.pending == 2
    link.session.confirmed(link.gen, 5, multiple=False, ack=False)
    assert link.session.pending == 1
    assert (link.session.stats.confirmed, link.session.stats.nacked) == (3, 1)


def test_accepted_messages_are_capped_queued_and_unconfirmed_together() -> None:
    link = ready_link(max_pending=3)
    link.publish("1", "t", b"a")
    link.published()  # a in flight, unconfirmed
    link.publish("1", "t", b"b")
    link.publish("1", "t", b"c")  # queued
    with pytest.raises(BrokerError, match="waiting for RabbitMQ"):
        link.publish("1", "t", b"one too many")
    link.session.confirmed(link.gen, 1, multiple=False, ack=True)
    link.publish("1", "t", b"d")  # room again
    assert (link.session.stats.published, link.session.pending) == (3 + 1, 3)


def test_publishes_and_sends_are_counted_apart() -> None:
    link = ready_link()
    link.publish("1", "tier.10", b"p")
    link.publish("1", "node-a", b"s", send=True)
    assert (link.session.stats.published, link.session.stats.sent) == (1, 1)


def test_a_basic_return_is_a_returned_delivery_with_the_topic_of_a_publish_or_none_for_a_send() -> (
    None
):
    link = ready_link()
    publish = link.session.returned(EXCHANGE, "tier.10", b"p", "guest")
    send = link.session.returned(INBOX, "node-a", b"s", "guest")
    assert (publish.returned, publish.topic) == (True, "tier.10")
    assert (send.returned, send.topic) == (True, None)
    assert link.session.stats.returned == 2


# -- flow control -------------------------------------------------------------------------


def test_nothing_is_written_while_rabbitmq_blocks_publishing_and_all_of_it_after() -> None:
    link = ready_link()
    link.session.blocked("low on memory")
    for i in range(3):
        link.publish("1", "t", b"held %d" % i)
    assert link.published() == []
    link.session.unblocked()
    assert [p.message.body for p in link.published()] == [b"held 0", b"held 1", b"held 2"]
    assert link.session.stats.blocked == 1


def test_a_new_connection_starts_unblocked() -> None:
    link = ready_link()
    link.session.blocked("alarm")
    link.session.lost(link.gen, link.now_s, "gone")
    link.session.tick(link.now_s)
    link.connect()
    link.publish("1", "t", b"after")
    assert len(link.published()) == 1


# -- reconnecting -------------------------------------------------------------------------


def test_reconnect_in_the_middle_of_a_confirm_window_replays_unconfirmed_before_the_rest() -> None:
    link = ready_link()
    for i in range(4):
        link.publish("1", "t", b"%d" % i)
    link.published()
    link.session.confirmed(link.gen, 2, multiple=True, ack=True)  # 0 and 1 confirmed
    link.session.lost(link.gen, link.now_s, "connection reset")
    link.publish("1", "t", b"while down")
    assert link.published() == []  # nothing to write to
    link.session.tick(link.now_s)  # the first retry after a working connection: at once
    link.log.clear()
    link.connect()
    replayed = [a for a in link.log if isinstance(a, Publish)]
    assert [p.message.body for p in replayed] == [b"2", b"3", b"while down"]
    assert [p.tag for p in replayed] == [1, 2, 3]  # a new channel numbers from 1
    assert link.session.stats.republished == 2
    assert link.session.stats.reconnects == 1


def test_an_ack_from_the_old_connection_settles_nothing_on_the_new_one() -> None:
    link = ready_link()
    link.publish("1", "t", b"x")
    link.published()
    old = link.gen
    link.session.lost(old, link.now_s, "reset")
    link.session.tick(link.now_s)
    link.connect()
    link.published()
    link.session.confirmed(old, 1, multiple=True, ack=True)
    assert link.session.pending == 1


def test_a_reconnect_restores_every_queue_binding_and_consumer_before_replaying() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    link.session.bind("1", "tier.10", "bound")
    link.settle()
    link.publish("1", "tier.10", b"unconfirmed")
    link.published()
    link.session.lost(link.gen, link.now_s, "reset")
    link.session.tick(link.now_s)
    link.log.clear()
    link.connect()
    link.published()
    restore = [
        a
        for a in link.log
        if isinstance(a, DeclareExchange | DeclareQueue | BindQueue | Consume | Publish)
    ]
    assert [type(a).__name__ for a in restore] == [
        "DeclareExchange",
        "DeclareExchange",
        "DeclareQueue",
        "BindQueue",
        "BindQueue",
        "Consume",
        "Publish",
    ]
    assert BindQueue("node-a", EXCHANGE, "tier.10") in restore


def test_a_bind_while_disconnected_is_done_by_the_restore_and_answered_once_ready() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    link.session.lost(link.gen, link.now_s, "reset")
    link.session.bind("1", "tier.25", "bound while down")
    link.actions()
    assert "bound while down" not in link.resolved()
    link.session.tick(link.now_s)
    link.connect()
    assert link.resolved()["bound while down"] is None
    assert BindQueue("node-a", EXCHANGE, "tier.25") in link.log


def test_failed_attempts_back_off_doubling_up_to_the_maximum_plus_jitter() -> None:
    link = ready_link(reconnect_initial_s=1.0, reconnect_max_s=4.0)
    link.session.lost(link.gen, link.now_s, "reset")
    waits = []
    for _ in range(5):
        timer = link.of(SetTimer)[-1]
        waits.append(timer.at_s - link.now_s)
        link.now_s = timer.at_s
        link.session.tick(link.now_s)
        link.actions()
        link.session.lost(link.gen, link.now_s, "refused")
    assert waits == [0.0, 1.5, 2.5, 4.5, 4.5]  # jitter 0.5 x initial on each


def test_an_outage_is_one_warning_when_lost_and_one_when_back_saying_how_long_and_how_many(
    caplog: pytest.LogCaptureFixture,
) -> None:
    link = ready_link(reconnect_initial_s=1.0, reconnect_max_s=4.0)
    open_endpoint(link, "1", "node-a")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="reservoir.brokers.amqp"):
        link.session.lost(link.gen, link.now_s, "reset")
        lost_at = link.now_s
        for _ in range(3):  # three attempts refused while the broker is down
            link.now_s = link.of(SetTimer)[-1].at_s
            link.session.tick(link.now_s)
            link.actions()
            link.session.lost(link.gen, link.now_s, "refused")
        link.now_s = link.of(SetTimer)[-1].at_s
        link.session.tick(link.now_s)
        link.connect()  # the fourth gets through
        link.publish("1", "t", b"after")  # and what follows logs nothing more
        link.published()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "reservoir: connection lost (reset); reconnecting",
        f"reservoir: reconnected after {link.now_s - lost_at:.1f} s (4 attempt(s)); "
        "1 endpoint(s) restored",
    ]
    attempts = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert attempts == [
        f"reservoir: reconnect attempt {n} failed (refused); retrying in {wait} s"
        for n, wait in ((1, "1.5"), (2, "2.5"), (3, "4.5"))
    ]


def test_a_connection_lost_and_back_at_once_is_said_twice_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    link = ready_link()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="reservoir.brokers.amqp"):
        for _ in range(2):  # two outages: a pair of lines each
            link.session.lost(link.gen, link.now_s, "reset")
            link.session.tick(link.now_s)
            link.connect()
    assert [r.getMessage() for r in caplog.records] == [
        "reservoir: connection lost (reset); reconnecting",
        "reservoir: reconnected after 0.0 s (1 attempt(s)); 0 endpoint(s) restored",
    ] * 2


def test_the_backoff_does_not_fire_early() -> None:
    link = ready_link(reconnect_initial_s=1.0)
    link.session.lost(link.gen, link.now_s, "reset")
    link.session.tick(link.now_s)
    link.actions()
    link.session.lost(link.gen, link.now_s, "refused")  # now backing off 1.5 s
    link.actions()
    link.session.tick(link.now_s + 1.4)
    assert link.of(Connect) == []
    link.session.tick(link.now_s + 1.5)
    assert len(link.of(Connect)) == 1


def test_a_first_connection_gives_up_after_its_attempts() -> None:
    link = Link(connect_attempts=2)
    link.session.start(link.now_s)
    link.actions()
    link.session.lost(link.gen, link.now_s, "refused")
    link.session.tick(link.of(SetTimer)[-1].at_s)
    link.actions()
    link.session.lost(link.gen, link.now_s, "refused")
    assert link.session.state is State.CLOSED
    assert link.session.failure is not None
    assert Stop() in link.actions()


def test_bad_credentials_end_a_first_connection_at_once() -> None:
    link = Link(connect_attempts=5)
    link.session.start(link.now_s)
    link.actions()
    link.session.lost(link.gen, link.now_s, "ACCESS_REFUSED", fatal=True)
    assert link.session.state is State.CLOSED
    assert "ACCESS_REFUSED" in str(link.session.failure)


def test_a_silent_broker_during_set_up_costs_the_connection_after_timeout_s() -> None:
    link = Link(timeout_s=2.0)
    link.session.start(link.now_s)
    link.actions()
    link.session.connected(link.gen, link.now_s, "guest")
    link.actions()  # channels asked for, never answered
    link.session.tick(link.now_s + 1.9)
    assert link.of(CloseConnection) == []
    link.session.tick(link.now_s + 2.0)
    assert len(link.of(CloseConnection)) == 1


def test_a_consumer_cancelled_by_the_broker_gets_its_queue_bindings_and_consumer_back() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    link.session.bind("1", "tier.10", "bound")
    link.settle()
    link.log.clear()
    link.session.consumer_cancelled(link.gen, "1")
    link.settle()
    assert [a for a in link.log if isinstance(a, DeclareQueue | BindQueue | Consume)] == [
        DeclareQueue("node-a"),
        BindQueue("node-a", INBOX, "node-a"),
        BindQueue("node-a", EXCHANGE, "tier.10"),
        Consume("1", "node-a"),
    ]
    assert link.session.stats.cancelled == 1
    assert link.session.ready


# -- exchanges under restricted users -----------------------------------------------------


def test_a_user_who_may_not_configure_the_exchanges_declares_them_passively() -> None:
    link = Link()
    link.session.start(link.now_s)
    link.actions()
    link.session.connected(link.gen, link.now_s, "node")

    def refuse_active(action: Action[str]) -> tuple[int, str] | None:
        if isinstance(action, DeclareExchange) and not action.passive:
            return 403, "ACCESS_REFUSED - configure access"
        return None

    link.settle(refuse=refuse_active)
    assert link.session.ready
    assert [a for a in link.log if isinstance(a, DeclareExchange)] == [
        DeclareExchange(EXCHANGE, False),
        DeclareExchange(EXCHANGE, True),
        DeclareExchange(INBOX, False),
        DeclareExchange(INBOX, True),
    ]
    # A reconnect remembers: straight to the passive declare.
    link.session.lost(link.gen, link.now_s, "reset")
    link.session.tick(link.now_s)
    link.log.clear()
    link.connect()
    assert [a for a in link.log if isinstance(a, DeclareExchange)] == [
        DeclareExchange(EXCHANGE, True),
        DeclareExchange(INBOX, True),
    ]


def test_a_missing_exchange_the_user_may_not_create_fails_the_first_connection() -> None:
    link = Link()
    link.session.start(link.now_s)
    link.actions()
    link.session.connected(link.gen, link.now_s, "node")

    def refuse(action: Action[str]) -> tuple[int, str] | None:
        if isinstance(action, DeclareExchange):
            return (403, "ACCESS_REFUSED") if not action.passive else (404, "NOT_FOUND")
        return None

    link.settle(refuse=refuse)
    assert link.session.state is State.CLOSED
    assert "does not exist" in str(link.session.failure)


def test_an_exchange_of_another_type_fails_the_first_connection() -> None:
    link = Link()
    link.session.start(link.now_s)
    link.actions()
    link.session.connected(link.gen, link.now_s, "guest")
    link.settle(
        refuse=lambda a: (406, "PRECONDITION_FAILED") if isinstance(a, DeclareExchange) else None
    )
    assert link.session.state is State.CLOSED
    assert "PRECONDITION_FAILED" in str(link.session.failure)


# -- a refused publish in a batch ---------------------------------------------------------


def test_a_403_in_a_batch_hands_back_the_refused_counts_those_before_and_republishes_the_rest() -> (
    None
):
    link = ready_link()
    open_endpoint(link, "7", "reservoir.node.a")
    link.publish("7", "reservoir.requestor.r", b"before", send=True)
    link.publish("7", "reservoir.node.other", b"forged", send=True)
    link.publish("7", "reservoir.requestor.r", b"after", send=True)
    link.publish("7", "reservoir.node.other", b"forged again", send=True)
    assert len(link.published()) == 4
    link.session.channel_closed(link.gen, "publish", 403, REFUSED_SEND)
    actions = link.actions()
    handed_back = [a for a in actions if isinstance(a, Deliver)]
    assert [(a.token, a.delivery.body, a.delivery.returned) for a in handed_back] == [
        ("7", b"forged", True),
        ("7", b"forged again", True),
    ]
    assert all(a.delivery.topic is None and a.delivery.user_id == "guest" for a in handed_back)
    assert OpenChannel("publish") in actions
    assert not any(isinstance(a, Connect | CloseConnection) for a in actions)  # no reconnect
    link.session.channel_opened(link.gen, "publish")
    again = link.published()
    assert [(p.tag, p.message.body) for p in again] == [(1, b"after")]
    stats = link.session.stats
    assert (stats.confirmed, stats.refused, stats.republished) == (1, 2, 1)


def test_a_403_naming_nothing_we_sent_hands_every_unconfirmed_message_back() -> None:
    link = ready_link()
    link.publish("1", "a", b"a")
    link.publish("1", "b", b"b")
    link.published()
    link.session.channel_closed(link.gen, "publish", 403, "ACCESS_REFUSED - something else")
    assert [a.delivery.body for a in link.of(Deliver)] == [b"a", b"b"]  # type: ignore[attr-defined]
    assert link.session.pending == 0


def test_a_refused_message_is_never_replayed_after_a_later_reconnect() -> None:
    link = ready_link()
    link.publish("1", "reservoir.node.other", b"forged", send=True)
    link.published()
    link.session.channel_closed(link.gen, "publish", 403, REFUSED_SEND)
    link.actions()
    link.session.lost(link.gen, link.now_s, "reset")
    link.session.tick(link.now_s)
    link.connect()
    assert link.published() == []


def test_publishes_from_before_a_replaced_publish_channel_carry_the_old_channel_number() -> None:
    link = ready_link()
    link.publish("1", "t", b"x")
    (first,) = link.published()
    link.session.channel_closed(link.gen, "publish", 403, "ACCESS_REFUSED - other")
    link.actions()
    assert first.channel != link.session.publish_channel


# -- closing ------------------------------------------------------------------------------


def test_close_sends_what_was_accepted_deletes_the_queues_then_closes_the_connection() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    link.publish("1", "t", b"last words")
    link.session.close(link.now_s)
    actions = link.actions()
    assert DeleteQueue("node-a") in actions
    assert [a.message.body for a in actions if isinstance(a, Publish)] == [b"last words"]
    assert not any(isinstance(a, CloseConnection) for a in actions)
    link.session.replied(link.gen)
    link.session.confirmed(link.gen, 1, multiple=False, ack=True)
    assert link.of(CloseConnection) == [CloseConnection("closing")]
    link.session.lost(link.gen, link.now_s, "closed by us")
    assert link.session.state is State.CLOSED
    assert Stop() in link.actions()
    assert link.session.stats.abandoned == 0


def test_close_gives_up_on_unconfirmed_messages_after_close_timeout_s() -> None:
    link = ready_link(close_timeout_s=1.0)
    link.publish("1", "t", b"never confirmed")
    link.published()
    link.session.close(link.now_s)
    link.actions()
    link.session.tick(link.now_s + 1.0)
    assert len(link.of(CloseConnection)) == 1
    link.session.tick(link.now_s + 2.0)  # and RabbitMQ never answers the close either
    assert link.session.state is State.CLOSED
    assert link.session.stats.abandoned == 1


def test_close_while_disconnected_fails_every_waiter_and_refuses_more() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    link.session.lost(link.gen, link.now_s, "reset")
    link.session.bind("1", "t", "waiting bind")
    link.session.close(link.now_s)
    link.actions()
    assert isinstance(link.resolved()["waiting bind"], BrokerClosed)
    with pytest.raises(BrokerClosed):
        link.publish("1", "t", b"x")


def test_a_refused_consume_fails_that_open_and_costs_only_the_consume_channel() -> None:
    link = ready_link()
    link.session.open_endpoint("1", "node-a", "opened")
    for _ in range(2):  # declare, bind its address: answered
        link.actions()
        link.session.replied(link.gen)
    assert link.of(Consume) == [Consume("1", "node-a")]
    link.session.channel_closed(link.gen, "consume", 403, "ACCESS_REFUSED - read access")
    actions = link.actions()
    assert OpenChannel("consume") in actions
    assert DeleteQueue("node-a") in actions  # declared: not left behind
    assert not any(isinstance(a, CloseConnection) for a in actions)
    assert isinstance(link.resolved()["opened"], BrokerError)
    assert link.session.ready


def test_closing_an_endpoint_fails_its_binds_still_queued_as_closed() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    open_endpoint(link, "2", "node-b")
    link.session.bind("2", "other", "bind out")  # goes out first, holds the line
    link.session.bind("1", "tier.10", "bind queued")
    link.actions()
    link.session.close_endpoint("1", "closed")
    link.actions()
    assert isinstance(link.resolved()["bind queued"], BrokerClosed)
    link.session.replied(link.gen)  # the bind that was out
    link.settle()
    assert link.resolved()["bind out"] is None
    assert BindQueue("node-a", EXCHANGE, "tier.10") not in link.log


# -- claims -------------------------------------------------------------------------------


def test_a_claim_is_an_exclusive_queue_refused_when_another_connection_holds_it() -> None:
    link = ready_link()
    open_endpoint(link, "1", "requestor-a")
    link.session.claim("1", "order-1", "claimed")
    link.settle(refuse=lambda a: (405, "RESOURCE_LOCKED") if isinstance(a, DeclareQueue) else None)
    assert DeclareQueue(claim_queue(EXCHANGE, "order-1")) in link.log
    assert isinstance(link.resolved()["claimed"], ClaimedElsewhere)
    link.session.claim("1", "order-1", "again")
    link.settle()
    assert link.resolved()["again"] is None  # not held here after the refusal: asked again


def test_a_second_endpoint_of_the_connection_is_refused_without_asking_rabbitmq() -> None:
    link = ready_link()
    open_endpoint(link, "1", "requestor-a")
    open_endpoint(link, "2", "requestor-b")
    link.session.claim("1", "order-1", "first")
    link.settle()
    declared = len([a for a in link.log if isinstance(a, DeclareQueue)])
    link.session.claim("2", "order-1", "second")
    link.settle()
    assert link.resolved()["first"] is None
    assert isinstance(link.resolved()["second"], ClaimedElsewhere)
    assert len([a for a in link.log if isinstance(a, DeclareQueue)]) == declared


def test_claims_die_with_their_connection_and_are_not_restored() -> None:
    link = ready_link()
    open_endpoint(link, "1", "requestor-a")
    link.session.claim("1", "order-1", "claimed")
    link.settle()
    link.session.lost(link.gen, link.now_s, "reset")
    link.session.claim("1", "order-2", "while down")
    link.actions()
    assert isinstance(link.resolved()["while down"], BrokerError)
    link.now_s += 60
    link.session.tick(link.now_s)
    link.connect()
    queue = claim_queue(EXCHANGE, "order-1")
    assert link.log.count(DeclareQueue(queue)) == 1  # the restore did not declare it again
    # gone with the connection: claiming it again declares it anew
    link.session.claim("1", "order-1", "anew")
    link.settle()
    assert link.resolved()["anew"] is None
    assert link.log.count(DeclareQueue(queue)) == 2


def test_unclaiming_deletes_the_queue_and_closing_the_endpoint_does_too() -> None:
    link = ready_link()
    open_endpoint(link, "1", "requestor-a")
    for key in ("order-1", "order-2"):
        link.session.claim("1", key, f"claimed {key}")
    link.settle()
    link.session.unclaim("1", "order-1", "let go")
    link.settle()
    assert DeleteQueue(claim_queue(EXCHANGE, "order-1")) in link.log
    link.session.close_endpoint("1", "closed")
    link.settle()
    assert DeleteQueue(claim_queue(EXCHANGE, "order-2")) in link.log


def test_claim_queues_are_named_per_exchange_and_a_requestors_user_may_declare_them() -> None:
    here, there = claim_queue("reservoir", "order-1"), claim_queue("other", "order-1")
    assert here != there
    assert here.startswith("reservoir.requestor.")


# -- ordered binds ----------------------------------------------------------------------


def test_what_is_accepted_after_an_ordered_bind_waits_for_its_answer() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    link.publish("1", "before", b"before")
    link.session.bind_ordered("1", "lookup.abc")
    link.publish("1", "after", b"offer")
    actions = link.actions()
    assert BindQueue("node-a", EXCHANGE, "lookup.abc") in actions
    assert [a.message.body for a in actions if isinstance(a, Publish)] == [b"before"]
    link.session.replied(link.gen)  # bind-ok
    assert [p.message.body for p in link.published()] == [b"offer"]


def test_a_refused_ordered_bind_lets_what_waited_go_and_forgets_the_pattern() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    link.session.bind_ordered("1", "lookup.abc")
    link.publish("1", "after", b"offer")
    link.actions()
    link.session.channel_closed(link.gen, "control", 403, "ACCESS_REFUSED")
    link.settle()
    assert [a.message.body for a in link.log if isinstance(a, Publish)] == [b"offer"]
    link.session.bind_ordered("1", "lookup.abc")  # not bound: asked again
    assert BindQueue("node-a", EXCHANGE, "lookup.abc") in link.actions()


def test_an_ordered_bind_cut_by_a_reconnect_is_restored_before_anything_is_published() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    link.session.bind_ordered("1", "lookup.abc")
    link.publish("1", "after", b"offer")
    link.actions()
    link.session.lost(link.gen, link.now_s, "reset")
    link.now_s += 60
    link.session.tick(link.now_s)
    link.connect()
    log = link.log
    bind = max(i for i, a in enumerate(log) if a == BindQueue("node-a", EXCHANGE, "lookup.abc"))
    published = [i for i, a in enumerate(log) if isinstance(a, Publish)]
    assert published and min(published) > bind


def test_an_ordered_unbind_waits_for_nothing_and_forgets_the_pattern() -> None:
    link = ready_link()
    open_endpoint(link, "1", "node-a")
    link.session.bind_ordered("1", "lookup.abc")
    link.settle()
    link.session.unbind_ordered("1", "lookup.abc")
    link.publish("1", "after", b"freed")
    actions = link.actions()
    assert UnbindQueue("node-a", EXCHANGE, "lookup.abc") in actions
    assert [a.message.body for a in actions if isinstance(a, Publish)] == [b"freed"]
