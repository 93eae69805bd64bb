"""The HTTP shapes of the placement service: what ``POST /v1/reservations`` takes, what the
service answers, and its errors as RFC 9457 problem details (``application/problem+json``).

Pydantic only: a user's app can take these shapes without FastAPI. (No ``from __future__
import annotations``: FastAPI reads these classes' annotations at run time.)
"""

import hashlib
import json
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from reservoir.protocol.audit import NodeSnapshot
from reservoir.protocol.messages import (
    IDENTIFIER_MAX_LENGTH,
    IDENTIFIER_PATTERN,
    TRAIT_MAX_LENGTH,
    TRAIT_PATTERN,
    GroupPolicy,
    GroupSpec,
    NumaSpec,
    TaskSpec,
    TaskState,
)
from reservoir.protocol.placement import (
    Placement,
    PlacementError,
    PlacementRequest,
    PlacementTimeout,
    request_of,
)

__all__ = [
    "PROBLEM_JSON",
    "AllocationOut",
    "Identifier",
    "NodeOut",
    "NumaIn",
    "PlacementOut",
    "Problem",
    "ProblemOut",
    "ReservationIn",
    "Trait",
    "UsageOut",
]

PROBLEM_JSON = "application/problem+json"
#: RFC 9457 ``type`` URIs of the problems this service answers with
PROBLEM_TYPES = {
    400: "about:blank",
    404: "urn:reservoir:problem:not-found",
    409: "urn:reservoir:problem:not-placed",
    422: "urn:reservoir:problem:invalid-request",
    502: "urn:reservoir:problem:free-incomplete",
    503: "urn:reservoir:problem:unavailable",
    504: "urn:reservoir:problem:timeout",
}


#: The protocol's rules for an id and a trait (:mod:`reservoir.protocol.messages`), as
#: pydantic checks them in the HTTP shapes: a bad field is a 422 that names it, and the
#: OpenAPI schema shows the rule.
Identifier = Annotated[
    str,
    StringConstraints(min_length=1, max_length=IDENTIFIER_MAX_LENGTH, pattern=IDENTIFIER_PATTERN),
]
Trait = Annotated[
    str, StringConstraints(min_length=1, max_length=TRAIT_MAX_LENGTH, pattern=TRAIT_PATTERN)
]


class NumaIn(BaseModel):
    """The NUMA shape of each instance."""

    model_config = ConfigDict(extra="forbid")

    #: split each instance across this many NUMA cells
    nodes: int = Field(default=1, ge=1, le=16)
    #: dedicated (pinned) CPUs
    dedicated_cpus: bool = False
    #: back the instance's memory with huge pages of this size (KiB)
    hugepage_kb: int | None = Field(default=None, gt=0)


class TaskIn(BaseModel):
    """The work each instance runs once placed (see :class:`~reservoir.TaskSpec`)."""

    model_config = ConfigDict(extra="forbid")

    #: the task driver: ``exec`` (a process) or ``docker`` (a container), as nodes offer
    driver: str = Field(default="exec", min_length=1, max_length=64, pattern=r"^[a-z0-9_.-]+$")
    #: the program and its arguments
    command: list[str] = Field(default_factory=list, max_length=1024)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    #: the container image, for ``docker``
    image: str | None = Field(default=None, min_length=1, max_length=500)
    #: the allocation outlives the task (freed by a DELETE, as a pure reservation)
    keep_allocation: bool = False
    #: a stop (a DELETE while the task runs) sends SIGTERM, then SIGKILL after this long
    stop_grace_s: float = Field(default=10.0, ge=0, le=3600)


class ReservationIn(BaseModel):
    """``POST /v1/reservations``: what each instance needs, how many, and where.

    The fields are those of the library's request (:class:`~reservoir.PlacementRequest`),
    with the shorthands ``vcpus``, ``memory_mb`` and ``disk_gb``; resource classes and
    traits are written as the nodes know them (``VCPU``, ``CUSTOM_GPU``)."""

    model_config = ConfigDict(extra="forbid")

    vcpus: int | None = Field(default=None, ge=0, le=2**20)
    memory_mb: int | None = Field(default=None, ge=0, le=2**40)
    disk_gb: int | None = Field(default=None, ge=0, le=2**40)
    #: any other resource classes per instance, e.g. ``{"CUSTOM_GPU": 1}``
    resources: dict[str, int] = Field(default_factory=dict)
    count: int = Field(default=1, ge=1, le=1000)
    #: accept a partial placement of at least this many instances
    min_count: int | None = Field(default=None, ge=1)
    #: a server group the instances join; ``policy`` defaults to anti-affinity
    group: Identifier | None = None
    policy: GroupPolicy | None = None
    required_traits: list[Trait] = Field(default_factory=list)
    forbidden_traits: list[Trait] = Field(default_factory=list)
    #: each inner list is satisfied when the node has at least one of its traits
    any_of_traits: list[list[Trait]] = Field(default_factory=list)
    numa: NumaIn | None = None
    #: free-form JSON for operators' node-side filters and weighers
    hints: dict[str, Any] = Field(default_factory=dict)
    #: work each instance runs once placed; its allocation is freed when it ends
    task: TaskIn | None = None
    #: ask nodes that cannot take it to say why (default: the service's ``--explain``)
    explain: bool | None = None
    #: idempotency key; the ``Idempotency-Key`` header is the usual way to give it
    request_id: Identifier | None = None
    #: how long to try before answering 504 (default: the ``request_timeout_s`` setting)
    timeout_s: float | None = Field(default=None, gt=0, le=600)

    @model_validator(mode="after")
    def _policy_needs_group(self) -> "ReservationIn":
        if self.policy is not None and self.group is None:
            raise ValueError("policy needs a group")
        return self

    def fingerprint(self) -> str:
        """A hash of what was asked, the idempotency key aside (it may come in the header
        or the body; the same request either way)."""
        shape = self.model_dump(mode="json", exclude={"request_id"})
        canonical = json.dumps(shape, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_placement_request(self, request_id: str | None, explain: bool) -> PlacementRequest:
        """The protocol's request, built as every front door builds it
        (:func:`~reservoir.protocol.placement.request_of`); ``explain`` is the service's
        default. Raises :class:`ValueError` for a shape the protocol refuses; when one
        field is at fault the error is an
        :class:`~reservoir.protocol.placement.InvalidRequest`, whose ``field`` names it."""
        group = None
        if self.group is not None:
            group = GroupSpec(name=self.group, policy=self.policy or "anti-affinity")
        numa = NumaSpec(**self.numa.model_dump()) if self.numa is not None else None
        return request_of(
            vcpus=self.vcpus,
            memory_mb=self.memory_mb,
            disk_gb=self.disk_gb,
            resources=self.resources,
            count=self.count,
            min_count=self.min_count,
            group=group,
            required_traits=frozenset(self.required_traits),
            forbidden_traits=frozenset(self.forbidden_traits),
            any_of_traits=tuple(frozenset(one) for one in self.any_of_traits),
            numa=numa,
            hints=self.hints,
            task=TaskSpec(**self.task.model_dump()) if self.task is not None else None,
            explain=explain if self.explain is None else self.explain,
            request_id=request_id,
        )


class AllocationOut(BaseModel):
    node: str
    allocation_id: str
    resources: dict[str, int]


class TaskOut(BaseModel):
    """One instance's task, as its node last reported it."""

    node: str
    allocation_id: str
    #: ``starting``, ``started``/``running``, ``exited``, ``failed`` or ``stopped``
    state: str
    exit_code: int | None = None
    reason: str = ""
    #: the limits the driver applied (``cgroup``, ``rlimit``, ``docker``, ``none``)
    limits: str = ""

    @classmethod
    def of(cls, state: TaskState) -> "TaskOut":
        return cls(
            node=state.sender,
            allocation_id=state.allocation_id,
            state=state.state,
            exit_code=state.exit_code,
            reason=state.reason,
            limits=state.limits,
        )


class PlacementOut(BaseModel):
    """A placement, in the shape ``reservoir request --json`` prints (so
    :func:`reservoir.runtime.auditor.read_placements` reads it back)."""

    placed: bool = True
    request_id: str
    partial: bool
    requested: int
    allocations: list[AllocationOut]
    tiers_tried: list[int]
    elapsed_s: float
    #: the tasks of its instances, when the request carried one (``GET`` only)
    tasks: list[TaskOut] = Field(default_factory=list)

    @classmethod
    def of(
        cls,
        placement: Placement | None,
        tasks: Sequence[TaskState] = (),
        *,
        request_id: str = "",
    ) -> "PlacementOut":
        if placement is None:  # every task ended and freed its allocation
            return cls(
                request_id=request_id,
                partial=False,
                requested=len(tasks),
                allocations=[],
                tiers_tried=[],
                elapsed_s=0.0,
                tasks=[TaskOut.of(t) for t in tasks],
            )
        return cls(
            tasks=[TaskOut.of(t) for t in tasks],
            request_id=placement.request_id,
            partial=placement.partial,
            requested=placement.requested,
            allocations=[
                AllocationOut(
                    node=a.node, allocation_id=a.allocation_id, resources=dict(a.resources)
                )
                for a in placement.allocations
            ],
            tiers_tried=list(placement.tiers_tried),
            elapsed_s=round(placement.elapsed_s, 4),
        )


class UsageOut(BaseModel):
    capacity: int
    allocated: int
    reserved: int


class NodeOut(BaseModel):
    """One live node, as its ledger report says."""

    name: str
    tier: int
    utilisation: float
    usage: dict[str, UsageOut]
    allocations: int
    reservations: int

    @classmethod
    def of(cls, snapshot: NodeSnapshot) -> "NodeOut":
        return cls(
            name=snapshot.name,
            tier=snapshot.tier,
            utilisation=round(snapshot.utilisation, 4),
            usage={
                rc: UsageOut(capacity=u.capacity, allocated=u.allocated, reserved=u.reserved)
                for rc, u in snapshot.usages.items()
            },
            allocations=len(snapshot.allocations),
            reservations=len(snapshot.reservations),
        )


class ProblemOut(BaseModel):
    """RFC 9457 problem details, with reservoir's extension members."""

    type: str
    title: str
    status: int
    detail: str
    request_id: str | None = None
    tiers_tried: list[int] | None = None
    #: reason -> how many nodes gave it
    reasons: dict[str, int] | None = None
    offers_received: int | None = None
    #: validation errors: each with the ``field`` it is about
    errors: list[dict[str, str]] | None = None


class Problem(Exception):
    """An error answered as ``application/problem+json``."""

    def __init__(self, status: int, title: str, detail: str, **extensions: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.extensions = extensions

    def body(self) -> dict[str, Any]:
        problem = ProblemOut(
            type=PROBLEM_TYPES.get(self.status, "about:blank"),
            title=self.title,
            status=self.status,
            detail=self.detail,
            **self.extensions,
        )
        return problem.model_dump(exclude_none=True)

    @classmethod
    def of_placement_error(cls, error: PlacementError) -> "Problem":
        explanation = error.explanation
        timed_out = isinstance(error, PlacementTimeout)
        return cls(
            504 if timed_out else 409,
            "not placed in time" if timed_out else "the nodes cannot take the request",
            str(explanation),
            request_id=explanation.request_id,
            tiers_tried=list(explanation.tiers_tried),
            reasons=dict(explanation.reasons),
            offers_received=explanation.offers_received,
        )

    @classmethod
    def of_validation_error(cls, errors: list[Any], where: tuple[str, ...] = ()) -> "Problem":
        fields = [
            {
                "field": ".".join(str(part) for part in (*where, *error.get("loc", ()))),
                "message": str(error.get("msg", "invalid")),
            }
            for error in errors
        ]
        detail = "; ".join(f"{f['field'] or 'body'}: {f['message']}" for f in fields)
        return cls(422, "invalid request", detail, errors=fields)
