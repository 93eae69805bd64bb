"""Live node agents on one in-process broker, in real time: what a test of code that talks
to reservoir (a service, a requestor, a web app) places on without a RabbitMQ.

Unlike :class:`~reservoir.testing.Simulation` (a virtual clock, deterministic from a seed),
the nodes here run on their own threads and the wall clock, as they do in production; a
request placed through the broker is answered as a real cluster would answer it.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

from reservoir.brokers.inprocess import InProcessBroker
from reservoir.protocol.audit import audit
from reservoir.protocol.placement import Placement
from reservoir.runtime.node_agent import NodeAgent

__all__ = ["InProcessCluster"]


class InProcessCluster:
    """Node agents on one :class:`~reservoir.brokers.inprocess.InProcessBroker`.

    ``broker``: the broker to start the nodes on; without one the cluster makes its own.
    :meth:`close` (or leaving the ``with`` block) closes the nodes, then the broker if the
    cluster made it: a broker given is the giver's to close."""

    def __init__(self, broker: InProcessBroker | None = None) -> None:
        self._owns_broker = broker is None
        self.broker = broker if broker is not None else InProcessBroker()
        self.nodes: list[NodeAgent] = []

    def add_node(self, name: str, **options: Any) -> NodeAgent:
        """Start a node agent named ``name``; keyword arguments as for :class:`NodeAgent`
        (``vcpus``, ``memory_mb``, ``settings``, ...)."""
        node = NodeAgent(self.broker, name=name, **options)
        self.nodes.append(node)
        return node

    def add_nodes(self, count: int, prefix: str = "node", **options: Any) -> list[NodeAgent]:
        """Start ``count`` node agents named ``<prefix>-0``, ``<prefix>-1``, ...; keyword
        arguments as for :class:`NodeAgent`, the same for each."""
        return [self.add_node(f"{prefix}-{i}", **options) for i in range(count)]

    def held(self) -> int:
        """How many allocations the nodes hold, together."""
        return sum(len(node.allocations()) for node in self.nodes)

    def audit(self, placements: Iterable[Placement] = ()) -> None:
        """The invariant audit over every node's ledger, against the ``placements`` the
        test was answered with; raises :class:`~reservoir.AuditFailed` naming what is
        broken."""
        audit([node.snapshot() for node in self.nodes], list(placements)).raise_if_failed()

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        if self._owns_broker:
            self.broker.close()

    def __enter__(self) -> InProcessCluster:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
