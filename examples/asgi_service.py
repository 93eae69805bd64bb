"""reservoir embedded in an API server of one's own: a small FastAPI app that places
servers, built on the lifespan helper of ``reservoir serve``.

:func:`reservoir.service.reservoir_lifespan` does the work: it opens ONE shared
:class:`~reservoir.Requestor` for the app's lifetime (thread-safe, any number of
concurrent requests over one reply queue, learning the offer latency that keeps tier
widening short), puts a :class:`~reservoir.service.ReservoirService` in
``app.state.reservoir``, runs every placement to its end even when the client goes away
(so the retry with the same key finds it), and on shutdown lets placements in flight
finish before closing the requestor. This app adds only its own HTTP shapes: ``/servers``
in its own words, and errors as plain JSON. For the whole service (problem+json errors,
``/readyz``, ``/metrics``, ``/v1/nodes``, the dashboard, a reused key with another body
refused), run ``reservoir serve`` itself, or include ``reservoir.service.router`` in the
app (docs/http-api.md, "The service in your own app").

What it shows:

- **Idempotency through the request id.** The ``Idempotency-Key`` header (or the body's
  ``request_id``) becomes the reservoir request id: a client that retries after a timeout
  or a dropped connection gets the same placement back, not a second one, even through
  another replica of this service (the nodes answer for the ids they hold). The same key
  with another shape is refused by the requestor (409). A multi-tenant service would
  prefix the key with the tenant.
- **The event loop never blocks.** The service awaits the requestor's futures; the
  protocol runs on the requestor's own threads.

Endpoints: ``POST /servers`` (201 with the placement; 409 with the explanation when the
nodes cannot take it; 504 when the request times out; 422 for a bad body),
``DELETE /servers/{request_id}`` (204, or 404 for an id no node holds, whichever replica
placed it) and ``GET /healthz`` (the requestor's in-flight count).

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
pass ``create_app`` the :class:`~reservoir.brokers.inprocess.InProcessBroker` the node agents use.
Each uvicorn worker process gets its own requestor, as it should.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Literal

from fastapi import FastAPI, Header, HTTPException, Request, Response, status
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
    RequestorClosed,
    Settings,
)
from reservoir.protocol.messages import GroupPolicy
from reservoir.service import Identifier, Problem, ReservoirService, reservoir_lifespan

__all__ = [
    "AllocationOut",
    "Health",
    "PlacementFailure",
    "PlacementOut",
    "ServerRequest",
    "app",
    "create_app",
]


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
    #: placements in this process's cache (made here, not freed or found gone since)
    placements: int


def current_service(request: Request) -> ReservoirService:
    service = getattr(request.app.state, "reservoir", None)
    if not isinstance(service, ReservoirService):
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the requestor is not open")
    return service


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
        async with reservoir_lifespan(app, broker, settings=settings, explain=explain):
            yield  # every request shares app.state.reservoir and its one requestor

    app = FastAPI(title="reservoir placement service", lifespan=lifespan)

    @app.exception_handler(PlacementError)
    async def not_placed(request: Request, error: PlacementError) -> JSONResponse:
        timed_out = isinstance(error, PlacementTimeout)
        code = status.HTTP_504_GATEWAY_TIMEOUT if timed_out else status.HTTP_409_CONFLICT
        return JSONResponse(PlacementFailure.of(error).model_dump(), status_code=code)

    @app.exception_handler(RequestorClosed)
    async def closing(request: Request, error: RequestorClosed) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=503)

    @app.exception_handler(Problem)
    async def problem(request: Request, error: Problem) -> JSONResponse:
        # the helper's errors (no such placement, shutting down), in this app's words
        return JSONResponse({"detail": error.detail}, status_code=error.status)

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
        request: Request,
        idempotency_key: Annotated[Identifier | None, Header()] = None,
    ) -> PlacementOut:
        service = current_service(request)
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
        responses={404: {"description": "no node holds such a placement"}},
    )
    async def delete_servers(request_id: str, request: Request) -> Response:
        # whichever process placed it: the nodes are asked what they hold of the id
        try:
            await current_service(request).release(request_id)
        except FreeIncomplete as error:
            raise HTTPException(status.HTTP_502_BAD_GATEWAY, str(error)) from error
        except ValueError as error:  # an id no node would accept
            raise HTTPException(422, str(error)) from error
        return Response(status_code=status.HTTP_204_NO_CONTENT)

    @app.get("/healthz")
    async def healthz(request: Request) -> Health:
        service = current_service(request)
        return Health(in_flight=service.requestor.in_flight(), placements=len(service.placements))

    return app


app = create_app()
