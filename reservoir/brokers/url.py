"""Broker URLs, parsed once: the one place that reads a broker URL's parts.

This module owns what a broker URL means to reservoir: which adapter serves its scheme
(``memory://`` the in-process broker, ``amqp://``/``amqps://`` pika, ``kombu+<kombu URL>``
kombu), the exchange (``?exchange=``, a reservoir-only parameter, parsed here and nowhere
else, stripped before a client library sees the URL), the vhost, the credentials (kept, and
masked in :attr:`BrokerUrl.display`, the only form fit for logs and error messages) and the
TLS options. Everything else reads a :class:`BrokerUrl`; :func:`reservoir.brokers.connect` takes one
or a string.

``BrokerUrl.parse`` checks the scheme and the exchange name and nothing a transport decides
(the kombu adapter refuses its transports that cannot honour the contract itself).

Several brokers of one cluster: URLs joined with ``;`` (kombu's failover syntax, e.g.
``amqp://u:p@10.0.0.1:5672/;amqp://u:p@10.0.0.2:5672/``). They must agree on the scheme,
the vhost and the exchange; :attr:`BrokerUrl.transport_urls` lists them in order, and the
adapters connect to the first and, each time a connection is lost or cannot be made, to
the next one round the list.
"""

from __future__ import annotations

import difflib
import os
import ssl
from dataclasses import dataclass, field, replace
from typing import Final, Literal
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from reservoir.broker import UnsupportedBroker
from reservoir.brokers._rules import DEFAULT_EXCHANGE, check_exchange, inbox_exchange, mask_password

__all__ = ["DEFAULT_BROKER_URL", "Adapter", "BrokerUrl"]

#: the broker used when nothing names one
DEFAULT_BROKER_URL: Final = "memory://"
#: what the display form shows instead of a password
MASK: Final = "***"

Adapter = Literal["memory", "pika", "kombu"]


@dataclass(frozen=True, slots=True)
class BrokerUrl:
    """A broker URL, parsed. Build it with :meth:`parse`; ``str()`` is :attr:`display`."""

    #: the URL's scheme as given, lower-cased: ``memory``, ``amqp``, ``amqps``, ``kombu+amqp``...
    scheme: str
    #: the adapter that serves it
    adapter: Adapter
    #: the topic exchange reservoir publishes on (``?exchange=``, else ``reservoir``)
    exchange: str
    #: whether ``?exchange=`` named it (a tool that did not name one may make its own)
    exchange_given: bool
    host: str | None
    port: int | None
    #: the AMQP virtual host (``/`` when the path names none)
    vhost: str
    username: str | None
    password: str | None = field(repr=False)
    #: the transport's TLS query options (``ssl_options``, ``ssl_*``), as given
    tls_options: tuple[tuple[str, str], ...]
    #: the URL the client library gets: reservoir's parameters stripped, and for kombu
    #: without the ``kombu+`` prefix; it carries the password, so never log it
    transport_url: str = field(repr=False)
    #: the URL with its password masked, for logs, errors and ``Broker.url``
    display: str
    #: every broker of the cluster the URL names, as :attr:`transport_url` is for the
    #: first; one entry for a URL naming one broker
    transport_urls: tuple[str, ...] = field(default=(), repr=False)
    #: TLS files (``?tls_ca=``, ``?tls_cert=``, ``?tls_key=``, reservoir's parameters for
    #: ``amqps``): the CA that signed the broker's certificate (else the system's CAs), and
    #: a client certificate and its key, for brokers that require one
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: the whole URL as given, password and reservoir's parameters included: what another
    #: reservoir process is handed (``--broker``); like :attr:`transport_url`, never log it
    given: str = field(default="", repr=False)

    @classmethod
    def parse(cls, url: str | BrokerUrl) -> BrokerUrl:
        """Parse ``url``; a :class:`BrokerUrl` is returned as it is. Raises
        :class:`UnsupportedBroker` for a scheme no adapter serves and ``ValueError`` for
        an exchange name reservoir cannot use."""
        if isinstance(url, BrokerUrl):
            return url
        if not isinstance(url, str):
            raise TypeError(f"a broker URL must be str, not {type(url).__name__}")
        if ";" in url:
            return cls._parse_several([part.strip() for part in url.split(";") if part.strip()])
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        adapter: Adapter
        if scheme == "memory":
            adapter, inner = "memory", url
        elif scheme in ("amqp", "amqps"):
            adapter, inner = "pika", url
        elif scheme.startswith("kombu+"):
            adapter, inner = "kombu", url.split("+", 1)[1]
        else:
            raise UnsupportedBroker(
                f"no broker adapter for {_mask(url)!r}: {_scheme_guess(scheme)}the schemes are "
                "memory://, amqp://, amqps:// and kombu+<kombu URL>"
            )
        parts = urlsplit(inner)
        ours: dict[str, str] = {}
        theirs: list[tuple[str, str]] = []
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key in _OURS:
                ours[key] = value
            else:
                if adapter == "pika":
                    _check_pika_parameter(key, url)
                theirs.append((key, value))
        exchange = check_exchange(ours.get("exchange", DEFAULT_EXCHANGE))
        # Untouched when there is nothing to strip: nothing re-encoded behind the user's back.
        query = parts.query if not ours else urlencode(theirs, quote_via=quote)
        transport = urlunsplit(parts._replace(query=query))
        try:
            port = parts.port
        except ValueError as error:
            raise ValueError(f"bad port in broker URL {_mask(url)!r}") from error
        display = _mask(url.split("#", 1)[0])  # shown without its fragment
        return cls(
            scheme=scheme,
            adapter=adapter,
            exchange=exchange,
            exchange_given="exchange" in ours,
            host=parts.hostname,
            port=port,
            vhost=unquote(parts.path[1:]) if len(parts.path) > 1 else "/",
            username=unquote(parts.username) if parts.username is not None else None,
            password=unquote(parts.password) if parts.password is not None else None,
            tls_options=tuple((k, v) for k, v in theirs if k.startswith("ssl")),
            transport_url=transport,
            display=display,
            transport_urls=(transport,),
            **_tls_files(ours, scheme, url),
            given=url,
        )

    @classmethod
    def _parse_several(cls, urls: list[str]) -> BrokerUrl:
        """Brokers of one cluster, ``;``-joined: the first's settings, every address."""
        parsed = [cls.parse(url) for url in urls]
        first = parsed[0]
        for other in parsed[1:]:
            for what in ("adapter", "scheme", "vhost", "exchange"):
                if getattr(other, what) != getattr(first, what):
                    raise ValueError(
                        f"the brokers of {'; '.join(p.display for p in parsed)!r} disagree "
                        f"on the {what}: {getattr(first, what)!r} and {getattr(other, what)!r}"
                    )
        if first.adapter == "memory":
            raise ValueError("memory:// names one in-process broker: it cannot be a cluster")
        return replace(
            first,
            display=";".join(p.display for p in parsed),
            transport_urls=tuple(p.transport_url for p in parsed),
            given=";".join(p.given for p in parsed),
        )

    @property
    def inbox_exchange(self) -> str:
        """The topic exchange sends go to, routed by the destination address."""
        return inbox_exchange(self.exchange)

    @property
    def tls(self) -> bool:
        """Whether the connection is encrypted (``amqps``, or kombu's ``ssl`` options)."""
        return self.scheme.endswith("amqps") or bool(self.tls_options)

    def with_exchange(self, exchange: str) -> BrokerUrl:
        """The same broker, on ``exchange`` (the URL's own ``?exchange=`` replaced)."""
        if self.adapter == "memory":
            return self

        def moved(url: str) -> str:
            parts = urlsplit(url)
            query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
            query = [(k, v) for k, v in query if k != "exchange"] + [("exchange", exchange)]
            return urlunsplit(parts._replace(query=urlencode(query, quote_via=quote)))

        return replace(
            self,
            exchange=check_exchange(exchange),
            exchange_given=True,
            display=";".join(moved(part) for part in self.display.split(";")),
            given=";".join(moved(part) for part in self.given.split(";")),
        )

    @property
    def verifies_tls(self) -> bool:
        """Whether reservoir sets up the TLS context (``tls_*`` parameters given)."""
        return any((self.tls_ca, self.tls_cert, self.tls_key))

    def ssl_context(self) -> ssl.SSLContext:
        """A client context that checks the broker's certificate and host name against
        ``tls_ca`` (else the system's CAs) and presents ``tls_cert`` when given."""
        context = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert is not None:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        return context

    @property
    def addresses(self) -> int:
        """How many brokers the URL names."""
        return max(1, len(self.transport_urls))

    def __str__(self) -> str:
        return self.display


#: query parameters that are reservoir's, stripped before a client library sees the URL
#: the schemes a URL can start with (``kombu+`` takes any of kombu's after it)
SCHEMES: Final = ("memory", "amqp", "amqps", "kombu+amqp", "kombu+amqps", "kombu+redis")


def _scheme_guess(scheme: str) -> str:
    """``did you mean amqp://? `` for a mistyped scheme (``ampq``), else nothing."""
    guess = difflib.get_close_matches(scheme, SCHEMES, n=1, cutoff=0.5) if scheme else []
    return f"did you mean {guess[0]}://? " if guess else ""


_OURS: Final = frozenset({"exchange", "tls_ca", "tls_cert", "tls_key"})


#: the query parameters pika's URLParameters takes (anything else it refuses)
_PIKA_PARAMETERS: Final = frozenset(
    {
        "blocked_connection_timeout", "channel_max", "client_properties",
        "connection_attempts", "frame_max", "heartbeat", "locale", "retry_delay",
        "socket_timeout", "ssl_options", "stack_timeout", "tcp_options",
    }
)  # fmt: skip


def _check_pika_parameter(key: str, url: str) -> None:
    """A typo (``?exchnge=``) is named here, in one line, rather than deep in pika."""
    if key in _PIKA_PARAMETERS:
        return
    known = sorted(_OURS | _PIKA_PARAMETERS)
    guess = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    raise ValueError(
        f"unknown parameter {key!r} in broker URL {_mask(url)!r}{hint}; "
        f"reservoir's are {', '.join(sorted(_OURS))}, pika's {', '.join(sorted(_PIKA_PARAMETERS))}"
    )


def _tls_files(ours: dict[str, str], scheme: str, url: str) -> dict[str, str | None]:
    files = {key: ours.get(key) or None for key in ("tls_ca", "tls_cert", "tls_key")}
    if any(files.values()) and not scheme.endswith("amqps"):
        raise ValueError(f"tls_ca, tls_cert and tls_key need an amqps:// URL: {_mask(url)!r}")
    if files["tls_key"] and not files["tls_cert"]:
        raise ValueError(f"tls_key without tls_cert in {_mask(url)!r}")
    for key, path in files.items():
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{key}: no such file {path!r}")
    return files


def _mask(url: str) -> str:
    """``url`` with its password, if any, replaced by :data:`MASK` (``kombu+`` kept)."""
    prefix, plus, rest = url.partition("+") if url.lower().startswith("kombu+") else ("", "", url)
    return f"{prefix}{plus}{mask_password(rest, MASK)}"
