"""Signing keys: which role signs with which key, which keys verify whom, and where the keys
come from (settings, environment or a small file).

There are two roles, ``node`` and ``requestor``; each message kind belongs to exactly one
(``NODE_KINDS`` and ``REQUESTOR_KINDS`` in :mod:`reservoir.protocol.messages`; an auditor
signs as a requestor). A :class:`Keyring` holds, per role, an ordered list of
keys: the first is the *current* one a participant of that role signs with, the rest are
still accepted, so a key can be rolled over by adding the new one everywhere, then moving
it first, then removing the old one.

A key is one of:

- ``id:secret``: HMAC-SHA256 with ``secret`` (at least 16 bytes). Whoever can verify with
  it can also sign with it: a node that verifies awards can forge them. See
  docs/design.md, "Signing", for what per-role HMAC keys do and do not give.
- ``id:ed25519:<base64 private key>``: an Ed25519 key that signs and verifies;
- ``id:ed25519-public:<base64 public key>``: an Ed25519 key that only verifies. A node
  given only the requestors' public keys cannot sign an award at all. Needs the
  ``cryptography`` package.

A node may instead have a key of its own (``RESERVOIR_NODE_KEY``, a file with its Ed25519
private entry), and requestors, keepers and auditors a :class:`NodeKeyring`
(``RESERVOIR_NODE_KEYRING``, a directory with one ``NAME.pub`` file of public entries per
node): then a node's message is believed only when it is signed with a key of the node it
claims to be, so no node can speak for another (docs/design.md, "Node identities").

``reservoir keys`` (:mod:`reservoir.cli.keys`) makes keys and keyring files.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import re
import secrets
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, cast

from reservoir.protocol.messages import NODE_KINDS, REQUESTOR_KINDS
from reservoir.version import install_hint

if TYPE_CHECKING:
    from reservoir.runtime.keys.nodes import NodeKeyFile, NodeKeyring

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

__all__ = [
    "MIN_SECRET_BYTES",
    "ROLES",
    "Key",
    "KeyConfigError",
    "Keyring",
    "Role",
    "generate",
    "kinds_of",
    "parse_keys",
    "read_key_file",
    "role_of",
]

# the logger's name predates the runtime package: operators' logging configs name it
log = logging.getLogger("reservoir.keys")

Role = Literal["node", "requestor"]
ROLES: Final[tuple[Role, ...]] = ("node", "requestor")
MIN_SECRET_BYTES: Final = 16
_KEY_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ED25519_KEY_BYTES: Final = 32


class KeyConfigError(ValueError):
    """Keys that cannot be used; the message names the setting they came from."""


def kinds_of(role: Role) -> frozenset[str]:
    """The message kinds a participant of ``role`` sends."""
    return NODE_KINDS if role == "node" else REQUESTOR_KINDS


def role_of(kind: str) -> Role:
    """The role that sends messages of ``kind``."""
    if kind in NODE_KINDS:
        return "node"
    if kind in REQUESTOR_KINDS:
        return "requestor"
    raise ValueError(f"no role sends {kind!r}")


class Key:
    """One key of a role, named by ``key_id`` on the wire. Its secret never appears in its
    ``repr``."""

    def __init__(
        self,
        key_id: str,
        *,
        hmac_secret: bytes | None = None,
        ed25519_private: Ed25519PrivateKey | None = None,
        ed25519_public: Ed25519PublicKey | None = None,
    ) -> None:
        if not _KEY_ID.match(key_id):
            raise ValueError(f"key id {key_id!r}: use 1 to 64 of A-Z a-z 0-9 _ . -")
        if sum(x is not None for x in (hmac_secret, ed25519_private, ed25519_public)) != 1:
            raise ValueError("a key is exactly one of an HMAC secret, or an Ed25519 key")
        if hmac_secret is not None and len(hmac_secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"key {key_id!r}: an HMAC secret must be at least {MIN_SECRET_BYTES} bytes, "
                f"this one is {len(hmac_secret)}"
            )
        self.key_id = key_id
        self._hmac_secret = hmac_secret
        self._private = ed25519_private
        if ed25519_private is not None:
            ed25519_public = ed25519_private.public_key()
        self._public = ed25519_public

    @property
    def algorithm(self) -> str:
        return "hmac-sha256" if self._hmac_secret is not None else "ed25519"

    @property
    def can_sign(self) -> bool:
        return self._hmac_secret is not None or self._private is not None

    def sign(self, data: bytes) -> bytes:
        """The signature of ``data`` as ASCII (hex for HMAC, base64url for Ed25519)."""
        if self._hmac_secret is not None:
            return hmac.new(self._hmac_secret, data, hashlib.sha256).hexdigest().encode()
        if self._private is None:
            raise ValueError(f"key {self.key_id!r} is a public key: it can only verify")
        return base64.urlsafe_b64encode(self._private.sign(data)).rstrip(b"=")

    def verify(self, data: bytes, signature: bytes) -> bool:
        if self._hmac_secret is not None:
            expected = hmac.new(self._hmac_secret, data, hashlib.sha256).hexdigest().encode()
            return hmac.compare_digest(expected, signature)
        from cryptography.exceptions import InvalidSignature

        assert self._public is not None
        try:
            raw = base64.urlsafe_b64decode(signature + b"=" * (-len(signature) % 4))
            self._public.verify(raw, data)
        except (InvalidSignature, ValueError):
            return False
        return True

    def public_entry(self) -> str:
        """This key as a verify-only entry (for an Ed25519 key: its public half)."""
        if self._public is None:
            raise ValueError(f"key {self.key_id!r} is an HMAC key: it has no public half")
        from cryptography.hazmat.primitives import serialization

        raw = self._public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return f"{self.key_id}:ed25519-public:{base64.b64encode(raw).decode()}"

    @property
    def fingerprint(self) -> str:
        """A short digest of the verifying half, to compare keys by eye; never the secret
        (for HMAC: a digest of a digest of it)."""
        if self._public is not None:
            from cryptography.hazmat.primitives import serialization

            raw = self._public.public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
        else:
            assert self._hmac_secret is not None
            raw = hashlib.sha256(self._hmac_secret).digest()
        return "SHA256:" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")

    def __repr__(self) -> str:
        kind = "private" if self.can_sign else "public"
        return f"Key({self.key_id!r}, {self.algorithm}, {kind})"


def _ed25519() -> type[Ed25519PrivateKey]:
    try:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    except ImportError:  # pragma: no cover - depends on the environment
        raise ValueError(
            f"Ed25519 keys need the 'cryptography' package: {install_hint('signing')}"
        ) from None
    return Ed25519PrivateKey


def _raw_ed25519(text: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise ValueError("not base64") from None
    if len(raw) != _ED25519_KEY_BYTES:
        raise ValueError(f"an Ed25519 key is {_ED25519_KEY_BYTES} bytes, this is {len(raw)}")
    return raw


def _parse_entry(entry: str) -> Key:
    key_id, colon, rest = entry.strip().partition(":")
    if not colon or not rest:
        raise ValueError("expected id:secret")
    if rest.startswith("ed25519:"):
        private = _ed25519().from_private_bytes(_raw_ed25519(rest[len("ed25519:") :]))
        return Key(key_id, ed25519_private=private)
    if rest.startswith("ed25519-public:"):
        _ed25519()  # says what to install when cryptography is missing
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        public = Ed25519PublicKey.from_public_bytes(_raw_ed25519(rest[len("ed25519-public:") :]))
        return Key(key_id, ed25519_public=public)
    return Key(key_id, hmac_secret=rest.encode())


def parse_keys(entries: str | Sequence[str], *, setting: str) -> tuple[Key, ...]:
    """Keys from ``id:secret,id:secret`` (or a list of entries), the current one first.
    Errors name ``setting`` and the entry's position, never the secret."""
    items = entries.split(",") if isinstance(entries, str) else list(entries)
    items = [entry for entry in items if entry.strip()]  # a trailing comma is no key
    keys: list[Key] = []
    for position, entry in enumerate(items, 1):
        try:
            keys.append(_parse_entry(entry))
        except ValueError as error:
            raise KeyConfigError(f"{setting}, key {position}: {error}") from None
    if not keys:
        raise KeyConfigError(f"{setting}: no keys")
    ids = [k.key_id for k in keys]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise KeyConfigError(f"{setting}: key id {', '.join(duplicates)} given twice")
    return tuple(keys)


@dataclass(frozen=True)
class Keyring:
    """Every key a participant knows, per role, the current one of each role first."""

    node: tuple[Key, ...]
    requestor: tuple[Key, ...]
    #: True for the single shared ``RESERVOIR_SECRET``: one key for both roles, so no
    #: role separation at all
    shared: bool = False
    #: with keys per node: whose key is whose, for verifying node messages (then ``node``
    #: holds at most this node's own key, and no key is believed for every node)
    node_identities: NodeKeyring | None = None
    #: this node's own key file, read again when it changes: then the node role's keys are
    #: its current key and the one it replaced (``node`` is what it held at start)
    own_key: NodeKeyFile | None = None

    def of(self, role: Role) -> tuple[Key, ...]:
        if role == "node" and self.own_key is not None:
            return self.own_key.in_use()
        return self.node if role == "node" else self.requestor

    def find(self, role: Role, key_id: str) -> Key | None:
        return next((k for k in self.of(role) if k.key_id == key_id), None)

    def signing_key(self, role: Role) -> Key | None:
        """The current key of ``role`` when it can sign, else None."""
        keys = self.of(role)
        return keys[0] if keys and keys[0].can_sign else None

    @classmethod
    def shared_secret(cls, secret: bytes, key_id: str = "shared") -> Keyring:
        key = Key(key_id, hmac_secret=secret)
        return cls(node=(key,), requestor=(key,), shared=True)

    @classmethod
    def from_file(
        cls, path: Path, *, setting: str = "RESERVOIR_KEYS_FILE", with_node: bool = True
    ) -> Keyring:
        """A JSON or TOML file (by its suffix) with a list of entries per role:
        ``{"node": ["n2:...", "n1:..."], "requestor": ["r1:ed25519-public:..."]}``.
        ``with_node=False`` (keys per node, given apart): the file has no ``node`` list."""
        where = f"{setting} ({path})"
        text = read_key_file(path, where)
        try:
            loaded = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except ValueError as error:
            raise KeyConfigError(
                f"{where}: not valid {path.suffix[1:] or 'JSON'}: {error}"
            ) from None
        if not isinstance(loaded, dict) or set(loaded) - set(ROLES):
            raise KeyConfigError(f"{where}: only the keys 'node' and 'requestor' belong here")
        if not with_node and "node" in loaded:
            raise KeyConfigError(
                f"{where}: has a 'node' list, but nodes have keys of their own "
                "(RESERVOIR_NODE_KEY, RESERVOIR_NODE_KEYRING): leave it out"
            )
        found: dict[str, tuple[Key, ...]] = {"node": ()}
        for role in ROLES if with_node else ("requestor",):
            entries = loaded.get(role)
            if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
                raise KeyConfigError(f"{where}: '{role}' must be a list of 'id:key' strings")
            found[role] = parse_keys(cast(list[str], entries), setting=f"{where} {role}")
        return cls(node=found["node"], requestor=found["requestor"])

    @classmethod
    def from_settings(
        cls,
        *,
        secret: str | None,
        node_keys: str | None,
        requestor_keys: str | None,
        keys_file: Path | None,
        node_key: Path | None = None,
        node_keyring: Path | None = None,
    ) -> Keyring | None:
        """The keyring the settings describe, or None when nothing is signed."""
        per_role = {
            "RESERVOIR_NODE_KEYS": node_keys,
            "RESERVOIR_REQUESTOR_KEYS": requestor_keys,
            "RESERVOIR_KEYS_FILE": keys_file,
            "RESERVOIR_NODE_KEY": node_key,
            "RESERVOIR_NODE_KEYRING": node_keyring,
        }
        given = [name for name, value in per_role.items() if value is not None]
        if secret is not None and given:
            raise KeyConfigError(
                f"RESERVOIR_SECRET (one key for both roles) and {', '.join(given)} are both "
                "set: use one or the other"
            )
        if secret is not None:
            try:
                return cls.shared_secret(secret.encode())
            except ValueError as error:
                raise KeyConfigError(f"RESERVOIR_SECRET: {error}") from None
        if node_key is not None or node_keyring is not None:
            return cls._per_node(node_key, node_keyring, node_keys, requestor_keys, keys_file)
        if keys_file is not None:
            if node_keys is not None or requestor_keys is not None:
                raise KeyConfigError(
                    "RESERVOIR_KEYS_FILE and RESERVOIR_NODE_KEYS/RESERVOIR_REQUESTOR_KEYS are "
                    "both set: put every key in the file, or none"
                )
            return cls.from_file(keys_file)
        if node_keys is None and requestor_keys is None:
            return None
        if node_keys is None or requestor_keys is None:
            missing = "RESERVOIR_NODE_KEYS" if node_keys is None else "RESERVOIR_REQUESTOR_KEYS"
            raise KeyConfigError(
                f"{missing} is not set: signing needs the keys of both roles (one's own to "
                "sign, the other's to verify)"
            )
        return cls(
            node=parse_keys(node_keys, setting="RESERVOIR_NODE_KEYS"),
            requestor=parse_keys(requestor_keys, setting="RESERVOIR_REQUESTOR_KEYS"),
        )

    @classmethod
    def _per_node(
        cls,
        node_key: Path | None,
        node_keyring: Path | None,
        node_keys: str | None,
        requestor_keys: str | None,
        keys_file: Path | None,
    ) -> Keyring:
        """Keys per node: this node's own key and/or the keyring of every node's public
        keys, with the requestor role's keys as ever."""
        if node_keys is not None:
            raise KeyConfigError(
                "RESERVOIR_NODE_KEYS (keys every node shares) and RESERVOIR_NODE_KEY or "
                "RESERVOIR_NODE_KEYRING (a key per node) are both set: use one or the other"
            )
        if keys_file is not None and requestor_keys is not None:
            raise KeyConfigError(
                "RESERVOIR_KEYS_FILE and RESERVOIR_REQUESTOR_KEYS are both set: put the "
                "requestor keys in the file, or none"
            )
        if keys_file is not None:
            requestor = cls.from_file(keys_file, with_node=False).requestor
        elif requestor_keys is not None:
            requestor = parse_keys(requestor_keys, setting="RESERVOIR_REQUESTOR_KEYS")
        else:
            raise KeyConfigError(
                "RESERVOIR_REQUESTOR_KEYS is not set: signing needs the requestor keys too "
                "(a node's to verify requests, a requestor's own to sign them)"
            )
        from reservoir.runtime.keys.nodes import NodeKeyFile, NodeKeyring

        own = NodeKeyFile(node_key) if node_key is not None else None
        identities = NodeKeyring(node_keyring) if node_keyring is not None else None
        return cls(
            node=own.in_use() if own is not None else (),
            requestor=requestor,
            node_identities=identities,
            own_key=own,
        )


def generate(key_id: str, *, ed25519: bool) -> tuple[str, str]:
    """A fresh key as (the entry that signs, the entry to give the verifiers). For HMAC
    both are the same secret."""
    if not ed25519:
        entry = f"{key_id}:{secrets.token_urlsafe(32)}"
        Key(key_id, hmac_secret=entry.partition(":")[2].encode())  # checks the id
        return entry, entry
    key_class = _ed25519()  # first: says what to install when cryptography is missing
    from cryptography.hazmat.primitives import serialization

    private = key_class.generate()
    raw = private.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )
    key = Key(key_id, ed25519_private=private)
    return f"{key_id}:ed25519:{base64.b64encode(raw).decode()}", key.public_entry()


def read_key_file(path: Path, where: str) -> str:
    """The text of a file holding private keys, with a warning when others can read it."""
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as error:
        raise KeyConfigError(f"{where}: cannot read it: {error.strerror}") from None
    if mode & 0o077:
        # Like ssh with a private key: say so, since anyone who can read it can sign.
        log.warning(
            "%s can be read by users other than its owner (mode %o): anyone who can "
            "read it can sign; chmod 600 it",
            where,
            mode & 0o777,
        )
    return text
