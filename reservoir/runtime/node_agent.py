"""``NodeAgent``: one compute node's participant, live.

It drives a :class:`~reservoir.protocol.node.NodeMachine` with a broker endpoint named
after the node (``reservoir.node.<name>``), a scheduler for its reservation-expiry timer and
an allocation store, which is durable (SQLite) when a state directory is given.

It also publishes what the machine only counts: the node's state and what became of its
reservations as Prometheus metrics (read when scraped, see :mod:`reservoir.observe.metrics`), a
``reservoir.node.evaluate`` or ``reservoir.node.award`` span for each traced request or
award (:mod:`reservoir.observe.tracing`), and the request id on every log line of a conversation.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import secrets
import tempfile
import threading
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from reservoir.broker import Broker
from reservoir.brokers import BrokerUrl
from reservoir.clock import Scheduler
from reservoir.observe import tracing
from reservoir.observe.metrics import Metrics, resource_families
from reservoir.protocol.addresses import node_address
from reservoir.protocol.audit import NodeSnapshot
from reservoir.protocol.compatibility import KNOWN_FEATURES
from reservoir.protocol.effects import (
    DeleteAllocation,
    Effect,
    ForgetTask,
    Publish,
    RememberTask,
    Send,
    StartTask,
    StopTask,
    StoreAllocation,
)
from reservoir.protocol.filters import Filter, Weigher
from reservoir.protocol.ledger import Allocation, Inventory
from reservoir.protocol.messages import (
    ROSTER_TOPIC,
    Message,
    NodeStatus,
    TaskOutput,
    TaskOutputQuery,
    TaskReport,
    Untrusted,
    is_resource_class,
)
from reservoir.protocol.node import NodeConfig, NodeMachine
from reservoir.protocol.numa import NumaTopology
from reservoir.protocol.placement import SHORTHAND_CLASSES
from reservoir.runtime.keys import KeyConfigError
from reservoir.runtime.keys.nodes import key_standing
from reservoir.runtime.machine_runner import Driver, Outcome
from reservoir.runtime.output_desk import OutputDesk
from reservoir.runtime.plugins import load_filters, load_weighers
from reservoir.runtime.settings import Settings
from reservoir.runtime.store import AllocationStore, MemoryStore, SqliteStore
from reservoir.runtime.tasks import (
    OutputChunk,
    TaskConfig,
    TaskDriver,
    TaskHandle,
    TaskOutputSource,
    TaskStartError,
    drivers_by_name,
    load_task_drivers,
)
from reservoir.version import __version__

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

__all__ = ["REJOIN_CHECK_S", "NodeAgent", "node_address"]

# the logger's name predates the runtime package: operators' logging configs name it
log = logging.getLogger("reservoir.node_agent")

#: how often a node says again that requestors refuse its messages, per reason
UNTRUSTED_WARNING_INTERVAL_S: Final = 60.0

#: How often a node agent on a broker that can lose its connection looks whether it came
#: back (:attr:`Broker.connections`), to announce itself again (NodeMachine.rejoined).
REJOIN_CHECK_S: Final = 1.0
#: The timer key of that check; the machine's own timers are strings.
_REJOIN_CHECK: Final = ("agent", "rejoin-check")
#: How often the agent looks whether its running tasks still run (and whether the output
#: a held TaskOutputQuery waits for came).
TASK_POLL_S: Final = 0.05
#: How often the agent forgets the ended tasks whose retention passed.
RETENTION_SWEEP_S: Final = 10.0


def _inventories(
    inventories: Mapping[str, Inventory | int] | None,
    vcpus: int | None,
    memory_mb: int | None,
    disk_gb: int | None,
) -> dict[str, Inventory]:
    shorthands = {"vcpus": vcpus, "memory_mb": memory_mb, "disk_gb": disk_gb}
    result: dict[str, Inventory] = {
        SHORTHAND_CLASSES[name]: Inventory(total=amount)
        for name, amount in shorthands.items()
        if amount is not None
    }
    for rc, inventory in (inventories or {}).items():
        result[rc] = inventory if isinstance(inventory, Inventory) else Inventory(total=inventory)
    unknown = sorted(rc for rc in result if not is_resource_class(rc))
    if unknown:
        raise ValueError(
            f"unknown resource class {', '.join(unknown)} "
            "(use VCPU, PCPU, MEMORY_MB, DISK_GB or CUSTOM_<NAME>)"
        )
    if not result:
        raise ValueError("a node needs at least one inventory (e.g. vcpus=, memory_mb=)")
    return result


class NodeAgent(Driver):
    """A node taking part in the protocol until :meth:`close`.

    ``broker`` may be a :class:`~reservoir.broker.Broker` (shared with others, not closed
    here), a URL, or None for ``settings.broker_url``; a broker opened here is closed here.
    """

    def __init__(
        self,
        broker: Broker | BrokerUrl | str | None = None,
        *,
        name: str,
        inventories: Mapping[str, Inventory | int] | None = None,
        vcpus: int | None = None,
        memory_mb: int | None = None,
        disk_gb: int | None = None,
        traits: Iterable[str] = (),
        numa: NumaTopology | None = None,
        configuration: Mapping[str, Any] | None = None,
        settings: Settings | None = None,
        scheduler: Scheduler | None = None,
        store: AllocationStore | None = None,
        filters: Sequence[Filter] | None = None,
        weighers: Sequence[Weigher] | None = None,
        metrics: Metrics | None = None,
        metrics_registry: CollectorRegistry | None = None,
        task_drivers: Mapping[str, TaskDriver] | Sequence[TaskDriver] | None = None,
        task_config: TaskConfig | None = None,
        start: bool = True,
    ) -> None:
        """``metrics_registry``: the Prometheus registry to count in (a registry of its
        own by default, so many nodes in one process never collide). ``task_drivers``:
        the drivers the node offers, as objects (an embedded agent's own code, told of
        every award and release of a request naming it); None: those
        ``settings.task_drivers`` names, made with ``task_config`` (who exec tasks run
        as, what tasks may run, how much output is kept and how long: the ``[tasks]``
        table of the node's configuration file)."""
        settings = settings if settings is not None else Settings()
        #: how the node runs tasks
        self.task_config = task_config if task_config is not None else TaskConfig()
        if task_drivers is None:
            tasks_dir = (
                settings.state_dir / "tasks" / name
                if settings.state_dir is not None
                else Path(tempfile.mkdtemp(prefix=f"reservoir-{name}-tasks-"))
            )
            drivers = load_task_drivers(
                settings.task_drivers, state_dir=tasks_dir, node=name, config=self.task_config
            )
        else:
            drivers = drivers_by_name(task_drivers)
        #: task driver name -> driver
        self.task_drivers: dict[str, TaskDriver] = drivers
        if metrics is None:
            metrics = Metrics(name, registry=metrics_registry)
        if store is None and settings.state_dir is not None:
            store = SqliteStore.for_node(settings.state_dir, name)
        self.store: AllocationStore = store if store is not None else MemoryStore()
        config = NodeConfig(
            name=name,
            address=node_address(name),
            inventories=_inventories(inventories, vcpus, memory_mb, disk_gb),
            traits=frozenset(traits),
            tiers=settings.ladder,
            incarnation=secrets.token_hex(4),
            filters=tuple(filters) if filters is not None else load_filters(settings.filters),
            weighers=tuple(weighers) if weighers is not None else load_weighers(settings.weighers),
            numa=numa,
            # the release and the features go with the configuration, so that whoever
            # asks a node for its ledger (reservoir nodes) learns them whatever line the
            # node writes for, from a node of any release (compatibility.said_release)
            configuration={
                **(configuration or {}),
                "release": __version__,
                "features": sorted(KNOWN_FEATURES),
            },
            task_drivers=frozenset(drivers),
            release=__version__,
            task_policy=self.task_config.policy,
        )
        self.machine = NodeMachine(
            config, allocations=self.store.load(), ended_tasks=self.store.load_ended_tasks()
        )
        #: allocation id -> the handle of its running task
        self._task_handles: dict[str, TaskHandle] = {}
        #: stops asked for before the task's start was done: allocation id -> grace
        self._stops_wanted: dict[str, float] = {}
        self._tasks_lock = threading.Lock()
        self._task_work: concurrent.futures.ThreadPoolExecutor | None = None
        self._output_work: concurrent.futures.ThreadPoolExecutor | None = None
        self._task_watch: threading.Thread | None = None
        self._tasks_done = threading.Event()
        #: answers TaskOutputQuery, holding those that wait for output
        self._output = OutputDesk(
            node=name,
            address=config.address,
            task_of=self._task_report,
            read=self._read_output,
            answer=self._send_output,
            poll_s=self._output_poll_s,
        )
        self._swept_at = 0.0
        #: reason -> when a requestor's Untrusted about it was last said in the log
        self._untrusted_said: dict[str, float] = {}
        try:
            super().__init__(
                broker=broker,
                settings=settings,
                scheduler=scheduler,
                metrics=metrics,
                endpoint_name=config.address,
                role="node",
            )
        except BaseException:
            self.store.close()
            raise
        self._started = False
        self._connections_seen = self.broker.connections
        self.metrics.add_source(self._metric_families)
        if start:
            self.start()

    @property
    def name(self) -> str:
        return self.machine.name

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._run(self.machine.start)
            self._recover_tasks()
            if self.task_drivers:
                self._task_executor()  # the watcher: output queries, retention
            if self.broker.reconnects:
                with self._lock:
                    if not self._closed:
                        now = self.scheduler.clock.now()
                        self._set_timer(_REJOIN_CHECK, now + REJOIN_CHECK_S)

    def close(self) -> None:
        """Stop hearing requests, withdraw live reservations, and let go of everything.
        Allocations stay in the store. Idempotent."""
        if self._closed:
            return
        if self._started:
            self._run(self.machine.stop)
        with self._lock:
            self._closed = True
            self._cancel_all_timers()
        self.metrics.remove_source()
        # The tasks go on running: a restarted agent re-attaches to them.
        self._tasks_done.set()
        self._output.close()
        if self._task_watch is not None:
            self._task_watch.join()
        for work in (self._task_work, self._output_work):
            if work is not None:
                work.shutdown(wait=True, cancel_futures=True)
        self._let_go()
        self.store.close()

    stop = close

    def __enter__(self) -> NodeAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- observing ---------------------------------------------------------------------

    def snapshot(self) -> NodeSnapshot:
        with self._lock:
            return NodeSnapshot.of(
                self.name,
                self.machine.ledger,
                self.scheduler.clock.now(),
                self.machine.tier(),
                self.machine.task_violations(),
            )

    def utilisation(self) -> float:
        with self._lock:
            return self.machine.utilisation()

    def tier(self) -> int:
        with self._lock:
            return self.machine.tier()

    def allocations(self) -> list[Allocation]:
        with self._lock:
            return list(self.machine.ledger.allocations.values())

    def status(self) -> dict[str, object]:
        """What the node holds and how full it is, as plain data (for a status file)."""
        snapshot = self.snapshot()
        now = snapshot.taken_at
        return {
            "node": self.name,
            # False while the broker connection is down (the agent reconnects by itself)
            "connected": self.broker.connected,
            "utilisation": round(snapshot.utilisation, 4),
            "tier": snapshot.tier,
            "usages": {
                rc: {"capacity": u.capacity, "allocated": u.allocated, "reserved": u.reserved}
                for rc, u in snapshot.usages.items()
            },
            "allocations": len(snapshot.allocations),
            "reservations": [
                {
                    "reservation_id": r.reservation_id,
                    "request_id": r.request_id,
                    "expires_in_s": round(r.deadline - now, 3),
                }
                for r in snapshot.reservations
            ],
            "violations": list(snapshot.violations),
            "counters": self.metrics.snapshot(),
        }

    def write_status(self, path: Path) -> None:
        """Write :meth:`status` as JSON, atomically (readers never see half a file)."""
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(json.dumps(self.status(), sort_keys=True))
        os.replace(partial, path)

    def free_allocations(self, allocation_ids: Sequence[str]) -> None:
        """Free allocations on the operator's word, without a requestor."""
        self._run(lambda now: self.machine.free_local(allocation_ids))

    # -- metrics -----------------------------------------------------------------------

    def _metric_families(self) -> Iterator[Metric]:
        """The node's state when Prometheus scrapes (see reservoir.observe.metrics)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshot = self.snapshot()
        with self._lock:
            counters = dict(self.machine.counters)
        name = self.name
        # Prometheus naming: base units (bytes), ratios as _ratio, one unit per family
        gauges: list[tuple[str, str, float]] = [
            ("reservoir_node_utilisation_ratio",
             "Dominant share, live reservations included (0..1)", snapshot.utilisation),
            ("reservoir_node_tier_ratio", "Narrowest tier the node hears (0..1)",
             snapshot.tier / 100),
            ("reservoir_node_allocations", "Allocations held", len(snapshot.allocations)),
            ("reservoir_node_reservations", "Live reservations held",
             len(snapshot.reservations)),
            ("reservoir_node_overcommitted_classes", "Resource classes the node holds more "
             "of than its inventory (it takes no new request while above 0)",
             len(snapshot.violations)),
        ]  # fmt: skip
        for metric, documentation, value in gauges:
            gauge = GaugeMetricFamily(metric, documentation, labels=["node"])
            gauge.add_metric([name], value)
            yield gauge
        yield from resource_families(name, snapshot.usages)
        made = CounterMetricFamily(
            "reservoir_node_reservations_made", "Reservations made (offers)", labels=["node"]
        )
        made.add_metric([name], counters.get("reserved", 0))
        yield made
        ended = CounterMetricFamily(
            "reservoir_node_reservations_ended",
            "Reservations ended, by how: awarded (turned into allocations), released, "
            "expired (past their TTL), withdrawn (the node stopping, or a superseded award)",
            labels=["node", "how"],
        )
        for how in ("awarded", "released", "expired", "withdrawn"):
            ended.add_metric([name, how], counters.get(how, 0))
        yield ended
        dry_runs = CounterMetricFamily(
            "reservoir_node_dry_runs", "Dry runs answered (nothing reserved)", labels=["node"]
        )
        dry_runs.add_metric([name], counters.get("dry_runs", 0))
        yield dry_runs

    # -- driver hooks ------------------------------------------------------------------

    def _check_own_key(self) -> None:
        keys = self.codec.keys
        key = keys.signing_key("node") if keys is not None else None
        if keys is None or keys.node_identities is None or key is None:
            return  # no keyring here to check against: requestors will say (Untrusted)
        standing = key_standing(keys.node_identities, self.machine.name, key)
        if standing is None:
            return
        if standing.another_nodes:
            raise KeyConfigError(f"node {self.machine.name}: {standing.problem}")
        log.warning("node %s: %s", self.machine.name, standing.problem)

    def _told_untrusted(self, notice: Untrusted, now: float) -> None:
        """A requestor refused a message in this node's name for the key that signed it:
        said once a minute per reason, in words the operator can act on (nothing else
        would show it here: the node's offers simply go unanswered)."""
        said = self._untrusted_said.get(notice.reason)
        if said is not None and now - said < UNTRUSTED_WARNING_INTERVAL_S:
            return
        self._untrusted_said[notice.reason] = now
        keys = self.codec.keys
        key = keys.signing_key("node") if keys is not None else None
        if key is not None and key.key_id == notice.key_id:
            log.warning(
                "node %s: requestor %s refuses this node's messages: %s (%s); this node "
                "signs with key %r (--node-key, RESERVOIR_NODE_KEY), which the requestors' "
                "node keyring does not list for %s: nothing is placed here until it does",
                self.name,
                notice.sender,
                notice.reason,
                notice.detail,
                key.key_id,
                self.name,
            )
        else:
            log.warning(
                "node %s: requestor %s refused a message sent in this node's name with "
                "another key than this node's: %s (%s); someone else signs as %s",
                self.name,
                notice.sender,
                notice.reason,
                notice.detail,
                self.name,
            )

    def _handle_message(self, message: Message, now: float) -> list[Effect]:
        if message.kind == "untrusted":
            assert isinstance(message, Untrusted)
            self._told_untrusted(message, now)
            return []
        if message.kind == "task_output_query":
            # Read from files (or an engine): not under the machine's lock, and not on
            # the broker's IO thread
            assert isinstance(message, TaskOutputQuery)
            self._output_executor().submit(self._output.ask, message)
            return []
        if getattr(message, "traceparent", None) is not None:
            effects = tracing.node_span(
                self.name, message, lambda: self.machine.handle(message, now)
            )
        else:
            effects = self.machine.handle(message, now)
        return self._logging_tier(effects)

    def _handle_returned(self, message: Message, now: float) -> list[Effect]:
        return self.machine.on_unroutable(message, now)

    def _logging_tier(self, effects: list[Effect]) -> list[Effect]:
        # The node announces its tier on the roster topic exactly when it changes (its
        # room, for keepers, on a topic of its own). A loop, not any() over a generator:
        # this runs for every message a node handles.
        for e in effects:
            if type(e) is Publish and e.topic == ROSTER_TOPIC and isinstance(e.message, NodeStatus):
                utilisation, tier = self.machine.utilisation(), self.machine.tier()
                log.info(
                    "node %s now at %.0f%% utilisation: tier %d%%",
                    self.name,
                    100 * utilisation,
                    tier,
                    extra={"node": self.name, "utilisation": round(utilisation, 4), "tier": tier},
                )
                break
        return effects

    def _handle_timer(self, key: Hashable, now: float) -> list[Effect]:
        if key == _REJOIN_CHECK:
            return self._check_rejoined(now)
        return self._logging_tier(self.machine.on_timer(key, now))

    def _check_rejoined(self, now: float) -> list[Effect]:
        """Under the lock, every REJOIN_CHECK_S: the connection came back since the last
        look (a counter, so no outage between two looks goes unseen)."""
        self._set_timer(_REJOIN_CHECK, now + REJOIN_CHECK_S)
        connections = self.broker.connections
        if connections == self._connections_seen or not self.broker.connected:
            return []
        self._connections_seen = connections
        log.info(
            "node %s is back on the broker: announcing itself again",
            self.name,
            extra={"node": self.name},
        )
        return self.machine.rejoined(now)

    # -- tasks -------------------------------------------------------------------------

    def tasks(self) -> list[TaskHandle]:
        """The handles of the tasks running now."""
        with self._tasks_lock:
            return list(self._task_handles.values())

    def _deliver(self, outcomes: list[Outcome]) -> None:
        # After the machine's lock is released and Accepted is sent: drivers may block
        for outcome in outcomes:
            if type(outcome) is StartTask:
                self._task_executor().submit(self._start_task, outcome)
            elif type(outcome) is StopTask:
                self._task_executor().submit(self._stop_task, outcome)

    def _output_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """Where output queries are read: apart from the tasks' starts and stops (a stop
        waits out its grace), so that neither waits for the other."""
        self._task_executor()  # the watcher, which looks at the queries held
        with self._tasks_lock:
            if self._output_work is None:
                self._output_work = concurrent.futures.ThreadPoolExecutor(
                    max_workers=2, thread_name_prefix=f"{self.name}:output"
                )
            return self._output_work

    def _task_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._tasks_lock:
            if self._task_work is None:
                self._task_work = concurrent.futures.ThreadPoolExecutor(
                    max_workers=4, thread_name_prefix=f"{self.name}:tasks"
                )
            if self._task_watch is None:
                self._task_watch = threading.Thread(
                    target=self._watch_tasks, name=f"{self.name}:task-watch", daemon=True
                )
                self._task_watch.start()
            return self._task_work

    def _task_event(self, allocation_id: str, state: str, **details: object) -> None:
        if not self._closed:
            wall_s = self.scheduler.clock.wall()
            self._run(
                lambda now: self.machine.task_changed(
                    allocation_id,
                    state,
                    now,
                    wall_s=wall_s,
                    **details,  # type: ignore[arg-type]
                )
            )

    def _start_task(self, effect: StartTask) -> None:
        allocation = effect.allocation
        task = allocation.task
        assert task is not None
        driver = self.task_drivers.get(task.driver)
        # Stored before the driver starts it, for a driver that finds a task by its
        # allocation: an agent killed while the start is under way (a supervisor, a
        # container, being started) finds it again, and stops it if it is not held.
        provisional = driver is not None and getattr(driver, "finds_by_allocation", False)
        if provisional:
            self.store.put_task(
                TaskHandle(
                    driver=task.driver,
                    allocation_id=allocation.allocation_id,
                    request_id=allocation.request_id,
                    ref="",
                )
            )
        try:
            if driver is None:
                raise TaskStartError(f"the node offers no {task.driver!r} task driver")
            refusal = self.task_config.policy.refusal(task)
            if refusal is not None:  # allowed when offered, not since (a new configuration)
                raise TaskStartError(f"{refusal.detail} on this node")
            handle = driver.start(allocation, task)
        except Exception as error:  # a driver may fail in any way: the task failed
            reason = str(error) if isinstance(error, TaskStartError) else repr(error)
            log.info("task of %s failed to start: %s", allocation.allocation_id, reason)
            if provisional:
                self.store.delete_task(allocation.allocation_id)
            self._task_event(allocation.allocation_id, "failed", reason=reason[:500])
            return
        self.store.put_task(handle)
        # Said before the watcher may see it end: "started" always comes first.
        self._task_event(allocation.allocation_id, "started", limits=handle.limits)
        with self._tasks_lock:
            self._task_handles[allocation.allocation_id] = handle
            grace = self._stops_wanted.pop(allocation.allocation_id, None)
        if grace is not None:
            driver.stop(handle, grace)

    def _stop_task(self, effect: StopTask) -> None:
        with self._tasks_lock:
            handle = self._task_handles.get(effect.allocation_id)
            if handle is None:  # still starting: stopped once it has
                self._stops_wanted[effect.allocation_id] = effect.grace_s
                return
        driver = self.task_drivers.get(handle.driver)
        if driver is not None:
            driver.stop(handle, effect.grace_s)

    def _watch_tasks(self) -> None:
        while not self._tasks_done.wait(TASK_POLL_S):
            self._watch_once()

    def _watch_once(self) -> None:
        try:
            self._output.tick()
            self._sweep_ended_tasks()
        except Exception:  # the watch must go on
            log.exception("node %s: answering output queries failed", self.name)
        for handle in self.tasks():
            driver = self.task_drivers.get(handle.driver)
            if driver is None:
                continue
            try:
                status = driver.status(handle)
            except Exception:  # one task's driver failing must not stop the watch
                log.exception("task driver %s failed to tell a status", handle.driver)
                continue
            if not status.running:
                self._task_ended(handle, driver, status.exit_code, status.reason)

    def _task_ended(
        self, handle: TaskHandle, driver: TaskDriver, exit_code: int | None, reason: str
    ) -> None:
        with self._tasks_lock:
            self._task_handles.pop(handle.allocation_id, None)
        self._task_event(handle.allocation_id, "exited", exit_code=exit_code, reason=reason)
        self.store.delete_task(handle.allocation_id)
        driver.forget(handle)

    def _recover_tasks(self) -> None:
        """After a restart: re-attach to the tasks still running, report the ones that
        ended meanwhile, stop any whose allocation is no longer held, and fail the tasks
        of allocations the previous run never got to start."""
        handles = {h.allocation_id: h for h in self.store.load_tasks()}
        with self._lock:
            held = {
                a.allocation_id: a
                for a in self.machine.ledger.allocations.values()
                if a.task is not None
            }
        for allocation_id, handle in list(handles.items()):
            driver = self.task_drivers.get(handle.driver)
            if driver is None:
                log.warning(
                    "node %s: task of %s was started by driver %r, which it no longer offers",
                    self.name,
                    allocation_id,
                    handle.driver,
                )
                continue
            if allocation_id not in held:
                log.info("stopping the task of %s: its allocation is gone", allocation_id)
                driver.stop(handle, 0.0)
                self.store.delete_task(allocation_id)
                driver.forget(handle)
                continue
            status = driver.reattach(handle)
            if not handle.ref and not status.running and status.exit_code is None:
                # stored before its start was done, and it never ran: as if not stored
                self.store.delete_task(allocation_id)
                del handles[allocation_id]
                continue
            if status.running:
                self._task_event(allocation_id, "running", limits=handle.limits)
                with self._tasks_lock:
                    self._task_handles[allocation_id] = handle
                self._task_executor()  # the watcher
            else:
                self._task_ended(handle, driver, status.exit_code, status.reason)
        for allocation_id in held.keys() - handles.keys():
            self._task_event(
                allocation_id, "failed", reason="the node agent stopped before it started the task"
            )

    def _sweep_ended_tasks(self) -> None:
        """Every RETENTION_SWEEP_S: forget the ended tasks whose retention passed."""
        now = self.scheduler.clock.now()
        if now - self._swept_at < RETENTION_SWEEP_S:
            return
        self._swept_at = now
        before_s = self.scheduler.clock.wall() - self.task_config.retention_s
        if not self._closed:
            self._run(lambda now: self.machine.forget_ended_tasks(before_s))

    # -- output ------------------------------------------------------------------------

    def _task_report(self, request_id: str, allocation_id: str) -> TaskReport | None:
        with self._lock:
            task = self.machine.tasks.get(allocation_id)
            if task is None or task.request_id != request_id:
                return None
            return task.summary()

    def _read_output(self, driver_name: str, query: TaskOutputQuery) -> OutputChunk | None:
        driver = self.task_drivers.get(driver_name)
        if not isinstance(driver, TaskOutputSource):
            return None  # a driver that keeps no output
        return driver.read_output(query.allocation_id, query.stream, query.offset, query.max_bytes)

    def _output_poll_s(self, driver_name: str) -> float:
        poll_s = getattr(self.task_drivers.get(driver_name), "output_poll_s", TASK_POLL_S)
        return float(poll_s) if isinstance(poll_s, int | float) else TASK_POLL_S

    def _send_output(self, query: TaskOutputQuery, output: TaskOutput) -> None:
        if not self._closed:
            self._run(lambda now: [Send(query.reply_to, output)])

    def _discard_output(self, effect: ForgetTask) -> None:
        driver = self.task_drivers.get(effect.driver)
        if isinstance(driver, TaskOutputSource):
            try:
                driver.discard_output(effect.allocation_id)
            except Exception:
                log.exception("node %s: discarding the output of %s failed", self.name,
                              effect.allocation_id)  # fmt: skip

    def _persist(
        self, effect: StoreAllocation | DeleteAllocation | RememberTask | ForgetTask
    ) -> None:
        if type(effect) is StoreAllocation:
            self.store.put(effect.allocation)
        elif type(effect) is DeleteAllocation:
            self.store.delete(effect.allocation_id)
        elif type(effect) is RememberTask:
            self.store.put_ended_task(effect.task)
        elif type(effect) is ForgetTask:
            self.store.delete_ended_task(effect.allocation_id)
            if not self._closed:  # files: not under the machine's lock
                self._task_executor().submit(self._discard_output, effect)
