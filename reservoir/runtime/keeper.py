"""``RosterKeeper``: a roster keeper, live (``reservoir keeper``).

It drives a :class:`~reservoir.protocol.keeper.KeeperMachine` with a broker endpoint named
like a requestor's (``reservoir.requestor.<name>``: it runs with a requestor's credentials)
and answers the samples requestors ask for. It holds nothing a placement depends on: run
one or two per cluster (every keeper bound answers each query), restart them at will.
When its broker connection comes back after an outage it roll-calls the nodes and says it
is up again, as at start: requestors whose queries reached nobody meanwhile come back.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Hashable
from pathlib import Path
from typing import Final

from reservoir.broker import Broker
from reservoir.brokers import BrokerUrl
from reservoir.clock import Scheduler
from reservoir.observe.metrics import Metrics
from reservoir.protocol.addresses import requestor_address
from reservoir.protocol.effects import Effect
from reservoir.protocol.keeper import KeeperConfig, KeeperMachine
from reservoir.protocol.messages import Message
from reservoir.runtime.machine_runner import Driver
from reservoir.runtime.node_agent import REJOIN_CHECK_S
from reservoir.runtime.settings import Settings

__all__ = ["RosterKeeper"]

log = logging.getLogger("reservoir.keeper")

#: The timer key of the look at the broker connection (the machine sets no timer).
_RECONNECT_CHECK: Final = ("keeper", "reconnect-check")


class RosterKeeper(Driver):
    """Follows every node's announcements and hands requestors samples of them."""

    def __init__(
        self,
        broker: Broker | BrokerUrl | str | None = None,
        *,
        name: str | None = None,
        settings: Settings | None = None,
        scheduler: Scheduler | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        settings = settings if settings is not None else Settings()
        self.name = name or f"keeper-{secrets.token_hex(4)}"
        address = requestor_address(self.name)
        self.machine = KeeperMachine(
            KeeperConfig(keeper_id=self.name, reply_to=address, tiers=settings.ladder)
        )
        super().__init__(
            broker=broker,
            settings=settings,
            scheduler=scheduler,
            metrics=metrics,
            endpoint_name=address,
            role="requestor",
        )
        self._connections_seen = self.broker.connections
        try:
            self._run(self.machine.start)
        except BaseException:
            self._let_go()
            raise
        if self.broker.reconnects:
            with self._lock:
                self._set_timer(_RECONNECT_CHECK, self.scheduler.clock.now() + REJOIN_CHECK_S)

    def nodes_known(self) -> int:
        """How many nodes the keeper's roster holds."""
        with self._lock:
            return len(self.machine.roster)

    def status(self) -> dict[str, object]:
        """Whether it is on the broker, how many nodes it knows, what it has done
        (``samples`` sent, ``members_sent``, ``statuses`` heard) and received, as plain
        data."""
        with self._lock:
            known = len(self.machine.roster)
            counters = dict(self.machine.counters)
        return {
            "keeper": self.name,
            # False while the broker connection is down (the keeper reconnects by itself)
            "connected": self.broker.connected,
            "nodes_known": known,
            "counters": counters,
            # messages received, by kind (queries, statuses)
            "received": dict(self.metrics.by_label("received")),
        }

    def write_status(self, path: Path) -> None:
        """Write :meth:`status` as JSON, atomically (readers never see half a file)."""
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(json.dumps(self.status(), sort_keys=True))
        os.replace(partial, path)

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._cancel_all_timers()
        self._let_go()

    def __enter__(self) -> RosterKeeper:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- driver hooks ------------------------------------------------------------------

    def _handle_message(self, message: Message, now: float) -> list[Effect]:
        return self.machine.handle(message, now)

    def _handle_returned(self, message: Message, now: float) -> list[Effect]:
        return self.machine.on_unroutable(message, now)

    def _handle_timer(self, key: Hashable, now: float) -> list[Effect]:
        if key == _RECONNECT_CHECK:
            return self._check_reconnected(now)
        return self.machine.on_timer(key, now)

    def _check_reconnected(self, now: float) -> list[Effect]:
        """Under the lock, every REJOIN_CHECK_S: the connection came back since the last
        look (a counter, so no outage between two looks goes unseen)."""
        self._set_timer(_RECONNECT_CHECK, now + REJOIN_CHECK_S)
        connections = self.broker.connections
        if connections == self._connections_seen or not self.broker.connected:
            return []
        self._connections_seen = connections
        log.info("keeper %s is back on the broker: announcing itself again", self.name)
        return self.machine.announce(now)
