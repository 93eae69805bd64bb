"""The documentation site (mkdocs.yml, docs/): every page is in the navigation, the CLI and
HTTP references are generated rather than written, and ``mkdocs build --strict`` passes,
with every option of every command in the built CLI reference.

The build needs the docs extra: without it the build's tests are skipped, except under CI
(``CI`` set), where .ci/run installs the extra and a missing mkdocs fails them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

from reservoir.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _config() -> dict[str, object]:
    config: dict[str, object] = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return config


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for entry in nav for page in _nav_pages(entry)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_every_page_under_docs_is_in_the_navigation_and_every_nav_entry_exists() -> None:
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.glob("*.md"))
    listed = sorted(_nav_pages(_config()["nav"]))
    assert listed == pages


def test_the_cli_reference_is_generated_from_the_click_group_not_written() -> None:
    page = (DOCS / "cli.md").read_text()
    assert "::: mkdocs-click" in page
    assert ":module: reservoir.cli" in page and ":command: main" in page
    # no hand-written table of commands or options to fall out of date
    assert "| command |" not in page
    assert not re.search(r"^\| `reservoir \w+", page, re.M)


def test_the_http_reference_renders_the_apps_own_openapi_document() -> None:
    assert "[OAD(build/docs/openapi.json)]" in (DOCS / "http-reference.md").read_text()
    assert "docs/hooks/openapi.py" in _nav_hooks()


def _nav_hooks() -> list[str]:
    hooks = _config().get("hooks", [])
    assert isinstance(hooks, list)
    return [str(h) for h in hooks]


def _every_option() -> dict[str, list[str]]:
    """command -> every long option it takes (the group's under ``reservoir``)."""
    options = {"reservoir": [o for p in main.params for o in p.opts if o.startswith("--")]}
    context = click.Context(main)
    for name in main.list_commands(context):
        command = main.get_command(context, name)
        assert command is not None
        options[f"reservoir {name}"] = [
            flag
            for param in command.params
            if isinstance(param, click.Option)
            for flag in (*param.opts, *param.secondary_opts)
            if flag.startswith("--")
        ]
    return options


def test_mkdocs_build_strict_passes_and_the_cli_reference_lists_every_option(
    tmp_path: Path,
) -> None:
    if shutil.which("mkdocs") is None:
        if os.environ.get("CI"):
            pytest.fail("mkdocs is missing: .ci/run installs the docs extra")
        pytest.skip("needs the docs extra: pip install -e '.[docs]'")
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    reference = (site / "cli" / "index.html").read_text()
    sections = re.split(r'<h[23] id="(reservoir(?:-[\w-]+)?)"', reference)
    by_command = {
        anchor.replace("-", " ", 1): html
        for anchor, html in zip(sections[1::2], sections[2::2], strict=True)
    }
    missing = {
        command: [flag for flag in flags if flag not in by_command.get(command, "")]
        for command, flags in _every_option().items()
    }
    assert {c: m for c, m in missing.items() if m} == {}
    # the HTTP reference holds every route of the app
    http = re.sub(r"<[^>]+>", "", (site / "http-reference" / "index.html").read_text())
    for route in ("POST /v1/reservations", "GET /v1/reservations/{request_id}",
                  "DELETE /v1/reservations/{request_id}", "GET /v1/nodes", "GET /v1/activity",
                  "GET /healthz", "GET /readyz"):  # fmt: skip
        assert route in http, route
    # nothing the built site loads comes from elsewhere (fonts, scripts, stylesheets)
    loads = re.compile(r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"')
    external = [
        f"{page.relative_to(site)}: {url}"
        for page in site.rglob("*.html")
        for url in loads.findall(page.read_text())
    ]
    assert external == []


def test_the_readme_is_short_keeps_the_ci_test_command_and_links_to_pages_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    # .ci/run runs the README's second quick-start command, exactly
    assert "python -m pip install -e '.[test]' && python -m pytest\n" in readme
    assert (
        "python -m pip install -e '.[test]' && python -m pytest"
        in (ROOT / ".ci" / "run").read_text()
    )
    targets = [link for link in re.findall(r"\]\(([^)#]+)", readme) if "://" not in link]
    assert targets, "the README links into the docs"
    assert [t for t in targets if not (ROOT / t).exists()] == []
    linked_pages = {Path(t).name for t in targets if t.startswith("docs/")}
    wanted = {"getting-started.md", "deploying.md", "http-api.md", "cli.md", "testing.md",
              "operating.md", "design.md", "performance.md"}  # fmt: skip
    assert linked_pages >= wanted
