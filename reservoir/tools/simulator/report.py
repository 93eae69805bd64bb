"""How a simulation's results are shown: a terminal table, ``results.md`` and PNG plots.

This module owns presentation only. matplotlib is imported only by :func:`write_plots`
(the ``plots`` extra); :func:`require_matplotlib` lets a caller fail before a long run
rather than after it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from reservoir.tools.simulator.runner import SimulationResult, machines_build

__all__ = [
    "COLUMNS",
    "LEGEND",
    "PLOTS",
    "markdown",
    "print_table",
    "require_matplotlib",
    "write_outputs",
    "write_plots",
]


def _percent(value: Any) -> str:
    return "-" if value is None else f"{value:.2%}"


def _number(digits: int) -> Callable[[Any], str]:
    def show(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "NO"
        return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"

    return show


#: (row key, header, formatter) of the columns tables show
COLUMNS: Final[tuple[tuple[str, str, Callable[[Any], str]], ...]] = (
    ("system", "system", str),
    ("offered_load", "load", _number(2)),
    ("success_rate", "placed", _percent),
    ("false_failures", "false fail", _number(0)),
    ("p50_ms", "p50 ms", _number(2)),
    ("p99_ms", "p99 ms", _number(2)),
    ("reschedules_per_placement", "resched/pl", _number(3)),
    ("messages_per_placement", "msgs/pl", _number(1)),
    ("state_messages_per_placement", "state/pl", _number(1)),
    ("reserved_fraction", "reserved", _percent),
    ("fill_at_first_failure", "fill@fail", _percent),
    ("broadcasts_per_placement", "bcast/pl", _number(3)),
    ("audit_ok", "audit", _number(0)),
    ("wall_s", "wall s", _number(1)),
)

#: what the short headers mean, under every table
LEGEND: Final = (
    "placed: arrivals placed; false fail: failures while some node had room; "
    "resched/pl: reschedules (reservoir: refused awards) per placement; msgs/pl: messages "
    "per placement, state/pl of them state reports; reserved: VCPUs held by live "
    "reservations, time-averaged; fill@fail: VCPUs allocated at the first failure; "
    "bcast/pl: reservoir's broadcast fallbacks per placement; latencies in virtual time."
)

#: (row key, title, y label) of the plots
PLOTS: Final = (
    ("success_rate", "Requests placed", "fraction of arrivals"),
    ("false_failures", "False failures (some node had room)", "requests"),
    ("p99_ms", "Placement latency, p99", "ms (virtual time)"),
    ("messages_per_placement", "Messages per placement", "messages"),
    ("reschedules_per_placement", "Reschedules per placement", "reschedules"),
    ("reserved_fraction", "VCPUs held by live reservations", "fraction, time-averaged"),
)


def _title(result: SimulationResult) -> str:
    config = result.config
    roster = ""
    if "reservoir" in config.systems:
        # what reservoir's messages per placement depend on most
        roster = f"reservoir's {config.requestors:,} requestor(s) and {config.keepers} keeper(s), "
    return (
        f"reservoir simulate: {config.nodes:,} nodes, {config.requests:,} arrivals per load "
        f"and system, {roster}latency {config.latency.describe()}, loss {config.loss:g}, "
        f"seed {config.seed}"
    )


def print_table(result: SimulationResult) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title=_title(result), box=box.SIMPLE_HEAD, caption=LEGEND)
    for key, header, _ in COLUMNS:
        table.add_column(
            header,
            justify="left" if key == "system" else "right",
            no_wrap=True,
            min_width=len(header),
        )
    for row in result.rows():
        table.add_row(*(show(row[key]) for key, _, show in COLUMNS))
    console = Console(width=max(Console().width, 150))
    console.print(table)
    verdict = "[green]invariants hold[/]" if result.invariants_hold else "[red]INVARIANTS BROKEN[/]"
    console.print(f"{verdict}; {result.elapsed_s:.1f} s, {machines_build()} build")


def markdown(result: SimulationResult, plots: list[Path] | None = None) -> str:
    config = result.config
    lines = [
        f"# {_title(result)}",
        "",
        f"Offered loads {', '.join(f'{load:g}' for load in config.loads)}; "
        f"{config.schedulers} Nova schedulers refreshing every {config.refresh_s:g} s; "
        f"{config.requestors} reservoir requestors; {config.probes} probes per sampled "
        f"placement; mean instance lifetime {config.mean_lifetime_s:g} s; "
        f"{'pre-filled to the steady state' if config.prefill else 'starting empty'}. "
        "Messages are passed as objects, without byte serialisation. "
        f"Ran in {result.elapsed_s:.1f} s on the {machines_build()} build.",
        "",
        "| " + " | ".join(header for _, header, _ in COLUMNS) + " |",
        "| " + " | ".join("---" if key == "system" else "---:" for key, _, _ in COLUMNS) + " |",
    ]
    for row in result.rows():
        lines.append("| " + " | ".join(show(row[key]) for key, _, show in COLUMNS) + " |")
    lines += [
        "",
        LEGEND,
        "",
        "Invariants hold." if result.invariants_hold else "**Invariants broken** (see the JSON).",
    ]
    for plot in plots or []:
        lines += ["", f"![{plot.stem}]({plot.name})"]
    return "\n".join(lines) + "\n"


def require_matplotlib() -> None:
    """Raise ImportError when matplotlib (the ``plots`` extra) is missing."""
    import matplotlib  # noqa: F401


def write_plots(result: SimulationResult, directory: Path) -> list[Path]:
    """One PNG per metric, offered load on the x axis, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows()
    systems = list(dict.fromkeys(row["system"] for row in rows))
    written = []
    for key, title, label in PLOTS:
        figure, axes = plt.subplots(figsize=(6, 4))
        for system in systems:
            points = [
                (row["offered_load"], row[key])
                for row in rows
                if row["system"] == system and row[key] is not None
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                axes.plot(xs, ys, marker="o", label=system)
        axes.set_title(title)
        axes.set_xlabel("offered load")
        axes.set_ylabel(label)
        if key == "messages_per_placement":
            axes.set_yscale("log")
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        path = directory / f"{key}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def write_outputs(result: SimulationResult, directory: Path) -> list[Path]:
    """``results.md``, ``results.json`` and the plots, into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    plots = write_plots(result, directory)
    report = directory / "results.md"
    report.write_text(markdown(result, plots))
    data = directory / "results.json"
    data.write_text(json.dumps(result.as_json(), sort_keys=True, indent=2) + "\n")
    return [report, data, *plots]
