"""What only the in-process broker has: fault injection, counters, per-instance state, and
delivery on a virtual scheduler. No real time passes in these tests (except the two that
check the broker's own thread)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from reservoir.broker import BrokerClosed, BrokerError, Delivery
from reservoir.brokers.inprocess import BrokerStats, Faults, InProcessBroker
from reservoir.clock import VirtualScheduler


class Recorder:
    """A handler that records what arrived and the virtual time it arrived at."""

    def __init__(self, scheduler: VirtualScheduler) -> None:
        self._scheduler = scheduler
        self.deliveries: list[Delivery] = []
        self.times: list[float] = []

    def __call__(self, delivery: Delivery) -> None:
        self.deliveries.append(delivery)
        self.times.append(self._scheduler.clock.now())

    @property
    def bodies(self) -> list[bytes]:
        return [d.body for d in self.deliveries if not d.returned]

    @property
    def returned(self) -> list[bytes]:
        return [d.body for d in self.deliveries if d.returned]


@pytest.fixture
def scheduler() -> VirtualScheduler:
    return VirtualScheduler()


@pytest.fixture
def broker(scheduler: VirtualScheduler) -> Iterator[InProcessBroker]:
    with InProcessBroker(scheduler) as opened:
        assert isinstance(opened, InProcessBroker)
        yield opened


def numbered(count: int) -> list[bytes]:
    return [f"{i:05d}".encode() for i in range(count)]


def run_fault_scenario(faults: Faults, count: int = 200) -> tuple[list[bytes], list[float]]:
    """Publish ``count`` numbered messages to one bound endpoint under ``faults`` and
    return what arrived, and when."""
    scheduler = VirtualScheduler()
    with InProcessBroker(scheduler, faults=faults) as broker:
        receiver = Recorder(scheduler)
        broker.open_endpoint(receiver).bind("t")
        sender = broker.open_endpoint(Recorder(scheduler))
        for body in numbered(count):
            sender.publish("t", body)
        scheduler.advance(60.0)
        return receiver.bodies, receiver.times


# -- delivery on a virtual scheduler ------------------------------------------------------------


def test_nothing_arrives_until_the_scheduler_runs(
    broker: InProcessBroker, scheduler: VirtualScheduler
) -> None:
    receiver = Recorder(scheduler)
    broker.open_endpoint(receiver, name="node").bind("t")
    broker.open_endpoint(Recorder(scheduler)).publish("t", b"x")
    assert receiver.deliveries == []
    scheduler.run_until_idle()
    assert receiver.bodies == [b"x"]
    assert receiver.times == [scheduler.clock.now()]


def test_unroutable_publish_is_returned_through_the_scheduler(
    broker: InProcessBroker, scheduler: VirtualScheduler
) -> None:
    sender = Recorder(scheduler)
    broker.open_endpoint(sender).publish("tier.10", b"anyone?")
    assert sender.deliveries == []
    scheduler.run_until_idle()
    assert sender.deliveries == [Delivery(b"anyone?", topic="tier.10", returned=True)]


def test_closing_an_endpoint_drops_what_is_pending_for_it(
    broker: InProcessBroker, scheduler: VirtualScheduler
) -> None:
    first = Recorder(scheduler)
    endpoint = broker.open_endpoint(first, name="node")
    broker.open_endpoint(Recorder(scheduler)).send("node", b"in flight")
    endpoint.close()
    # The name is free again, but what was in flight was for the old inbox.
    second = Recorder(scheduler)
    broker.open_endpoint(second, name="node")
    scheduler.run_until_idle()
    assert first.deliveries == []
    assert second.deliveries == []
    assert broker.stats.dropped == 1


def test_closing_the_broker_leaves_a_given_scheduler_running(
    broker: InProcessBroker, scheduler: VirtualScheduler
) -> None:
    receiver = Recorder(scheduler)
    broker.open_endpoint(receiver, name="node")
    broker.open_endpoint(Recorder(scheduler)).send("node", b"pending")
    broker.close()
    timer = scheduler.call_later(1.0, lambda: None)
    assert not timer.cancelled
    scheduler.advance(2.0)
    assert receiver.deliveries == []


# -- faults -------------------------------------------------------------------------------------


def test_loss_is_about_the_configured_rate() -> None:
    arrived, _ = run_fault_scenario(Faults(loss=0.2, seed=1), count=10_000)
    assert 0.18 * 10_000 <= 10_000 - len(arrived) <= 0.22 * 10_000


def test_seeded_faults_replay_exactly() -> None:
    faults = Faults(loss=0.3, duplicate=0.2, delay_s=(0.0, 0.5), seed=42)
    assert run_fault_scenario(faults) == run_fault_scenario(faults)
    other_seed = Faults(loss=0.3, duplicate=0.2, delay_s=(0.0, 0.5), seed=43)
    assert run_fault_scenario(faults) != run_fault_scenario(other_seed)


def test_duplicate_delivers_twice() -> None:
    arrived, _ = run_fault_scenario(Faults(duplicate=1.0, seed=1), count=50)
    assert arrived == [body for body in numbered(50) for _ in range(2)]


def test_duplicate_is_about_the_configured_rate(scheduler: VirtualScheduler) -> None:
    arrived, _ = run_fault_scenario(Faults(duplicate=0.1, seed=3), count=10_000)
    assert 0.08 * 10_000 <= len(arrived) - 10_000 <= 0.12 * 10_000
    assert set(arrived) == set(numbered(10_000))


def test_delay_defers_every_delivery_within_its_bounds(scheduler: VirtualScheduler) -> None:
    with InProcessBroker(scheduler, faults=Faults(delay_s=(0.5, 1.0), seed=5)) as broker:
        receiver = Recorder(scheduler)
        broker.open_endpoint(receiver).bind("t")
        start = scheduler.clock.now()
        sender = broker.open_endpoint(Recorder(scheduler))
        for body in numbered(100):
            sender.publish("t", body)
        scheduler.run_until_idle()
        assert receiver.deliveries == []
        scheduler.advance(0.49)
        assert receiver.deliveries == []
        scheduler.advance(0.51)
        assert len(receiver.bodies) == 100
        assert all(start + 0.5 <= t <= start + 1.0 for t in receiver.times)


def test_independent_delays_reorder_messages() -> None:
    arrived, times = run_fault_scenario(Faults(delay_s=(0.0, 1.0), seed=9), count=100)
    assert sorted(arrived) == numbered(100)
    assert arrived != numbered(100)
    assert times == sorted(times)


def test_without_faults_one_sender_is_fifo() -> None:
    arrived, _ = run_fault_scenario(Faults(), count=1000)
    assert arrived == numbered(1000)


def test_applies_to_limits_faults_to_the_chosen_deliveries(scheduler: VirtualScheduler) -> None:
    faults = Faults(loss=1.0, applies_to=lambda d: d.body.startswith(b"drop"))
    with InProcessBroker(scheduler, faults=faults) as broker:
        receiver = Recorder(scheduler)
        broker.open_endpoint(receiver, name="node").bind("t")
        sender = broker.open_endpoint(Recorder(scheduler))
        sender.publish("t", b"drop me")
        sender.publish("t", b"keep me")
        sender.send("node", b"drop me too")
        sender.send("node", b"keep me too")
        scheduler.run_until_idle()
        assert receiver.bodies == [b"keep me", b"keep me too"]
        assert broker.stats.lost == 2


def test_applies_to_sees_the_topic(scheduler: VirtualScheduler) -> None:
    faults = Faults(loss=1.0, applies_to=lambda d: d.topic == "tier.10")
    with InProcessBroker(scheduler, faults=faults) as broker:
        receiver = Recorder(scheduler)
        node = broker.open_endpoint(receiver)
        node.bind("tier.#")
        sender = broker.open_endpoint(Recorder(scheduler))
        sender.publish("tier.10", b"lost")
        sender.publish("tier.25", b"kept")
        sender.send(node.address, b"direct, kept")
        scheduler.run_until_idle()
        assert receiver.bodies == [b"kept", b"direct, kept"]


def test_returned_notifications_are_never_faulted(scheduler: VirtualScheduler) -> None:
    with InProcessBroker(scheduler, faults=Faults(loss=1.0, delay_s=(5.0, 5.0))) as broker:
        sender = Recorder(scheduler)
        endpoint = broker.open_endpoint(sender)
        endpoint.publish("nobody.home", b"unroutable")
        endpoint.send("no-such-address", b"unknown")
        scheduler.run_until_idle()
        assert sender.returned == [b"unroutable", b"unknown"]
        assert broker.stats.lost == 0


def test_setting_faults_to_none_heals_the_network(
    broker: InProcessBroker, scheduler: VirtualScheduler
) -> None:
    receiver = Recorder(scheduler)
    broker.open_endpoint(receiver).bind("t")
    sender = broker.open_endpoint(Recorder(scheduler))
    broker.faults = Faults(loss=1.0)
    sender.publish("t", b"into the void")
    scheduler.run_until_idle()
    broker.faults = None
    assert broker.faults is None
    sender.publish("t", b"healed")
    scheduler.run_until_idle()
    assert receiver.bodies == [b"healed"]


def test_setting_seeded_faults_reseeds_the_broker(
    broker: InProcessBroker, scheduler: VirtualScheduler
) -> None:
    receiver = Recorder(scheduler)
    broker.open_endpoint(receiver).bind("t")
    sender = broker.open_endpoint(Recorder(scheduler))
    runs = []
    for _ in range(2):
        broker.faults = Faults(loss=0.5, seed=11)
        receiver.deliveries.clear()
        for body in numbered(100):
            sender.publish("t", body)
        scheduler.run_until_idle()
        runs.append(receiver.bodies)
    assert runs[0] == runs[1]
    assert 0 < len(runs[0]) < 100


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss": -0.1},
        {"loss": 1.5},
        {"duplicate": 2.0},
        {"loss": float("nan")},
        {"delay_s": (1.0, 0.5)},
        {"delay_s": (-1.0, 0.0)},
        {"delay_s": (0.0, float("inf"))},
    ],
)
def test_faults_refuse_nonsense(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must"):
        Faults(**kwargs)  # type: ignore[arg-type]


# -- counters -----------------------------------------------------------------------------------


def test_stats_count_what_happened(broker: InProcessBroker, scheduler: VirtualScheduler) -> None:
    def explode(delivery: Delivery) -> None:
        raise RuntimeError("handler bug")

    broker.open_endpoint(Recorder(scheduler), name="a").bind("t.#")
    broker.open_endpoint(explode, name="b").bind("t.*")
    sender = broker.open_endpoint(Recorder(scheduler))
    sender.publish("t.1", b"two receivers")
    sender.publish("t", b"one receiver")
    sender.publish("u", b"nobody")
    sender.send("a", b"direct")
    sender.send("nobody", b"unknown")
    scheduler.run_until_idle()
    assert broker.stats == BrokerStats(
        published=3, sent=2, delivered=4, returned=2, handler_errors=1
    )


def test_stats_count_faults() -> None:
    scheduler = VirtualScheduler()
    with InProcessBroker(scheduler, faults=Faults(loss=0.5, duplicate=0.5, seed=2)) as broker:
        receiver = Recorder(scheduler)
        broker.open_endpoint(receiver).bind("t")
        sender = broker.open_endpoint(Recorder(scheduler))
        for body in numbered(1000):
            sender.publish("t", body)
        scheduler.run_until_idle()
        stats = broker.stats
        assert stats.published == 1000
        assert stats.lost + (stats.delivered - stats.duplicated) == 1000
        assert stats.delivered == len(receiver.deliveries)
        assert stats.lost > 0
        assert stats.duplicated > 0


def test_stats_are_a_snapshot(broker: InProcessBroker, scheduler: VirtualScheduler) -> None:
    snapshot = broker.stats
    broker.open_endpoint(Recorder(scheduler)).publish("t", b"x")
    assert snapshot.published == 0
    assert broker.stats.published == 1


def test_handler_errors_are_logged_and_counted(
    broker: InProcessBroker, scheduler: VirtualScheduler, caplog: pytest.LogCaptureFixture
) -> None:
    def explode(delivery: Delivery) -> None:
        raise RuntimeError("handler bug")

    receiver = Recorder(scheduler)
    broker.open_endpoint(explode, name="bad").bind("t")
    broker.open_endpoint(receiver, name="good").bind("t")
    sender = broker.open_endpoint(Recorder(scheduler))
    with caplog.at_level(logging.ERROR, logger="reservoir.brokers.inprocess"):
        sender.publish("t", b"1")
        sender.publish("t", b"2")
        scheduler.run_until_idle()
    assert receiver.bodies == [b"1", b"2"]
    assert broker.stats.handler_errors == 2
    failures = [r for r in caplog.records if r.name == "reservoir.brokers.inprocess"]
    assert len(failures) == 2
    assert all(r.exc_info is not None and "bad" in r.getMessage() for r in failures)


# -- per-instance state -------------------------------------------------------------------------


def test_two_brokers_share_nothing(scheduler: VirtualScheduler) -> None:
    with InProcessBroker(scheduler) as first, InProcessBroker(scheduler) as second:
        in_first, in_second = Recorder(scheduler), Recorder(scheduler)
        first.open_endpoint(in_first, name="x").bind("t.#")
        second.open_endpoint(in_second, name="x")  # the same name is free in another broker
        sender = Recorder(scheduler)
        from_second = second.open_endpoint(sender)
        from_second.send("x", b"direct in second")
        from_second.publish("t.1", b"bound only in first")
        scheduler.run_until_idle()
        assert in_first.deliveries == []
        assert in_second.bodies == [b"direct in second"]
        assert sender.returned == [b"bound only in first"]
        assert first.stats == BrokerStats()
        assert first.addresses() == {"x"}


# -- routing cache ------------------------------------------------------------------------------


def test_bind_and_unbind_take_effect_on_a_cached_topic(
    broker: InProcessBroker, scheduler: VirtualScheduler
) -> None:
    receiver = Recorder(scheduler)
    node = broker.open_endpoint(receiver)
    sender_log = Recorder(scheduler)
    sender = broker.open_endpoint(sender_log)

    sender.publish("tier.10", b"nobody yet")  # routes to nobody, and caches that
    node.bind("tier.#")
    sender.publish("tier.10", b"bound")
    node.unbind("tier.#")
    sender.publish("tier.10", b"unbound")
    node.bind("tier.*")
    sender.publish("tier.10", b"bound again")
    scheduler.run_until_idle()  # before the close, which would drop what is pending
    node.close()
    sender.publish("tier.10", b"closed")
    scheduler.run_until_idle()

    assert receiver.bodies == [b"bound", b"bound again"]
    assert sender_log.returned == [b"nobody yet", b"unbound", b"closed"]


# -- endpoints and validation ---------------------------------------------------------------------


def test_generated_addresses_skip_names_already_taken(
    broker: InProcessBroker, scheduler: VirtualScheduler
) -> None:
    broker.open_endpoint(Recorder(scheduler), name="inbox.1")
    generated = broker.open_endpoint(Recorder(scheduler))
    assert generated.address.startswith("inbox.")
    assert generated.address != "inbox.1"
    with pytest.raises(BrokerError):
        broker.open_endpoint(Recorder(scheduler), name=generated.address)


@pytest.mark.parametrize("name", ["", "amq.reserved", "x" * 256])
def test_names_rabbitmq_would_refuse_are_refused(broker: InProcessBroker, name: str) -> None:
    with pytest.raises(ValueError, match=r"empty|reserved|longer than 255 bytes"):
        broker.open_endpoint(lambda d: None, name=name)


def test_topics_longer_than_an_amqp_short_string_are_refused(
    broker: InProcessBroker, scheduler: VirtualScheduler
) -> None:
    endpoint = broker.open_endpoint(Recorder(scheduler))
    endpoint.publish("é" * 127, b"254 bytes is fine")
    with pytest.raises(ValueError, match="longer than 255 bytes"):
        endpoint.publish("é" * 128, b"256 bytes is not")
    with pytest.raises(ValueError, match="longer than 255 bytes"):
        endpoint.bind("a." * 128)


def test_bytes_subclasses_arrive_as_plain_bytes(
    broker: InProcessBroker, scheduler: VirtualScheduler
) -> None:
    class Tagged(bytes):
        pass

    receiver = Recorder(scheduler)
    node = broker.open_endpoint(receiver)
    broker.open_endpoint(Recorder(scheduler)).send(node.address, Tagged(b"tagged"))
    scheduler.run_until_idle()
    assert type(receiver.deliveries[0].body) is bytes


def test_closed_broker_raises_broker_closed(
    broker: InProcessBroker, scheduler: VirtualScheduler
) -> None:
    endpoint = broker.open_endpoint(Recorder(scheduler))
    broker.close()
    assert broker.closed
    assert endpoint.closed
    with pytest.raises(BrokerClosed):
        broker.open_endpoint(Recorder(scheduler))
    with pytest.raises(BrokerClosed):
        endpoint.unbind("t")
    broker.close()


# -- the broker's own thread ----------------------------------------------------------------------


def test_owned_thread_scheduler_is_closed_with_the_broker() -> None:
    broker = InProcessBroker()
    arrived = threading.Event()
    node = broker.open_endpoint(lambda d: arrived.set())
    broker.open_endpoint(lambda d: None).send(node.address, b"x")
    assert arrived.wait(10)
    broker.close()
    assert broker.scheduler.call_soon(lambda: None).cancelled


def test_a_handler_may_close_the_broker_from_the_delivery_thread() -> None:
    broker = InProcessBroker()
    done = threading.Event()

    def close_everything(delivery: Delivery) -> None:
        broker.close()
        done.set()

    node = broker.open_endpoint(close_everything)
    broker.open_endpoint(lambda d: None).send(node.address, b"shut down")
    assert done.wait(10)
    assert broker.closed
