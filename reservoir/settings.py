"""Settings shared by every participant, read from ``RESERVOIR_*`` environment variables.

Every field can also be passed directly (``Settings(ttl_s=3.0)``); command-line options
override both. Defaults are those of docs/design.md.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from reservoir.protocol.policies import POLICIES
from reservoir.protocol.tiers import DEFAULT_TIERS, TierLadder
from reservoir.wire import DEFAULT_MAX_MESSAGE_BYTES, Codec

__all__ = ["Settings"]


class Settings(BaseSettings):
    """reservoir's settings. Environment: ``RESERVOIR_<FIELD>``, e.g. ``RESERVOIR_TTL_S``."""

    model_config = SettingsConfigDict(env_prefix="RESERVOIR_", frozen=True, extra="forbid")

    #: where the broker is; ``memory://`` is the in-process broker
    broker_url: str = "memory://"
    #: shared secret: when set, every message is signed and unsigned ones are dropped
    secret: SecretStr | None = None
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=1024)
    #: signed messages stamped further than this from the receiver's clock are dropped
    replay_window_s: float = Field(default=30.0, gt=0)
    #: how long a node holds a reservation
    ttl_s: float = Field(default=5.0, gt=0, le=3600)
    tiers: tuple[int, ...] = DEFAULT_TIERS
    #: longest wait for a first offer before widening to the next tier
    max_widen_s: float = Field(default=2.0, gt=0)
    #: shortest wait for a first offer before widening (when latency says nobody's coming)
    min_widen_s: float = Field(default=0.05, gt=0)
    #: how the requestor picks winners: spread, pack or least-utilised
    policy: str = "spread"
    #: nodes a requestor probes per instance wanted (at least two), sampled from the
    #: emptiest tiers; more probes give the policy and node weighers more to choose from
    probe_factor: float = Field(default=2.0, gt=0, le=1000)
    #: sampling rounds, each twice as wide, before the exhaustive tier broadcast
    #: (0: always broadcast to whole tiers, as the first version of the protocol did)
    probe_rounds: int = Field(default=20, ge=0, le=40)
    #: how long ``Requestor.reserve`` waits by default
    request_timeout_s: float = Field(default=30.0, gt=0)
    #: where a node agent keeps its durable ledger (None: in memory only)
    state_dir: Path | None = None
    #: broker users (RabbitMQ's validated ``user_id``) allowed to send what requestors send
    #: (requests, awards, releases, frees); None: anyone the broker lets in
    requestor_users: frozenset[str] | None = None
    #: broker users allowed to send what nodes send (offers, acceptances, ...); None: anyone
    node_users: frozenset[str] | None = None
    #: node-side filters to run, by entry point name, in order (None: every one found)
    filters: tuple[str, ...] | None = None
    #: node-side weighers to use, by entry point name (None: every one found)
    weighers: tuple[str, ...] | None = None

    @field_validator("tiers")
    @classmethod
    def _valid_ladder(cls, tiers: tuple[int, ...]) -> tuple[int, ...]:
        TierLadder(tiers)
        return tiers

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
        return policy

    @property
    def ladder(self) -> TierLadder:
        return TierLadder(self.tiers)

    def codec(self) -> Codec:
        secret = self.secret.get_secret_value().encode() if self.secret else None
        return Codec(
            max_bytes=self.max_message_bytes,
            secret=secret,
            replay_window_s=self.replay_window_s,
        )
