"""Shared by the benchmark scripts: command-line options, tables, JSON results."""

import argparse
import json
import os
import platform
import sys
from pathlib import Path


# Compile-only benchmarks need no accelerator; keep libtpu from looking for one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

RESULTS = Path(__file__).parent / "results"
MIB = 2**20
GIB = 2**30


def example(name: str):
    """`examples/<name>.py`, imported by path (examples/ is not a package)."""
    import importlib.util

    path = Path(__file__).parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument("--json", type=Path, help="also write the results to this file")
    return p


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table (also readable in a terminal)."""
    cells = [[str(c) for c in headers]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def _cell(c) -> str:
    if c is None:
        return "-"
    return f"{c:.2f}" if isinstance(c, float) else str(c)


def write_json(path: Path | None, name: str, data) -> None:
    if path is None:
        return
    import jax

    payload = {
        "benchmark": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "jax": jax.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "results": data,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")
