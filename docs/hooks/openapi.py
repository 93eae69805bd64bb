"""MkDocs hook: write the service's OpenAPI document before the build, from the app itself
(``reservoir.service.create_app()``), to ``build/docs/openapi.json``, where the HTTP page's
``[OAD(...)]`` (neoteroi-mkdocs) renders it. Building the app opens nothing: the broker is
connected only by its lifespan, which is not run here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OPENAPI = Path("build/docs/openapi.json")


def on_pre_build(config: Any) -> None:
    from reservoir.service import create_app

    root = Path(config.config_file_path).parent
    document = create_app().openapi()
    target = root / OPENAPI
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
