"""Keys per node with real processes on a real RabbitMQ: keys made by ``reservoir keys``, two
``reservoir node --node-key`` processes, ``reservoir request`` and ``reservoir audit``
reading the node keyring; then one node's key rolled over with no process restarted."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reservoir.testing import ProcessCluster

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]
pytest.importorskip("cryptography")


@pytest.fixture
def cluster(reservoir_amqp_url: str) -> Iterator[ProcessCluster]:
    """Nodes (with no state directory) and commands on the test's own exchange, with no
    other ``RESERVOIR_`` setting of the test run's environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RESERVOIR_")}
    env = {**clean, "RESERVOIR_BROKER_URL": reservoir_amqp_url}
    with ProcessCluster(reservoir_amqp_url, env=env) as cluster:
        yield cluster


def test_nodes_with_keys_of_their_own_place_audit_and_roll_a_key_over_without_a_restart(
    cluster: ProcessCluster, tmp_path: Path
) -> None:
    env = cluster.env
    keyring = tmp_path / "keyring"
    made = cluster.run("keys", "generate", "--id", "requestors-1", "--ed25519", env=env)
    assert made.returncode == 0, made.stderr
    requestor_private, requestor_public = (line.split()[1] for line in made.stdout.splitlines())
    suffix = uuid.uuid4().hex[:6]
    n1, n2 = f"n1-{suffix}", f"n2-{suffix}"
    for name in (n1, n2):
        key_file = str(tmp_path / f"{name}.key")
        added = cluster.run("keys", "add-node", name, "--keyring", str(keyring), "--key-file",
                            key_file, "--id", f"{name}-old", env=env)  # fmt: skip
        assert added.returncode == 0, added.stderr
    on_nodes = {**env, "RESERVOIR_REQUESTOR_KEYS": requestor_public}
    on_requestors = {
        **env,
        "RESERVOIR_REQUESTOR_KEYS": requestor_private,
        "RESERVOIR_NODE_KEYRING": str(keyring),
    }
    # one names its key with the flag, the other with the setting
    size = {"vcpus": 8, "memory_mb": 8192}
    cluster.start_node(n1, "--node-key", str(tmp_path / f"{n1}.key"), env=on_nodes, **size)
    n2_env = {**on_nodes, "RESERVOIR_NODE_KEY": str(tmp_path / f"{n2}.key")}
    cluster.start_node(n2, env=n2_env, **size)
    nodes = cluster.nodes
    placed = cluster.run("request", "--json", "--timeout", "20", "--vcpus", "2", "--memory-mb",
                         "1024", env=on_requestors)  # fmt: skip
    assert placed.returncode == 0, placed.stderr
    assert json.loads(placed.stdout)["placed"] is True
    assert n1 in placed.stdout or n2 in placed.stdout
    audited = cluster.run(
        "audit", "--json", "--expect-nodes", "2", "--wait", "10", env=on_requestors
    )
    assert audited.returncode == 0, audited.stdout + audited.stderr

    # roll n1's key over with no restart: the keyring lists the new key beside the
    # old; the new key file is moved over n1's, which it signs with within 2 s
    new_key = str(tmp_path / f"{n1}-new.key")
    rolled = cluster.run("keys", "add-node", n1, "--keyring", str(keyring), "--key-file", new_key,
                         "--id", f"{n1}-new", env=env)  # fmt: skip
    assert rolled.returncode == 0, rolled.stderr
    process = nodes[n1].process
    os.replace(new_key, tmp_path / f"{n1}.key")
    time.sleep(2.5)
    retired = cluster.run("keys", "retire", n1, f"{n1}-old", "--keyring", str(keyring), env=env)
    assert retired.returncode == 0, retired.stderr
    audited = cluster.run(
        "audit", "--json", "--expect-nodes", "2", "--wait", "10", env=on_requestors
    )
    assert audited.returncode == 0, audited.stdout + audited.stderr
    assert json.loads(audited.stdout)["nodes"] == 2  # n1 answered with its new key
    assert nodes[n1].process is process and process.poll() is None  # never restarted
