"""The pika adapter's work per sequential round trip, counted in instructions.

    python benchmarks/adapter_instructions.py --round-trips N [--url amqp://...]

The round trip of `adapter_speed.py` (its ``measure`` and its ``AdapterClient``: one
``reservoir.brokers.connect(url)`` broker, two endpoints opened ``inline`` as reservoir's driver
opens them, B echoing what A sends, one at a time after ``WARM_UP`` unmeasured), for the
pika adapter alone, so that it can run under callgrind. Its times move with the machine;
its instructions do not. At two sizes, the difference of the two totals over the
difference of the round trips cancels start-up, connection and warm-up:

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/adapter_instructions.py --round-trips 300
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/adapter_instructions.py --round-trips 1300

and (second total - first) / 1000 is the instructions per round trip: two runs of one
build agree far more closely than a timed run could. A round trip is two messages, their
two publisher confirms and one wake-up of the IO thread by the caller: every turn of the
adapter's hot path. The run uses an exchange of its own, deleted at the end; the queues
go with the connection.
"""

from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import asdict

from adapter_speed import AdapterClient, measure

import reservoir.brokers
from reservoir.brokers.url import BrokerUrl

BODY = b"x" * 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--round-trips", type=int, default=3000, help="measured, one at a time")
    args = parser.parse_args()
    if args.round_trips < 1:
        parser.error("--round-trips: at least 1")
    url = BrokerUrl.parse(args.url)
    if url.adapter != "pika":
        parser.error("--url: an amqp:// or amqps:// URL (the pika adapter's)")
    exchange = f"reservoir.adapterinstructions.{uuid.uuid4().hex[:12]}"
    url = url.with_exchange(exchange)
    with reservoir.brokers.own_exchange(url, name=exchange):
        result = measure(lambda roles: AdapterClient(url, roles), args.round_trips, 1, BODY)
    print(json.dumps({"round_trips": args.round_trips, **asdict(result)}))


if __name__ == "__main__":
    main()
