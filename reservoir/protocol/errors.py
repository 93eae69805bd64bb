"""The errors the protocol machines raise about themselves.

Its own module, never compiled (see ``setup.py``): mypyc cannot compile a subclass of a
built-in exception as a native class, and the machines that raise these are compiled.
"""

from __future__ import annotations

__all__ = ["ProtocolBug"]


class ProtocolBug(RuntimeError):
    """The requestor machine tried a transition its table does not allow."""
