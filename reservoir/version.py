"""The release this tree is and the name it is distributed under: one definition each, read
by the package, its tracer, ``reservoir --version`` and every "pip install" hint.

The import package is ``reservoir``; the distribution (what ``pip install`` names) is
``reservoir-scheduler``, because the PyPI project ``reservoir`` belongs to someone else
(a sampling library). ``tests/unit/test_distribution.py`` holds pyproject.toml, the docs,
the Dockerfile and the hints to this name.
"""

__version__ = "0.1.0"

#: the distribution's name on PyPI: ``[project] name`` in pyproject.toml
DISTRIBUTION = "reservoir-scheduler"


def install_hint(extra: str) -> str:
    """The command that installs an extra of reservoir, for an error to suggest."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"
