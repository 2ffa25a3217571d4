"""The layout the design notes describe: every module in the module map with its
level, imports only from lower levels (so no import circles), no module over 600
lines, and JAX internals only in the adapter modules; and every test file in the
order the test workers take them."""

import ast
import functools
import pathlib
import re

import pytest

from . import conftest


ROOT = pathlib.Path(__file__).parent.parent
PACKAGE = ROOT / "eqx_offload"
NOTES = ROOT / "docs" / "design-notes.md"
ADAPTERS = {"_jaxpr.py", "_compat.py", "_compiler.py", "_compiler_thunks.py"}


@functools.cache  # for each of the parametrized tests, and each import
def _modules() -> dict[str, pathlib.Path]:
    """Module files by their path inside the package (`_update/_optim.py`)."""
    return {
        str(p.relative_to(PACKAGE)): p
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "__init__.py"
    }


@functools.cache
def _map() -> dict[str, int]:
    """The module map's rows: file -> level."""
    text = NOTES.read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `([\w/.]+)` \|", section, re.M)
    return {file: int(level) for level, file in rows}


def _imports(path: pathlib.Path) -> set[str]:
    """The package modules `path` imports at run time (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    here = path.relative_to(PACKAGE).parent.parts
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level == 0 or id(node) in skip:
            continue
        base = list(here[: len(here) - (node.level - 1)])
        parts = base + (node.module.split(".") if node.module else [])
        names = [a.name for a in node.names] if not node.module else [None]
        for name in names:
            target = parts + ([name] if name else [])
            for candidate in ("/".join(target) + ".py", "/".join(target[:-1]) + ".py"):
                if candidate in _modules():
                    found.add(candidate)
                    break
            else:
                package = PACKAGE.joinpath(*target)
                if package.is_dir():  # a subpackage: its interface
                    found.add("/".join(target) + "/")
    return found


def test_the_module_map_lists_every_module():
    assert set(_map()) == set(_modules())


@pytest.mark.parametrize("module", sorted(_modules()))
def test_a_module_imports_only_lower_levels(module):
    levels = _map()
    mine = levels[module]
    for target in _imports(_modules()[module]):
        if target.endswith("/"):  # a subpackage's interface: its highest module
            inside = [lv for m, lv in levels.items() if m.startswith(target)]
            level = max(inside)
        else:
            level = levels[target]
        assert level < mine, f"{module} (level {mine}) imports {target} ({level})"


@pytest.mark.parametrize("module", sorted(_modules()))
def test_no_module_is_over_600_lines(module):
    assert len(_modules()[module].read_text().splitlines()) <= 600


# A function a newcomer can follow: radon's cyclomatic complexity at most 20 (its
# grade C). Equinox has 13 functions above 10 in 734; the one exception here is a
# plot, a flat list of drawing calls.
_MOST_COMPLEX = 20
_EXEMPT = {("_report/_plot.py", "plot")}


@pytest.mark.parametrize("module", sorted(_modules()))
def test_no_function_is_too_complex(module):
    from radon.complexity import cc_visit

    blocks = cc_visit(_modules()[module].read_text())
    over = [
        (b.fullname, b.complexity)
        for b in blocks
        if b.complexity > _MOST_COMPLEX and (module, b.name) not in _EXEMPT
    ]
    assert not over, f"{module}: split these into named steps: {over}"


_INTERNALS = re.compile(
    r"jax\._src|params\[\"|params\.get\(|primitive\.name|donate_first|donate_rest"
    r"|_cache_size"
)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_jax_internals_only_in_the_adapters(module):
    if pathlib.Path(module).name in ADAPTERS:
        return
    text = _modules()[module].read_text()
    assert not _INTERNALS.findall(text), module


def test_the_slowest_first_order_names_every_test_file():
    """`tests/conftest.py`'s `SLOWEST_FIRST`, the order in which the two workers
    take whole files, names each test file once and no file that is gone: a file
    left out runs after every listed one, whatever its time, and can leave one
    worker running alone at the end."""
    listed = list(conftest.SLOWEST_FIRST)
    present = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    twice = sorted({name for name in listed if listed.count(name) > 1})
    missing, gone = sorted(present - set(listed)), sorted(set(listed) - present)
    assert not (twice or missing or gone), (
        f"`SLOWEST_FIRST` lists twice: {twice}; leaves out: {missing}; lists files "
        f"that are gone: {gone}. Order every file by its time in a measured run."
    )
