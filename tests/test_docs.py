"""The docs stand on what the repository holds: every mistake in the error
catalogue names a test that exists."""

import re
from pathlib import Path


ROOT = Path(__file__).parent.parent


def test_every_catalogued_mistake_names_an_existing_test():
    rows = [
        line
        for line in (ROOT / "docs" / "errors.md").read_text().splitlines()
        if re.match(r'\| <span id="e\d+"></span>\d+ \|', line)
    ]
    numbers = [int(line.split("|")[1].split("</span>")[1]) for line in rows]
    anchors = [int(re.search(r'id="e(\d+)"', line)[1]) for line in rows]
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
    docstrings: one `::: eqx_offload.<name>` entry for each name of `__all__`, and
    none for anything else."""
    import types

    import eqx_offload as eo

    public = {
        name
        for name, value in vars(eo).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(eo.__all__) == public
    pages = sorted((ROOT / "docs" / "api").glob("*.md"))
    entries = [
        name
        for page in pages
        for name in re.findall(r"(?m)^::: eqx_offload\.(\w+)$", page.read_text())
    ]
    assert sorted(entries) == sorted(eo.__all__)
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in pages:
        assert f"- api/{page.name}\n" in nav, page.name


def test_the_site_navigates_when_opened_from_disk(tmp_path):
    """`site/index.html` opened in a browser: every link between pages names a
    file (`api.html`), not a directory, whose listing a browser would show."""
    import os
    import subprocess
    import sys
    from urllib.parse import unquote, urlparse

    mkdocs = Path(sys.executable).parent / "mkdocs"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [str(mkdocs), "build", "--strict", "--quiet", "-d", str(tmp_path)]
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    # (404.html is only served, never opened: its links are absolute.)
    pages = sorted(set(tmp_path.rglob("*.html")) - {tmp_path / "404.html"})
    assert (tmp_path / "index.html") in pages and len(pages) > 15
    for page in pages:
        for href in re.findall(r'href="([^"]+)"', page.read_text()):
            link = urlparse(href)
            if link.scheme or link.netloc or not link.path:
                continue  # another site, or an anchor on this page
            target = (page.parent / unquote(link.path)).resolve()
            assert target.is_file(), f"{page.relative_to(tmp_path)}: {href}"
