"""The figures `docs/benchmarks.md` quotes in its tables are those the benchmark
scripts wrote.

The summary's rows name where each of their figures comes from, in a hidden
comment (`<!-- figures: expression; ... -->`): one Python expression per figure of
the "measured" and verdict columns, in order, over the JSON files
(`depth.json["results"][12]["device MiB"]`), that rounds to the figure as shown;
or a section (`"§4"`) whose text quotes the same figure; or `None` for a figure
no result records (listed in `UNRECORDED`).

Elsewhere, every number in a table of a section is one of the numbers of the
JSON files that section names (its commands write them), rounded to the decimals
the table shows (bytes, MiB and GiB converted, fractions as percentages, or the
ratio of two figures of one result, or the growth from one to the other in
percent)."""

import json
import re
import types
from pathlib import Path

import pytest


ROOT = Path(__file__).parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?![\w.])")
FIGURES = re.compile(r"\s*<!-- figures: (.*?) -->")
# The summary's figures that no benchmark result records: the own step's device
# bytes against `train_step`'s (`tests/test_examples.py` checks them within 0.5%).
UNRECORDED = ["0.08", "512"]


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
        rows = [
            line
            for line in part.splitlines()
            if line.startswith("|") and not re.match(r"\|[-:| ]+\|$", line)
        ]
        out.append((heading, files, rows[1:] if rows else []))  # minus the header
    return out


def _summary_rows() -> list[str]:
    summary = PAGE.read_text().split("## Summary of targets\n", 1)[1]
    rows = [line for line in summary.split("\n## ", 1)[0].splitlines()]
    return [r for r in rows if r.startswith("|")][2:]  # minus the header


def _figures(cell: str) -> list[str]:
    """The numbers of a table cell, section numbers (§4) left out."""
    cell = re.sub(r"§\d+", "", cell.replace("**", "").replace("−", "-"))
    return NUMBER.findall(cell)


@pytest.mark.parametrize("row", _summary_rows(), ids=lambda r: r.split("|")[1][:40])
def test_summary_figures_are_those_its_rows_name(row):
    _, target, measured, verdict, _ = row.split("|")
    named = FIGURES.search(verdict)
    verdict = FIGURES.sub("", verdict)
    figures = _figures(measured) + _figures(verdict)
    exprs = [e.strip() for e in named[1].split(";")] if named else []
    assert len(exprs) == len(figures), f"{figures} in {row!r}: name each"
    namespace = {
        p.stem: types.SimpleNamespace(json=json.loads(p.read_text()))
        for p in RESULTS.glob("*.json")
    }
    builtins = {"len": len, "min": min, "max": max}
    sections = re.split(r"(?m)^(?=## )", PAGE.read_text())
    for text, expr in zip(figures, exprs):
        value = eval(expr, {"__builtins__": builtins, **namespace})
        if value is None:
            assert text in UNRECORDED, f"{text} in {row!r} comes from no result"
        elif isinstance(value, str):  # quoted from the section's text
            (section,) = [s for s in sections if s.startswith(f"## {value[1:]}.")]
            assert re.search(rf"(?<![\d.]){re.escape(text)}(?![\d])", section)
        else:
            decimals = len(text.split(".")[1]) if "." in text else 0
            expected = f"{value:,.{decimals}f}"
            if "," not in text:
                expected = expected.replace(",", "")
            assert expected == text.lstrip("+"), f"{expr} = {value}, shown as {text}"


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
    [s for s in _sections() if s[1] and s[2] and "Summary" not in s[0]],
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
        cells = cells[3:]  # the first two columns name the row
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
