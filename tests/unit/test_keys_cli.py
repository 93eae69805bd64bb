"""``reservoir keys``: role keys that parse, a node's own key and its keyring file, a rollover
in three commands, ids and fingerprints shown but never a secret, and one line for a
mistake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from reservoir.cli import main
from reservoir.runtime.keys import parse_keys
from reservoir.runtime.keys.nodes import NodeKeyring, load_node_key

pytest.importorskip("cryptography")


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["keys", *args])
    return result.exit_code, result.stdout, result.stderr


def test_generate_prints_a_signing_and_a_verifying_entry_that_parse() -> None:
    status, out, _ = run("generate", "--id", "node-2026-12")
    assert status == 0
    signing, verifying = (line.split()[1] for line in out.splitlines())
    assert signing == verifying  # HMAC: the same secret both ways
    assert parse_keys(signing, setting="x")[0].key_id == "node-2026-12"
    status, out, _ = run("generate", "--id", "req-1", "--ed25519")
    signing, verifying = (line.split()[1] for line in out.splitlines())
    assert parse_keys(signing, setting="x")[0].can_sign
    assert not parse_keys(verifying, setting="x")[0].can_sign


def test_a_bad_key_id_is_one_line_and_exit_2() -> None:
    status, out, err = run("generate", "--id", "bad id")
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("reservoir keys generate: key id 'bad id'")


def test_add_node_writes_a_private_key_file_and_the_public_half_to_the_keyring(
    tmp_path: Path,
) -> None:
    keyring, key_file = tmp_path / "keyring", tmp_path / "n1.key"
    status, out, _ = run("add-node", "n1", "--keyring", str(keyring), "--key-file", str(key_file),
                         "--id", "n1-a")  # fmt: skip
    assert status == 0, out
    assert key_file.stat().st_mode & 0o777 == 0o600
    own = load_node_key(key_file)
    (listed,) = NodeKeyring(keyring).nodes()["n1"]
    assert (listed.key_id, listed.fingerprint) == ("n1-a", own.fingerprint)
    assert not listed.can_sign
    assert "ed25519:" not in (keyring / "n1.pub").read_text().replace("ed25519-public:", "")


def test_a_rollover_is_add_node_then_retire(tmp_path: Path) -> None:
    keyring = str(tmp_path / "keyring")
    run("add-node", "n1", "--keyring", keyring, "--key-file", str(tmp_path / "old.key"),
        "--id", "n1-old")  # fmt: skip
    status, out, _ = run("add-node", "n1", "--keyring", keyring, "--key-file",
                         str(tmp_path / "new.key"), "--id", "n1-new")  # fmt: skip
    assert status == 0
    assert "lists n1-new, n1-old" in out  # both believed during the overlap
    status, out, _ = run("retire", "n1", "n1-old", "--keyring", keyring)
    assert status == 0
    assert [k.key_id for k in NodeKeyring(Path(keyring)).nodes()["n1"]] == ["n1-new"]
    status, _, err = run("retire", "n1", "n1-new", "--keyring", keyring)
    assert status == 2
    assert "is the last key of node 'n1': to retire the node, delete" in err


def test_add_node_never_overwrites_a_key_file_unless_forced(tmp_path: Path) -> None:
    keyring, key_file = str(tmp_path / "keyring"), tmp_path / "n1.key"
    assert run("add-node", "n1", "--keyring", keyring, "--key-file", str(key_file))[0] == 0
    before = key_file.read_text()
    status, _, err = run("add-node", "n1", "--keyring", keyring, "--key-file", str(key_file))
    assert status == 2
    assert "exists" in err
    assert key_file.read_text() == before
    assert len(NodeKeyring(Path(keyring)).nodes()["n1"]) == 1  # nothing half done
    status, _, _ = run("add-node", "n1", "--keyring", keyring, "--key-file", str(key_file),
                       "--force")  # fmt: skip
    assert status == 0
    assert key_file.read_text() != before


def test_show_lists_ids_and_fingerprints_and_never_a_secret(tmp_path: Path) -> None:
    keyring, key_file = tmp_path / "keyring", tmp_path / "n1.key"
    run("add-node", "n1", "--keyring", str(keyring), "--key-file", str(key_file), "--id", "n1-a")
    run("add-node", "n2", "--keyring", str(keyring), "--key-file", str(tmp_path / "n2.key"),
        "--id", "n2-a")  # fmt: skip
    secret = key_file.read_text().strip().splitlines()[-1].rpartition(":")[2]
    status, out, _ = run("show", "--keyring", str(keyring), "--key-file", str(key_file))
    assert status == 0
    assert out.splitlines()[0].split() == ["node", "id", "fingerprint"]
    assert "n1-a" in out
    assert "n2-a" in out
    assert secret not in out
    status, out, _ = run("show", "--keyring", str(keyring), "--json")
    rows = json.loads(out)["keys"]
    assert sorted((r["node"], r["id"]) for r in rows) == [("n1", "n1-a"), ("n2", "n2-a")]
    assert all(r["fingerprint"].startswith("SHA256:") for r in rows)


def test_show_with_nothing_to_show_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RESERVOIR_NODE_KEYRING", raising=False)
    monkeypatch.delenv("RESERVOIR_NODE_KEY", raising=False)
    status, _, err = run("show")
    assert status == 2
    assert "give --keyring DIR or --key-file PATH" in err


def test_a_keyring_with_a_private_key_in_it_is_one_line_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "n1.pub").write_text(run("generate", "--id", "n1", "--ed25519")[1].split()[1])
    status, _, err = run("show", "--keyring", str(tmp_path))
    assert status == 2
    assert err.count("\n") == 1
    assert "n1.pub" in err
    assert "public keys only" in err
