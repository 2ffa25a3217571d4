"""Error messages in the anchors' shape: short enough to read at a glance, with
long explanations kept as module constants and each catalogued error's link at
the end (`_errors.see`). Measured over the literal text of every `raise` in the
library, as the code review measured Equinox (median 62 characters) and optax
(55)."""

import ast
import statistics
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


def _messages() -> list[tuple[str, int]]:
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            if not node.exc.args:
                continue
            length = _text_length(node.exc.args[0])
            if length is not None:
                where = f"{path.relative_to(LIBRARY)}:{node.lineno}"
                found.append((where, length))
    return found


def test_messages_are_found():
    assert len(_messages()) > 150


def test_the_median_message_is_under_100_characters():
    lengths = [n for _, n in _messages()]
    assert statistics.median(lengths) < 100


@pytest.mark.parametrize("limit", [300])
def test_no_message_is_over_300_characters(limit):
    long = [(where, n) for where, n in _messages() if n > limit]
    assert not long, f"over {limit} characters (make them module constants): {long}"
