"""Dotted paths of pytree leaves, and the patterns that select them.

A path is written the way you would reach the leaf in Python, without the root:
`blocks.mlp.layers[0].weight`. Dictionary keys that are strings are written as
attributes (`w1`), other keys and sequence indices in brackets (`[0]`). The
`layers` field of a `Stacked` is left out, so `blocks.mlp.weight` names the stacked
weight of every layer and `blocks.input` the carry entering each layer.

Patterns: `*` matches within one dotted segment, `**` across segments (`**.` also
matches no segment at all, so `**.input` matches `input`), and everything else,
brackets included, is literal.
"""

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax.tree_util as jtu


def format_key(key: Any) -> str:
    """One key of a JAX key path as it appears in a dotted path."""
    named = isinstance(key, jtu.DictKey) and isinstance(key.key, str)
    if isinstance(key, jtu.DictKey) and not (named and key.key.isidentifier()):
        return f"[{key.key!r}]"
    if isinstance(key, jtu.GetAttrKey | jtu.DictKey):
        return "." + key_segment(key)
    if isinstance(key, jtu.SequenceKey | jtu.FlattenedIndexKey):
        return f"[{key_segment(key)}]"
    return str(key)


def key_segment(key: Any) -> str:
    """One key of a JAX key path as a segment of a state-dict key (`_state_dict`):
    attribute names, dictionary keys and sequence indices alike, without dots or
    brackets."""
    for field in ("name", "key", "idx"):  # `GetAttrKey`, `DictKey`, `SequenceKey`
        if hasattr(key, field):
            return str(getattr(key, field))
    return str(key)


def join(prefix: str, keys: tuple[Any, ...] | str) -> str:
    """Appends a key path (or an already formatted relative path) to `prefix`."""
    rest = keys if isinstance(keys, str) else "".join(format_key(k) for k in keys)
    if rest and not rest.startswith(("[", ".")):
        rest = "." + rest
    out = prefix + rest
    return out[1:] if out.startswith(".") else out


class AbstractLayerStack(eqx.Module):
    """A module whose `layers` hold layers stacked along a leading axis.

    `leaves` walks into its `layers` without writing that field into the path and
    with one more layer axis. `eqx_offload.Stacked` is the implementation; the base
    lives here so that these path utilities do not depend on it.
    """

    layers: eqx.AbstractVar[Any]


class Leaf(NamedTuple):
    """A leaf of a pytree with what `eqx_offload` needs to know about it."""

    path: str
    value: Any
    stacked: str | None  # path of the innermost enclosing `Stacked`, if any
    metadata: Mapping[str, Any]  # metadata of the innermost dataclass field above
    layer_axes: int = 0  # leading axes that index layers: one per enclosing `Stacked`
    # The leaf's state-dict key (`key_segment`s), with `None` where each enclosing
    # `Stacked`'s layer index goes.
    segments: tuple[str | None, ...] = ()


def leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[Leaf]:
    """Flattens `tree` like `jax.tree.leaves`, giving each leaf its dotted path (and
    its state-dict key: the one walk over `Stacked` layers both spellings share)."""
    out: list[Leaf] = []
    _visit(tree, "", (), None, {}, is_leaf, out)
    return out


def _visit(
    node: Any,
    prefix: str,
    segments: tuple[str | None, ...],
    stacked: str | None,
    meta: Mapping,
    is_leaf: Callable[[Any], bool] | None,
    out: list[Leaf],
) -> None:
    """Appends the leaves of `node` to `out` (`leaves`' walk; a module-level function
    rather than a closure, since it runs for every tree the library looks at)."""
    if isinstance(node, AbstractLayerStack):
        _visit(node.layers, prefix, segments + (None,), prefix, meta, is_leaf, out)
        return

    def stops(x: Any) -> bool:  # a nested `Stacked` (visited on its own), or a leaf
        return x is not node and (
            isinstance(x, AbstractLayerStack) or (is_leaf is not None and is_leaf(x))
        )

    for keys, value in jtu.tree_leaves_with_path(node, is_leaf=stops):
        path = join(prefix, keys)
        key = segments + tuple(key_segment(k) for k in keys)
        leaf_meta = _field_metadata(node, keys, meta)
        if isinstance(value, AbstractLayerStack) and value is not node:
            _visit(value, path, key, stacked, leaf_meta, is_leaf, out)
        else:
            depth = sum(s is None for s in key)
            out.append(Leaf(path, value, stacked, leaf_meta, depth, key))


def _field_metadata(node: Any, keys: tuple[Any, ...], meta: Mapping) -> Mapping:
    """The metadata of the innermost dataclass field on the way down `keys`."""
    for key in keys:
        try:
            if isinstance(key, jtu.GetAttrKey):
                field = getattr(node, "__dataclass_fields__", {}).get(key.name)
                meta = field.metadata if field is not None and field.metadata else meta
                node = getattr(node, key.name)
            elif isinstance(key, jtu.DictKey | jtu.SequenceKey):
                node = node[key.key if isinstance(key, jtu.DictKey) else key.idx]
            else:
                break
        except (AttributeError, KeyError, IndexError, TypeError):
            break
    return meta


# `**.` (any segments, or none), `**`, `*`, and a run of literal characters.
_TOKENS = re.compile(r"\*\*\.|\*\*|\*|[^*]+")
_WILDCARDS = {"**.": r"(?:.*\.)?", "**": r".*", "*": r"[^.]*"}


@functools.cache
def _regex(pattern: str) -> re.Pattern[str]:
    tokens = _TOKENS.findall(pattern)
    return re.compile("".join(_WILDCARDS.get(t) or re.escape(t) for t in tokens))


def matches(pattern: str, name: str) -> bool:
    """Whether `pattern` matches the whole of `name`."""
    return _regex(pattern).fullmatch(name) is not None


def prefix_match(pattern: str, path: str) -> int | None:
    """Length of the longest prefix of `path` (ending at a segment boundary, or the
    whole path) that `pattern` matches, or `None`."""
    regex = _regex(pattern)
    ends = [i for i, c in enumerate(path) if c in ".["] + [len(path)]
    return next(
        (end for end in reversed(ends) if end and regex.fullmatch(path[:end])), None
    )


def under(path: str, patterns: Sequence[str]) -> bool:
    """Whether one of `patterns` matches `path` or a dotted prefix of it (as
    `Policy(params=...)` patterns match: `"head"` is every leaf under `head`)."""
    return any(prefix_match(p, path) is not None for p in patterns)


def specificity(pattern: str) -> int:
    """How many literal (non-`*`) characters a pattern has."""
    return len(pattern.replace("*", ""))


def best_match(
    path: str,
    items: Sequence[tuple[str, Any]],
    where: str,
    used: dict[str, bool] | None = None,
    link: str = "",
) -> tuple[str, Any] | None:
    """The (pattern, value) of `items` that applies to the leaf at `path`: of the
    patterns that match it or a dotted prefix of it, the one with the most literal
    characters. Two equally specific ones that disagree are a `ValueError` (ending
    with `link`, the error catalogue's). Marks the matching patterns in `used`."""
    best: tuple[str, Any] | None = None
    best_len = -1
    for pattern, value in items:
        if prefix_match(pattern, path) is None:
            continue
        if used is not None:
            used[pattern] = True
        length = specificity(pattern)
        if length > best_len:
            best, best_len = (pattern, value), length
        elif length == best_len and best is not None and value != best[1]:
            raise ValueError(
                f"{where}: patterns {best[0]!r} and {pattern!r} both match leaf "
                f"{path!r} equally well but give {best[1]!r} and {value!r}. Make one "
                "of them more specific." + link
            )
    return best


def check_used(
    used: dict[str, bool], paths: Sequence[str], where: str, link: str = ""
) -> None:
    """Raises a `ValueError` naming the patterns of `used` that matched no leaf
    (ending with `link`, the error catalogue's)."""
    unused = [p for p, hit in used.items() if not hit]
    if unused:
        raise ValueError(
            f"{where}: pattern(s) {quoted(unused)} match no leaf. Array leaves are: "
            f"{quoted(paths)}." + link
        )


def best_matches(
    paths: list[str], items: Sequence[tuple], where: str, links: tuple[str, str]
) -> list[tuple[str, Any] | None]:
    """The `best_match` of `items` for each path. A pattern that matches none of them
    is a `ValueError` (`check_used`). `links`: the catalogue's, for each error."""
    used = {pattern: False for pattern, _ in items}
    found = [best_match(path, items, where, used, links[0]) for path in paths]
    check_used(used, paths, where, links[1])
    return found


def is_literal(pattern: str) -> bool:
    return "*" not in pattern


def quoted(names: Any, limit: int = 20) -> str:
    """`'a', 'b', ...` for error messages."""
    names = list(names)
    if not names:
        return "(none)"
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
