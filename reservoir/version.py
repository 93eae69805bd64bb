"""The release this tree is and the name it is distributed under: one definition each, read
by the package, its tracer, ``reservoir --version`` and every "pip install" hint. Which
release runs beside which is :mod:`reservoir.protocol.compatibility`'s (docs/upgrading.md).

The import package is ``reservoir``; the distribution (what ``pip install`` names) is
``reservoir-scheduler``, because the PyPI project ``reservoir`` belongs to someone else
(a sampling library). ``tests/unit/test_distribution.py`` holds pyproject.toml, the docs,
the Dockerfile and the hints to this name.
"""

import functools
import importlib.metadata
import re
import tomllib
from pathlib import Path

#: this tree's release: the next one after the last tagged (``v0.1.0``), until it is made
__version__ = "0.2.0.dev0"

#: the distribution's name on PyPI: ``[project] name`` in pyproject.toml
DISTRIBUTION = "reservoir-scheduler"


def version_line() -> str:
    """What ``reservoir --version`` says after the program's name: the release, the
    protocol version it speaks and the release line it runs beside (docs/upgrading.md)."""
    # imported here: ``import reservoir`` loads this module and must load nothing more
    from reservoir.protocol.compatibility import RELEASE_LINES
    from reservoir.protocol.messages import PROTOCOL_VERSION

    return f"{__version__} (protocol {PROTOCOL_VERSION}; runs beside {RELEASE_LINES[-2]})"


def install_hint(extra: str) -> str:
    """The command that installs what an extra of reservoir brings, for an error to
    suggest: ``pip install 'cryptography>=38' (the signing extra)``. It names the extra's
    own packages, so it works however reservoir was installed (from a checkout, a built
    wheel or an index), where ``pip install 'reservoir-scheduler[signing]'`` works only
    from an index that has the release. The packages are read from this checkout's
    pyproject.toml when reservoir runs from one, else from the installed distribution's
    metadata; with neither (an extra unknown to both), the distribution's extra is named."""
    packages = _extra_requirements().get(extra)
    if not packages:
        return f"pip install '{DISTRIBUTION}[{extra}]'"
    return f"pip install {' '.join(repr(p) for p in packages)} (the {extra} extra)"


@functools.cache
def _extra_requirements() -> dict[str, tuple[str, ...]]:
    """Each extra's requirements, as written where they can be read (see install_hint)."""
    checkout = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        project = tomllib.loads(checkout.read_text())["project"]
        if project["name"] == DISTRIBUTION:
            extras = project["optional-dependencies"]
            return {extra: tuple(map(str, listed)) for extra, listed in extras.items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not run from a checkout: the installed metadata says it
    try:
        listed = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    found: dict[str, tuple[str, ...]] = {}
    for requirement in listed:
        package, _, marker = requirement.partition(";")
        named = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if named is not None:
            found[named.group(1)] = (*found.get(named.group(1), ()), package.strip())
    return found
