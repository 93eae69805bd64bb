"""Effects: what a state machine asks its driver to do.

The state machines in this package never touch a socket, a thread or a clock. Each call
takes an event and the current time and returns a list of these effects; the driver (the
live runtime, or the simulator) carries them out *in order*. Order matters: a node stores
an allocation before it sends ``Accepted``, so an acknowledged allocation survives a crash.

Effects are values, but slotted dataclasses with a hash of their fields rather than frozen
ones: a machine builds one for nearly every message it handles, and a frozen dataclass's
``__init__`` (``object.__setattr__`` per field) costs 2.5 times as much. Nothing changes an
effect once it is made.
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
    "Found",
    "FreeCompleted",
    "Placed",
    "Publish",
    "Send",
    "SetTimer",
    "StartTask",
    "StopTask",
    "StoreAllocation",
    "Unbind",
]


@dataclass(slots=True, unsafe_hash=True)
class Publish:
    """Publish ``message`` on a topic of the request exchange."""

    topic: str
    message: Message


@dataclass(slots=True, unsafe_hash=True)
class Send:
    """Send ``message`` to one participant's address."""

    address: str
    message: Message


@dataclass(slots=True, unsafe_hash=True)
class Bind:
    """Start hearing a topic."""

    topic: str


@dataclass(slots=True, unsafe_hash=True)
class Unbind:
    """Stop hearing a topic."""

    topic: str


@dataclass(slots=True, unsafe_hash=True)
class SetTimer:
    """Call the machine's ``on_timer(key, now)`` at time ``at``; replaces a timer with the
    same key."""

    key: Hashable
    at: float


@dataclass(slots=True, unsafe_hash=True)
class CancelTimer:
    key: Hashable


@dataclass(slots=True, unsafe_hash=True)
class StoreAllocation:
    """Persist a new allocation before anything else is said about it."""

    allocation: Allocation


@dataclass(slots=True, unsafe_hash=True)
class DeleteAllocation:
    allocation_id: str


@dataclass(slots=True, unsafe_hash=True)
class StartTask:
    """Start the allocation's task (its ``task``) through the driver it names; the node
    asks only after the allocation is stored and ``Accepted`` is on its way. The driver
    reports back with :meth:`~reservoir.protocol.node.NodeMachine.task_changed`."""

    allocation: Allocation


@dataclass(slots=True, unsafe_hash=True)
class StopTask:
    """Stop the task of an allocation that was freed: SIGTERM, then SIGKILL after
    ``grace_s`` (or the driver's equivalent)."""

    allocation_id: str
    driver: str
    grace_s: float


@dataclass(slots=True, unsafe_hash=True)
class Placed:
    """A request is placed: hand ``placement`` to whoever asked."""

    request_id: str
    placement: Placement


@dataclass(slots=True, unsafe_hash=True)
class Failed:
    """A request cannot be placed; ``error`` explains what was tried."""

    request_id: str
    error: PlacementError


@dataclass(slots=True, unsafe_hash=True)
class FreeCompleted:
    """A placement's allocations are freed (``missing`` lists nodes that never answered)."""

    request_id: str
    freed: tuple[str, ...]
    missing: tuple[str, ...]


@dataclass(slots=True, unsafe_hash=True)
class Found:
    """What the nodes hold of a request id, asked for by a find
    (:mod:`reservoir.protocol.finding`): None when nobody answered holding any of it."""

    request_id: str
    placement: Placement | None


@dataclass(slots=True, unsafe_hash=True)
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
    | StartTask
    | StopTask
    | Placed
    | Failed
    | FreeCompleted
    | Found
    | Dropped
)
