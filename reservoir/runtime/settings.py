"""Settings shared by every participant, read from ``RESERVOIR_*`` environment variables.

Every field can also be passed directly (``Settings(ttl_s=3.0)``); command-line options
override both. A node's configuration file sits beneath the environment: which of its
settings, the environment's and the flags' a node runs with is decided in one place,
:func:`reservoir.runtime.node_setup.node_setup`, whose
:meth:`~reservoir.runtime.node_setup.NodeSetup.settings_fields` the node's settings are
made from. Defaults are those of docs/design.md. Signing keys come from here too
(``RESERVOIR_SECRET``, or ``RESERVOIR_NODE_KEYS`` and ``RESERVOIR_REQUESTOR_KEYS``, or
``RESERVOIR_KEYS_FILE``, with ``RESERVOIR_NODE_KEY`` and ``RESERVOIR_NODE_KEYRING`` for keys
per node; see :mod:`reservoir.runtime.keys`) and are checked when the settings are made, so a
bad key fails at start with the setting's name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    Field,
    PlainSerializer,
    PlainValidator,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from reservoir.brokers import BrokerUrl
from reservoir.protocol.compatibility import RELEASE_LINES
from reservoir.protocol.policies import POLICIES
from reservoir.protocol.tiers import DEFAULT_TIERS, TierLadder
from reservoir.runtime.keys import Keyring, Role
from reservoir.runtime.wire import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_REPLAY_CACHE_ENTRIES, Codec

__all__ = ["BrokerUrlSetting", "Settings"]

#: a broker URL setting: parsed once, here, into a :class:`~brokers.BrokerUrl` (a bad one
#: is a ValueError naming the setting; a scheme no adapter serves is
#: :class:`~reservoir.broker.UnsupportedBroker`, which the commands report as a usage error
#: with a suggestion),
#: shown with its password masked
BrokerUrlSetting = Annotated[
    BrokerUrl,
    NoDecode,  # the environment's text is the URL, not JSON
    PlainValidator(BrokerUrl.parse),
    PlainSerializer(lambda url: url.display),
]


class Settings(BaseSettings):
    """reservoir's settings. Environment: ``RESERVOIR_<FIELD>``, e.g. ``RESERVOIR_TTL_S``."""

    # Errors must not echo what was given: it may be a key.
    model_config = SettingsConfigDict(
        env_prefix="RESERVOIR_", frozen=True, extra="forbid", hide_input_in_errors=True
    )

    #: where the broker is (``memory://`` is an in-process broker); None when nothing
    #: names one: the commands that talk to a cluster then refuse to start, and a library
    #: object given neither a broker nor a URL opens ``reservoir.brokers.connect``'s default
    broker_url: BrokerUrlSetting | None = None
    #: one shared secret for both roles (the first form of signing, still supported): when
    #: set, every message is signed and unsigned ones are dropped, but any participant can
    #: sign any kind; the per-role keys below separate the roles
    secret: SecretStr | None = None
    #: the node role's keys, ``id:secret,id:secret``, the current one first (see
    #: reservoir.runtime.keys for Ed25519 entries); a node signs with the first, everyone verifies
    #: node messages with any of them
    node_keys: SecretStr | None = None
    #: the requestor role's keys (requestors and auditors), in the same form
    requestor_keys: SecretStr | None = None
    #: a JSON or TOML file with both roles' keys, instead of the two settings above
    keys_file: Path | None = None
    #: this node's own key: a file with one ``id:ed25519:...`` entry (``reservoir keys
    #: add-node`` makes one); instead of ``node_keys``, with ``node_keyring`` on the others
    node_key: Path | None = None
    #: a directory with every node's public keys, ``NAME.pub`` per node: node messages are
    #: believed only when signed by a key of the node they claim to be from
    node_keyring: Path | None = None
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=1024)
    #: signed messages stamped further than this from the receiver's clock are dropped
    replay_window_s: float = Field(default=30.0, gt=0)
    #: the most recent message ids kept to refuse replays (bounds the codec's memory)
    replay_cache_entries: int = Field(default=DEFAULT_REPLAY_CACHE_ENTRIES, ge=1000)
    #: the ``participant`` label of a requestor's metrics (default: the host name and the
    #: process's role, e.g. ``web-1/serve``): stable across restarts
    requestor_name: str | None = None
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
    #: where a requestor's roster comes from (docs/design.md, "Many requestors: roster
    #: keepers"): ``auto`` (samples from a roster keeper, ``reservoir keeper``, while one
    #: answers; every node's statuses while none does; switching both ways as keepers
    #: come and go), ``announcements`` (every node's statuses and a roll call of every
    #: node at start, never a keeper: what a placement costs grows with the requestors),
    #: or ``keeper`` (the same as ``auto``, its earlier name)
    roster_from: Literal["auto", "announcements", "keeper"] = "auto"
    #: how long ``Requestor.reserve`` waits by default
    request_timeout_s: float = Field(default=30.0, gt=0)
    #: how long a caller waiting on its tasks (``TaskRun.wait``, ``reservoir run``) hears
    #: nothing before it asks the nodes holding them: news sent while the requestor was
    #: reconnecting is lost, their answers are not
    task_check_s: float = Field(default=5.0, gt=0)
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
    #: the task drivers a node offers, by entry point name (``exec``, ``docker``); a
    #: request whose task names another is not offered. In the environment:
    #: ``RESERVOIR_TASK_DRIVERS=exec,docker``
    task_drivers: Annotated[tuple[str, ...], NoDecode] = ()
    #: the oldest release line every message must be read by (docs/upgrading.md): the
    #: line before this one while participants of it may run (the default), this one's
    #: once every participant runs it. Written for 0.1, messages leave out what 0.1
    #: refuses, nodes do not say their release and features in their statuses, and a
    #: request needing a feature of a later line is refused before anyone is asked
    compatible_with: str = RELEASE_LINES[-2]

    @field_validator("task_drivers", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(name.strip() for name in value.split(",") if name.strip())
        return value

    @field_validator("compatible_with")
    @classmethod
    def _known_line(cls, line: str) -> str:
        if line not in RELEASE_LINES:
            raise ValueError(
                f"{line!r} is no release line this release runs beside: "
                f"{' or '.join(RELEASE_LINES)} (the line before it, or its own)"
            )
        return line

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

    @model_validator(mode="after")
    def _usable_keys(self) -> Settings:
        self.keyring()  # raises KeyConfigError (a ValueError) naming the setting
        return self

    @property
    def ladder(self) -> TierLadder:
        return TierLadder(self.tiers)

    def keyring(self) -> Keyring | None:
        """The signing keys these settings describe (read afresh: a keys file may have
        been rolled over), or None when messages are not signed."""
        return Keyring.from_settings(
            secret=self.secret.get_secret_value() if self.secret else None,
            node_keys=self.node_keys.get_secret_value() if self.node_keys else None,
            requestor_keys=self.requestor_keys.get_secret_value() if self.requestor_keys else None,
            keys_file=self.keys_file,
            node_key=self.node_key,
            node_keyring=self.node_keyring,
        )

    def codec(self, role: Role | None = None) -> Codec:
        """A codec speaking for ``role`` (None: any role, for tools)."""
        return Codec(
            max_bytes=self.max_message_bytes,
            keys=self.keyring(),
            role=role,
            replay_window_s=self.replay_window_s,
            replay_cache_entries=self.replay_cache_entries,
            compatible_with=self.compatible_with,
        )
