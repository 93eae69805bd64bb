"""A whole reservoir on one virtual clock: the simulator tests and property tests use.

Every node agent and requestor is the live runtime class, driven by one
:class:`~reservoir.clock.VirtualScheduler` through one
:class:`~reservoir.brokers.inprocess.InProcessBroker`, so a five-second reservation expiry takes no
real time and a run is reproducible from its seed. :meth:`Simulation.finish` settles the run
and audits the invariants over every node's ledger.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from reservoir.brokers.inprocess import Faults, InProcessBroker
from reservoir.clock import VirtualScheduler
from reservoir.protocol.audit import AuditReport, NodeSnapshot, audit
from reservoir.protocol.placement import Placement
from reservoir.runtime.keeper import RosterKeeper
from reservoir.runtime.node_agent import NodeAgent
from reservoir.runtime.requestor import Requestor
from reservoir.runtime.settings import Settings

__all__ = ["Simulation"]


class Simulation:
    """Nodes and requestors sharing one broker and one virtual clock."""

    def __init__(self, *, faults: Faults | None = None, settings: Settings | None = None) -> None:
        self.scheduler = VirtualScheduler()
        self.broker = InProcessBroker(self.scheduler, faults=faults)
        self.settings = settings if settings is not None else Settings()
        self.nodes: dict[str, NodeAgent] = {}
        self.requestors: list[Requestor] = []
        self.keepers: list[RosterKeeper] = []
        self._closed = False

    # -- building ----------------------------------------------------------------------

    def add_node(self, name: str, **kwargs: Any) -> NodeAgent:
        """Start a node agent; keyword arguments as for :class:`NodeAgent`."""
        kwargs.setdefault("settings", self.settings)
        node = NodeAgent(self.broker, name=name, scheduler=self.scheduler, **kwargs)
        self.nodes[name] = node
        self.scheduler.run_until_idle()
        return node

    def add_nodes(self, count: int, prefix: str = "node", **kwargs: Any) -> list[NodeAgent]:
        return [self.add_node(f"{prefix}-{i}", **kwargs) for i in range(count)]

    def restart_node(self, name: str, **kwargs: Any) -> NodeAgent:
        """Stop a node agent and start a new one under the same name (same store if the
        caller passes it in ``kwargs``)."""
        self.nodes.pop(name).close()
        return self.add_node(name, **kwargs)

    def add_requestor(self, name: str | None = None, **kwargs: Any) -> Requestor:
        """Start a requestor; keyword arguments as for :class:`Requestor`. Unnamed ones are
        numbered (``requestor-0``, ...): a requestor's name seeds its sampling, so a run
        is reproducible."""
        kwargs.setdefault("settings", self.settings)
        if name is None:
            name = f"requestor-{len(self.requestors)}"
        requestor = Requestor(self.broker, name=name, scheduler=self.scheduler, **kwargs)
        self.requestors.append(requestor)
        return requestor

    def add_keeper(self, name: str | None = None, **kwargs: Any) -> RosterKeeper:
        """Start a roster keeper; keyword arguments as for :class:`RosterKeeper`."""
        kwargs.setdefault("settings", self.settings)
        if name is None:
            name = f"keeper-{len(self.keepers)}"
        keeper = RosterKeeper(self.broker, name=name, scheduler=self.scheduler, **kwargs)
        self.keepers.append(keeper)
        self.scheduler.run_until_idle()
        return keeper

    # -- running -----------------------------------------------------------------------

    def run_until_done(
        self,
        futures: Iterable[concurrent.futures.Future[Any]],
        *,
        timeout_s: float = 120.0,
    ) -> bool:
        """Advance virtual time until every future is done; False if ``timeout_s`` of
        virtual time passed first."""
        pending = list(futures)
        return self.scheduler.run_until(lambda: all(f.done() for f in pending), timeout_s=timeout_s)

    def place(self, requestor: Requestor, *, wait_s: float = 600.0, **fields: Any) -> Placement:
        """Submit one request (keyword fields as for ``Requestor.submit``, ``timeout_s``
        included) and run virtual time until it is decided; raises as ``reserve`` would."""
        future = requestor.submit(**fields)
        if not self.run_until_done([future], timeout_s=wait_s):
            raise TimeoutError(f"no verdict within {wait_s}s of virtual time")
        return future.result(timeout=0)

    def advance(self, seconds: float) -> None:
        self.scheduler.advance(seconds)

    # -- checking ----------------------------------------------------------------------

    def snapshots(self) -> list[NodeSnapshot]:
        return [node.snapshot() for node in self.nodes.values()]

    def settle(self) -> None:
        """Let every reservation's TTL and every retry run out."""
        self.scheduler.advance(self.settings.ttl_s * 3 + 1.0)

    def audit(self, placements: Sequence[Placement] = ()) -> AuditReport:
        return audit(self.snapshots(), placements)

    def finish(
        self, placements: Sequence[Placement] = (), *, allow_orphans: bool = True
    ) -> AuditReport:
        """Settle, audit (raising :class:`~reservoir.AuditFailed` on a broken invariant)
        and close."""
        self.settle()
        report = self.audit(placements)
        self.close()
        report.raise_if_failed(allow_orphans=allow_orphans)
        return report

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for requestor in self.requestors:
            requestor.close()
        for keeper in self.keepers:
            keeper.close()
        for node in self.nodes.values():
            node.close()
        self.scheduler.run_until_idle()
        self.broker.close()
        self.scheduler.close()

    def counters(self) -> Mapping[str, int]:
        """Every participant's counters, summed."""
        total: dict[str, int] = {}
        for participant in [*self.nodes.values(), *self.requestors]:
            for key, value in participant.metrics.snapshot().items():
                total[key] = total.get(key, 0) + value
        return total
