"""Deprecated: moved to :mod:`reservoir.observe.exposition`; re-exported for one release."""

import warnings

from reservoir.observe.exposition import *  # noqa: F403
from reservoir.observe.exposition import __all__ as __all__

warnings.warn(
    "reservoir.prometheus is deprecated: import from reservoir.observe.exposition",
    DeprecationWarning,
    stacklevel=2,
)
