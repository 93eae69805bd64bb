"""Keys per node with real processes on a real RabbitMQ: keys made by ``reservoir keys``, two
``reservoir node --node-key`` processes, ``reservoir request`` and ``reservoir audit``
reading the node keyring; then one node's key rolled over with no process restarted."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reservoir.brokers import connect

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]
pytest.importorskip("cryptography")


def reservoir(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reservoir.cli", *args],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


class Node:
    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.lines: queue.Queue[str] = queue.Queue()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "reservoir.cli", "node", "--name", name, "--vcpus", "8",
             "--memory-mb", "8192", *args],
            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        threading.Thread(target=self._pump, daemon=True).start()
        self.wait_for("ready")

    def _pump(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.put(line)

    def wait_for(self, text: str, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    break
                continue
            seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"node {self.name} never said {text!r}: {''.join(seen)}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=20)


@pytest.fixture
def env(reservoir_amqp_broker_url: str) -> Iterator[dict[str, str]]:
    separator = "&" if "?" in reservoir_amqp_broker_url else "?"
    url = f"{reservoir_amqp_broker_url}{separator}exchange=identity-e2e-{uuid.uuid4().hex[:10]}"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RESERVOIR_")}
    yield {**clean, "RESERVOIR_BROKER_URL": url}
    with connect(url) as broker:
        broker.delete_exchanges()  # type: ignore[attr-defined]


def test_nodes_with_keys_of_their_own_place_audit_and_roll_a_key_over_without_a_restart(
    env: dict[str, str], tmp_path: Path
) -> None:
    keyring = tmp_path / "keyring"
    made = reservoir("keys", "generate", "--id", "requestors-1", "--ed25519", env=env)
    assert made.returncode == 0, made.stderr
    requestor_private, requestor_public = (line.split()[1] for line in made.stdout.splitlines())
    suffix = uuid.uuid4().hex[:6]
    n1, n2 = f"n1-{suffix}", f"n2-{suffix}"
    for name in (n1, n2):
        key_file = str(tmp_path / f"{name}.key")
        added = reservoir("keys", "add-node", name, "--keyring", str(keyring),
                          "--key-file", key_file, "--id", f"{name}-old", env=env)  # fmt: skip
        assert added.returncode == 0, added.stderr
    on_nodes = {**env, "RESERVOIR_REQUESTOR_KEYS": requestor_public}
    on_requestors = {
        **env,
        "RESERVOIR_REQUESTOR_KEYS": requestor_private,
        "RESERVOIR_NODE_KEYRING": str(keyring),
    }
    nodes = {
        # one names its key with the flag, the other with the setting
        n1: Node(n1, ["--node-key", str(tmp_path / f"{n1}.key")], on_nodes),
        n2: Node(n2, [], {**on_nodes, "RESERVOIR_NODE_KEY": str(tmp_path / f"{n2}.key")}),
    }
    try:
        placed = reservoir("request", "--json", "--timeout", "20", "--vcpus", "2",
                           "--memory-mb", "1024", env=on_requestors)  # fmt: skip
        assert placed.returncode == 0, placed.stderr
        assert json.loads(placed.stdout)["placed"] is True
        assert n1 in placed.stdout or n2 in placed.stdout
        audited = reservoir("audit", "--json", "--expect-nodes", "2", "--wait", "10",
                            env=on_requestors)  # fmt: skip
        assert audited.returncode == 0, audited.stdout + audited.stderr

        # roll n1's key over with no restart: the keyring lists the new key beside the
        # old; the new key file is moved over n1's, which it signs with within 2 s
        new_key = str(tmp_path / f"{n1}-new.key")
        rolled = reservoir("keys", "add-node", n1, "--keyring", str(keyring),
                           "--key-file", new_key, "--id", f"{n1}-new", env=env)  # fmt: skip
        assert rolled.returncode == 0, rolled.stderr
        process = nodes[n1].process
        os.replace(new_key, tmp_path / f"{n1}.key")
        time.sleep(2.5)
        retired = reservoir("keys", "retire", n1, f"{n1}-old", "--keyring", str(keyring), env=env)
        assert retired.returncode == 0, retired.stderr
        audited = reservoir("audit", "--json", "--expect-nodes", "2", "--wait", "10",
                            env=on_requestors)  # fmt: skip
        assert audited.returncode == 0, audited.stdout + audited.stderr
        assert json.loads(audited.stdout)["nodes"] == 2  # n1 answered with its new key
        assert nodes[n1].process is process and process.poll() is None  # never restarted
    finally:
        for node in nodes.values():
            node.stop()
