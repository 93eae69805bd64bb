"""What the end-to-end tests of ``reservoir serve`` share: the arguments of their node
processes, and waiting for a replica to say it is ready over HTTP."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from reservoir.testing.processes import READY_TIMEOUT_S, ReservoirProcess

NODE_VCPUS = 8
NODE_MEMORY_MB = 16384


def node_args(name: str, state_dir: Path, metrics_port: int | None = None) -> list[str]:
    args = ["node", "--name", name, "--vcpus", str(NODE_VCPUS),
            "--memory-mb", str(NODE_MEMORY_MB), "--state-dir", str(state_dir)]  # fmt: skip
    return args if metrics_port is None else [*args, "--metrics-port", str(metrics_port)]


def wait_until_ready(base_url: str, serve: ReservoirProcess) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(base_url=base_url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            assert serve.running, "".join(serve.said)
            try:
                if client.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # a real process starting: nothing to wait on but its port
    raise AssertionError(f"reservoir serve never became ready: {''.join(serve.said)}")
