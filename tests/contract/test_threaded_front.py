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


def test_a_batch_of_sends_wakes_the_io_thread_once_as_it_ends() -> None:
    broker = LoopbackBroker()
    try:
        heard: list[bytes] = []
        both = threading.Event()

        def record(delivery: Delivery) -> None:
            heard.append(delivery.body)
            if len(heard) == 2:
                both.set()

        receiver = broker.open_endpoint(record, name="receiver")
        sender = broker.open_endpoint(lambda delivery: None, name="sender")
        wakes_before = broker.wakes_sent
        with sender.batch():
            sender.send(receiver.address, b"probe 1")
            sender.send(receiver.address, b"probe 2")
            assert broker.wakes_sent == wakes_before, "a send in a batch woke the IO thread"
        assert broker.wakes_sent == wakes_before + 1
        assert both.wait(10)
        assert heard == [b"probe 1", b"probe 2"]
    finally:
        broker.close()


def test_a_bind_inside_a_batch_does_not_wait_on_the_batchs_put_off_wake_up() -> None:
    broker = LoopbackBroker(timeout_s=2.0)
    try:
        sender = broker.open_endpoint(lambda delivery: None, name="sender")
        with sender.batch():
            sender.send("nobody-in-particular", b"first")  # claims the wake-up, put off
            sender.bind("some.topic")  # waits for the IO thread: would time out
        assert broker.stats.sent == 1
    finally:
        broker.close()
