"""The threaded front of the RabbitMQ drivers, on the loopback broker (the session and the
front with RabbitMQ played in memory, see loopback.py): what an inline handler sends is
carried out by the IO thread as soon as the handler returns, with no wake-up."""

from __future__ import annotations

import threading

from loopback import LoopbackBroker

from reservoir.broker import Delivery, Endpoint


def test_an_inline_handlers_reply_is_published_before_the_io_thread_reads_on() -> None:
    broker = LoopbackBroker()
    try:
        pongs: list[bytes] = []
        ponged = threading.Event()

        def record(delivery: Delivery) -> None:
            pongs.append(delivery.body)
            ponged.set()

        broker.open_endpoint(record, name="asker")
        holder: list[Endpoint] = []

        def answer(delivery: Delivery) -> None:
            holder[0].send("asker", b"pong")

        answering = broker.open_endpoint(answer, name="answering", inline=True)
        holder.append(answering)
        left_in_outbox: list[int] = []
        looked = threading.Event()
        wakes_before = broker.wakes_sent

        def a_message_arrives() -> None:
            # As the client library calls in when it reads a message: outside any pump.
            broker._message(answering._token, broker.inbox_exchange, "answering", b"ping", None)
            left_in_outbox.append(len(broker._session._outbox))
            looked.set()

        broker._calls.put(a_message_arrives)
        assert looked.wait(10)
        assert left_in_outbox == [0], "the reply waited for a later wake-up"
        assert broker.wakes_sent == wakes_before  # ... and none was needed
        assert ponged.wait(10)
        assert pongs == [b"pong"]
    finally:
        broker.close()
