"""A node's ledger: its inventories, the allocations it holds and its live reservations.

This is the source of truth for "is there room on this node". Its one rule, checked by
:meth:`Ledger.violations` and by every test's audit:

    for every resource class:  allocated + reserved-by-live-reservations <= capacity
    where capacity = floor((total - reserved) * allocation_ratio)

Capacity follows OpenStack Placement's inventory arithmetic (the reserved amount is set
aside before the ratio applies). Time enters only as arguments: a reservation is live while
``now < deadline`` and expired from its deadline on.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from reservoir.protocol.messages import AllocationInfo, NumaPlacement, Reason, TaskSpec
from reservoir.protocol.room import room_class

__all__ = [
    "Allocation",
    "Inventory",
    "Ledger",
    "Reservation",
    "ResourceUsage",
    "SlotFit",
]


@dataclass(frozen=True)
class Inventory:
    """How much of one resource class a node has, in the spirit of Placement's inventories."""

    total: int
    reserved: int = 0
    min_unit: int = 1
    max_unit: int | None = None
    step_size: int = 1
    allocation_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.total < 0 or self.reserved < 0:
            raise ValueError("total and reserved must not be negative")
        if self.reserved > self.total:
            raise ValueError(f"reserved ({self.reserved}) exceeds total ({self.total})")
        if self.min_unit < 1 or self.step_size < 1:
            raise ValueError("min_unit and step_size must be at least 1")
        if self.max_unit is not None and self.max_unit < self.min_unit:
            raise ValueError("max_unit must not be below min_unit")
        if not (self.allocation_ratio > 0 and math.isfinite(self.allocation_ratio)):
            raise ValueError("allocation_ratio must be a positive number")

    @functools.cached_property
    def capacity(self) -> int:
        # The epsilon keeps 0.1-style ratios from losing a unit to float rounding.
        return math.floor((self.total - self.reserved) * self.allocation_ratio + 1e-9)

    def unit_problem(self, amount: int) -> tuple[str, str] | None:
        """Why one instance can never take ``amount`` of this class here, as a reason code
        and a detail, or None."""
        max_unit = self.total if self.max_unit is None else self.max_unit
        if amount > max_unit:
            return "too_large", f"asks {amount}, the most one instance may take is {max_unit}"
        if amount < self.min_unit:
            return "unit", f"asks {amount}, below the minimum unit {self.min_unit}"
        if amount % self.step_size:
            return "unit", f"asks {amount}, not a multiple of the step size {self.step_size}"
        return None


@dataclass(frozen=True, slots=True)
class Allocation:
    """One instance placed on this node. Durable: it survives the node agent's restart.

    Slotted: a simulated cloud of 100,000 nodes holds 1.75 million of them per run."""

    allocation_id: str
    request_id: str
    reservation_id: str
    #: requestor id that was awarded it (who may free it)
    owner: str
    resources: Mapping[str, int]
    #: the request's ``count``, kept so an audit can spot a request placed twice
    request_count: int = 1
    group: str | None = None
    numa: NumaPlacement | None = None
    #: a Lookup for the id must find it; not stored, so allocations loaded after a
    #: restart are findable, whatever their request was
    findable: bool = field(default=True, compare=False)
    #: when its requestor was asked to place the request (the award's ``requested_at_s``,
    #: seconds since the epoch): of two placements of one id, the later one stands
    requested_at_s: float = 0.0
    #: the work the node runs in this instance, if the request carried one
    task: TaskSpec | None = None
    #: where the task's state goes: the reply address of the requestor that placed it
    reply_to: str | None = None

    def info(self) -> AllocationInfo:
        return AllocationInfo(
            allocation_id=self.allocation_id, resources=dict(self.resources), numa=self.numa
        )


@dataclass
class Reservation:
    """Room held for ``slots`` instances of one request until ``deadline``."""

    reservation_id: str
    request_id: str
    #: requestor id and reply address: only its owner may award or release it
    owner: str
    reply_to: str
    slots: int
    per_instance: Mapping[str, int]
    deadline: float
    request_count: int = 1
    group: str | None = None
    numa: tuple[NumaPlacement, ...] = ()
    #: a requestor with precedence is placing the same request id: refuse our owner's award
    superseded_by: str | None = None
    #: a Lookup for the id must find it (see ``ReservationRequest.findable``)
    findable: bool = False
    #: a Lookup must find what it becomes (``ReservationRequest.findable_when_placed``)
    findable_when_placed: bool = False
    #: the work each instance runs once awarded
    task: TaskSpec | None = None

    def holds(self) -> dict[str, int]:
        return {rc: amount * self.slots for rc, amount in self.per_instance.items()}


@dataclass(frozen=True)
class ResourceUsage:
    """One resource class of a node: ``capacity`` (what may be allocated), what the
    allocations hold (``allocated``) and what live reservations hold (``reserved``, the
    protocol's word; operators see it as ``held``); and the inventory it comes from:
    ``total``, host-``reserved`` capacity (Placement's meaning: ``host_reserved`` here)
    and ``allocation_ratio``."""

    capacity: int
    allocated: int
    reserved: int
    total: int = 0
    host_reserved: int = 0
    allocation_ratio: float = 1.0

    @property
    def free(self) -> int:
        return self.capacity - self.allocated - self.reserved


@dataclass(slots=True)
class SlotFit:
    """How many instances of a shape fit, and when none do, why."""

    slots: int
    reasons: tuple[Reason, ...] = ()
    #: resource fit ignoring live reservations: > 0 means "busy, try again shortly"
    slots_without_reservations: int = 0


@dataclass
class Ledger:
    """Inventories, allocations and reservations of one node, with indexes kept in step."""

    inventories: Mapping[str, Inventory]
    allocations: dict[str, Allocation] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    _allocated: Counter[str] = field(default_factory=Counter)
    _reserved: Counter[str] = field(default_factory=Counter)
    #: allocation ids by request and by reservation, as tuples: nearly every id holds one
    #: allocation on a node, and a one-item tuple is a quarter of a one-item set (a
    #: simulated cloud of 100,000 nodes holds 1.75 million allocations, each in both)
    _allocations_by_request: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _allocations_by_reservation: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _reservation_by_request: dict[str, str] = field(default_factory=dict)
    _group_members: Counter[str] = field(default_factory=Counter)
    _utilisation: float | None = None
    _allocated_share: float | None = None
    _room: dict[str, int] | None = None
    #: request ids whose findable reservation or allocations came or went since the last
    #: drain (only those can change what a lookup bucket must hold; most ids are the
    #: requestors' own, which no Lookup looks for)
    _touched: set[str] = field(default_factory=set)
    #: the addresses of the PCI devices the node may hand out (None: it names none), for
    #: :meth:`violations`: a device held must be one of them
    devices: frozenset[str] | None = None
    #: PCI devices held by allocations and reservations together, counted with
    #: repeats: while it is 0 no device can be held twice or be another node's
    _devices_held: int = 0

    @classmethod
    def with_allocations(
        cls, inventories: Mapping[str, Inventory], allocations: Iterable[Allocation]
    ) -> Ledger:
        ledger = cls(dict(inventories))
        for allocation in allocations:
            ledger.add_allocation(allocation)
        return ledger

    # -- reading ---------------------------------------------------------------------

    def usage(self, resource_class: str) -> ResourceUsage:
        inventory = self.inventories.get(resource_class)
        if inventory is None:
            return ResourceUsage(
                capacity=0,
                allocated=self._allocated[resource_class],
                reserved=self._reserved[resource_class],
            )
        return ResourceUsage(
            capacity=inventory.capacity,
            allocated=self._allocated[resource_class],
            reserved=self._reserved[resource_class],
            total=inventory.total,
            host_reserved=inventory.reserved,
            allocation_ratio=inventory.allocation_ratio,
        )

    def allocated(self, resource_class: str) -> int:
        """Units of ``resource_class`` the allocations hold (``usage`` without the rest)."""
        return self._allocated[resource_class]

    def reserved(self, resource_class: str) -> int:
        """Units of ``resource_class`` live reservations hold."""
        return self._reserved[resource_class]

    def usages(self) -> dict[str, ResourceUsage]:
        classes = set(self.inventories) | set(self._allocated) | set(self._reserved)
        return {rc: self.usage(rc) for rc in sorted(classes)}

    def utilisation(self) -> float:
        """Dominant share: the largest (allocated + reserved) / capacity over the classes."""
        # Asked several times per message (the offer, the tier): computed once per change.
        if self._utilisation is None:
            self._utilisation = self._dominant_share(with_reservations=True)
        return self._utilisation

    def allocated_share(self) -> float:
        """Dominant share of the allocations alone, leaving out live reservations: what
        a node's tier follows, so that a reservation made and released a moment later
        does not move the node across a tier boundary and back."""
        if self._allocated_share is None:
            self._allocated_share = self._dominant_share(with_reservations=False)
        return self._allocated_share

    def room(self) -> dict[str, int]:
        """The room requestors are told of (:mod:`reservoir.protocol.room`): per resource
        class, the class of what the allocations leave free."""
        if self._room is None:
            self._room = {
                rc: room_class(inventory.capacity - self._allocated[rc])
                for rc, inventory in sorted(self.inventories.items())
            }
        return self._room

    def _dominant_share(self, *, with_reservations: bool) -> float:
        share = 0.0
        for rc, inventory in self.inventories.items():
            capacity = inventory.capacity
            if capacity > 0:
                used = self._allocated[rc] + (self._reserved[rc] if with_reservations else 0)
                share = max(share, used / capacity)
        return share

    def fit(self, per_instance: Mapping[str, int], max_slots: int) -> SlotFit:
        """How many instances of ``per_instance`` fit in what is free, up to ``max_slots``."""
        slots = max_slots
        slots_without = max_slots
        reasons: list[Reason] = []
        for rc, amount in sorted(per_instance.items()):
            if amount <= 0:
                continue
            inventory = self.inventories.get(rc)
            if inventory is None:
                reasons.append(
                    Reason(
                        code="missing", subject=rc, shortfall=amount, detail=f"the node has no {rc}"
                    )
                )
                slots = slots_without = 0
                continue
            problem = inventory.unit_problem(amount)
            if problem is not None:
                code, detail = problem
                reasons.append(Reason(code=code, subject=rc, detail=f"{rc}: {detail}"))
                slots = slots_without = 0
                continue
            # the counters, read directly: a ResourceUsage per class per probe cost more
            capacity = inventory.capacity
            allocated = self._allocated[rc]
            reserved = self._reserved[rc]
            free = max(capacity - allocated - reserved, 0)
            fits = free // amount
            fits_without = max(capacity - allocated, 0) // amount
            if fits < slots:
                slots = fits
            if fits_without < slots_without:
                slots_without = fits_without
            if fits == 0:
                reasons.append(
                    Reason(
                        code="insufficient",
                        subject=rc,
                        shortfall=amount - free,
                        detail=f"{rc}: need {amount}, free {free} of "
                        f"{capacity} ({reserved} reserved by others)",
                    )
                )
        if slots > 0:
            reasons = []
        return SlotFit(
            slots=slots, reasons=tuple(reasons), slots_without_reservations=slots_without
        )

    def allocations_for(self, request_id: str) -> list[Allocation]:
        ids = self._allocations_by_request.get(request_id)
        if not ids:  # every probe asks, and nearly always of an id not placed here
            return []
        return [self.allocations[a] for a in sorted(ids)]

    def allocations_from(self, reservation_id: str) -> list[Allocation]:
        ids = self._allocations_by_reservation.get(reservation_id, ())
        return [self.allocations[a] for a in sorted(ids)]

    def reservation_for(self, request_id: str) -> Reservation | None:
        reservation_id = self._reservation_by_request.get(request_id)
        return None if reservation_id is None else self.reservations[reservation_id]

    def holds_findable(self, request_id: str) -> bool:
        """Whether a reservation or an allocation of ``request_id`` that a Lookup must find
        is held here."""
        reservation = self.reservation_for(request_id)
        if reservation is not None and reservation.findable:
            return True
        held = self._allocations_by_request.get(request_id)
        return held is not None and any(self.allocations[a].findable for a in held)

    def drain_touched(self) -> set[str]:
        """The request ids whose findable holdings changed since the last call (and forget
        them)."""
        touched = self._touched
        if touched:  # most calls find nothing: keep the empty set rather than make one
            self._touched = set()
        return touched

    def group_members(self, group: str) -> int:
        """Instances of ``group`` this node hosts or holds a reservation for."""
        return self._group_members[group]

    def next_deadline(self) -> float | None:
        return min((r.deadline for r in self.reservations.values()), default=None)

    def expired(self, now: float) -> list[Reservation]:
        return [r for r in self.reservations.values() if r.deadline <= now]

    def numa_placements(self) -> Iterator[NumaPlacement]:
        """Every NUMA placement held, by allocations and live reservations alike."""
        for allocation in self.allocations.values():
            if allocation.numa is not None:
                yield allocation.numa
        for reservation in self.reservations.values():
            yield from reservation.numa

    def violations(self) -> list[str]:
        """Every way this ledger breaks the no-overcommit rule (empty when it holds)."""
        problems = []
        for rc, usage in self.usages().items():
            if usage.allocated + usage.reserved > usage.capacity:
                problems.append(
                    f"{rc}: allocated {usage.allocated} + reserved {usage.reserved} "
                    f"> capacity {usage.capacity}"
                )
        return problems + self._device_violations()

    def overcommitted(self) -> bool:
        """Whether :meth:`violations` finds anything, without building its words: asked
        for every request a node hears, so it looks at the few classes held and, only when
        PCI devices are held at all, at the devices."""
        inventories = self.inventories
        reserved = self._reserved
        for rc, allocated in self._allocated.items():
            inventory = inventories.get(rc)
            if allocated + reserved[rc] > (inventory.capacity if inventory is not None else 0):
                return True
        for rc, units in reserved.items():
            inventory = inventories.get(rc)
            if units and self._allocated[rc] + units > (
                inventory.capacity if inventory is not None else 0
            ):
                return True
        return self._devices_held > 0 and bool(self._device_violations())

    def _device_violations(self) -> list[str]:
        """PCI devices held twice (by allocations and live reservations together), or held
        and not the node's."""
        holders: dict[str, list[str]] = {}
        for allocation in self.allocations.values():
            if allocation.numa is not None:
                for address in allocation.numa.devices:
                    holders.setdefault(address, []).append(allocation.allocation_id)
        for reservation in self.reservations.values():
            for placement in reservation.numa:
                for address in placement.devices:
                    holders.setdefault(address, []).append(reservation.reservation_id)
        problems = []
        for address, held_by in sorted(holders.items()):
            if len(held_by) > 1:
                problems.append(f"PCI device {address} held {len(held_by)} times: {held_by}")
            if self.devices is not None and address not in self.devices:
                problems.append(f"PCI device {address} held by {held_by}: not the node's")
        return problems

    # -- changing --------------------------------------------------------------------

    def add_reservation(self, reservation: Reservation) -> None:
        if reservation.reservation_id in self.reservations:
            raise ValueError(f"reservation {reservation.reservation_id} exists")
        if reservation.request_id in self._reservation_by_request:
            raise ValueError(f"request {reservation.request_id} already holds a reservation")
        self.reservations[reservation.reservation_id] = reservation
        _add(self._reserved, reservation.holds(), 1)
        self._utilisation = None
        if reservation.numa:
            self._devices_held += sum(len(p.devices) for p in reservation.numa)
        self._reservation_by_request[reservation.request_id] = reservation.reservation_id
        if reservation.findable:
            self._touched.add(reservation.request_id)
        if reservation.group is not None:
            self._group_members[reservation.group] += reservation.slots

    def pop_reservation(self, reservation_id: str) -> Reservation | None:
        reservation = self.reservations.pop(reservation_id, None)
        if reservation is None:
            return None
        _add(self._reserved, reservation.holds(), -1)
        self._utilisation = None
        if reservation.numa:
            self._devices_held -= sum(len(p.devices) for p in reservation.numa)
        del self._reservation_by_request[reservation.request_id]
        if reservation.findable:
            self._touched.add(reservation.request_id)
        if reservation.group is not None:
            self._group_members[reservation.group] -= reservation.slots
        return reservation

    def add_allocation(self, allocation: Allocation) -> None:
        if allocation.allocation_id in self.allocations:
            raise ValueError(f"allocation {allocation.allocation_id} exists")
        self.allocations[allocation.allocation_id] = allocation
        _add(self._allocated, allocation.resources, 1)
        if allocation.numa is not None:
            self._devices_held += len(allocation.numa.devices)
        self._utilisation = self._allocated_share = self._room = None
        _index(self._allocations_by_request, allocation.request_id, allocation.allocation_id)
        _index(
            self._allocations_by_reservation, allocation.reservation_id, allocation.allocation_id
        )
        if allocation.findable:
            self._touched.add(allocation.request_id)
        if allocation.group is not None:
            self._group_members[allocation.group] += 1

    def remove_allocation(self, allocation_id: str) -> Allocation | None:
        allocation = self.allocations.pop(allocation_id, None)
        if allocation is None:
            return None
        _add(self._allocated, allocation.resources, -1)
        if allocation.numa is not None:
            self._devices_held -= len(allocation.numa.devices)
        self._utilisation = self._allocated_share = self._room = None
        _discard(self._allocations_by_request, allocation.request_id, allocation_id)
        _discard(self._allocations_by_reservation, allocation.reservation_id, allocation_id)
        if allocation.findable:
            self._touched.add(allocation.request_id)
        if allocation.group is not None:
            self._group_members[allocation.group] -= 1
        return allocation


def _add(totals: Counter[str], amounts: Mapping[str, int], sign: int) -> None:
    """``totals`` plus (or minus) ``amounts``: ``Counter.update`` first asks whether its
    argument is a Mapping, an ABC check dearer than the two or three additions."""
    for resource_class, amount in amounts.items():
        totals[resource_class] += sign * amount


def _index(index: dict[str, tuple[str, ...]], key: str, value: str) -> None:
    members = index.get(key)
    # a request's allocations on one node are a handful at most: copying is cheap
    index[key] = (value,) if members is None else (*members, value)


def _discard(index: dict[str, tuple[str, ...]], key: str, value: str) -> None:
    members = index.get(key)
    if members is not None and value in members:
        kept = tuple(m for m in members if m != value)
        if kept:
            index[key] = kept
        else:
            del index[key]
