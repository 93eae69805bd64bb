"""Waiting for a broker that is not there yet: capped exponential backoff with jitter,
interruptible by a stop event. Used by every long-running process (``reservoir node``,
the chaos harness's requestors) so that one started before its broker, or during a
broker restart, waits instead of exiting. And :func:`quietly_connecting`, which keeps the
client libraries' narration of each failed attempt off a command's stderr."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final, TypeVar

from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_never,
    wait_exponential_jitter,
)

from reservoir.broker import BrokerError

__all__ = ["MAX_WAIT_S", "quietly_connecting", "until_connected"]

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


#: the loggers of the transports and their adapters, which narrate each connection attempt
_CONNECTING_LOGGERS: Final = ("pika", "kombu", "amqp", "reservoir.brokers")


@contextlib.contextmanager
def quietly_connecting() -> Iterator[None]:
    """Keep the adapters' line per failed connection attempt off stderr while a command's
    first connection is tried, so that an unreachable broker is the command's one line
    (unless logging was asked for at INFO or below, e.g. ``reservoir -v request``)."""
    if logging.getLogger().getEffectiveLevel() < logging.WARNING:
        yield
        return
    loggers = [logging.getLogger(name) for name in _CONNECTING_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
