"""Suite-wide settings. Hypothesis explores freshly on a developer's machine and replays a
fixed set of examples under CI, so a CI run is reproducible; ``--run-slow`` explores much
further (see tests/property/test_soak.py)."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
