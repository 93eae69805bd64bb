"""``reservoir serve``: the placement service over HTTP, and the pieces of it a user's own
ASGI app can embed.

This module owns:

- :class:`ReservoirService`: ONE shared :class:`~reservoir.Requestor` per process (it is
  thread-safe, runs any number of concurrent requests over one reply queue and learns the
  offer latency that keeps tier widening short), the placements this process made, and
  the per-process record of idempotency key -> request body hash.
- :func:`reservoir_lifespan`: an async context manager that opens the service for an
  ASGI app's lifespan and closes it on shutdown (in-flight placements are given
  ``drain_timeout_s`` to finish, then the requestor closes, which fails what is still in
  flight and releases what it reserved). Put it in a FastAPI or Starlette lifespan.
- :func:`create_app`: the FastAPI app of ``reservoir serve`` (``/v1/reservations``,
  ``/v1/nodes``, ``/healthz``, ``/readyz``, ``/metrics``); every error is
  ``application/problem+json`` (RFC 9457).
- :func:`serve`: the click command, registered on ``reservoir`` by reservoir/cli.py.

FastAPI, uvicorn and prometheus_client come with the ``api`` extra; they are imported
only when an app is built or served, so ``reservoir`` without the extra still works.
(Hence no ``from __future__ import annotations`` here: FastAPI resolves the endpoints'
annotations, which name classes imported inside :func:`create_app`.)
"""

import asyncio
import hashlib
import json
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any, Protocol, TypeVar

import click
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from reservoir import tracing
from reservoir.audit import NodeSnapshot
from reservoir.auditor import LedgerCollector
from reservoir.broker import Broker, BrokerError
from reservoir.protocol.messages import (
    IDENTIFIER_MAX_LENGTH,
    IDENTIFIER_PATTERN,
    TRAIT_MAX_LENGTH,
    TRAIT_PATTERN,
    GroupPolicy,
    GroupSpec,
)
from reservoir.protocol.placement import (
    Placement,
    PlacementError,
    PlacementRequest,
    PlacementTimeout,
    checked_request,
)
from reservoir.requestor import FreeIncomplete, Requestor, RequestorClosed
from reservoir.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from reservoir.service_metrics import ServiceMetrics

__all__ = [
    "AllocationOut",
    "Identifier",
    "NodeOut",
    "PlacementOut",
    "Problem",
    "ReservationIn",
    "ReservoirService",
    "Trait",
    "create_app",
    "reservoir_lifespan",
    "serve",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

PROBLEM_JSON = "application/problem+json"
#: RFC 9457 ``type`` URIs of the problems this service answers with
PROBLEM_TYPES = {
    400: "about:blank",
    404: "urn:reservoir:problem:not-found",
    409: "urn:reservoir:problem:not-placed",
    422: "urn:reservoir:problem:invalid-request",
    502: "urn:reservoir:problem:free-incomplete",
    503: "urn:reservoir:problem:unavailable",
    504: "urn:reservoir:problem:timeout",
}

DEFAULT_DRAIN_TIMEOUT_S = 10.0
DEFAULT_NODES_WAIT_S = 1.0


# -- the HTTP shapes -------------------------------------------------------------------

#: The protocol's rules for an id and a trait (:mod:`reservoir.protocol.messages`), as
#: pydantic checks them in the HTTP shapes: a bad field is a 422 that names it, and the
#: OpenAPI schema shows the rule.
Identifier = Annotated[
    str,
    StringConstraints(min_length=1, max_length=IDENTIFIER_MAX_LENGTH, pattern=IDENTIFIER_PATTERN),
]
Trait = Annotated[
    str, StringConstraints(min_length=1, max_length=TRAIT_MAX_LENGTH, pattern=TRAIT_PATTERN)
]


class ReservationIn(BaseModel):
    """``POST /v1/reservations``: what each instance needs, how many, and where."""

    model_config = ConfigDict(extra="forbid")

    vcpus: int | None = Field(default=None, ge=0, le=2**20)
    memory_mb: int | None = Field(default=None, ge=0, le=2**40)
    disk_gb: int | None = Field(default=None, ge=0, le=2**40)
    #: any other resource classes per instance, e.g. ``{"CUSTOM_GPU": 1}``
    resources: dict[str, int] = Field(default_factory=dict)
    count: int = Field(default=1, ge=1, le=1000)
    #: accept a partial placement of at least this many instances
    min_count: int | None = Field(default=None, ge=1)
    #: a server group the instances join; ``policy`` defaults to anti-affinity
    group: Identifier | None = None
    policy: GroupPolicy | None = None
    required_traits: list[Trait] = Field(default_factory=list)
    forbidden_traits: list[Trait] = Field(default_factory=list)
    #: idempotency key; the ``Idempotency-Key`` header is the usual way to give it
    request_id: Identifier | None = None
    #: how long to try before answering 504 (default: the ``request_timeout_s`` setting)
    timeout_s: float | None = Field(default=None, gt=0, le=600)

    @model_validator(mode="after")
    def _policy_needs_group(self) -> "ReservationIn":
        if self.policy is not None and self.group is None:
            raise ValueError("policy needs a group")
        return self

    def fingerprint(self) -> str:
        """A hash of what was asked, the idempotency key aside (it may come in the header
        or the body; the same request either way)."""
        shape = self.model_dump(mode="json", exclude={"request_id"})
        canonical = json.dumps(shape, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_placement_request(self, request_id: str | None, explain: bool) -> PlacementRequest:
        """The protocol's request; raises :class:`ValueError` for a shape the protocol
        refuses (no positive amount, min_count > count, an unknown class); when one field
        is at fault the error is an :class:`~reservoir.protocol.placement.InvalidRequest`,
        whose ``field`` names it."""
        resources = dict(self.resources)
        for name, amount in (
            ("VCPU", self.vcpus),
            ("MEMORY_MB", self.memory_mb),
            ("DISK_GB", self.disk_gb),
        ):
            if amount is not None:
                resources[name] = amount
        group = None
        if self.group is not None:
            group = GroupSpec(name=self.group, policy=self.policy or "anti-affinity")
        return checked_request(
            PlacementRequest(
                resources=resources,
                count=self.count,
                min_count=self.min_count,
                group=group,
                required_traits=frozenset(self.required_traits),
                forbidden_traits=frozenset(self.forbidden_traits),
                explain=explain,
                request_id=request_id,
            )
        )


class AllocationOut(BaseModel):
    node: str
    allocation_id: str
    resources: dict[str, int]


class PlacementOut(BaseModel):
    """A placement, in the shape ``reservoir request --json`` prints (so
    :func:`reservoir.auditor.read_placements` reads it back)."""

    placed: bool = True
    request_id: str
    partial: bool
    requested: int
    allocations: list[AllocationOut]
    tiers_tried: list[int]
    elapsed_s: float

    @classmethod
    def of(cls, placement: Placement) -> "PlacementOut":
        return cls(
            request_id=placement.request_id,
            partial=placement.partial,
            requested=placement.requested,
            allocations=[
                AllocationOut(
                    node=a.node, allocation_id=a.allocation_id, resources=dict(a.resources)
                )
                for a in placement.allocations
            ],
            tiers_tried=list(placement.tiers_tried),
            elapsed_s=round(placement.elapsed_s, 4),
        )


class UsageOut(BaseModel):
    capacity: int
    allocated: int
    reserved: int


class NodeOut(BaseModel):
    """One live node, as its ledger report says."""

    name: str
    tier: int
    utilisation: float
    usage: dict[str, UsageOut]
    allocations: int
    reservations: int

    @classmethod
    def of(cls, snapshot: NodeSnapshot) -> "NodeOut":
        return cls(
            name=snapshot.name,
            tier=snapshot.tier,
            utilisation=round(snapshot.utilisation, 4),
            usage={
                rc: UsageOut(capacity=u.capacity, allocated=u.allocated, reserved=u.reserved)
                for rc, u in snapshot.usages.items()
            },
            allocations=len(snapshot.allocations),
            reservations=len(snapshot.reservations),
        )


class ProblemOut(BaseModel):
    """RFC 9457 problem details, with reservoir's extension members."""

    type: str
    title: str
    status: int
    detail: str
    request_id: str | None = None
    tiers_tried: list[int] | None = None
    #: reason -> how many nodes gave it
    reasons: dict[str, int] | None = None
    offers_received: int | None = None
    #: validation errors: each with the ``field`` it is about
    errors: list[dict[str, str]] | None = None


class Problem(Exception):
    """An error answered as ``application/problem+json``."""

    def __init__(self, status: int, title: str, detail: str, **extensions: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.extensions = extensions

    def body(self) -> dict[str, Any]:
        problem = ProblemOut(
            type=PROBLEM_TYPES.get(self.status, "about:blank"),
            title=self.title,
            status=self.status,
            detail=self.detail,
            **self.extensions,
        )
        return problem.model_dump(exclude_none=True)

    @classmethod
    def of_placement_error(cls, error: PlacementError) -> "Problem":
        explanation = error.explanation
        timed_out = isinstance(error, PlacementTimeout)
        return cls(
            504 if timed_out else 409,
            "not placed in time" if timed_out else "the nodes cannot take the request",
            str(explanation),
            request_id=explanation.request_id,
            tiers_tried=list(explanation.tiers_tried),
            reasons=dict(explanation.reasons),
            offers_received=explanation.offers_received,
        )

    @classmethod
    def of_validation_error(cls, errors: list[Any], where: tuple[str, ...] = ()) -> "Problem":
        fields = [
            {
                "field": ".".join(str(part) for part in (*where, *error.get("loc", ()))),
                "message": str(error.get("msg", "invalid")),
            }
            for error in errors
        ]
        detail = "; ".join(f"{f['field'] or 'body'}: {f['message']}" for f in fields)
        return cls(422, "invalid request", detail, errors=fields)


# -- the service -----------------------------------------------------------------------


class _HasState(Protocol):
    state: Any


@dataclass
class ReservoirService:
    """The shared requestor, what this process placed (by request id), and the
    idempotency record.

    The record lives in memory: the key -> body-hash check and ``GET``/``DELETE`` see only
    this process's placements. The nodes still answer for a reused id across processes
    (the same id gives the same placement from any replica), but only the process that
    first saw a key can tell that a later body differs. Only the event loop's thread
    touches the dictionaries, so there is no lock.
    """

    requestor: Requestor
    broker: Broker
    settings: Settings
    explain: bool = True
    metrics: "ServiceMetrics | None" = None
    placements: dict[str, Placement] = field(default_factory=dict)
    #: idempotency key -> fingerprint of the body first given with it
    fingerprints: dict[str, str] = field(default_factory=dict)
    freeing: set[str] = field(default_factory=set)
    closing: bool = False
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def ready(self) -> bool:
        """Whether requests can be placed: not shutting down, and the broker connected.
        The in-process broker has no connection to lose and is always ready."""
        if self.closing:
            return False
        return self.broker.connected

    def check_ready(self) -> None:
        if self.closing:
            raise Problem(503, "shutting down", "the service is shutting down")
        if not self.ready:
            raise Problem(503, "broker unavailable", "the broker connection is down")

    def claim_key(self, key: str, fingerprint: str) -> None:
        """Remember the body first given with ``key``; a different one is a 422."""
        seen = self.fingerprints.setdefault(key, fingerprint)
        if seen != fingerprint:
            raise Problem(
                422,
                "idempotency key reused",
                f"request id {key!r} was given before with a different body; "
                "use a new Idempotency-Key for a different request",
                request_id=key,
            )

    async def place(self, spec: PlacementRequest, *, timeout_s: float | None = None) -> Placement:
        """Place ``spec`` and record it, even should the caller go away (the retry with
        the same key then finds it)."""
        try:
            self.check_ready()
        except Problem:
            if self.metrics is not None:
                self.metrics.failures.labels("unavailable").inc()
            raise
        return await self._to_the_end(self._place(spec, timeout_s))

    async def release(self, request_id: str) -> None:
        """Release a placement this process made; 404 for any other id."""
        placement = self.placements.pop(request_id, None)
        if placement is None:
            raise Problem(404, "no such reservation", f"this service holds no {request_id!r}")
        # marked before the first await: a POST with this key in between must not find it
        # neither listed nor being freed, and place it again under the release
        self.freeing.add(request_id)
        self._count_held()
        await self._to_the_end(self._release(placement))

    async def nodes(self, wait_s: float, expect_nodes: int | None = None) -> list[NodeSnapshot]:
        """Every live node's ledger, asked for over the broker, gathered for ``wait_s``
        (less once ``expect_nodes`` have answered)."""
        self.check_ready()

        def gather() -> list[NodeSnapshot]:
            collector = LedgerCollector(self.broker, settings=self.settings)
            try:
                collector.ask()
                return collector.collect(wait_s=wait_s, expect_nodes=expect_nodes)
            finally:
                collector.close()

        return await asyncio.to_thread(gather)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the placements and releases in flight; returns how
        many were still running."""
        pending = set(self._tasks)
        if pending:
            _done, pending = await asyncio.wait(pending, timeout=timeout_s)
        return len(pending)

    async def _place(self, spec: PlacementRequest, timeout_s: float | None) -> Placement:
        metrics = self.metrics
        started = time.monotonic()
        if metrics is not None:
            metrics.in_flight.inc()
        outcome = "placed"
        try:
            placement = await self.requestor.reserve_async(spec, timeout_s=timeout_s)
        except PlacementTimeout:
            outcome = "timeout"
            raise
        except PlacementError as error:
            # abandoned by the shutdown, not refused by the nodes
            outcome = "unavailable" if self.closing else "not_placed"
            log.info(
                "not placed: %s",
                error.explanation,
                extra={"request_id": error.explanation.request_id},
            )
            raise
        except (RequestorClosed, BrokerError):
            outcome = "unavailable"
            raise
        except BaseException:
            outcome = "error"
            raise
        finally:
            if metrics is not None:
                metrics.in_flight.dec()
                metrics.placement_seconds.labels(outcome).observe(time.monotonic() - started)
                if outcome != "placed":
                    metrics.failures.labels(outcome).inc()
        if metrics is not None:
            metrics.placements.labels(str(placement.partial).lower()).inc()
        log.info(
            "placed %s: %d instance(s) on %s in %.1f ms",
            placement.request_id,
            len(placement.allocations),
            ", ".join(sorted(set(placement.nodes))),
            placement.elapsed_s * 1000,
            extra={"request_id": placement.request_id},
        )
        self.placements[placement.request_id] = placement
        self._count_held()
        return placement

    async def _release(self, placement: Placement) -> None:
        try:
            await self.requestor.release_async(placement)
        except FreeIncomplete:
            # listed again, so that a retried DELETE can finish the job
            self.placements[placement.request_id] = placement
            self._count_held()
            raise
        else:
            # the key is free again: a new body under it is a new request
            self.fingerprints.pop(placement.request_id, None)
        finally:
            self.freeing.discard(placement.request_id)

    def _count_held(self) -> None:
        if self.metrics is not None:
            self.metrics.held.set(len(self.placements))

    async def _to_the_end(self, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` in a task of its own that a cancelled caller does not cancel.
        (Shielding also keeps a cancelled await from cancelling the requestor's future,
        which other waiters on the same id share.)"""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return await asyncio.shield(task)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: nobody may be left to await it


@asynccontextmanager
async def reservoir_lifespan(
    app: _HasState | None = None,
    broker: Broker | str | None = None,
    *,
    settings: Settings | None = None,
    explain: bool = True,
    metrics: "ServiceMetrics | None" = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
) -> AsyncIterator[ReservoirService]:
    """Open a :class:`ReservoirService` for an ASGI app's lifetime; put it in the app's
    lifespan::

        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            async with reservoir_lifespan(app, "amqp://guest:guest@127.0.0.1:5672/"):
                yield

        app = FastAPI(lifespan=lifespan)

        @app.post("/servers")
        async def create(request: Request) -> dict[str, str]:
            service: ReservoirService = request.app.state.reservoir
            placement = await service.place(PlacementRequest(resources={"VCPU": 2}))
            ...

    ``broker`` is a shared :class:`~reservoir.Broker` (left open), a URL, or None for
    ``settings.broker_url``; a broker opened here is closed on exit. With ``app``, the
    service is ``app.state.reservoir`` while open. ``explain`` asks nodes that cannot take
    a request to say why (one more small message per such node, only on failure), so a
    409 names the short resource. On exit, placements in flight get ``drain_timeout_s``
    to finish; then the requestor closes, failing what is left (``RequestorClosed``) and
    releasing whatever it had reserved for it.
    """
    settings = settings if settings is not None else Settings()
    owned: Broker | None = None
    if not isinstance(broker, Broker):
        from brokers import connect

        broker = owned = await asyncio.to_thread(connect, broker or settings.broker_url)
    registry = metrics.registry if metrics is not None else None
    try:
        requestor = await asyncio.to_thread(
            Requestor, broker, settings=settings, metrics_registry=registry
        )
    except BaseException:
        if owned is not None:
            await asyncio.to_thread(owned.close)
        raise
    service = ReservoirService(
        requestor=requestor, broker=broker, settings=settings, explain=explain, metrics=metrics
    )
    if app is not None:
        app.state.reservoir = service
    try:
        yield service
    finally:
        service.closing = True
        left = await service.drain(drain_timeout_s)
        if left:
            log.warning("shutting down with %d placement(s) still in flight: failing them", left)
        await asyncio.to_thread(requestor.close)
        if app is not None:
            app.state.reservoir = None
        if owned is not None:
            await asyncio.to_thread(owned.close)


# -- the app ---------------------------------------------------------------------------


def create_app(
    broker: Broker | str | None = None,
    *,
    settings: Settings | None = None,
    explain: bool = True,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
) -> "FastAPI":
    """The app of ``reservoir serve``, placing through ``broker`` (as in
    :func:`reservoir_lifespan`). Its metrics are in a registry of its own
    (``app.state.metrics``)."""
    from fastapi import FastAPI, Header, Query, Request, Response
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    from reservoir.service_metrics import CONTENT_TYPE_LATEST, ServiceMetrics

    metrics = ServiceMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with reservoir_lifespan(
            app,
            broker,
            settings=settings,
            explain=explain,
            metrics=metrics,
            drain_timeout_s=drain_timeout_s,
        ):
            yield

    app = FastAPI(
        title="reservoir placement service",
        summary="Place work on compute nodes through reservoir's reservation protocol.",
        lifespan=lifespan,
    )
    app.state.metrics = metrics
    app.state.reservoir = None

    def service_of(request: Request) -> ReservoirService:
        service = getattr(request.app.state, "reservoir", None)
        if not isinstance(service, ReservoirService):
            raise Problem(503, "not started", "the requestor is not open")
        return service

    def problem_response(problem: Problem) -> JSONResponse:
        return JSONResponse(problem.body(), status_code=problem.status, media_type=PROBLEM_JSON)

    @app.exception_handler(Problem)
    async def on_problem(request: Request, error: Problem) -> JSONResponse:
        return problem_response(error)

    @app.exception_handler(PlacementError)
    async def on_not_placed(request: Request, error: PlacementError) -> JSONResponse:
        return problem_response(Problem.of_placement_error(error))

    @app.exception_handler(RequestorClosed)
    async def on_closed(request: Request, error: RequestorClosed) -> JSONResponse:
        return problem_response(Problem(503, "shutting down", str(error)))

    @app.exception_handler(BrokerError)
    async def on_broker(request: Request, error: BrokerError) -> JSONResponse:
        return problem_response(Problem(503, "broker unavailable", str(error)))

    @app.exception_handler(FreeIncomplete)
    async def on_free_incomplete(request: Request, error: FreeIncomplete) -> JSONResponse:
        return problem_response(Problem(502, "release incomplete", str(error)))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return problem_response(Problem.of_validation_error(list(error.errors())))

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, error: HTTPException) -> JSONResponse:
        title = {404: "not found", 405: "method not allowed"}.get(error.status_code, "error")
        return problem_response(Problem(error.status_code, title, str(error.detail)))

    @app.middleware("http")
    async def trace_requests(request: Request, call_next: Any) -> Response:
        # A server span continuing the caller's traceparent header: the requestor's
        # reservoir.place span, and through it every node's, are its children.
        if tracing.tracer() is None:
            response: Response = await call_next(request)
            return response
        with tracing.Traced(f"{request.method} {request.url.path}",
                            parent=dict(request.headers)) as traced:  # fmt: skip
            response = await call_next(request)
            route = getattr(request.scope.get("route"), "path", None)
            if route is not None:
                traced.span.update_name(f"{request.method} {route}")
                traced.span.set_attribute("http.route", route)
            traced.span.set_attribute("http.request.method", request.method)
            traced.span.set_attribute("http.response.status_code", response.status_code)
            return response

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        route = request.scope.get("route")
        template = getattr(route, "path", "unmatched")
        metrics.http_requests.labels(request.method, template, str(response.status_code)).inc()
        return response

    problems: dict[int | str, dict[str, Any]] = {
        code: {"model": ProblemOut, "content": {PROBLEM_JSON: {}}, "description": text}
        for code, text in (
            (409, "the nodes cannot take it; the detail says why"),
            (422, "a bad body, or an idempotency key reused with another body"),
            (503, "the broker connection is down, or the service is shutting down"),
            (504, "not placed in time"),
        )
    }

    @app.post(
        "/v1/reservations",
        status_code=201,
        responses={200: {"model": PlacementOut, "description": "a replay"}, **problems},
    )
    async def create_reservation(
        body: ReservationIn,
        request: Request,
        response: Response,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> PlacementOut:
        """Place a request. The ``Idempotency-Key`` header (or the body's ``request_id``)
        is its request id: 201 with the placement when this call placed it (or found it on
        the nodes); 200 with the same placement when this process already answered for
        that key; 422 when the key was given before with a different body."""
        service = service_of(request)
        key = idempotency_key if idempotency_key is not None else body.request_id
        if idempotency_key is not None and body.request_id not in (None, idempotency_key):
            raise Problem(
                422,
                "invalid request",
                "the Idempotency-Key header and the body's request_id differ",
                errors=[{"field": "header.Idempotency-Key", "message": "differs from request_id"}],
            )
        try:
            spec = body.to_placement_request(key, service.explain)
        except ValueError as error:  # InvalidRequest, or how the fields fit together
            field = getattr(error, "field", "")
            loc: tuple[str, ...] = ("body", *field.split(".")) if field else ("body",)
            if idempotency_key is not None and loc == ("body", "request_id"):
                loc = ("header", "Idempotency-Key")  # name the key where it came from
            message = getattr(error, "problem", str(error))
            raise Problem.of_validation_error([{"loc": loc, "msg": message}]) from None
        if key is not None:
            service.claim_key(key, body.fingerprint())
            if key in service.freeing:
                raise Problem(409, "being released", f"{key!r} is being released", request_id=key)
            recorded = service.placements.get(key)
            if recorded is not None:
                response.status_code = 200
                return PlacementOut.of(recorded)
        try:
            placement = await service.place(spec, timeout_s=body.timeout_s)
        except (PlacementError, RequestorClosed, BrokerError, Problem) as error:
            if key is not None and key not in service.placements:
                # nothing is held under the key: let it be used again, for any body
                service.fingerprints.pop(key, None)
            if isinstance(error, PlacementError) and service.closing:
                # abandoned by the shutdown, not refused by the nodes: retry elsewhere
                problem = Problem.of_placement_error(error)
                raise Problem(503, "shutting down", problem.detail, **problem.extensions) from None
            raise
        return PlacementOut.of(placement)

    @app.get(
        "/v1/reservations/{request_id}",
        responses={404: {"model": ProblemOut, "description": "not placed by this process"}},
    )
    async def get_reservation(request_id: str, request: Request) -> PlacementOut:
        """A placement this service process made and has not released."""
        placement = service_of(request).placements.get(request_id)
        if placement is None:
            raise Problem(404, "no such reservation", f"this service holds no {request_id!r}")
        return PlacementOut.of(placement)

    @app.delete(
        "/v1/reservations/{request_id}",
        status_code=204,
        responses={404: {"model": ProblemOut, "description": "not placed by this process"}},
    )
    async def delete_reservation(request_id: str, request: Request) -> Response:
        """Release a placement (its instances are gone): 204 once every node confirms."""
        await service_of(request).release(request_id)
        return Response(status_code=204)

    @app.get("/v1/nodes")
    async def list_nodes(
        request: Request,
        wait_s: Annotated[float, Query(gt=0, le=30)] = DEFAULT_NODES_WAIT_S,
        expect_nodes: Annotated[int | None, Query(ge=1)] = None,
    ) -> list[NodeOut]:
        """Every live node, its tier and usage, from the ledger reports the nodes send
        within ``wait_s`` (sooner once ``expect_nodes`` have answered)."""
        snapshots = await service_of(request).nodes(wait_s, expect_nodes)
        return [NodeOut.of(snapshot) for snapshot in snapshots]

    @app.get("/healthz")
    async def healthz(request: Request) -> dict[str, Any]:
        """The process is alive (it says nothing of the broker: see ``/readyz``)."""
        service = getattr(request.app.state, "reservoir", None)
        in_flight = service.requestor.in_flight() if isinstance(service, ReservoirService) else 0
        return {"status": "ok", "in_flight": in_flight}

    @app.get("/readyz", responses={503: {"model": ProblemOut, "description": "not ready"}})
    async def readyz(request: Request) -> dict[str, str]:
        """200 only while the broker connection is up and the service is not closing."""
        service_of(request).check_ready()
        return {"status": "ready"}

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        """This app's metrics in the Prometheus text format."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


# -- the command -----------------------------------------------------------------------


def _stopped(signum: int, frame: FrameType | None) -> None:
    """Stop here with status 0: raised again by uvicorn once its graceful stop is done,
    or a stop before uvicorn took over the signals (the ``finally`` closes the broker)."""
    raise SystemExit(0)


@click.command()
@click.option(
    "--broker",
    "broker_url",
    envvar="RESERVOIR_BROKER_URL",
    default=None,
    help="Broker URL: memory://, amqp://user:pass@host:5672/vhost or kombu+amqp://... "
    "[env: RESERVOIR_BROKER_URL]",
)
@click.option(
    "--host",
    envvar="RESERVOIR_SERVE_HOST",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0 in a container) [env: RESERVOIR_SERVE_HOST].",
)
@click.option(
    "--port",
    envvar="RESERVOIR_SERVE_PORT",
    default=8000,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="TCP port to listen on [env: RESERVOIR_SERVE_PORT].",
)
@click.option(
    "--explain/--no-explain",
    envvar="RESERVOIR_SERVE_EXPLAIN",
    default=True,
    show_default=True,
    help="Ask nodes that cannot take a request why, so a 409 names the short resource "
    "[env: RESERVOIR_SERVE_EXPLAIN].",
)
@click.option(
    "--drain-timeout",
    "drain_timeout_s",
    envvar="RESERVOIR_SERVE_DRAIN_TIMEOUT",
    default=DEFAULT_DRAIN_TIMEOUT_S,
    show_default=True,
    type=click.FloatRange(0, 600),
    help="On SIGTERM, seconds requests in flight get to finish before they fail "
    "[env: RESERVOIR_SERVE_DRAIN_TIMEOUT].",
)
@click.option(
    "--access-log/--no-access-log",
    envvar="RESERVOIR_SERVE_ACCESS_LOG",
    default=False,
    show_default=True,
    help="Log every request [env: RESERVOIR_SERVE_ACCESS_LOG].",
)
def serve(
    broker_url: str | None,
    host: str,
    port: int,
    explain: bool,
    drain_timeout_s: float,
    access_log: bool,
) -> None:
    """Serve placements over HTTP: an ASGI app (FastAPI on uvicorn) embedding one requestor.

    \b
    POST   /v1/reservations        place (Idempotency-Key header or request_id: the key)
    GET    /v1/reservations/{id}   a placement this process made
    DELETE /v1/reservations/{id}   release it
    GET    /v1/nodes               every live node, its tier and usage
    GET    /healthz, /readyz       the process; the broker connection
    GET    /metrics                Prometheus metrics
    GET    /docs                   the OpenAPI documentation

    Errors are application/problem+json (RFC 9457). Settings come from RESERVOIR_*
    environment variables as for every command. SIGTERM stops accepting connections,
    lets requests in flight finish (--drain-timeout), closes the requestor and exits 0.
    """
    from reservoir.cli import _settings
    from reservoir.exit_status import EXIT_BROKER, EXIT_USAGE

    try:
        import uvicorn
    except ImportError:
        click.echo("reservoir serve needs the api extra: pip install 'reservoir[api]'", err=True)
        raise SystemExit(EXIT_USAGE) from None
    from reservoir.cli import _set_up_tracing, _shown_url
    from reservoir.logs import json_logs, say

    settings = _settings(broker_url=broker_url)
    _set_up_tracing("serve")
    try:
        listening = _listen(host, port)
    except OSError as error:
        click.echo(f"reservoir serve: cannot listen on {host}:{port}: {error}", err=True)
        raise SystemExit(EXIT_USAGE) from None
    from brokers import connect

    try:
        broker = connect(settings.broker_url)
    except BrokerError as error:
        listening.close()
        # the adapters' errors name the URL with its password masked
        click.echo(f"reservoir serve: cannot reach the broker: {error}", err=True)
        raise SystemExit(EXIT_BROKER) from None
    # (uvicorn does not say where it listens when it is handed the socket)
    shown = _shown_url(settings.broker_url)
    say(f"reservoir serve: listening on http://{host}:{port}, broker {shown}")
    # uvicorn handles SIGTERM and SIGINT itself (stop accepting, finish what is open, run
    # the lifespan's shutdown), then raises the signal again under the handlers it found:
    # with this one, a stop it completed ends in exit status 0, not death by the signal.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, _stopped)
    try:
        app = create_app(
            broker, settings=settings, explain=explain, drain_timeout_s=drain_timeout_s
        )
        if json_logs():
            # uvicorn's own handlers print text: let its lines reach ours instead
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
                logging.getLogger(name).setLevel(logging.INFO)
        config = uvicorn.Config(
            app,
            access_log=access_log,
            log_level="info",
            log_config=None if json_logs() else uvicorn.config.LOGGING_CONFIG,
            # uvicorn waits this long for open connections after SIGTERM; the lifespan
            # then drains the requestor's own work with the same allowance
            timeout_graceful_shutdown=int(drain_timeout_s) or None,
        )
        uvicorn.Server(config).run(sockets=[listening])
    finally:
        listening.close()
        broker.close()


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port``, bound here rather than by uvicorn so that a
    port in use is one line and exit status 2, not uvicorn's log and status 1."""
    family, kind, protocol, _name, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    )[0]
    listening = socket.socket(family, kind, protocol)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
    except BaseException:
        listening.close()
        raise
    listening.set_inheritable(True)
    return listening
