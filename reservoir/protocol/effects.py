"""Effects: what a state machine asks its driver to do.

The state machines in this package never touch a socket, a thread or a clock. Each call
takes an event and the current time and returns a list of these effects; the driver (the
live runtime, or the simulator) carries them out *in order*. Order matters: a node stores
an allocation before it sends ``Accepted``, so an acknowledged allocation survives a crash.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import Message
from reservoir.protocol.placement import Placement, PlacementError

__all__ = [
    "Bind",
    "CancelTimer",
    "DeleteAllocation",
    "Dropped",
    "Effect",
    "Failed",
    "FreeCompleted",
    "Placed",
    "Publish",
    "Send",
    "SetTimer",
    "StoreAllocation",
    "Unbind",
]


@dataclass(frozen=True, slots=True)
class Publish:
    """Publish ``message`` on a topic of the request exchange."""

    topic: str
    message: Message


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to one participant's address."""

    address: str
    message: Message


@dataclass(frozen=True, slots=True)
class Bind:
    """Start hearing a topic."""

    topic: str


@dataclass(frozen=True, slots=True)
class Unbind:
    """Stop hearing a topic."""

    topic: str


@dataclass(frozen=True, slots=True)
class SetTimer:
    """Call the machine's ``on_timer(key, now)`` at time ``at``; replaces a timer with the
    same key."""

    key: Hashable
    at: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    key: Hashable


@dataclass(frozen=True, slots=True)
class StoreAllocation:
    """Persist a new allocation before anything else is said about it."""

    allocation: Allocation


@dataclass(frozen=True, slots=True)
class DeleteAllocation:
    allocation_id: str


@dataclass(frozen=True, slots=True)
class Placed:
    """A request is placed: hand ``placement`` to whoever asked."""

    request_id: str
    placement: Placement


@dataclass(frozen=True, slots=True)
class Failed:
    """A request cannot be placed; ``error`` explains what was tried."""

    request_id: str
    error: PlacementError


@dataclass(frozen=True, slots=True)
class FreeCompleted:
    """A placement's allocations are freed (``missing`` lists nodes that never answered)."""

    request_id: str
    freed: tuple[str, ...]
    missing: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Dropped:
    """A message was ignored: late, duplicate, unknown or out of place. Logged at debug
    level and counted under ``reason``; never an error."""

    reason: str
    detail: str


Effect = (
    Publish
    | Send
    | Bind
    | Unbind
    | SetTimer
    | CancelTimer
    | StoreAllocation
    | DeleteAllocation
    | Placed
    | Failed
    | FreeCompleted
    | Dropped
)
