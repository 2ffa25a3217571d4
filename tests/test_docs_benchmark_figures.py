"""The figures the benchmarks pages quote in their tables are those the benchmark
scripts wrote: the summary (`docs/benchmarks.md`) and its sections, a page each
(`docs/benchmarks/*.md`, titled `# 4. ...`).

The summary's rows name where each of their figures comes from, in a hidden
comment (`<!-- figures: expression; ... -->`): one Python expression per figure of
the "measured" and verdict columns, in order, over the JSON files
(`depth.json["results"][12]["device MiB"]`), that rounds to the figure as shown;
or a section (`"§4"`) whose page quotes the same figure; or `None` for a figure
no result records (listed in `UNRECORDED`).

Every other table with figures follows a hidden comment naming their sources:

    <!-- rows: tutorial.json["results"]
    | - | - | r["cpu device MiB"] | r["cpu host MiB"] | ... |
    -->

first an expression giving the table's rows in order (a list over the JSON files,
which may select some of a file's rows), then, laid out like a table row (and
wrapped over lines as needed, so no expression may contain `|`), one expression
per column over a row's record `r`, or `-` for a column of names with no figures
in it. A column's value is what its cell shows: a number, as rounded there (and
with thousands separators if it has them); `None`, shown as `-` or `—`; a string,
whose numbers are the cell's (`r["note"]`, "needs 34.38G of HBM", shown as "needs
34.38"; `r["topology"]`, "2x2"); `True` or `False`, a cell starting with "yes" or
"no"; or a tuple of these, for a cell with several figures ("1.53 + 0.00",
"447.0 → 468.6 MiB"). Every number of a cell must be named: a cell with more
figures than its column names, or a `-` column with a digit in it (but the names
of `LABELS`), is an error, as is a table without its comment. The files it reads
must be those its section names (its commands write them).
"""

import json
import re
import types
from pathlib import Path

import pytest


ROOT = Path(__file__).parent.parent
SUMMARY = ROOT / "docs" / "benchmarks.md"
SECTIONS = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
PAGES = [SUMMARY, *SECTIONS]
RESULTS = ROOT / "benchmarks" / "results"
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?![\w.])")
FIGURES = re.compile(r"\s*<!-- figures: (.*?) -->")
# The summary's figures that no benchmark result records: the own step's device
# bytes against `train_step`'s (`tests/test_examples.py` checks them within 0.5%).
UNRECORDED = ["0.08", "512"]
# A table cell's figures: numbers (also where a unit follows, "34.38G", or inside a
# name, "2x2", "fp32") and the dashes that stand for a missing value.
TOKEN = re.compile(r"-?\d[\d,]*(?:\.\d+)?|(?<!\S)[-—](?!\S)")
ROWS = re.compile(r"<!-- rows: ((?:(?!-->).)*)-->\s*\Z", re.S)
# The names with numbers in `-` columns, by header: numbers no result records.
LABELS = {
    # The soak runs are numbered and named by the setting they ran under; the
    # JSON files record neither (the setting is in the second file's name).
    "run": ["1", "`MALLOC_ARENA_MAX=2`"],
}
BUILTINS = {
    "len": len,
    "min": min,
    "max": max,
    "sorted": sorted,
    "list": list,
    "enumerate": enumerate,
}


def _results() -> dict[str, types.SimpleNamespace]:
    """Each JSON file of results by its stem, as `stem.json`."""
    return {
        p.stem: types.SimpleNamespace(json=json.loads(p.read_text()))
        for p in RESULTS.glob("*.json")
    }


def _shown(value: float, text: str) -> str:
    """`value` written as `text` is: to its decimals, with its thousands separators."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    shown = f"{value:,.{decimals}f}"
    return shown if "," in text else shown.replace(",", "")


def _sections() -> dict[str, str]:
    """Each section's page by its number (`"4"` for `# 4. ...`)."""
    texts = [p.read_text() for p in SECTIONS]
    return {re.findall(r"\A# (\d+)\. ", t)[0]: t for t in texts}


def _summary_rows() -> list[str]:
    summary = SUMMARY.read_text().split("## Summary of targets\n", 1)[1]
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
    namespace = _results()
    sections = _sections()
    for text, expr in zip(figures, exprs):
        value = eval(expr, {"__builtins__": BUILTINS, **namespace})
        if value is None:
            assert text in UNRECORDED, f"{text} in {row!r} comes from no result"
        elif isinstance(value, str):  # quoted from the section's page
            section = sections[value.removeprefix("§")]
            assert re.search(rf"(?<![\d.]){re.escape(text)}(?![\d])", section)
        else:
            expected = _shown(value, text)
            assert expected == text.lstrip("+"), f"{expr} = {value}, shown as {text}"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _cell_errors(cell: str, value, where: str) -> list[str]:
    """What in `cell` is not `value` (a column's value, see the module docstring)."""
    cell = cell.replace("**", "").replace("−", "-")
    tokens = TOKEN.findall(cell)
    errors = []
    for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, bool):
            if not re.match(rf"{'yes' if v else 'no'}\b", cell):
                errors.append(f"{where}: {cell!r} shown, {v}")
            continue
        expected = TOKEN.findall(v) if isinstance(v, str) else [v]
        for e in expected:
            if not tokens:
                errors.append(f"{where}: {cell!r} does not show {e!r}")
                continue
            text = tokens.pop(0)
            if e is None:
                ok = text in "-—"
            elif isinstance(e, str):
                ok = text == e
            else:
                ok = text not in "-—" and _shown(e, text) == text
            if not ok:
                errors.append(f"{where}: {text} shown, {e!r} named")
    errors += [f"{where}: {text} in {cell!r} is not named" for text in tokens]
    return errors


def table_errors(page: str) -> list[str]:
    """Each figure of `page`'s tables (but the summary's) that is not the value its
    table's comment names, or that no comment names."""
    namespace = _results()
    errors = []
    for table in re.finditer(r"(?m)^\|.*\n\|[-:| ]+\|\n(?:\|.*\n)*", page):
        before = page[: table.start()]
        heading = re.findall(r"(?m)^#+ (.*)", before)[-1]
        header, _, *rows = table[0].splitlines()
        if heading == "Summary of targets" or not re.search(r"\d", "".join(rows)):
            continue
        named = ROWS.search(before)
        if named is None:
            errors.append(
                f"{heading}: the table {header!r} has no `<!-- rows:` comment"
            )
            continue
        records, _, columns = named[1].partition("\n|")
        exprs = _cells(" ".join(("|" + columns).split()))
        headers = _cells(header)
        if len(exprs) != len(headers):
            errors.append(
                f"{heading}: {len(exprs)} expressions, {len(headers)} columns"
            )
            continue
        after = re.split(r"(?m)^#+ ", page[table.start() :], maxsplit=1)[0]
        section = re.split(r"(?m)^#+ ", before)[-1] + after
        for stem in re.findall(r"(\w+)\.json\b", named[1]):
            if f"benchmarks/results/{stem}.json" not in section:
                errors.append(f"{heading}: {stem}.json is not this section's")
        records = eval(
            " ".join(records.split()), {"__builtins__": BUILTINS, **namespace}
        )
        if len(records) != len(rows):
            errors.append(f"{heading}: {len(records)} records, {len(rows)} rows")
            continue
        for row, r in zip(rows, records):
            cells = _cells(row)
            if len(cells) != len(headers):
                errors.append(f"{heading}: {row!r} has {len(cells)} cells")
                continue
            for head, expr, cell in zip(headers, exprs, cells):
                where = f"{heading}, {cells[0]!r}, {head!r}"
                if expr == "-":
                    if re.search(r"\d", cell) and cell not in LABELS.get(head, []):
                        errors.append(f"{where}: {cell!r} is named by no expression")
                    continue
                globals_ = {"__builtins__": BUILTINS, **namespace, "r": r}
                errors += _cell_errors(cell, eval(expr, globals_), where)
    return errors


def test_every_section_has_its_page():
    numbers = sorted(int(n) for n in _sections())
    assert numbers == list(range(1, len(SECTIONS) + 1))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_table_figures_are_those_their_comments_name(page):
    assert table_errors(page.read_text()) == []


ALTERED = [
    pytest.param(
        "| offload_all | 32 | 1351.64 |",
        "| offload_all | 32 | 1351.65 |",
        "1351.65",
        id="a figure a digit off",
    ),
    pytest.param(
        "(returns after 0.37)",
        "(returns after 0.38)",
        "0.38",
        id="the second figure of a cell",
    ),
    pytest.param(
        "| 2x2 | 4 | needs 34.38 |",
        "| 2x2 | 4 | needs 34.36 |",
        "34.36",
        id="a figure of a note",
    ),
    pytest.param(
        "| none | 32 | - |",
        "| none | 32 | 29.50 |",
        "29.50",
        id="a missing value shown",
    ),
    pytest.param(
        "| offload_all | bf16 | 8 | 713.23 | 2849.02 | 3072.91 | 9347.62 | 6018.61 |\n",
        "",
        "18 rows",
        id="a row left out",
    ),
    pytest.param(
        '<!-- rows: metrics.json["results"]["rows"]',
        "<!-- ",
        "no `<!-- rows:`",
        id="a table without its comment",
    ),
    pytest.param(
        'r["host bytes"] | r["H2D MiB"] | r["D2H MiB"] |',
        'r["host bytes"] | r["H2D MiB"] |',
        "4 expressions, 5 columns",
        id="a column without its expression",
    ),
]


@pytest.mark.parametrize("old, new, reported", ALTERED)
def test_a_wrong_figure_is_reported(old, new, reported):
    (page,) = [p.read_text() for p in PAGES if old in p.read_text()]
    assert page.count(old) == 1
    errors = table_errors(page.replace(old, new))
    assert errors and all(reported in e for e in errors), errors
