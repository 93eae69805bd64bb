"""The one interruption path of the ``reservoir`` command: Ctrl-C (SIGINT) or SIGTERM
prints one line and exits 130 (:data:`~reservoir.exit_status.EXIT_INTERRUPTED`).

The entry point (``reservoir/__main__.py``) calls :func:`install` before anything else is
imported (which is why this module lives outside :mod:`reservoir.cli`, whose import loads
every command, and why ``import reservoir`` loads nothing eagerly): a signal
while the commands load ends the process with the line at once (nothing has started, so
nothing is lost). Once a command runs (:func:`interruptible`, entered by the group), the
signal raises :class:`KeyboardInterrupt` in the main thread, so the command's ``finally``
blocks and context managers close what it opened (a requestor releases its live
reservations) before the group prints the line. A command that stops on its own terms
(``node``, ``keeper``) installs its own handlers and ends with :func:`interrupted` once it
has stopped.

This module imports nothing but the standard library: it must be cheap to load.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

from reservoir.exit_status import EXIT_INTERRUPTED

__all__ = [
    "STOP_SIGNALS",
    "deferred",
    "install",
    "interrupted",
    "interruptible",
    "set_from_a_signal_handler",
    "stop_on_signals",
    "stopped",
]

#: the signals that stop a command as Ctrl-C does
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_running = False
#: inside :func:`deferred`: a stop signal waits in ``_pending`` until it ends
_deferring = False
_pending: list[int] = []


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _deferring:
        _pending.append(signum)
        return
    if _running:
        raise KeyboardInterrupt
    # Still importing: nothing has started, and a KeyboardInterrupt here would surface as
    # a traceback out of whichever import it hit.
    os.write(2, b"reservoir: interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def install() -> None:
    """SIGINT and SIGTERM stop the command (main thread only: signals go there)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_signal)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """While a command runs, a stop signal unwinds it as KeyboardInterrupt."""
    global _running
    _running = True
    try:
        yield
    finally:
        _running = False


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within, a stop signal waits, then takes effect (KeyboardInterrupt) when the block
    ends: for what must not be cut in half, such as printing a placement already made,
    which the caller must learn of rather than lose."""
    global _deferring
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        if _pending:
            _pending.clear()
            raise KeyboardInterrupt


def stop_on_signals(stop: threading.Event, *, hangup: bool = False) -> None:
    """For a command that stops on its own terms (``node``, ``keeper``): SIGINT and SIGTERM
    (and SIGHUP with ``hangup``, as a terminal closing or ``kill -HUP`` would send) set
    ``stop`` rather than unwind it; it stops, says so, and exits 130 (:func:`stopped`)."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        set_from_a_signal_handler(stop)

    for signum in (*STOP_SIGNALS, *((signal.SIGHUP,) if hangup else ())):
        signal.signal(signum, on_signal)


def set_from_a_signal_handler(event: threading.Event) -> None:
    """Set ``event`` from a signal handler. Not directly: the handler runs in the main
    thread between two bytecodes, possibly inside that thread's own ``event.wait()`` while
    it holds the event's lock, and ``set()`` would wait for that lock forever (a node
    stopped with SIGTERM was seen hanging so). A thread of its own sets it once the main
    thread lets go."""
    threading.Thread(target=event.set, name="signal", daemon=True).start()


def stopped() -> NoReturn:
    """Exit status 130 for a command a signal stopped, once it has said so itself."""
    sys.exit(EXIT_INTERRUPTED)


def interrupted(command: str, what: str = "interrupted") -> NoReturn:
    """The one line (``reservoir request: interrupted``) and exit status 130."""
    try:
        sys.stderr.write(f"{command}: {what}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # stderr gone (a closed pipe): the status still says it
    sys.exit(EXIT_INTERRUPTED)
