"""Node-side checks (filters) and preferences (weighers), and the built-in ones.

A node decides with the whole request. Each :class:`Filter` looks at the request and a
read-only view of the node and says how many instances it allows and, when it allows none,
why. Each :class:`Weigher` scores the node for the request; the offer carries the sum, so a
requestor's policy can prefer it. Operators add their own through the entry point groups
``reservoir.filters`` and ``reservoir.weighers``; the built-in checks use the same interface.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from reservoir.protocol.ledger import Ledger
from reservoir.protocol.messages import NumaPlacement, Reason, ReservationRequest
from reservoir.protocol.numa import NumaTopology, fit_instances

__all__ = [
    "BUILT_IN_FILTERS",
    "BUILT_IN_WEIGHERS",
    "DEFAULT_FILTERS",
    "DEFAULT_WEIGHERS",
    "Filter",
    "GroupFilter",
    "NodeView",
    "NumaFilter",
    "ResourceFilter",
    "SoftGroupWeigher",
    "TraitFilter",
    "Verdict",
    "Weigher",
    "evaluate",
]


@dataclass(frozen=True)
class NodeView:
    """What a filter or weigher may look at. Treat it as read-only."""

    name: str
    traits: frozenset[str]
    ledger: Ledger
    #: the node's NUMA topology, when it describes one
    numa: NumaTopology | None = None


@dataclass(frozen=True)
class Verdict:
    """A filter's answer: at most ``max_slots`` instances may be placed here."""

    max_slots: int
    reasons: tuple[Reason, ...] = ()
    #: the only obstacle is other requests' live reservations: worth asking again shortly
    busy: bool = False
    #: NUMA placements for the instances, when the filter chose them
    numa: tuple[NumaPlacement, ...] | None = None


#: the pass-through verdicts, shared (they are frozen): most filters let most requests
#: through, and a verdict built for each cost a node a frozen dataclass per filter per probe
_ALLOWING: dict[int, Verdict] = {}


def allowing(max_slots: int) -> Verdict:
    """The verdict that allows ``max_slots`` instances and has nothing to say."""
    verdict = _ALLOWING.get(max_slots)
    if verdict is None:
        verdict = Verdict(max_slots=max_slots)
        if max_slots <= 64:  # the common counts; a larger one is built each time
            _ALLOWING[max_slots] = verdict
    return verdict


@runtime_checkable
class Filter(Protocol):
    """A check that runs on the node with the full request."""

    name: str

    def check(self, request: ReservationRequest, node: NodeView, max_slots: int) -> Verdict:
        """Allow at most ``max_slots`` (what earlier filters allow) or fewer instances."""
        ...


@runtime_checkable
class Weigher(Protocol):
    """A preference: how good this node is for the request, ideally in -1..1."""

    name: str
    multiplier: float

    def weigh(self, request: ReservationRequest, node: NodeView, slots: int) -> float: ...


class ResourceFilter:
    """Enough of every requested resource class, within each inventory's unit rules."""

    name = "resources"

    def check(self, request: ReservationRequest, node: NodeView, max_slots: int) -> Verdict:
        fit = node.ledger.fit(request.resources, max_slots)
        if fit.slots > 0:
            return allowing(fit.slots)
        busy = fit.slots_without_reservations > 0
        return Verdict(max_slots=0, reasons=fit.reasons, busy=busy)


class TraitFilter:
    """Every required trait, no forbidden trait, one of each any-of group."""

    name = "traits"

    def check(self, request: ReservationRequest, node: NodeView, max_slots: int) -> Verdict:
        if not (request.required_traits or request.forbidden_traits or request.any_of_traits):
            return allowing(max_slots)  # most requests ask for no trait at all
        reasons = [
            Reason(code="trait_missing", subject=trait, detail=f"the node lacks trait {trait}")
            for trait in sorted(request.required_traits - node.traits)
        ]
        reasons += [
            Reason(code="trait_forbidden", subject=trait, detail=f"the node has trait {trait}")
            for trait in sorted(request.forbidden_traits & node.traits)
        ]
        reasons += [
            Reason(
                code="trait_missing",
                subject="|".join(sorted(group)),
                detail=f"the node has none of {', '.join(sorted(group))}",
            )
            for group in request.any_of_traits
            if not group & node.traits
        ]
        return Verdict(max_slots=0 if reasons else max_slots, reasons=tuple(reasons))


class GroupFilter:
    """Hard server-group policies. Anti-affinity: at most one member per node, counting
    members held by live reservations, so concurrent requests cannot stack two members.
    Affinity: a new group needs all its instances on one node; where the group already
    lives is settled by the requestor, which hears how many members each node holds."""

    name = "server_group"

    def check(self, request: ReservationRequest, node: NodeView, max_slots: int) -> Verdict:
        group = request.group
        if group is None or not group.is_hard:
            return allowing(max_slots)
        members = node.ledger.group_members(group.name)
        if group.policy == "anti-affinity":
            if members:
                allocated = sum(
                    1 for a in node.ledger.allocations.values() if a.group == group.name
                )
                return Verdict(
                    max_slots=0,
                    reasons=(
                        Reason(
                            code="anti_affinity",
                            subject=group.name,
                            detail=f"the node already holds {members} member(s) of "
                            f"anti-affinity group {group.name}",
                        ),
                    ),
                    busy=allocated == 0,
                )
            return allowing(min(max_slots, 1))
        # hard affinity
        if members == 0 and max_slots < request.wanted_slots:
            return Verdict(
                max_slots=0,
                reasons=(
                    Reason(
                        code="affinity",
                        subject=group.name,
                        detail=f"affinity group {group.name} needs {request.wanted_slots} "
                        f"instance(s) on one node; {max_slots} fit here",
                    ),
                ),
            )
        return allowing(max_slots)


class NumaFilter:
    """Fits NUMA-shaped requests onto the node's cells and chooses their CPUs, and chooses
    the PCI devices of requests that ask for some (see :mod:`reservoir.protocol.numa`)."""

    name = "numa"

    def check(self, request: ReservationRequest, node: NodeView, max_slots: int) -> Verdict:
        if request.numa is None and not request.pci:
            return allowing(max_slots)
        if node.numa is None:
            if request.pci:
                alias = min(request.pci)
                return Verdict(
                    max_slots=0,
                    reasons=(
                        Reason(code="pci", subject=alias, detail="the node has no PCI devices"),
                    ),
                )
            return Verdict(
                max_slots=0,
                reasons=(Reason(code="numa", detail="the node describes no NUMA topology"),),
            )
        placements, shortfall = fit_instances(
            node.numa, node.ledger.numa_placements(), request, max_slots
        )
        if shortfall is not None:
            code = "numa" if shortfall.alias is None else "pci"
            reason = Reason(code=code, subject=shortfall.alias, detail=shortfall.why[:500])
            return Verdict(max_slots=0, reasons=(reason,), busy=_busy(request, node))
        return Verdict(max_slots=len(placements), numa=tuple(placements))


def _busy(request: ReservationRequest, node: NodeView) -> bool:
    """Whether only live reservations hold the cells, CPUs or devices the request needs
    (then it is worth asking again shortly, as for any resource)."""
    if not node.ledger.reservations or node.numa is None:
        return False
    allocated = (a.numa for a in node.ledger.allocations.values() if a.numa is not None)
    placements, _ = fit_instances(node.numa, allocated, request, 1)
    return bool(placements)


class SoftGroupWeigher:
    """Soft affinity prefers nodes holding members of the group; soft anti-affinity avoids
    them. Neither ever excludes a node."""

    name = "soft_server_group"

    def __init__(self, multiplier: float = 1.0) -> None:
        self.multiplier = multiplier

    def weigh(self, request: ReservationRequest, node: NodeView, slots: int) -> float:
        group = request.group
        if group is None or group.is_hard:
            return 0.0
        members = node.ledger.group_members(group.name)
        closeness = members / (members + 1)  # 0 for none, towards 1 for many
        return closeness if group.policy == "soft-affinity" else -closeness


#: The built-in filters by the name they are registered under (the ``reservoir.filters``
#: entry points in pyproject.toml, which a test holds to this), cheap checks first: the one
#: list of them. A node without plugins runs :data:`DEFAULT_FILTERS`, one of each.
BUILT_IN_FILTERS: Mapping[str, type[Filter]] = {
    "traits": TraitFilter,
    "resources": ResourceFilter,
    "server_group": GroupFilter,
    "numa": NumaFilter,
}
BUILT_IN_WEIGHERS: Mapping[str, type[Weigher]] = {"soft_server_group": SoftGroupWeigher}

DEFAULT_FILTERS: tuple[Filter, ...] = tuple(kind() for kind in BUILT_IN_FILTERS.values())
DEFAULT_WEIGHERS: tuple[Weigher, ...] = tuple(kind() for kind in BUILT_IN_WEIGHERS.values())


@dataclass(slots=True)
class Evaluation:
    """What the node's filters and weighers make of a request."""

    slots: int
    reasons: tuple[Reason, ...]
    busy: bool
    score: float
    numa: tuple[NumaPlacement, ...] | None


def evaluate(
    request: ReservationRequest,
    node: NodeView,
    filters: Sequence[Filter],
    weighers: Sequence[Weigher],
) -> Evaluation:
    """Run the filters in order, each narrowing the slots the previous ones allowed.

    Without ``explain`` the first filter that allows nothing ends the evaluation; with it,
    every filter runs so the requestor hears every reason.
    """
    slots = request.count
    reasons: list[Reason] = []
    busy_only = True
    numa: tuple[NumaPlacement, ...] | None = None
    for check in filters:
        verdict = check.check(request, node, slots if slots > 0 else request.count)
        if verdict.max_slots <= 0:
            reasons.extend(verdict.reasons)
            busy_only = busy_only and verdict.busy
            slots = 0
            if not request.explain:
                break
            continue
        if slots > 0:
            slots = min(slots, verdict.max_slots)
            if verdict.numa is not None:
                numa = verdict.numa
    if slots <= 0:
        return Evaluation(
            slots=0, reasons=tuple(reasons), busy=busy_only and bool(reasons), score=0.0, numa=None
        )
    # float(): whatever number type an operator's weigher returns, the offer carries a
    # plain float
    score = float(sum(w.multiplier * w.weigh(request, node, slots) for w in weighers))
    return Evaluation(
        slots=slots,
        reasons=(),
        busy=False,
        score=score,
        numa=None if numa is None else numa[:slots],
    )
