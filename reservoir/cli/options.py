"""What the ``reservoir`` commands share, each in one place: the options every command
spells alike (``--broker``, ``--json``), reading the settings, the one line a bad setting
or an unreachable broker gets, and the helpers of their output.

A command module declares its own options and turns its input into the library's types;
whatever two commands would otherwise write twice lives here.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
from pydantic import ValidationError

from reservoir.broker import BrokerError, UnsupportedBroker
from reservoir.brokers import BrokerUrl
from reservoir.exit_status import EXIT_BROKER, EXIT_USAGE
from reservoir.runtime.settings import Settings

if TYPE_CHECKING:
    from rich.progress import Progress

    from reservoir.protocol.audit import NodeSnapshot
    from reservoir.runtime.requestor import Requestor

F = TypeVar("F", bound=Callable[..., Any])

BROKER_HELP = (
    "Broker URL: amqp://user:pass@host:5672/vhost, kombu+amqp://... or memory:// (a broker "
    "inside this process only) [env: RESERVOIR_BROKER_URL; required]"
)


#: the one line a command that talks to a cluster prints when no broker was named
NO_BROKER = (
    "no broker given: pass --broker URL or set RESERVOIR_BROKER_URL "
    "(amqp://user:pass@host:5672/ for RabbitMQ; memory:// for a broker inside this process only)"
)


def broker_option(
    default: str | None = None, *, checked_by_the_command: bool = False
) -> Callable[[F], F]:
    """``--broker URL`` (parameter ``broker_url``), read from ``RESERVOIR_BROKER_URL`` when
    absent. Without ``default`` the command talks to a cluster and refuses to start without
    one (exit status 2, :data:`NO_BROKER`): a forgotten URL must not quietly become an empty
    in-process broker. ``default`` only where a command runs on its own broker (``demo``),
    which then says so. ``checked_by_the_command``: the command may find the URL elsewhere
    (``node``'s configuration file) and refuses with :data:`NO_BROKER` itself."""

    def given(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if checked_by_the_command:
            return value
        if not value and default is None and not ctx.resilient_parsing:
            usage_error(NO_BROKER)
        return value or default

    return click.option(
        "--broker",
        "broker_url",
        envvar="RESERVOIR_BROKER_URL",
        default=default,
        show_default=default is not None,
        callback=given,
        help=BROKER_HELP if default is None else BROKER_HELP.replace("; required]", "]"),
    )


def json_option(help: str = "Print one JSON object.") -> Callable[[F], F]:
    """``--json`` (parameter ``as_json``): machine-readable output on stdout."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def connect_attempts_option() -> Callable[[F], F]:
    """``--connect-attempts N`` for a long-running process that waits for its broker."""
    return click.option(
        "--connect-attempts",
        type=click.IntRange(0),
        default=0,
        show_default=True,
        help="Give up after this many failed attempts to reach the broker (0: keep trying, "
        "with backoff up to 15 s between attempts, until stopped).",
    )


def seconds_option(
    name: str, default: float, help: str, *, minimum: float = 0.1
) -> Callable[[F], F]:
    """A duration in seconds (``--timeout`` as ``timeout_s``, ``--wait`` as ``wait_s``)."""
    return click.option(
        name,
        f"{name.removeprefix('--').replace('-', '_')}_s",
        type=click.FloatRange(minimum),
        default=default,
        show_default=True,
        help=help,
    )


def within(limit: str, *, minimum: int = 0) -> click.IntRange:
    """An amount no larger than a front door takes (``FRONT_DOOR_LIMITS``), so that a
    command refuses what ``POST /v1/reservations`` refuses, with the same bound."""
    from reservoir.protocol.placement import FRONT_DOOR_LIMITS

    return click.IntRange(minimum, FRONT_DOOR_LIMITS[limit])


def expect_nodes_option(help: str) -> Callable[[F], F]:
    """``--expect-nodes N``: stop waiting once this many nodes answered."""
    return click.option("--expect-nodes", type=click.IntRange(1), help=help)


def progress_bar(as_json: bool) -> Progress:
    """A bar on stderr while a long run goes on: only on a terminal, and gone at the end
    when stdout carries JSON."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    stderr = Console(stderr=True)
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=as_json,
        disable=not stderr.is_terminal,
    )


def load_settings(**overrides: Any) -> Settings:
    """The settings from ``RESERVOIR_*`` with the command's options over them (``None``
    meaning "not given"), or one line naming what is wrong and exit status 2."""
    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    except UnsupportedBroker as error:
        # a URL no broker could have (``ampq://``): the user's to fix, not the broker's
        usage_error(f"--broker / RESERVOIR_BROKER_URL: {error}")
    except ValidationError as error:
        # One line naming each setting (and its environment variable) and what is wrong,
        # not pydantic's report with its links.
        problems = "; ".join(
            f"{_setting_name(e['loc'])}{e['msg'].removeprefix('Value error, ')}"
            for e in error.errors(include_url=False)
        )
        usage_error(problems if _is_the_broker(error) else f"bad setting: {problems}")
    return settings


def _is_the_broker(error: ValidationError) -> bool:
    return [e["loc"][:1] for e in error.errors()] == [("broker_url",)]


def _setting_name(loc: tuple[int | str, ...]) -> str:
    """``ttl_s (RESERVOIR_TTL_S): `` for a field's error; nothing for one about several
    settings together (its message names them)."""
    if not loc:
        return ""
    field = str(loc[0])
    if field == "broker_url":
        # One line, naming what is wrong: a mistyped URL is not worth a usage screen.
        return "--broker / RESERVOIR_BROKER_URL: "
    return f"{field} (RESERVOIR_{field.upper()}): "


def command_path() -> str:
    """``reservoir request``, say: the words a message of the running command starts with."""
    context = click.get_current_context(silent=True)
    words: list[str] = []
    # up to the group, whose name is the program's as users type it, whatever the test
    # runner or entry point calls it (and a subcommand's, ``reservoir keys show``, in full)
    while context is not None and context.parent is not None:
        words.insert(0, context.info_name or "")
        context = context.parent
    return " ".join(["reservoir", *words])


def usage_error(problem: str) -> NoReturn:
    """One line on stderr naming the command and the problem; exit status 2."""
    click.echo(f"{command_path()}: {problem}", err=True)
    sys.exit(EXIT_USAGE)


def cannot_reach_broker(error: BaseException) -> NoReturn:
    """The one line every command prints when its broker does not answer; exit status 3."""
    click.echo(f"{command_path()}: {broker_problem(error)}", err=True)
    sys.exit(EXIT_BROKER)


def broker_problem(error: BaseException) -> str:
    """``cannot connect to amqp://guest:***@host:5672/: connection refused``: a broker
    error as celery's and dramatiq's operators know it (the adapters already say which
    URL and what went wrong; anything else gets the words that say it is the broker)."""
    said = str(error)
    return said if said.startswith("cannot connect to ") else f"cannot reach the broker: {said}"


def set_up_tracing(command: str) -> None:
    """OpenTelemetry for this process, when OTEL_TRACES_EXPORTER asks for it."""
    from reservoir.observe.tracing import configure_from_environment

    problem = configure_from_environment(f"reservoir-{command}")
    if problem is not None:
        usage_error(problem)


def shown_url(url: str | BrokerUrl | None) -> str:
    """A broker URL fit to print: its password masked (the one owner of that: BrokerUrl)."""
    try:
        return BrokerUrl.parse(url or "memory://").display
    except (ValueError, BrokerError):
        return "(an unparseable broker URL)"


def parse_pairs(values: Sequence[str], what: str, *, upper: bool = True) -> dict[str, str]:
    """``KEY=VALUE`` options (repeatable) as a mapping, keys upper-cased unless ``upper``
    is false; a malformed one is a usage error naming it and ``what`` was expected."""
    pairs = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key or not rest:
            raise click.BadParameter(f"{value!r}: expected {what}")
        key = key.strip()
        pairs[key.upper() if upper else key] = rest.strip()
    return pairs


def ledgers(
    settings: Settings, wait_s: float, expect_nodes: int | None = None
) -> list[NodeSnapshot]:
    """Every live node's ledger, asked for over the broker and gathered for ``wait_s``
    (less once ``expect_nodes`` answered), or the one line and exit 3."""
    from reservoir.runtime.auditor import LedgerCollector
    from reservoir.runtime.backoff import quietly_connecting

    try:
        with quietly_connecting():
            collector = LedgerCollector(settings.broker_url, settings=settings)
    except BrokerError as error:
        cannot_reach_broker(error)
    try:
        collector.ask()
        return collector.collect(wait_s=wait_s, expect_nodes=expect_nodes)
    finally:
        collector.close()


def open_requestor(broker_url: str | BrokerUrl | None) -> Requestor:
    """A :class:`~reservoir.Requestor` on the command's broker, or the one line and exit 3.
    What it places is findable by its id, generated ids too (``findable``): ``reservoir
    serve``'s GET and DELETE, and ``reservoir free``, find it from any process."""
    from reservoir.runtime.backoff import quietly_connecting
    from reservoir.runtime.requestor import Requestor

    settings = load_settings(broker_url=broker_url)
    try:
        with quietly_connecting():
            return Requestor(settings.broker_url, settings=settings, findable=True)
    except BrokerError as error:
        cannot_reach_broker(error)


@contextlib.contextmanager
def stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM stops a long run (bench, chaos, simulate) as Ctrl-C does, so the processes
    and exchanges it started go too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def require_message_counts(command: str) -> None:
    """A usage error unless prometheus-client is installed: ``bench`` and ``versus`` read
    messages per placement from the participants' Prometheus counters."""
    from reservoir.observe import metrics
    from reservoir.version import install_hint

    if not metrics.AVAILABLE:
        raise click.UsageError(
            f"reservoir {command} counts messages with prometheus-client: "
            f"{install_hint('prometheus')}"
        )
