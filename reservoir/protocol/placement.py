"""A placement as the caller sees it: the :class:`PlacementRequest` going in, and the
:class:`Placement` or :class:`PlacementError` coming out. An error explains what was tried
("tiers 10%..100% tried, 3 offers; VCPU exhausted on 37 nodes, trait HW_GPU missing on 12").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from reservoir.protocol.messages import (
    Identifier,
    InstanceShape,
    InvalidField,
    NumaPlacement,
    Reason,
    TaskState,
    check_ids,
    validation_error_at,
)

__all__ = [
    "FRONT_DOOR_LIMITS",
    "SHORTHAND_CLASSES",
    "Explanation",
    "Holdings",
    "InvalidRequest",
    "PlacedAllocation",
    "Placement",
    "PlacementError",
    "PlacementRequest",
    "PlacementTimeout",
    "checked_request",
    "reason_label",
    "request_of",
]


class PlacementRequest(InstanceShape, frozen=True, kw_only=True):
    """What a caller asks for. ``request_id`` is the idempotency key: asking again with the
    same id returns the existing placement instead of placing again.

    Constructing one checks how the fields fit together; :func:`checked_request` checks
    each field too, and a requestor does so before it places anything."""

    request_id: Identifier | None = None


class InvalidRequest(InvalidField):
    """A request no node would accept, found by :func:`checked_request`. ``field`` names
    the field (dotted, empty for the request as a whole) and ``problem`` says what is
    wrong with it."""


def checked_request(request: PlacementRequest) -> PlacementRequest:
    """``request`` with every field checked as a node will check it (types, ranges, the
    patterns of ids and traits, JSON hints); raises :class:`InvalidRequest`, e.g.
    ``count: Expected `int` <= 10000``."""
    try:
        # A round trip through the wire format: exactly the checks a node's decoding makes
        checked = msgspec.json.decode(msgspec.json.encode(request), type=PlacementRequest)
        check_ids(checked)
    except msgspec.ValidationError as error:
        raise InvalidRequest(*validation_error_at(error)) from None
    except InvalidField as error:
        raise InvalidRequest(error.field, error.problem) from None
    except (msgspec.EncodeError, TypeError) as error:
        raise InvalidRequest("hints", f"not JSON: {error}") from None
    return checked


#: The shorthands every front door takes for the three commonest resource classes
#: (``vcpus=2`` is ``resources={"VCPU": 2}``): the one mapping of them.
SHORTHAND_CLASSES: Final[Mapping[str, str]] = {
    "vcpus": "VCPU",
    "memory_mb": "MEMORY_MB",
    "disk_gb": "DISK_GB",
}

#: The most one request through a front door may ask for: ``POST /v1/reservations``
#: refuses more (its body's limits, reservoir/service/shapes.py), and ``reservoir
#: request`` and ``reservoir run`` refuse the same, so that no front door takes what
#: another refuses. (The wire allows more instances, 10,000: the library's own callers.)
FRONT_DOOR_LIMITS: Final[Mapping[str, int]] = {
    "count": 1000,
    "vcpus": 2**20,
    "memory_mb": 2**40,
    "disk_gb": 2**40,
}


def request_of(**fields: Any) -> PlacementRequest:
    """The request a front door's caller described, checked: the one way the library's
    keywords, ``reservoir request`` and ``POST /v1/reservations`` build a
    :class:`PlacementRequest`, so that the same words make the same request everywhere.

    ``fields`` are :class:`PlacementRequest`'s (a new field is reachable from every front
    door that passes it on) and the shorthands of :data:`SHORTHAND_CLASSES`; ``None``
    means not given. A shorthand and ``resources`` giving one class two different amounts
    is an :class:`InvalidRequest`, as is every shape :func:`checked_request` refuses
    (resource classes and traits are taken as written: ``vcpu`` is not ``VCPU``)."""
    given = {name: value for name, value in fields.items() if value is not None}
    resources = dict(given.pop("resources", None) or {})
    for name, resource_class in SHORTHAND_CLASSES.items():
        amount = given.pop(name, None)
        if amount is None:
            continue
        if resources.setdefault(resource_class, amount) != amount:
            raise InvalidRequest(
                "resources",
                f"{name}={amount} and {resource_class}={resources[resource_class]} disagree: "
                "give the amount once",
            )
    try:
        request = PlacementRequest(resources=resources, **given)
    except TypeError as error:  # a field PlacementRequest does not have
        raise TypeError(f"not a field of a request: {error}") from None
    except ValueError as error:  # how the fields fit together
        raise InvalidRequest("", str(error)) from None
    return checked_request(request)


@dataclass(frozen=True)
class PlacedAllocation:
    """One instance of a placement: which node holds it, and what it holds."""

    node: str
    #: the node's address, where frees go
    address: str
    allocation_id: str
    resources: Mapping[str, int]
    numa: NumaPlacement | None = None


@dataclass(frozen=True)
class Placement:
    """A placed request. ``allocations`` has one entry per instance."""

    request_id: str
    allocations: tuple[PlacedAllocation, ...]
    #: instances asked for (``count``); fewer were placed only when ``min_count`` allowed it
    requested: int
    tiers_tried: tuple[int, ...] = ()
    attempts: int = 1
    elapsed_s: float = 0.0
    #: offers the requestor received while placing it
    offers_received: int = 0
    #: when a requestor was asked for the placement its allocations belong to (seconds
    #: since the epoch): of two placements of one id, the later one stands
    requested_at_s: float = 0.0

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes holding the instances, one entry per instance."""
        return tuple(a.node for a in self.allocations)

    @property
    def partial(self) -> bool:
        return len(self.allocations) < self.requested


_LABELS: Mapping[str, str] = {
    "insufficient": "{subject} exhausted",
    "missing": "no {subject} inventory",
    "too_large": "{subject} larger than one instance may take",
    "unit": "{subject} amount off the inventory's min_unit/step_size",
    "trait_missing": "trait {subject} missing",
    "trait_forbidden": "forbidden trait {subject} present",
    "anti_affinity": "anti-affinity group {subject} already on the node",
    "affinity": "affinity group {subject} does not fit on one node",
    "numa": "NUMA topology cannot fit it",
    "pci": "no free {subject} where its NUMA policy allows",
    "overcommitted": "node holds more than its inventory",
    "feature": "the node's release does not know {subject}",
    "task_driver": "no {subject} task driver",
}


@dataclass(frozen=True)
class Holdings:
    """What the nodes hold of one request id, as a find heard it."""

    request_id: str
    #: the allocations heard, as a placement (None: no allocation heard)
    placement: Placement | None
    #: the tasks of the id's instances the holders reported, by node and allocation
    tasks: tuple[TaskState, ...] = ()
    #: every holder answered (or no node holds anything of the id): the answer is exact.
    #: False when the deadline came first: then nothing is known of what was not heard
    settled: bool = True
    #: a requestor a node holds a reservation of the id for: it is being placed
    placing: str | None = None

    @property
    def held(self) -> bool:
        """Something of the id is held: an allocation, or a task remembered."""
        return self.placement is not None or bool(self.tasks)


def reason_label(reason: Reason) -> str:
    """A short phrase to count nodes under, e.g. ``VCPU exhausted``."""
    if reason.code in ("pci", "task_not_allowed") and reason.detail:
        # the detail says which cells lacked the device ("no free gpu-a100 on the NUMA
        # cell of 4 free dedicated CPUs"), or what the node's policy refuses ("the image
        # 'alpine' is not allowed"), which is what an operator needs to know
        return reason.detail
    template = _LABELS.get(reason.code)
    if template is None:
        return reason.code if reason.subject is None else f"{reason.code} {reason.subject}"
    return template.format(subject=reason.subject or "?")


@dataclass(frozen=True)
class Explanation:
    """Why a request was not placed, from the requestor's view of the conversation."""

    request_id: str
    wanted: int
    found: int
    tiers_tried: tuple[int, ...]
    offers_received: int
    declines_received: int = 0
    busy_nodes: int = 0
    #: reason label -> how many nodes gave it (only when the request asked to explain)
    reasons: Mapping[str, int] = field(default_factory=dict)
    #: a one-line cause from the requestor's side (timed out, node refused, ...)
    note: str = ""
    #: how long the requestor tried
    elapsed_s: float = 0.0

    def __str__(self) -> str:
        tiers = ", ".join(f"{t}%" for t in self.tiers_tried) or "none"
        text = (
            f"request {self.request_id}: placed 0 of {self.wanted} instance(s); "
            f"tiers tried: {tiers}; offers received: {self.offers_received}"
        )
        if self.found:
            text += f" (room found for {self.found})"
        if self.note:
            text += f"; {self.note}"
        if self.busy_nodes:
            text += f"; {self.busy_nodes} node(s) busy with other reservations"
        if self.reasons:
            ranked = sorted(self.reasons.items(), key=lambda item: (-item[1], item[0]))
            text += "; " + ", ".join(f"{label} on {n} node(s)" for label, n in ranked)
        return text


class PlacementError(Exception):
    """No placement: ``explanation`` says what was tried and what the nodes said."""

    def __init__(self, explanation: Explanation) -> None:
        super().__init__(str(explanation))
        self.explanation = explanation


class PlacementTimeout(PlacementError):
    """The caller's timeout ran out before the request was placed."""
