"""Finding node-side filters and weighers through entry points.

Filters are registered in the ``reservoir.filters`` entry point group and weighers in
``reservoir.weighers``; reservoir registers its own built-in checks there too, so an
operator's check is installed, discovered and ordered exactly like the built-in ones.
Each entry point names a class (or any callable) that returns the filter or weigher.

Order: the built-ins first, in :data:`BUILT_IN_FILTERS` order (cheap checks first), then
every other one by name. ``Settings.filters`` / ``RESERVOIR_FILTERS`` names the ones to use,
in order, when an operator wants to choose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib.metadata import EntryPoint, entry_points

from reservoir.protocol.filters import BUILT_IN_FILTERS, BUILT_IN_WEIGHERS, Filter, Weigher

__all__ = [
    "BUILT_IN_FILTERS",
    "BUILT_IN_WEIGHERS",
    "PluginError",
    "installed_entry_points",
    "load_filters",
    "load_weighers",
]

FILTER_GROUP = "reservoir.filters"
WEIGHER_GROUP = "reservoir.weighers"


class PluginError(RuntimeError):
    """A filter or weigher could not be found or loaded."""


#: (group, the finder that read it) -> its entry points, sorted by name. Reading them
#: scans every installed distribution's metadata (milliseconds), and every node agent asks
#: twice: once per process is enough, since what is installed does not change under a
#: running process. Keyed by the finder too, so a test that replaces ``entry_points``
#: reads its own.
_installed: dict[tuple[str, object], tuple[EntryPoint, ...]] = {}


def installed_entry_points(group: str) -> tuple[EntryPoint, ...]:
    """The entry points installed in ``group``, sorted by name, read once per process
    (filters, weighers and task drivers alike)."""
    finder = entry_points
    installed = _installed.get((group, finder))
    if installed is None:
        installed = tuple(sorted(finder(group=group), key=lambda ep: ep.name))
        _installed[(group, finder)] = installed
    return installed


def _discovered(group: str, built_in: Mapping[str, type]) -> dict[str, EntryPoint | type]:
    found: dict[str, EntryPoint | type] = dict(built_in)
    for entry_point in installed_entry_points(group):
        if entry_point.name not in built_in:
            found[entry_point.name] = entry_point
    return found


def _load(group: str, name: str, source: EntryPoint | type) -> object:
    try:
        factory = source.load() if isinstance(source, EntryPoint) else source
        return factory()
    except Exception as error:  # an operator's plugin may fail in any way: say which
        raise PluginError(f"{group} entry point {name!r} failed to load: {error}") from error


def _load_all(
    group: str, built_in: Mapping[str, type], names: Sequence[str] | None, kind: type, what: str
) -> list[object]:
    found = _discovered(group, built_in)
    loaded: list[object] = []
    for name in list(found) if names is None else list(names):
        if name not in found:
            raise PluginError(f"no {what} named {name!r}; known: {', '.join(found)}")
        plugin = _load(group, name, found[name])
        if not isinstance(plugin, kind):
            raise PluginError(f"{what} {name!r} does not have the {kind.__name__} interface")
        loaded.append(plugin)
    return loaded


def load_filters(names: Sequence[str] | None = None) -> tuple[Filter, ...]:
    """Every discovered filter, or those named, in order."""
    loaded = _load_all(FILTER_GROUP, BUILT_IN_FILTERS, names, Filter, "filter")
    return tuple(f for f in loaded if isinstance(f, Filter))


def load_weighers(names: Sequence[str] | None = None) -> tuple[Weigher, ...]:
    """Every discovered weigher, or those named, in order."""
    loaded = _load_all(WEIGHER_GROUP, BUILT_IN_WEIGHERS, names, Weigher, "weigher")
    return tuple(w for w in loaded if isinstance(w, Weigher))
