"""The release before this tree's, built once per session for the tests of this folder
(``tests/upgrade/release_builds.py``)."""

from __future__ import annotations

import pytest

from tests.upgrade.release_builds import PREVIOUS, ReleaseBuild, ReleaseUnavailable, build


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> ReleaseBuild:
    """Release 0.1.0 (the one this tree runs beside), installed in a venv of its own."""
    try:
        return build(PREVIOUS, tmp_path_factory.mktemp(f"release-{PREVIOUS}"))
    except ReleaseUnavailable as error:
        pytest.fail(str(error), pytrace=False)
