"""A question asked once of every serving node, and its answers gathered: the part an
audit (:class:`~reservoir.runtime.auditor.LedgerCollector`) and a dry run
(:class:`~reservoir.runtime.dry_run.DryRun`) share.

The question is published on the widest tier's topic, which every serving node binds; the
asker's inbox is named like a requestor's, so that under the per-role broker users of
``deploy/rabbitmq/`` nodes may answer it. A question the broker hands back as unroutable
means no node listens at all, and waiting stops at once.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections.abc import Hashable

from reservoir.broker import Broker
from reservoir.brokers import BrokerUrl
from reservoir.clock import Scheduler
from reservoir.observe.metrics import Metrics
from reservoir.protocol.addresses import requestor_address
from reservoir.protocol.effects import Dropped, Effect, Publish
from reservoir.protocol.messages import Message
from reservoir.runtime.machine_runner import Driver
from reservoir.runtime.settings import Settings

__all__ = ["AskEveryNode"]


class AskEveryNode(Driver):
    """Asks every serving node once (:meth:`ask`), gathers answers until :meth:`close`.

    A subclass says what it asks (:meth:`_question`), which answers it takes
    (:meth:`_take`, under :attr:`_changed`) and how many nodes have answered in full
    (:meth:`_nodes_answered`, under :attr:`_changed`)."""

    #: what the asker is, for the reason a stray message is dropped
    asker = "an asker"

    def __init__(
        self,
        broker: Broker | BrokerUrl | str | None,
        *,
        name: str,
        settings: Settings | None = None,
        scheduler: Scheduler | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self._changed = threading.Condition()
        self._nobody = False
        super().__init__(
            broker=broker,
            settings=settings if settings is not None else Settings(),
            scheduler=scheduler,
            metrics=metrics,
            endpoint_name=requestor_address(name),
            role="requestor",
        )

    def ask(self) -> None:
        """Publish the question on the widest tier's topic."""
        ladder = self.settings.ladder
        widest = ladder.percents[-1]
        question = self._question(widest)
        self._run(lambda now: [Publish(ladder.topic(widest), question)])

    def wait_for_answers(self, *, wait_s: float, expect_nodes: int | None = None) -> None:
        """Wait up to ``wait_s``: less once ``expect_nodes`` nodes have answered in full,
        or when the broker said that no node listens."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            while not self._nobody:
                if expect_nodes is not None and self._nodes_answered() >= expect_nodes:
                    return
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    return
                self._changed.wait(left_s)

    @property
    def nobody_listens(self) -> bool:
        """The broker handed the question back: no node is bound to the widest tier."""
        with self._changed:
            return self._nobody

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._cancel_all_timers()
        self._let_go()

    # -- for subclasses ----------------------------------------------------------------

    @abstractmethod
    def _question(self, widest_tier: int) -> Message:
        """The message every node is asked."""

    @abstractmethod
    def _take(self, message: Message) -> bool:
        """Keep ``message`` if it answers the question (under :attr:`_changed`)."""

    @abstractmethod
    def _nodes_answered(self) -> int:
        """Nodes whose answer is complete (under :attr:`_changed`)."""

    # -- driver hooks ------------------------------------------------------------------

    def _handle_message(self, message: Message, now: float) -> list[Effect]:
        with self._changed:
            taken = self._take(message)
            if taken:
                self._changed.notify_all()
        if taken:
            return []
        return [Dropped("unexpected", f"{self.asker} does not take this {message.kind!r}")]

    def _handle_returned(self, message: Message, now: float) -> list[Effect]:
        # The question is all we publish: back unroutable, nobody is there to answer.
        with self._changed:
            self._nobody = True
            self._changed.notify_all()
        return []

    def _handle_timer(self, key: Hashable, now: float) -> list[Effect]:
        return []
