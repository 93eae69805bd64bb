"""A driver of the AMQP session with RabbitMQ played in memory, for the contract suite.

``LoopbackBroker`` is an :class:`~reservoir.brokers.amqp.threaded.AmqpBroker` like the pika and
kombu drivers, with the same session, the same threaded front and the same IO-thread pump; only
``_do`` differs: instead of a client library it carries out each action against a small
in-memory model of one RabbitMQ vhost (topic exchanges, exclusive queues, bindings,
mandatory returns before the ack, a confirm per publish). So the whole broker contract runs
on the session and the front without RabbitMQ, and a failure there is theirs, not a
client library's.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from reservoir.brokers.amqp import session as core
from reservoir.brokers.amqp.session import Action, Session
from reservoir.brokers.amqp.threaded import AmqpBroker, Future
from reservoir.brokers.routing import topic_matches


class LoopbackBroker(AmqpBroker):
    driver = "loopback"

    def __init__(self, **options: Any) -> None:
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = False
        self._gen = 0
        #: queue name -> consuming endpoint token (None until consumed)
        self._queues: dict[str, str | None] = {}
        #: (exchange, queue, pattern) bindings, in binding order
        self._bindings: list[tuple[str, str, str]] = []
        #: wake-ups of the IO thread asked for so far
        self.wakes_sent = 0
        super().__init__("amqp://loopback@localhost/?exchange=loopback", **options)

    def _io_main(self) -> None:
        while not self._stopping:
            self._calls.get()()

    def _send_wake(self) -> None:
        self.wakes_sent += 1
        self._calls.put(self._pump)

    def _do(self, action: Action[Future]) -> None:
        gen = self._gen
        if isinstance(action, core.Connect):
            self._gen = action.gen
            self._event(Session.connected, action.gen, self._now(), "loopback")
        elif isinstance(action, core.OpenChannel):
            self._event(Session.channel_opened, gen, action.role)
        elif isinstance(action, core.Publish):
            self._route(action)
        elif isinstance(action, core.CloseConnection):
            self._queues.clear()  # exclusive queues die with the connection
            self._bindings.clear()
            self._event(Session.lost, gen, self._now(), action.reason)
        elif isinstance(action, core.Stop):
            self._stopping = True
        elif not isinstance(action, core.SetTimer):  # nothing here takes time
            self._control(action)
            self._event(Session.replied, gen)

    def _control(self, action: Action[Future]) -> None:
        if isinstance(action, core.DeclareQueue):
            self._queues.setdefault(action.address, None)
        elif isinstance(action, core.BindQueue):
            binding = (action.exchange, action.address, action.pattern)
            if binding not in self._bindings:
                self._bindings.append(binding)
        elif isinstance(action, core.UnbindQueue):
            binding = (action.exchange, action.address, action.pattern)
            self._bindings = [b for b in self._bindings if b != binding]
        elif isinstance(action, core.DeleteQueue):
            self._queues.pop(action.address, None)
            self._bindings = [b for b in self._bindings if b[1] != action.address]
        elif isinstance(action, core.Consume):
            self._queues[action.address] = action.token

    def _route(self, publish: core.Publish) -> None:
        message = publish.message
        targets = {
            name
            for exchange, name, pattern in self._bindings
            if exchange == message.exchange and topic_matches(pattern, message.routing_key)
        }
        consumers = [self._queues.get(name) for name in sorted(targets)]
        if not targets:  # mandatory: RabbitMQ returns it, then acks it
            self._returned(
                message.token, message.exchange, message.routing_key, message.body, "loopback"
            )
        for token in consumers:
            if token is not None:
                self._message(
                    token, message.exchange, message.routing_key, message.body, "loopback"
                )
        self._event(Session.confirmed, self._gen, publish.tag, multiple=False, ack=True)
