"""The live dashboard of ``reservoir serve``: a static page shipped in the package
(``reservoir/service/ui/``: HTML, one script, one stylesheet; no build step, nothing
fetched from elsewhere) at ``/ui``, ``/`` redirecting to it, and ``GET /v1/activity``,
this replica's recent placements summarised (:mod:`reservoir.service.activity`).

The page polls ``/v1/activity`` and ``/v1/nodes`` (every node's ledger, asked of the nodes
over the broker) and draws the nodes by tier, as a heatmap per resource class and a paged
table of bars, with its own SVG. It needs the API routes beside it (``/v1/nodes``): a
user's app includes both as :data:`reservoir.service.router`.

(No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations.)
"""

from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import RedirectResponse

from reservoir.service.activity import MAX_WINDOW_S, MIN_BUCKET_S, span_problem
from reservoir.service.problems import ProblemRoute
from reservoir.service.routes import service_of
from reservoir.service.shapes import Problem

__all__ = ["ASSETS", "router"]

router = APIRouter(route_class=ProblemRoute)

#: the page's files, by the name the page asks for, and their media types
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


def _asset(name: str) -> bytes:
    return resources.files("reservoir.service").joinpath("ui", name).read_bytes()


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui", include_in_schema=False)
async def ui_without_slash() -> RedirectResponse:
    # the page names its script and stylesheet relatively, so it lives at /ui/
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/", include_in_schema=False)
async def ui_page() -> Response:
    return _asset_response("index.html")


@router.get("/ui/{name}", include_in_schema=False)
async def ui_asset(name: str) -> Response:
    if name not in ASSETS:
        shown = name if len(name) <= 64 else f"{name[:64]}..."  # the client's text: short
        raise Problem(404, "not found", f"the dashboard has no {shown!r}")
    return _asset_response(name)


def _asset_response(name: str) -> Response:
    # no-cache: a replica upgraded in place serves its own page on the next load
    return Response(_asset(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


@router.get("/v1/activity")
async def activity(
    request: Request,
    window_s: Annotated[float, Query(gt=0, le=MAX_WINDOW_S)] = 300.0,
    bucket_s: Annotated[float, Query(ge=MIN_BUCKET_S, le=MAX_WINDOW_S)] = 10.0,
) -> dict[str, Any]:
    """This replica's placements over the last ``window_s``: placements per second (over
    the last minute), p50/p99 of the placement time, how many per ``bucket_s`` (at least
    1 s and no longer than the window: at most 3,600 counts), failures by reason and the
    last few outcomes with the nodes chosen. Per replica: each replica of a service counts
    only what it answered (Prometheus adds the replicas up)."""
    # the schema bounds each parameter; how they fit together is checked here
    refused = span_problem(window_s, bucket_s)
    if refused is not None:
        parameter, problem = refused
        raise Problem.of_validation_error([{"loc": ("query", parameter), "msg": problem}])
    return service_of(request).activity.summary(window_s, bucket_s)
