"""reservoir: place work on compute nodes with a fanout reservation protocol.

A requestor broadcasts a reservation request on utilisation-tiered topics; every node that
can take it reserves the resources and answers; the requestor awards a winner and releases
the rest; unclaimed reservations expire. The node is the source of truth, so concurrent
requestors never double-book it. See README.md and docs/ (docs/design.md is the design of record).
"""

from reservoir.broker import Broker, BrokerError, Delivery, Endpoint, UnsupportedBroker
from reservoir.clock import (
    Clock,
    FakeClock,
    Scheduler,
    SystemClock,
    ThreadScheduler,
    VirtualScheduler,
)
from reservoir.protocol.audit import AuditFailed, AuditReport, NodeSnapshot, audit
from reservoir.protocol.ledger import Allocation, Inventory
from reservoir.protocol.messages import GroupSpec, NumaSpec
from reservoir.protocol.numa import NumaCell, NumaTopology, PciDevice
from reservoir.protocol.placement import (
    Explanation,
    PlacedAllocation,
    Placement,
    PlacementError,
    PlacementRequest,
    PlacementTimeout,
)
from reservoir.protocol.tiers import TierLadder
from reservoir.runtime.keeper import RosterKeeper
from reservoir.runtime.node_agent import NodeAgent
from reservoir.runtime.requestor import FreeIncomplete, Requestor, RequestorClosed
from reservoir.runtime.settings import Settings
from reservoir.runtime.store import SqliteStore, StateError
from reservoir.version import __version__ as __version__

__all__ = [
    "Allocation",
    "AuditFailed",
    "AuditReport",
    "Broker",
    "BrokerError",
    "Clock",
    "Delivery",
    "Endpoint",
    "Explanation",
    "FakeClock",
    "FreeIncomplete",
    "GroupSpec",
    "Inventory",
    "NodeAgent",
    "NodeSnapshot",
    "NumaCell",
    "NumaSpec",
    "NumaTopology",
    "PciDevice",
    "PlacedAllocation",
    "Placement",
    "PlacementError",
    "PlacementRequest",
    "PlacementTimeout",
    "Requestor",
    "RequestorClosed",
    "RosterKeeper",
    "Scheduler",
    "Settings",
    "SqliteStore",
    "StateError",
    "SystemClock",
    "ThreadScheduler",
    "TierLadder",
    "UnsupportedBroker",
    "VirtualScheduler",
    "audit",
]
