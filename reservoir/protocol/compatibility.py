"""Which releases run side by side, what each one reads, and how a message is written for
a reader of the release before (docs/design.md, "Upgrades: two releases at once").

The policy, as far as code holds it:

- **Release lines.** A release line is a release's first two numbers (``0.2`` for
  ``0.2.0.dev0`` or ``0.2.3``). A cluster runs at most two lines at once, in every role:
  this one and the one before (:data:`RELEASE_LINES`: the lines this code knows, oldest
  first, its own last).
- **What a reader ignores.** From 0.2 on a reader ignores a field it does not know, so a
  field a release adds reaches older readers as nothing. 0.1 refuses a whole message with
  a field it does not know (its structs forbid unknown fields): a participant writing for
  0.1 (its ``compatible_with``, by default the line before its own) leaves out every
  field added since (:func:`backport`). :data:`ADDED` lists every such field with the line
  that added it; a test holds it to 0.1's own decoder.
- **What a reader must not ignore.** A request field a node must understand to serve the
  request rightly belongs to a *feature* (:data:`FEATURES`), which the request names in
  ``needs``: a node that does not know a feature it names declines the request with the
  reason ``feature``, in words, rather than serving it wrongly or dropping it. Such a
  field is *essential*: it cannot be left out for a reader that does not know it, so a
  requestor writing for 0.1 refuses the request before it asks anyone.
- **Saying what one runs.** A node says its release and the features it knows in its
  status, and a keeper passes them on in its samples, so that a requestor probes only
  nodes that know what a request needs (for readers of 0.1 both are left out: the node
  looks like one of 0.1, which is all such a reader can be told). A node also carries a
  trait per release line from 0.2 to its own (:func:`release_traits`,
  ``RESERVOIR_RELEASE_0_2``): a request may require or forbid one, and a node of 0.1,
  which has none, declines it as for any trait.

Pure, like the rest of the protocol: it knows no build, only the lines and what each reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import UnionType
from typing import Any, Final, NamedTuple, TypeVar, Union, get_args, get_origin, get_type_hints

import msgspec
import msgspec.structs

from reservoir.protocol.messages import (
    NO_FEATURES,
    InstanceShape,
    Message,
    NodeStatus,
    ReservationRequest,
    RosterMember,
)

__all__ = [
    "ADDED",
    "ADDED_KINDS",
    "FEATURES",
    "KNOWN_FEATURES",
    "OLDEST_RELEASE",
    "RELEASE_LINES",
    "STRICT_LINES",
    "Added",
    "Feature",
    "Unwritable",
    "backport",
    "line_key",
    "line_of",
    "needed_by",
    "reads_features",
    "release_traits",
    "said_features",
    "said_release",
]

#: The release lines this code knows, oldest first, its own last. A cluster may run the
#: last two at once; a participant may be told to write for either (``compatible_with``).
RELEASE_LINES: Final = ("0.1", "0.2")
#: The first release, and the one release whose participants say nothing of their
#: release: a node whose status or ledger names none is of this release.
OLDEST_RELEASE: Final = "0.1.0"
#: The lines whose readers refuse a message with a field they do not know.
STRICT_LINES: Final = frozenset({"0.1"})

_RELEASE = re.compile(r"(\d+)\.(\d+)(?:[.\-+].*)?\Z")


def line_of(release: str) -> str:
    """The release line of ``release``: ``0.2`` for ``0.2.0.dev0``; raises ValueError for a
    string that is no release."""
    matched = _RELEASE.match(release)
    if matched is None:
        raise ValueError(f"{release!r} is not a release (such as 0.2 or 0.2.1)")
    return f"{int(matched.group(1))}.{int(matched.group(2))}"


def line_key(line: str) -> tuple[int, int]:
    """``line`` (``0.2``) as numbers, to compare lines by."""
    major, minor = line.split(".")
    return int(major), int(minor)


def reads_features(line: str) -> bool:
    """Whether a reader of ``line`` reads a request's ``needs`` (0.2 and later)."""
    return line not in STRICT_LINES


def release_traits(release: str) -> frozenset[str]:
    """The traits of a node of ``release``: ``RESERVOIR_RELEASE_<major>_<minor>`` for every
    line of its major version up to its own, from 0.2 on (0.1 had none: the mechanism
    came after it), so that ``required_traits`` naming one asks for nodes of that line or
    later, and ``forbidden_traits`` for nodes before it. An empty or unknown release has
    none."""
    try:
        major, minor = line_key(line_of(release))
    except ValueError:
        return frozenset()
    first = 2 if major == 0 else 0
    return frozenset(f"RESERVOIR_RELEASE_{major}_{m}" for m in range(first, minor + 1))


class Feature(NamedTuple):
    """Something a node of a later release knows: a request field it must understand to
    serve the request rightly, or a kind of message it answers."""

    name: str
    #: the release line that brought it: nodes of earlier lines do not know it
    line: str
    #: what it is, as a decline or a refusal says it ("task output")
    what: str
    #: whether a request uses it (None: no request does; a kind of message it answers)
    used_by: Callable[[InstanceShape], bool] | None = None


#: The features brought after 0.1, by name: a request using one names it in ``needs``,
#: nodes say which they know in their status and their configuration.
FEATURES: Final[Mapping[str, Feature]] = {
    # a node answers TaskOutputQuery: a reader asks only nodes that say so
    "task_output": Feature("task_output", "0.2", "task output"),
}
#: the features this code knows
KNOWN_FEATURES: Final[frozenset[str]] = frozenset(FEATURES) or NO_FEATURES


def needed_by(shape: InstanceShape, features: Mapping[str, Feature] = FEATURES) -> frozenset[str]:
    """The features ``shape`` uses (``needs``), of those in ``features``."""
    if not features:
        return NO_FEATURES
    used = frozenset(
        name
        for name, feature in features.items()
        if feature.used_by is not None and feature.used_by(shape)
    )
    return used or NO_FEATURES


class Added(NamedTuple):
    """A field added after 0.1: the line that added it, and whether it is essential (a
    reader that does not know it must not read the message without it)."""

    line: str
    essential: bool = False


#: Every field added to a message, or to a part of one, after 0.1.0, with the line that
#: added it. Each has a default, left out of the JSON, so a message not using it is byte
#: for byte what 0.1 writes.
ADDED: Final[Mapping[type, Mapping[str, Added]]] = {
    NodeStatus: {"release": Added("0.2"), "features": Added("0.2")},
    RosterMember: {"release": Added("0.2"), "features": Added("0.2")},
    ReservationRequest: {"needs": Added("0.2", essential=True)},
}


#: Every message kind added after 0.1.0, with the line that added it. A reader that does
#: not know a kind drops it (``unknown_kind``): a kind that asks for an answer (essential)
#: goes only to a participant known to know it, from its status or its ledger's
#: configuration (:func:`said_features`), which every release answers; one whose loss is
#: harmless (news) may go to anyone.
ADDED_KINDS: Final[Mapping[str, Added]] = {
    # asks for an answer: sent only to a node whose features name ``task_output``
    "task_output_query": Added("0.2", essential=True),
    # the answer, to a reader that asked
    "task_output": Added("0.2"),
}


def said_release(configuration: Mapping[str, Any]) -> str:
    """The release a node's configuration (its ledger report's, which every release
    sends whatever it writes for) names: :data:`OLDEST_RELEASE` when it names none."""
    release = configuration.get("release")
    return release if isinstance(release, str) and release else OLDEST_RELEASE


def said_features(configuration: Mapping[str, Any]) -> frozenset[str]:
    """The features a node's configuration names (none for a node of 0.1.0)."""
    features = configuration.get("features")
    if not isinstance(features, list):
        return NO_FEATURES
    return frozenset(f for f in features if isinstance(f, str)) or NO_FEATURES


class Unwritable(ValueError):
    """A message holds an essential field its reader's release does not know: a bug in
    whoever built it (a requestor refuses such a request before it asks anyone)."""


_M = TypeVar("_M", bound=Message)
_Plan = Callable[[Any], Any]
#: (reader line, class) -> how to write one of the class for that reader; None: as it is
_PLANS: dict[tuple[str, type], _Plan | None] = {}


def backport(message: _M, reader: str) -> _M:
    """``message`` as a reader of the line ``reader`` can read it: the fields it does not
    know left out when it refuses unknown fields (0.1), the message itself otherwise.
    Raises :class:`Unwritable` when an essential field would have to go."""
    if reader not in STRICT_LINES:
        return message
    plan = _plan(reader, type(message))
    return message if plan is None else plan(message)


def _plan(reader: str, cls: type) -> _Plan | None:
    key = (reader, cls)
    if key not in _PLANS:
        _PLANS[key] = None  # a struct holding itself (none does) would end here
        _PLANS[key] = _make_plan(reader, cls)
    return _PLANS[key]


def _make_plan(reader: str, cls: type) -> _Plan | None:
    newer = {
        name: added
        for name, added in ADDED.get(cls, {}).items()
        if line_key(added.line) > line_key(reader)
    }
    defaults = {f.name: f for f in msgspec.structs.fields(cls)}
    nested: list[tuple[str, Callable[[Any], Any]]] = []
    for name, hint in get_type_hints(cls).items():
        if name not in cls.__struct_fields__ or name in newer:  # type: ignore[attr-defined]
            continue
        each = _nested_plan(reader, hint)
        if each is not None:
            nested.append((name, each))
    if not newer and not nested:
        return None

    # The default itself, not an equal value: the JSON leaves out a field holding its
    # default object, and may write an equal one (an empty frozenset is not the one in
    # the class), which a reader of 0.1 refuses.
    for name in newer:
        if defaults[name].default is msgspec.NODEFAULT:
            raise TypeError(f"{cls.__name__}.{name}: a field added after 0.1 needs a default")

    def write(message: Any) -> Any:
        changes: dict[str, Any] = {}
        for name, added in newer.items():
            default = defaults[name].default
            value = getattr(message, name)
            if value is default:
                continue
            if added.essential and value != default:
                raise Unwritable(
                    f"{cls.__name__}.{name} (added in {added.line}) cannot be written "
                    f"for a reader of {reader}, which does not know it"
                )
            changes[name] = default
        for name, each in nested:
            value = getattr(message, name)
            written = each(value)
            if written is not value:
                changes[name] = written
        return msgspec.structs.replace(message, **changes) if changes else message

    return write


def _nested_plan(reader: str, hint: object) -> Callable[[Any], Any] | None:
    """How to write a field of type ``hint`` holding structs with fields to leave out."""
    origin, args = get_origin(hint), get_args(hint)
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return _plan(reader, hint)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return None  # fixed tuples of plain values only
    if origin is tuple:
        each = _nested_plan(reader, args[0])
        if each is None:
            return None
        return lambda values: _written_all(values, each)
    if origin in (Union, UnionType) and args:  # an optional struct
        plans = [_nested_plan(reader, arg) for arg in args if arg is not type(None)]
        inner = next((p for p in plans if p is not None), None)
        if inner is None:
            return None
        return lambda value: value if value is None else inner(value)
    return None


def _written_all(values: tuple[Any, ...], each: Callable[[Any], Any]) -> tuple[Any, ...]:
    written = tuple(each(value) for value in values)
    return values if all(a is b for a, b in zip(written, values, strict=True)) else written
