"""The node's per-request check that it holds no more than it has
(:meth:`Ledger.overcommitted`) says what the full account (:meth:`Ledger.violations`)
says, on any ledger: held over a smaller inventory or not, with PCI devices held twice or
held and not the node's, after any adds and removals."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from reservoir.protocol.ledger import Allocation, Inventory, Ledger, Reservation
from reservoir.protocol.messages import NumaPlacement

DEVICES = ("0000:3b:00.0", "0000:3b:00.1", "0000:af:00.0")

resources = st.dictionaries(
    st.sampled_from(["VCPU", "MEMORY_MB", "DISK_GB"]), st.integers(0, 6), max_size=3
)
numa = st.one_of(
    st.none(),
    st.lists(st.sampled_from(DEVICES), max_size=2).map(
        lambda devices: NumaPlacement(cells=(), devices=tuple(devices))
    ),
)
inventories = st.dictionaries(
    st.sampled_from(["VCPU", "MEMORY_MB"]),
    st.integers(0, 12).map(lambda total: Inventory(total=total)),
    max_size=2,
)


@given(
    inventories,
    st.lists(st.tuples(resources, numa), max_size=6),
    st.lists(st.tuples(resources, numa, st.integers(1, 2)), max_size=4),
    st.sets(st.integers(0, 5)),
    st.one_of(st.none(), st.sets(st.sampled_from(DEVICES)).map(frozenset)),
)
def test_the_quick_check_agrees_with_the_full_account(
    inventory: dict[str, Inventory],
    held: list[tuple[dict[str, int], NumaPlacement | None]],
    reserved: list[tuple[dict[str, int], NumaPlacement | None, int]],
    removed: set[int],
    devices: frozenset[str] | None,
) -> None:
    ledger = Ledger(inventory, devices=devices)
    for i, (amounts, placement) in enumerate(held):
        ledger.add_allocation(
            Allocation(f"a{i}", f"q{i}", f"r{i}", "owner", amounts, numa=placement)
        )
    for i, (amounts, placement, slots) in enumerate(reserved):
        ledger.add_reservation(
            Reservation(
                f"res{i}", f"p{i}", "owner", "reply", slots, amounts, deadline=10.0,
                numa=(placement,) * slots if placement is not None else (),
            )
        )  # fmt: skip
    assert ledger.overcommitted() == bool(ledger.violations())
    for i in removed:
        ledger.remove_allocation(f"a{i}")
        ledger.pop_reservation(f"res{i}")
        assert ledger.overcommitted() == bool(ledger.violations())
