"""Asks the running build about its wire, for tests/upgrade/test_wire_fixtures.py, which
runs it with a released build's interpreter: that release's own decoder and structs
answer, not a copy of their rules. It imports nothing of reservoir but what it runs with.

    python wire_probe.py decode < bodies.json   # a JSON list of base64 bodies
        -> a list of {"ok": true, "json": <the message as this build writes it>} or
           {"ok": false, "reason": <why a participant drops it>, "detail": ...}
    python wire_probe.py fields
        -> {"fields": {struct name: [field, ...]}, "kinds": [kind, ...]}
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any, get_args


def decode(bodies: list[str]) -> list[dict[str, Any]]:
    from reservoir.protocol.messages import encode_message
    from reservoir.runtime.wire import Codec, DecodeError

    codec = Codec()
    answers: list[dict[str, Any]] = []
    for encoded in bodies:
        try:
            message = codec.decode(
                base64.b64decode(encoded), 0.0, destination=None, check_replay=False
            )
        except DecodeError as error:
            answers.append({"ok": False, "reason": error.reason, "detail": error.detail})
        else:
            answers.append({"ok": True, "json": encode_message(message).decode()})
    return answers


def fields() -> dict[str, Any]:
    import msgspec

    from reservoir.protocol import messages

    structs = {
        name: cls
        for name, cls in vars(messages).items()
        if isinstance(cls, type)
        and issubclass(cls, msgspec.Struct)
        and cls.__module__ == messages.__name__
        and not name.startswith("_")
    }
    return {
        "fields": {name: list(cls.__struct_fields__) for name, cls in sorted(structs.items())},
        "kinds": sorted(cls.kind for cls in get_args(messages.Message)),
    }


if __name__ == "__main__":
    if sys.argv[1] == "decode":
        json.dump(decode(json.load(sys.stdin)), sys.stdout)
    elif sys.argv[1] == "fields":
        json.dump(fields(), sys.stdout)
    else:
        sys.exit(f"wire_probe.py: no command {sys.argv[1]!r} (decode, fields)")
