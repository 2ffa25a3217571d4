"""`benchmarks/README.md` indexes every benchmark script and every result it keeps."""

import fnmatch
import re
from pathlib import Path


BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def _rows() -> list[list[str]]:
    lines = (BENCHMARKS / "README.md").read_text().splitlines()
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in lines
        if line.startswith("| `")
    ]


def test_every_script_has_a_row():
    scripts = {p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")}
    indexed = [row[0].strip("`") for row in _rows()]
    assert sorted(indexed) == sorted(scripts)


def test_every_kept_result_is_named_by_a_row():
    patterns = [
        name for row in _rows() for name in re.findall(r"`([\w*.]+\.json)`", row[2])
    ]
    for result in (BENCHMARKS / "results").glob("*.json"):
        assert any(fnmatch.fnmatch(result.name, p) for p in patterns), result.name
    for pattern in patterns:
        assert list((BENCHMARKS / "results").glob(pattern)), pattern


def test_model_definitions_live_in_their_own_folder():
    for script in BENCHMARKS.glob("*.py"):
        source = script.read_text()
        assert not re.search(r"^class \w+\(eqx\.Module\)", source, re.M), script.name
