"""The docs stand on what the repository holds: every mistake in the error
catalogue names a test that exists, every public name has its entry on an API page,
and the site navigates from disk (`scripts/test.sh` builds it, without a warning)."""

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).parent.parent


def test_every_catalogued_mistake_names_an_existing_test():
    rows = [
        line
        for line in (ROOT / "docs" / "errors.md").read_text().splitlines()
        if re.match(r'\| <span id="e\d+"></span>\d+ \|', line)
    ]
    numbers = [int(line.split("|")[1].split("</span>")[1]) for line in rows]
    anchors = [int(re.findall(r'id="e(\d+)"', line)[0]) for line in rows]
    assert anchors == numbers
    assert numbers == list(range(1, len(rows) + 1))
    assert len(rows) >= 30
    for line in rows:
        refs = re.findall(r"`(test_\w+\.py)::(test_\w+)`", line)
        assert refs, f"no test named in: {line}"
        for file, test in refs:
            source = (ROOT / "tests" / file).read_text()
            assert re.search(rf"^def {test}\(", source, re.M), f"{file}::{test}"


def test_every_public_name_has_one_entry_on_the_api_pages():
    """The API pages (`docs/api/*.md`, one per topic) are generated from the
    docstrings: one `::: eqx_offload.<name>` entry for each public name (each name
    `eqx_offload/__init__.py` re-exports), and none for anything else."""
    import types

    import eqx_offload as eo

    public = {
        name
        for name, value in vars(eo).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    pages = sorted((ROOT / "docs" / "api").glob("*.md"))
    entries = [
        name
        for page in pages
        for name in re.findall(r"(?m)^::: eqx_offload\.(\w+)$", page.read_text())
    ]
    assert sorted(entries) == sorted(public)
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in pages:
        assert f"- api/{page.name}\n" in nav, page.name


# What the site is built from: its configuration and hook, the pages, and the
# package (the API pages are its docstrings).
def _sources() -> list[Path]:
    return [
        ROOT / "mkdocs.yml",
        ROOT / "scripts" / "mkdocs_hooks.py",
        *(p for p in (ROOT / "docs").rglob("*") if p.is_file()),
        *(ROOT / "eqx_offload").rglob("*.py"),
    ]


def _fresh(site: Path) -> bool:
    """Whether `site` holds a build newer than everything it is built from."""
    pages = list(site.rglob("*.html"))
    if (site / "index.html") not in pages:
        return False
    built = min(p.stat().st_mtime for p in pages)
    return all(s.stat().st_mtime < built for s in _sources())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site `scripts/test.sh` builds before pytest (`site/`, with `mkdocs build
    --strict`, which it checks prints nothing but the build's progress); where that
    is missing or older than what it is built from, built here and checked alike."""
    import os
    import subprocess
    import sys

    if _fresh(ROOT / "site"):
        return ROOT / "site"
    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # Not `--quiet`: it hides the warnings from `--strict` too, which then passes.
    command = [str(mkdocs), "build", "--strict", "-d", str(out)]
    built = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    printed = built.stdout + built.stderr
    assert built.returncode == 0, printed
    # No warning and no notice (an unresolved link or anchor, a page outside the
    # nav, a cross-reference autorefs cannot find): only the build's progress.
    progress = re.compile(
        r"INFO +- +(Cleaning site directory|Building documentation to directory: "
        r"|Documentation built in )"
    )
    assert [line for line in printed.splitlines() if not progress.match(line)] == []
    return out


def test_the_site_navigates_when_opened_from_disk(site):
    """`site/index.html` opened in a browser: every link between pages names a
    file (`tutorial.html`), not a directory, whose listing a browser would show."""
    from urllib.parse import unquote, urlparse

    # (404.html is only served, never opened: its links are absolute.)
    pages = sorted(set(site.rglob("*.html")) - {site / "404.html"})
    assert (site / "index.html") in pages and len(pages) > 15
    for page in pages:
        for href in re.findall(r'href="([^"]+)"', page.read_text()):
            link = urlparse(href)
            if link.scheme or link.netloc or not link.path:
                continue  # another site, or an anchor on this page
            target = (page.parent / unquote(link.path)).resolve()
            assert target.is_file(), f"{page.relative_to(site)}: {href}"
