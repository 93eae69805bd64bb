"""``reservoir simulate``: the protocol on a virtual clock beside the baselines."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from reservoir.cli.options import (
    json_option,
    progress_bar,
    stopped_by_sigterm,
)
from reservoir.exit_status import EXIT_INTERRUPTED, EXIT_USAGE
from reservoir.version import install_hint


def _simulator() -> Any:
    """The ``reservoir.tools.simulator`` package, or a usage error naming what it lacks (numpy
    is not a dependency of the library itself; the plots extra brings it)."""
    try:
        import reservoir.tools.simulator
    except ImportError as error:
        raise click.UsageError(
            f"reservoir simulate needs {error.name or 'numpy'}: {install_hint('simulate')}"
        ) from None
    return reservoir.tools.simulator


def _parse_loads(ctx: click.Context, param: click.Parameter, value: str) -> tuple[float, ...]:
    try:
        loads = tuple(float(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: comma-separated numbers, e.g. 0.5,0.8,0.95") from None
    if not loads or any(not 0 < load <= 2 for load in loads):
        raise click.BadParameter(f"{value!r}: each offered load must be in (0, 2]")
    return loads


def _parse_systems(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    known = _simulator().SYSTEMS
    systems = tuple(
        dict.fromkeys(part.strip().lower() for part in value.split(",") if part.strip())
    )
    unknown = [s for s in systems if s not in known]
    if unknown or not systems:
        raise click.BadParameter(f"{', '.join(unknown) or value!r}: choose from {', '.join(known)}")
    return systems


def _parse_latency(ctx: click.Context, param: click.Parameter, value: str) -> Any:
    try:
        return _simulator().parse_latency_ms(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


@click.command()
@click.option(
    "--nodes",
    default=1000,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Simulated nodes (32, 48 and 64 VCPUs, 2 GiB per VCPU).",
)
@click.option(
    "--requests",
    default=10_000,
    show_default=True,
    type=click.IntRange(1),
    help="Arrivals per offered load per system (1, 2, 4 or 8 VCPUs each).",
)
@click.option(
    "--loads",
    default="0.5,0.8,0.95",
    show_default=True,
    callback=_parse_loads,
    help="Offered loads: steady-state demand as a fraction of the cluster's VCPUs.",
)
@click.option(
    "--systems",
    default="reservoir,nova,sampling,omniscient",
    show_default=True,
    callback=_parse_systems,
    help="Systems to run on the same workload.",
)
@click.option(
    "--schedulers",
    default=8,
    show_default=True,
    type=click.IntRange(1, 1024),
    help="Nova: scheduler processes, each with its own host-state cache.",
)
@click.option(
    "--refresh-s",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.001),
    help="Nova: how often each scheduler refreshes its cache from the nodes.",
)
@click.option(
    "--probes",
    default=2,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Sampling: nodes probed per placement attempt (power of d choices).",
)
@click.option(
    "--requestors",
    default=8,
    show_default=True,
    type=click.IntRange(1, 1024),
    help="reservoir: requestors placing concurrently (arrivals go round robin).",
)
@click.option(
    "--keepers",
    default=2,
    show_default=True,
    type=click.IntRange(0, 16),
    help="reservoir: roster keepers, two as in the recommended deployment; requestors take "
    "their rosters from them (roster_from auto). 0: every requestor follows every node's "
    "announcements itself (roster_from announcements; docs/design.md, 'Many requestors: "
    "roster keepers').",
)
@click.option(
    "--requestor-restarts-per-s",
    "restarts_per_s",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0, 1000.0),
    help="reservoir: requestors replaced by new ones per second of arrivals, as in a "
    "rolling deploy (each new one starts as a requestor does; the old one finishes what "
    "it has in flight).",
)
@click.option(
    "--latency-ms",
    "latency",
    default="1",
    show_default=True,
    callback=_parse_latency,
    help="One-way latency: MS, fixed:MS, uniform:LO,HI or lognormal:MEDIAN,SIGMA.",
)
@click.option(
    "--loss",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0, 0.5),
    help="Probability that a message is lost.",
)
@click.option(
    "--lifetime-s",
    default=3600.0,
    show_default=True,
    type=click.FloatRange(0.001),
    help="Mean instance lifetime (exponential); the offered load sets the arrival rate.",
)
@click.option(
    "--prefill/--no-prefill",
    default=True,
    show_default=True,
    help="Start at the steady state (Poisson-many instances placed by spread) or empty.",
)
@click.option(
    "--seed", default=0, show_default=True, type=int, help="Seed for the nodes and workload."
)
@click.option(
    "--jobs",
    default=None,
    type=click.IntRange(1, 256),
    help="Runs (one per system and load) in parallel worker processes; the results do "
    "not depend on it.  [default: the cores this process may use, or one worker per "
    "reservoir run and one for the baselines when there are more of those and memory "
    "allows]",
)
@click.option(
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write results.md, results.json and PNG plots here (needs the plots extra).",
)
@json_option("Print exactly one JSON object with the results, nothing else on stdout.")
def simulate(
    nodes: int,
    requests: int,
    loads: tuple[float, ...],
    systems: tuple[str, ...],
    schedulers: int,
    refresh_s: float,
    probes: int,
    requestors: int,
    keepers: int,
    restarts_per_s: float,
    latency: Any,
    loss: float,
    lifetime_s: float,
    prefill: bool,
    seed: int,
    jobs: int | None,
    output: Path | None,
    as_json: bool,
) -> None:
    """Simulate NODES nodes in virtual time and compare reservoir with baselines.

    reservoir runs its real node and requestor state machines on a discrete-event engine
    (no broker, no threads; messages are passed as objects, without byte serialisation);
    Nova's cached scheduler, power-of-d sampling and an omniscient scheduler run the
    identical workload: Poisson arrivals at each offered load, exponential lifetimes, the
    same latency and loss. Each reservoir run ends with the invariant audit of every
    node's ledger; a broken invariant exits with status 2.

    A run of 100,000 nodes takes minutes per load; the mypyc build of the machines
    (docs/benchmarks.md, "The compiled build") runs it about 1.3x faster, with the same results. The
    output says which build ran.
    """
    simulator = _simulator()
    if output is not None:
        _require_plots()
    config = simulator.SimulationConfig(
        nodes=nodes,
        requests=requests,
        loads=loads,
        systems=systems,
        schedulers=schedulers,
        requestors=requestors,
        keepers=keepers,
        requestor_restarts_per_s=restarts_per_s,
        refresh_s=refresh_s,
        probes=probes,
        latency=latency,
        loss=loss,
        seed=seed,
        mean_lifetime_s=lifetime_s,
        prefill=prefill,
    )
    result = _run(simulator, config, jobs, as_json)
    _report(result, output, as_json)


def _require_plots() -> None:
    from reservoir.tools.simulator.report import require_matplotlib

    try:
        require_matplotlib()
    except ImportError:
        raise click.UsageError(
            f"--output draws plots with matplotlib: {install_hint('plots')}"
        ) from None


def _run(simulator: Any, config: Any, jobs: int | None, as_json: bool) -> Any:
    """Every run of the configuration, with a progress bar on a terminal; Ctrl-C or
    SIGTERM stops the worker processes and exits 130."""
    runs = config.requests * len(config.loads) * len(config.systems)
    with progress_bar(as_json) as bar:
        task = bar.add_task("simulating", total=runs)
        try:
            with stopped_by_sigterm():
                return simulator.simulate(
                    config,
                    progress=lambda label, n: bar.update(task, description=label, advance=n),
                    jobs=jobs if jobs is not None else simulator.default_jobs(config),
                )
        except KeyboardInterrupt:
            bar.stop()
            click.echo("reservoir simulate: interrupted; its worker processes stopped", err=True)
            sys.exit(EXIT_INTERRUPTED)


def _report(result: Any, output: Path | None, as_json: bool) -> None:
    """The table or the JSON object, the files of ``--output``, and exit status 2 when an
    audit found a broken invariant."""
    from reservoir.tools.simulator.report import print_table, write_outputs

    if as_json:
        click.echo(json.dumps(result.as_json(), sort_keys=True))
    else:
        print_table(result)
    if output is not None:
        written = write_outputs(result, output)
        if not as_json:
            click.echo(f"wrote {', '.join(str(path) for path in written)}")
    if not result.invariants_hold:
        if not as_json:
            for run in result.runs:
                if run.audit_ok is False:
                    click.echo(
                        f"  {run.system} at load {run.offered_load:g}: audit {run.audit}",
                        err=True,
                    )
        sys.exit(EXIT_USAGE)
