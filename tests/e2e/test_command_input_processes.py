"""Input a command cannot use is refused in words, as a user meets it: real ``reservoir``
processes, no broker needed (they stop before one is reached, or run on ``memory://``).
An extra that is not installed is one line saying how to install it; what it only adds
(CPU traits) is left out with a warning rather than stopping the rest."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXCLUDED = "0000:00:1f.6"
HANDED_OUT = "0000:3b:00.0"


def reservoir(*args: str, without: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``reservoir ARGS`` in a process of its own; ``without``: modules it cannot import, as
    on an install without the extra that brings them."""
    blocked = "".join(f"sys.modules[{name!r}] = None; " for name in without)
    code = f"import sys; {blocked}from reservoir.cli import main; main(sys.argv[1:])"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def refusal(done: subprocess.CompletedProcess[str]) -> str:
    """The line a refused command ends with: exit status 2, no traceback, none of the
    validator's own words."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "Expected `" not in done.stderr and "regex" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def small_host(root: Path) -> Path:
    """Two CPUs on one cell and 4 GiB; a GPU the configuration hands out and an Ethernet
    controller it excludes."""
    system = root / "sys/devices/system"
    write(system / "cpu/online", "0-1")
    write(system / "node/node0/cpulist", "0-1")
    write(system / "node/node0/meminfo", f"Node 0 MemTotal:       {4 * 2**20} kB")
    for address, vendor, product, klass in (
        (HANDED_OUT, "10de", "20b0", "030200"),
        (EXCLUDED, "8086", "15bb", "020000"),
    ):
        device = root / "sys/bus/pci/devices" / address
        write(device / "vendor", f"0x{vendor}")
        write(device / "device", f"0x{product}")
        write(device / "class", f"0x{klass}")
        write(device / "numa_node", "0")
    write(root / "proc/cpuinfo", "processor\t: 0\nflags\t\t: fpu sse4_2 avx2\n")
    return root


NODE_FILE = f"""
name = "small"

[discovery]
enabled = true
reserved_memory_mb = 512
excluded_devices = ["{EXCLUDED}"]

[[pci.alias]]
name = "gpu"
vendor_id = "10de"
product_id = "20b0"

[[pci.device_spec]]
vendor_id = "10de"
"""


# -- 6. a missing extra is one line saying what to install -------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("keys", "generate", "--id", "k1", "--ed25519"),
        ("keys", "add-node", "n1", "--keyring", "{tmp}/ring", "--key-file", "{tmp}/n1.key"),
    ],
    ids=["generate", "add-node"],
)
def test_ed25519_keys_without_the_signing_extra_are_one_line_saying_what_to_install(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    done = reservoir(*(a.format(tmp=tmp_path) for a in args), without=("cryptography",))
    line = refusal(done)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert line.startswith(f"reservoir keys {args[1]}: Ed25519 keys need the 'cryptography'")
    assert "pip install 'cryptography>=38'" in line, line
    assert not (tmp_path / "n1.key").exists() and not (tmp_path / "ring").exists()


def test_discovery_on_an_install_without_os_traits_reads_the_host_and_leaves_the_traits_out(
    tmp_path: Path,
) -> None:
    root = small_host(tmp_path / "root")
    shown = reservoir("node", "--discover", "--root", str(root), "--print", without=("os_traits",))
    assert shown.returncode == 0, shown.stderr
    assert "inventory: MEMORY_MB=4096, PCPU=2, VCPU=2" in shown.stdout
    assert "traits: none (CPU traits need os-traits: pip install 'os-traits>=2.0'" in shown.stdout

    blocked = "import sys; sys.modules['os_traits'] = None; "
    node = subprocess.Popen(
        [sys.executable, "-c", blocked + "from reservoir.cli import main; main(sys.argv[1:])",
         "node", "--name", "base", "--discover", "--root", str(root), "--broker", "memory://"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert node.stderr is not None
        for line in node.stderr:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    said: list[str] = []
    deadline = time.monotonic() + 20
    try:
        while not any(": ready on " in line for line in said):
            assert time.monotonic() < deadline and node.poll() is None, said
            try:
                said.append(lines.get(timeout=0.5))
            except queue.Empty:
                continue
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(timeout=20)
    (warning,) = [line for line in said if "warning" in line]
    assert (
        "node base: warning: discovered without the CPU's traits: CPU traits need os-traits: "
        "pip install 'os-traits>=2.0'" in warning
    )
    (configuration,) = [line for line in said if "configuration {" in line]
    running = json.loads(configuration.split("configuration ", 1)[1])
    assert running["inventory"]["VCPU"]["total"] == 2
    assert running["traits"] == []


# -- 7. input that would mean nothing is refused -----------------------------------------


def test_discovery_under_a_root_that_is_not_there_is_refused(tmp_path: Path) -> None:
    line = refusal(reservoir("node", "--discover", "--root", str(tmp_path / "none"), "--print"))
    assert line == f"Error: --discover: root {tmp_path / 'none'}: no such directory"


def test_discovery_that_finds_no_cpu_is_refused_rather_than_an_empty_host(tmp_path: Path) -> None:
    line = refusal(reservoir("node", "--discover", "--root", str(tmp_path), "--print"))
    assert line.startswith(f"Error: --discover: no online CPU under {tmp_path}")


def test_discover_print_shows_the_memory_the_host_keeps_and_which_devices_are_excluded(
    tmp_path: Path,
) -> None:
    write(tmp_path / "node.toml", NODE_FILE)
    root = small_host(tmp_path / "root")
    args = ("node", "--config", str(tmp_path / "node.toml"), "--discover", "--root", str(root))
    shown = reservoir(*args, "--print")
    assert shown.returncode == 0, shown.stderr
    assert "MEMORY_MB=4096 (host-reserved 512)" in shown.stdout
    rows = {line.split()[0]: line.split()[-1] for line in shown.stdout.splitlines()
            if line.startswith("0000:")}  # fmt: skip
    assert rows == {HANDED_OUT: "gpu", EXCLUDED: "excluded"}
    found = json.loads(reservoir(*args, "--print", "--json").stdout)
    assert found["reserved"] == {"MEMORY_MB": 512}
    assert found["excluded_devices"] == [EXCLUDED]
    assert found["devices"] == {HANDED_OUT: "gpu"}


@pytest.mark.parametrize("key", ["vendor_id", "product_id"])
def test_a_pci_id_that_is_not_4_hex_digits_is_refused_naming_the_line(
    key: str, tmp_path: Path
) -> None:
    bad = NODE_FILE.replace('vendor_id = "10de"\nproduct_id = "20b0"', (
        'vendor_id = "1AF4X"\nproduct_id = "20b0"' if key == "vendor_id"
        else 'vendor_id = "10de"\nproduct_id = "20b"'
    ))  # fmt: skip
    write(tmp_path / "node.toml", bad)
    line = refusal(reservoir("node", "--config", str(tmp_path / "node.toml"), "--vcpus", "1",
                             "--broker", "memory://"))  # fmt: skip
    number = [line.split(" ")[0] for line in bad.splitlines()].index(key) + 1
    assert line == (
        f"reservoir node: --config {tmp_path / 'node.toml'}, line {number}: pci.alias.{key}: "
        "expected 4 hex digits, as lspci -n shows them (e.g. 10de)"
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--resource", "CUSTOM_GPU=-1"),
         "Error: Invalid value for --resource: CUSTOM_GPU=-1: the amount is a whole number, "
         "0 or more"),
        (("--require", "hw_gpu"),
         "Error: Invalid value for --require: 'hw_gpu' is not a trait: a trait is 1 to 255 "
         "upper-case letters, digits and underscores, e.g. HW_CPU_X86_AVX2 (did you mean "
         "HW_GPU?)"),
        (("--any-of", "HW_A,hw-b"),
         "Error: Invalid value for --any-of: 'hw-b' is not a trait: a trait is 1 to 255 "
         "upper-case letters, digits and underscores, e.g. HW_CPU_X86_AVX2"),
        (("--count", "10000"),
         "Error: Invalid value for '--count': 10000 is not in the range 1<=x<=1000."),
        (("--vcpus", "99999999999999"),
         "Error: Invalid value for '--vcpus': 99999999999999 is not in the range "
         "0<=x<=1048576."),
    ],
    ids=["negative-amount", "lower-case-trait", "any-of", "count", "vcpus"],
)  # fmt: skip
def test_a_request_the_http_api_would_refuse_is_refused_in_words_naming_the_option(
    args: tuple[str, ...], said: str
) -> None:
    done = reservoir("request", "--broker", "memory://", "--memory-mb", "1", *args)
    assert refusal(done) == said


def test_the_cli_spells_dedicated_cpus_as_the_http_api_does() -> None:
    # accepted (a dry run on an empty broker: no node answered, exit 1), and --pinned too
    for flag in ("--dedicated-cpus", "--pinned"):
        done = reservoir("request", "--broker", "memory://", "--vcpus", "2", "--numa-nodes", "1",
                         flag, "--dry-run", "--timeout", "0.2")  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert "no node answered" in done.stdout
