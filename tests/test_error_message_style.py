"""Error messages in the anchors' shape: short enough to read at a glance, with
long explanations kept as module constants and each catalogued error's link at
the end (`_errors.see`). Measured over the literal text of every `raise` in the
library, as the code review measured Equinox (median 62 characters) and optax
(55)."""

import ast
import functools
import re
import statistics
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest


LIBRARY = Path(__file__).parent.parent / "eqx_offload"
# A formatted value (`{name!r}`) counts as this many characters: a leaf path or
# a number, as users see them.
PLACEHOLDER = 10


def _text_length(node: ast.expr) -> int | None:
    """The length of a message expression's literal text, or None where it is not
    written at the `raise` (a variable, a module constant, a call)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return len(node.value)
    if isinstance(node, ast.JoinedStr):
        return sum(
            len(v.value)
            if isinstance(v, ast.Constant) and isinstance(v.value, str)
            else PLACEHOLDER
            for v in node.values
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        if _is_link(node.right):
            return _text_length(node.left)
        left, right = _text_length(node.left), _text_length(node.right)
        if left is not None and right is not None:
            return left + right
    return None


def _is_link(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, (ast.Name, ast.Attribute))
        and (getattr(node.func, "id", None) or getattr(node.func, "attr", None))
        == "see"
    )


@functools.cache
def _modules() -> tuple[tuple[Path, ast.Module], ...]:
    """Every library module, parsed once for all the tests."""
    return tuple((p, ast.parse(p.read_text())) for p in sorted(LIBRARY.rglob("*.py")))


@functools.cache
def _messages() -> tuple[tuple[str, int], ...]:
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            if not node.exc.args:
                continue
            length = _text_length(node.exc.args[0])
            if length is not None:
                where = f"{path.relative_to(LIBRARY)}:{node.lineno}"
                found.append((where, length))
    return tuple(found)


def test_messages_are_found():
    assert len(_messages()) > 150


def test_the_median_message_is_under_100_characters():
    lengths = [n for _, n in _messages()]
    assert statistics.median(lengths) < 100


@pytest.mark.parametrize("limit", [300])
def test_no_message_is_over_300_characters(limit):
    long = [(where, n) for where, n in _messages() if n > limit]
    assert not long, f"over {limit} characters (make them module constants): {long}"


ERRORS = LIBRARY.parent / "docs" / "errors.md"
# A row whose message is not the library's: JAX's own error, or none at all.
NOT_OURS = re.compile(r"`\w+` from (JAX|Python)|no error")
# A row whose message is another row's, and so ends with that row's link.
SHARED = re.compile(r"it ends with `See docs/errors\.md#e(\d+)\.`")


def _rows() -> dict[int, str]:
    """Each row of the error catalogue: its number and its "what you see" cell."""
    rows = {}
    for line in ERRORS.read_text().splitlines():
        match = re.match(r'\| <span id="e(\d+)"></span>\1 \| ', line)
        if match:
            rows[int(match[1])] = line.split(" | ")[2]
    return rows


def _assigned(statements: Iterable[ast.AST]) -> dict[str, list[ast.expr]]:
    """What each name is assigned in these statements (a tuple's names, their
    elements, or the whole value)."""
    names: dict[str, list[ast.expr]] = {}
    for node in statements:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name):
                names.setdefault(target.id, []).append(node.value)
            elif isinstance(target, ast.Tuple):
                values = node.value
                for i, element in enumerate(target.elts):
                    if isinstance(element, ast.Name):
                        value = (
                            values.elts[i] if isinstance(values, ast.Tuple) else values
                        )
                        names.setdefault(element.id, []).append(value)
    return names


def _numbers(node: ast.AST, scopes: list[dict], seen: frozenset = frozenset()):
    """The integers an expression can give: its constants (not those compared),
    and those of what the names it uses are assigned, innermost scope first."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return {node.value}
    if isinstance(node, ast.Compare):
        return set()
    if isinstance(node, ast.Name):
        scope = next((s for s in reversed(scopes) if node.id in s), {})
        values = scope.get(node.id, []) if node.id not in seen else []
        return set().union(*(_numbers(v, scopes, seen | {node.id}) for v in values))
    children = (
        [node.body, node.orelse]
        if isinstance(node, ast.IfExp)
        else ast.iter_child_nodes(node)
    )
    return set().union(*(_numbers(c, scopes, seen) for c in children))


def _linked_in(node: ast.AST, scopes: list[dict]) -> Iterator[int]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        scopes = [*scopes, _assigned(ast.walk(node))]
    if isinstance(node, ast.Call) and _is_link(node):
        for arg in node.args:
            yield from _numbers(arg, scopes)
    for child in ast.iter_child_nodes(node):
        yield from _linked_in(child, scopes)


@functools.cache
def _linked() -> frozenset[int]:
    """The rows the library's messages link to (`see(...)`)."""
    numbers = set()
    for _, tree in _modules():
        numbers.update(_linked_in(tree, [_assigned(tree.body)]))
    return frozenset(numbers)


def test_every_catalogued_message_ends_with_its_link():
    linked = _linked()
    missing = []
    for number, what in _rows().items():
        shared = SHARED.search(what)
        if shared and int(shared[1]) in linked:
            continue
        if number not in linked and not NOT_OURS.match(what):
            missing.append(number)
    assert not missing, f"rows no message links to (`see(N)`): {missing}"


def test_every_link_names_a_row():
    assert not _linked() - set(_rows())
