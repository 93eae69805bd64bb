"""The requestor's timer keys, as typed values.

A machine asks its driver for a timer with ``SetTimer(key, at)`` and is called back with
the same key. Keys are frozen structs, so a firing is dispatched on its fields, never
on positions in a tuple, and a key of one conversation or attempt can never be mistaken
for another's. They are msgspec structs rather than frozen dataclasses because several
are made, hashed and compared per placement: a frozen dataclass is built field by field
through ``object.__setattr__`` and hashed by a generated Python function, a frozen
struct both in C (docs/performance.md, "The runtime"). They are final: a firing is told
apart by its key's exact class (``type(key) is FreeTimer``), cheaper than ``isinstance``
on a struct.
"""

from __future__ import annotations

from enum import StrEnum
from typing import final

import msgspec

__all__ = ["ConversationTimer", "FreeTimer", "TimerKind"]


class TimerKind(StrEnum):
    """What a conversation's timer is for."""

    #: an attempt's collect window closed: decide with the offers in hand
    COLLECT = "collect"
    #: nobody (or not everyone probed) answered an attempt in time: decide or widen
    WIDEN = "widen"
    #: awards are unanswered: re-send them, or give up on them
    AWARD = "award"
    #: the caller's timeout
    DEADLINE = "deadline"
    #: a back-off is over: ask again
    RETRY = "retry"
    #: a Lookup's holders have had their chance to answer
    LOOKUP = "lookup"


#: the kinds that belong to one attempt (a firing for an earlier attempt is stale)
PER_ATTEMPT = frozenset({TimerKind.COLLECT, TimerKind.WIDEN})


@final
class ConversationTimer(msgspec.Struct, frozen=True):
    """A timer of the conversation placing ``request_id``; ``attempt`` is set for the kinds
    that belong to one attempt and 0 otherwise."""

    request_id: str
    kind: TimerKind
    attempt: int = 0


@final
class FreeTimer(msgspec.Struct, frozen=True):
    """Re-send the unconfirmed frees of ``request_id`` (``notify``: a caller waits)."""

    request_id: str
    notify: bool
