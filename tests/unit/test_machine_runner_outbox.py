"""The driver's outbox on a broker's IO thread: a bind goes to a thread of the driver's own,
with everything queued after it, in order, and the IO thread never waits.

The broker here is a fake: its endpoint records every call with the thread that made it,
and says waiting is not allowed on one thread, the test's stand-in for a broker's IO thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest

from reservoir.broker import Broker, Endpoint, Handler
from reservoir.clock import FakeClock, VirtualScheduler
from reservoir.protocol.effects import Bind, Effect, Send, Unbind
from reservoir.protocol.messages import Message, Release
from reservoir.runtime.machine_runner import Driver
from reservoir.runtime.settings import Settings


class RecordingEndpoint(Endpoint):
    def __init__(self, address: str, io_thread: Callable[[], threading.Thread | None]) -> None:
        self.address = address
        self._io_thread = io_thread
        #: (what, argument, the name of the thread that did it), in order
        self.calls: list[tuple[str, str, str]] = []
        self.changed = threading.Condition()
        #: set to hold a bind until the test lets it go
        self.bind_may_finish = threading.Event()
        self.bind_may_finish.set()

    def _record(self, what: str, argument: str) -> None:
        with self.changed:
            self.calls.append((what, argument, threading.current_thread().name))
            self.changed.notify_all()

    def wait_for_calls(self, count: int) -> list[tuple[str, str, str]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.calls) >= count, 10), self.calls
            return list(self.calls)

    def bind(self, pattern: str) -> None:
        assert self.blocking_allowed(), "bind on the IO thread"
        self.bind_may_finish.wait(10)
        self._record("bind", pattern)

    def unbind(self, pattern: str) -> None:
        assert self.blocking_allowed(), "unbind on the IO thread"
        self._record("unbind", pattern)

    def publish(self, topic: str, body: bytes) -> None:
        self._record("publish", topic)

    def send(self, address: str, body: bytes) -> None:
        self._record("send", address)

    def close(self) -> None:
        pass

    def blocking_allowed(self) -> bool:
        return threading.current_thread() is not self._io_thread()


class FakeBroker(Broker):
    url = "fake://"

    def __init__(self) -> None:
        self.io_thread: threading.Thread | None = None
        self.endpoint: RecordingEndpoint | None = None

    def open_endpoint(
        self, handler: Handler, *, name: str | None = None, inline: bool = False
    ) -> Endpoint:
        assert inline, "the driver opens its endpoint inline"
        self.endpoint = RecordingEndpoint(name or "anonymous", lambda: self.io_thread)
        return self.endpoint

    def close(self) -> None:
        pass


class StepDriver(Driver):
    """A driver whose machine is whatever the test feeds ``_run``."""

    def _handle_message(self, message: Message, now: float) -> list[Effect]:
        return []


def release(number: int) -> Release:
    return Release(request_id=f"r{number}", sender="someone", reservation_id=f"res{number}")


def driver_on(broker: FakeBroker) -> StepDriver:
    return StepDriver(
        broker=broker,
        settings=Settings(broker_url="memory://"),
        scheduler=VirtualScheduler(FakeClock()),
        metrics=None,
        endpoint_name="node-a",
        role="node",
    )


def run_on_io_thread(broker: FakeBroker, step: Callable[[], None]) -> None:
    thread = threading.Thread(target=step, name="io")
    broker.io_thread = thread
    thread.start()
    thread.join(10)
    assert not thread.is_alive()


def test_sends_on_the_io_thread_go_out_there_at_once() -> None:
    broker = FakeBroker()
    driver = driver_on(broker)
    effects: list[Effect] = [Send("requestor-1", release(1)), Send("requestor-2", release(2))]
    run_on_io_thread(broker, lambda: driver._run(lambda now: effects))
    assert broker.endpoint is not None
    assert broker.endpoint.calls == [
        ("send", "requestor-1", "io"),
        ("send", "requestor-2", "io"),
    ]
    assert driver._binder is None  # no bind, no thread of its own
    driver._let_go()


def test_a_bind_met_on_the_io_thread_goes_with_what_follows_it_to_the_binder() -> None:
    broker = FakeBroker()
    driver = driver_on(broker)
    endpoint = broker.endpoint
    assert endpoint is not None
    endpoint.bind_may_finish.clear()  # the bind waits, as one on RabbitMQ waits for bind-ok
    effects: list[Effect] = [
        Send("requestor-1", release(1)),
        Bind("lookup.7"),
        Send("requestor-2", release(2)),
        Unbind("tier.40"),
        Send("requestor-3", release(3)),
    ]
    run_on_io_thread(broker, lambda: driver._run(lambda now: effects))
    # The IO thread returned while the bind still waits: only the send before it is out.
    assert endpoint.calls == [("send", "requestor-1", "io")]
    # A later event on the IO thread queues behind the bind rather than overtaking it.
    run_on_io_thread(broker, lambda: driver._run(lambda now: [Send("requestor-4", release(4))]))
    assert endpoint.calls == [("send", "requestor-1", "io")]
    endpoint.bind_may_finish.set()
    calls = endpoint.wait_for_calls(6)
    assert [(what, argument) for what, argument, _thread in calls] == [
        ("send", "requestor-1"),
        ("bind", "lookup.7"),
        ("send", "requestor-2"),
        ("unbind", "tier.40"),
        ("send", "requestor-3"),
        ("send", "requestor-4"),
    ]
    assert all(thread.startswith("node-a:binds") for _what, _arg, thread in calls[1:])
    driver._let_go()


def test_a_thread_that_may_wait_binds_itself() -> None:
    broker = FakeBroker()
    driver = driver_on(broker)
    driver._run(lambda now: [Bind("tier.10"), Send("requestor-1", release(1))])
    assert broker.endpoint is not None
    here = threading.current_thread().name
    assert broker.endpoint.calls == [("bind", "tier.10", here), ("send", "requestor-1", here)]
    assert driver._binder is None
    driver._let_go()


def test_a_failure_on_the_binder_thread_is_logged_not_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = FakeBroker()
    driver = driver_on(broker)
    endpoint = broker.endpoint
    assert endpoint is not None

    def broken_bind(pattern: str) -> None:
        raise ValueError(f"a bug binding {pattern}")

    endpoint.bind = broken_bind  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="reservoir.driver"):
        run_on_io_thread(broker, lambda: driver._run(lambda now: [Bind("lookup.7")]))
        assert driver._binder is not None
        driver._binder.shutdown(wait=True)  # the flush has run
    assert any("binder thread failed" in r.message for r in caplog.records)
    assert "a bug binding lookup.7" in caplog.text
