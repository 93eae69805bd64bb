"""Deprecated: the service moved to :mod:`reservoir.service`; this module re-exports it
for one release."""

import warnings
from typing import Any

import reservoir.service

warnings.warn(
    "reservoir.serve is deprecated: import from reservoir.service",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(reservoir.service, name)
