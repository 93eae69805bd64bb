"""The engines' two-level event queue gives events in exactly the order one heap gives."""

from __future__ import annotations

import heapq
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from reservoir.tools.simulator.calendar import LaterSeconds

SPILL = -9


def marker(second: int) -> tuple[Any, ...]:
    return (float(second), -1, SPILL, second)


delays = st.one_of(
    st.floats(min_value=0.0, max_value=30.0, allow_nan=False),
    st.integers(min_value=0, max_value=30).map(float),  # onto the buckets' edges
)
#: each step: how many events to pop, then new events, each as a delay from the current
#: time and whether it bypasses the buckets (the engines push messages straight in)
steps = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=4),
        st.lists(st.tuples(delays, st.booleans()), max_size=5),
    ),
    max_size=60,
)

Steps = list[tuple[int, list[tuple[float, bool]]]]


def drain(
    steps: Steps,
    *,
    two_level: bool,
    start_s: float = 0.0,
    now_at_markers: bool = False,
) -> list[tuple[float, int]]:
    """Pop and push as ``steps`` say, then pop everything: the (time, sequence) order.
    ``now_at_markers``: the clock moves to a marker's time too, as the reservoir engine's
    does (the baselines' moves only at events)."""
    heap: list[tuple[Any, ...]] = []
    later = LaterSeconds(heap, marker)
    popped: list[tuple[float, int]] = []
    now = start_s
    sequence = 0

    def pop() -> bool:
        nonlocal now
        while heap:
            entry = heapq.heappop(heap)
            assert entry[0] >= now, "a marker or an event from the past"
            if entry[2] == SPILL:
                later.spill(entry[3])
                if now_at_markers:
                    now = entry[0]
                continue
            now = entry[0]
            popped.append((entry[0], entry[1]))
            return True
        return False

    for pops, pushes in steps:
        for _ in range(pops):
            pop()
        for delay, direct in pushes:
            sequence += 1
            entry = (now + delay, sequence, 0, None)
            if two_level and not direct:
                later.push(entry, now)
            else:
                heapq.heappush(heap, entry)
    while pop():
        pass
    assert len(later) == 0
    return popped


@settings(max_examples=300, deadline=None)
@given(
    steps,
    # negative and fractional starts: a second is the floor of a time, not its truncation
    st.one_of(st.floats(min_value=-5.0, max_value=5.0), st.integers(-5, 5).map(float)),
    st.booleans(),
)
def test_events_come_out_in_the_order_one_heap_gives(
    steps: Steps, start_s: float, now_at_markers: bool
) -> None:
    one_heap = drain(steps, two_level=False, start_s=start_s)
    assert drain(steps, two_level=True, start_s=start_s, now_at_markers=now_at_markers) == one_heap


def test_an_event_waiting_for_its_second_comes_out_before_a_later_one_due_then() -> None:
    # at 0 an event is pushed for 2.0 (it waits in second 2's bucket) and one for 1.5;
    # at 1.5 one more for 2.0 joins the bucket, and one for 1.5 goes straight in
    steps: Steps = [(0, [(2.0, False), (1.5, False)]), (1, [(0.5, False), (0.0, False)])]
    assert drain(steps, two_level=True) == [(1.5, 2), (1.5, 4), (2.0, 1), (2.0, 3)]
