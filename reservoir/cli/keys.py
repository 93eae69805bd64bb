"""``reservoir keys``: make signing keys, and keep a node keyring (a key per node).

``generate`` prints a key for a role (``RESERVOIR_NODE_KEYS``/``RESERVOIR_REQUESTOR_KEYS``);
``add-node`` gives a node a key of its own (its private file, and its public half in the
keyring directory requestors read); ``retire`` ends a rollover; ``show`` lists what a
keyring or a key file holds, never a secret. docs/design.md, "Node identities".
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import click

from reservoir.cli.options import json_option, usage_error

_KEYRING = click.option(
    "--keyring",
    "keyring",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="RESERVOIR_NODE_KEYRING",
    required=True,
    help="The node keyring directory (one NAME.pub per node) [env: RESERVOIR_NODE_KEYRING].",
)


@click.group()
def keys() -> None:
    """Make signing keys and keep the node keyring."""


@keys.command()
@click.option("--id", "key_id", required=True, help="The key id, e.g. node-2026-12.")
@click.option("--ed25519", is_flag=True, help="An Ed25519 key pair, not an HMAC secret.")
def generate(key_id: str, ed25519: bool) -> None:
    """Print a fresh key for a role: the entry that signs, and the one verifiers get
    (the same secret for HMAC; the public half for Ed25519)."""
    from reservoir.runtime.keys import generate as make

    try:
        signing, verifying = make(key_id, ed25519=ed25519)
    except ValueError as error:
        usage_error(str(error))
    click.echo(f"signing:   {signing}")
    click.echo(f"verifying: {verifying}")


@keys.command("add-node")
@click.argument("name")
@_KEYRING
@click.option(
    "--key-file",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the node's private key (mode 600); the node's --node-key.",
)
@click.option("--id", "key_id", help="The key id [default: NAME and a random suffix].")
@click.option("--force", is_flag=True, help="Replace --key-file if it exists.")
def add_node(name: str, keyring: Path, key_file: Path, key_id: str | None, force: bool) -> None:
    """Give node NAME a new Ed25519 key: its private half to --key-file, its public half
    first in the keyring's NAME.pub, keeping the keys listed there. To roll a key over:
    add-node to a new file; once the keyring has reached the requestors, move the file
    over the node's key file (the node signs with it within 2 s); then `retire` the old."""
    from reservoir.runtime.keys import (
        generate as make,
    )
    from reservoir.runtime.keys.nodes import add_node_key, node_keyring_file, write_node_key

    key_id = key_id if key_id is not None else f"{name[:55]}-{secrets.token_hex(4)}"
    try:
        keyring_file = node_keyring_file(keyring, name)
        signing, verifying = make(key_id, ed25519=True)
        if key_file.exists() and not force:
            raise ValueError(f"--key-file {key_file} exists: give another path, or --force")
        listed = add_node_key(keyring, name, verifying)
        write_node_key(key_file, signing, replace=True)
    except (ValueError, OSError) as error:
        usage_error(str(error))
    click.echo(f"node {name}: key {key_id} written to {key_file} (keep it private)")
    click.echo(
        f"{keyring_file}: lists {', '.join(k.key_id for k in listed)}; requestors "
        "reading this keyring believe the new key within seconds"
    )


@keys.command()
@click.argument("name")
@click.argument("key_id")
@_KEYRING
def retire(name: str, key_id: str, keyring: Path) -> None:
    """Take key KEY_ID of node NAME out of the keyring: messages signed with it are
    refused from then on (within seconds, with no restart)."""
    from reservoir.runtime.keys.nodes import retire_node_key

    try:
        left = retire_node_key(keyring, name, key_id)
    except (ValueError, OSError) as error:
        usage_error(str(error))
    click.echo(f"node {name}: retired {key_id}; lists {', '.join(k.key_id for k in left)}")


@keys.command()
@click.option(
    "--keyring",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="RESERVOIR_NODE_KEYRING",
    help="A node keyring directory [env: RESERVOIR_NODE_KEYRING].",
)
@click.option(
    "--key-file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="RESERVOIR_NODE_KEY",
    help="A node's own key file [env: RESERVOIR_NODE_KEY].",
)
@json_option()
def show(keyring: Path | None, key_file: Path | None, as_json: bool) -> None:
    """List the nodes of a keyring and their keys, and a node key file's key: ids and
    fingerprints, never a secret."""
    from reservoir.runtime.keys import KeyConfigError
    from reservoir.runtime.keys.nodes import NodeKeyring, load_node_key

    if keyring is None and key_file is None:
        usage_error("give --keyring DIR or --key-file PATH (or RESERVOIR_NODE_KEYRING)")
    rows: list[dict[str, str]] = []
    try:
        if key_file is not None:
            key = load_node_key(key_file, setting="--key-file")
            rows.append(
                {
                    "source": str(key_file),
                    "node": "",
                    "id": key.key_id,
                    "fingerprint": key.fingerprint,
                }
            )
        if keyring is not None:
            for node, node_keys in NodeKeyring(keyring, setting="--keyring").nodes().items():
                rows.extend(
                    {
                        "source": str(keyring),
                        "node": node,
                        "id": k.key_id,
                        "fingerprint": k.fingerprint,
                    }
                    for k in node_keys
                )
    except KeyConfigError as error:
        usage_error(str(error))
    if as_json:
        click.echo(json.dumps({"keys": rows}, sort_keys=True))
        return
    if not rows:
        click.echo("no keys")
        return
    shown = [{**row, "node": row["node"] or "(key file)"} for row in rows]
    widths = {c: max(len(c), *(len(r[c]) for r in shown)) for c in ("node", "id")}
    click.echo(f"{'node':<{widths['node']}}  {'id':<{widths['id']}}  fingerprint")
    for row in shown:
        click.echo(
            f"{row['node']:<{widths['node']}}  {row['id']:<{widths['id']}}  {row['fingerprint']}"
        )
