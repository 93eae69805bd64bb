"""The HTTP shapes of the placement service: what ``POST /v1/reservations`` takes, what the
service answers, and its errors as RFC 9457 problem details (``application/problem+json``).

Pydantic only: a user's app can take these shapes without FastAPI. (No ``from __future__
import annotations``: FastAPI reads these classes' annotations at run time.)
"""

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from reservoir.protocol.audit import NodeSnapshot
from reservoir.protocol.messages import (
    IDENTIFIER_MAX_LENGTH,
    IDENTIFIER_PATTERN,
    PCI_ALIAS_PATTERN,
    TRAIT_MAX_LENGTH,
    TRAIT_PATTERN,
    GroupPolicy,
    GroupSpec,
    NumaSpec,
    PciPolicy,
    TaskSpec,
    TaskState,
)
from reservoir.protocol.placement import (
    Placement,
    PlacementError,
    PlacementTimeout,
)
from reservoir.runtime.auditor import node_fields
from reservoir.runtime.checked_request import CheckedRequest

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
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
#: the largest request body ``reservoir serve`` reads by default (beyond: a 413, refused
#: before it is read whole); a request with a few thousand traits fits
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
#: RFC 9457 ``type`` URIs of the problems this service answers with
PROBLEM_TYPES = {
    400: "about:blank",
    404: "urn:reservoir:problem:not-found",
    405: "about:blank",
    409: "urn:reservoir:problem:not-placed",
    413: "about:blank",
    415: "about:blank",
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

# The keys of a body's maps, each bounded in length and alphabet, and the maps in size, so
# that no map key is unbounded text (a refusal names the key: it must stay short).
#: a resource class as written (the protocol's check names an unknown one, and its case)
ResourceClassKey = Annotated[
    str, StringConstraints(min_length=1, max_length=TRAIT_MAX_LENGTH, pattern=r"^[A-Za-z0-9_]+$")
]
#: an amount of a resource class, as the protocol bounds it
Amount = Annotated[int, Field(ge=0, le=2**53)]
PciAlias = Annotated[str, StringConstraints(pattern=PCI_ALIAS_PATTERN)]
#: a task's environment variable: any name without ``=`` (or NUL)
EnvName = Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=r"^[^=\x00]+$")]
#: one argument, variable value or path of a task, as the protocol bounds it
TaskText = Annotated[str, StringConstraints(max_length=4096)]
HintKey = Annotated[str, StringConstraints(min_length=1, max_length=255)]
#: map entries: resource classes and PCI aliases per instance, a task's variables, hints
MAX_CLASSES = 64
MAX_ENV = 256
MAX_HINTS = 64
#: how deep a hint's JSON may nest (deeper overflows the encoders' recursion)
MAX_HINT_DEPTH = 32


def hint_problem(hints: dict[str, Any]) -> str | None:
    """What makes ``hints`` no JSON a node takes, or None: nested deeper than
    :data:`MAX_HINT_DEPTH`, a number that is not finite (``NaN``), a key over 255
    characters. Walked without recursion, so no depth can overflow it."""
    pending: list[tuple[Any, int]] = [(hints, 0)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_HINT_DEPTH:
            return f"must not nest deeper than {MAX_HINT_DEPTH} levels"
        if isinstance(value, float) and not math.isfinite(value):
            return "must be JSON numbers (not NaN or Infinity)"
        if isinstance(value, dict):
            if any(len(str(key)) > 255 for key in value):
                return "keys must be at most 255 characters"
            pending.extend((inner, depth + 1) for inner in value.values())
        elif isinstance(value, list):
            pending.extend((inner, depth + 1) for inner in value)
    return None


class NumaIn(BaseModel):
    """The NUMA shape of each instance."""

    # strict: ``true`` or ``"2"`` is no integer (nor ``1`` a boolean)
    model_config = ConfigDict(extra="forbid", strict=True)

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
    command: list[TaskText] = Field(default_factory=list, max_length=1024)
    env: dict[EnvName, TaskText] = Field(default_factory=dict, max_length=MAX_ENV)
    workdir: TaskText | None = None
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
    traits are written as the nodes know them (``VCPU``, ``CUSTOM_GPU``). Types are
    strict: ``"vcpus": true`` or ``"vcpus": "2"`` is a 422, not 1 or 2."""

    model_config = ConfigDict(extra="forbid", strict=True)

    vcpus: int | None = Field(default=None, ge=0, le=2**20)
    memory_mb: int | None = Field(default=None, ge=0, le=2**40)
    disk_gb: int | None = Field(default=None, ge=0, le=2**40)
    #: any other resource classes per instance, e.g. ``{"CUSTOM_GPU": 1}``
    resources: dict[ResourceClassKey, Amount] = Field(default_factory=dict, max_length=MAX_CLASSES)
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
    #: PCI devices per instance by the alias the nodes give them, e.g. ``{"gpu-a100": 1}``
    pci: dict[PciAlias, Annotated[int, Field(ge=1, le=64)]] = Field(
        default_factory=dict, max_length=MAX_CLASSES
    )
    #: where the devices sit relative to the instance's NUMA cells (Nova's
    #: ``hw:pci_numa_affinity_policy``; default ``legacy``)
    numa_policy: PciPolicy | None = None
    #: free-form JSON for operators' node-side filters and weighers (nested at most 32
    #: deep, finite numbers)
    hints: dict[HintKey, Any] = Field(default_factory=dict, max_length=MAX_HINTS)
    #: work each instance runs once placed; its allocation is freed when it ends
    task: TaskIn | None = None
    #: ask nodes that cannot take it to say why (default: the service's ``--explain``)
    explain: bool | None = None
    #: idempotency key; the ``Idempotency-Key`` header is the usual way to give it
    request_id: Identifier | None = None
    #: how long to try before answering 504 (default: the ``request_timeout_s`` setting)
    timeout_s: float | None = Field(default=None, gt=0, le=600)

    @field_validator("hints", mode="before")
    @classmethod
    def _hints_are_json_a_node_takes(cls, hints: Any) -> Any:
        # before pydantic copies them: so no nesting reaches a recursive walk
        if isinstance(hints, dict):
            problem = hint_problem(hints)
            if problem is not None:
                raise PydanticCustomError("hints", problem)
        return hints

    @model_validator(mode="after")
    def _policy_needs_group(self) -> "ReservationIn":
        if self.policy is not None and self.group is None:
            raise PydanticCustomError("policy_without_group", "policy needs a group")
        return self

    def fingerprint(self) -> str:
        """A hash of what was asked, the idempotency key aside (it may come in the header
        or the body; the same request either way)."""
        shape = self.model_dump(mode="json", exclude={"request_id"})
        canonical = json.dumps(shape, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_placement_request(self, request_id: str | None, explain: bool) -> CheckedRequest:
        """The protocol's request, built as every front door builds it
        (:func:`~reservoir.protocol.placement.request_of`) and checked here, once: the
        requestor places it as it is. ``explain`` is the service's default. Raises
        :class:`ValueError` for a shape the protocol refuses; when one field is at fault
        the error is an :class:`~reservoir.protocol.placement.InvalidRequest`, whose
        ``field`` names it."""
        group = None
        if self.group is not None:
            group = GroupSpec(name=self.group, policy=self.policy or "anti-affinity")
        numa = NumaSpec(**self.numa.model_dump()) if self.numa is not None else None
        return CheckedRequest.of(
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
            pci=self.pci,
            numa_policy=self.numa_policy,
            hints=self.hints,
            task=TaskSpec(**self.task.model_dump()) if self.task is not None else None,
            explain=explain if self.explain is None else self.explain,
            request_id=request_id,
        )


class AllocationOut(BaseModel):
    node: str
    allocation_id: str
    resources: dict[str, int]
    #: the PCI devices the instance holds, by address (a request with ``pci``)
    pci_devices: list[str] = Field(default_factory=list)
    #: the NUMA cells it sits on (a request with a NUMA shape)
    numa_cells: list[int] = Field(default_factory=list)


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
                    node=a.node,
                    allocation_id=a.allocation_id,
                    resources=dict(a.resources),
                    pci_devices=list(a.numa.devices) if a.numa else [],
                    numa_cells=list(a.numa.cells) if a.numa else [],
                )
                for a in placement.allocations
            ],
            tiers_tried=list(placement.tiers_tried),
            elapsed_s=round(placement.elapsed_s, 4),
        )


class UsageOut(BaseModel):
    """One resource class of a node (the field vocabulary of ``reservoir nodes`` too)."""

    #: the inventory: total, host-reserved (Placement's "reserved") and allocation ratio
    total: int
    reserved: int
    allocation_ratio: float
    #: what may be allocated: (total - reserved) x allocation_ratio
    capacity: int
    #: held by allocations
    used: int
    #: held by live reservations (offers not yet awarded or let go)
    held: int
    free: int


class NodeOut(BaseModel):
    """One live node, as its ledger report says."""

    name: str
    #: the reservoir release the node runs (``0.1.0`` for a node that does not say)
    release: str
    #: the narrowest tier the node hears, percent
    tier: int
    #: dominant share, live reservations included (0..1)
    utilisation: float
    usage: dict[str, UsageOut]
    #: allocations and live reservations held (counts)
    allocations: int
    reservations: int

    @classmethod
    def of(cls, snapshot: NodeSnapshot) -> "NodeOut":
        return cls.model_validate(node_fields(snapshot))


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

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        headers: dict[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        #: response headers (``Allow`` of a 405, ``Retry-After`` of a 503)
        self.headers = dict(headers or {})
        if status == 503:
            # unavailable here and now: another replica (or this one, restarted) may take it
            self.headers.setdefault("Retry-After", RETRY_AFTER_S)
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
        """A 422 naming each field at fault in reservoir's words (pydantic's are
        translated), or a 400 when the body is not JSON at all."""
        for error in errors:
            if error.get("type") == "json_invalid":
                position = error.get("loc", ())[-1:]
                at = f" at character {position[0]}" if position else ""
                reason = str(error.get("ctx", {}).get("error", "")).lower()
                return cls(
                    400,
                    "malformed JSON",
                    f"the body is not valid JSON{at}" + (f" ({reason})" if reason else ""),
                )
        fields = [_field_error((*where, *error.get("loc", ())), _in_our_words(error))
                  for error in errors]  # fmt: skip
        detail = "; ".join(f"{f['field'] or 'body'}: {f['message']}" for f in fields)
        return cls(422, "invalid request", detail, errors=fields)


#: seconds a 503 asks the client to wait before retrying
RETRY_AFTER_S = "1"

#: pydantic's error types, as reservoir says them ({...} from the error's context)
_MESSAGES: dict[str, str] = {
    "missing": "is required",
    "extra_forbidden": "is not a field of this request",
    "int_type": "must be an integer (not a string, a boolean or a fraction)",
    "int_parsing": "must be an integer",
    "int_from_float": "must be a whole number",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "greater_than": "must be more than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "string_too_short": "must not be empty",
    "string_too_long": "must be at most {max_length} characters",
    "string_pattern_mismatch": "must match {pattern}",
    "literal_error": "must be one of {expected}",
    "enum": "must be one of {expected}",
}


#: the longest part of a field's name a problem repeats (a map's key is the client's text)
_SHOWN = 64


def _shown(part: object) -> str:
    text = str(part)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}..."


def _field_error(loc: Sequence[object], message: str) -> dict[str, str]:
    """One error of a 422: the field (``body.resources``), and what is wrong. A map's key
    at fault (pydantic's ``(..., key, "[key]")``) is named in the message, not as a field,
    and no part of either is repeated whole when it is long."""
    if len(loc) >= 2 and loc[-1] == "[key]":
        return {
            "field": ".".join(_shown(part) for part in loc[:-2]),
            "message": f"key {_shown(loc[-2])!r} {message}",
        }
    return {"field": ".".join(_shown(part) for part in loc), "message": message}


def _in_our_words(error: dict[str, Any]) -> str:
    template = _MESSAGES.get(str(error.get("type")))
    if template is not None:
        try:
            return template.format(**error.get("ctx", {}))
        except (KeyError, IndexError):
            pass
    message = str(error.get("msg", "invalid"))
    # a validator's own words, without pydantic's prefix
    return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
