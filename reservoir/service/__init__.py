"""The placement service over HTTP (``reservoir serve``), and the parts of it a user's own
ASGI app mounts.

- :mod:`.shapes`: the HTTP shapes (pydantic) and :class:`Problem`, answered as
  ``application/problem+json`` (RFC 9457);
- :mod:`.reservoir_service`: :class:`ReservoirService` (one shared requestor per process),
  and :mod:`.lifespan`: :func:`reservoir_lifespan`, which opens it for an ASGI app's
  lifetime;
- :data:`router`: the whole service as one FastAPI ``APIRouter`` for a user's own app
  (:mod:`.embed`): :mod:`.routes`, the API routes, and :mod:`.dashboard`, the live
  dashboard (``/ui``) and ``/v1/activity`` over :mod:`.activity`, each replica's ring of
  its recent placements; each route answers its own errors as problem+json
  (:mod:`.problems`);
- :func:`add_problem_handlers`: a user's app's own errors as problem+json too (a
  ``PlacementError`` a 409 naming why);
- :mod:`.app`: :func:`create_app`, the app of ``reservoir serve``;
- :mod:`.metrics`: the service's Prometheus metrics.

FastAPI, uvicorn and prometheus_client come with the ``api`` extra; the routes and the
app import FastAPI, so :func:`create_app`, :data:`router` and
:func:`add_problem_handlers` are loaded from here only when asked for, and ``reservoir``
without the extra still imports.
"""

from typing import Any

from reservoir.service.lifespan import reservoir_lifespan
from reservoir.service.reservoir_service import DEFAULT_DRAIN_TIMEOUT_S, ReservoirService
from reservoir.service.shapes import (
    AllocationOut,
    Identifier,
    NodeOut,
    PlacementOut,
    Problem,
    ReservationIn,
    Trait,
)

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT_S",
    "AllocationOut",
    "Identifier",
    "NodeOut",
    "PlacementOut",
    "Problem",
    "ReservationIn",
    "ReservoirService",
    "Trait",
    "add_problem_handlers",
    "create_app",
    "reservoir_lifespan",
    "router",
]


def __getattr__(name: str) -> Any:
    # FastAPI is imported only with the parts that need it (the api extra)
    if name == "create_app":
        from reservoir.service.app import create_app

        return create_app
    if name == "router":
        from reservoir.service.embed import router

        return router
    if name == "add_problem_handlers":
        from reservoir.service.problems import add_problem_handlers

        return add_problem_handlers
    raise AttributeError(f"module 'reservoir.service' has no attribute {name!r}")
