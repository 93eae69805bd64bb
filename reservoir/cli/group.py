"""The ``reservoir`` group: its options apply before any command (logging)."""

from __future__ import annotations

import importlib
from typing import Any

import click

from reservoir.interrupt import interrupted, interruptible
from reservoir.version import version_line


class _Group(click.Group):
    """The group, with the one interruption path (:mod:`reservoir.interrupt`) around every
    command: click's own turns Ctrl-C into "Aborted!" and exit status 1, the status of
    "not placed". Its commands are imported when one is run or listed, not with the
    group: a command that places one request does not import the benchmarks, the
    simulator and the service first (half of a command's start)."""

    #: command name -> "module:attribute" of the command, imported when first asked for
    lazy: dict[str, str] = {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in self.lazy:
            module, _, attribute = self.lazy[cmd_name].partition(":")
            command = getattr(importlib.import_module(module), attribute)
            assert isinstance(command, click.Command), self.lazy[cmd_name]
            self.add_command(command, cmd_name)
        return command

    def invoke(self, ctx: click.Context) -> Any:
        with interruptible():
            try:
                return super().invoke(ctx)
            except KeyboardInterrupt:
                # the command's own finally blocks have run: what it opened is closed
                name = ctx.invoked_subcommand
                interrupted(f"reservoir {name}" if name else "reservoir")


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(f"reservoir, version {version_line()}")
    ctx.exit()


@click.group(
    cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_show_version,
    help="Show the release, the protocol version it speaks and the release line it runs "
    "beside, and exit.",
)
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="More logging on stderr: -v info, -vv debug, -vvv the AMQP client library's "
    "debug too (pika's and kombu's, a line per frame).",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    envvar="RESERVOIR_LOG_FORMAT",
    help="Log lines on stderr as text, or as one JSON object each (with the request_id "
    "of the conversation a line belongs to) [env: RESERVOIR_LOG_FORMAT].",
)
def main(verbose: int, log_format: str) -> None:
    """reservoir places work on compute nodes with a fanout reservation protocol.

    A requestor broadcasts a reservation request on utilisation-tiered topics; every node
    that can take it reserves the resources and answers; the requestor awards a winner
    and releases the rest; unclaimed reservations expire after a TTL (5 s).
    """
    from reservoir.observe.logs import configure

    configure(verbose, "json" if log_format == "json" else "text")


# -- demo ----------------------------------------------------------------------------------
