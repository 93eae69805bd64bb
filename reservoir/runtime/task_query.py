"""Asking the nodes what became of tasks: ``reservoir tasks``, and anyone who did not
place the request (its placing requestor hears each change as it happens).

:class:`TaskQuestion` publishes a :class:`~reservoir.protocol.messages.TaskQuery` on the
widest tier's topic and gathers the :class:`~reservoir.protocol.messages.TaskState`
answers for a while: every node that knows a task of the id (or any, with ``every``)
answers, those with nothing to say stay silent.
"""

from __future__ import annotations

import secrets

from reservoir.broker import Broker
from reservoir.brokers import BrokerUrl
from reservoir.protocol.messages import Message, TaskQuery, TaskState
from reservoir.runtime.asking import AskEveryNode
from reservoir.runtime.settings import Settings

__all__ = ["TaskQuestion", "ask_tasks"]

#: the request id of a query for every task
EVERY_TASK_ID = "tasks"


class TaskQuestion(AskEveryNode):
    """Asks every node about the tasks of ``request_id`` (None: every task)."""

    asker = "a task query"

    def __init__(
        self,
        broker: Broker | BrokerUrl | str | None,
        request_id: str | None = None,
        *,
        settings: Settings | None = None,
    ) -> None:
        self.request_id = request_id
        self.answers: dict[tuple[str, str], TaskState] = {}
        super().__init__(broker, name=f"tasks-{secrets.token_hex(4)}", settings=settings)

    def _question(self, widest_tier: int) -> Message:
        return TaskQuery(
            request_id=self.request_id or EVERY_TASK_ID,
            sender=self.address,
            reply_to=self.address,
            every=self.request_id is None,
        )

    def _take(self, message: Message) -> bool:
        if not isinstance(message, TaskState) or not message.answering:
            return False
        if self.request_id is not None and message.request_id != self.request_id:
            return False
        self.answers[(message.sender, message.allocation_id)] = message
        return True

    def _nodes_answered(self) -> int:
        return 0  # how many nodes know a task is not known: wait the time out

    def collected(self) -> list[TaskState]:
        """The answers so far, by node and allocation."""
        with self._changed:
            return [self.answers[key] for key in sorted(self.answers)]


def ask_tasks(
    broker: Broker | BrokerUrl | str | None,
    request_id: str | None = None,
    *,
    wait_s: float = 0.5,
    settings: Settings | None = None,
) -> list[TaskState]:
    """The tasks the nodes report within ``wait_s``, by node and allocation."""
    question = TaskQuestion(broker, request_id, settings=settings)
    try:
        question.ask()
        question.wait_for_answers(wait_s=wait_s)
        return question.collected()
    finally:
        question.close()
