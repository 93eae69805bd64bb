"""The app of ``reservoir serve``: FastAPI with the service's routes, its lifespan, its
errors as problem+json and its middleware (traces, request counts).

A user's own app takes what it needs instead: the routes
(:data:`reservoir.service.routes.router`), :func:`add_problem_handlers` and
:func:`~reservoir.service.reservoir_lifespan`. FastAPI comes with the ``api`` extra; this
module is imported only when an app is built.
"""

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

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
from reservoir.service.shapes import PROBLEM_JSON, Problem

__all__ = ["add_problem_handlers", "create_app"]


def create_app(
    broker: Broker | BrokerUrl | str | None = None,
    *,
    settings: Settings | None = None,
    explain: bool = True,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
) -> FastAPI:
    """The app of ``reservoir serve``, placing through ``broker`` (as in
    :func:`~reservoir.service.reservoir_lifespan`). Its metrics are in a registry of its
    own (``app.state.metrics``). Its live dashboard is at ``/ui`` (:mod:`.dashboard`)."""
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
    add_problem_handlers(app)
    app.middleware("http")(trace_requests)
    app.middleware("http")(count_requests)
    app.include_router(router)
    app.include_router(dashboard.router)  # /ui, / redirecting to it, /v1/activity
    return app


def problem_response(problem: Problem) -> JSONResponse:
    return JSONResponse(problem.body(), status_code=problem.status, media_type=PROBLEM_JSON)


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
        title = {404: "not found", 405: "method not allowed"}.get(error.status_code, "error")
        return Problem(error.status_code, title, str(error.detail))
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
    return problem_response(_problem_of(error))


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
        template = getattr(request.scope.get("route"), "path", "unmatched")
        metrics.http_requests.labels(request.method, template, str(response.status_code)).inc()
    return response
