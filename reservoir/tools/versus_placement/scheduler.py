"""One scheduler process of ``reservoir versus placement``: claims against OpenStack
Placement the way Nova's scheduler does, one instance per request.

For each placement it sends the query Nova sends (``GET /allocation_candidates`` with the
flavour's resources and ``limit=1000``, microversion :data:`MICROVERSION`), ranks the
candidates with the weighers of Nova's default set that tell these providers apart (see
:func:`ranked`), then claims the first with ``PUT /allocations/{consumer_uuid}``
(``consumer_generation: null``, a new consumer): a 409 ``placement.concurrent_update`` is
tried again on the same provider up to :data:`CLAIM_ATTEMPTS` times in all (the
``@retries`` of Nova's report client), any other 409 (the provider filled up meanwhile)
moves on to the next candidate, and no candidate left is a refusal (Nova's NoValidHost).

Its conversation with :mod:`reservoir.tools.versus_placement.runner`, one JSON object a
line on stdout: ``{"event": "ready"}`` once Placement answers; on a line ``go`` on stdin it
places ``--placements`` instances and says ``{"event": "done", "latencies_s": [...],
"refused": N, "conflicts": {CODE: COUNT}, "retries": N, "next_candidate": N}``; then it
exits (also when stdin closes).

    python -m reservoir.tools.versus_placement.scheduler --url http://127.0.0.1:PORT \\
        --placements 50 --vcpus 1 --memory-mb 1024
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["MICROVERSION", "PROJECT_ID", "USER_ID", "Claims", "PlacementClient", "main", "ranked"]

#: the microversion of both calls: Nova's scheduler asks allocation candidates at 1.36
#: (same_subtree, required traits) and its claim carries a consumer generation (1.28+)
MICROVERSION: Final = "placement 1.36"
#: the most candidates Nova asks for ([scheduler] max_placement_results, default 1000)
CANDIDATE_LIMIT: Final = 1000
#: tries of one claim on a provider generation conflict (Nova's report client @retries)
CLAIM_ATTEMPTS: Final = 4
#: queries each scheduler sends before it says it is ready (Placement's workers open
#: their database connections and caches on the first requests): no claims, so that the
#: fill measurement's counts stay exact
WARMUP_QUERIES: Final = 5
#: Nova's weigher multipliers for the weighers modelled (ram, cpu: 1.0 by default)
RAM_WEIGHT_MULTIPLIER: Final = 1.0
CPU_WEIGHT_MULTIPLIER: Final = 1.0
#: the project and user every claim is made for (noauth2 takes any)
PROJECT_ID: Final = "a" * 32
USER_ID: Final = "b" * 32


class PlacementClient:
    """Placement's HTTP API on a kept-open connection (reopened when the server closes
    it, as gunicorn's sync workers do after each response)."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        self._connection = http.client.HTTPConnection(
            parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=timeout_s
        )

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        headers = {
            "X-Auth-Token": "admin",  # auth_strategy = noauth2: this token is an admin
            "OpenStack-API-Version": MICROVERSION,
            "Accept": "application/json",
        }
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):
            try:
                self._connection.request(method, path, body=payload, headers=headers)
                response = self._connection.getresponse()
                data = response.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._connection.close()
                if attempt == 2:
                    raise
        return response.status, (json.loads(data) if data else None)

    def close(self) -> None:
        self._connection.close()


def _normalised(values: Sequence[float]) -> list[float]:
    """Nova's weight normalisation: the smallest value 0, the largest 1, all 0 if equal."""
    low, high = min(values), max(values)
    if high == low:
        return [0.0 for _ in values]
    return [(value - low) / (high - low) for value in values]


def _free(summary: Mapping[str, Any], resource: str) -> float:
    held = summary["resources"].get(resource)
    return float(held["capacity"] - held["used"]) if held else 0.0


def ranked(candidates: Mapping[str, Any]) -> list[str]:
    """The providers of an ``/allocation_candidates`` answer, best first, as Nova's
    default weighers rank them here: the RAM weigher (most free memory first) and the CPU
    weigher (most free VCPUs first), each normalised over the candidates and multiplied by
    its default 1.0. The other default weighers (disk, I/O ops, PCI, server groups, build
    failures, cross cell, instances, hypervisor version, image properties) give every
    provider of this run the same weight, so they cannot change the order. Equal weights
    keep Placement's order (Nova's sort is stable, and ``host_subset_size`` is 1)."""
    summaries = candidates["provider_summaries"]
    providers = [
        next(iter(request["allocations"])) for request in candidates["allocation_requests"]
    ]
    if not providers:
        return []
    ram = _normalised([_free(summaries[p], "MEMORY_MB") for p in providers])
    cpu = _normalised([_free(summaries[p], "VCPU") for p in providers])
    weights = [
        RAM_WEIGHT_MULTIPLIER * r + CPU_WEIGHT_MULTIPLIER * c for r, c in zip(ram, cpu, strict=True)
    ]
    order = sorted(range(len(providers)), key=lambda index: weights[index], reverse=True)
    return [providers[index] for index in order]


@dataclass
class Claims:
    """What one scheduler's placements came to."""

    latencies_s: list[float] = field(default_factory=list)
    refused: int = 0
    #: the 409s Placement answered, by error code
    conflicts: Counter[str] = field(default_factory=Counter)
    #: claims sent again to the same provider after a generation conflict
    retries: int = 0
    #: claims that moved on to the next candidate (the first one had filled up)
    next_candidate: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "latencies_s": self.latencies_s,
            "refused": self.refused,
            "conflicts": dict(self.conflicts),
            "retries": self.retries,
            "next_candidate": self.next_candidate,
        }


def _candidates_path(resources: Mapping[str, int]) -> str:
    """The query Nova's scheduler sends for a flavour (no traits, no aggregates here)."""
    wanted = ",".join(f"{name}:{amount}" for name, amount in resources.items())
    return f"/allocation_candidates?resources={wanted}&limit={CANDIDATE_LIMIT}"


def place(client: PlacementClient, resources: Mapping[str, int], claims: Claims) -> bool:
    """One instance, claimed as Nova's scheduler claims it; False when it is refused."""
    started = time.perf_counter()
    status, candidates = client.call("GET", _candidates_path(resources))
    if status != 200:
        raise RuntimeError(f"GET /allocation_candidates answered {status}: {candidates}")
    consumer = str(uuid.uuid4())
    for index, provider in enumerate(ranked(candidates)):
        if index:
            claims.next_candidate += 1
        body = {
            "allocations": {provider: {"resources": dict(resources)}},
            "project_id": PROJECT_ID,
            "user_id": USER_ID,
            "consumer_generation": None,
        }
        for attempt in range(CLAIM_ATTEMPTS):
            if attempt:
                claims.retries += 1
            status, answer = client.call("PUT", f"/allocations/{consumer}", body)
            if status == 204:
                claims.latencies_s.append(time.perf_counter() - started)
                return True
            if status != 409:
                raise RuntimeError(f"PUT /allocations answered {status}: {answer}")
            code = (answer or {}).get("errors", [{}])[0].get("code", "unknown")
            claims.conflicts[code] += 1
            if code != "placement.concurrent_update":
                break  # this provider cannot take it now: the next candidate
    claims.refused += 1
    return False


def _say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m reservoir.tools.versus_placement.scheduler")
    parser.add_argument("--url", required=True, help="Placement's endpoint")
    parser.add_argument("--placements", type=int, required=True)
    parser.add_argument("--vcpus", type=int, required=True)
    parser.add_argument("--memory-mb", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    client = PlacementClient(args.url)
    try:
        resources = {"VCPU": args.vcpus, "MEMORY_MB": args.memory_mb}
        for _ in range(WARMUP_QUERIES):
            status, answer = client.call("GET", _candidates_path(resources))
            if status != 200:
                print(f"scheduler: Placement answered {status}: {answer}", file=sys.stderr)
                return 1
        _say("ready")
        if sys.stdin.readline().strip() != "go":
            return 0
        claims = Claims()
        for _ in range(args.placements):
            place(client, resources, claims)
        _say("done", **claims.as_json())
        return 0
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
