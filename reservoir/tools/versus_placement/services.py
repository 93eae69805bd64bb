"""The incumbent's services, started on loopback for one run and stopped with it: a
MariaDB server of its own (a private datadir under the run's temporary directory, never
the machine's own server) and OpenStack Placement's WSGI application under gunicorn.

Everything is started inside a :class:`contextlib.ExitStack` the caller owns: leaving it
(at the end, on an error, on Ctrl-C) stops the processes and removes the directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from reservoir.version import install_hint

__all__ = ["IncumbentUnavailable", "PlacementService", "missing", "start_placement"]

#: the Debian MariaDB server's programs (apt-get install mariadb-server)
MARIADB_SERVER: Final = "mariadbd"
MARIADB_INSTALL_DB: Final = "mariadb-install-db"
#: gunicorn workers Placement runs with
WSGI_WORKERS: Final = 2
START_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 20.0


class IncumbentUnavailable(RuntimeError):
    """Placement, its database or its WSGI server cannot be started here."""


def _program(name: str) -> str | None:
    """A program on PATH, or in the sbin directories Debian puts servers in."""
    found = shutil.which(name)
    if found:
        return found
    for directory in ("/usr/sbin", "/usr/local/sbin", "/sbin"):
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def missing() -> list[str]:
    """What this machine lacks to run the incumbent (empty when nothing)."""
    lacking = []
    for module, package in (
        ("placement", "openstack-placement"),
        ("pymysql", "PyMySQL"),
        ("gunicorn", "gunicorn"),
    ):
        try:
            __import__(module)
        except ImportError:
            lacking.append(f"{package} ({install_hint('placement')})")
    for program in (MARIADB_SERVER, MARIADB_INSTALL_DB):
        if _program(program) is None:
            lacking.append(f"{program} (apt-get install mariadb-server)")
    return lacking


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


def _stop(process: subprocess.Popen[bytes], stop_signal: int = signal.SIGTERM) -> None:
    """``stop_signal``, then SIGKILL if it does not go within STOP_TIMEOUT_S."""
    if process.poll() is None:
        process.send_signal(stop_signal)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(log: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        return " | ".join(lines[-5:])
    return ""


def _started(
    command: list[str],
    log: Path,
    stack: contextlib.ExitStack,
    env: dict[str, str] | None = None,
    stop_signal: int = signal.SIGTERM,
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    stack.callback(_stop, process, stop_signal)
    return process


def _wait_until(
    ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str, log: Path
) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if process.poll() is not None:
            raise IncumbentUnavailable(
                f"{what} exited with status {process.returncode}: {_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise IncumbentUnavailable(f"{what} did not answer within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


def _children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (gunicorn's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@dataclass(frozen=True)
class PlacementService:
    """Placement's endpoint and the processes behind it (for their CPU)."""

    url: str
    mariadb_pids: list[int]
    placement_pids: list[int]
    workdir: Path


def start_placement(
    stack: contextlib.ExitStack, progress: Callable[[str], None]
) -> PlacementService:
    """MariaDB on a free loopback port with a private datadir, Placement's database
    created (``placement-manage db sync``) and its WSGI app under gunicorn with
    :data:`WSGI_WORKERS` workers on another free port; all stopped and removed when
    ``stack`` closes."""
    lacking = missing()
    if lacking:
        raise IncumbentUnavailable("missing: " + ", ".join(lacking))
    workdir = Path(tempfile.mkdtemp(prefix="reservoir-versus-placement-"))
    stack.callback(shutil.rmtree, workdir, ignore_errors=True)
    server, install_db = _program(MARIADB_SERVER), _program(MARIADB_INSTALL_DB)
    assert server is not None and install_db is not None  # missing() said so
    datadir = workdir / "mariadb"
    user = ["--user=root"] if os.geteuid() == 0 else []
    install = subprocess.run(
        [install_db, "--no-defaults", f"--datadir={datadir}", "--skip-test-db",
         "--auth-root-authentication-method=normal", *user],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if install.returncode:
        tail = " | ".join((install.stdout + install.stderr).strip().splitlines()[-5:])
        raise IncumbentUnavailable(f"mariadb-install-db failed: {tail}")
    # Placement's database, created by the server itself as it starts (no client needed)
    init_sql = workdir / "init.sql"
    init_sql.write_text("CREATE DATABASE IF NOT EXISTS placement CHARACTER SET utf8;\n")
    db_port = free_port()
    db_log = workdir / "mariadb.log"
    progress(f"starting MariaDB on 127.0.0.1:{db_port} (datadir {datadir})")
    mariadb = _started(
        [server, "--no-defaults", f"--datadir={datadir}", f"--port={db_port}",
         "--bind-address=127.0.0.1", f"--socket={workdir / 'mariadb.sock'}",
         f"--pid-file={workdir / 'mariadb.pid'}", "--skip-grant-tables", "--skip-log-bin",
         "--innodb-buffer-pool-size=128M", f"--init-file={init_sql}", "--max-connections=500",
         *user],
        db_log, stack,
    )  # fmt: skip
    _wait_until(lambda: _answers(db_port), mariadb, "mariadbd", db_log)

    etc = workdir / "etc"
    etc.mkdir()
    (etc / "placement.conf").write_text(
        "[DEFAULT]\ndebug = false\n"
        "[api]\nauth_strategy = noauth2\n"
        "[placement_database]\n"
        f"connection = mysql+pymysql://root@127.0.0.1:{db_port}/placement?charset=utf8\n"
    )
    bin_dir = Path(sys.executable).parent
    manage = shutil.which("placement-manage", path=str(bin_dir)) or shutil.which("placement-manage")
    if manage is None:
        raise IncumbentUnavailable("placement-manage is not installed next to this Python")
    progress("creating Placement's database (placement-manage db sync)")
    sync = subprocess.run(
        [manage, "--config-file", str(etc / "placement.conf"), "db", "sync"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if sync.returncode:
        tail = " | ".join((sync.stdout + sync.stderr).strip().splitlines()[-5:])
        raise IncumbentUnavailable(f"placement-manage db sync failed: {tail}")

    api_port = free_port()
    api_log = workdir / "gunicorn.log"
    env = {**os.environ, "OS_PLACEMENT_CONFIG_DIR": str(etc)}
    progress(f"starting Placement under gunicorn ({WSGI_WORKERS} workers) on 127.0.0.1:{api_port}")
    gunicorn = _started(
        [sys.executable, "-m", "gunicorn", "--workers", str(WSGI_WORKERS),
         "--bind", f"127.0.0.1:{api_port}", "--control-socket", str(workdir / "gunicorn.ctl"),
         "--worker-tmp-dir", str(workdir), "placement.wsgi.api:application"],
        api_log, stack, env, signal.SIGINT,  # gunicorn's quick shutdown: no request to wait for
    )  # fmt: skip
    url = f"http://127.0.0.1:{api_port}"
    _wait_until(lambda: _placement_answers(url), gunicorn, "gunicorn (Placement)", api_log)
    workers: list[int] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(workers) < WSGI_WORKERS and time.monotonic() < deadline:
        workers = _children_of(gunicorn.pid)
        time.sleep(0.1)
    return PlacementService(url, [mariadb.pid], [gunicorn.pid, *workers], workdir)


def _placement_answers(url: str) -> bool:
    with contextlib.suppress(urllib.error.URLError, OSError):
        request = urllib.request.Request(url + "/", headers={"X-Auth-Token": "admin"})
        with urllib.request.urlopen(request, timeout=2) as answer:
            return int(answer.status) == 200
    return False
