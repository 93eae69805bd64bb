"""A placement request checked once, at the edge, and carried as checked from there.

Checking a :class:`~reservoir.protocol.placement.PlacementRequest`
(:func:`~reservoir.protocol.placement.checked_request`) is a round trip through the wire
format: every check a node's decoding makes. A front door (the library's keywords,
``reservoir request``'s and ``reservoir run``'s options, ``POST /v1/reservations``'s body)
makes it once, by :meth:`CheckedRequest.of`, and hands the requestor the
:class:`CheckedRequest`, which :meth:`~reservoir.runtime.requestor.Requestor.submit` and
:meth:`~reservoir.runtime.requestor.Requestor.run` place as it is. A request built
elsewhere (a library caller's own ``PlacementRequest``) is checked where it comes in,
by :meth:`CheckedRequest.check`, once.
"""

from __future__ import annotations

from typing import Any, final

from msgspec.structs import replace as msgspec_replace

from reservoir.protocol.placement import PlacementRequest, checked_request, request_of
from reservoir.runtime.request_ids import new_request_id

__all__ = ["CheckedRequest"]

#: what only this module's constructors hold: a CheckedRequest is made by them alone
_MADE_HERE = object()


@final
class CheckedRequest:
    """A :class:`~reservoir.protocol.placement.PlacementRequest` every field of which was
    checked as a node will check it. Immutable; made only by :meth:`of`, :meth:`check`
    and :meth:`identified` (a changed copy of ``request`` is a plain
    ``PlacementRequest`` again, to be checked anew)."""

    __slots__ = ("request",)

    request: PlacementRequest

    def __init__(self, request: PlacementRequest, made_here: object) -> None:
        if made_here is not _MADE_HERE:
            raise TypeError("a CheckedRequest is made by CheckedRequest.of or .check")
        object.__setattr__(self, "request", request)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a CheckedRequest does not change")

    def __repr__(self) -> str:
        return f"CheckedRequest({self.request!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CheckedRequest) and other.request == self.request

    def __hash__(self) -> int:
        return hash(self.request)

    @classmethod
    def of(cls, **fields: Any) -> CheckedRequest:
        """The request a front door's caller described, checked
        (:func:`~reservoir.protocol.placement.request_of`: ``fields`` are the request's
        and the shorthands ``vcpus``, ``memory_mb``, ``disk_gb``; None is not given).
        Raises :class:`~reservoir.protocol.placement.InvalidRequest`, or TypeError for a
        field a request does not have."""
        return cls(request_of(**fields), _MADE_HERE)

    @classmethod
    def check(cls, request: PlacementRequest) -> CheckedRequest:
        """``request``, checked (:func:`~reservoir.protocol.placement.checked_request`);
        raises :class:`~reservoir.protocol.placement.InvalidRequest`."""
        return cls(checked_request(request), _MADE_HERE)

    @property
    def request_id(self) -> str | None:
        """The caller's request id (the idempotency key), or None."""
        return self.request.request_id

    def identified(self) -> CheckedRequest:
        """This request with a request id: its own, else a fresh one, which needs no
        check (:func:`~reservoir.runtime.request_ids.new_request_id` makes only ids a
        node accepts)."""
        if self.request.request_id is not None:
            return self
        return CheckedRequest(
            msgspec_replace(self.request, request_id=new_request_id()), _MADE_HERE
        )
