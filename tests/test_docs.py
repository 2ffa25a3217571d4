"""The docs stand on what the repository holds: every mistake in the error
catalogue names a test that exists."""

import re
from pathlib import Path


ROOT = Path(__file__).parent.parent


def test_every_catalogued_mistake_names_an_existing_test():
    rows = [
        line
        for line in (ROOT / "docs" / "errors.md").read_text().splitlines()
        if re.match(r"\| \d+ \|", line)
    ]
    numbers = [int(line.split("|")[1]) for line in rows]
    assert numbers == list(range(1, len(rows) + 1))
    assert len(rows) >= 30
    for line in rows:
        refs = re.findall(r"`(test_\w+\.py)::(test_\w+)`", line)
        assert refs, f"no test named in: {line}"
        for file, test in refs:
            source = (ROOT / "tests" / file).read_text()
            assert re.search(rf"^def {test}\(", source, re.M), f"{file}::{test}"


def test_every_public_name_is_in_all_and_in_the_reference():
    import types

    import eqx_offload as eo

    public = {
        name
        for name, value in vars(eo).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(eo.__all__) == public
    reference = (ROOT / "docs" / "reference.md").read_text()
    overview = (ROOT / "docs" / "api.md").read_text()
    for name in eo.__all__:
        assert f"::: eqx_offload.{name}\n" in reference, name
        assert f"eo.{name}" in overview, name
