"""Waiting for a broker that is not there yet: capped exponential backoff with jitter,
interruptible by a stop event. Used by every long-running process (``reservoir node``,
the chaos harness's requestors) so that one started before its broker, or during a
broker restart, waits instead of exiting."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_never,
    wait_exponential_jitter,
)

from reservoir.broker import BrokerError

__all__ = ["MAX_WAIT_S", "until_connected"]

T = TypeVar("T")

#: the longest wait between two attempts
MAX_WAIT_S = 15.0


class _Stopped(Exception):
    """The stop event was set while waiting."""


def until_connected(
    start: Callable[[], T],
    attempts: int,
    stop: threading.Event,
    *,
    on_wait: Callable[[int, BaseException, float], None],
) -> T | None:
    """Call ``start()`` until it gets past the broker (raises no :class:`BrokerError`).

    Waits 1 s, 2 s, 4 s ... up to :data:`MAX_WAIT_S` between attempts, each plus up to
    0.5 s of jitter, so that a fleet restarted together with its broker does not knock in
    step. ``attempts`` of 0 means without end; after the last one the error is raised.
    ``on_wait(attempt, error, wait_s)`` is told of every failed attempt that will be
    retried. Returns None when ``stop`` is set meanwhile.
    """

    def before_sleep(state: Any) -> None:
        error = state.outcome.exception()
        on_wait(state.attempt_number, error, state.upcoming_sleep)

    def interruptible_sleep(seconds: float) -> None:
        if stop.wait(seconds):
            raise _Stopped

    retrying = Retrying(
        stop=stop_after_attempt(attempts) if attempts else stop_never,
        wait=wait_exponential_jitter(max=MAX_WAIT_S, jitter=0.5),
        retry=retry_if_exception_type(BrokerError),
        before_sleep=before_sleep,
        sleep=interruptible_sleep,
        reraise=True,
    )
    try:
        return retrying(start)
    except _Stopped:
        return None
