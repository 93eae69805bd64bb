"""The service's errors as ``application/problem+json`` (RFC 9457), wherever its routes are
mounted: :class:`ProblemRoute`, the route class of every route of the service, answers
each route's own errors (a bad query or body, a body too large or not JSON, the
service's and the library's exceptions, and anything unexpected, which is logged) as a
problem, whichever app includes the routes; :func:`add_problem_handlers` does the same
for a whole app's errors (its own routes', its 404s and 405s).

An unexpected error is a 500 problem whose detail says nothing of the cause; the cause,
with its traceback, is logged on ``reservoir.serve``. Input alone never causes one: every
parameter is bounded where it is declared.

FastAPI comes with the ``api`` extra; this module is imported only with the routes.
"""

import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, MutableMapping
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.routing import Match

from reservoir.broker import BrokerError
from reservoir.protocol.placement import PlacementError
from reservoir.runtime.requestor import FreeIncomplete, RequestorClosed
from reservoir.service.shapes import DEFAULT_MAX_BODY_BYTES, PROBLEM_JSON, Problem

__all__ = [
    "PROBLEM_ERRORS",
    "InternalErrors",
    "ProblemRoute",
    "add_problem_handlers",
    "internal_error",
    "problem_of",
    "problem_response",
]

# the logger's name predates the service package: operators' logging configs name it
log = logging.getLogger("reservoir.serve")


def problem_response(problem: Problem) -> JSONResponse:
    """``problem`` as the response that carries it."""
    return JSONResponse(
        problem.body(),
        status_code=problem.status,
        media_type=PROBLEM_JSON,
        headers=problem.headers or None,
    )


#: the errors answered as problem+json for what they are (any other is a 500)
PROBLEM_ERRORS: tuple[type[Exception], ...] = (
    Problem,
    PlacementError,
    RequestorClosed,
    BrokerError,
    FreeIncomplete,
    RequestValidationError,
    HTTPException,
)


def problem_of(error: Exception) -> Problem | None:
    """The problem+json answer to an error of :data:`PROBLEM_ERRORS`; None for any other."""
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
            400: "bad request",
            404: "not found",
            405: "method not allowed",
            413: "request body too large",
        }.get(error.status_code, "error")
        return Problem(
            error.status_code, title, str(error.detail), headers=dict(error.headers or {})
        )
    return None


def internal_error(method: str, path: str, error: BaseException) -> Problem:
    """The 500 answer to an error nothing expected, which is logged here with its
    traceback (the answer says nothing of it: that is for the operator)."""
    log.error(
        "%s %s failed: %s: %s",
        method,
        path,
        type(error).__name__,
        error,
        exc_info=error,
        extra={"method": method, "path": path, "status": 500},
    )
    return Problem(
        500,
        "internal error",
        f"the service failed on {method} {path}; its log says why",
    )


def answer_to(request: Request, error: Exception) -> Problem:
    """The problem ``error`` is, or a logged 500."""
    problem = problem_of(error)
    if problem is None:
        return internal_error(request.method, request.url.path, error)
    return problem


#: the media types a request body may have: JSON (``application/json`` or ``+json``)
_JSON = ("application/json",)


def body_refusal(headers: Mapping[str, str], max_body_bytes: int) -> Problem | None:
    """A 415 for a body that is not JSON (by its Content-Type), a 413 for one whose
    Content-Length is over ``max_body_bytes``; None for a request without a body."""
    length = headers.get("content-length")
    has_body = (length is not None and length.strip() != "0") or "transfer-encoding" in headers
    if has_body and not _is_json(headers.get("content-type", "")):
        given = headers.get("content-type") or "none"
        return Problem(
            415, "unsupported media type", f"the body must be application/json, not {given}"
        )
    if length is not None and length.strip().isdigit() and int(length) > max_body_bytes:
        return too_large(max_body_bytes)
    return None


def too_large(max_body_bytes: int) -> Problem:
    return Problem(
        413,
        "request body too large",
        f"the body is larger than {max_body_bytes} bytes (--max-body-bytes)",
    )


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type in _JSON or media_type.endswith("+json")


Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]


def counted(receive: Receive, max_body_bytes: int) -> Receive:
    """``receive`` that raises a 413 as soon as the body streamed in (chunked) passes
    ``max_body_bytes``: what is beyond is never read."""
    seen = 0

    async def receiving() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > max_body_bytes:
                raise HTTPException(413, too_large(max_body_bytes).detail)
        return message

    return receiving


def max_body_bytes_of(request: Request) -> int:
    """The app's ``state.max_body_bytes`` (``reservoir serve --max-body-bytes``), or the
    default of 1 MiB."""
    limit = getattr(request.app.state, "max_body_bytes", None)
    return limit if isinstance(limit, int) else DEFAULT_MAX_BODY_BYTES


Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class ProblemRoute(APIRoute):
    """A route that answers its own errors as problem+json, in any app: a body that is
    not JSON (415) or is over the app's ``state.max_body_bytes`` (413, refused before it
    is read whole), an invalid parameter or body (422, each field named in reservoir's
    words), the service's and the library's exceptions, and any other error as a logged
    500. So a user's app that includes the service's router gets the service's answers,
    and keeps its own error handling for its own routes."""

    def get_route_handler(self) -> Handler:
        handle = super().get_route_handler()

        async def answer(request: Request) -> Response:
            limit = max_body_bytes_of(request)
            refused = body_refusal(request.headers, limit)
            if refused is not None:
                return problem_response(refused)
            try:
                if "content-length" in request.headers or "transfer-encoding" in request.headers:
                    request = Request(request.scope, counted(request.receive, limit))
                return await handle(request)
            except Exception as error:
                return problem_response(answer_to(request, error))

        return answer


Scope = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class InternalErrors:
    """An ASGI middleware that answers an error nothing else answered (one outside the
    routes, whose own errors :class:`ProblemRoute` answers) with a logged 500 problem,
    when no response has started: the middleware outside it (the request counter, the
    access log) sees a 500 like any other answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as error:
            if started:
                raise  # half an answer is out: the server ends the connection
            problem = internal_error(scope.get("method", ""), scope.get("path", ""), error)
            await problem_response(problem)(scope, receive, send)


async def on_error(request: Request, error: Exception) -> Response:
    """An app's exception handler: the problem ``error`` is (a 405 naming every method
    its path takes), or a logged 500."""
    problem = answer_to(request, error)
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


def add_problem_handlers(app: FastAPI) -> None:
    """Answer the errors of all of ``app``'s routes, its own included, as problem+json:
    validation and HTTP errors (404, 405 with ``Allow``), :class:`Problem`, and the
    library's exceptions (a ``PlacementError`` a 409 naming why, 504 when it timed out;
    a ``BrokerError`` or ``RequestorClosed`` a 503)."""
    for error in PROBLEM_ERRORS:
        app.add_exception_handler(error, on_error)
