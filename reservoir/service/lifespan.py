"""The lifespan that opens a :class:`~reservoir.service.reservoir_service.ReservoirService`
for an ASGI app and closes it on shutdown (in-flight placements are given
``drain_timeout_s`` to finish, then the requestor closes, which fails what is still in
flight and releases what it reserved).

No FastAPI here: :func:`reservoir_lifespan` serves a Starlette app or any ASGI framework's
lifespan as well.
"""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

from reservoir.broker import Broker
from reservoir.brokers import BrokerUrl
from reservoir.observe.metrics import default_participant
from reservoir.runtime.requestor import Requestor
from reservoir.runtime.settings import Settings
from reservoir.service.reservoir_service import DEFAULT_DRAIN_TIMEOUT_S, ReservoirService

if TYPE_CHECKING:
    from reservoir.service.metrics import ServiceMetrics

__all__ = ["reservoir_lifespan"]


class _HasState(Protocol):
    state: Any


@asynccontextmanager
async def reservoir_lifespan(
    app: _HasState | None = None,
    broker: Broker | BrokerUrl | str | None = None,
    *,
    settings: Settings | None = None,
    explain: bool = True,
    metrics: "ServiceMetrics | None" = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
) -> AsyncIterator[ReservoirService]:
    """Open a :class:`ReservoirService` for an ASGI app's lifetime; put it in the app's
    lifespan, and include the service's routes (:data:`reservoir.service.router`) to
    serve them as ``reservoir serve`` does::

        from collections.abc import AsyncIterator
        from contextlib import asynccontextmanager

        from fastapi import FastAPI, Request

        from reservoir import PlacementRequest
        from reservoir.service import (
            ReservoirService,
            add_problem_handlers,
            reservoir_lifespan,
            router,
        )


        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            async with reservoir_lifespan(app):  # the broker of RESERVOIR_BROKER_URL
                yield


        app = FastAPI(lifespan=lifespan)
        app.include_router(router)  # /v1/reservations, /v1/nodes, /ui: errors as problem+json
        add_problem_handlers(app)  # this app's own too: a PlacementError is a 409 problem


        @app.post("/servers", status_code=201)
        async def create(request: Request) -> dict[str, str]:
            service: ReservoirService = request.app.state.reservoir
            placement = await service.place(PlacementRequest(resources={"VCPU": 2}))
            return {"node": placement.allocations[0].node}

    ``broker`` is a shared :class:`~reservoir.Broker` (left open), a URL, or None for
    ``settings.broker_url``; a broker opened here is closed on exit. With ``app``, the
    service is ``app.state.reservoir`` while open. ``explain`` asks nodes that cannot take
    a request to say why (one more small message per such node, only on failure), so a
    409 names the short resource. On exit, placements in flight get ``drain_timeout_s``
    to finish; then the requestor closes, failing what is left (``RequestorClosed``) and
    releasing whatever it had reserved for it.
    """
    settings = settings if settings is not None else Settings()
    owned: Broker | None = None
    if not isinstance(broker, Broker):
        from reservoir.brokers import connect

        broker = owned = await asyncio.to_thread(connect, broker or settings.broker_url)
    registry = metrics.registry if metrics is not None else None
    try:
        # findable: every placement, generated ids too, can be found from any replica
        requestor = await asyncio.to_thread(
            Requestor,
            broker,
            settings=settings,
            metrics_registry=registry,
            findable=True,
            participant=settings.requestor_name or default_participant("serve"),
        )
    except BaseException:
        if owned is not None:
            await asyncio.to_thread(owned.close)
        raise
    service = ReservoirService(
        requestor=requestor, broker=broker, settings=settings, explain=explain, metrics=metrics
    )
    if app is not None:
        app.state.reservoir = service
    try:
        yield service
    finally:
        await service.stop(drain_timeout_s)
        if app is not None:
            app.state.reservoir = None
        if owned is not None:
            await asyncio.to_thread(owned.close)
