"""The node's book of its allocations' tasks: what each is doing, as its task driver last
said, and the tasks that ended lately (so that a ``TaskQuery`` after the end still hears
the exit code). Pure bookkeeping for :class:`~reservoir.protocol.node.NodeMachine`.

An ended task is remembered until :data:`ENDED_KEPT` newer ones ended or its retention
passed (the node agent's sweep, :meth:`TaskBook.forget_ended`), and across restarts of
the agent: the book says which to keep (:class:`EndedTask`) and which to let go.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final, cast

import msgspec.structs

from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import TaskReport, TaskState, TaskStateName

__all__ = ["ENDED_KEPT", "ENDED_STATES", "EndedTask", "NodeTask", "TaskBook"]

#: the states a task does not come back from
ENDED_STATES: Final = frozenset({"exited", "failed", "stopped"})
#: how many ended tasks a node remembers for queries (the oldest are forgotten first)
ENDED_KEPT: Final = 4096


@dataclass(slots=True)
class NodeTask:
    """One allocation's task on the node."""

    allocation_id: str
    request_id: str
    driver: str
    #: the placing requestor's reply address: where its state changes go
    reply_to: str | None
    keep_allocation: bool
    stop_grace_s: float
    #: its allocation could be found by id (a Lookup): its state can be, too
    findable: bool = True
    #: how many instances its placement has in all (its allocation's ``request_count``)
    instances: int = 1
    state: str = "starting"
    exit_code: int | None = None
    reason: str = ""
    limits: str = ""
    #: its allocation was freed: a stop was asked for
    stopping: bool = False
    stop_reason: str = ""
    #: when it ended, on the wall clock (seconds since the epoch; 0: not ended, or not said)
    ended_at_s: float = 0.0

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES

    def report(self) -> TaskState:
        """The task's state as a message (the node fills in sender and reply_to)."""
        return TaskState(
            request_id=self.request_id,
            sender="-",
            reply_to="-",
            **msgspec.structs.asdict(self.summary()),
        )

    def summary(self) -> TaskReport:
        """The task's state as a part of another answer (``AlreadyPlaced.tasks``)."""
        return TaskReport(
            allocation_id=self.allocation_id,
            # "started" is news once; asked again, a task that started is running
            state=cast(TaskStateName, "running" if self.state == "started" else self.state),
            driver=self.driver,
            exit_code=self.exit_code,
            reason=self.reason,
            limits=self.limits,
            kept=self.keep_allocation,
        )


class EndedTask(msgspec.Struct, frozen=True, kw_only=True):
    """An ended task as the node keeps it across restarts (its agent's store)."""

    allocation_id: str
    request_id: str
    driver: str
    state: str
    exit_code: int | None = None
    reason: str = ""
    limits: str = ""
    keep_allocation: bool = False
    findable: bool = True
    instances: int = 1
    ended_at_s: float = 0.0

    @classmethod
    def of(cls, task: NodeTask) -> EndedTask:
        return cls(
            allocation_id=task.allocation_id,
            request_id=task.request_id,
            driver=task.driver,
            state=task.state,
            exit_code=task.exit_code,
            reason=task.reason,
            limits=task.limits,
            keep_allocation=task.keep_allocation,
            findable=task.findable,
            instances=task.instances,
            ended_at_s=task.ended_at_s,
        )

    def task(self) -> NodeTask:
        return NodeTask(
            allocation_id=self.allocation_id,
            request_id=self.request_id,
            driver=self.driver,
            reply_to=None,  # the news of its end went out before
            keep_allocation=self.keep_allocation,
            stop_grace_s=0.0,
            findable=self.findable,
            instances=self.instances,
            state=self.state,
            exit_code=self.exit_code,
            reason=self.reason,
            limits=self.limits,
            ended_at_s=self.ended_at_s,
        )


class TaskBook:
    """Live tasks by allocation id, and the lately ended ones."""

    def __init__(self, ended: Iterable[EndedTask] = ()) -> None:
        self._live: dict[str, NodeTask] = {}
        self._ended: OrderedDict[str, NodeTask] = OrderedDict()
        #: request id -> the allocation ids of its tasks booked here (live or ended)
        self._by_request: dict[str, set[str]] = {}
        #: request ids whose last task was forgotten since :meth:`drain_forgotten`
        self._forgotten: set[str] = set()
        #: ended tasks forgotten since :meth:`drain_let_go` (their records and output go)
        self._let_go: list[NodeTask] = []
        for record in sorted(ended, key=lambda e: e.ended_at_s):
            task = record.task()
            self._ended[task.allocation_id] = task
            self._by_request.setdefault(task.request_id, set()).add(task.allocation_id)
            # its lookup topic is bound again once the node starts (drain_forgotten)
            self._forgotten.add(task.request_id)
        self._trim()

    def starting(self, allocation: Allocation) -> NodeTask:
        """Book the task of ``allocation`` (which carries one), not yet started."""
        spec = allocation.task
        assert spec is not None, "an allocation without a task has nothing to start"
        task = NodeTask(
            allocation_id=allocation.allocation_id,
            request_id=allocation.request_id,
            driver=spec.driver,
            reply_to=allocation.reply_to,
            keep_allocation=spec.keep_allocation,
            stop_grace_s=spec.stop_grace_s,
            findable=allocation.findable,
            instances=allocation.request_count,
        )
        self._live[task.allocation_id] = task
        self._by_request.setdefault(task.request_id, set()).add(task.allocation_id)
        return task

    def get(self, allocation_id: str) -> NodeTask | None:
        task = self._live.get(allocation_id)
        return task if task is not None else self._ended.get(allocation_id)

    def change(
        self,
        task: NodeTask,
        state: str,
        *,
        exit_code: int | None,
        reason: str,
        limits: str | None,
    ) -> TaskState:
        """Record ``task``'s new state; the report of it (``started`` stays as is)."""
        task.state = state
        if exit_code is not None:
            task.exit_code = exit_code
        task.reason = reason
        if limits is not None:
            task.limits = limits
        report = task.report()
        if state == "started":
            report = msgspec.structs.replace(report, state="started")
        if task.ended and self._live.pop(task.allocation_id, None) is not None:
            self._ended[task.allocation_id] = task
            self._trim()
        return report

    def _trim(self) -> None:
        while len(self._ended) > ENDED_KEPT:
            _, forgotten = self._ended.popitem(last=False)
            self._forget(forgotten)

    def forget_ended(self, before_s: float) -> None:
        """Forget the ended tasks that ended before ``before_s`` (wall clock): their
        retention passed."""
        for task in list(self._ended.values()):
            if task.ended_at_s >= before_s:
                break  # in the order they ended
            del self._ended[task.allocation_id]
            self._forget(task)

    def drain_let_go(self) -> list[NodeTask]:
        """The ended tasks forgotten since the last call."""
        let_go, self._let_go = self._let_go, []
        return let_go

    def _forget(self, task: NodeTask) -> None:
        self._let_go.append(task)
        booked = self._by_request.get(task.request_id)
        if booked is not None:
            booked.discard(task.allocation_id)
            if not booked:
                del self._by_request[task.request_id]
                self._forgotten.add(task.request_id)

    def drain_forgotten(self) -> set[str]:
        """The request ids of which no task is booked any more since the last call (the
        last one ended long enough ago to be forgotten), and those of the tasks the book
        was made with: whose lookup topics to look at again."""
        forgotten, self._forgotten = self._forgotten, set()
        return forgotten

    def remembers_findable(self, request_id: str) -> bool:
        """Whether a task of ``request_id`` whose allocation was findable is booked."""
        return any(task.findable for task in self.of_request(request_id))

    def live(self) -> Iterator[NodeTask]:
        return iter(list(self._live.values()))

    def ended(self) -> Iterator[NodeTask]:
        return iter(list(self._ended.values()))

    def all(self) -> list[NodeTask]:
        return [*self._live.values(), *self._ended.values()]

    def of_request(self, request_id: str) -> list[NodeTask]:
        """The tasks of ``request_id`` booked here, by allocation id."""
        booked = sorted(self._by_request.get(request_id, ()))
        return [task for task in map(self.get, booked) if task is not None]
