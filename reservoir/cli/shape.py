"""The options that describe a request, as ``reservoir request`` and ``reservoir run`` both
take them (the one request shape: every field of :class:`~reservoir.PlacementRequest`
reaches both), and the request they make, through
:func:`~reservoir.protocol.placement.request_of` as every front door's."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import click

from reservoir.cli.options import parse_pairs, within
from reservoir.protocol.messages import (
    PCI_POLICIES,
    TRAIT_MAX_LENGTH,
    TRAIT_PATTERN,
    GroupPolicy,
    GroupSpec,
    NumaSpec,
    TaskSpec,
)
from reservoir.runtime.checked_request import CheckedRequest

__all__ = ["SHAPE_PARAMETERS", "request_from_options", "shape_options"]

F = TypeVar("F", bound=Callable[..., Any])

#: each option of a request's shape, in the order ``--help`` lists them
_SHAPE_OPTIONS = [
    click.option("--vcpus", type=within("vcpus"), help="VCPUs per instance."),
    click.option("--memory-mb", type=within("memory_mb"), help="Memory per instance, MiB."),
    click.option("--disk-gb", type=within("disk_gb"), help="Disk per instance, GiB."),
    click.option(
        "--resource",
        "resources",
        multiple=True,
        metavar="CLASS=AMOUNT",
        help="Any other resource class per instance, e.g. CUSTOM_GPU=1. Repeatable.",
    ),
    click.option(
        "--count",
        default=1,
        show_default=True,
        type=within("count", minimum=1),
        help="Instances wanted; all or nothing unless --min-count.",
    ),
    click.option(
        "--min-count",
        type=within("count", minimum=1),
        help="Accept a partial placement of this many.",
    ),
    click.option(
        "--require",
        "required",
        multiple=True,
        metavar="TRAIT",
        help="A trait the node must have. Repeatable.",
    ),
    click.option(
        "--forbid",
        "forbidden",
        multiple=True,
        metavar="TRAIT",
        help="A trait the node must not have. Repeatable.",
    ),
    click.option(
        "--any-of",
        "any_of",
        multiple=True,
        metavar="TRAIT,TRAIT",
        help="The node must have at least one of these traits. Repeatable: each is one more "
        "such set.",
    ),
    click.option("--group", help="Server group the instances join."),
    click.option(
        "--policy",
        "group_policy",
        type=click.Choice(["affinity", "anti-affinity", "soft-affinity", "soft-anti-affinity"]),
        help="The server group's policy (with --group).",
    ),
    click.option(
        "--numa-nodes", type=click.IntRange(1), help="Spread each instance over N NUMA cells."
    ),
    click.option(
        "--dedicated-cpus",
        "--pinned",
        "pinned",
        is_flag=True,
        help="Dedicated (pinned) CPUs, with --numa-nodes: numa.dedicated_cpus, as the HTTP API "
        "and the library spell it (--pinned is the same flag).",
    ),
    click.option(
        "--hugepage-kb",
        type=click.IntRange(1),
        help="Back each instance's memory with huge pages of this size (KiB), e.g. 2048.",
    ),
    click.option(
        "--pci",
        "pci",
        multiple=True,
        metavar="ALIAS:COUNT",
        help="PCI devices per instance by the alias the nodes give them, e.g. gpu-a100:1. "
        "Repeatable.",
    ),
    click.option(
        "--numa-policy",
        type=click.Choice(PCI_POLICIES),
        help="Where the PCI devices sit relative to the instance's NUMA cells "
        "(as Nova's hw:pci_numa_affinity_policy; default legacy).",
    ),
    click.option(
        "--hint",
        "hints",
        multiple=True,
        metavar="KEY=VALUE",
        help="Free-form hint for node-side filters. Repeatable.",
    ),
    click.option("--request-id", help="Idempotency key: asking again returns the same placement."),
    click.option(
        "--explain/--no-explain",
        default=True,
        show_default=True,
        help="Ask nodes that cannot take it to say why (each such node answers with its "
        "reasons; --no-explain keeps them silent on broadcasts).",
    ),
]

#: the parameters :func:`shape_options` adds, as :func:`request_from_options` takes them
SHAPE_PARAMETERS = (
    "vcpus", "memory_mb", "disk_gb", "resources", "count", "min_count", "required",
    "forbidden", "any_of", "group", "group_policy", "numa_nodes", "pinned", "hugepage_kb",
    "pci", "numa_policy", "hints", "request_id", "explain",
)  # fmt: skip


def shape_options(command: F) -> F:
    """The options of a request's shape (``--vcpus`` ... ``--explain``)."""
    for option in reversed(_SHAPE_OPTIONS):
        command = option(command)
    return command


def request_from_options(task: TaskSpec | None = None, **options: Any) -> CheckedRequest:
    """The request the shape's options describe (``options``: :data:`SHAPE_PARAMETERS`),
    carrying ``task``, checked here, once (the requestor places it as it is); a usage
    error naming the option at fault otherwise."""
    group, group_policy = options["group"], options["group_policy"]
    if (group is None) != (group_policy is None):
        raise click.UsageError("--group and --policy go together")
    numa = None
    numa_nodes, pinned, hugepage_kb = (
        options["numa_nodes"],
        options["pinned"],
        options["hugepage_kb"],
    )
    if numa_nodes is not None or pinned or hugepage_kb is not None:
        numa = NumaSpec(nodes=numa_nodes or 1, dedicated_cpus=pinned, hugepage_kb=hugepage_kb)
    required, forbidden, any_of = options["required"], options["forbidden"], options["any_of"]
    for option, traits in (
        ("--require", required),
        ("--forbid", forbidden),
        ("--any-of", [t.strip() for one in any_of for t in one.split(",")]),
    ):
        _check_traits(option, traits)
    try:
        return CheckedRequest.of(
            vcpus=options["vcpus"],
            memory_mb=options["memory_mb"],
            disk_gb=options["disk_gb"],
            resources=_amounts(options["resources"]),
            count=options["count"],
            min_count=options["min_count"],
            required_traits=frozenset(required),
            forbidden_traits=frozenset(forbidden),
            any_of_traits=tuple(frozenset(t.strip() for t in one.split(",")) for one in any_of),
            group=GroupSpec(name=group, policy=cast(GroupPolicy, group_policy)) if group else None,
            numa=numa,
            pci=_devices(options["pci"]),
            numa_policy=options["numa_policy"],
            explain=options["explain"],
            hints=parse_pairs(options["hints"], "KEY=VALUE", upper=False),
            request_id=options["request_id"],
            task=task,
        )
    except ValueError as error:
        raise click.UsageError(f"not a valid request: {error}") from None


def _check_traits(option: str, traits: Iterable[str]) -> None:
    """Each trait as the nodes spell them, or a usage error naming ``option`` in words."""
    for trait in traits:
        if re.fullmatch(TRAIT_PATTERN, trait) is None or len(trait) > TRAIT_MAX_LENGTH:
            upper = trait.upper()
            fits = re.fullmatch(TRAIT_PATTERN, upper) is not None
            guess = f" (did you mean {upper}?)" if fits and upper != trait else ""
            raise click.BadParameter(
                f"{trait!r} is not a trait: a trait is 1 to {TRAIT_MAX_LENGTH} upper-case "
                f"letters, digits and underscores, e.g. HW_CPU_X86_AVX2{guess}",
                param_hint=option,
            )


def _amounts(pairs: tuple[str, ...]) -> dict[str, int]:
    amounts = {}
    for resource_class, text in parse_pairs(pairs, "CLASS=AMOUNT", upper=False).items():
        try:
            amount = int(text)
        except ValueError:
            amount = -1
        if amount < 0:
            raise click.BadParameter(
                f"{resource_class}={text}: the amount is a whole number, 0 or more",
                param_hint="--resource",
            )
        amounts[resource_class] = amount
    return amounts


def _devices(pairs: tuple[str, ...]) -> dict[str, int]:
    """``--pci ALIAS:COUNT`` options as alias -> count (one alias given twice adds up)."""
    devices: dict[str, int] = {}
    for pair in pairs:
        alias, colon, text = pair.rpartition(":")
        if not colon or not alias or not text.isdigit() or int(text) < 1:
            raise click.BadParameter(
                f"{pair!r}: give ALIAS:COUNT, e.g. gpu-a100:1", param_hint="--pci"
            )
        devices[alias] = devices.get(alias, 0) + int(text)
    return devices
