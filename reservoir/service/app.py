"""The app of ``reservoir serve``: FastAPI with the service's routes, its lifespan, its
errors as problem+json and its middleware (traces, request counts).

A user's own app takes what it needs instead: the routes
(:data:`reservoir.service.routes.router`), :func:`add_problem_handlers` and
:func:`~reservoir.service.reservoir_lifespan`. FastAPI comes with the ``api`` extra; this
module is imported only when an app is built.
"""

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from brokers import BrokerUrl
from reservoir.broker import Broker, BrokerError
from reservoir.observe import tracing
from reservoir.protocol.placement import PlacementError
from reservoir.runtime.requestor import FreeIncomplete, RequestorClosed
from reservoir.runtime.settings import Settings
from reservoir.service import dashboard
from reservoir.service.lifespan import DEFAULT_DRAIN_TIMEOUT_S, reservoir_lifespan
from reservoir.service.metrics import ServiceMetrics
from reservoir.service.routes import router
from reservoir.service.shapes import DEFAULT_MAX_BODY_BYTES, PROBLEM_JSON, Problem, ProblemOut

__all__ = ["BodyLimit", "add_problem_handlers", "create_app", "problem_openapi"]

#: one line per request with ``--access-log`` (its facts as fields in JSON logs)
access_log = logging.getLogger("reservoir.serve.access")


def create_app(
    broker: Broker | BrokerUrl | str | None = None,
    *,
    settings: Settings | None = None,
    explain: bool = True,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The app of ``reservoir serve``, placing through ``broker`` (as in
    :func:`~reservoir.service.reservoir_lifespan`). Its metrics are in a registry of its
    own (``app.state.metrics``). A request body over ``max_body_bytes`` is a 413, and
    one that is not JSON a 415, before it is read (:class:`BodyLimit`). Each request is
    logged on ``reservoir.serve.access`` while ``app.state.access_log`` is true. Its
    live dashboard is at ``/ui`` (:mod:`.dashboard`)."""
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
    app.state.access_log = False
    add_problem_handlers(app)
    # the innermost first: the requests it refuses are traced, counted and logged too
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    app.middleware("http")(trace_requests)
    app.middleware("http")(count_requests)
    app.middleware("http")(log_requests)
    app.include_router(router)
    app.include_router(dashboard.router)  # /ui, / redirecting to it, /v1/activity
    app.openapi = lambda: problem_openapi(app)  # type: ignore[method-assign]
    return app


def problem_response(problem: Problem) -> JSONResponse:
    return JSONResponse(
        problem.body(),
        status_code=problem.status,
        media_type=PROBLEM_JSON,
        headers=problem.headers or None,
    )


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: the media types a request body may have: JSON (``application/json`` or ``+json``)
_JSON = ("application/json",)


class BodyLimit:
    """Refuse a request body over ``max_body_bytes`` with a 413 problem before it is
    read whole: at once when its Content-Length says so, else as soon as the bytes
    streamed in (chunked) pass the limit. And a body that is not JSON (by its
    Content-Type) with a 415 problem, unread. An ASGI middleware: it sees the bytes
    before FastAPI gathers them."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        length = headers.get("content-length")
        has_body = (length is not None and length.strip() != "0") or (
            "transfer-encoding" in headers
        )
        refused: Problem | None = None
        if has_body and not _is_json(headers.get("content-type", "")):
            given = headers.get("content-type") or "none"
            refused = Problem(
                415,
                "unsupported media type",
                f"the body must be application/json, not {given}",
            )
        elif length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
            refused = self._too_large()
        if refused is not None:
            await problem_response(refused)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    # raised where the route reads the body: answered as problem+json
                    raise HTTPException(413, self._too_large().detail)
            return message

        await self.app(scope, counted, send)

    def _too_large(self) -> Problem:
        return Problem(
            413,
            "request body too large",
            f"the body is larger than {self.max_body_bytes} bytes (--max-body-bytes)",
        )


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type in _JSON or media_type.endswith("+json")


def _problem_of(error: Exception) -> Problem:
    """The problem+json answer to an error a route let through."""
    if isinstance(error, Problem):
        return error
    if isinstance(error, PlacementError):
        return Problem.of_placement_error(error)
    if isinstance(error, RequestorClosed):
        return Problem(503, "shutting down", str(error))
    if isinstance(error, BrokerError):
        return Problem(503, "broker unavailable", str(error))
    if isinstance(error, FreeIncomplete):
        return Problem(502, "release incomplete", str(error))
    if isinstance(error, RequestValidationError):
        return Problem.of_validation_error(list(error.errors()))
    if isinstance(error, HTTPException):
        title = {
            404: "not found",
            405: "method not allowed",
            413: "request body too large",
        }.get(error.status_code, "error")
        return Problem(
            error.status_code, title, str(error.detail), headers=dict(error.headers or {})
        )
    raise TypeError(f"no problem+json for {type(error).__name__}")  # pragma: no cover


#: the errors answered as problem+json, each by :func:`_problem_of`
PROBLEM_ERRORS: tuple[type[Exception], ...] = (
    Problem,
    PlacementError,
    RequestorClosed,
    BrokerError,
    FreeIncomplete,
    RequestValidationError,
    HTTPException,
)


async def on_error(request: Request, error: Exception) -> JSONResponse:
    problem = _problem_of(error)
    if problem.status == 405:
        # every method the path takes (Starlette names only those of the first route
        # matching it: GET, where DELETE is another route on the same path)
        allowed = _methods_of(request)
        problem.headers["Allow"] = ", ".join(allowed)
        problem.detail = f"{request.method} {request.url.path}: allowed are {', '.join(allowed)}"
    return problem_response(problem)


#: the methods a 405's Allow header may name
_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _methods_of(request: Request) -> list[str]:
    """The methods some route takes at the request's path (each tried, as the routes
    are FastAPI's to describe: an included router is one route of many methods)."""
    return [
        method
        for method in _METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] is Match.FULL
            for route in request.app.router.routes
        )
    ]


def _flat_routes(routes: Any) -> Iterator[Any]:
    """``routes`` and, in place of a router included in them (FastAPI's own wrapper, or
    a mount), the routes it holds."""
    for route in routes:
        inner = getattr(route, "routes", None)
        if inner is None:
            inner = getattr(getattr(route, "original_router", None), "routes", None)
        if inner is not None:
            yield from _flat_routes(inner)
        else:
            yield route


def add_problem_handlers(app: FastAPI) -> None:
    """Answer the service's errors, validation and HTTP errors included, as
    ``application/problem+json`` (RFC 9457)."""
    for error in PROBLEM_ERRORS:
        app.add_exception_handler(error, on_error)


Next = Callable[[Request], Awaitable[Response]]


async def trace_requests(request: Request, call_next: Next) -> Response:
    """A server span continuing the caller's traceparent header: the requestor's
    reservoir.place span, and through it every node's, are its children."""
    if tracing.tracer() is None:
        return await call_next(request)
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


async def count_requests(request: Request, call_next: Next) -> Response:
    """``reservoir_service_http_requests_total`` by method, route template and status."""
    response = await call_next(request)
    metrics: Any = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.http_requests.labels(
            request.method, route_template(request), str(response.status_code)
        ).inc()
    return response


def route_template(request: Request) -> str:
    """The route template a request matched (``/v1/reservations/{request_id}``), the
    documentation's included; ``unmatched`` for a path no route has (a 404): never the
    path itself, which would make a series per id."""
    route = request.scope.get("route")
    if route is None:
        # FastAPI's own /docs, /redoc and /openapi.json routes are plain Starlette ones,
        # which do not put themselves in the scope; nor has a route run for a request
        # refused before it (a 413, a 415)
        for candidate in _flat_routes(request.app.router.routes):
            match, _child = candidate.matches(request.scope)
            if match is Match.FULL:
                route = candidate
                break
    return str(getattr(route, "path", "unmatched"))


async def log_requests(request: Request, call_next: Next) -> Response:
    """One access line per request while ``app.state.access_log`` is true, its facts
    as fields: ``method``, ``path``, ``route``, ``status``, ``elapsed_ms`` and the
    ``request_id`` of a reservation route (its key, given or generated)."""
    started = time.monotonic()
    response = await call_next(request)
    if getattr(request.app.state, "access_log", False):
        elapsed_ms = round((time.monotonic() - started) * 1000, 1)
        request_id = getattr(request.state, "request_id", None)
        if request_id is None:
            request_id = request.path_params.get("request_id")
        access_log.info(
            "%s %s %d %.1f ms",
            request.method,
            request.url.path,
            response.status_code,
            elapsed_ms,
            extra={
                "method": request.method,
                "path": request.url.path,
                "route": route_template(request),
                "status": response.status_code,
                "elapsed_ms": elapsed_ms,
                "request_id": request_id,
                "client": request.client.host if request.client else None,
            },
        )
    return response


def problem_openapi(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document, its error responses (4xx, 5xx) described as they
    are: ``application/problem+json`` bodies of the ``Problem`` schema (not FastAPI's
    ``HTTPValidationError`` in ``application/json``)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    document = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("ProblemOut", None)
    schemas["Problem"] = ProblemOut.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas["Problem"]["title"] = "Problem"
    problem = {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}
    for path in document.get("paths", {}).values():
        for operation in path.values():
            responses = operation.setdefault("responses", {})
            if "requestBody" in operation:
                responses.setdefault("400", {"description": "the body is not valid JSON"})
                responses.setdefault("413", {"description": "the body is too large"})
                responses.setdefault("415", {"description": "the body is not JSON"})
            for code, response in responses.items():
                if code[:1] in ("4", "5"):
                    response["content"] = dict(problem)
                    if response.get("description") == "Validation Error":
                        response["description"] = "a field is invalid; errors[] names each"
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    app.openapi_schema = document
    return document
