"""The garbage-collector policy during a run.

A run at 100,000 nodes holds tens of millions of long-lived objects (machines, ledgers,
allocations, rosters). Python's cyclic collector keeps rescanning them: measured at 60,000
nodes, its collections made the arrival loop five times slower and the start-up twice as
slow. Neither the protocol machines nor the engines create reference cycles per message
(reference counting frees everything they drop; peak memory was the same with the
collector on and off), so a run pauses the collector and restores it afterwards.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused", "roster_bytes_per_entry"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block (reference counting goes on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def roster_bytes_per_entry(entries: int = 20_000) -> float:
    """What one node costs a requestor's roster, measured: a roster of ``entries`` nodes
    with names and addresses like the simulator's, built under tracemalloc."""
    import tracemalloc

    from reservoir.protocol.addresses import node_address
    from reservoir.protocol.roster import Roster, Sampler
    from reservoir.protocol.tiers import DEFAULT_LADDER

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        roster = Roster(DEFAULT_LADDER, Sampler(0))
        for i in range(entries):
            name = f"node-{i}"
            roster.update(name, node_address(name), 100, {"VCPU": i % 6, "MEMORY_MB": i % 12})
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del roster
    return used / entries
