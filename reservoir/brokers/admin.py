"""Topology administration: what a tool may do to a RabbitMQ beyond the Broker contract.

This module owns the capabilities the demo, the bench and the tests need and the broker
interface deliberately lacks: asking whether an exchange exists, and deleting exchanges
(reservoir's pair, ``<exchange>`` and ``<exchange>.inbox``). They sit behind the small
typed :class:`TopologyAdmin` protocol, reached through :func:`admin`, instead of a
``getattr`` on a broker. Each call runs over a short-lived connection of its own, so it
works before, during or after a broker's life, and names itself ``<client>:admin``.

Deleting an exchange takes every participant's bindings with it: a tool deletes only
exchanges it made itself for its own run. ``exchange_exists`` lets it tell, before it
declares anything, whether the exchange it was pointed at is someone else's, and
:func:`own_exchange` does the whole dance for a tool that wants a run of its own::

    with own_exchange(url, name=f"reservoir-demo-{run_id}") as run_url:
        broker = reservoir.brokers.connect(run_url)   # declares the exchanges; deleted afterwards
        ...

If the URL names (``?exchange=``) an exchange that already exists, :func:`own_exchange`
raises :class:`ExchangeInUse` and deletes nothing: live nodes and services on it keep
running.

Both RabbitMQ URL forms (``amqp://`` and ``kombu+amqp://``) reach the same RabbitMQ, so one
implementation (pika's blocking connection) serves both.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from reservoir.broker import BrokerError
from reservoir.brokers.url import BrokerUrl

if TYPE_CHECKING:
    import pika

__all__ = ["ExchangeInUse", "RabbitAdmin", "TopologyAdmin", "admin", "own_exchange"]


class ExchangeInUse(BrokerError):
    """The exchange a run was to make its own already exists: it is someone else's."""


@runtime_checkable
class TopologyAdmin(Protocol):
    """Exchange administration on the broker a URL names."""

    def exchange_exists(self, name: str) -> bool:
        """Whether the exchange ``name`` exists (a passive declare: needs no permission)."""
        ...

    def delete_exchanges(self, *names: str) -> None:
        """Delete these exchanges, with their bindings; one already gone is no error.
        Raises :class:`BrokerError` when the broker cannot be reached or refuses."""
        ...

    def delete_reservoir_exchanges(self) -> None:
        """Delete the URL's exchange and its inbox exchange."""
        ...


def admin(
    url: str | BrokerUrl, *, timeout_s: float = 10.0, client: str = "reservoir"
) -> TopologyAdmin | None:
    """The :class:`TopologyAdmin` for ``url``; None for ``memory://``, whose exchanges live
    and die with the broker object, so there is nothing to administer."""
    parsed = BrokerUrl.parse(url)
    if parsed.adapter == "memory":
        return None
    return RabbitAdmin(parsed, timeout_s=timeout_s, client=client)


@contextlib.contextmanager
def own_exchange(url: str | BrokerUrl, *, name: str) -> Iterator[BrokerUrl]:
    """``url`` on exchanges of this run's own, deleted when the block ends.

    The exchange is the URL's own ``?exchange=`` when it names one, else ``name``. If it (or
    its inbox exchange) exists already, it belongs to someone else: :class:`ExchangeInUse`,
    and nothing is deleted, then or later. (Someone creating it between this check and the
    run's first declare would share it with the run; a name of the run's own, such as one
    with a random part, avoids that.) On ``memory://`` the URL comes back as it is: its
    exchanges die with the broker object."""
    parsed = BrokerUrl.parse(url)
    if not parsed.exchange_given:
        parsed = parsed.with_exchange(name)
    topology = admin(parsed)
    if topology is None:
        yield parsed
        return
    taken = [n for n in (parsed.exchange, parsed.inbox_exchange) if topology.exchange_exists(n)]
    if taken:
        raise ExchangeInUse(
            f"exchange {taken[0]!r} already exists on {parsed.display}: another deployment may "
            "be using it, so this run will neither use nor delete it (name a new exchange, or "
            "none for a private one)"
        )
    try:
        yield parsed
    finally:
        topology.delete_reservoir_exchanges()


class RabbitAdmin:
    """:class:`TopologyAdmin` on RabbitMQ, over a blocking pika connection per call."""

    def __init__(self, url: BrokerUrl, *, timeout_s: float = 10.0, client: str = "reservoir"):
        self.url = url
        self._timeout_s = timeout_s
        self._client = client

    def exchange_exists(self, name: str) -> bool:
        import pika.exceptions  # only where RabbitMQ is used: memory:// needs no pika

        with self._connection() as connection:
            try:
                connection.channel().exchange_declare(name, passive=True)
            except pika.exceptions.ChannelClosedByBroker as error:
                if error.reply_code == 404:
                    return False
                raise BrokerError(f"asking for exchange {name!r}: {error}") from error
            return True

    def delete_exchanges(self, *names: str) -> None:
        import pika.exceptions

        with self._connection() as connection:
            for name in names:
                channel = connection.channel()
                try:
                    channel.exchange_delete(name)
                except pika.exceptions.ChannelClosedByBroker as error:
                    raise BrokerError(
                        f"RabbitMQ refused to delete exchange {name!r}: "
                        f"{error.reply_code} {error.reply_text}"
                    ) from error
                channel.close()

    def delete_reservoir_exchanges(self) -> None:
        self.delete_exchanges(self.url.exchange, self.url.inbox_exchange)

    def _connection(self) -> pika.BlockingConnection:
        import pika
        import pika.exceptions

        url = self.url
        if url.adapter == "pika":
            params = pika.URLParameters(url.transport_url)
        else:
            params = pika.ConnectionParameters(
                host=url.host or "localhost",
                port=url.port or (5671 if url.tls else 5672),
                virtual_host=url.vhost,
                credentials=pika.PlainCredentials(url.username or "guest", url.password or "guest"),
                ssl_options=pika.SSLOptions(ssl.create_default_context()) if url.tls else None,
            )
        params.client_properties = {"connection_name": f"{self._client}:admin"}
        params.socket_timeout = params.blocked_connection_timeout = self._timeout_s
        try:
            return pika.BlockingConnection(params)
        except pika.exceptions.AMQPError as error:
            raise BrokerError(f"cannot connect to {url.display}: {error!r}") from error
