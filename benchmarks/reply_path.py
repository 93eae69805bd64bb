"""Measure the two RabbitMQ reply paths reservoir could use, in one run, with pika.

(a) **reply queue**: the requestor owns an exclusive queue and puts its name in ``reply_to``;
    the responder publishes the reply on the default exchange with that routing key.
(b) **direct reply-to**: the requestor consumes the pseudo-queue ``amq.rabbitmq.reply-to``
    (no-ack, on the publishing channel) and puts that name in ``reply_to``; RabbitMQ hands
    the reply straight to the requestor's channel, with no queue in between.

For each path it measures round-trip latency (one request at a time: p50, p90, p99, mean)
and throughput (a window of requests in flight). Paths alternate over several rounds so that
drift on the machine hits both alike; the medians over rounds are reported, with the ratio
direct/queue. Every publish is ``mandatory`` as in the adapter; publisher confirms are off on
both paths, so the numbers isolate the reply path itself. The responder runs in a process
of its own.

    python benchmarks/reply_path.py --url amqp://guest:guest@127.0.0.1:5672/
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika

DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"


@dataclass(frozen=True)
class Result:
    p50_us: float
    p90_us: float
    p99_us: float
    mean_us: float
    throughput_per_s: float


def _respond(url: str, queue: str, ready: Any, stop: Any) -> None:
    """The responder process: echo every request to its ``reply_to``."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.queue_declare(queue, exclusive=True)

    def answer(ch: Any, method: Any, properties: Any, body: bytes) -> None:
        ch.basic_publish(
            "",
            properties.reply_to,
            body,
            pika.BasicProperties(correlation_id=properties.correlation_id),
            mandatory=True,
        )

    channel.basic_consume(queue, answer, auto_ack=True)
    ready.set()
    while not stop.is_set():
        connection.process_data_events(time_limit=0.2)
    connection.close()


class Responder:
    """Answers requests from a process of its own, so that it does not share the
    requester's interpreter lock and the numbers say more about the broker."""

    def __init__(self, url: str, queue: str) -> None:
        self.queue = queue
        context = multiprocessing.get_context("spawn")
        self._ready = context.Event()
        self._stop = context.Event()
        self._process = context.Process(
            target=_respond, args=(url, queue, self._ready, self._stop), daemon=True
        )
        self._process.start()
        if not self._ready.wait(20):
            self._process.kill()
            raise RuntimeError("the responder process did not start")

    def close(self) -> None:
        self._stop.set()
        self._process.join(10)


class Requester:
    """One connection and channel that sends requests and counts replies."""

    def __init__(self, url: str, server_queue: str, direct: bool) -> None:
        self.connection = pika.BlockingConnection(pika.URLParameters(url))
        self.channel = self.connection.channel()
        self.server_queue = server_queue
        self.replies = 0
        if direct:
            self.reply_to = DIRECT_REPLY_TO
        else:
            declared = self.channel.queue_declare(f"bench-reply-{uuid.uuid4().hex}", exclusive=True)
            self.reply_to = declared.method.queue
        # Direct reply-to must be consumed, no-ack, before the first publish that names it.
        self.channel.basic_consume(self.reply_to, self._on_reply, auto_ack=True)
        self._properties = pika.BasicProperties(reply_to=self.reply_to, correlation_id="c")

    def _on_reply(self, ch: Any, method: Any, properties: Any, body: bytes) -> None:
        self.replies += 1

    def request(self, body: bytes) -> None:
        self.channel.basic_publish("", self.server_queue, body, self._properties, mandatory=True)

    def wait_for(self, replies: int) -> None:
        while self.replies < replies:
            self.connection.process_data_events(time_limit=None)

    def close(self) -> None:
        self.connection.close()


def measure(
    url: str, server_queue: str, direct: bool, round_trips: int, total: int, window: int
) -> Result:
    requester = Requester(url, server_queue, direct)
    try:
        body = b"x" * 256  # about the size of an encoded Offer
        for _ in range(50):  # warm up: connection, queue, JIT-free but cache-warm paths
            requester.request(body)
            requester.wait_for(requester.replies + 1)
        samples: list[float] = []
        for _ in range(round_trips):
            target = requester.replies + 1
            start = time.perf_counter()
            requester.request(body)
            requester.wait_for(target)
            samples.append(time.perf_counter() - start)
        base = requester.replies
        sent = 0
        start = time.perf_counter()
        while sent < total:
            while sent < total and sent - (requester.replies - base) < window:
                requester.request(body)
                sent += 1
            requester.connection.process_data_events(time_limit=None)
        requester.wait_for(base + total)
        elapsed = time.perf_counter() - start
    finally:
        requester.close()
    samples.sort()

    def pct(q: float) -> float:
        return samples[min(len(samples) - 1, int(q * len(samples)))] * 1e6

    return Result(
        p50_us=pct(0.50),
        p90_us=pct(0.90),
        p99_us=pct(0.99),
        mean_us=statistics.fmean(samples) * 1e6,
        throughput_per_s=total / elapsed,
    )


def median_result(results: list[Result]) -> Result:
    def med(get: Callable[[Result], float]) -> float:
        return statistics.median(get(r) for r in results)

    return Result(
        p50_us=med(lambda r: r.p50_us),
        p90_us=med(lambda r: r.p90_us),
        p99_us=med(lambda r: r.p99_us),
        mean_us=med(lambda r: r.mean_us),
        throughput_per_s=med(lambda r: r.throughput_per_s),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--round-trips", type=int, default=2000, help="sequential, per round")
    parser.add_argument("--total", type=int, default=20000, help="pipelined, per round")
    parser.add_argument("--window", type=int, default=100, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    responder = Responder(args.url, f"bench-server-{uuid.uuid4().hex}")
    results: dict[str, list[Result]] = {"reply queue": [], "direct reply-to": []}
    try:
        for round_number in range(args.rounds):
            # Alternate which path goes first so warm-up effects do not favour one.
            order = [False, True] if round_number % 2 == 0 else [True, False]
            for direct in order:
                name = "direct reply-to" if direct else "reply queue"
                results[name].append(
                    measure(
                        args.url,
                        responder.queue,
                        direct,
                        args.round_trips,
                        args.total,
                        args.window,
                    )
                )
    finally:
        responder.close()

    summary = {name: median_result(rs) for name, rs in results.items()}
    print(
        f"{args.rounds} rounds; latency over {args.round_trips} sequential round trips, "
        f"throughput over {args.total} requests with {args.window} in flight (medians)"
    )
    print(f"{'path':<16} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} {'mean us':>8} {'req/s':>9}")
    for name, r in summary.items():
        print(
            f"{name:<16} {r.p50_us:8.0f} {r.p90_us:8.0f} {r.p99_us:8.0f} {r.mean_us:8.0f} "
            f"{r.throughput_per_s:9.0f}"
        )
    by_queue, by_direct = summary["reply queue"], summary["direct reply-to"]
    print(
        f"direct/queue: p50 latency x{by_direct.p50_us / by_queue.p50_us:.2f}, "
        f"p99 latency x{by_direct.p99_us / by_queue.p99_us:.2f}, "
        f"throughput x{by_direct.throughput_per_s / by_queue.throughput_per_s:.2f}"
    )


if __name__ == "__main__":
    main()
