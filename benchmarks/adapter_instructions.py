"""The pika adapter's work per sequential round trip, counted in instructions.

    python benchmarks/adapter_instructions.py --round-trips N [--url amqp://...]

One ``brokers.connect(url)`` broker with two endpoints opened ``inline`` (as reservoir's
driver opens them), A and B: A sends a 300-byte body to B, B's handler sends it back, and
the caller waits for it before the next; ``--round-trips`` of them after a tenth as many
unmeasured. It prints the CPU and wall time per round trip, which move with the machine.
The instructions do not: under callgrind, at two sizes, the difference of the two totals
over the difference of the round trips cancels start-up, connection and warm-up:

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/adapter_instructions.py --round-trips 300
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/adapter_instructions.py --round-trips 1300

and (second total - first) / 1100 is the instructions per round trip (300 and 1,300 round
trips with 30 and 130 unmeasured). Two runs of one build agreed within 0.02 % on the
adapter's own loop, within 0.4 % on pika's (docs/performance.md). A round trip is two
messages, their two publisher confirms and one wake-up of the IO thread by the caller:
every turn of the adapter's hot path. The run uses an exchange of its own, deleted at
the end; the queues go with the connection.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid

import brokers
from brokers.url import BrokerUrl
from reservoir.broker import Delivery

BODY = b"x" * 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--round-trips", type=int, default=3000, help="measured, one at a time")
    args = parser.parse_args()
    if args.round_trips < 1:
        parser.error("--round-trips: at least 1")
    exchange = f"reservoir.adapterinstructions.{uuid.uuid4().hex[:12]}"
    url = BrokerUrl.parse(args.url).with_exchange(exchange)
    back = threading.Event()
    with brokers.own_exchange(url, name=exchange):
        broker = brokers.connect(url)
        try:
            a = broker.open_endpoint(lambda _d: back.set(), name=f"{exchange}.a", inline=True)

            def echo(delivery: Delivery) -> None:
                b.send(a.address, delivery.body)

            b = broker.open_endpoint(echo, name=f"{exchange}.b", inline=True)

            def round_trips(count: int) -> None:
                for _ in range(count):
                    back.clear()
                    a.send(b.address, BODY)
                    if not back.wait(5):
                        raise SystemExit("a round trip took over 5 s: is RabbitMQ up?")

            round_trips(max(1, args.round_trips // 10))
            cpu_s, wall_s = time.process_time(), time.perf_counter()
            round_trips(args.round_trips)
            cpu_s, wall_s = time.process_time() - cpu_s, time.perf_counter() - wall_s
        finally:
            broker.close()
    print(
        json.dumps(
            {
                "round_trips": args.round_trips,
                "cpu_us_per_round_trip": round(cpu_s / args.round_trips * 1e6, 1),
                "wall_us_per_round_trip": round(wall_s / args.round_trips * 1e6, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
