"""The simulated network: one-way latency distributions and message loss.

This module owns how long a message takes and whether it arrives. Every system of a run
(reservoir and the baselines) draws from the same model with its own seeded
``random.Random``, so none of them sees a kinder network than the others.

Latency is given in milliseconds on the command line (``--latency-ms``), in one of three
forms:

- ``5`` or ``fixed:5``: every message takes exactly 5 ms;
- ``uniform:1,10``: uniformly between 1 and 10 ms;
- ``lognormal:2,0.5``: log-normal with a median of 2 ms and sigma 0.5 (a long right tail,
  as measured latencies have).

Loss is a probability per message, drawn independently for every delivery. The reservoir
machines cope with loss by themselves (timers, re-sent awards and frees, TTLs); the
baselines have no such protocol modelled, so for them a lost message is re-sent after
:data:`BASELINE_RETRANSMIT_S` (an RPC retry), which costs time and one more message.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["BASELINE_RETRANSMIT_S", "LatencyModel", "Legs", "parse_latency_ms"]

#: How long a baseline's sender waits before re-sending a message the network lost.
BASELINE_RETRANSMIT_S: Final = 1.0

LatencyKind = Literal["fixed", "uniform", "lognormal"]


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """A one-way latency distribution. ``a_ms``/``b_ms`` are the fixed value (fixed), the
    bounds (uniform) or the median and sigma (lognormal; ``b_ms`` is then unitless)."""

    kind: LatencyKind
    a_ms: float
    b_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.a_ms) and math.isfinite(self.b_ms)):
            raise ValueError("latencies must be finite numbers")
        if self.kind == "fixed" and self.a_ms <= 0:
            raise ValueError("a fixed latency must be positive")
        if self.kind == "uniform" and not 0 < self.a_ms <= self.b_ms:
            raise ValueError("uniform:LO,HI needs 0 < LO <= HI")
        if self.kind == "lognormal" and not (self.a_ms > 0 and self.b_ms >= 0):
            raise ValueError("lognormal:MEDIAN,SIGMA needs MEDIAN > 0 and SIGMA >= 0")

    @property
    def fixed_s(self) -> float | None:
        """The latency in seconds when it never varies, else None."""
        return self.a_ms / 1000 if self.kind == "fixed" else None

    @property
    def mean_s(self) -> float:
        if self.kind == "fixed":
            return self.a_ms / 1000
        if self.kind == "uniform":
            return (self.a_ms + self.b_ms) / 2000
        return self.a_ms / 1000 * math.exp(self.b_ms**2 / 2)

    def sampler(self, rng: random.Random) -> Callable[[], float]:
        """A function drawing one latency, in seconds, from ``rng``."""
        if self.kind == "fixed":
            return functools.partial(float, self.a_ms / 1000)
        if self.kind == "uniform":
            return functools.partial(rng.uniform, self.a_ms / 1000, self.b_ms / 1000)
        return functools.partial(rng.lognormvariate, math.log(self.a_ms / 1000), self.b_ms)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.a_ms:g} ms"
        if self.kind == "uniform":
            return f"uniform {self.a_ms:g}..{self.b_ms:g} ms"
        return f"lognormal median {self.a_ms:g} ms, sigma {self.b_ms:g}"


def parse_latency_ms(text: str) -> LatencyModel:
    """``5``, ``fixed:5``, ``uniform:1,10`` or ``lognormal:2,0.5`` (milliseconds)."""
    kind, sep, rest = text.strip().partition(":")
    if not sep:
        kind, rest = "fixed", kind
    kind = kind.strip().lower()
    try:
        numbers = [float(part) for part in rest.split(",")]
    except ValueError:
        raise ValueError(
            f"{text!r}: numbers expected, e.g. 5, uniform:1,10 or lognormal:2,0.5"
        ) from None
    if kind == "fixed" and len(numbers) == 1:
        return LatencyModel("fixed", numbers[0])
    if kind in ("uniform", "lognormal") and len(numbers) == 2:
        return LatencyModel(kind, numbers[0], numbers[1])  # type: ignore[arg-type]
    raise ValueError(f"{text!r}: expected MS, fixed:MS, uniform:LO,HI or lognormal:MEDIAN,SIGMA")


class Legs:
    """Message legs of a baseline: each call draws one leg's delay, counts the message,
    and with loss adds a re-send (after :data:`BASELINE_RETRANSMIT_S`) per lost copy."""

    __slots__ = ("_draw", "_loss", "_random", "lost", "messages")

    def __init__(self, latency: LatencyModel, loss: float, rng: random.Random) -> None:
        self._draw = latency.sampler(rng)
        self._loss = loss
        self._random = rng.random
        self.messages = 0
        self.lost = 0

    def __call__(self) -> float:
        self.messages += 1
        delay_s = self._draw()
        if self._loss:
            while self._random() < self._loss:
                self.lost += 1
                self.messages += 1
                delay_s += BASELINE_RETRANSMIT_S + self._draw()
        return delay_s
