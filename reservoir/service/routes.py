"""The placement service's API routes, as one :class:`~fastapi.APIRouter`: the
reservations, ``/v1/nodes``, the probes and ``/metrics`` (a user's app includes them with
the dashboard as :data:`reservoir.service.router`, with
:func:`~reservoir.service.reservoir_lifespan` in its lifespan).

Each route finds the service at ``request.app.state.reservoir`` (the lifespan puts it
there) and the app's metrics, when it keeps them, at ``request.app.state.metrics``. Errors
are raised as :class:`~reservoir.service.shapes.Problem` (or the library's own
exceptions); the routes' class, :class:`~reservoir.service.problems.ProblemRoute`, turns
them into problem+json in whichever app includes them.

(No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations.)
"""

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from reservoir.broker import BrokerError
from reservoir.protocol.messages import InvalidField
from reservoir.protocol.placement import Holdings, Placement, PlacementError
from reservoir.runtime.checked_request import CheckedRequest
from reservoir.runtime.output_reader import OutputPiece, OutputReader, OutputUnreachable
from reservoir.runtime.requestor import RequestorClosed
from reservoir.service.problems import ProblemRoute
from reservoir.service.reservoir_service import ReservoirService
from reservoir.service.shapes import (
    PROBLEM_JSON,
    NodeOut,
    PlacementOut,
    Problem,
    ProblemOut,
    ReservationIn,
)

__all__ = ["DEFAULT_NODES_WAIT_S", "router", "service_of"]

DEFAULT_NODES_WAIT_S = 1.0
#: the longest a node listing waits for the nodes' ledgers, and the most it waits for
MAX_NODES_WAIT_S = 30.0
MAX_EXPECT_NODES = 1_000_000

router = APIRouter(route_class=ProblemRoute)

#: the problems the placement routes answer with, for the OpenAPI document
PLACEMENT_PROBLEMS: dict[int | str, dict[str, Any]] = {
    code: {"model": ProblemOut, "content": {PROBLEM_JSON: {}}, "description": text}
    for code, text in (
        (409, "the nodes cannot take it; the detail says why"),
        (422, "a bad body, or an idempotency key reused with another body"),
        (503, "the broker connection is down, or the service is shutting down"),
        (504, "not placed in time"),
    )
}


def service_of(request: Request) -> ReservoirService:
    """The app's open service, or a 503 while the lifespan has not opened it."""
    service = getattr(request.app.state, "reservoir", None)
    if not isinstance(service, ReservoirService):
        raise Problem(503, "not started", "the requestor is not open")
    return service


def placement_response(out: PlacementOut, status_code: int = 200, **headers: str) -> Response:
    """``out`` as the answer, serialized once: returned as a ``Response``, FastAPI does
    not validate it against the route's model again (the routes declare the model, for
    the OpenAPI document)."""
    return Response(
        out.model_dump_json(), status_code=status_code, media_type="application/json",
        headers=headers or None,
    )  # fmt: skip


def _location(request: Request, request_id: str) -> str:
    """The reservation's URL, from the POST route's own path (any prefix the router was
    included under is in it): ``url_for`` would search every route for it."""
    route = request.scope.get("route")
    path = getattr(route, "path", "/v1/reservations").lstrip("/")
    return f"{request.base_url}{path}/{quote(request_id, safe='')}"


@router.post(
    "/v1/reservations",
    status_code=201,
    response_model=PlacementOut,
    responses={
        201: {
            "description": "placed; Location is the reservation's URL",
            "headers": {"Location": {"schema": {"type": "string", "format": "uri"}}},
        },
        200: {"model": PlacementOut, "description": "a replay"},
        **PLACEMENT_PROBLEMS,
    },
)
async def create_reservation(
    body: ReservationIn,
    request: Request,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> Response:
    """Place a request. The ``Idempotency-Key`` header (or the body's ``request_id``)
    is its request id: 201 with the placement when this call placed it (or found it on
    the nodes); 200 with the same placement when this process already answered for
    that key and the nodes still hold it; 422 when the key was given to this process
    before with a different body (and its placement is still held)."""
    service = service_of(request)
    key = _idempotency_key(body, idempotency_key)
    request.state.request_id = key  # for the access line
    spec = _placement_request(body, key, service.explain, key_in_header=idempotency_key is not None)
    if key is not None:
        replayed = await _replay(service, key, body)
        if replayed is not None:
            return placement_response(PlacementOut.of(replayed))
    placement = await _place(service, spec, key, body.timeout_s)
    request.state.request_id = placement.request_id
    return placement_response(
        PlacementOut.of(placement), 201, Location=_location(request, placement.request_id)
    )


def _idempotency_key(body: ReservationIn, header: str | None) -> str | None:
    """The request id: the ``Idempotency-Key`` header, else the body's ``request_id``."""
    if header is not None and body.request_id not in (None, header):
        raise Problem(
            422,
            "invalid request",
            "the Idempotency-Key header and the body's request_id differ",
            errors=[{"field": "header.Idempotency-Key", "message": "differs from request_id"}],
        )
    return header if header is not None else body.request_id


def _placement_request(
    body: ReservationIn, key: str | None, explain: bool, *, key_in_header: bool
) -> CheckedRequest:
    """The protocol's request, or a 422 naming the field the protocol refuses."""
    try:
        return body.to_placement_request(key, explain)
    except ValueError as error:  # InvalidRequest, or how the fields fit together
        field = getattr(error, "field", "")
        loc: tuple[str, ...] = ("body", *field.split(".")) if field else ("body",)
        if key_in_header and loc == ("body", "request_id"):
            loc = ("header", "Idempotency-Key")  # name the key where it came from
        message = getattr(error, "problem", str(error))
        raise Problem.of_validation_error([{"loc": loc, "msg": message}]) from None


async def _replay(service: ReservoirService, key: str, body: ReservationIn) -> Placement | None:
    """The placement this process already answered with under ``key``, if the nodes still
    hold it; a 422 when the key came before with another body, a 409 while it is being
    released."""
    if key in service.placements and key not in service.freeing:
        # Answered here before: the nodes may have let it go since (released through
        # another replica), and then the key is free again. Asking them costs a lookup,
        # over once they have reported the placement's allocations.
        await service.find(key)  # the key is checked already: a valid id
    service.claim_key(key, body.fingerprint())
    if key in service.freeing:
        raise Problem(409, "being released", f"{key!r} is being released", request_id=key)
    return service.placements.get(key)


async def _place(
    service: ReservoirService, spec: CheckedRequest, key: str | None, timeout_s: float | None
) -> Placement:
    try:
        return await service.place(spec, timeout_s=timeout_s)
    except (PlacementError, RequestorClosed, BrokerError, Problem) as error:
        if key is not None and key not in service.placements:
            # nothing is held under the key: let it be used again, for any body
            service.fingerprints.pop(key, None)
        if isinstance(error, PlacementError) and service.closing:
            # abandoned by the shutdown, not refused by the nodes: retry elsewhere
            problem = Problem.of_placement_error(error)
            raise Problem(503, "shutting down", problem.detail, **problem.extensions) from None
        raise


#: the problems GET and DELETE of a reservation answer with, for the OpenAPI document
RESERVATION_PROBLEMS: dict[int | str, dict[str, Any]] = {
    code: {"model": ProblemOut, "content": {PROBLEM_JSON: {}}, "description": text}
    for code, text in (
        (404, "no node holds anything of the id"),
        (422, "an id no node would accept"),
        (
            503,
            "the broker connection is down, the service is shutting down, or what the "
            "nodes hold of the id is not known yet (Retry-After)",
        ),
    )
}


async def _find(service: ReservoirService, request_id: str, where: str) -> Holdings:
    """What the nodes hold of ``request_id``, or a 422 naming ``where`` the id came from."""
    try:
        return await service.find(request_id)
    except InvalidField as error:
        raise Problem.of_validation_error(
            [{"loc": tuple(where.split(".")), "msg": error.problem}]
        ) from None


@router.get(
    "/v1/reservations/{request_id}", response_model=PlacementOut, responses=RESERVATION_PROBLEMS
)
async def get_reservation(request_id: str, request: Request) -> Response:
    """The placement the nodes hold under ``request_id``, whichever replica placed it
    (asked of the nodes: one lookup on the id's topic, answered by each holder), with
    the state of its tasks if it carried one (``tasks``; a task that ended freed its
    allocation, so a request whose tasks all ended shows them and no allocation). 503
    with Retry-After while that is not known (a holder slow to answer, or the id still
    being placed), never a 404 for an id a node holds."""
    holdings = await _find(service_of(request), request_id, "path.request_id")
    if not holdings.held:
        raise Problem(404, "no such reservation", f"no node holds {request_id!r}")
    return placement_response(
        PlacementOut.of(holdings.placement, list(holdings.tasks), request_id=request_id)
    )


@router.get(
    "/v1/reservations/{request_id}/logs",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/plain": {}},
            "description": "the output, as the task wrote it (streamed while following)",
        },
        **RESERVATION_PROBLEMS,
    },
)
async def get_reservation_logs(
    request_id: str,
    request: Request,
    stream: Literal["stdout", "stderr"] = "stdout",
    follow: bool = False,
    allocation: Annotated[str | None, Query(max_length=255)] = None,
) -> StreamingResponse:
    """The output of the tasks of ``request_id`` (``stream``: ``stdout`` or ``stderr``),
    read from their nodes, which keep it for a while after the tasks end: what they hold
    now, or with ``follow``, streamed as it is written until every task ended. Only
    ``allocation``'s instance when given; with several, each line is prefixed with its
    instance. 404 when no node holds a task of the id."""
    service = service_of(request)
    holdings = await _find(service, request_id, "path.request_id")
    where = sorted({(t.sender, t.allocation_id) for t in holdings.tasks})
    if allocation is not None:
        where = [(node, a) for node, a in where if a == allocation]
    if not where:
        raise Problem(404, "no such task", f"no node holds a task of {request_id!r}"
                      + (f" on allocation {allocation!r}" if allocation else ""))  # fmt: skip
    readers = service.requestor.output_readers(
        request_id, stream=stream, follow=follow, locations=where
    )
    return StreamingResponse(
        _output_body(readers, prefixed=len(readers) > 1), media_type="text/plain"
    )


async def _output_body(readers: list[OutputReader], *, prefixed: bool) -> AsyncIterator[bytes]:
    """The readers' pieces as they come (each reader's in order), lines prefixed with the
    instance when ``prefixed``; a note for bytes no longer kept, or a node gone."""
    pieces: asyncio.Queue[OutputPiece | str | None] = asyncio.Queue()

    async def pump(reader: OutputReader) -> None:
        try:
            async for piece in reader:
                await pieces.put(piece)
        except OutputUnreachable as error:
            await pieces.put(f"[reservoir: {error}]\n")
        finally:
            await pieces.put(None)

    tasks = [asyncio.create_task(pump(reader)) for reader in readers]
    partial: dict[str, bytes] = {}
    running = len(tasks)
    try:
        while running:
            item = await pieces.get()
            if item is None:
                running -= 1
            elif isinstance(item, str):
                yield item.encode()
            else:
                if item.skipped:
                    yield f"[reservoir: {item.skipped} byte(s) no longer kept]\n".encode()
                if not prefixed:
                    yield item.data
                    continue
                *lines, partial[item.allocation_id] = (
                    partial.get(item.allocation_id, b"") + item.data
                ).split(b"\n")
                prefix = f"[{item.allocation_id}] ".encode()
                yield b"".join(prefix + line + b"\n" for line in lines)
        for allocation_id, rest in partial.items():
            if rest:
                yield f"[{allocation_id}] ".encode() + rest + b"\n"
    finally:
        for reader in readers:
            reader.stop()
        for task in tasks:
            task.cancel()


@router.delete(
    "/v1/reservations/{request_id}",
    status_code=204,
    responses={
        **RESERVATION_PROBLEMS,
        502: {"model": ProblemOut, "description": "a node did not confirm the free"},
    },
)
async def delete_reservation(request_id: str, request: Request) -> Response:
    """Release what the nodes hold under ``request_id`` (its instances are gone),
    whichever replica placed it: 204 once every holder confirms."""
    try:
        await service_of(request).release(request_id)
    except InvalidField as error:
        raise Problem.of_validation_error(
            [{"loc": ("path", "request_id"), "msg": error.problem}]
        ) from None
    return Response(status_code=204)


@router.get("/v1/nodes")
async def list_nodes(
    request: Request,
    wait_s: Annotated[float, Query(gt=0, le=MAX_NODES_WAIT_S)] = DEFAULT_NODES_WAIT_S,
    expect_nodes: Annotated[int | None, Query(ge=1, le=MAX_EXPECT_NODES)] = None,
) -> list[NodeOut]:
    """Every live node, its tier and usage, from the ledger reports the nodes send
    within ``wait_s`` (sooner once ``expect_nodes`` have answered). The wait is on a
    thread of the listings' own (at most 8 gather at once; more wait their turn), so it
    holds up no other request."""
    snapshots = await service_of(request).nodes(wait_s, expect_nodes)
    return [NodeOut.of(snapshot) for snapshot in snapshots]


@router.get("/healthz")
async def healthz(request: Request) -> dict[str, Any]:
    """The process is alive (it says nothing of the broker: see ``/readyz``)."""
    service = getattr(request.app.state, "reservoir", None)
    in_flight = service.requestor.in_flight() if isinstance(service, ReservoirService) else 0
    return {"status": "ok", "in_flight": in_flight}


@router.get("/readyz", responses={503: {"model": ProblemOut, "description": "not ready"}})
async def readyz(request: Request) -> dict[str, str]:
    """200 only while the broker connection is up and the service is not closing."""
    service_of(request).check_ready()
    return {"status": "ready"}


@router.get("/metrics", response_class=Response)
async def prometheus_metrics(request: Request) -> Response:
    """This app's metrics in the Prometheus text format."""
    from reservoir.service.metrics import CONTENT_TYPE_LATEST

    metrics = getattr(request.app.state, "metrics", None)
    if metrics is None:
        raise Problem(404, "not found", "this app keeps no metrics")
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
