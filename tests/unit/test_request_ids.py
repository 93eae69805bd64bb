"""Request ids (``reservoir.runtime.request_ids``): shaped as ``uuid.uuid4().hex``, never
repeated, in this process, across threads or in a forked child, and read from the OS in
batches rather than one system call each."""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from reservoir.runtime import request_ids
from reservoir.runtime.request_ids import BATCH, new_request_id


def test_an_id_is_a_version_4_uuid_in_32_hex_digits() -> None:
    request_id = new_request_id()

    assert len(request_id) == 32
    parsed = uuid.UUID(hex=request_id)
    assert parsed.hex == request_id
    assert (parsed.version, parsed.variant) == (4, uuid.RFC_4122)


def test_ids_are_never_repeated_across_many_batches() -> None:
    ids = [new_request_id() for _ in range(10 * BATCH + 3)]

    assert len(set(ids)) == len(ids)


def test_threads_taking_ids_at_once_never_share_one() -> None:
    taken: list[list[str]] = [[] for _ in range(8)]

    def take(mine: list[str]) -> None:
        mine.extend(new_request_id() for _ in range(2 * BATCH))

    threads = [threading.Thread(target=take, args=(mine,)) for mine in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    every = [request_id for mine in taken for request_id in mine]
    assert len(set(every)) == len(every) == 8 * 2 * BATCH


def test_the_os_is_asked_once_for_each_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    real = os.urandom

    def counted(size: int) -> bytes:
        reads.append(size)
        return real(size)

    monkeypatch.setattr(request_ids.os, "urandom", counted)
    for _ in range(3 * BATCH):  # whatever the pool held before, three reads at most
        new_request_id()

    assert reads == [16 * BATCH] * 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_hand_out_its_parents_next_ids() -> None:
    new_request_id()  # the parent's pool holds unread ids as it forks
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's side, reported through the pipe
        try:
            os.write(writer, "".join(new_request_id() for _ in range(BATCH)).encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        text = pipe.read()
    os.waitpid(child, 0)
    childs = {text[i : i + 32] for i in range(0, len(text), 32)}
    parents = {new_request_id() for _ in range(BATCH)}

    assert len(childs) == BATCH
    assert childs.isdisjoint(parents)
