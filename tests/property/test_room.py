"""A node's room never rules it out for a shape it can take: sampling by room cannot hide
a node where the request fits (the exhaustive step is for stale rooms, not for the rule)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from reservoir.protocol.ledger import Allocation, Inventory, Ledger
from reservoir.protocol.room import may_fit

CLASSES = ("VCPU", "MEMORY_MB", "DISK_GB", "CUSTOM_GPU")

inventories = st.dictionaries(
    st.sampled_from(CLASSES),
    st.builds(
        lambda total, ratio: Inventory(total=total, allocation_ratio=ratio),
        st.integers(0, 100_000),
        st.sampled_from([1.0, 1.5, 4.0, 16.0]),
    ),
    min_size=1,
)
shapes = st.dictionaries(st.sampled_from(CLASSES), st.integers(0, 70_000), min_size=1)


@given(inventories, st.lists(shapes, max_size=6), shapes)
def test_a_node_that_can_take_a_shape_is_never_ruled_out_by_its_room(
    inventory: dict[str, Inventory], held: list[dict[str, int]], shape: dict[str, int]
) -> None:
    ledger = Ledger(dict(inventory))
    for index, resources in enumerate(held):
        # Allocations as they stood when placed: only those that fitted then.
        if ledger.fit(resources, 1).slots:
            ledger.add_allocation(
                Allocation(
                    allocation_id=f"a{index}",
                    request_id=f"r{index}",
                    reservation_id=f"res{index}",
                    owner="requestor",
                    resources=resources,
                    request_count=1,
                )
            )
    if ledger.fit(shape, 1).slots > 0:
        assert may_fit(ledger.room(), shape), (ledger.room(), shape)
