"""Messages to bytes and back, refusing anything a participant must not act on.

:class:`Codec` is the only way a message enters or leaves a participant. Decoding checks,
in order: size; then, when keys are configured, the envelope, the key (known, and of the
role that sends this kind), the signature, the destination, freshness and replay; then
JSON well-formedness and the message schema; last, that the signed role and sender are
the message's own. Each refusal raises :class:`DecodeError` with a short ``reason`` that
the runtime counts; nothing malformed, oversized, unsigned, forged, misrouted or replayed
ever reaches a state machine.

Wire format: unsigned messages are the message's JSON. Signed ones are one header line and
the JSON::

    RSV2 <role> <key id> <wall-clock stamp> <nonce> <destination> <sender> <signature>\\n<JSON>

The signature (HMAC-SHA256, or Ed25519 for such keys: see :mod:`reservoir.runtime.keys`) covers
the header up to the signature, a newline and the JSON, byte for byte: the role, key id,
stamp, nonce, routing key or address it was sent to, and sender cannot be changed without
the key. With a node keyring (keys per node), a node message's key is looked up among the
keys of the node its sender names, so no node can sign in another's name. No header field
contains a space or a newline, so the split is unambiguous. The algorithm is the one of the
key the receiver holds under that id, never read from the message, so no one can choose a
weaker check for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import threading
from collections import OrderedDict, deque
from typing import Final, NoReturn

import msgspec

from reservoir.protocol.compatibility import RELEASE_LINES, backport
from reservoir.protocol.messages import (
    PROTOCOL_VERSION,
    InvalidField,
    Message,
    decode_message,
    encode_message,
    validation_error_at,
)
from reservoir.runtime.keys import ROLES, Keyring, Role, kinds_of, role_of
from reservoir.runtime.keys.nodes import NodeKeyring

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_REPLAY_CACHE_ENTRIES",
    "SIGNATURE_REASONS",
    "Codec",
    "DecodeError",
    "DropWarnings",
]

DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024
#: The most message ids a codec remembers for replay detection (about 170 bytes each, so
#: about 45 MB when full; full means 8,000 messages a second received for 30 s).
DEFAULT_REPLAY_CACHE_ENTRIES: Final = 250_000
_MAGIC: Final = b"RSV2"
_HEADER_FIELDS: Final = 8
_FIELD = re.compile(rb"^[\x21-\x7e]{1,300}$")  # printable ASCII, no space
#: how many nodes sharing a key id a refused node message is checked against, to name
#: an impersonator (a bound, since the message chooses the id)
_MAX_HOLDERS_CHECKED: Final = 4

#: The reasons that say a key or a clock is wrong (or someone is forging): a participant
#: warns about these, rate-limited, rather than only counting them.
SIGNATURE_REASONS: Final = frozenset(
    {
        "unsigned",
        "unexpected_signature",
        "bad_envelope",
        "unknown_key",
        "wrong_role",
        "bad_signature",
        "wrong_destination",
        "wrong_sender",
        "impersonation",
        "stale",
    }
)


class DecodeError(ValueError):
    """A body that must be dropped. ``reason`` is a counter name: ``oversized``,
    ``malformed``, ``unknown_kind``, ``unsupported_version``, ``invalid``, ``replayed``,
    or one of
    :data:`SIGNATURE_REASONS`. ``sender`` is who the envelope claims sent it, when it
    got that far (unverified unless the reason is about the message after its
    signature)."""

    def __init__(
        self,
        reason: str,
        detail: str,
        sender: str | None = None,
        *,
        node_key: bool = False,
        key_id: str | None = None,
        signed_body: bytes | None = None,
    ) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.sender = sender
        #: a node message refused for its key against the node keyring (``impersonation``
        #: or ``unknown_key``): the node it claims to be can be told (it cannot see it)
        self.node_key = node_key
        #: the id of the key that signed it, for a ``node_key`` refusal
        self.key_id = key_id
        #: for ``impersonation``, the message's JSON, which a real key of another node
        #: signed: not to be believed, only to tell which request it answered
        self.signed_body = signed_body


class Codec:
    """Encodes and decodes messages; thread-safe.

    ``keys`` turns signing on (``secret`` is the old single shared secret, the same as
    ``Keyring.shared_secret(secret)``). ``role`` is who this codec speaks for: it signs
    only that role's kinds, with that role's current key. A codec without a role signs
    any kind with its role's current key (tools and tests). ``compatible_with`` is the
    oldest release line its messages must be read by (the line before this one, unless
    every participant runs this one): what that line's readers would refuse is left out
    (:func:`~reservoir.protocol.compatibility.backport`)."""

    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        keys: Keyring | None = None,
        secret: bytes | None = None,
        role: Role | None = None,
        replay_window_s: float = 30.0,
        replay_cache_entries: int = DEFAULT_REPLAY_CACHE_ENTRIES,
        compatible_with: str = RELEASE_LINES[-2],
    ) -> None:
        if compatible_with not in RELEASE_LINES:
            raise ValueError(
                f"compatible_with {compatible_with!r}: this release runs beside "
                f"{' and '.join(RELEASE_LINES)} only"
            )
        if secret is not None:
            if keys is not None:
                raise ValueError("give keys or a shared secret, not both")
            if len(secret) < 16:
                raise ValueError("a signing secret must be at least 16 bytes")
            keys = Keyring.shared_secret(secret)
        if (
            keys is not None
            and role == "node"
            and keys.node_identities is not None
            and not keys.node
        ):
            raise ValueError(
                "a node needs a key of its own to sign with (RESERVOIR_NODE_KEY, or "
                "--node-key): the node keyring holds only public keys"
            )
        if keys is not None and role is not None and keys.signing_key(role) is None:
            raise ValueError(
                f"the {role} role's current (first) key cannot sign: a {role} needs its own "
                "private key first in its list"
            )
        self.max_bytes = max_bytes
        self.keys = keys
        self.role = role
        self.replay_window_s = replay_window_s
        self.replay_cache_entries = replay_cache_entries
        self.compatible_with = compatible_with
        #: digest of (sender, nonce) -> stamp, oldest stamp first (near enough: they arrive
        #: in order); a 16-byte digest keeps an entry small whatever the sender's name
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        #: once the cache is full, the stamp of the newest id it had to forget: anything
        #: stamped at or before it can no longer be told from a replay, so it is refused
        self._forgotten_up_to_s = float("-inf")
        self._lock = threading.Lock()

    @property
    def signing(self) -> bool:
        return self.keys is not None

    def encode(self, message: Message, wall_s: float, *, destination: str) -> bytes:
        """``destination`` is the routing key it is published with, or the address it is
        sent to: the receiver checks it is where the message was meant to go."""
        body = encode_message(backport(message, self.compatible_with))
        if self.keys is None:
            return body
        role = role_of(message.kind)
        if self.role is not None and role != self.role:
            raise ValueError(f"a {self.role} does not send {message.kind!r} messages")
        if role == "node" and self.keys.own_key is not None:
            self.keys.own_key.recheck(wall_s)  # a node's key file may have been replaced
        key = self.keys.signing_key(role)
        if key is None:
            raise ValueError(f"no key to sign a {role}'s {message.kind!r} with")
        fields = [
            _MAGIC,
            role.encode(),
            key.key_id.encode(),
            f"{wall_s:.6f}".encode(),
            secrets.token_hex(12).encode(),
            destination.encode(),
            message.sender.encode(),
        ]
        if not all(_FIELD.match(f) for f in fields):
            raise ValueError(f"destination {destination!r} cannot go in an envelope")
        unsigned = b" ".join(fields)
        signature = key.sign(unsigned + b"\n" + body)
        return unsigned + b" " + signature + b"\n" + body

    def decode(
        self, body: bytes, wall_s: float, *, destination: str | None, check_replay: bool = True
    ) -> Message:
        """Parse ``body`` or raise :class:`DecodeError`. ``destination`` is the routing
        key it arrived with, or our address for a direct send; None (with
        ``check_replay=False``) is for our own messages handed back by the broker as
        unroutable, which may name any destination and may come twice."""
        if len(body) > self.max_bytes:
            raise DecodeError("oversized", f"{len(body)} bytes > limit {self.max_bytes}")
        signed_role: Role | None = None
        sender: str | None = None
        if self.keys is not None:
            body, signed_role, sender = self._verify(body, wall_s, destination, check_replay)
        elif body.startswith(_MAGIC + b" ") or body.startswith(b"RSV1."):
            raise DecodeError("unexpected_signature", "signed message but no keys configured")
        try:
            message = decode_message(body)
        except msgspec.ValidationError as error:
            raise DecodeError(*_refusal(error), sender) from None
        except InvalidField as error:
            raise DecodeError("invalid", str(error), sender) from None
        except (msgspec.DecodeError, UnicodeDecodeError):
            raise DecodeError("malformed", "not a JSON object", sender) from None
        except RecursionError:
            # msgspec parses nested values (hints, an unknown field) recursively
            raise DecodeError("malformed", "nested too deep", sender) from None
        if signed_role is not None and message.kind not in kinds_of(signed_role):
            raise DecodeError(
                "wrong_role",
                f"a {message.kind!r} signed with a {signed_role} key: only a "
                f"{role_of(message.kind)} may send it",
                sender,
            )
        if sender is not None and message.sender != sender:
            raise DecodeError(
                "wrong_sender", f"signed by {sender!r}, claims {message.sender!r}", sender
            )
        return message

    def _verify(
        self, signed: bytes, wall_s: float, destination: str | None, check_replay: bool
    ) -> tuple[bytes, Role, str]:
        assert self.keys is not None
        if not signed.startswith(_MAGIC + b" "):
            if signed.startswith(b"RSV1."):
                raise DecodeError(
                    "bad_envelope", "an RSV1 envelope (an older reservoir): upgrade the sender"
                )
            raise DecodeError("unsigned", "a signature is required", _claimed_sender(signed))
        header, newline, body = signed.partition(b"\n")
        fields = header.split(b" ")
        if not newline or len(fields) != _HEADER_FIELDS or not all(map(_FIELD.match, fields)):
            raise DecodeError("bad_envelope", "the signature envelope is malformed")
        # ASCII by the pattern above, so these decode
        _, role_b, key_id_b, stamp_b, nonce, destination_b, sender_b, signature = fields
        sender = sender_b.decode()
        role, key_id = role_b.decode(), key_id_b.decode()
        if role not in ROLES:
            raise DecodeError("bad_envelope", f"no role {role!r}", sender)
        signed_role: Role = "node" if role == "node" else "requestor"
        identities = self.keys.node_identities
        if signed_role == "node" and identities is not None:
            # keys per node: only the node the message claims to be from can have signed it
            key = identities.find(sender, key_id, wall_s)
            if key is None:
                self._refuse_other_nodes_key(identities, header, signature, body, key_id, sender)
        else:
            key = self.keys.find(signed_role, key_id)
        if key is None:
            other: Role = "node" if signed_role == "requestor" else "requestor"
            if self.keys.find(other, key_id) is not None:
                raise DecodeError(
                    "wrong_role", f"key {key_id!r} is a {other} key, not a {role} key", sender
                )
            raise DecodeError(
                "unknown_key", f"no {role} key {key_id!r} here (rolled over?)", sender
            )
        if not key.verify(header[: -len(signature) - 1] + b"\n" + body, signature):
            raise DecodeError("bad_signature", f"does not match {role} key {key_id!r}", sender)
        if destination is not None and destination_b.decode() != destination:
            raise DecodeError(
                "wrong_destination",
                f"signed for {destination_b.decode()!r}, arrived at {destination!r}",
                sender,
            )
        if not check_replay:
            return body, signed_role, sender
        try:
            sent_s = float(stamp_b)
        except ValueError:
            raise DecodeError("bad_envelope", "the stamp is not a number", sender) from None
        if not abs(wall_s - sent_s) <= self.replay_window_s:  # also refuses NaN
            raise DecodeError("stale", f"stamped {wall_s - sent_s:+.1f}s away from now", sender)
        message_id = hashlib.blake2b(sender_b + b" " + nonce, digest_size=16).digest()
        with self._lock:
            self._forget_before(wall_s - self.replay_window_s)
            if message_id in self._seen:
                raise DecodeError("replayed", "this exact message was received before", sender)
            if sent_s <= self._forgotten_up_to_s:
                raise DecodeError(
                    "stale", "older than what the full replay cache still remembers", sender
                )
            self._seen[message_id] = sent_s
            while len(self._seen) > self.replay_cache_entries:
                _, forgotten_s = self._seen.popitem(last=False)
                self._forgotten_up_to_s = max(self._forgotten_up_to_s, forgotten_s)
        return body, signed_role, sender

    @staticmethod
    def _refuse_other_nodes_key(
        identities: NodeKeyring,
        header: bytes,
        signature: bytes,
        body: bytes,
        key_id: str,
        sender: str,
    ) -> NoReturn:
        """Why a node message signed with a key its claimed sender does not list is refused:
        ``impersonation`` when another node's key really signed it (that node is named: it
        is the one to look at), else ``unknown_key``. Only messages that are refused anyway
        pay for the extra checks, and only a few of them, since ids are few per node."""
        for holder, key in identities.holders(key_id)[:_MAX_HOLDERS_CHECKED]:
            if key.verify(header[: -len(signature) - 1] + b"\n" + body, signature):
                raise DecodeError(
                    "impersonation",
                    f"signed with the key {key_id!r} of node {holder!r}, claims to be {sender!r}",
                    sender,
                    node_key=True,
                    key_id=key_id,
                    signed_body=body,
                )
        raise DecodeError(
            "unknown_key",
            f"node {sender!r} has no key {key_id!r} in the node keyring (a new node, or a "
            "key rolled over?)",
            sender,
            node_key=True,
            key_id=key_id,
        )

    def _forget_before(self, oldest_s: float) -> None:
        # Ids arrive roughly in stamp order, so the oldest sit at the front.
        while self._seen:
            message_id, sent_s = next(iter(self._seen.items()))
            if sent_s >= oldest_s:
                break
            del self._seen[message_id]

    def replay_cache_size(self) -> int:
        with self._lock:
            return len(self._seen)


class DropWarnings:
    """One warning per (reason, sender) per ``interval_s`` for messages dropped for a
    signature reason, so a wrong key shows in the log within seconds without an attacker
    being able to flood it. A forger chooses the sender names, so it remembers at most
    ``max_entries`` pairs and warns at most ``max_warnings`` times an interval in all
    (saying once when it stops). The clock is the caller's."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = 60.0,
        max_entries: int = 1024,
        max_warnings: int = 20,
    ) -> None:
        self._log = logger
        self.interval_s = interval_s
        self.max_entries = max_entries
        self.max_warnings = max_warnings
        self._last_s: OrderedDict[tuple[str, str | None], float] = OrderedDict()
        self._suppressed: dict[tuple[str, str | None], int] = {}
        #: when each of the latest warnings was given, for the overall limit
        self._recent_s: deque[float] = deque()
        self._lock = threading.Lock()

    def dropped(self, participant: str, error: DecodeError, now_s: float) -> bool:
        """Note a drop; log a warning if this reason and sender have not been warned about
        within the interval. Returns whether it warned."""
        if error.reason not in SIGNATURE_REASONS:
            return False
        pair = (error.reason, error.sender)
        with self._lock:
            last_s = self._last_s.get(pair)
            if last_s is not None and now_s - last_s < self.interval_s:
                self._suppressed[pair] = self._suppressed.get(pair, 0) + 1
                return False
            while self._recent_s and now_s - self._recent_s[0] >= self.interval_s:
                self._recent_s.popleft()
            if len(self._recent_s) > self.max_warnings:
                return False
            self._recent_s.append(now_s)
            if len(self._recent_s) > self.max_warnings:
                self._log.warning(
                    "%s is dropping messages for signature reasons from many senders; no "
                    "more warnings for up to %.0f s (the dropped{reason=...} counters go on)",
                    participant,
                    self.interval_s,
                )
                return True
            self._last_s.pop(pair, None)
            self._last_s[pair] = now_s
            while len(self._last_s) > self.max_entries:
                oldest, _ = self._last_s.popitem(last=False)
                self._suppressed.pop(oldest, None)
            since = self._suppressed.pop(pair, 0)
        self._log.warning(
            "%s dropped a message from %s: %s (%s)%s; counted as dropped{reason=%s}; at most "
            "one warning per reason and sender every %.0f s",
            participant,
            repr(error.sender) if error.sender else "an unknown sender",
            error.reason,
            error.detail,
            f", and {since} more like it since the last warning" if since else "",
            error.reason,
            self.interval_s,
        )
        return True


def _claimed_sender(body: bytes) -> str | None:
    """Who an unsigned message says it is from, for the warning only (a participant with
    no keys configured is the usual cause); None when it does not say."""
    try:
        sender = json.loads(body).get("sender")
    except (ValueError, AttributeError, RecursionError):
        return None
    return sender[:200] if isinstance(sender, str) else None


def _refusal(error: msgspec.ValidationError) -> tuple[str, str]:
    """The reason and detail of a body that is JSON but no valid message: the detail names
    the field, ``allocations[0].slots: Expected `int` >= 1``."""
    where, what = validation_error_at(error)
    if not where and what.startswith("Expected `object`"):
        return "malformed", "not a JSON object"
    if where == "kind" or what == "Object missing required field `kind`":
        return "unknown_kind", f"kind: {what}"
    if where == "version":
        # a protocol version this release does not speak (docs/design.md, "Upgrades")
        return "unsupported_version", f"version: {what} (this reservoir speaks {PROTOCOL_VERSION})"
    return "invalid", f"{where or 'message'}: {what}"
