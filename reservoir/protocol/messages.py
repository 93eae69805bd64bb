"""The protocol's messages: what crosses the broker, and nothing else.

Every message is a frozen msgspec struct that carries the protocol version, the
``request_id`` of the conversation it belongs to and the id of its sender. A field it does
not know is ignored (a newer release's, which it can do without: a request field a node
must understand belongs to a feature the request names in ``needs``, and a node that does
not know one declines; see :mod:`reservoir.protocol.compatibility`). They form one union
tagged by ``kind``. Decoding (:func:`decode_message`) checks every constraint written in
the annotations; building one checks only what its
``__post_init__`` checks, since the machines build them from values they hold (a caller's
request is checked in full before it is placed: :func:`~reservoir.protocol.placement.
checked_request`). msgspec rather than pydantic because it builds, encodes and decodes
these messages several times faster (``benchmarks/codec.py``). A request carries the *whole*
request (resources, traits, NUMA shape, server group, hints): whatever a node needs to
decide, it finds there, so the node runs the one and only copy of the placement logic.

Conversation, one per request id (see docs/design.md):

    requestor --ReservationRequest(probed_node)--> a few nodes sampled from its roster
              (the exhaustive step: --ReservationRequest--> tier topic --> every node
              that hears it)
              (--Lookup--> lookup.<bucket of the id>, when the caller chose the request id)
    node      --Offer | Decline | AlreadyPlaced--> requestor's reply address
              (a dry run, ReservationRequest(dry_run) on the widest tier's topic: every
              node --Assessment--> requestor, and nothing is reserved)
    requestor --Award | Release--> node
    node      --Accepted | Refused--> requestor
    requestor --Free--> node --Freed--> requestor       (the instance was deleted)

Tasks, when the request carries one (``task``; see docs/design.md, "Tasks"):

    node      --TaskState(started)--> the placing requestor, after Accepted
    node      --TaskState(exited | failed | stopped)--> the placing requestor
    anyone    --TaskQuery--> the widest tier's topic; nodes --TaskState--> the asker
    anyone    --TaskOutputQuery--> a node; node --TaskOutput--> the asker (a chunk of a
              task's stdout or stderr; held until there is one when it waits)

Membership, for requestors' rosters (not a conversation; ``request_id`` is ``roster``):

    node      --NodeStatus--> roster topic    (at start, on every change of tier, leaving)
    requestor --RollCall--> the widest tier's topic; node --NodeStatus--> requestor

Audit, for ``reservoir audit`` (``request_id`` is ``audit``):

    auditor   --LedgerQuery--> the widest tier's topic
    node      --LedgerReport (one or more parts)--> auditor
"""

from __future__ import annotations

import hashlib
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import UnionType
from typing import (
    Annotated,
    Any,
    ClassVar,
    Final,
    Literal,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import msgspec
from msgspec import Meta, field

__all__ = [
    "AUDIT_ID",
    "FEATURE_PATTERN",
    "IDENTIFIER_MAX_LENGTH",
    "IDENTIFIER_PATTERN",
    "IN_FLIGHT_ELSEWHERE",
    "KEEPER_TOPIC",
    "LOOKUP_BUCKETS",
    "MAX_FEATURES",
    "MAX_SAMPLE",
    "MESSAGE_CLASSES",
    "NODE_KINDS",
    "NO_FEATURES",
    "OUTPUT_CHUNK_MAX",
    "OUTPUT_WAIT_MAX_S",
    "PCI_ALIAS_PATTERN",
    "PCI_POLICIES",
    "PROTOCOL_VERSION",
    "REJOINED_TOPIC",
    "REQUESTOR_KINDS",
    "ROOM_TOPIC",
    "ROSTER_ID",
    "ROSTER_TOPIC",
    "STANDARD_RESOURCE_CLASSES",
    "TASK_STATES",
    "TRAIT_MAX_LENGTH",
    "TRAIT_PATTERN",
    "UNTRUSTED_ID",
    "Accepted",
    "AllocationInfo",
    "AlreadyPlaced",
    "Assessment",
    "Award",
    "Decline",
    "Free",
    "Freed",
    "GroupPolicy",
    "GroupSpec",
    "HeldAllocation",
    "HeldReservation",
    "InstanceShape",
    "InvalidField",
    "KeeperUp",
    "LedgerQuery",
    "LedgerReport",
    "Lookup",
    "Message",
    "NodeStatus",
    "NumaPlacement",
    "NumaSpec",
    "Offer",
    "OutputStream",
    "PciPolicy",
    "Reason",
    "Refused",
    "Release",
    "ReservationRequest",
    "ResourceTally",
    "RollCall",
    "RosterMember",
    "RosterQuery",
    "RosterSample",
    "TaskOutput",
    "TaskOutputQuery",
    "TaskQuery",
    "TaskReport",
    "TaskSpec",
    "TaskState",
    "TaskStateName",
    "Untrusted",
    "bucket_bitmap",
    "buckets_in",
    "check_ids",
    "decode_message",
    "encode_message",
    "is_resource_class",
    "lookup_bucket",
    "lookup_topic",
    "message_from_fields",
    "validation_error_at",
]

PROTOCOL_VERSION: Final = 1

#: The standard resource classes; any other class must be ``CUSTOM_<NAME>``.
STANDARD_RESOURCE_CLASSES: Final = frozenset({"VCPU", "PCPU", "MEMORY_MB", "DISK_GB"})

#: Nodes announce their tier on this topic of the request exchange; requestors bind it.
ROSTER_TOPIC: Final = "roster"
#: A node that is back publishes the lookup buckets of the ids it holds on this topic
#: (design.md, "Lookups"); every requestor binds it, whoever keeps its roster.
REJOINED_TOPIC: Final = "rejoined"
#: Roster keepers bind this topic: a requestor that takes its roster from a keeper asks
#: for a sample here (design.md, "Many requestors: roster keepers"). A keeper that starts
#: says so on :data:`ROSTER_TOPIC` (:class:`KeeperUp`), which the requestors that follow
#: the announcements bind.
KEEPER_TOPIC: Final = "keeper"
#: Nodes publish every change of their room on this topic once a keeper has roll-called
#: them; only keepers bind it.
ROOM_TOPIC: Final = "roster.room"
#: The most nodes one :class:`RosterSample` names (it stays well inside a message's size).
MAX_SAMPLE: Final = 256
#: The ``request_id`` of membership messages, which belong to no conversation.
ROSTER_ID: Final = "roster"
#: The ``request_id`` of audit messages.
AUDIT_ID: Final = "audit"
#: The ``request_id`` of :class:`Untrusted` messages.
UNTRUSTED_ID: Final = "untrusted"
#: Request ids hash into this many lookup buckets: a node that is back names the buckets
#: of the ids it holds (``NodeStatus.rejoined_buckets``, a bitmap of this many bits), so
#: that requestors look up again the ids they placed in them. (Lookups themselves go to
#: one topic per id: :func:`lookup_topic`.)
LOOKUP_BUCKETS: Final = 1 << 16

_CUSTOM_CLASS = re.compile(r"CUSTOM_[A-Z0-9_]+")

_IDENTIFIER_CHARACTER = r"[A-Za-z0-9._:@/+=-]"
#: what an id (a request, a node, an address...) may be: the pattern and the longest
IDENTIFIER_PATTERN: Final = f"^{_IDENTIFIER_CHARACTER}+$"
IDENTIFIER_MAX_LENGTH: Final = 200
#: what a trait may be
TRAIT_PATTERN: Final = r"^[A-Z0-9_]+$"
TRAIT_MAX_LENGTH: Final = 255
# msgspec matches a pattern with Python's re.search, where "$" also matches before a final
# newline: its patterns end with "\Z" (the ones above are for pydantic's, which has no \Z)
_TRAIT = r"^[A-Z0-9_]+\Z"
#: what a feature's name may be (:mod:`reservoir.protocol.compatibility`)
FEATURE_PATTERN: Final = r"^[a-z0-9_.-]{1,64}$"
#: the most features a message names
MAX_FEATURES: Final = 64


class _IdentifierMark:
    """Marks a field as an id. Such fields are checked after decoding (:func:`check_ids`),
    all of a message's ids with one match, rather than one pattern per field by msgspec,
    which made checking the ids the costliest part of decoding a message
    (docs/performance.md, "The runtime")."""


_IDENTIFIER_MARK: Final = _IdentifierMark()
_ONE_IDENTIFIER = f"{_IDENTIFIER_CHARACTER}{{1,{IDENTIFIER_MAX_LENGTH}}}"
_IDENTIFIER = re.compile(_ONE_IDENTIFIER)
#: ids joined by NUL, which no id contains
_IDENTIFIERS = re.compile(f"{_ONE_IDENTIFIER}(?:\x00{_ONE_IDENTIFIER})*")

Identifier = Annotated[str, _IDENTIFIER_MARK]
Trait = Annotated[str, Meta(min_length=1, max_length=TRAIT_MAX_LENGTH, pattern=_TRAIT)]
Amount = Annotated[int, Meta(ge=0, le=2**53)]
#: a feature's name: something a request may use that a node must know
FeatureName = Annotated[str, Meta(pattern=r"^[a-z0-9_.-]{1,64}\Z")]
Features = Annotated[frozenset[FeatureName], Meta(max_length=MAX_FEATURES)]
#: no feature: the default of every field of :data:`Features`. The JSON leaves a field out
#: when it holds its default *object* (an equal empty set is written ``[]``, which a reader
#: of 0.1 refuses): whoever means "none" passes this one
NO_FEATURES: Final[frozenset[str]] = frozenset()
#: a participant's release, as it says it (``0.2.0``); empty: it does not say (0.1.0)
ReleaseName = Annotated[str, Meta(max_length=64, pattern=r"^[0-9A-Za-z.+-]*\Z")]
#: what a PCI alias may be (an operator's name for a kind of device, e.g. ``gpu-a100``)
PCI_ALIAS_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
PciAlias = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")]
#: a PCI address as the node names its devices (``0000:3b:00.0``)
PciAddress = Annotated[str, Meta(min_length=1, max_length=64)]
#: how a PCI device must sit relative to the instance's NUMA cells, as Nova's
#: ``hw:pci_numa_affinity_policy``: ``required`` on one of the instance's cells;
#: ``legacy`` (the default) the same, but a device with no NUMA cell may go anywhere;
#: ``preferred`` on the instance's cells when there is one free, else anywhere;
#: ``socket`` on a cell of the same socket as one of the instance's cells
PciPolicy = Literal["required", "preferred", "legacy", "socket"]
PCI_POLICIES: Final[tuple[str, ...]] = get_args(PciPolicy)
#: when a placement was asked for, seconds since the epoch (0: unknown); bounded (about
#: the year 5100), so that no message can claim infinity and win against every other
PlacedAt = Annotated[float, Meta(ge=0, le=1e11)]
#: a W3C ``traceparent`` (version-trace id-parent id-flags), carried so that a node's spans
#: join the requestor's trace; absent unless the requestor traces
TraceParent = Annotated[str, Meta(pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}\Z")]


def is_resource_class(name: str) -> bool:
    """True for a standard class (``VCPU``, ``PCPU``, ``MEMORY_MB``, ``DISK_GB``) or a
    ``CUSTOM_*`` one."""
    return name in STANDARD_RESOURCE_CLASSES or bool(_CUSTOM_CLASS.fullmatch(name))


def lookup_bucket(request_id: str) -> int:
    """The lookup bucket of ``request_id``, 0 to ``LOOKUP_BUCKETS - 1``. The same on every
    participant: a stable hash, not Python's salted ``hash``."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % LOOKUP_BUCKETS


def lookup_topic(request_id: str) -> str:
    """The topic a ``Lookup`` for ``request_id`` is published on, and that a node holding
    anything of that id binds: one per id (a 128-bit hash of it, so the topic has one
    length and one alphabet whatever the id). A ``Lookup`` therefore reaches exactly the
    nodes holding something of the id, and comes back unroutable when none does, which
    is how "nobody holds it" is known rather than waited for."""
    return f"lookup.{hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()}"


def bucket_bitmap(buckets: Iterable[int]) -> bytes:
    """The set of lookup buckets as a bitmap of ``LOOKUP_BUCKETS`` bits (8 KiB): bit ``b``
    is bit ``b % 8`` of byte ``b // 8``. Bounded whatever a node holds, where a list of
    its request ids is not."""
    bitmap = bytearray(LOOKUP_BUCKETS // 8)
    for bucket in buckets:
        bitmap[bucket >> 3] |= 1 << (bucket & 7)
    return bytes(bitmap)


def buckets_in(bitmap: bytes) -> Iterator[int]:
    """The buckets set in a :func:`bucket_bitmap`."""
    for index, byte in enumerate(bitmap):
        if byte:
            for bit in range(8):
                if byte >> bit & 1:
                    yield index * 8 + bit


def _unknown_resource_classes(names: Mapping[str, int]) -> str | None:
    """What is wrong with the resource classes ``names`` (a request's resources, a node's
    room), or None. Every request and every answer passes here: a set test for the
    standard classes, the common case, and a pattern only for the others."""
    if STANDARD_RESOURCE_CLASSES.issuperset(names):
        return None
    unknown = sorted(rc for rc in names if not is_resource_class(rc))
    if not unknown:
        return None
    cased = [rc.upper() for rc in unknown if is_resource_class(rc.upper())]
    hint = f" (classes are upper case: {', '.join(cased)})" if cased else ""
    return (
        f"unknown resource class {', '.join(unknown)}{hint}: use one of "
        f"{', '.join(sorted(STANDARD_RESOURCE_CLASSES))} or CUSTOM_<NAME>"
    )


#: A node's room (:mod:`reservoir.protocol.room`): per resource class, floor(log2) of what
#: its allocations leave free, -1 when nothing is; empty when the sender does not say. It
#: rides on every answer a node sends: msgspec checks the amounts and the size, and
#: :func:`check_ids` the classes (a set test for the standard ones, the common case).
Room = Annotated[dict[str, Annotated[int, Meta(ge=-1, le=53)]], Meta(max_length=64)]


class InvalidField(ValueError):
    """A decoded message (or a caller's request) with a field no participant accepts,
    found by :func:`check_ids`: ``field`` names it (``allocations[0].allocation_id``;
    empty for the message as a whole), ``problem`` says what is wrong."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem


def check_ids(struct: _Frozen, at: str = "") -> None:
    """Check the ids of a decoded ``struct`` and of the structs it holds (every field of
    type :data:`Identifier`, optional or in a tuple) and the classes of its ``room``, all
    of a struct's with one match; raises :class:`InvalidField`. msgspec checks every other
    constraint while decoding; these are checked after it, because one match for all the
    ids of a message costs a third of msgspec's check of one pattern per field. Built
    messages are not checked: the machines build them from values they hold."""
    check = _CHECKS.get(type(struct))
    if check is None:
        check = _CHECKS[type(struct)] = _ids_check(type(struct))
    check(struct, at)


def _ids_check(cls: type) -> Callable[[Any, str], None]:
    """``cls``'s check, made once: which fields are ids, which hold structs, whether it
    has a room."""
    required: list[str] = []
    optional: list[str] = []
    many: list[str] = []
    nested: list[str] = []
    nested_many: list[str] = []
    for name, hint in get_type_hints(cls, include_extras=True).items():
        if name not in cls.__struct_fields__:  # type: ignore[attr-defined]
            continue
        origin, args = get_origin(hint), get_args(hint)
        if origin is tuple:
            if _is_identifier(args[0]):
                many.append(name)
            elif _is_struct(args[0]):
                nested_many.append(name)
        elif origin is dict:
            if _is_struct(args[1]):
                nested_many.append(name)  # checked value by value, named by key
        elif origin in (Union, UnionType):  # optional
            if any(_is_identifier(arg) for arg in args):
                optional.append(name)
            elif any(_is_struct(arg) for arg in args):
                nested.append(name)
        elif _is_identifier(hint):
            required.append(name)
        elif _is_struct(hint):
            nested.append(name)
    has_room = "room" in cls.__struct_fields__  # type: ignore[attr-defined]
    # attrgetter of two or more names gives a tuple, joined as it is: the cheapest path,
    # for the ids every message carries (request_id, sender)
    get_required: Callable[[Any], tuple[str, ...]]
    if len(required) > 1:
        get_required = operator.attrgetter(*required)
    else:
        get_required = lambda struct: tuple(getattr(struct, name) for name in required)  # noqa: E731
    single = required + optional

    def check(struct: Any, at: str) -> None:
        ids: tuple[str, ...] | list[str] = get_required(struct)
        if optional or many:
            ids = list(ids)
            for name in optional:
                value = getattr(struct, name)
                if value is not None:
                    ids.append(value)
            for name in many:
                ids.extend(getattr(struct, name))
        if ids:
            joined = "\x00".join(ids)
            # the count: an id holding a NUL itself would otherwise pass as two
            if _IDENTIFIERS.fullmatch(joined) is None or joined.count("\x00") != len(ids) - 1:
                _name_the_bad_id(struct, single, many, at)
        if has_room and struct.room:
            problem = _unknown_resource_classes(struct.room)
            if problem is not None:
                raise InvalidField(f"{at}room", problem)
        for name in nested:
            value = getattr(struct, name)
            if value is not None:
                check_ids(value, f"{at}{name}.")
        for name in nested_many:
            values = getattr(struct, name)
            for key, value in values.items() if isinstance(values, dict) else enumerate(values):
                check_ids(value, f"{at}{name}[{key}].")

    return check


def _is_struct(hint: object) -> bool:
    return isinstance(hint, type) and issubclass(hint, _Frozen)


def _is_identifier(hint: object) -> bool:
    return get_origin(hint) is Annotated and _IDENTIFIER_MARK in getattr(hint, "__metadata__", ())


def _name_the_bad_id(struct: Any, single: list[str], many: list[str], at: str) -> None:
    wanted = f"Expected an id: 1 to {IDENTIFIER_MAX_LENGTH} of the letters, digits and ._:@/+=-"
    for name in single:
        value = getattr(struct, name)
        if value is not None and not _IDENTIFIER.fullmatch(value):
            raise InvalidField(f"{at}{name}", wanted)
    for name in many:
        for i, value in enumerate(getattr(struct, name)):
            if not _IDENTIFIER.fullmatch(value):
                raise InvalidField(f"{at}{name}[{i}]", wanted)
    raise AssertionError(f"the ids of a {type(struct).__name__} failed as one, none alone")


#: each struct class's check, made the first time one is checked
_CHECKS: dict[type, Callable[[Any, str], None]] = {}


# Every message and part of one is a frozen msgspec struct. Constructing one checks
# nothing but what ``__post_init__`` checks (the machines build them from values they
# hold); decoding checks every constraint in the annotations and ``__post_init__``, then
# :func:`check_ids`, so nothing malformed reaches a machine. A field it does not know is
# skipped, not refused: it is a later release's, and the compatibility policy
# (docs/design.md, "Upgrades") lets a release add only what an earlier one may go
# without (0.1.0 refused such a message whole, so what is written for it leaves out
# everything added since: compatibility.backport).
# Fields equal to their default are left out of the JSON: a message that uses none of the
# optional fields is byte for byte what it was before they existed.
class _Frozen(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


def _protocol_version() -> Literal[1]:
    # A factory rather than a plain default, so that the version is always on the wire
    # (omit_defaults leaves out plain defaults only): a receiver of another version can
    # tell the difference.
    return PROTOCOL_VERSION


class _Message(_Frozen, tag_field="kind", frozen=True, kw_only=True):
    #: the message's kind, as the JSON's ``kind`` field carries it
    kind: ClassVar[str]
    version: Literal[1] = field(default_factory=_protocol_version)
    request_id: Identifier
    sender: Identifier


GroupPolicy = Literal["affinity", "anti-affinity", "soft-affinity", "soft-anti-affinity"]


class GroupSpec(_Frozen, frozen=True, kw_only=True):
    """A server group the requested instances join, with its placement policy."""

    name: Identifier
    policy: GroupPolicy

    @property
    def is_hard(self) -> bool:
        return not self.policy.startswith("soft-")


class NumaSpec(_Frozen, frozen=True, kw_only=True):
    """The NUMA shape of each instance: split across ``nodes`` cells, optionally with
    dedicated (pinned) CPUs and memory backed by huge pages of ``hugepage_kb``."""

    nodes: Annotated[int, Meta(ge=1, le=16)] = 1
    dedicated_cpus: bool = False
    hugepage_kb: Annotated[int, Meta(gt=0)] | None = None


class NumaPlacement(_Frozen, frozen=True, kw_only=True):
    """Where on the node's NUMA topology one instance landed: its cells, its pinned host
    CPUs (dedicated only), and what it takes from each cell."""

    cells: tuple[int, ...]
    cpus: tuple[int, ...] = ()
    memory_mb_per_cell: tuple[int, ...] = ()
    vcpus_per_cell: tuple[int, ...] = ()
    hugepage_kb: int | None = None
    #: the PCI devices the instance holds, by address (a request with ``pci``); held by
    #: the reservation as its pinned CPUs are, so no two instances get one device. A
    #: request with devices and no NUMA shape floats: ``cells`` is empty.
    devices: tuple[PciAddress, ...] = ()


class AllocationInfo(_Frozen, frozen=True, kw_only=True):
    """One instance's allocation on a node, as the node reports it."""

    allocation_id: Identifier
    resources: dict[str, Amount]
    numa: NumaPlacement | None = None


class Reason(_Frozen, frozen=True, kw_only=True):
    """Why a node cannot take a request: which check said no, and by how much."""

    #: which check said no, e.g. ``insufficient``, ``trait_missing``, ``anti_affinity``
    code: Annotated[str, Meta(min_length=1, max_length=64)]
    #: what it is about: a resource class, a trait, a server group
    subject: Annotated[str, Meta(max_length=255)] | None = None
    #: for a resource: how much more the node would need
    shortfall: int | None = None
    detail: Annotated[str, Meta(max_length=500)] = ""


#: Decline reason: another requestor holds a reservation for the same request id here
#: (a node says it; a requestor and a finder act on it).
IN_FLIGHT_ELSEWHERE: Final = "in_flight_elsewhere"


#: What a task can be doing, as a node reports it: ``starting`` (awarded, its driver
#: not done starting it), ``started`` (the driver started it:
#: said once), ``running`` (alive, in answers to a query and after a re-attach),
#: ``exited`` (ended by itself, with its exit code), ``failed`` (never started: the
#: reason says why), ``stopped`` (ended because its allocation was freed).
TaskStateName = Literal["starting", "started", "running", "exited", "failed", "stopped"]
TASK_STATES: Final = frozenset(get_args(TaskStateName))
#: one argument, variable or path of a task, bounded so a request stays one message
_TaskText = Annotated[str, Meta(max_length=4096)]


class TaskSpec(_Frozen, frozen=True, kw_only=True):
    """The work a request carries: the node starts it in each instance once awarded,
    through the task driver named ``driver`` (one the node offers; one that does not
    never offers). ``command`` is the program and its arguments; ``image`` is for
    container drivers (``docker``)."""

    driver: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9_.-]+\Z")]
    command: Annotated[tuple[_TaskText, ...], Meta(max_length=1024)] = ()
    env: Annotated[dict[str, _TaskText], Meta(max_length=256)] = field(default_factory=dict)
    workdir: _TaskText | None = None
    image: Annotated[str, Meta(min_length=1, max_length=500)] | None = None
    #: the allocation outlives the task (freed by the caller, as a pure reservation)
    keep_allocation: bool = False
    #: a stop sends SIGTERM, then SIGKILL after this many seconds
    stop_grace_s: Annotated[float, Meta(ge=0, le=3600)] = 10.0


class InstanceShape(_Frozen, frozen=True, kw_only=True):
    """What each instance needs and where it may go: the part of a request a caller writes.

    Constructing one checks how its fields fit together (a positive amount of something,
    ``min_count`` within ``count``, known resource classes, no trait both required and
    forbidden); the constraints on each field are checked when it is decoded, and before a
    requestor places it
    (:func:`~reservoir.protocol.placement.checked_request`)."""

    count: Annotated[int, Meta(ge=1, le=10_000)] = 1
    #: accept a partial placement of at least this many instances (default: all or nothing)
    min_count: Annotated[int, Meta(ge=1)] | None = None
    #: amount of each resource class per instance
    resources: dict[str, Amount]
    required_traits: frozenset[Trait] = frozenset()
    forbidden_traits: frozenset[Trait] = frozenset()
    #: each inner set is satisfied when the node has at least one of its traits
    any_of_traits: tuple[frozenset[Trait], ...] = ()
    numa: NumaSpec | None = None
    #: PCI devices per instance, by the alias the nodes give them: alias -> count
    pci: dict[PciAlias, Annotated[int, Meta(ge=1, le=64)]] = field(default_factory=dict)
    #: where the devices must sit relative to the instance's NUMA cells (default legacy)
    numa_policy: PciPolicy | None = None
    group: GroupSpec | None = None
    #: ask nodes that cannot take the request to say why
    explain: bool = False
    #: free-form JSON for operators' node-side filters and weighers
    hints: dict[str, Any] = field(default_factory=dict)
    #: work to start in each instance once awarded (None: a pure reservation)
    task: TaskSpec | None = None

    def __post_init__(self) -> None:
        problem = _unknown_resource_classes(self.resources)
        if problem is not None:
            raise ValueError(problem)
        if not any(self.resources.values()):
            raise ValueError("a request must ask for a positive amount of some resource")
        if self.min_count is not None and self.min_count > self.count:
            raise ValueError("min_count cannot exceed count")
        # frozenset(): a caller may build one with lists; the check makes them frozensets.
        # Most requests forbid nothing: then there is nothing to build.
        if (
            self.forbidden_traits
            and self.required_traits
            and frozenset(self.required_traits) & frozenset(self.forbidden_traits)
        ):
            raise ValueError("a trait cannot be both required and forbidden")
        if self.numa_policy is not None and not self.pci:
            raise ValueError("numa_policy places PCI devices: ask for some with pci")

    @property
    def wanted_slots(self) -> int:
        """How many instances would satisfy the request at the least."""
        return self.count if self.min_count is None else self.min_count

    def shape_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in InstanceShape.__struct_fields__}


class ReservationRequest(InstanceShape, tag_field="kind", tag="request", frozen=True, kw_only=True):
    """Broadcast on a tier topic: reserve room for ``count`` instances of this shape.

    (The shape's fields come first; the envelope's are those of every message: msgspec
    lets a struct inherit the fields of one base only.)"""

    kind: ClassVar[Literal["request"]] = "request"
    version: Literal[1] = field(default_factory=_protocol_version)
    request_id: Identifier
    sender: Identifier
    reply_to: Identifier
    tier: Annotated[int, Meta(ge=1, le=100)]
    attempt: Annotated[int, Meta(ge=1)]
    ttl_s: Annotated[float, Meta(gt=0, le=3600)]
    #: set when the request is a probe: sent to this node alone, one of a few sampled
    #: from the requestor's roster, rather than broadcast. A probed node answers even
    #: when it cannot take the request (a compact Decline), so the requestor decides the
    #: moment every probed node has answered; a probe that comes back unroutable names
    #: the node that is gone.
    probed_node: Identifier | None = None
    #: another requestor may look this id up (the caller chose it, or another requestor
    #: places it too): the node binds the id's lookup topic while it holds anything of
    #: it, *before* it offers, so that two requestors placing the id find each other.
    #: Generated ids are never looked up by a placement, and spare the node the bind.
    findable: bool = False
    #: what is placed of this (generated) id must be found by id (a service answers GET
    #: and DELETE for it): the node binds the id's lookup topic too, but after it offers,
    #: and answers an award only once the binding is in place, so the offer waits for no
    #: broker round trip
    findable_when_placed: bool = False
    #: every node that hears it and cannot take it says so (a compact Decline), as a
    #: probed node does: set by the exhaustive step, after sampling the roster found too
    #: little, so that a full cluster is told apart from one where nobody listens and the
    #: request fails at once rather than waiting for nodes that might still be starting
    declines_wanted: bool = False
    #: only ask: the node evaluates the request and answers with an Assessment (whether
    #: and how much it could take, and why not), reserving nothing
    dry_run: bool = False
    traceparent: TraceParent | None = None
    #: the features the request uses that a node must know to serve it rightly
    #: (:mod:`reservoir.protocol.compatibility`): a node that does not know one declines,
    #: with the reason ``feature``. Set by the requestor, never by a caller.
    needs: Features = NO_FEATURES


class Lookup(_Message, tag="lookup", frozen=True, kw_only=True):
    """Published on the id's own topic (:func:`lookup_topic`), which only nodes holding
    something of the id bind: "who holds this id?" Holders of allocations answer
    ``AlreadyPlaced``; a node holding a reservation of the id for another requestor says
    so (``in_flight_elsewhere``), to both requestors unless the asker is ``following``.
    Nobody bound: the broker hands it back, and nobody holds the id. Tiers cannot do this
    job: the node holding a placement may sit in any tier."""

    kind: ClassVar[Literal["lookup"]] = "lookup"
    reply_to: Identifier
    #: the sender contends for nothing (it follows another requestor's placement, or
    #: only asks what is held): nodes tell it what they hold, and nobody else of it
    following: bool = False


class Offer(_Message, tag="offer", frozen=True, kw_only=True):
    """A node reserved room for ``slots`` instances until its reservation expires."""

    kind: ClassVar[Literal["offer"]] = "offer"
    reply_to: Identifier
    reservation_id: Identifier
    attempt: Annotated[int, Meta(ge=1)]
    slots: Annotated[int, Meta(ge=1)]
    #: the node's dominant share with this reservation included, 0..1
    utilisation: Annotated[float, Meta(ge=0)]
    #: what the node's weighers make of hosting this request; higher is better
    score: float = 0.0
    ttl_s: Annotated[float, Meta(gt=0)]
    #: members of the request's server group the node already hosts or holds
    group_members: Annotated[int, Meta(ge=0)] = 0
    #: the node's room, for the requestor's roster
    room: Room = field(default_factory=dict)


class Decline(_Message, tag="decline", frozen=True, kw_only=True):
    """A node cannot take the request. Sent when the request asks for an explanation, or
    when the only obstacle is other requests' live reservations (``busy``): then the
    requestor knows that waiting briefly may help."""

    kind: ClassVar[Literal["decline"]] = "decline"
    reply_to: Identifier
    attempt: Annotated[int, Meta(ge=1)]
    busy: bool = False
    reasons: tuple[Reason, ...] = ()
    group_members: Annotated[int, Meta(ge=0)] = 0
    room: Room = field(default_factory=dict)


class TaskReport(_Frozen, frozen=True, kw_only=True):
    """One instance's task as a node last knew it (in :class:`AlreadyPlaced`): the fields
    of a :class:`TaskState`, without the envelope."""

    allocation_id: Identifier
    state: TaskStateName
    driver: Annotated[str, Meta(max_length=64)] = ""
    exit_code: int | None = None
    reason: Annotated[str, Meta(max_length=500)] = ""
    limits: Annotated[str, Meta(max_length=200)] = ""
    kept: bool = False


class AlreadyPlaced(_Message, tag="already_placed", frozen=True, kw_only=True):
    """The node holds allocations for this request id (the request was placed), or
    remembers the tasks of some that ended (``allocations`` empty, ``tasks`` not)."""

    kind: ClassVar[Literal["already_placed"]] = "already_placed"
    reply_to: Identifier
    allocations: tuple[AllocationInfo, ...]
    #: the requestor that was awarded them: the one that finishes the request
    owner: Identifier | None = None
    #: when the placement they belong to was asked for (the award's ``requested_at_s``):
    #: of two placements of one id, the later one stands (see ``Award``). One value: a
    #: node holds one placement's allocations of an id (it answers any request for an id
    #: it holds with this message, so it never reserves for the id again)
    requested_at_s: PlacedAt = 0.0
    #: how many instances the placement has on every node together (the award's
    #: ``instances``, else the request's count): once an asker has heard of that many,
    #: every holder has answered. 0: not said (a node of an earlier release)
    instances: Annotated[int, Meta(ge=0, le=10_000)] = 0
    #: the tasks of the id's instances on this node, running or lately ended
    tasks: tuple[TaskReport, ...] = ()


class Award(_Message, tag="award", frozen=True, kw_only=True):
    """Turn ``slots`` of the reservation into allocations (the rest is released)."""

    kind: ClassVar[Literal["award"]] = "award"
    reply_to: Identifier
    reservation_id: Identifier
    slots: Annotated[int, Meta(ge=1)]
    traceparent: TraceParent | None = None
    #: the wall-clock time (seconds since the epoch, the requestor's clock) the requestor
    #: was asked to place the request: the node keeps it with the allocations. Should one
    #: id be placed twice (a holder away when a retry looked it up), the placement asked
    #: for later is the one its caller holds, and the earlier one is freed. 0: unknown
    #: (a requestor of an earlier release), older than any other.
    requested_at_s: PlacedAt = 0.0
    #: how many instances the whole placement has, on every node together: the node
    #: keeps it with the allocations, so that whoever asks who holds the id knows when
    #: every holder has answered. 0: not said (the node keeps the request's count)
    instances: Annotated[int, Meta(ge=0, le=10_000)] = 0


class Assessment(_Message, tag="assessment", frozen=True, kw_only=True):
    """A node's answer to a dry run: how many instances it could take now (0: none, and
    ``reasons`` say why when the request asks to explain), reserving nothing."""

    kind: ClassVar[Literal["assessment"]] = "assessment"
    reply_to: Identifier
    slots: Annotated[int, Meta(ge=0)]
    #: the node's dominant share now, 0..1
    utilisation: Annotated[float, Meta(ge=0)]
    #: what the node's weighers make of hosting the request; higher is better
    score: float = 0.0
    #: the narrowest tier the node belongs to, as a percentage
    tier: Annotated[int, Meta(ge=1, le=100)]
    #: only other requests' live reservations stand in the way
    busy: bool = False
    reasons: tuple[Reason, ...] = ()


class Release(_Message, tag="release", frozen=True, kw_only=True):
    """Drop the reservation: another node won, or the request is over."""

    kind: ClassVar[Literal["release"]] = "release"
    reservation_id: Identifier


class Accepted(_Message, tag="accepted", frozen=True, kw_only=True):
    """The node turned its reservation into allocations."""

    kind: ClassVar[Literal["accepted"]] = "accepted"
    reply_to: Identifier
    reservation_id: Identifier
    allocations: tuple[AllocationInfo, ...]
    room: Room = field(default_factory=dict)


class Refused(_Message, tag="refused", frozen=True, kw_only=True):
    """The node cannot honour an award (or withdraws an offer): the reservation is gone."""

    kind: ClassVar[Literal["refused"]] = "refused"
    reply_to: Identifier
    reservation_id: Identifier
    reason: Annotated[str, Meta(max_length=500)]


class Untrusted(_Message, tag="untrusted", frozen=True, kw_only=True):
    """A requestor refused a message sent in this node's name because of the key that
    signed it (``reason``: ``impersonation``, another node's key; ``unknown_key``, a key
    the node keyring does not list for this node), and says so to the node it claimed to
    be, which cannot see it otherwise: its offers are dropped before any requestor acts
    on them. At most one a minute per reason and node from each requestor. Its
    ``request_id`` is :data:`UNTRUSTED_ID`: it belongs to no conversation."""

    kind: ClassVar[Literal["untrusted"]] = "untrusted"
    reason: Literal["impersonation", "unknown_key"]
    #: the id of the key that signed the refused message: this node's own (its key is
    #: not the one the keyring lists for it), or another's (someone signs in its name)
    key_id: Annotated[str, Meta(min_length=1, max_length=300)]
    detail: Annotated[str, Meta(max_length=500)]


class Free(_Message, tag="free", frozen=True, kw_only=True):
    """Free allocations of the request: the ones named; else those that came of
    ``reservation_id`` (and the reservation itself); else everything the request holds
    on the node, reservation included."""

    kind: ClassVar[Literal["free"]] = "free"
    reply_to: Identifier
    allocation_ids: tuple[Identifier, ...] = ()
    reservation_id: Identifier | None = None


class Freed(_Message, tag="freed", frozen=True, kw_only=True):
    """The node no longer holds what the ``Free`` named (whether or not it ever did).
    ``allocation_ids`` and ``reservation_id`` echo the Free; ``freed`` lists what went."""

    kind: ClassVar[Literal["freed"]] = "freed"
    reply_to: Identifier
    allocation_ids: tuple[Identifier, ...] = ()
    reservation_id: Identifier | None = None
    freed: tuple[Identifier, ...] = ()
    room: Room = field(default_factory=dict)


class NodeStatus(_Message, tag="status", frozen=True, kw_only=True):
    """A node's place on the tier ladder and its room, for requestors' rosters. Published
    on :data:`ROSTER_TOPIC` when the node starts, whenever it moves to another tier, and
    (``leaving``) when it stops; sent to a requestor that asks with a :class:`RollCall`.
    (Its room also rides on every answer the node sends a requestor.)"""

    kind: ClassVar[Literal["status"]] = "status"
    request_id: Identifier = ROSTER_ID
    #: the node's address: where probes go
    reply_to: Identifier
    #: the narrowest tier the node belongs to, as a percentage
    tier: Annotated[int, Meta(ge=1, le=100)]
    leaving: bool = False
    #: an answer to a RollCall (the requestor times it: its first latency samples)
    answering: bool = False
    room: Room = field(default_factory=dict)
    #: the node publishes every change of its room for keepers (on ``ROOM_TOPIC``): a
    #: keeper that hears a status without it (a new node, one restarted, one that stopped
    #: when nobody heard) roll-calls the node, which then does
    room_news: bool = False
    #: sent by a node that is back (started with stored allocations, or reconnected):
    #: the lookup buckets of the caller-chosen ids it holds, as a
    #: :func:`bucket_bitmap`. While it was away a retry's lookup could not find them, so
    #: a requestor that answered one of those ids looks it up again and frees an
    #: earlier placement found beside its own (design.md, "Lookups"). Empty otherwise.
    rejoined_buckets: Annotated[bytes, Meta(max_length=LOOKUP_BUCKETS // 8)] = b""
    #: the node's release (``reservoir --version``); empty: it does not say (0.1.0)
    release: ReleaseName = ""
    #: the features it knows (:mod:`reservoir.protocol.compatibility`): a requestor
    #: probes it only for requests whose ``needs`` it knows
    features: Features = NO_FEATURES


class RollCall(_Message, tag="roll_call", frozen=True, kw_only=True):
    """Published on the widest tier's topic by a requestor whose roster is empty (it just
    started): every node answers with its :class:`NodeStatus`."""

    kind: ClassVar[Literal["roll_call"]] = "roll_call"
    request_id: Identifier = ROSTER_ID
    reply_to: Identifier
    #: sent by a roster keeper: the node then publishes every change of its room on
    #: :data:`ROOM_TOPIC` (which only keepers bind), not only its tier changes
    from_keeper: bool = False


class RosterQuery(_Message, tag="roster_query", frozen=True, kw_only=True):
    """Published on :data:`KEEPER_TOPIC` by a requestor that takes its roster from a
    keeper: "name me up to ``wanted`` nodes, emptiest tiers first". Every keeper bound
    answers with a :class:`RosterSample`."""

    kind: ClassVar[Literal["roster_query"]] = "roster_query"
    request_id: Identifier = ROSTER_ID
    reply_to: Identifier
    wanted: Annotated[int, Meta(ge=1, le=MAX_SAMPLE)]
    #: one instance's resources: only nodes whose room may take it, emptiest tiers
    #: first (a requestor whose own sample had none); empty: any node, uniformly
    needs: dict[str, Amount] = field(default_factory=dict)


class KeeperUp(_Message, tag="keeper_up", frozen=True, kw_only=True):
    """Published on :data:`ROSTER_TOPIC` by a roster keeper when it starts (and when its
    broker connection comes back): a requestor that follows the announcements (it found
    no keeper) asks it for a sample, and once one comes stops following them. Only such
    requestors (and other keepers) hear it: one delivery each per keeper start."""

    kind: ClassVar[Literal["keeper_up"]] = "keeper_up"
    request_id: Identifier = ROSTER_ID
    reply_to: Identifier


class RosterMember(_Frozen, frozen=True, kw_only=True):
    """A node as a keeper last heard of it: where to probe it, its tier and its room."""

    name: Identifier
    address: Identifier
    tier: Annotated[int, Meta(ge=1, le=100)]
    room: Room = field(default_factory=dict)
    #: the node's release and features, as its status said them
    release: ReleaseName = ""
    features: Features = NO_FEATURES


class RosterSample(_Message, tag="roster_sample", frozen=True, kw_only=True):
    """A keeper's answer to a :class:`RosterQuery`: nodes sampled uniformly from the
    emptiest tiers of its roster. A hint, like every roster: the nodes still decide."""

    kind: ClassVar[Literal["roster_sample"]] = "roster_sample"
    request_id: Identifier = ROSTER_ID
    reply_to: Identifier
    members: tuple[RosterMember, ...] = ()

    def __post_init__(self) -> None:
        if len(self.members) > MAX_SAMPLE:
            raise ValueError(f"a sample names at most {MAX_SAMPLE} nodes")


class LedgerQuery(_Message, tag="ledger_query", frozen=True, kw_only=True):
    """Published on the widest tier's topic by an auditor: every node answers with its
    whole ledger (:class:`LedgerReport`), so the invariants can be checked across the
    cluster from what the nodes hold rather than what requestors believe."""

    kind: ClassVar[Literal["ledger_query"]] = "ledger_query"
    request_id: Identifier = AUDIT_ID
    reply_to: Identifier
    #: names this audit, so an auditor tells its answers from a previous audit's
    audit_id: Identifier


class ResourceTally(_Frozen, frozen=True, kw_only=True):
    """One resource class of a node: usable capacity, allocated and reserved (by live
    reservations) amounts; and its inventory: ``total``, ``host_reserved`` and
    ``allocation_ratio`` (absent from an older node's report: ``total`` None)."""

    capacity: int
    allocated: Amount
    reserved: Amount
    total: Amount | None = None
    host_reserved: Amount = 0
    allocation_ratio: Annotated[float, Meta(gt=0)] = 1.0


class HeldAllocation(_Frozen, frozen=True, kw_only=True):
    """One allocation in a node's ledger, as a ledger report carries it."""

    allocation_id: Identifier
    request_id: Identifier
    reservation_id: Identifier
    #: the requestor that was awarded it
    owner: Identifier
    resources: dict[str, Amount]
    #: instances the request asked for in all (the audit's "placed at most once" bound)
    request_count: Annotated[int, Meta(ge=1)]


class HeldReservation(_Frozen, frozen=True, kw_only=True):
    """One live reservation in a node's ledger. ``expires_in_s`` is measured on the
    node's own clock when it answered (negative: the deadline has passed)."""

    reservation_id: Identifier
    request_id: Identifier
    owner: Identifier
    slots: Annotated[int, Meta(ge=0)]
    #: what each of the ``slots`` instances holds
    per_instance: dict[str, Amount]
    expires_in_s: float


class LedgerReport(_Message, tag="ledger_report", frozen=True, kw_only=True):
    """A node's ledger, in answer to a :class:`LedgerQuery`. A ledger too large for one
    message comes in ``parts`` messages numbered from 0; each carries the tallies."""

    kind: ClassVar[Literal["ledger_report"]] = "ledger_report"
    request_id: Identifier = AUDIT_ID
    reply_to: Identifier
    audit_id: Identifier
    #: unique per start of the node's process: parts of two incarnations never mix
    incarnation: Identifier
    part: Annotated[int, Meta(ge=0)]
    parts: Annotated[int, Meta(ge=1)]
    tier: Annotated[int, Meta(ge=1, le=100)]
    tallies: dict[str, ResourceTally]
    allocations: tuple[HeldAllocation, ...] = ()
    reservations: tuple[HeldReservation, ...] = ()
    #: what the node's own ledger says is wrong with it (overcommit)
    violations: tuple[Annotated[str, Meta(max_length=500)], ...] = ()
    #: the configuration the node runs with (inventory, NUMA cells, PCI devices, where
    #: it came from), for ``reservoir nodes``; in part 0 only
    configuration: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} of {self.parts}: parts are numbered from 0")


class TaskState(_Message, tag="task_state", frozen=True, kw_only=True):
    """What became of one instance's task, from the node running it: sent to the
    requestor that placed it as the state changes, and to anyone asking
    (:class:`TaskQuery`)."""

    kind: ClassVar[Literal["task_state"]] = "task_state"
    reply_to: Identifier
    allocation_id: Identifier
    state: TaskStateName
    driver: Annotated[str, Meta(max_length=64)] = ""
    #: the task's exit code (``exited``, ``stopped`` when known)
    exit_code: int | None = None
    #: why it failed to start, or how it was stopped
    reason: Annotated[str, Meta(max_length=500)] = ""
    #: which limits the driver applied (``cgroup``, ``rlimit``, ``docker``, ``none``)
    limits: Annotated[str, Meta(max_length=200)] = ""
    #: the allocation outlives the task
    kept: bool = False
    #: an answer to a TaskQuery, not news
    answering: bool = False


#: a task's output streams
OutputStream = Literal["stdout", "stderr"]
#: the most bytes of output one :class:`TaskOutput` carries (base64 in the JSON, the
#: message stays within the codec's 64 KiB)
OUTPUT_CHUNK_MAX: Final = 32 * 1024
#: the longest a node holds a :class:`TaskOutputQuery` waiting for output
OUTPUT_WAIT_MAX_S: Final = 30.0


class TaskOutputQuery(_Message, tag="task_output_query", frozen=True, kw_only=True):
    """Sent straight to the node running a task (``request_id`` is the task's request):
    up to ``max_bytes`` of its ``stream`` from ``offset`` on. With ``wait_s``, the node
    holds its answer until there is something past ``offset``, the task ended, or
    ``wait_s`` passed: a reader following the output asks again as each answer comes,
    so one answer is in flight per reader, and nothing is sent while nobody reads.
    ``max_bytes`` 0 asks for the task's state alone: held until the task ended."""

    kind: ClassVar[Literal["task_output_query"]] = "task_output_query"
    reply_to: Identifier
    allocation_id: Identifier
    stream: OutputStream = "stdout"
    offset: Annotated[int, Meta(ge=0)] = 0
    max_bytes: Annotated[int, Meta(ge=0, le=OUTPUT_CHUNK_MAX)] = OUTPUT_CHUNK_MAX
    wait_s: Annotated[float, Meta(ge=0, le=OUTPUT_WAIT_MAX_S)] = 0.0


class TaskOutput(_Message, tag="task_output", frozen=True, kw_only=True):
    """A node's answer to a :class:`TaskOutputQuery`: ``data``, the bytes of ``stream``
    from ``offset`` on (``skipped`` bytes before it were asked for but are no longer
    kept: the node keeps a bounded amount per stream), the stream's ``size`` so far,
    and the task's state."""

    kind: ClassVar[Literal["task_output"]] = "task_output"
    reply_to: Identifier
    allocation_id: Identifier
    stream: OutputStream = "stdout"
    offset: Annotated[int, Meta(ge=0)] = 0
    data: Annotated[bytes, Meta(max_length=OUTPUT_CHUNK_MAX)] = b""
    skipped: Annotated[int, Meta(ge=0)] = 0
    size: Annotated[int, Meta(ge=0)] = 0
    #: the task ended and ``data`` reaches the end of the stream: nothing more comes
    ended: bool = False
    #: the task as the node knows it (None: no task of the allocation is known there)
    task: TaskReport | None = None
    #: the node keeps output of the allocation (False: none, or its retention passed)
    kept: bool = True


class TaskQuery(_Message, tag="task_query", frozen=True, kw_only=True):
    """Published on the widest tier's topic: every node answers with a
    :class:`TaskState` for each task it knows of the request id (``every``: of every
    request; then ``request_id`` is ``tasks``). Nodes remember ended tasks for a while."""

    kind: ClassVar[Literal["task_query"]] = "task_query"
    reply_to: Identifier
    every: bool = False


Message = (
    ReservationRequest
    | Lookup
    | Offer
    | Decline
    | AlreadyPlaced
    | Award
    | Assessment
    | Release
    | Accepted
    | Refused
    | Free
    | Freed
    | NodeStatus
    | RollCall
    | RosterQuery
    | RosterSample
    | KeeperUp
    | LedgerQuery
    | LedgerReport
    | TaskState
    | TaskQuery
    | TaskOutputQuery
    | TaskOutput
    | Untrusted
)

#: Every message class: a machine takes an event of exactly one of these (they are final),
#: and drops anything else before it dispatches on ``kind``
MESSAGE_CLASSES: Final[frozenset[type]] = frozenset(get_args(Message))

#: The kinds only a requestor sends, and the kinds only a node sends.
REQUESTOR_KINDS: Final = frozenset(
    {
        "request",
        "lookup",
        "award",
        "release",
        "free",
        "roll_call",
        "ledger_query",
        # a roster keeper runs with a requestor's credentials
        "roster_query",
        "roster_sample",
        "keeper_up",
        "task_query",
        "task_output_query",
        "untrusted",
    }
)
NODE_KINDS: Final = frozenset(
    {
        "offer",
        "decline",
        "already_placed",
        "assessment",
        "accepted",
        "refused",
        "freed",
        "status",
        "ledger_report",
        "task_state",
        "task_output",
    }
)

_DECODER: Final = msgspec.json.Decoder(Message)
_ENCODER: Final = msgspec.json.Encoder()


def decode_message(body: bytes) -> Message:
    """Parse and validate one message from its JSON; raises :class:`msgspec.DecodeError`
    for bytes that are not JSON (or not UTF-8), :class:`msgspec.ValidationError` (a
    subclass) for JSON that is not a valid message, :class:`InvalidField` for a bad id or
    room, and :class:`RecursionError` for values nested too deep (in ``hints``, say).
    :meth:`reservoir.runtime.wire.Codec.decode` turns each into its ``DecodeError``."""
    message = _DECODER.decode(body)
    check_ids(message)
    return message


def encode_message(message: Message) -> bytes:
    """The message's JSON (fields left at their default are left out)."""
    return _ENCODER.encode(message)


def message_from_fields(fields: Mapping[str, object]) -> Message:
    """Build and validate a message from JSON-like fields (``kind`` included), checking
    every constraint as decoding does; raises :class:`msgspec.ValidationError` or
    :class:`InvalidField`."""
    message: Message = msgspec.convert(fields, Message)
    check_ids(message)
    return message


def validation_error_at(error: msgspec.ValidationError) -> tuple[str, str]:
    """Where in the message msgspec's ``error`` is, and what it says: "Expected `int` >= 1
    - at `$.allocations[0].slots`" is ``("allocations[0].slots", "Expected `int` >= 1")``;
    the place is empty for the message as a whole."""
    what, at, where = str(error).rpartition(" - at `$")
    if not at:
        return "", str(error)
    return where.rstrip("`").lstrip("."), what
