"""How the bench's requestors place, in this process and in requestor-host processes alike.

This module owns the one flavour the bench places and how long it may take
(:func:`place_one`), how a run is split between requestors (:func:`shares_of`) and
placed by them a thread each (:func:`place_in_threads`), and when a requestor is ready
(:func:`wait_for_roster`): so that the sequential run, the throughput run's threads and the
requestor processes ask alike.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from reservoir.protocol.placement import PlacementError
from reservoir.runtime.requestor import Requestor
from reservoir.tools.bench.errors import BenchError

__all__ = [
    "FLAVOUR_MEMORY_MB",
    "FLAVOUR_VCPUS",
    "PLACE_TIMEOUT_S",
    "READY_TIMEOUT_S",
    "WARMUP_PLACEMENTS",
    "place_in_threads",
    "place_one",
    "place_timed",
    "roster_wanted",
    "shares_of",
    "wait_for_roster",
]

#: the one flavour placed: single-instance, small
FLAVOUR_VCPUS: Final = 1
FLAVOUR_MEMORY_MB: Final = 1024
#: placements each requestor makes before it is measured (latency estimates settle)
WARMUP_PLACEMENTS: Final = 20
#: the longest one placement may take
PLACE_TIMEOUT_S: Final = 30.0
#: the longest a requestor (or a host of them) may take to know the nodes
READY_TIMEOUT_S: Final = 60.0


def place_one(
    requestor: Requestor, *, explain: bool = False, timeout_s: float = PLACE_TIMEOUT_S
) -> None:
    """One placement of the bench's flavour; raises :class:`PlacementError` if it fails."""
    requestor.reserve(
        vcpus=FLAVOUR_VCPUS, memory_mb=FLAVOUR_MEMORY_MB, explain=explain, timeout_s=timeout_s
    )


def shares_of(placements: int, requestors: int) -> list[int]:
    """``placements`` split between ``requestors`` as evenly as whole numbers allow."""
    return [
        placements // requestors + (1 if index < placements % requestors else 0)
        for index in range(requestors)
    ]


def place_timed(
    requestor: Requestor, count: int, on_placed: Callable[[], None] | None = None
) -> tuple[list[float], int]:
    """``count`` placements one after the other: the seconds each placed one took, and how
    many failed. ``on_placed`` is called after each, placed or not."""
    latencies_s: list[float] = []
    failed = 0
    for _ in range(count):
        started = time.perf_counter()
        try:
            place_one(requestor)
        except PlacementError:
            failed += 1
        else:
            latencies_s.append(time.perf_counter() - started)
        if on_placed is not None:
            on_placed()
    return latencies_s, failed


def place_in_threads(
    requestors: Sequence[Requestor],
    placements: int,
    *,
    warm_up: int = 0,
    begin: Callable[[], None] | None = None,
    on_placed: Callable[[], None] | None = None,
) -> tuple[list[float], int]:
    """Each requestor places its share of ``placements`` in a thread of its own, after
    ``warm_up`` unmeasured placements; ``begin`` runs once, when every thread has warmed
    up and before any measured placement starts (where a caller starts its clocks);
    ``on_placed`` after each measured placement, on the thread that made it. Returns the
    seconds each placement took and how many failed."""
    start = threading.Barrier(len(requestors), action=begin)
    lock = threading.Lock()
    latencies_s: list[float] = []
    failures = [0]

    def worker(requestor: Requestor, share: int) -> None:
        for _ in range(warm_up):
            with contextlib.suppress(PlacementError):
                place_one(requestor)
        start.wait()
        mine, failed = place_timed(requestor, share, on_placed)
        with lock:
            latencies_s.extend(mine)
            failures[0] += failed

    threads = [
        threading.Thread(target=worker, args=(requestor, share), name=f"bench-requestor-{i}")
        for i, (requestor, share) in enumerate(
            zip(requestors, shares_of(placements, len(requestors)), strict=True)
        )
    ]
    for thread in threads:
        thread.daemon = True
        thread.start()
    for thread in threads:
        thread.join()
    return latencies_s, failures[0]


def roster_wanted(requestor: Requestor, nodes: int) -> int | None:
    """How many nodes a ready requestor knows: every one when it follows the
    announcements, a keeper's full sample when it takes its roster from a keeper; None
    while it does not know which yet (its first query is on its way)."""
    machine = requestor.machine
    source = machine.roster_source.state
    if source == "asking":
        return None
    return nodes if source == "announcements" else min(nodes, machine.config.keeper_sample)


def wait_for_roster(requestor: Requestor, nodes: int, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until the requestor knows the nodes (roll call answers and announcements, or a
    keeper's sample); :class:`BenchError` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        wanted = roster_wanted(requestor, nodes)
        if wanted is not None and len(requestor.machine.roster) >= wanted:
            return
        if time.monotonic() > deadline:
            where = requestor.machine.roster_source.state
            raise BenchError(
                f"{requestor.name} knew {len(requestor.machine.roster)} of "
                f"{wanted if wanted is not None else nodes} nodes within {timeout_s:.0f} s "
                f"(its roster from: {where})"
            )
        time.sleep(0.01)
