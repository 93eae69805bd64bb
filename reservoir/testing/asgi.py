"""Testing an ASGI app that embeds reservoir, in one event loop and without a server: its
lifespan run as uvicorn runs it, and an httpx client talking to it in process.

    async with serving(app) as client:
        created = await client.post("/v1/reservations", json={"vcpus": 2})

:func:`running` fails the test when the app's startup or shutdown does not complete (a
lifespan that raised, a requestor that could not open); :func:`serving` needs httpx.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

__all__ = ["running", "serving"]

Message = MutableMapping[str, Any]


@asynccontextmanager
async def running(app: Any) -> AsyncIterator[None]:
    """Start and stop ``app`` through the ASGI lifespan protocol, as uvicorn does."""
    to_app: asyncio.Queue[Message] = asyncio.Queue()
    from_app: asyncio.Queue[Message] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}
    lifespan = asyncio.create_task(app(scope, to_app.get, from_app.put))
    await to_app.put({"type": "lifespan.startup"})
    started = await from_app.get()
    if started["type"] != "lifespan.startup.complete":
        lifespan.cancel()
        raise AssertionError(f"the app did not start: {started}")
    try:
        yield
    finally:
        await to_app.put({"type": "lifespan.shutdown"})
        stopped = await from_app.get()
        await lifespan
        if stopped["type"] != "lifespan.shutdown.complete":
            raise AssertionError(f"the app did not stop cleanly: {stopped}")


@asynccontextmanager
async def serving(app: Any, base_url: str = "http://api.test") -> AsyncIterator[httpx.AsyncClient]:
    """``app`` started, and an httpx client talking to it in this event loop."""
    import httpx

    async with running(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=base_url) as client:
            yield client
