"""The interruption path's parts, in this process: what ``deferred`` holds back."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from reservoir.interrupt import STOP_SIGNALS, deferred, install, interruptible


@pytest.fixture
def installed() -> Iterator[None]:
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    install()
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def signalled(signum: int, finished: list[str], *, deferring: bool) -> None:
    with deferred() if deferring else contextlib.nullcontext():
        os.kill(os.getpid(), signum)
        time.sleep(0.05)  # the handler has run by now
        finished.append("printed")


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("signum", STOP_SIGNALS)
def test_a_stop_signal_inside_deferred_waits_for_the_block_to_end(signum: int) -> None:
    finished: list[str] = []
    with interruptible(), pytest.raises(KeyboardInterrupt):
        signalled(signum, finished, deferring=True)
    assert finished == ["printed"]  # held back until the block ended


@pytest.mark.usefixtures("installed")
def test_a_stop_signal_outside_deferred_interrupts_at_once() -> None:
    finished: list[str] = []
    with interruptible(), pytest.raises(KeyboardInterrupt):
        signalled(signal.SIGTERM, finished, deferring=False)
    assert finished == []
