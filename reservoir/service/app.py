"""The app of ``reservoir serve``: FastAPI with the service's routes, its lifespan, its
errors as problem+json and its middleware (traces, request counts, access lines).

A user's own app takes what it needs instead: the whole service as one router
(:data:`reservoir.service.router`, which answers its own errors as problem+json),
:func:`~reservoir.service.reservoir_lifespan`, and, for its own routes,
:func:`~reservoir.service.problems.add_problem_handlers`. FastAPI comes with the ``api``
extra; this module is imported only when an app is built.
"""

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from starlette.routing import Match

from reservoir.broker import Broker
from reservoir.brokers import BrokerUrl
from reservoir.observe import tracing
from reservoir.runtime.settings import Settings
from reservoir.service.embed import router
from reservoir.service.lifespan import reservoir_lifespan
from reservoir.service.metrics import ServiceMetrics
from reservoir.service.problems import (
    ASGIApp,
    InternalErrors,
    Message,
    Receive,
    Scope,
    Send,
    add_problem_handlers,
    internal_error,
    problem_response,
)
from reservoir.service.reservoir_service import DEFAULT_DRAIN_TIMEOUT_S
from reservoir.service.shapes import DEFAULT_MAX_BODY_BYTES, PROBLEM_JSON, ProblemOut

__all__ = ["add_problem_handlers", "create_app", "problem_openapi"]

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
    one that is not JSON a 415, before it is read (``app.state.max_body_bytes``, which
    the routes read: :class:`~reservoir.service.problems.ProblemRoute`). Every error is
    a problem+json answer, an unexpected one a 500 logged with its traceback; each is
    counted and, while ``app.state.access_log`` is true, logged on
    ``reservoir.serve.access`` as any answer is. Its live dashboard is at ``/ui``
    (:mod:`.dashboard`)."""
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
    app.state.max_body_bytes = max_body_bytes
    add_problem_handlers(app)  # what no route answers: a 404, a 405
    # outside every middleware: one of them failing is still a problem+json 500, logged
    app.add_exception_handler(Exception, on_unexpected)
    # the innermost first: the errors it answers are traced, counted and logged too
    app.add_middleware(InternalErrors)
    app.add_middleware(Observed)
    app.include_router(router)  # the reservation routes, /v1/nodes, the probes, /ui
    app.openapi = lambda: problem_openapi(app)  # type: ignore[method-assign]
    return app


async def on_unexpected(request: Request, error: Exception) -> Response:
    """A 500 problem for an error in the middleware itself (Starlette's last resort, which
    answers in text/plain otherwise); not counted, as the counter is what failed."""
    return problem_response(internal_error(request.method, request.url.path, error))


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


class Observed:
    """Each request traced, counted and, while ``app.state.access_log`` is true, logged:
    a server span continuing the caller's ``traceparent`` header (when tracing), so the
    requestor's ``reservoir.place`` span and through it every node's are its children;
    ``reservoir_service_http_requests_total`` by method, route template and status; one
    access line with its facts as fields (``method``, ``path``, ``route``, ``status``,
    ``elapsed_ms``, the ``request_id`` of a reservation route, given or generated).

    A plain ASGI middleware that only watches the answer go by. (Starlette's
    ``@app.middleware("http")`` runs every request through a task group and a streamed
    copy of the response; three of them were a third of ``reservoir serve``'s CPU per
    request.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500  # what a request that raised past every handler comes to

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        traced = None
        if tracing.tracer() is not None:
            parent = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            traced = tracing.Traced(f"{scope['method']} {scope['path']}", parent=parent)
        try:
            with traced or contextlib.nullcontext():
                await self.app(scope, receive, sending)
                if traced is not None:
                    _annotate(traced, scope, status)
        finally:
            _observed(scope, status, time.monotonic() - started)


def _annotate(traced: tracing.Traced, scope: Scope, status: int) -> None:
    route = getattr(scope.get("route"), "path", None)
    if route is not None:
        traced.span.update_name(f"{scope['method']} {route}")
        traced.span.set_attribute("http.route", route)
    traced.span.set_attribute("http.request.method", scope["method"])
    traced.span.set_attribute("http.response.status_code", status)


def _observed(scope: Scope, status: int, elapsed_s: float) -> None:
    """Count the answer, and log it while the app's access log is on."""
    app = scope.get("app")
    state = app.state if app is not None else None
    route = None
    metrics: Any = getattr(state, "metrics", None)
    if metrics is not None:
        route = route_template(scope)
        metrics.http_requests.labels(scope["method"], route, str(status)).inc()
    if not getattr(state, "access_log", False):
        return
    elapsed_ms = round(elapsed_s * 1000, 1)
    request_id = scope.get("state", {}).get("request_id")
    if request_id is None:
        request_id = scope.get("path_params", {}).get("request_id")
    client = scope.get("client")
    access_log.info(
        "%s %s %d %.1f ms",
        scope["method"],
        scope["path"],
        status,
        elapsed_ms,
        extra={
            "method": scope["method"],
            "path": scope["path"],
            "route": route if route is not None else route_template(scope),
            "status": status,
            "elapsed_ms": elapsed_ms,
            "request_id": request_id,
            "client": client[0] if client else None,
        },
    )


def route_template(scope: Scope) -> str:
    """The route template a request matched (``/v1/reservations/{request_id}``), the
    documentation's included; ``unmatched`` for a path no route has (a 404): never the
    path itself, which would make a series per id."""
    route = scope.get("route")
    if route is None:
        # FastAPI's own /docs, /redoc and /openapi.json routes are plain Starlette ones,
        # which do not put themselves in the scope
        app = scope.get("app")
        for candidate in _flat_routes(app.router.routes if app is not None else ()):
            match, _child = candidate.matches(scope)
            if match is Match.FULL:
                route = candidate
                break
    return str(getattr(route, "path", "unmatched"))


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
