"""``Finder``: asks the nodes what they hold of a request id
(:mod:`reservoir.protocol.finding` is the machine), on an inbox of its own.

A :class:`~reservoir.runtime.requestor.Requestor` opens one the first time it is asked to
find (``Requestor.find``), on the same broker and scheduler, and closes it with itself. Its
inbox is its own so that the nodes' answers to a find never reach the requestor's
conversations: a requestor that hears ``AlreadyPlaced`` for an id it is not placing takes
the allocations for late ones, and frees those it was awarded itself (it may have placed
them and forgotten), or reconciles them with its own answer. A find must only look. The
inbox is named like a requestor's, so under the per-role broker users of
``deploy/rabbitmq/`` nodes may answer it, and it signs as a requestor.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Hashable

from reservoir.broker import Broker
from reservoir.clock import Scheduler
from reservoir.observe.metrics import Metrics
from reservoir.protocol.addresses import requestor_address
from reservoir.protocol.effects import Effect, Found
from reservoir.protocol.finding import Finding, FindTimer
from reservoir.protocol.messages import Message
from reservoir.protocol.placement import Holdings, Placement
from reservoir.runtime.machine_runner import Driver, Outcome
from reservoir.runtime.settings import Settings

__all__ = ["Finder"]


class Finder(Driver):
    """Finds what the nodes hold of request ids; any number of finds at once, one per id
    (a second find of an id being found shares its answer)."""

    def __init__(
        self,
        broker: Broker,
        *,
        name: str,
        settings: Settings,
        scheduler: Scheduler | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        address = requestor_address(name)
        self.machine = Finding(sender=name, reply_to=address)
        self._waiting: dict[str, list[concurrent.futures.Future[Holdings]]] = {}
        super().__init__(
            broker=broker,
            settings=settings,
            scheduler=scheduler,
            metrics=metrics,
            endpoint_name=address,
            role="requestor",
        )

    def find_future(
        self, request_id: str, deadline_s: float, *, expected: Placement | None = None
    ) -> concurrent.futures.Future[Holdings]:
        """Ask the nodes; the future resolves to what they hold of ``request_id``, settled
        once every holder has answered or the broker says no node binds the id's topic,
        not settled when ``deadline_s`` comes first. Raises ``InvalidField`` for an id no
        node would accept, ``ValueError`` for a deadline that is not positive."""
        future: concurrent.futures.Future[Holdings] = concurrent.futures.Future()
        outcomes: list[Outcome] = []
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.address} is closed")
            effects = self.machine.find(
                request_id, self.scheduler.clock.now(), deadline_s, expected=expected
            )
            self._waiting.setdefault(request_id, []).append(future)
            self._execute(effects, outcomes)
        self._settle(outcomes)
        return future

    def close(self, error: BaseException | None = None) -> None:
        """Stop finding; finds still waiting raise ``error`` (a ``RuntimeError`` by
        default). Idempotent."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._cancel_all_timers()
            ids = self.machine.abandon()
            waiting = [f for request_id in ids for f in self._waiting.pop(request_id, [])]
        for future in waiting:
            if not future.done():
                future.set_exception(error or RuntimeError(f"{self.address} closed"))
        self._let_go()

    # -- driver hooks ------------------------------------------------------------------

    def _conversation_of(self, key: Hashable) -> str | None:
        return key.request_id if isinstance(key, FindTimer) else None

    def _handle_message(self, message: Message, now: float) -> list[Effect]:
        return self.machine.handle(message, now)

    def _handle_returned(self, message: Message, now: float) -> list[Effect]:
        return self.machine.on_unroutable(message, now)

    def _handle_timer(self, key: Hashable, now: float) -> list[Effect]:
        return self.machine.on_timer(key, now)

    def _deliver(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            if type(outcome) is Found:
                with self._lock:
                    waiting = self._waiting.pop(outcome.request_id, [])
                for future in waiting:
                    if not future.done():  # a waiter that gave up is skipped
                        future.set_result(outcome.holdings)
