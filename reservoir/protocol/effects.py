"""Effects: what a state machine asks its driver to do.

The state machines in this package never touch a socket, a thread or a clock. Each call
takes an event and the current time and returns a list of these effects; the driver (the
live runtime, or the simulator) carries them out *in order*. Order matters: a node stores
an allocation before it sends ``Accepted``, so an acknowledged allocation survives a crash.

Effects are values: frozen msgspec structs, hashed and compared by their fields. A machine
builds several for every message it handles, and a struct is made in C, where a slotted
dataclass's ``__init__`` is a Python function (docs/performance.md, "The runtime"). They
are final: drivers tell them apart by exact class (``type(effect) is Send``), which is
cheaper than ``isinstance`` on a struct (that asks the struct's metaclass).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import final

import msgspec

from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import Message
from reservoir.protocol.placement import Holdings, Placement, PlacementError
from reservoir.protocol.task_book import EndedTask

__all__ = [
    "Bind",
    "CancelTimer",
    "Claim",
    "DeleteAllocation",
    "Dropped",
    "Effect",
    "Failed",
    "ForgetTask",
    "Found",
    "FreeCompleted",
    "Placed",
    "Publish",
    "RememberTask",
    "Send",
    "SetTimer",
    "StartTask",
    "StopTask",
    "StoreAllocation",
    "Unbind",
    "Unclaim",
]


@final
class Publish(msgspec.Struct, frozen=True):
    """Publish ``message`` on a topic of the request exchange."""

    topic: str
    message: Message


@final
class Send(msgspec.Struct, frozen=True):
    """Send ``message`` to one participant's address."""

    address: str
    message: Message


@final
class Bind(msgspec.Struct, frozen=True):
    """Start hearing a topic."""

    topic: str


@final
class Unbind(msgspec.Struct, frozen=True):
    """Stop hearing a topic."""

    topic: str


@final
class Claim(msgspec.Struct, frozen=True):
    """Hold ``request_id`` against every other requestor (:meth:`Endpoint.claim`): the
    answer comes back as ``RequestorMachine.on_claim``."""

    request_id: str


@final
class Unclaim(msgspec.Struct, frozen=True):
    """Let go of the claim of ``request_id``."""

    request_id: str


@final
class SetTimer(msgspec.Struct, frozen=True):
    """Call the machine's ``on_timer(key, now)`` at time ``at``; replaces a timer with the
    same key."""

    key: Hashable
    at: float


@final
class CancelTimer(msgspec.Struct, frozen=True):
    key: Hashable


@final
class StoreAllocation(msgspec.Struct, frozen=True):
    """Persist a new allocation before anything else is said about it."""

    allocation: Allocation


@final
class DeleteAllocation(msgspec.Struct, frozen=True):
    allocation_id: str


@final
class StartTask(msgspec.Struct, frozen=True):
    """Start the allocation's task (its ``task``) through the driver it names; the node
    asks only after the allocation is stored and ``Accepted`` is on its way. The driver
    reports back with :meth:`~reservoir.protocol.node.NodeMachine.task_changed`."""

    allocation: Allocation


@final
class StopTask(msgspec.Struct, frozen=True):
    """Stop the task of an allocation that was freed: SIGTERM, then SIGKILL after
    ``grace_s`` (or the driver's equivalent)."""

    allocation_id: str
    driver: str
    grace_s: float


@final
class RememberTask(msgspec.Struct, frozen=True):
    """Persist an ended task, so that a restarted node still tells of it until its
    retention passes (its state, and where its output is)."""

    task: EndedTask


@final
class ForgetTask(msgspec.Struct, frozen=True):
    """An ended task's retention passed (or newer ones took its place): its record and
    its output go."""

    allocation_id: str
    driver: str


@final
class Placed(msgspec.Struct, frozen=True):
    """A request is placed: hand ``placement`` to whoever asked."""

    request_id: str
    placement: Placement


@final
class Failed(msgspec.Struct, frozen=True):
    """A request cannot be placed; ``error`` explains what was tried."""

    request_id: str
    error: PlacementError


@final
class FreeCompleted(msgspec.Struct, frozen=True):
    """A placement's allocations are freed (``missing`` lists nodes that never answered)."""

    request_id: str
    freed: tuple[str, ...]
    missing: tuple[str, ...]


@final
class Found(msgspec.Struct, frozen=True):
    """What the nodes hold of a request id, asked for by a find
    (:mod:`reservoir.protocol.finding`)."""

    request_id: str
    holdings: Holdings


@final
class Dropped(msgspec.Struct, frozen=True):
    """A message was ignored: late, duplicate, unknown or out of place. Logged at debug
    level and counted under ``reason``; never an error."""

    reason: str
    detail: str


Effect = (
    Publish
    | Send
    | Bind
    | Unbind
    | Claim
    | Unclaim
    | SetTimer
    | CancelTimer
    | StoreAllocation
    | DeleteAllocation
    | StartTask
    | StopTask
    | RememberTask
    | ForgetTask
    | Placed
    | Failed
    | FreeCompleted
    | Found
    | Dropped
)
