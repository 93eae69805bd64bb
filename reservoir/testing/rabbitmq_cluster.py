"""A RabbitMQ cluster on loopback for tests: ``size`` nodes of the machine's own
``rabbitmq-server``, each with its own node name, AMQP port, inter-node port and data
directory under one base directory, clustered with ``rabbitmqctl join_cluster``.

Nothing leaves loopback: every listener and the Erlang distribution bind 127.0.0.1, and
epmd is asked to listen there only. The nodes share an Erlang cookie of their own (in
the base directory), so they are not reachable with the machine's RabbitMQ's cookie, and
they never touch that RabbitMQ's data. :meth:`RabbitMqCluster.kill` ends a node the hard
way (SIGKILL of its Erlang VM), as a crashed broker host would. Ports are picked free but
not held: a node whose port was taken before it bound it starts again on fresh ones. Each
node and each ``rabbitmqctl`` runs in the node's directory, so whatever the VM writes where
it runs (a crash dump) goes with the base directory.

It needs ``rabbitmq-server`` and ``rabbitmqctl`` (Debian's package is enough) and a user
allowed to run them: root, or the ``rabbitmq`` user.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from reservoir.testing.tls import TlsFiles

__all__ = ["ClusterUnavailable", "RabbitMqCluster"]

_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
_CTL = Path("/usr/lib/rabbitmq/bin/rabbitmqctl")
START_TIMEOUT_S = 90.0
#: how often a node whose port was taken as it started is launched again on fresh ones
LAUNCH_ATTEMPTS = 3
#: what a node's output says when a port it was given is taken: the ports are picked free
#: but not held, and a socket left in TIME_WAIT by a node just stopped, or anyone's
#: listener, can take one before the node binds it
_PORT_TAKEN = ("dist_port_already_used", "eaddrinuse")


class ClusterUnavailable(RuntimeError):
    """This machine cannot run a RabbitMQ cluster (no RabbitMQ, or not allowed)."""


class _PortTaken(RuntimeError):
    """A node exited as it started because a port it was given is taken."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class ClusterNode:
    name: str
    amqp_port: int
    dist_port: int
    directory: Path
    tls_port: int = 0
    process: subprocess.Popen[bytes] | None = None
    #: where its latest launch's output starts in ``server.out`` (each launch appends)
    output_from: int = 0

    def take_fresh_ports(self, *, tls: bool) -> None:
        """Free ports for AMQP, the Erlang distribution, and TLS when ``tls``: picked free,
        not held (see :meth:`RabbitMqCluster._wait_up_or_move`)."""
        self.amqp_port, self.dist_port = _free_port(), _free_port()
        self.tls_port = _free_port() if tls else 0

    @property
    def node_name(self) -> str:
        return f"{self.name}@localhost"


class RabbitMqCluster:
    """``size`` clustered RabbitMQ nodes on loopback; a context manager."""

    def __init__(
        self, base_dir: Path, *, size: int = 3, user: str = "guest", tls: TlsFiles | None = None
    ) -> None:
        """``tls``: give every node a TLS listener too (``tls_port``) that requires a
        client certificate signed by ``tls.ca_cert``."""
        for tool in (_SERVER, _CTL):
            if not tool.exists():
                raise ClusterUnavailable(f"{tool} is missing: install rabbitmq-server")
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            raise ClusterUnavailable("starting RabbitMQ nodes of its own needs root")
        self.base_dir = base_dir
        self.user = user
        self.tls = tls
        self.home = base_dir / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(16).upper())
            cookie.chmod(0o400)
        tag = secrets.token_hex(3)
        self.nodes = [
            ClusterNode(f"reservoir-{tag}-{i}", 0, 0, base_dir / f"n{i}") for i in range(size)
        ]
        for node in self.nodes:
            node.take_fresh_ports(tls=tls is not None)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> RabbitMqCluster:
        for node in self.nodes:
            self._launch(node)
        for node in self.nodes:
            self._wait_up_or_move(node)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            self.ctl(node, "stop_app")
            self.ctl(node, "reset")
            self.ctl(node, "join_cluster", first.node_name)
            self.ctl(node, "start_app")
        for node in self.nodes:
            self.ctl(node, "await_startup")
        return self

    def __enter__(self) -> RabbitMqCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every node and remove their data."""
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    self.ctl(node, "stop", timeout_s=30)
                if node.process.poll() is None:
                    self._kill_vm(node)
        shutil.rmtree(self.base_dir, ignore_errors=True)

    # -- faults ------------------------------------------------------------------------

    def kill(self, index: int) -> None:
        """SIGKILL one node's Erlang VM: a broker host crashing."""
        self._kill_vm(self.nodes[index])

    def restart(self, index: int) -> None:
        """Start a killed node again; it rejoins the cluster from its data."""
        node = self.nodes[index]
        self._launch(node)
        self._wait_up(node)
        self.ctl(node, "await_startup")

    def _port_closed(self, node: ClusterNode, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", node.amqp_port), timeout=1).close()
            except OSError:
                return
            time.sleep(0.1)
        raise RuntimeError(f"RabbitMQ node {node.name} still listens after it was killed")

    # -- addresses ---------------------------------------------------------------------

    def url(self, index: int, *, vhost: str = "") -> str:
        return f"amqp://{self.user}:{self.user}@127.0.0.1:{self.nodes[index].amqp_port}/{vhost}"

    def tls_url(self, index: int, *, scheme: str = "amqps", vhost: str = "") -> str:
        """The node's TLS listener, by name (``localhost``, which its certificate names)."""
        port = self.nodes[index].tls_port
        return f"{scheme}://{self.user}:{self.user}@localhost:{port}/{vhost}"

    def urls(self, *, vhost: str = "") -> list[str]:
        return [self.url(i, vhost=vhost) for i in range(len(self.nodes))]

    def ctl(self, node: ClusterNode, *args: str, timeout_s: float = 60.0) -> str:
        done = subprocess.run(
            [str(_CTL), "-q", "-n", node.node_name, *args],
            env=self._env(node),
            cwd=node.directory,  # where an Erlang crash dump lands: removed with the rest
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} on {node.name}: {said}")
        return done.stdout

    def connected_node(self, peer_port: int) -> int | None:
        """Which node holds the client connection from local port ``peer_port``."""
        for index, node in enumerate(self.nodes):
            if node.process is None or node.process.poll() is not None:
                continue
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                for line in self.ctl(node, "list_connections", "peer_port").split():
                    if line.isdigit() and int(line) == peer_port:
                        return index
        return None

    # -- internals ---------------------------------------------------------------------

    def _env(self, node: ClusterNode) -> dict[str, str]:
        node.directory.mkdir(parents=True, exist_ok=True)
        config = node.directory / "rabbitmq.conf"
        if not config.exists():
            lines = [
                f"listeners.tcp.local = 127.0.0.1:{node.amqp_port}",
                "loopback_users = none",
                # keep the test cluster small: a stopped node must not block the others
                "cluster_partition_handling = ignore",
            ]
            if self.tls is not None:
                lines += [
                    f"listeners.ssl.local = 127.0.0.1:{node.tls_port}",
                    f"ssl_options.cacertfile = {self.tls.ca_cert}",
                    f"ssl_options.certfile = {self.tls.server_cert}",
                    f"ssl_options.keyfile = {self.tls.server_key}",
                    "ssl_options.verify = verify_peer",
                    "ssl_options.fail_if_no_peer_cert = true",
                ]
            config.write_text("\n".join(lines) + "\n")
            (node.directory / "enabled_plugins").write_text("[].\n")
            (node.directory / "env.conf").write_text("")
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")},
            "HOME": str(self.home),
            "RABBITMQ_CONF_ENV_FILE": str(node.directory / "env.conf"),
            "RABBITMQ_NODENAME": node.node_name,
            "RABBITMQ_CONFIG_FILE": str(config),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(node.directory / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(node.directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(node.directory / "log"),
            "RABBITMQ_PID_FILE": str(node.directory / "rabbit.pid"),
            "RABBITMQ_DIST_PORT": str(node.dist_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "RABBITMQ_CTL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def _launch(self, node: ClusterNode) -> None:
        log = (node.directory / "server.out").open("ab") if node.directory.exists() else None
        env = self._env(node)
        if log is None:
            log = (node.directory / "server.out").open("ab")
        node.output_from = log.tell()
        # In the node's directory, so that what the VM writes where it runs (an Erlang or
        # Mnesia crash dump as a node is stopped or killed) goes with the base directory,
        # not into the caller's (a test run's checkout).
        node.process = subprocess.Popen(
            [str(_SERVER)], env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            cwd=node.directory, start_new_session=True,
        )  # fmt: skip
        log.close()

    def _wait_up_or_move(self, node: ClusterNode) -> None:
        """Wait for a node just launched; one whose port was taken meanwhile is launched
        again on fresh ports (it has no clients yet to be told of the old ones)."""
        for attempt in range(1, LAUNCH_ATTEMPTS + 1):
            try:
                self._wait_up(node)
                return
            except _PortTaken:
                if attempt == LAUNCH_ATTEMPTS:
                    raise
            node.take_fresh_ports(tls=self.tls is not None)
            (node.directory / "rabbitmq.conf").unlink()  # written again with the new ports
            self._launch(node)

    def _wait_up(self, node: ClusterNode) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert node.process is not None
            if node.process.poll() is not None:
                with (node.directory / "server.out").open("rb") as log:
                    log.seek(node.output_from)
                    output = log.read().decode(errors="replace")
                tail = output[-2000:]
                if any(marker in output for marker in _PORT_TAKEN):
                    raise _PortTaken(f"RabbitMQ node {node.name}: a port was taken:\n{tail}")
                raise RuntimeError(f"RabbitMQ node {node.name} exited:\n{tail}")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", node.amqp_port), timeout=1).close()
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"RabbitMQ node {node.name} not up in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)

    def _kill_vm(self, node: ClusterNode) -> None:
        pid_file = node.directory / "rabbit.pid"
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
        if node.process is not None:
            # the script's whole session: the VM and its helpers (epmd is shared; spared)
            with contextlib.suppress(OSError):
                os.killpg(node.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=30)
        self._port_closed(node)
