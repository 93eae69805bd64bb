"""The whole placement service as one router for a user's own FastAPI app.

:data:`router` holds every route of ``reservoir serve``: the reservations
(``/v1/reservations``), ``/v1/nodes``, the probes, ``/metrics``, and the dashboard
(``/ui``, ``/`` redirecting to it, ``/v1/activity``). Each of its routes answers its
own errors as problem+json (:class:`~reservoir.service.problems.ProblemRoute`), so an app
that includes it answers as ``reservoir serve`` does, and keeps its own error handling
for its own routes::

    app = FastAPI(lifespan=lifespan)   # with reservoir_lifespan in it
    app.include_router(reservoir.service.router)

(No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations.)
"""

from fastapi import APIRouter

from reservoir.service import dashboard, routes
from reservoir.service.problems import ProblemRoute

__all__ = ["router"]

router = APIRouter(route_class=ProblemRoute)
router.include_router(routes.router)
router.include_router(dashboard.router)
