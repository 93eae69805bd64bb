"""Reading a task's output where the node keeps it: per stream, files of bounded size
named after the offset of their first byte (written by the task's supervisor,
:class:`~reservoir.runtime.task_supervisor.RotatingOutput`). A reader asks for bytes
from an offset on, and learns which of them are no longer kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from reservoir.runtime.task_supervisor import OUTPUT_STREAMS, output_file_name, output_files
from reservoir.runtime.tasks import OutputChunk

__all__ = ["MAX_READ_BYTES", "read_output_dir", "write_output_dir"]

#: the most one read returns (a chunk must fit in one message, base64 and all)
MAX_READ_BYTES: Final = 32 * 1024
#: a read that meets a file rotated away while it read tries again this often
_ATTEMPTS: Final = 3


def read_output_dir(
    directory: Path, stream: str, offset: int, max_bytes: int
) -> OutputChunk | None:
    """Up to ``max_bytes`` of ``stream`` from ``offset`` on, as kept in ``directory``;
    None when there is no such directory (no output kept)."""
    if stream not in OUTPUT_STREAMS:
        raise ValueError(f"no output stream {stream!r}")
    max_bytes = max(0, min(max_bytes, MAX_READ_BYTES))
    for _ in range(_ATTEMPTS):
        if not directory.is_dir():
            return None
        files = output_files(directory, stream)
        if not files:
            return OutputChunk(offset=offset, size=0)
        try:
            return _read(files, offset, max_bytes)
        except FileNotFoundError:
            continue  # rotated while it was read: the listing is stale
    return OutputChunk(offset=offset, size=offset)


def _read(files: list[tuple[int, Path]], offset: int, max_bytes: int) -> OutputChunk:
    last_start, last_path = files[-1]
    size = last_start + last_path.stat().st_size
    first_start = files[0][0]
    skipped = 0
    if offset < first_start:
        skipped, offset = first_start - offset, first_start
    if offset >= size:
        return OutputChunk(offset=offset, skipped=skipped, size=size)
    parts: list[bytes] = []
    wanted = min(max_bytes, size - offset)
    position = offset
    for index, (start, path) in enumerate(files):
        if wanted <= 0:
            break
        end = files[index + 1][0] if index + 1 < len(files) else size
        if position >= end:
            continue
        with path.open("rb") as file:
            file.seek(position - start)
            data = file.read(min(wanted, end - position))
        if not data:
            break
        parts.append(data)
        position += len(data)
        wanted -= len(data)
    return OutputChunk(offset=offset, data=b"".join(parts), skipped=skipped, size=size)


def write_output_dir(directory: Path, stream: str, data: bytes) -> None:
    """Keep ``data`` as the whole of ``stream`` in ``directory`` (a container's output,
    copied out of the engine before the container goes)."""
    directory.mkdir(parents=True, exist_ok=True)
    for _, old in output_files(directory, stream):
        old.unlink(missing_ok=True)
    path = directory / output_file_name(stream, 0)
    path.write_bytes(data)
    path.chmod(0o640)
