"""The participants' addresses: the one place that says what a node's or a requestor's
inbox is called. A node's is stable across its restarts (its name), so a requestor's award
or free finds it again; the broker's permissions (deploy/rabbitmq) are written against
these prefixes too."""

from __future__ import annotations

from typing import Final

__all__ = ["NODE_PREFIX", "REQUESTOR_PREFIX", "node_address", "requestor_address"]

NODE_PREFIX: Final = "reservoir.node."
REQUESTOR_PREFIX: Final = "reservoir.requestor."


def node_address(name: str) -> str:
    """The inbox address of the node called ``name``."""
    return NODE_PREFIX + name


def requestor_address(name: str) -> str:
    """The inbox address of the requestor (or auditor, or dry run) called ``name``."""
    return REQUESTOR_PREFIX + name
