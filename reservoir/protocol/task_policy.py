"""What a node lets a request's task do: the programs, images and environment variables
its operator allows (the ``[tasks]`` table of the node's configuration file). A node
declines a request whose task its policy refuses, and says why (``task_not_allowed``),
so that the refusal reaches the caller instead of a silence.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Final

from reservoir.protocol.messages import Reason, TaskSpec

__all__ = ["TASK_NOT_ALLOWED", "TaskPolicy"]

#: Decline reason: the node's policy does not allow the request's task
TASK_NOT_ALLOWED: Final = "task_not_allowed"


def _allowed(value: str, patterns: tuple[str, ...] | None) -> bool:
    return patterns is None or any(fnmatch.fnmatchcase(value, p) for p in patterns)


@dataclass(frozen=True)
class TaskPolicy:
    """Globs of what a task may use; None allows anything, an empty tuple nothing."""

    #: programs (the command's first word, as written: ``sh``, ``/opt/app/bin/*``)
    commands: tuple[str, ...] | None = None
    #: container images (``alpine:*``, ``registry.example.com/team/*``)
    images: tuple[str, ...] | None = None
    #: environment variables a request may set (``LANG``, ``APP_*``)
    env: tuple[str, ...] | None = None

    @property
    def restricts(self) -> bool:
        return self.commands is not None or self.images is not None or self.env is not None

    def refusal(self, task: TaskSpec) -> Reason | None:
        """Why the policy refuses ``task`` (None: it allows it)."""
        if task.command and not _allowed(task.command[0], self.commands):
            return Reason(
                code=TASK_NOT_ALLOWED,
                subject="command",
                detail=f"the command {task.command[0][:200]!r} is not allowed",
            )
        if task.image is not None and not _allowed(task.image, self.images):
            return Reason(
                code=TASK_NOT_ALLOWED,
                subject="image",
                detail=f"the image {task.image[:200]!r} is not allowed",
            )
        refused = sorted(name for name in task.env if not _allowed(name, self.env))
        if refused:
            names = ", ".join(refused)
            return Reason(
                code=TASK_NOT_ALLOWED,
                subject="env",
                detail=f"the environment variable(s) {names[:300]} may not be set",
            )
        return None
