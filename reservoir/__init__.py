"""reservoir: place work on compute nodes with a fanout reservation protocol.

A requestor broadcasts a reservation request on utilisation-tiered topics; every node that
can take it reserves the resources and answers; the requestor awards a winner and releases
the rest; unclaimed reservations expire. The node is the source of truth, so concurrent
requestors never double-book it. See README.md and docs/ (docs/design.md is the design of record).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from reservoir.version import __version__ as __version__

# The names below are imported when first used (PEP 562), not with the package: the
# ``reservoir`` command installs its interruption handler first thing, and importing the
# whole library before it could run would leave Ctrl-C in that first half second to a
# KeyboardInterrupt traceback.
if TYPE_CHECKING:
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
        Holdings,
        PlacedAllocation,
        Placement,
        PlacementError,
        PlacementRequest,
        PlacementTimeout,
    )
    from reservoir.protocol.tiers import TierLadder
    from reservoir.runtime.checked_request import CheckedRequest
    from reservoir.runtime.keeper import RosterKeeper
    from reservoir.runtime.node_agent import NodeAgent
    from reservoir.runtime.requestor import (
        FindIncomplete,
        FreeIncomplete,
        Requestor,
        RequestorClosed,
    )
    from reservoir.runtime.settings import Settings
    from reservoir.runtime.store import SqliteStore, StateError

#: where each public name lives
_WHERE = {
    "Allocation": "reservoir.protocol.ledger",
    "AuditFailed": "reservoir.protocol.audit",
    "AuditReport": "reservoir.protocol.audit",
    "Broker": "reservoir.broker",
    "BrokerError": "reservoir.broker",
    "CheckedRequest": "reservoir.runtime.checked_request",
    "Clock": "reservoir.clock",
    "Delivery": "reservoir.broker",
    "Endpoint": "reservoir.broker",
    "Explanation": "reservoir.protocol.placement",
    "FakeClock": "reservoir.clock",
    "FindIncomplete": "reservoir.runtime.requestor",
    "FreeIncomplete": "reservoir.runtime.requestor",
    "Holdings": "reservoir.protocol.placement",
    "GroupSpec": "reservoir.protocol.messages",
    "Inventory": "reservoir.protocol.ledger",
    "NodeAgent": "reservoir.runtime.node_agent",
    "NodeSnapshot": "reservoir.protocol.audit",
    "NumaCell": "reservoir.protocol.numa",
    "NumaSpec": "reservoir.protocol.messages",
    "NumaTopology": "reservoir.protocol.numa",
    "PciDevice": "reservoir.protocol.numa",
    "PlacedAllocation": "reservoir.protocol.placement",
    "Placement": "reservoir.protocol.placement",
    "PlacementError": "reservoir.protocol.placement",
    "PlacementRequest": "reservoir.protocol.placement",
    "PlacementTimeout": "reservoir.protocol.placement",
    "Requestor": "reservoir.runtime.requestor",
    "RequestorClosed": "reservoir.runtime.requestor",
    "RosterKeeper": "reservoir.runtime.keeper",
    "Scheduler": "reservoir.clock",
    "Settings": "reservoir.runtime.settings",
    "SqliteStore": "reservoir.runtime.store",
    "StateError": "reservoir.runtime.store",
    "SystemClock": "reservoir.clock",
    "ThreadScheduler": "reservoir.clock",
    "TierLadder": "reservoir.protocol.tiers",
    "UnsupportedBroker": "reservoir.broker",
    "VirtualScheduler": "reservoir.clock",
    "audit": "reservoir.protocol.audit",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'reservoir' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # once found, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__all__ = [
    "Allocation",
    "AuditFailed",
    "AuditReport",
    "Broker",
    "BrokerError",
    "CheckedRequest",
    "Clock",
    "Delivery",
    "Endpoint",
    "Explanation",
    "FakeClock",
    "FindIncomplete",
    "FreeIncomplete",
    "GroupSpec",
    "Holdings",
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
