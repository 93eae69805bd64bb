"""``Requestor``: the public, thread-safe and asyncio-friendly way to place work.

One ``Requestor`` runs any number of concurrent requests over one broker endpoint (its
reply address). ``reserve`` blocks the calling thread; ``reserve_async`` awaits without
blocking the event loop; ``submit`` returns a :class:`concurrent.futures.Future`. All three
share the same state machine, so a request id placed through one is known to the others.

    with Requestor("amqp://guest:guest@localhost/") as requestor:
        placement = requestor.reserve(vcpus=2, memory_mb=4096)
        ...
        requestor.release(placement)

Observability lives here, not in the protocol core: each outcome goes to the requestor's
Prometheus metrics (:mod:`reservoir.observe.metrics`; ``metrics_registry=`` puts them in a registry
of the caller's, e.g. the one its own ``/metrics`` serves), each placement is a
``reservoir.place`` span when OpenTelemetry is set up (:mod:`reservoir.observe.tracing`), and every
log line of a conversation carries its ``request_id`` (:mod:`reservoir.observe.logs`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from reservoir.broker import Broker
from reservoir.brokers import BrokerUrl
from reservoir.clock import Scheduler
from reservoir.observe import tracing
from reservoir.observe.logs import REQUEST_ID
from reservoir.observe.metrics import Metrics, default_participant
from reservoir.protocol.addresses import node_address, requestor_address
from reservoir.protocol.compatibility import said_features, said_release
from reservoir.protocol.effects import Effect, Failed, FreeCompleted, Placed, Send
from reservoir.protocol.messages import (
    OUTPUT_CHUNK_MAX,
    Decline,
    InvalidField,
    LedgerQuery,
    LedgerReport,
    Message,
    Offer,
    TaskOutput,
    TaskOutputQuery,
    TaskQuery,
    TaskSpec,
    TaskState,
    decode_message,
)
from reservoir.protocol.placement import (
    Explanation,
    Holdings,
    PlacedAllocation,
    Placement,
    PlacementError,
    PlacementRequest,
)
from reservoir.protocol.policies import Policy, policy_named
from reservoir.protocol.requestor import RequestorMachine
from reservoir.protocol.requestor_state import RequestorConfig
from reservoir.protocol.task_book import ENDED_STATES
from reservoir.protocol.timers import ConversationTimer, FreeTimer
from reservoir.runtime.checked_request import CheckedRequest
from reservoir.runtime.finding import Finder
from reservoir.runtime.machine_runner import Driver, Outcome
from reservoir.runtime.output_reader import (
    FOLLOW_WAIT_S,
    OutputNotKnown,
    OutputPiece,
    OutputReader,
    OutputUnreachable,
    merged,
)
from reservoir.runtime.request_ids import new_request_id
from reservoir.runtime.settings import Settings
from reservoir.runtime.task_run import TaskRun

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

__all__ = ["FindIncomplete", "FreeIncomplete", "NoSuchTask", "Requestor", "RequestorClosed"]

# the logger's name predates the runtime package: operators' logging configs name it
log = logging.getLogger("reservoir.requestor")

#: how much longer than its own deadline a blocking call waits for the machine's verdict
_VERDICT_GRACE_S = 5.0


class RequestorClosed(RuntimeError):
    """The requestor was closed; it places and frees nothing more."""


class FreeIncomplete(RuntimeError):
    """Some nodes did not confirm freeing their allocations in time (they may be down;
    the requestor goes on freeing there while it runs)."""

    def __init__(self, request_id: str, missing: tuple[str, ...]) -> None:
        super().__init__(f"request {request_id}: no confirmation from {', '.join(missing)}")
        self.request_id = request_id
        self.missing = missing


class FindIncomplete(RuntimeError):
    """Not every holder of a request id answered a find before its deadline, so what the
    nodes hold of it is not known (a holder slow to answer, or the id being placed:
    ``placing`` names the requestor a node holds a reservation of it for). Asking again
    later may settle it; it is never an answer of "nothing held"."""

    def __init__(self, holdings: Holdings) -> None:
        heard = holdings.placement.nodes if holdings.placement is not None else ()
        why = (
            f"it is being placed by {holdings.placing}"
            if holdings.placing is not None
            else "not every holder answered in time"
        )
        super().__init__(
            f"what the nodes hold of {holdings.request_id} is not known yet: {why}"
            + (f" (heard from {', '.join(sorted(set(heard)))})" if heard else "")
        )
        self.request_id = holdings.request_id
        self.holdings = holdings
        self.placing = holdings.placing


class NoSuchTask(LookupError):
    """No node holds a task of the request id (none was placed, or every one of them
    ended longer ago than the nodes keep ended tasks)."""


#: the most output queries a requestor keeps waiting for their answers (a reader that
#: gave up on one leaves it behind; beyond this, those given up on are let go)
_OUTPUT_ASKED_MAX = 1024
#: what a TaskOutput holds besides its data (ids, the task's state, a signature), at most
_OUTPUT_ENVELOPE_BYTES = 4096


def _shape(
    request: PlacementRequest | CheckedRequest | None, fields: dict[str, Any]
) -> CheckedRequest:
    """The request to place, checked exactly once: a :class:`CheckedRequest` as it is (a
    front door checked it), a ``PlacementRequest`` checked here, or one built from the
    caller's keywords by :meth:`CheckedRequest.of`, the same as every front door's."""
    if request is not None:
        if any(value is not None for value in fields.values()):
            raise TypeError("pass either a PlacementRequest or keyword fields, not both")
        if isinstance(request, CheckedRequest):
            return request
        return CheckedRequest.check(request)
    return CheckedRequest.of(**fields)


def _task_given_once(
    fields: dict[str, Any],
    command: Iterable[str],
    driver: str,
    env: dict[str, str] | None,
    workdir: str | None,
    image: str | None,
    keep_allocation: bool,
    stop_grace_s: float,
) -> None:
    """A TypeError when :meth:`Requestor.run` is given a request and, besides it, the
    task's words or a request's fields (each has one source)."""
    told = (
        fields
        or tuple(command)
        or env
        or workdir is not None
        or image is not None
        or driver != "exec"
        or keep_allocation
        or stop_grace_s != 10.0
    )
    if told:
        raise TypeError("pass either a request carrying its task or the task's words, not both")


class Requestor(Driver):
    """Places requests on whatever nodes the broker reaches.

    ``broker`` may be a :class:`~reservoir.broker.Broker` (shared, not closed here), a URL,
    or None for ``settings.broker_url``.
    """

    def __init__(
        self,
        broker: Broker | BrokerUrl | str | None = None,
        *,
        name: str | None = None,
        settings: Settings | None = None,
        policy: Policy | str | None = None,
        scheduler: Scheduler | None = None,
        metrics: Metrics | None = None,
        metrics_registry: CollectorRegistry | None = None,
        findable: bool = False,
        participant: str | None = None,
    ) -> None:
        """``participant``: the label of its metrics (default: ``name`` when given, else
        the ``requestor_name`` setting, else the host name and ``requestor``: stable
        across restarts, unlike the generated name, unique per process because it names
        the reply queue).
        ``metrics_registry``: the Prometheus registry to count in (a registry of its
        own by default; ``reservoir serve`` gives the service's, so that its ``/metrics``
        shows the requestor's placements too). ``findable``: every placement can be found
        by its id (:meth:`find`), generated ids too; caller-chosen ids always can. It adds
        no wait before placing, but each node binds the id's lookup bucket before it
        offers (a broker round trip per reservation)."""
        settings = settings if settings is not None else Settings()
        self.name = name or f"requestor-{secrets.token_hex(4)}"
        if metrics is None:
            participant = (
                participant or name or settings.requestor_name or default_participant("requestor")
            )
            metrics = Metrics(participant, registry=metrics_registry)
        if isinstance(policy, str) or policy is None:
            policy = policy_named(policy or settings.policy)
        # The machine exists before the endpoint does: a delivery can arrive the moment
        # the endpoint is open. Every adapter makes a named endpoint's address its name.
        address = requestor_address(self.name)
        self.machine = RequestorMachine(
            RequestorConfig(
                requestor_id=self.name,
                reply_to=address,
                tiers=settings.ladder,
                policy=policy,
                ttl_s=settings.ttl_s,
                max_widen_s=settings.max_widen_s,
                min_widen_s=settings.min_widen_s,
                probe_factor=settings.probe_factor,
                probe_rounds=settings.probe_rounds,
                roster_from=settings.roster_from,
                findable=findable,
                compatible_with=settings.compatible_with,
            )
        )
        self._placing: dict[str, list[concurrent.futures.Future[Placement]]] = {}
        #: request id -> the callers waiting for its frees; each gets the ids freed
        self._freeing: dict[str, list[concurrent.futures.Future[tuple[str, ...]]]] = {}
        #: request id -> its reservoir.place spans (one per caller joining it), if tracing
        self._spans: dict[str, list[Any]] = {}
        #: request ids answered from the machine's memory, not placed again
        self._replays: set[str] = set()
        #: request id -> the run waiting for its tasks' states
        self._runs: dict[str, TaskRun] = {}
        #: (allocation id, stream, offset) -> the readers waiting for that chunk of output
        self._output_asked: dict[
            tuple[str, str, int], list[concurrent.futures.Future[TaskOutput]]
        ] = {}
        #: nodes known to answer TaskOutputQuery (release 0.2 on): asked once, then kept
        self._output_nodes: set[str] = set()
        #: a question for a node's features (a LedgerQuery) by its audit id: the node, and
        #: whoever waits for the answer (None: the node knows task output)
        self._feature_asks: dict[str, tuple[str, concurrent.futures.Future[None]]] = {}
        #: asks the nodes what they hold of an id; opened by the first find
        self._finder: Finder | None = None
        #: the broker's connections when the machine's claims were made (see claims_lost)
        self._connections_seen = 0
        self._finder_lock = threading.Lock()
        super().__init__(
            broker=broker,
            settings=settings,
            scheduler=scheduler,
            metrics=metrics,
            endpoint_name=address,
            role="requestor",
        )
        try:
            # Fill the roster: from a keeper, or from the nodes' announcements.
            self._run(self.machine.start)
        except BaseException:
            self._let_go()
            raise
        self.metrics.add_source(self._metric_families)

    # -- placing -----------------------------------------------------------------------

    def submit(
        self,
        request: PlacementRequest | CheckedRequest | None = None,
        *,
        timeout_s: float | None = None,
        **fields: Any,
    ) -> concurrent.futures.Future[Placement]:
        """Start placing ``request``, or the request ``fields`` describe: any field of
        :class:`~reservoir.PlacementRequest` (``resources``, ``count``, ``min_count``,
        ``required_traits``, ``forbidden_traits``, ``any_of_traits``, ``numa``, ``group``,
        ``explain``, ``hints``, ``request_id``) and the shorthands ``vcpus``,
        ``memory_mb`` and ``disk_gb``, e.g. ``submit(vcpus=2, memory_mb=4096)``. The future
        resolves to a :class:`Placement` or raises :class:`PlacementError`
        (:class:`~reservoir.PlacementTimeout` when out of time).

        Callbacks added to the future run on the thread that resolves it, which on RabbitMQ
        is the broker's IO thread: keep them short, and never wait in one for another
        placement (``reserve``, ``result()``), whose answer that thread would have to read,
        nor open or close a participant there. Calling ``submit`` from a callback is fine.

        The request is checked once, as a node will check it, before anything is sent
        (:class:`~reservoir.protocol.placement.InvalidRequest` otherwise): the keywords
        and a ``PlacementRequest`` here; a
        :class:`~reservoir.runtime.checked_request.CheckedRequest` (what the commands and
        the HTTP service hand over) was checked where it was made, and is placed as it is."""
        spec = _shape(request, fields).request
        request_id = spec.request_id or new_request_id()
        timeout_s = self.settings.request_timeout_s if timeout_s is None else timeout_s
        span, traceparent = tracing.start_place(request_id, spec.resources, spec.count)
        if span is not None:
            with self._lock:
                self._spans.setdefault(request_id, []).append(span)
        return self._start(
            self._placing,
            request_id,
            lambda now: self._place(spec, request_id, now, timeout_s, traceparent),
        )

    def _place(
        self,
        spec: PlacementRequest,
        request_id: str,
        now: float,
        timeout_s: float,
        traceparent: str | None,
    ) -> list[Effect]:
        if self.machine.placement_of(request_id) is not None:
            # answered from memory: not a placement to time or count again
            self._replays.add(request_id)
        return self.machine.place(
            spec,
            request_id,
            now,
            timeout_s,
            traceparent=traceparent,
            requested_at_s=self.scheduler.clock.wall(),
        )

    def _start(
        self,
        waiting: dict[str, list[concurrent.futures.Future[Any]]],
        request_id: str,
        step: Callable[[float], list[Effect]],
    ) -> concurrent.futures.Future[Any]:
        """Register a waiter for ``request_id`` and feed the machine ``step``, atomically,
        so the outcome cannot arrive before the waiter is there to receive it."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        outcomes: list[Outcome] = []
        token = REQUEST_ID.set(request_id)
        try:
            with self._lock:
                closed = self._closed
                if not closed:
                    waiting.setdefault(request_id, []).append(future)
                    self._execute(step(self.scheduler.clock.now()), outcomes)
            if closed:
                self._end_spans(request_id, "closed")
                raise RequestorClosed(f"{self.name} is closed")
            self._settle(outcomes)
        finally:
            REQUEST_ID.reset(token)
        return future

    def reserve(
        self,
        request: PlacementRequest | CheckedRequest | None = None,
        *,
        timeout_s: float | None = None,
        **fields: Any,
    ) -> Placement:
        """Place a request and wait for the outcome (blocking; thread-safe)."""
        future = self.submit(request, timeout_s=timeout_s, **fields)
        wait_s = self.settings.request_timeout_s if timeout_s is None else timeout_s
        return future.result(timeout=wait_s + _VERDICT_GRACE_S)

    async def reserve_async(
        self,
        request: PlacementRequest | CheckedRequest | None = None,
        *,
        timeout_s: float | None = None,
        **fields: Any,
    ) -> Placement:
        """Place a request without blocking the running event loop."""
        return await asyncio.wrap_future(self.submit(request, timeout_s=timeout_s, **fields))

    # -- running -----------------------------------------------------------------------

    def run(
        self,
        command: Iterable[str] = (),
        *,
        driver: str = "exec",
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        image: str | None = None,
        keep_allocation: bool = False,
        stop_grace_s: float = 10.0,
        timeout_s: float | None = None,
        on_change: Callable[[TaskState], None] | None = None,
        request: PlacementRequest | CheckedRequest | None = None,
        **fields: Any,
    ) -> TaskRun:
        """Place a request whose instances run ``command`` (through the task driver
        ``driver``, ``image`` for ``docker``), and return at once a :class:`TaskRun` to
        wait on: its ``placement`` future, the tasks' states as their nodes report them,
        ``wait()`` for every task to end and ``exit_code``. ``fields`` describe the request
        as for :meth:`submit`. A task that ends frees its allocation (unless
        ``keep_allocation``); releasing the placement stops a task still running (SIGTERM,
        SIGKILL after ``stop_grace_s``). ``on_change`` is called with each state, on the
        thread that received it: keep it short, and never call the requestor from it.

        ``request`` instead of the task's words and ``fields``: a request carrying its
        task (``task`` set), checked here when it is a ``PlacementRequest`` and placed as
        it is when it is a :class:`~reservoir.runtime.checked_request.CheckedRequest`
        (``reservoir run`` hands one over). Either way the request is checked once."""
        if request is None:
            task = TaskSpec(
                driver=driver,
                command=tuple(command),
                env=dict(env or {}),
                workdir=workdir,
                image=image,
                keep_allocation=keep_allocation,
                stop_grace_s=stop_grace_s,
            )
            # the id chosen before the check, so that the one check covers the caller's
            given_id = fields.pop("request_id", None)
            checked = CheckedRequest.of(
                task=task,
                request_id=new_request_id() if given_id is None else given_id,
                **fields,
            )
        else:
            _task_given_once(
                fields, command, driver, env, workdir, image, keep_allocation, stop_grace_s
            )
            checked = _shape(request, {}).identified()
            if checked.request.task is None:
                raise ValueError("a request to run carries its task: give task= or a command")
        request_id = checked.request_id
        assert request_id is not None  # chosen above, or identified()
        placement: concurrent.futures.Future[Placement] = concurrent.futures.Future()
        run = TaskRun(
            request_id,
            placement,
            on_change,
            ask=self._ask_tasks,
            check_s=self.settings.task_check_s,
        )
        with self._lock:
            self._runs[request_id] = run  # before any state can come back
        placing = self.submit(checked, timeout_s=timeout_s)

        def placed(done: concurrent.futures.Future[Placement]) -> None:
            error = done.exception()
            if error is not None:
                with self._lock:
                    self._runs.pop(request_id, None)
                placement.set_exception(error)
            else:
                placement.set_result(done.result())

        placing.add_done_callback(placed)
        return run

    async def run_async(self, command: Iterable[str] = (), **options: Any) -> TaskRun:
        """:meth:`run`, placed without blocking the running event loop: returns once the
        request is placed (``await run.wait_async()`` for the tasks to end)."""
        run = self.run(command, **options)
        await asyncio.wrap_future(run.placement)
        return run

    def _ask_tasks(self, placement: Placement) -> None:
        """Ask each node holding ``placement`` what became of its tasks (answered with a
        TaskState each, heard as news is)."""
        query = TaskQuery(request_id=placement.request_id, sender=self.name, reply_to=self.address)
        addresses = sorted({allocation.address for allocation in placement.allocations})
        self._run(lambda now: [Send(address, query) for address in addresses])

    def _heard_task(self, state: TaskState) -> None:
        run = self._runs.get(state.request_id)
        if run is not None:
            run.heard(state)
            if run.finished:
                self._runs.pop(state.request_id, None)

    def attach(self, request_id: str, *, deadline_s: float | None = None) -> TaskRun:
        """Follow the tasks of a request placed elsewhere (by another process, or by this
        one before it restarted): a :class:`TaskRun` seeded with what the nodes hold of
        ``request_id`` now, which hears of each task's end from its node (each node is
        asked to answer once the task ended, and asked again while it runs). Raises
        :class:`NoSuchTask` when no node holds a task of it, :class:`FindIncomplete`
        when not every holder answered in time."""
        holdings = self.holdings_future(request_id, deadline_s=deadline_s).result(
            timeout=(self.settings.max_widen_s if deadline_s is None else deadline_s)
            + _VERDICT_GRACE_S
        )
        if not holdings.settled:
            raise FindIncomplete(holdings)
        if not holdings.tasks:
            raise NoSuchTask(f"no node holds a task of {request_id}")
        allocations = tuple(
            PlacedAllocation(
                node=t.sender,
                address=node_address(t.sender),
                allocation_id=t.allocation_id,
                resources={},
            )
            for t in sorted(holdings.tasks, key=lambda t: (t.sender, t.allocation_id))
        )
        placed: concurrent.futures.Future[Placement] = concurrent.futures.Future()
        placed.set_result(
            Placement(request_id=request_id, allocations=allocations, requested=len(allocations))
        )
        run = TaskRun(request_id, placed)
        for state in holdings.tasks:
            run.heard(state)
        if run.finished:
            return run
        with self._lock:
            self._runs[request_id] = run
        for allocation in allocations:
            if run.latest[allocation.allocation_id].state not in ENDED_STATES:
                threading.Thread(
                    target=self._watch_task,
                    args=(run, allocation.node, allocation.allocation_id),
                    name=f"{self.name}:watch-{allocation.allocation_id}",
                    daemon=True,
                ).start()
        return run

    async def attach_async(self, request_id: str, *, deadline_s: float | None = None) -> TaskRun:
        """:meth:`attach` without blocking the running event loop."""
        return await asyncio.to_thread(self.attach, request_id, deadline_s=deadline_s)

    def _watch_task(self, run: TaskRun, node: str, allocation_id: str) -> None:
        """Until the task ended: ask its node to answer once it did (a query for its
        state alone, held by the node), and take each answer as news."""
        silent = False
        while not self._closed and not run.finished:
            try:
                answer = self.output_future(
                    node, run.request_id, allocation_id, max_bytes=0, wait_s=FOLLOW_WAIT_S
                ).result(timeout=FOLLOW_WAIT_S + _VERDICT_GRACE_S)
            except (concurrent.futures.TimeoutError, OutputUnreachable, RequestorClosed):
                if self._closed:
                    return
                if not silent:
                    log.warning("request %s: node %s does not answer about its task %s; "
                                "still asking", run.request_id, node, allocation_id)  # fmt: skip
                silent = True
                threading.Event().wait(self.settings.task_check_s)  # not a busy loop
                continue
            silent = False
            task = answer.task
            if task is None:
                # Found moments ago, unknown now: its retention passed since it ended
                task_state = TaskState(
                    request_id=run.request_id,
                    sender=node,
                    reply_to=answer.reply_to,
                    allocation_id=allocation_id,
                    state="exited",
                    reason="the node no longer keeps this task (it ended before its retention)",
                    answering=True,
                )
            else:
                task_state = TaskState(
                    request_id=run.request_id,
                    sender=node,
                    reply_to=answer.reply_to,
                    allocation_id=allocation_id,
                    state=task.state,
                    driver=task.driver,
                    exit_code=task.exit_code,
                    reason=task.reason,
                    limits=task.limits,
                    kept=task.kept,
                    answering=True,
                )
            with self._lock:  # as a delivery is heard
                self._heard_task(task_state)
            if task_state.state in ENDED_STATES:
                return

    # -- output ------------------------------------------------------------------------

    def output_future(
        self,
        node: str,
        request_id: str,
        allocation_id: str,
        stream: str = "stdout",
        offset: int = 0,
        *,
        max_bytes: int | None = None,
        wait_s: float = 0.0,
    ) -> concurrent.futures.Future[TaskOutput]:
        """Ask ``node`` for up to ``max_bytes`` of ``stream`` of the task of
        ``allocation_id`` from ``offset`` on; the future resolves to its answer, a
        :class:`~reservoir.protocol.messages.TaskOutput` (``OutputUnreachable`` when the
        node's inbox is gone). With ``wait_s`` the node answers once there is output past
        ``offset`` or the task ended (at the latest after ``wait_s``); ``max_bytes=0``
        asks for the task's state alone, answered once it ended. By default, as much as
        an answer this requestor accepts carries (its ``max_message_bytes``: the chunk
        goes as base64, in an envelope)."""
        if max_bytes is None:
            room = (self.settings.max_message_bytes - _OUTPUT_ENVELOPE_BYTES) * 3 // 4
            max_bytes = max(1, min(OUTPUT_CHUNK_MAX, room))
        query = TaskOutputQuery(
            request_id=request_id,
            sender=self.name,
            reply_to=self.address,
            allocation_id=allocation_id,
            stream=stream,  # type: ignore[arg-type]  # checked by the message's decoder
            offset=offset,
            max_bytes=max_bytes,
            wait_s=wait_s,
        )
        future: concurrent.futures.Future[TaskOutput] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RequestorClosed(f"{self.name} is closed")
            if len(self._output_asked) >= _OUTPUT_ASKED_MAX:
                self._let_go_of_given_up_output()
            self._output_asked.setdefault((allocation_id, stream, offset), []).append(future)
            known = self._knows_task_output(node)
        if known is None:
            self._run(lambda now: [Send(node_address(node), query)])
            return future

        def asked(check: concurrent.futures.Future[None]) -> None:
            error = check.exception()
            if error is not None:
                with self._lock:
                    waiting = self._output_asked.pop((allocation_id, stream, offset), [])
                for waiter in waiting:
                    if not waiter.done():
                        waiter.set_exception(error)
                return
            self._run(lambda now: [Send(node_address(node), query)])

        known.add_done_callback(asked)
        self._settle([])  # the question for its features, queued under the lock, goes now
        return future

    def _knows_task_output(self, node: str) -> concurrent.futures.Future[None] | None:
        """Under the machine's lock: None when ``node`` is known to answer a
        ``TaskOutputQuery`` (its status said the feature, or its configuration did when
        asked), else a future that resolves once its configuration says (with
        ``OutputNotKnown`` when it does not). A node of release 0.1.0 drops the query as
        a kind it does not know: it is never sent one (docs/design.md, "Upgrades")."""
        member = self.machine.roster.member(node)
        if node in self._output_nodes or (member is not None and "task_output" in member.features):
            return None
        for asked_node, waiting in self._feature_asks.values():
            if asked_node == node:
                return waiting  # being asked already
        audit_id = f"features-{secrets.token_hex(6)}"
        waiting = concurrent.futures.Future()
        self._feature_asks[audit_id] = (node, waiting)
        question = LedgerQuery(sender=self.name, reply_to=self.address, audit_id=audit_id)
        self._execute([Send(node_address(node), question)], [])
        return waiting

    def _heard_features(self, report: LedgerReport) -> None:
        """Under the machine's lock: a node's ledger configuration, asked for its features:
        its waiters learn whether it answers TaskOutputQuery (outside the lock: they send
        the query)."""
        asked = self._feature_asks.pop(report.audit_id, None) if report.part == 0 else None
        if asked is None:
            return
        node, waiting = asked
        error: BaseException | None = None
        if "task_output" in said_features(report.configuration):
            self._output_nodes.add(node)
        else:
            error = OutputNotKnown(
                f"node {node} runs release {said_release(report.configuration)}, which does "
                "not know task output: it keeps no output a reader can ask for"
            )
        self._settle_later(waiting, error)

    def _features_unreachable(self, query: LedgerQuery) -> None:
        """Under the machine's lock: the node asked for its features is not there."""
        asked = self._feature_asks.pop(query.audit_id, None)
        if asked is not None:
            node, waiting = asked
            self._settle_later(waiting, OutputUnreachable(f"node {node} is not reachable"))

    def _settle_later(
        self, waiting: concurrent.futures.Future[None], error: BaseException | None
    ) -> None:
        """Resolve ``waiting`` once the machine's lock is let go (its callbacks call in)."""

        def settle() -> None:
            if waiting.done():
                return
            if error is None:
                waiting.set_result(None)
            else:
                waiting.set_exception(error)

        self.scheduler.call_at(self.scheduler.clock.now(), settle)

    def _let_go_of_given_up_output(self) -> None:
        for key, waiting in list(self._output_asked.items()):
            waiting[:] = [f for f in waiting if not f.done()]
            if not waiting:
                del self._output_asked[key]

    def _ask_output(
        self, node: str, request_id: str, allocation_id: str, stream: str, offset: int,
        wait_s: float,
    ) -> concurrent.futures.Future[TaskOutput]:  # fmt: skip
        return self.output_future(node, request_id, allocation_id, stream, offset, wait_s=wait_s)

    def _heard_output(self, answer: TaskOutput) -> None:
        """Under the machine's lock (a delivery): hand the answer to its readers."""
        key = (answer.allocation_id, answer.stream, answer.offset)
        waiting = self._output_asked.pop(key, [])
        if answer.skipped:  # asked from an offset no longer kept
            waiting += self._output_asked.pop(
                (answer.allocation_id, answer.stream, answer.offset - answer.skipped), []
            )
        for future in waiting:
            if not future.done():
                future.set_result(answer)

    def _unreachable_output(self, query: TaskOutputQuery) -> None:
        """Under the machine's lock (a returned message): its readers learn why."""
        waiting = self._output_asked.pop((query.allocation_id, query.stream, query.offset), [])
        for future in waiting:
            if not future.done():
                future.set_exception(
                    OutputUnreachable(f"the node holding {query.allocation_id} is not reachable")
                )

    def task_locations(
        self, request_id: str, *, deadline_s: float | None = None
    ) -> list[tuple[str, str]]:
        """Where the tasks of ``request_id`` run or ran, as (node, allocation id) pairs:
        from this requestor's memory when it placed the request, else asked of the
        nodes (:meth:`holdings_future`). Raises :class:`NoSuchTask` or
        :class:`FindIncomplete`."""
        with self._lock:
            placement = self.machine.placement_of(request_id)
        if placement is not None:
            return sorted((a.node, a.allocation_id) for a in placement.allocations)
        holdings = self.holdings_future(request_id, deadline_s=deadline_s).result(
            timeout=(self.settings.max_widen_s if deadline_s is None else deadline_s)
            + _VERDICT_GRACE_S
        )
        if not holdings.settled:
            raise FindIncomplete(holdings)
        found = {(t.sender, t.allocation_id) for t in holdings.tasks}
        if not found:
            raise NoSuchTask(f"no node holds a task of {request_id}")
        return sorted(found)

    def output_readers(
        self,
        request_id: str,
        *,
        stream: str = "stdout",
        follow: bool = False,
        allocation_id: str | None = None,
        locations: list[tuple[str, str]] | None = None,
    ) -> list[OutputReader]:
        """A reader of ``stream`` per instance's task of ``request_id`` (only
        ``allocation_id``'s when given): see :class:`OutputReader`."""
        where = locations if locations is not None else self.task_locations(request_id)
        if allocation_id is not None:
            where = [(node, a) for node, a in where if a == allocation_id]
            if not where:
                raise NoSuchTask(f"request {request_id} has no instance {allocation_id}")
        return [
            OutputReader(self._ask_output, node, request_id, a, stream, follow=follow)
            for node, a in where
        ]

    def output(
        self,
        request_id: str,
        *,
        stream: str = "stdout",
        follow: bool = False,
        allocation_id: str | None = None,
    ) -> Iterator[OutputPiece]:
        """The output of the tasks of ``request_id`` (``stream``: ``stdout`` or
        ``stderr``), as :class:`OutputPiece` in the order each instance wrote it, the
        instances' pieces as they come: what the nodes keep now, or with ``follow``,
        until every task ended. Blocking; raises :class:`NoSuchTask` when no node holds a
        task of the id."""
        return merged(
            self.output_readers(
                request_id, stream=stream, follow=follow, allocation_id=allocation_id
            )
        )

    # -- freeing -----------------------------------------------------------------------

    def release_future(self, placement: Placement) -> concurrent.futures.Future[tuple[str, ...]]:
        """Free ``placement``'s allocations: resolves to the ids of those the nodes freed
        (``FreeIncomplete`` if a node does not confirm within the free attempts)."""
        return self._start(
            self._freeing, placement.request_id, lambda now: self.machine.free(placement, now)
        )

    def free_future(
        self, request_id: str, node: str, allocation_ids: Iterable[str] = ()
    ) -> concurrent.futures.Future[tuple[str, ...]]:
        """Free a request's allocations on the node called ``node``: those named, or all
        of them. Resolves, once the node confirms, to the ids of the allocations it freed:
        empty when it held none of them (``FreeIncomplete`` if it does not confirm within
        the free attempts; the requestor goes on trying). The ids are the node's answer to
        the first Free it took: were that answer lost and the Free sent again, the node
        would answer that it held nothing any more."""
        address, ids = node_address(node), tuple(allocation_ids)
        return self._start(
            self._freeing,
            request_id,
            lambda now: self.machine.free_on_node(request_id, node, address, ids, now),
        )

    def release(self, placement: Placement, *, timeout_s: float = 30.0) -> None:
        """Free a placement's allocations on their nodes (the instances were deleted).
        Raises :class:`FreeIncomplete` if a node does not confirm within the free
        attempts; the requestor goes on freeing there, less often, while it runs."""
        self.release_future(placement).result(timeout=timeout_s)

    async def release_async(self, placement: Placement) -> tuple[str, ...]:
        """:meth:`release_future`, awaited: the ids of the allocations the nodes freed."""
        return await asyncio.wrap_future(self.release_future(placement))

    # -- finding -----------------------------------------------------------------------

    def holdings_future(
        self, request_id: str, *, deadline_s: float | None = None
    ) -> concurrent.futures.Future[Holdings]:
        """Ask the nodes what they hold of ``request_id`` (its allocations, and the tasks
        of its instances): the future resolves to :class:`Holdings`, *settled* once every
        holder has answered (each says how many instances the placement has in all) or
        at once when no node holds anything of the id (the question comes back
        unroutable). Not settled when ``deadline_s`` (None: the ``max_widen_s`` setting,
        2 s) comes first: a holder slow to answer, or the id being placed. Only findable
        placements are found: those of caller-chosen ids, and every one a requestor made
        ``findable=True``. A node that cannot be reached at the moment (down, or
        reconnecting) is not heard. Raises ``InvalidField`` for an id no node would
        accept."""
        with self._lock:
            if self._closed:
                raise RequestorClosed(f"{self.name} is closed")
            expected = self.machine.placement_of(request_id)
        deadline_s = self.settings.max_widen_s if deadline_s is None else deadline_s
        return self._open_finder().find_future(request_id, deadline_s, expected=expected)

    def holdings(self, request_id: str, *, deadline_s: float | None = None) -> Holdings:
        """:meth:`holdings_future`, waited for (blocking; thread-safe)."""
        future = self.holdings_future(request_id, deadline_s=deadline_s)
        wait_s = self.settings.max_widen_s if deadline_s is None else deadline_s
        return future.result(timeout=wait_s + _VERDICT_GRACE_S)

    async def holdings_async(self, request_id: str, *, deadline_s: float | None = None) -> Holdings:
        """:meth:`holdings_future` without blocking the running event loop."""
        if self._finder is None:
            await asyncio.to_thread(self._open_finder)  # opening an inbox waits for the broker
        return await asyncio.wrap_future(self.holdings_future(request_id, deadline_s=deadline_s))

    def find(self, request_id: str, *, deadline_s: float | None = None) -> Placement | None:
        """The allocations the nodes hold of ``request_id``, as a :class:`Placement`
        (the placement this requestor answered with, when the nodes hold exactly it;
        otherwise what they hold, ``requested`` being the instances held), or None when
        they hold none (blocking; thread-safe). Raises :class:`FindIncomplete` when not
        every holder answered before the deadline: see :meth:`holdings_future`."""
        return _found(self.holdings(request_id, deadline_s=deadline_s))

    async def find_async(
        self, request_id: str, *, deadline_s: float | None = None
    ) -> Placement | None:
        """:meth:`find` without blocking the running event loop."""
        return _found(await self.holdings_async(request_id, deadline_s=deadline_s))

    def forget(self, request_id: str) -> None:
        """Forget a placement this requestor remembers under ``request_id``: the nodes no
        longer hold it (it was freed through another requestor), so placing the id again
        must ask them instead of answering from memory."""
        with self._lock:
            self.machine.forget(request_id)

    def _open_finder(self) -> Finder:
        with self._finder_lock:
            if self._finder is None:
                if self._closed:
                    raise RequestorClosed(f"{self.name} is closed")
                self._finder = Finder(
                    self.broker,
                    name=f"{self.name}.find",
                    settings=self.settings,
                    scheduler=self.scheduler,
                    metrics=self.metrics,
                )
            return self._finder

    # -- lifecycle ---------------------------------------------------------------------

    def in_flight(self) -> int:
        with self._lock:
            return self.machine.in_flight()

    def close(self) -> None:
        """Fail whatever is in flight (releasing what it holds) and let go. Idempotent."""
        if self._closed:
            return
        outcomes: list[Outcome] = []
        with self._lock:
            self._execute(self.machine.abandon(self.scheduler.clock.now()), outcomes)
            self._closed = True
            self._cancel_all_timers()
        self._settle(outcomes)
        waiting: list[concurrent.futures.Future[Any]] = []
        for placing in self._placing.values():
            waiting += placing
        for freeing in self._freeing.values():
            waiting += freeing
        with self._lock:
            asked, self._output_asked = self._output_asked, {}
        for readers in asked.values():
            waiting += readers
        for future in waiting:
            if not future.done():
                future.set_exception(RequestorClosed(f"{self.name} closed"))
        with self._lock:
            left = list(self._spans)
        for request_id in left:
            self._end_spans(request_id, "closed")
        with self._finder_lock:
            finder, self._finder = self._finder, None
        if finder is not None:
            finder.close(RequestorClosed(f"{self.name} closed"))
        self.metrics.remove_source()
        self._let_go()

    def __enter__(self) -> Requestor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Requestor:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    # -- observing ---------------------------------------------------------------------

    def _metric_families(self) -> Iterator[Metric]:
        """The requestor's state when Prometheus scrapes (see reservoir.observe.metrics)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            in_flight = self.machine.in_flight()
            held = self.machine.held_reservations()
            roster = len(self.machine.roster)
            source = self.machine.roster_source.state
            steps = dict(self.machine.counters)
        labels = ["participant"]
        for name, documentation, value in (
            ("reservoir_requestor_in_flight", "Requests being placed now", in_flight),
            ("reservoir_requestor_offers_held", "Offers held, not yet awarded or released",
             held),
            ("reservoir_requestor_roster_nodes", "Nodes the requestor knows of", roster),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, documentation, labels=labels)
            gauge.add_metric([self.metrics.participant], value)
            yield gauge
        counter = CounterMetricFamily(
            "reservoir_requestor_steps",
            "How the requestor asked: probes (messages), probe_rounds, exhaustive_steps "
            "(tier broadcasts), busy_retries, unheard_retries, room_rechecks (decliners that "
            "told of more room, asked again before a failure)",
            labels=["participant", "step"],
        )
        for step in ("probes", "probe_rounds", "exhaustive_steps", "busy_retries",
                     "unheard_retries", "room_rechecks"):  # fmt: skip
            counter.add_metric([self.metrics.participant, step], steps.get(step, 0))
        yield counter
        reconciled = CounterMetricFamily(
            "reservoir_requestor_reconciliations",
            "One request id placed twice while a holder was away, found once it was back: "
            "lookups_again (ids looked up again), superseded_frees (earlier placements "
            "freed), superseded_placements (ours the earlier: forgotten)",
            labels=["participant", "kind"],
        )
        for kind in ("lookups_again", "superseded_frees", "superseded_placements"):
            reconciled.add_metric([self.metrics.participant, kind], steps.get(kind, 0))
        yield reconciled
        where = GaugeMetricFamily(
            "reservoir_requestor_roster_source",
            "Where the requestor's roster comes from now (1 for the one): keepers (a roster "
            "keeper's samples), announcements (every node's statuses: no keeper answers, or "
            "roster_from is announcements), asking (started; no keeper answered yet)",
            labels=["participant", "source"],
        )
        for each in ("keepers", "announcements", "asking"):
            where.add_metric([self.metrics.participant, each], 1 if each == source else 0)
        yield where
        switches = CounterMetricFamily(
            "reservoir_requestor_roster_switches",
            "Switches of the roster's source: to announcements (a query reached no "
            "keeper), to keepers (a keeper answered again)",
            labels=["participant", "to"],
        )
        for to, step in (("announcements", "no_keeper"), ("keepers", "back_on_keepers")):
            switches.add_metric([self.metrics.participant, to], steps.get(step, 0))
        yield switches

    def _end_spans(self, request_id: str, outcome: str, error: BaseException | None = None,
                   **attributes: Any) -> None:  # fmt: skip
        if not self._spans:
            return  # not tracing: the usual case costs one truth test
        with self._lock:
            spans = self._spans.pop(request_id, ())
        for span in spans:
            tracing.end_place(span, outcome, error, **attributes)

    # -- driver hooks ------------------------------------------------------------------

    def _conversation_of(self, key: Hashable) -> str | None:
        if type(key) is ConversationTimer or type(key) is FreeTimer:
            return key.request_id
        return None

    def _handle_message(self, message: Message, now: float) -> list[Effect]:
        if message.kind == "task_state":
            # news for a caller waiting on its tasks, not for the placing conversation
            assert isinstance(message, TaskState)
            self._heard_task(message)
            return []
        if message.kind == "task_output":
            assert isinstance(message, TaskOutput)
            self._heard_output(message)
            return []
        if message.kind == "ledger_report":
            assert isinstance(message, LedgerReport)
            self._heard_features(message)  # the only ledger a requestor asks for
            return []
        if self.machine.claims_held:
            self._notice_claims_lost()
        return self.machine.handle(message, now)

    def _handle_returned(self, message: Message, now: float) -> list[Effect]:
        if message.kind == "task_output_query":
            assert isinstance(message, TaskOutputQuery)
            self._unreachable_output(message)
            return []
        if message.kind == "ledger_query":
            assert isinstance(message, LedgerQuery)
            self._features_unreachable(message)
            return []
        return self.machine.on_unroutable(message, now)

    def _refused_answer(self, body: bytes) -> None:
        # An offer or decline signed with another node's key: nothing in it is believed,
        # but it did answer, so the tier it answered is not waited out for it.
        try:
            message = decode_message(body)
        except (msgspec.DecodeError, InvalidField, UnicodeDecodeError, RecursionError):
            return
        if type(message) is Offer or type(message) is Decline:
            request_id, sender, attempt = message.request_id, message.sender, message.attempt
            self._run(lambda now: self.machine.on_refused_answer(request_id, sender, attempt, now))

    def _handle_timer(self, key: Hashable, now: float) -> list[Effect]:
        if self.machine.claims_held:
            self._notice_claims_lost()
        return self.machine.on_timer(key, now)

    def _handle_claim(self, request_id: str, held: bool | None, now: float) -> list[Effect]:
        if held:
            # the claim was made on the connection there is now (the driver checked)
            self._connections_seen = self.broker.connections
        return self.machine.on_claim(request_id, held, now)

    def _notice_claims_lost(self) -> None:
        """Under the machine's lock, before it decides anything: a connection renewed
        since the claims were made took them with it. (Offers that came after the
        renewal can only be heard after it, so the machine hears of it first.)"""
        connections = self.broker.connections
        if connections != self._connections_seen:
            self._connections_seen = connections
            self.machine.claims_lost()

    def _deliver(self, outcomes: list[Outcome]) -> None:
        # A waiter may have given up (an asyncio task cancelled, a client gone): its future
        # is done already and is skipped; everyone else still gets the answer.
        for outcome in outcomes:
            if type(outcome) is Placed:
                placement = outcome.placement
                if self._replays:
                    replay = outcome.request_id in self._replays
                    self._replays.discard(outcome.request_id)
                else:
                    replay = False
                if not replay:
                    self.metrics.placed(placement)
                if log.isEnabledFor(logging.DEBUG):  # its arguments cost more than the call
                    self._log_placed(outcome.request_id, placement)
                self._end_spans(
                    outcome.request_id,
                    "placed",
                    instances=len(placement.allocations),
                    offers=placement.offers_received,
                    tiers_tried=len(placement.tiers_tried),
                )
                for future in self._pop(self._placing, outcome.request_id):
                    if not future.done():
                        future.set_result(outcome.placement)
            elif type(outcome) is Failed:
                explanation = outcome.error.explanation
                self._replays.discard(outcome.request_id)
                self.metrics.failed(outcome.error, explanation.elapsed_s)
                log.debug(
                    "not placed: %s",
                    explanation,
                    extra={
                        "request_id": outcome.request_id,
                        "outcome": "not_placed",
                        "elapsed_ms": round(explanation.elapsed_s * 1000, 1),
                    },
                )
                self._end_spans(
                    outcome.request_id,
                    "failed",
                    outcome.error,
                    offers=explanation.offers_received,
                    tiers_tried=len(explanation.tiers_tried),
                )
                for future in self._pop(self._placing, outcome.request_id):
                    if not future.done():
                        future.set_exception(outcome.error)
            elif type(outcome) is FreeCompleted:
                for done in self._pop(self._freeing, outcome.request_id):
                    if done.done():
                        continue
                    if outcome.missing:
                        done.set_exception(FreeIncomplete(outcome.request_id, outcome.missing))
                    else:
                        done.set_result(outcome.freed)

    @staticmethod
    def _log_placed(request_id: str, placement: Placement) -> None:
        nodes = sorted(set(placement.nodes))
        log.debug(
            "placed %s: %d instance(s) on %s in %.1f ms, tiers %s",
            request_id,
            len(placement.allocations),
            ", ".join(nodes) or "no node",
            placement.elapsed_s * 1000,
            placement.tiers_tried,
            # the facts as fields of a JSON line (observe/logs.py)
            extra={
                "request_id": request_id,
                "outcome": "placed",
                "node": ",".join(nodes),
                "elapsed_ms": round(placement.elapsed_s * 1000, 1),
            },
        )

    def _pop(self, waiting: dict[str, list[Any]], request_id: str) -> list[Any]:
        with self._lock:
            return waiting.pop(request_id, [])


# Re-exported for callers that catch errors from this module.
__all__ += ["Explanation", "PlacementError"]


def _found(holdings: Holdings) -> Placement | None:
    if not holdings.settled:
        raise FindIncomplete(holdings)
    return holdings.placement
