"""What one service replica saw of its own placements lately, for the dashboard
(``GET /v1/activity``): a bounded ring of outcomes (placed or why not, how long, where),
summarised over a window as placements per second, latency percentiles, failures by reason
and the last few placements.

Per replica by design: the service keeps no shared state (the nodes are the truth for what
is held), so behind a load balancer each replica reports its own share of the traffic;
Prometheus (``reservoir_service_*``) is the place to add the replicas up. The ring holds at
most ``capacity`` outcomes, so a busy replica's window may be shorter than asked: the answer
says how far back it reaches. Time is read from an injected monotonic clock, so tests drive
it with a fake one.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACTIVITY_CAPACITY",
    "MAX_BUCKETS",
    "MAX_WINDOW_S",
    "MIN_BUCKET_S",
    "Activity",
    "Outcome",
    "span_problem",
]

#: outcomes a replica remembers: at 100 placements/s, the last 5 minutes and a half
ACTIVITY_CAPACITY = 32_768
#: the last placements the summary lists
RECENT = 12
#: the longest window a summary covers, and the shortest bucket it counts in: so a summary
#: has at most MAX_BUCKETS counts (a few kB of JSON), whatever it is asked for
MAX_WINDOW_S = 3600.0
MIN_BUCKET_S = 1.0
MAX_BUCKETS = int(MAX_WINDOW_S / MIN_BUCKET_S)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One placement attempt as the replica answered it."""

    at: float
    #: "placed", or why not: "timeout", "unavailable", "error", "not placed: <reason>"
    result: str
    elapsed_s: float
    request_id: str
    nodes: tuple[str, ...] = ()
    instances: int = 0
    partial: bool = False


def span_problem(window_s: float, bucket_s: float) -> tuple[str, str] | None:
    """What is wrong with a summary's window and bucket, as (the parameter, the problem),
    or None: both finite, the window within (0, :data:`MAX_WINDOW_S`], the bucket at least
    :data:`MIN_BUCKET_S` and no longer than the window, and so at most :data:`MAX_BUCKETS`
    buckets."""
    if not (math.isfinite(window_s) and 0 < window_s <= MAX_WINDOW_S):
        return "window_s", f"must be more than 0 and at most {MAX_WINDOW_S:g}"
    if not (math.isfinite(bucket_s) and bucket_s >= MIN_BUCKET_S):
        return "bucket_s", f"must be at least {MIN_BUCKET_S:g}"
    if bucket_s > window_s:
        return "bucket_s", "must not be longer than window_s"
    return None


def percentile(sorted_values: Sequence[float], fraction: float) -> float | None:
    """The nearest-rank percentile of already sorted values (None when there are none)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


class Activity:
    """The ring of a replica's outcomes and its summaries. Touched only by the event
    loop's thread (as the rest of
    :class:`~reservoir.service.reservoir_service.ReservoirService`)."""

    def __init__(
        self, capacity: int = ACTIVITY_CAPACITY, now: Callable[[], float] = time.monotonic
    ) -> None:
        self.now = now
        self.outcomes: deque[Outcome] = deque(maxlen=capacity)

    def placed(
        self,
        request_id: str,
        elapsed_s: float,
        nodes: Sequence[str],
        *,
        partial: bool = False,
    ) -> None:
        self.outcomes.append(
            Outcome(self.now(), "placed", elapsed_s, request_id, tuple(nodes), len(nodes), partial)
        )

    def failed(self, request_id: str, elapsed_s: float, reason: str) -> None:
        self.outcomes.append(Outcome(self.now(), reason, elapsed_s, request_id))

    def summary(self, window_s: float = 300.0, bucket_s: float = 10.0) -> dict[str, Any]:
        """The window's outcomes in the dashboard's shape. Raises :class:`ValueError` for
        a window or bucket :func:`span_problem` refuses."""
        refused = span_problem(window_s, bucket_s)
        if refused is not None:
            raise ValueError(f"{refused[0]} {refused[1]}")
        now = self.now()
        since = now - window_s
        seen = [o for o in self.outcomes if o.at >= since]
        placed = [o for o in seen if o.result == "placed"]
        latencies = sorted(o.elapsed_s for o in placed)
        buckets = max(1, math.ceil(window_s / bucket_s))
        counts = [0] * buckets
        for o in placed:
            index = min(buckets - 1, int((now - o.at) / bucket_s))
            counts[buckets - 1 - index] += 1
        failures: dict[str, int] = {}
        for o in seen:
            if o.result != "placed":
                failures[o.result] = failures.get(o.result, 0) + 1
        # the rate over the last minute, or over what the replica has seen when less
        last_minute = [o for o in placed if o.at >= now - 60.0]
        reaches_s = now - self.outcomes[0].at if self.outcomes else 0.0
        rate_span = min(60.0, window_s, max(reaches_s, bucket_s))
        p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
        return {
            "scope": "replica",
            "window_s": window_s,
            "reaches_s": round(min(reaches_s, window_s), 3),
            "attempts": len(seen),
            "placed": len(placed),
            "placements_per_s": round(len(last_minute) / rate_span, 3),
            "p50_s": None if p50 is None else round(p50, 4),
            "p99_s": None if p99 is None else round(p99, 4),
            "bucket_s": bucket_s,
            "placed_per_bucket": counts,
            "failures": dict(sorted(failures.items(), key=lambda item: (-item[1], item[0]))),
            "recent": [
                {
                    "request_id": o.request_id,
                    "result": o.result,
                    "nodes": sorted(set(o.nodes)),
                    "instances": o.instances,
                    "partial": o.partial,
                    "elapsed_s": round(o.elapsed_s, 4),
                    "age_s": round(now - o.at, 1),
                }
                for o in list(self.outcomes)[-RECENT:][::-1]
            ],
        }
