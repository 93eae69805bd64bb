"""reservoir embedded in an API server: a small FastAPI service that places servers.

For the whole service (problem+json errors, ``/readyz`` that follows the broker
connection, ``/metrics``, ``/v1/nodes``, the key-reused-with-another-body check), run
``reservoir serve`` or build on :func:`reservoir.serve.create_app`; its lifespan helper
:func:`reservoir.serve.reservoir_lifespan` puts the same shared requestor in any FastAPI
or Starlette app. This example stays small to show the design underneath.

What it shows:

- **One Requestor per process.** A :class:`~reservoir.Requestor` is thread-safe and runs
  any number of concurrent requests over one broker endpoint (one reply queue, one
  connection), and it learns the offer latency that keeps tier widening short. So the app
  opens one in its lifespan, every request shares it, and shutdown closes it. A requestor
  per HTTP request would open a queue per request and start every placement cold.
- **The event loop never blocks.** Handlers ``await requestor.reserve_async(...)`` and
  ``await requestor.release_async(...)``: the protocol runs on the requestor's own
  scheduler thread while the handler awaits a future. Opening and closing the requestor
  (which may connect to RabbitMQ) runs in a worker thread.
- **Idempotency through the request id.** The ``Idempotency-Key`` header (or the body's
  ``request_id``) becomes the reservoir request id. A client that retries after a timeout
  or a dropped connection gets the same placement back, not a second one, even through
  another replica of this service: the nodes themselves answer for the ids they hold. A
  multi-tenant service would prefix the key with the tenant so two tenants' keys never
  meet.
- **A placement, once started, runs to its end.** If the client goes away mid-request the
  placement still completes and is recorded (the handler's await is shielded), so the
  retry with the same key finds it. (Shielding also keeps a cancelled await from
  cancelling the requestor's own future, which other waiters on the same id share.)

Endpoints: ``POST /servers`` (201 with the placement; 409 with the explanation when the
nodes cannot take it; 504 when the request times out; 422 for a bad body),
``DELETE /servers/{request_id}`` (204, or 404 for an id this process did not place) and
``GET /healthz`` (the requestor's in-flight count).

Running it::

    python -m pip install -e '.[api]'
    export RESERVOIR_BROKER_URL=amqp://guest:guest@127.0.0.1:5672/
    reservoir node --name n1 --vcpus 16 --memory-mb 65536 &
    reservoir node --name n2 --vcpus 16 --memory-mb 65536 &
    python -m uvicorn examples.asgi_service:app
    curl -sX POST localhost:8000/servers -H 'Idempotency-Key: order-1' \\
        -H 'Content-Type: application/json' -d '{"vcpus": 2, "memory_mb": 4096}'
    curl -sX DELETE localhost:8000/servers/order-1

The module-level ``app`` reads ``RESERVOIR_BROKER_URL`` (and the other ``RESERVOIR_*``
settings). Without it the broker is ``memory://``: a fresh in-process broker that no node
shares, so every ``POST`` answers 409. Nodes and the service must meet on one broker: on
RabbitMQ, run ``reservoir node`` processes alongside as above; in one process (tests),
pass ``create_app`` the :class:`~brokers.inprocess.InProcessBroker` the node agents use.
Each uvicorn worker process gets its own requestor, as it should.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from reservoir import (
    Broker,
    FreeIncomplete,
    GroupSpec,
    Placement,
    PlacementError,
    PlacementRequest,
    PlacementTimeout,
    Requestor,
    RequestorClosed,
    Settings,
)
from reservoir.protocol.messages import GroupPolicy, Identifier

__all__ = [
    "AllocationOut",
    "Health",
    "PlacementFailure",
    "PlacementOut",
    "ServerRequest",
    "app",
    "create_app",
]

T = TypeVar("T")


# -- the HTTP shapes -------------------------------------------------------------------


class ServerRequest(BaseModel):
    """``POST /servers``: what each server needs, and how many."""

    model_config = ConfigDict(extra="forbid")

    vcpus: int = Field(ge=1, le=4096)
    memory_mb: int = Field(ge=1, le=2**40)
    disk_gb: int | None = Field(default=None, ge=1, le=2**40)
    count: int = Field(default=1, ge=1, le=1000)
    #: a server group the servers join; ``policy`` defaults to anti-affinity
    group: Identifier | None = None
    policy: GroupPolicy | None = None
    #: idempotency key; the ``Idempotency-Key`` header is the usual way to give it
    request_id: Identifier | None = None

    @model_validator(mode="after")
    def _policy_needs_group(self) -> ServerRequest:
        if self.policy is not None and self.group is None:
            raise ValueError("policy needs a group")
        return self

    def to_placement_request(self, request_id: str | None, explain: bool) -> PlacementRequest:
        group = None
        if self.group is not None:
            group = GroupSpec(name=self.group, policy=self.policy or "anti-affinity")
        resources = {"VCPU": self.vcpus, "MEMORY_MB": self.memory_mb}
        if self.disk_gb is not None:
            resources["DISK_GB"] = self.disk_gb
        return PlacementRequest(
            resources=resources,
            count=self.count,
            group=group,
            explain=explain,
            request_id=request_id,
        )


class AllocationOut(BaseModel):
    node: str
    allocation_id: str
    resources: dict[str, int]


class PlacementOut(BaseModel):
    request_id: str
    allocations: list[AllocationOut]
    requested: int
    tiers_tried: list[int]
    elapsed_s: float

    @classmethod
    def of(cls, placement: Placement) -> PlacementOut:
        return cls(
            request_id=placement.request_id,
            allocations=[
                AllocationOut(
                    node=a.node, allocation_id=a.allocation_id, resources=dict(a.resources)
                )
                for a in placement.allocations
            ],
            requested=placement.requested,
            tiers_tried=list(placement.tiers_tried),
            elapsed_s=placement.elapsed_s,
        )


class PlacementFailure(BaseModel):
    """409 or 504: why nothing was placed, as the requestor saw it."""

    #: the whole explanation in one line ("... tiers tried: 10%, ...; VCPU exhausted on ...")
    detail: str
    request_id: str
    tiers_tried: list[int]
    offers_received: int
    #: reason -> how many nodes gave it
    reasons: dict[str, int]
    note: str

    @classmethod
    def of(cls, error: PlacementError) -> PlacementFailure:
        explanation = error.explanation
        return cls(
            detail=str(explanation),
            request_id=explanation.request_id,
            tiers_tried=list(explanation.tiers_tried),
            offers_received=explanation.offers_received,
            reasons=dict(explanation.reasons),
            note=explanation.note,
        )


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    #: requests the requestor is placing right now
    in_flight: int
    #: placements this process made and has not freed
    placements: int


# -- the service -----------------------------------------------------------------------


class PlacementService:
    """The shared requestor, and the placements this process made, by request id.

    The placements live in memory to keep the example small: a real service keeps them in
    its database, next to the servers they belong to, so that a restart or another replica
    can still free them. Only the event loop's thread touches them, so there is no lock.
    """

    def __init__(self, requestor: Requestor, *, explain: bool) -> None:
        self.requestor = requestor
        self.explain = explain
        self.placements: dict[str, Placement] = {}
        self.freeing: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def place(self, spec: PlacementRequest) -> Placement:
        """Place ``spec`` and list the placement, even should the caller go away."""
        return await self._to_the_end(self._place(spec))

    async def free(self, placement: Placement) -> None:
        """Free a placement this process no longer lists, even should the caller go away;
        listed again if a node never confirms, so that a retried ``DELETE`` can finish."""
        await self._to_the_end(self._free(placement))

    async def _place(self, spec: PlacementRequest) -> Placement:
        placement = await self.requestor.reserve_async(spec)
        self.placements[placement.request_id] = placement
        return placement

    async def _free(self, placement: Placement) -> None:
        self.freeing.add(placement.request_id)
        try:
            await self.requestor.release_async(placement)
        except FreeIncomplete:
            self.placements[placement.request_id] = placement
            raise
        finally:
            self.freeing.discard(placement.request_id)

    async def _to_the_end(self, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` in a task of its own that a cancelled caller does not cancel."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return await asyncio.shield(task)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: nobody may be left to await it


def current_service(request: Request) -> PlacementService:
    service = getattr(request.app.state, "service", None)
    if not isinstance(service, PlacementService):
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the requestor is not open")
    return service


Service = Annotated[PlacementService, Depends(current_service)]


# -- the app ---------------------------------------------------------------------------


def create_app(
    broker: Broker | str | None = None,
    *,
    settings: Settings | None = None,
    explain: bool = True,
) -> FastAPI:
    """The service, placing through ``broker``: a shared :class:`~reservoir.Broker` (left
    open), a URL, or None for ``RESERVOIR_BROKER_URL`` (a broker opened here is closed on
    shutdown). ``explain`` asks nodes that cannot take a request to say why, so every 409
    counts the reasons (and an impossible request fails in milliseconds, not after each
    tier's wait), at the cost of one more message per such node."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        requestor = await asyncio.to_thread(Requestor, broker, settings=settings)
        app.state.service = PlacementService(requestor, explain=explain)
        try:
            yield  # every request shares app.state.service.requestor
        finally:
            app.state.service = None
            await asyncio.to_thread(requestor.close)  # fails what is in flight, lets go

    app = FastAPI(title="reservoir placement service", lifespan=lifespan)

    @app.exception_handler(PlacementError)
    async def not_placed(request: Request, error: PlacementError) -> JSONResponse:
        timed_out = isinstance(error, PlacementTimeout)
        code = status.HTTP_504_GATEWAY_TIMEOUT if timed_out else status.HTTP_409_CONFLICT
        return JSONResponse(PlacementFailure.of(error).model_dump(), status_code=code)

    @app.exception_handler(RequestorClosed)
    async def closing(request: Request, error: RequestorClosed) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=503)

    @app.post(
        "/servers",
        status_code=status.HTTP_201_CREATED,
        responses={
            409: {"model": PlacementFailure, "description": "the nodes cannot take it"},
            504: {"model": PlacementFailure, "description": "not placed in time"},
        },
    )
    async def create_servers(
        body: ServerRequest,
        service: Service,
        idempotency_key: Annotated[Identifier | None, Header()] = None,
    ) -> PlacementOut:
        if idempotency_key and body.request_id and idempotency_key != body.request_id:
            raise HTTPException(
                422,
                "the Idempotency-Key header and the body's request_id differ",
            )
        request_id = idempotency_key or body.request_id
        if request_id is not None and request_id in service.freeing:
            raise HTTPException(status.HTTP_409_CONFLICT, f"{request_id} is being deleted")
        spec = body.to_placement_request(request_id, service.explain)
        return PlacementOut.of(await service.place(spec))

    @app.delete(
        "/servers/{request_id}",
        status_code=status.HTTP_204_NO_CONTENT,
        responses={404: {"description": "this service holds no such placement"}},
    )
    async def delete_servers(request_id: str, service: Service) -> Response:
        placement = service.placements.pop(request_id, None)
        if placement is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no placement {request_id!r}")
        try:
            await service.free(placement)
        except FreeIncomplete as error:
            raise HTTPException(status.HTTP_502_BAD_GATEWAY, str(error)) from error
        return Response(status_code=status.HTTP_204_NO_CONTENT)

    @app.get("/healthz")
    async def healthz(service: Service) -> Health:
        return Health(in_flight=service.requestor.in_flight(), placements=len(service.placements))

    return app


app = create_app()
