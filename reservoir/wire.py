"""Messages to bytes and back, refusing anything a participant must not act on.

:class:`Codec` is the only way a message enters or leaves a participant. Decoding checks,
in order: size, signature (when a shared secret is configured), freshness and replay (for
signed messages), JSON well-formedness, and the message schema. Each refusal raises
:class:`DecodeError` with a short ``reason`` that the runtime counts; nothing malformed,
oversized, unsigned, forged or replayed ever reaches a state machine.

Wire format: unsigned messages are the message's JSON. Signed ones are
``RSV1.<wall-clock stamp>.<nonce>.<hex HMAC-SHA256>.<JSON>``, the MAC covering stamp, nonce
and JSON, so a stamp cannot be moved without the key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict
from typing import Final

from pydantic import ValidationError

from reservoir.protocol.messages import Message, message_adapter

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "Codec", "DecodeError"]

DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024
_SIGNED_PREFIX: Final = b"RSV1."


class DecodeError(ValueError):
    """A body that must be dropped. ``reason`` is a counter name: ``oversized``,
    ``malformed``, ``unknown_kind``, ``invalid``, ``unsigned``, ``bad_signature``, ``stale``
    or ``replayed``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Codec:
    """Encodes and decodes messages; thread-safe."""

    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        secret: bytes | None = None,
        replay_window_s: float = 30.0,
    ) -> None:
        if secret is not None and len(secret) < 16:
            raise ValueError("a signing secret must be at least 16 bytes")
        self.max_bytes = max_bytes
        self._secret = secret
        self.replay_window_s = replay_window_s
        self._seen_nonces: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def signing(self) -> bool:
        return self._secret is not None

    def encode(self, message: Message, wall_s: float) -> bytes:
        body = message.model_dump_json().encode()
        if self._secret is None:
            return body
        stamp = f"{wall_s:.6f}".encode()
        nonce = secrets.token_hex(12).encode()
        mac = self._mac(stamp, nonce, body)
        return b".".join((_SIGNED_PREFIX[:-1], stamp, nonce, mac, body))

    def decode(self, body: bytes, wall_s: float, *, check_replay: bool = True) -> Message:
        """Parse ``body`` or raise :class:`DecodeError`. ``check_replay=False`` is for our
        own messages handed back by the broker as unroutable."""
        if len(body) > self.max_bytes:
            raise DecodeError("oversized", f"{len(body)} bytes > limit {self.max_bytes}")
        if self._secret is not None:
            body = self._verify(body, wall_s, check_replay)
        elif body.startswith(_SIGNED_PREFIX):
            raise DecodeError("unexpected_signature", "signed message but no secret configured")
        try:
            return message_adapter.validate_json(body)
        except ValidationError as error:
            kinds = {e["type"] for e in error.errors()}
            if kinds & {"json_invalid", "json_type", "dict_type"}:
                raise DecodeError("malformed", "not a JSON object") from None
            if kinds & {"union_tag_invalid", "union_tag_not_found"}:
                raise DecodeError("unknown_kind", _first_error(error)) from None
            raise DecodeError("invalid", _first_error(error)) from None

    def _mac(self, stamp: bytes, nonce: bytes, body: bytes) -> bytes:
        assert self._secret is not None
        digest = hmac.new(self._secret, stamp + b"." + nonce + b"." + body, hashlib.sha256)
        return digest.hexdigest().encode()

    def _verify(self, signed: bytes, wall_s: float, check_replay: bool) -> bytes:
        if not signed.startswith(_SIGNED_PREFIX):
            raise DecodeError("unsigned", "a signature is required")
        parts = signed[len(_SIGNED_PREFIX) :].split(b".", 4)
        # the stamp itself contains one dot: seconds.microseconds
        if len(parts) != 5:
            raise DecodeError("bad_signature", "signature envelope is malformed")
        stamp = parts[0] + b"." + parts[1]
        nonce, mac, body = parts[2], parts[3], parts[4]
        if not hmac.compare_digest(mac, self._mac(stamp, nonce, body)):
            raise DecodeError("bad_signature", "signature does not match")
        if not check_replay:
            return body
        try:
            sent_s = float(stamp)
        except ValueError:
            raise DecodeError("bad_signature", "stamp is not a number") from None
        if abs(wall_s - sent_s) > self.replay_window_s:
            raise DecodeError("stale", f"stamped {wall_s - sent_s:+.1f}s away from now")
        with self._lock:
            self._forget_before(wall_s - self.replay_window_s)
            if nonce in self._seen_nonces:
                raise DecodeError("replayed", "this exact message was received before")
            self._seen_nonces[nonce] = sent_s
        return body

    def _forget_before(self, oldest_s: float) -> None:
        # Nonces arrive roughly in stamp order, so the oldest sit at the front.
        while self._seen_nonces:
            nonce, sent_s = next(iter(self._seen_nonces.items()))
            if sent_s >= oldest_s:
                break
            del self._seen_nonces[nonce]


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "message"
    return f"{where}: {first['msg']}"
