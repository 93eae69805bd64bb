"""Keys per node: a node's own key, and the keyring that says whose key is whose.

A node signs with a key of its own (``RESERVOIR_NODE_KEY``: a file with one
``id:ed25519:<private key>`` entry). Requestors, keepers and auditors hold a
:class:`NodeKeyring` (``RESERVOIR_NODE_KEYRING``): a directory with one file per node,
``<name>.pub``, listing that node's public keys, so a node message is believed only when it
is signed with a key of the node it claims to be from, and no node can speak for another.
docs/design.md, "Node identities", says why a keyring rather than certificates.
``reservoir keys add-node`` and ``retire`` (:mod:`reservoir.cli.keys`) keep the files.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from reservoir.runtime.keys import Key, KeyConfigError, parse_keys, read_key_file

__all__ = [
    "NODE_KEYRING_SUFFIX",
    "KeyStanding",
    "NodeKeyFile",
    "NodeKeyring",
    "add_node_key",
    "key_standing",
    "load_node_key",
    "node_keyring_file",
    "parse_node_file",
    "retire_node_key",
    "write_node_key",
]

log = logging.getLogger("reservoir.keys")

#: a node's file in a keyring directory is ``<node name>.pub``
NODE_KEYRING_SUFFIX: Final = ".pub"
#: what a keyring file's stem may be: a node name that is a plain file name
_NODE_FILE_STEM = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,199}$")


def _lines(text: str) -> list[str]:
    """The entries of a key file: one a line; blank lines and ``#`` comments skipped."""
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def load_node_key(path: Path, *, setting: str = "RESERVOIR_NODE_KEY") -> Key:
    """A node's own key: a file holding one ``id:ed25519:<private key>`` entry."""
    where = f"{setting} ({path})"
    entries = _lines(read_key_file(path, where))
    if len(entries) != 1:
        raise KeyConfigError(
            f"{where}: holds {len(entries)} keys; a node's key file holds exactly one, "
            "its current key (the keyring may list its old one during a rollover)"
        )
    (key,) = parse_keys(entries, setting=where)
    if key.algorithm != "ed25519" or not key.can_sign:
        raise KeyConfigError(
            f"{where}: a node's own key must be an Ed25519 private key (id:ed25519:...), "
            "so that requestors verify it with its public half and cannot sign with it; "
            "make one with `reservoir keys add-node`"
        )
    return key


#: what says a file may have changed: modification and change times (a chmod is a change),
#: size and inode (a file moved into place)
_Stamp = tuple[int, int, int, int]


def _stamp_of(st: os.stat_result) -> _Stamp:
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)


def _stamp(path: Path) -> _Stamp:
    return _stamp_of(path.stat())


class _Every:
    """Runs an action at most every ``interval_s`` seconds of the caller's clock (a clock
    set back counts as time gone by, so a jump never stops the looks). Thread-safe: of
    callers racing past the interval, one runs it."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last_s: float | None = None
        self._lock = threading.Lock()

    def _due(self, now_s: float) -> bool:
        last_s = self._last_s
        return last_s is None or abs(now_s - last_s) >= self.interval_s

    def run(self, now_s: float, action: Callable[[], None]) -> None:
        if not self._due(now_s):
            return
        with self._lock:
            if self._due(now_s):
                self._last_s = now_s
                action()


class NodeKeyFile:
    """A node's own key file, looked at again at most every ``recheck_s`` seconds of the
    caller's clock when the node signs: a new key put in its place (``mv``, so it is never
    read half written) is signed with from then on, with no restart. The key it replaced
    is still accepted on the node's own messages handed back by the broker. A file gone
    bad after start keeps the key it had, with a warning. Thread-safe."""

    def __init__(
        self, path: Path, *, recheck_s: float = 2.0, setting: str = "RESERVOIR_NODE_KEY"
    ) -> None:
        self.path = path
        self._setting = setting
        self._every = _Every(recheck_s)
        self._current = load_node_key(path, setting=setting)
        self._previous: Key | None = None
        try:
            self._stamp = _stamp(path)
        except OSError:  # pragma: no cover - it was just read
            self._stamp = (0, 0, 0, 0)
        #: the last problem warned about, so that it is said once, not every recheck
        self._problem: str | None = None

    def in_use(self) -> tuple[Key, ...]:
        """The current key first, then the one it replaced, if any."""
        current, previous = self._current, self._previous
        return (current,) if previous is None else (current, previous)

    @property
    def recheck_s(self) -> float:
        return self._every.interval_s

    def recheck(self, now_s: float) -> None:
        """Look at the file again if ``recheck_s`` has gone by since the last look."""
        self._every.run(now_s, self._look)

    def _look(self) -> None:
        try:
            stamp = _stamp(self.path)
        except OSError as error:
            self._cannot_use(str(error.strerror))
            return
        if stamp == self._stamp:
            return
        self._stamp = stamp  # a bad file is warned about once, not every recheck
        try:
            key = load_node_key(self.path, setting=self._setting)
        except KeyConfigError as error:
            self._cannot_use(str(error))
            return
        self._problem = None
        if key.key_id == self._current.key_id:
            if key.fingerprint != self._current.fingerprint:
                log.warning(
                    "%s (%s): a different key under the same id %r; keeping the one in "
                    "use: give a new key a new id",
                    self._setting,
                    self.path,
                    key.key_id,
                )
            return
        log.info(
            "%s (%s): now signing with key %r (was %r); requestors must have it in "
            "their node keyring",
            self._setting,
            self.path,
            key.key_id,
            self._current.key_id,
        )
        self._previous, self._current = self._current, key

    def _cannot_use(self, problem: str) -> None:
        if problem != self._problem:
            self._problem = problem
            log.warning("%s (%s): %s; still signing with key %r", self._setting, self.path,
                        problem, self._current.key_id)  # fmt: skip

    def __repr__(self) -> str:
        return f"NodeKeyFile({str(self.path)!r}, current={self._current.key_id!r})"


def parse_node_file(text: str, *, where: str) -> tuple[Key, ...]:
    """The public keys of one node's keyring file (one ``id:ed25519-public:...`` a line)."""
    keys = parse_keys(_lines(text), setting=where) if _lines(text) else ()
    for key in keys:
        if key.can_sign:
            raise KeyConfigError(
                f"{where}: key {key.key_id!r} can sign ({key.algorithm}); a keyring holds "
                "public keys only (id:ed25519-public:...), or every reader could speak "
                "for this node"
            )
    return keys


class NodeKeyring:
    """Whose key is whose: a directory with one file per node, ``<name>.pub``, each listing
    that node's public keys (more than one during a rollover). A requestor believes a node
    message only when the node it claims to be lists the key that signed it.

    The directory is read at start (a bad file is then an error naming it) and looked at
    again at most every ``recheck_s`` seconds of the caller's clock when a key is looked up:
    a node added, rolled over or removed is known within that, with no restart. A file
    that has become unreadable or bad on a later look keeps the keys it had (and is
    warned about), so a half-edited file cannot lock a node out. Thread-safe."""

    def __init__(
        self,
        directory: Path,
        *,
        recheck_s: float = 2.0,
        setting: str = "RESERVOIR_NODE_KEYRING",
    ) -> None:
        self.directory = directory
        self._where = f"{setting} ({directory})"
        self._every = _Every(recheck_s)
        #: file name -> what its stat said when read; a change means read it again
        self._stamps: dict[str, _Stamp] = {}
        self._keys: dict[str, tuple[Key, ...]] = {}
        self._reload(strict=True)

    @property
    def recheck_s(self) -> float:
        return self._every.interval_s

    def find(self, node: str, key_id: str, now_s: float) -> Key | None:
        """The key ``key_id`` of ``node``, or None when that node lists no such key."""
        self._recheck(now_s)
        return next((k for k in self._keys.get(node, ()) if k.key_id == key_id), None)

    def holders(self, key_id: str) -> list[tuple[str, Key]]:
        """Every node listing a key with this id (ids are chosen per node, so several may)."""
        return [(n, k) for n, keys in self._keys.items() for k in keys if k.key_id == key_id]

    def nodes(self) -> dict[str, tuple[Key, ...]]:
        """Every node named in the keyring and its keys, by name."""
        return dict(sorted(self._keys.items()))

    def _recheck(self, now_s: float) -> None:
        self._every.run(now_s, lambda: self._reload(strict=False))

    def _reload(self, *, strict: bool) -> None:
        try:
            stamps = self._scan()
        except OSError as error:
            if strict:
                raise KeyConfigError(
                    f"{self._where}: cannot read the directory: {error.strerror}"
                ) from None
            log.warning("%s: cannot read the directory: %s; keeping its keys", self._where, error)
            return
        if stamps == self._stamps:
            return
        keys: dict[str, tuple[Key, ...]] = {}
        for file_name, stamp in stamps.items():
            node = file_name[: -len(NODE_KEYRING_SUFFIX)]
            if stamp == self._stamps.get(file_name):
                # unchanged; a bad one was warned about when it changed, and keeps the
                # keys it had (if any)
                if node in self._keys:
                    keys[node] = self._keys[node]
                continue
            where = f"{self._where} {file_name}"
            try:
                keys[node] = parse_node_file((self.directory / file_name).read_text(), where=where)
            except (OSError, KeyConfigError) as error:
                # a KeyConfigError names the file already
                problem = f"{where}: {error.strerror}" if isinstance(error, OSError) else str(error)
                if strict:
                    raise KeyConfigError(problem) from None
                if node in self._keys:
                    keys[node] = self._keys[node]
                    log.warning("%s; keeping the keys it had", problem)
                else:
                    log.warning("%s; node %r has no keys until it is fixed", problem, node)
        # one assignment each: a lookup on another thread sees the old or the new map
        self._keys = keys
        self._stamps = stamps

    def _scan(self) -> dict[str, _Stamp]:
        stamps: dict[str, _Stamp] = {}
        with os.scandir(self.directory) as entries:
            for entry in entries:
                stem = entry.name[: -len(NODE_KEYRING_SUFFIX)]
                if not entry.name.endswith(NODE_KEYRING_SUFFIX) or not _NODE_FILE_STEM.match(stem):
                    continue
                try:
                    # follows symbolic links: Kubernetes mounts a ConfigMap's files as such
                    st = entry.stat()
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    stamps[entry.name] = _stamp_of(st)
        return stamps

    def __repr__(self) -> str:
        return f"NodeKeyring({str(self.directory)!r}, {len(self._keys)} node(s))"


@dataclass(frozen=True)
class KeyStanding:
    """Why requestors holding a node keyring would refuse what a node signs with its key:
    ``another_nodes`` when the keyring lists the key for another node (every message is
    ``impersonation``: the node must not run so), else a key the keyring does not list
    for it (``unknown_key``: a keyring not updated yet, here or there)."""

    problem: str
    another_nodes: bool


def key_standing(keyring: NodeKeyring, node: str, key: Key) -> KeyStanding | None:
    """What ``keyring`` says of ``node`` signing with ``key``: None when it lists that key
    for ``node``."""
    listed = keyring.nodes()
    fingerprint = key.fingerprint
    if any(k.key_id == key.key_id and k.fingerprint == fingerprint for k in listed.get(node, ())):
        return None
    owners = sorted(
        name
        for name, keys in listed.items()
        if name != node and any(k.fingerprint == fingerprint for k in keys)
    )
    if owners:
        return KeyStanding(
            f"its key {key.key_id!r} is node {owners[0]}'s in the node keyring "
            f"({node_keyring_file(keyring.directory, owners[0])}), not {node}'s: requestors "
            f"would refuse every message of {node} as impersonation (give it a key of its "
            f"own: reservoir keys add-node {node})",
            another_nodes=True,
        )
    return KeyStanding(
        f"the node keyring ({keyring.directory}) lists no key {key.key_id!r} for {node}: "
        "requestors reading it would refuse its messages as unknown_key until it does",
        another_nodes=False,
    )


def node_keyring_file(directory: Path, node: str) -> Path:
    """Where ``node``'s public keys live in a keyring directory."""
    if not _NODE_FILE_STEM.match(node):
        raise ValueError(
            f"node name {node!r} cannot name a keyring file: use up to 200 of "
            "A-Z a-z 0-9 _ . @ -, not starting with . or -"
        )
    return directory / f"{node}{NODE_KEYRING_SUFFIX}"


def _write_atomically(path: Path, text: str, mode: int) -> None:
    # a reader (a requestor re-reading the keyring) sees the old file or the new, never half
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def add_node_key(directory: Path, node: str, public_entry: str) -> tuple[Key, ...]:
    """Put a public key first in ``node``'s keyring file (made if need be), keeping the
    keys it lists (the overlap of a rollover); returns the node's keys now."""
    path = node_keyring_file(directory, node)
    where = str(path)
    old = parse_node_file(path.read_text(), where=where) if path.exists() else ()
    (new,) = parse_node_file(public_entry, where="the new key")
    if any(k.key_id == new.key_id for k in old):
        raise ValueError(f"{where} already lists a key {new.key_id!r}: give the new key another id")
    directory.mkdir(parents=True, exist_ok=True)
    entries = [new.public_entry(), *(k.public_entry() for k in old)]
    _write_atomically(path, _keyring_file_text(node, entries), 0o644)
    return (new, *old)


def retire_node_key(directory: Path, node: str, key_id: str) -> tuple[Key, ...]:
    """Take ``key_id`` out of ``node``'s keyring file (the end of a rollover); returns the
    keys left. The last key is not taken out: removing the file retires the node."""
    path = node_keyring_file(directory, node)
    if not path.exists():
        raise ValueError(f"{path}: no such file, so node {node!r} has no keys here")
    keys = parse_node_file(path.read_text(), where=str(path))
    left = tuple(k for k in keys if k.key_id != key_id)
    if len(left) == len(keys):
        listed = ", ".join(k.key_id for k in keys) or "none"
        raise ValueError(f"{path} lists no key {key_id!r} (it lists {listed})")
    if not left:
        raise ValueError(
            f"{key_id!r} is the last key of node {node!r}: to retire the node, delete {path}"
        )
    _write_atomically(path, _keyring_file_text(node, [k.public_entry() for k in left]), 0o644)
    return left


def write_node_key(path: Path, signing_entry: str, *, replace: bool) -> None:
    """Write a node's own key file, readable by its owner only."""
    if path.exists() and not replace:
        raise ValueError(f"{path} exists: give another path, or --force to replace it")
    text = "# a reservoir node's own signing key: keep it private (RESERVOIR_NODE_KEY)\n"
    _write_atomically(path, text + signing_entry + "\n", 0o600)


def _keyring_file_text(node: str, entries: Sequence[str]) -> str:
    header = f"# public keys of reservoir node {node}, the current one first\n"
    return header + "".join(f"{entry}\n" for entry in entries)
