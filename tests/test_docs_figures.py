"""The figures `docs/benchmarks.md` quotes in its tables are those the benchmark
scripts wrote: every number in a table of a section is one of the numbers of the
JSON files that section names (its commands write them; the summary's, of all of
them), rounded to the decimals the table
shows (bytes, MiB and GiB converted, fractions as percentages, or the ratio of
two figures of one result, or the growth from one to the other in percent)."""

import json
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?![\w.])")


def _numbers(data) -> list[float]:
    if isinstance(data, bool):
        return []
    if isinstance(data, int | float):
        return [float(data)]
    if isinstance(data, dict):
        return [n for v in data.values() for n in _numbers(v)]
    if isinstance(data, list):
        return [n for v in data for n in _numbers(v)]
    if isinstance(data, str):  # "needs 34.38G of HBM"
        return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", data)]
    return []


def _sections() -> list[tuple[str, list[str], list[str]]]:
    """(heading, the JSON files it names, table rows) per `##`/`###` section."""
    out = []
    for part in re.split(r"(?m)^(?=##+ )", PAGE.read_text()):
        heading = part.splitlines()[0] if part.strip() else ""
        files = list(
            dict.fromkeys(re.findall(r"benchmarks/results/[\w.]+\.json", part))
        )
        if not files and "Summary" in heading:  # it quotes every benchmark
            files = sorted(
                f"benchmarks/results/{p.name}" for p in RESULTS.glob("*.json")
            )
        rows = [
            line
            for line in part.splitlines()
            if line.startswith("|") and not re.match(r"\|[-:| ]+\|$", line)
        ]
        out.append((heading, files, rows[1:] if rows else []))  # minus the header
    return out


def _ratios(data) -> list[float]:
    """Ratios of two numbers of one JSON object ("× state")."""
    if isinstance(data, list):
        return [r for v in data for r in _ratios(v)]
    if not isinstance(data, dict):
        return []
    scalars = [
        float(v)
        for v in data.values()
        if isinstance(v, int | float) and v and v is not True
    ]
    out = [a / b for a in scalars for b in scalars]
    return out + [r for v in data.values() for r in _ratios(v)]


@pytest.mark.parametrize(
    "heading, files, rows",
    [s for s in _sections() if s[1] and s[2]],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_table_figures_come_from_the_results(heading, files, rows):
    known = []
    for file in files:
        data = json.loads((ROOT / file).read_text())
        ratios = _ratios(data)
        known += _numbers(data) + ratios + [100 * (r - 1) for r in ratios]
    # MiB <-> GiB, bytes -> MiB or GiB, fractions -> percent.
    factors = (1, 1 / 1024, 1024, 2**-20, 2**-30, 100)
    scaled = [k * f for k in known for f in factors]
    for row in rows:
        cells = row.split("|")
        # The first two columns name the row; the summary's are the target and
        # what was measured, then a verdict in words.
        cells = cells[2:3] if "Summary" in heading else cells[3:]
        for cell in cells:
            for text in NUMBER.findall(cell.replace("**", "").replace("−", "-")):
                decimals = len(text.split(".")[1]) if "." in text else 0
                value = float(text.replace(",", ""))
                if decimals == 0 and abs(value) < 100:
                    continue  # counts, layer numbers, chips: not figures
                tolerance = 0.5 * 10**-decimals + 1e-9
                assert any(abs(k - value) <= tolerance for k in scaled), (
                    f"{heading}: {text} in {row!r} is in none of {files}"
                )
