"""What routing direct messages through a topic exchange costs RabbitMQ, against a direct one.

    python benchmarks/exchange_type.py [--url amqp://guest:guest@127.0.0.1:5672/] \\
        [--messages 5000] [--rounds 6] [--bindings 200] [--destinations 1] [--beam-pid PID]

reservoir sends every direct message (offer, award, accepted, release...) through the
topic exchange ``<name>.inbox``, routing key = the receiver's address, rather than through
a direct exchange or the default one, so that RabbitMQ's topic permissions can say who may
send what (docs/internals.md). This measures the price of that choice on the broker: for
each exchange type, an exchange of its own with ``--bindings`` queues bound by
address-like keys, as a node process's inboxes are, and ``--destinations`` more queues
consumed by a second connection; then ``--messages`` 512-byte publishes to those in turn,
``mandatory``, each waiting for its publisher confirm (one at a time, as a placement's
messages go), and
RabbitMQ's CPU over them read from ``/proc`` as ``reservoir bench`` reads it
(:mod:`reservoir.tools.bench.limits`). The two types take turns, the order alternating
each round; it prints each run and the medians. Everything it declares is exclusive or
auto-deleted, gone when it ends.

Many destinations are what a requestor's channel sends to (a node's address for each
probe and award): on a topic exchange RabbitMQ checks the publisher's topic permission
for each routing key, and a channel remembers only the last 12 keys it checked
(``rabbit_channel``'s permission cache), so beyond 12 destinations every publish is
checked again. ``--destinations 1`` prices the exchange alone, ``--destinations 50``
with the checks a placement's messages pay.

RabbitMQ must run on this machine, listening on the URL's loopback port (its CPU is read
from ``/proc``); ``--beam-pid`` names its process when that finds none.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid

import pika

from reservoir.brokers import BrokerUrl
from reservoir.tools.bench.limits import CpuMeter, broker_processes

BODY = b"x" * 512


def broker_cpu_seconds(meter: CpuMeter) -> float:
    seconds = meter.snapshot().seconds.get("broker")
    if seconds is None:
        raise SystemExit("RabbitMQ's CPU cannot be read from /proc: name it with --beam-pid")
    return seconds


def one_run(
    url: str, kind: str, messages: int, bindings: int, destinations: int, meter: CpuMeter
) -> tuple[float, float]:
    """RabbitMQ's CPU and the wall time per message, in microseconds, through a new
    exchange of type ``kind``."""
    params = pika.URLParameters(url)
    publisher = pika.BlockingConnection(params)
    consumer = pika.BlockingConnection(params)
    try:
        channel = publisher.channel()
        channel.confirm_delivery()
        exchange = f"bench.exchange-type.{kind}.{uuid.uuid4().hex[:8]}"
        channel.exchange_declare(exchange, exchange_type=kind, auto_delete=True)
        for index in range(bindings):
            queue = channel.queue_declare("", exclusive=True).method.queue
            address = f"inbox.node-{index}.{uuid.uuid4().hex}"
            channel.queue_bind(queue, exchange, routing_key=address)
        inbound = consumer.channel()
        keys = [f"inbox.{uuid.uuid4().hex}" for _ in range(destinations)]
        targets = []
        for key in keys:
            target = inbound.queue_declare("", exclusive=True).method.queue
            inbound.queue_bind(target, exchange, routing_key=key)
            targets.append(target)
        received = 0
        all_in = threading.Event()

        def on_message(*_: object) -> None:
            nonlocal received
            received += 1
            if received == messages:
                all_in.set()

        for target in targets:
            inbound.basic_consume(target, on_message, auto_ack=True)
        reader = threading.Thread(target=inbound.start_consuming, daemon=True)
        reader.start()
        time.sleep(0.3)  # the consumer settled before the clock starts
        cpu_before, wall_before = broker_cpu_seconds(meter), time.perf_counter()
        for index in range(messages):
            channel.basic_publish(exchange, keys[index % destinations], BODY, mandatory=True)
        if not all_in.wait(60):
            raise SystemExit(f"{kind}: {received} of {messages} messages arrived")
        cpu = broker_cpu_seconds(meter) - cpu_before
        wall = time.perf_counter() - wall_before
        consumer.add_callback_threadsafe(inbound.stop_consuming)
        reader.join(5)
    finally:
        publisher.close()
        consumer.close()
    return cpu / messages * 1e6, wall / messages * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--bindings", type=int, default=200)
    parser.add_argument(
        "--destinations", type=int, default=1, help="queues the messages go to in turn"
    )
    parser.add_argument("--beam-pid", type=int, default=None)
    args = parser.parse_args()
    if args.messages < 1 or args.rounds < 1 or args.destinations < 1 or args.bindings < 0:
        parser.error(
            "--messages, --rounds and --destinations must be at least 1, --bindings at least 0"
        )
    pids = [args.beam_pid] if args.beam_pid else broker_processes(BrokerUrl.parse(args.url))
    if not pids:
        parser.error(f"no process listens on {args.url}'s port here: name it with --beam-pid")
    meter = CpuMeter({"broker": pids})
    cpu: dict[str, list[float]] = {"topic": [], "direct": []}
    for round_ in range(args.rounds):
        kinds = ("topic", "direct") if round_ % 2 == 0 else ("direct", "topic")
        for kind in kinds:
            cpu_us, wall_us = one_run(
                args.url, kind, args.messages, args.bindings, args.destinations, meter
            )
            cpu[kind].append(cpu_us)
            print(f"round {round_}: {kind:6} RabbitMQ {cpu_us:6.1f} us/message, wall {wall_us:.1f}")
    topic, direct = statistics.median(cpu["topic"]), statistics.median(cpu["direct"])
    lower = sum(d < t for t, d in zip(cpu["topic"], cpu["direct"], strict=True))
    print(
        f"median RabbitMQ CPU per message: topic {topic:.1f} us, direct {direct:.1f} us "
        f"(topic/direct {topic / direct:.3f}; direct lower in {lower} of {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
