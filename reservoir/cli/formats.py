"""One output formatter for the commands that list things (``reservoir nodes``,
``reservoir request --dry-run``), as the OpenStack CLI (cliff) has it: ``-f table|json|
yaml|csv|value`` and ``-c COLUMN`` (repeatable) to pick columns.

A command describes its columns once (:class:`Column`: the field name, which is the
name the HTTP API uses for it too, and a heading with its unit for the table) and hands
its rows, plain dictionaries keyed by field name, to :func:`emit`. ``json`` and ``yaml``
print the rows as a list of objects, ``csv`` a header of field names and a line per row,
``value`` the values alone, space-separated, a line per row (for shell scripts).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from reservoir.cli.options import usage_error

__all__ = ["FORMATS", "Column", "emit", "format_options", "picked"]

FORMATS = ("table", "json", "yaml", "csv", "value")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Column:
    """A column: ``key`` is its field name (JSON, YAML, CSV, ``-c``), ``heading`` what a
    table shows above it (with the unit), ``show`` how a table cell shows a value."""

    key: str
    heading: str
    show: Callable[[Any], str] = str
    #: right-aligned in a table (numbers)
    numeric: bool = True
    #: how a csv or value cell shows a value (default: :func:`_plain`)
    plain: Callable[[Any], str] | None = None

    def cell(self, value: Any) -> str:
        """The value as a csv or value cell."""
        return self.plain(value) if self.plain is not None and value is not None else _plain(value)


def format_options(f: F) -> F:
    """``-f/--format`` (parameter ``output_format``) and ``-c/--column`` (``columns``)."""
    f = click.option(
        "-c",
        "--column",
        "columns",
        multiple=True,
        metavar="COLUMN",
        help="Show this column (repeatable; by its field name or heading); default: all.",
    )(f)
    return click.option(
        "-f",
        "--format",
        "output_format",
        type=click.Choice(FORMATS),
        default="table",
        show_default=True,
        help="Output format.",
    )(f)


def emit(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[Column],
    output_format: str,
    chosen: Sequence[str] = (),
) -> None:
    """Print ``rows`` as ``output_format``, with the ``chosen`` columns (all by default;
    an unknown one is a usage error naming the option and the columns there are)."""
    shown = picked(columns, chosen)
    if output_format == "table":
        _table(rows, shown)
    elif output_format == "json":
        click.echo(json.dumps([_fields(row, shown) for row in rows], indent=2))
    elif output_format == "yaml":
        click.echo(_yaml([_fields(row, shown) for row in rows]), nl=False)
    elif output_format == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([c.key for c in shown])
        for row in rows:
            writer.writerow([c.cell(row.get(c.key)) for c in shown])
        click.echo(out.getvalue(), nl=False)
    elif output_format == "value":
        for row in rows:
            click.echo(" ".join(c.cell(row.get(c.key)) for c in shown))
    else:  # pragma: no cover - click.Choice keeps it to FORMATS
        usage_error(f"-f/--format: no format {output_format!r}")


def picked(columns: Sequence[Column], chosen: Sequence[str]) -> list[Column]:
    """The ``chosen`` columns (all when none is), or a usage error naming the unknown one
    and the columns there are: a command checks its ``-c`` with it before doing anything."""
    if not chosen:
        return list(columns)
    named = {c.key.lower(): c for c in columns} | {c.heading.lower(): c for c in columns}
    picked = []
    for name in chosen:
        column = named.get(name.lower())
        if column is None:
            there = ", ".join(c.key for c in columns)
            usage_error(f"-c/--column: no column {name!r}; the columns are {there}")
        picked.append(column)
    return picked


def _fields(row: Mapping[str, Any], shown: Sequence[Column]) -> dict[str, Any]:
    return {c.key: row.get(c.key) for c in shown}


def _plain(value: Any) -> str:
    """A cell of csv or value output: lists joined with ``;``, mappings as ``key=value``
    joined with ``;``, None empty."""
    if value is None:
        return ""
    if isinstance(value, Mapping):
        return ";".join(f"{k}={_plain(v)}" for k, v in sorted(value.items()))
    if isinstance(value, list | tuple):
        return ";".join(str(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _yaml(rows: list[dict[str, Any]]) -> str:
    """Rows as a YAML sequence of mappings. Every value is a JSON scalar or list, which
    YAML reads as it is (no YAML library needed for flat rows)."""
    lines = []
    for row in rows:
        prefix = "- "
        for key, value in row.items():
            lines.append(f"{prefix}{key}: {json.dumps(value)}")
            prefix = "  "
        if prefix == "- ":
            lines.append("- {}")
    return "".join(line + "\n" for line in lines) if lines else "[]\n"


def _table(rows: Sequence[Mapping[str, Any]], shown: Sequence[Column]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for column in shown:
        # folded, never cut with an ellipsis: a table shows the whole of every value
        table.add_column(
            column.heading, justify="right" if column.numeric else "left", overflow="fold"
        )
    for row in rows:
        table.add_row(*("-" if row.get(c.key) is None else c.show(row.get(c.key)) for c in shown))
    Console(width=max(200, sum(len(c.heading) + 2 for c in shown))).print(table)
