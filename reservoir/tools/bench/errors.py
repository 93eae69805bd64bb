"""What goes wrong in a ``reservoir bench`` run, and the exit status it calls for."""

from __future__ import annotations

from reservoir.exit_status import EXIT_RUN_FAILED

__all__ = ["BenchError"]


class BenchError(RuntimeError):
    """The run could not be carried out (a node process died, nodes never came up)."""

    def __init__(self, message: str, exit_status: int = EXIT_RUN_FAILED) -> None:
        super().__init__(message)
        self.exit_status = exit_status
