"""What a model's parts weigh before anything is compiled: the top-level fields
that hold trainable leaves, the parts of the optimizer state, and the device bytes
each single move of `plan` frees by estimate."""

from collections import Counter
from typing import Any

import jax.numpy as jnp

from .. import _paths
from .._policy import Policy
from .._update import (
    as_transformation,
    init_opt_state,
    is_trainable,
    state_leaves,
    trainable,
)
from ._candidates import field_of, Knob, Move, Part


def param_bytes(model: Any) -> dict[str, int]:
    """The top-level fields of `model` that hold trainable leaves, in order, with
    the bytes of those leaves."""
    out: Counter[str] = Counter()
    for leaf in _paths.leaves(model):
        if is_trainable(leaf.value):
            out[field_of(leaf.path)] += _nbytes(leaf.value)
    return out


def state_slots(optimizer: Any, model: Any) -> dict[Part, int]:
    """Where `plan` can put optimizer state, with the bytes of each. A slot is one
    part of one top-level field's state (`Part("blocks", slot="nu")`: Adam's second
    moment of the blocks), or all of it where the optimizer names no parts. State
    that mirrors no parameter (step counts) stays on the device, uncounted."""
    owned = [(s, field_of(s.owner_path)) for s in _owned(optimizer, model)]
    unnamed = {field for s, field in owned if s.part is None}
    out: Counter[Part] = Counter()
    for s, field in owned:
        slot = Part(field) if field in unnamed else Part(field, slot=s.part)
        out[slot] += _nbytes(s.leaf.value)
    return out


def estimates(sizes: dict[Knob, dict[Any, int]], offered: list) -> dict[Move, int]:
    """The device bytes each single move frees, before compiling anything: of
    each knob, the bytes of what it moves (`sizes`: a field's parameters by its
    `Part`, `param_bytes`; a slot's optimizer state, `state_slots`; a streamed
    table, `tables_of`; a field's compute copies, `copies_of`), and a checkpoint
    name's saved bytes (`checkpoint_names`), offloaded or recomputed."""
    out: dict[Move, int] = {}
    for knob, of in sizes.items():
        out |= {Move(knob, name, "pinned_host"): n for name, n in of.items()}
    choices = ("offload", "recompute")
    return out | {
        Move("residual", n.name, c): n.bytes for n in offered for c in choices
    }


def copies_of(model: Any, dtypes: tuple[str | None, ...]) -> dict[str, int]:
    """The top-level fields whose host-resident parameters get compute copies
    (`Policy(compute_dtype=...)`) under every compute dtype offered, with the bytes
    of their copies (in the widest of those dtypes): the fields with a floating
    leaf in another dtype; none without a compute dtype offered."""
    out: dict[str, int] | None = None
    for dtype in [jnp.dtype(d) for d in dtypes if d is not None]:
        sizes: dict[str, int] = Counter()
        for leaf in _paths.leaves(model):
            x = leaf.value
            floating = is_trainable(x) and jnp.issubdtype(x.dtype, jnp.floating)
            if floating and x.dtype != dtype:
                sizes[field_of(leaf.path)] += x.size * dtype.itemsize
        if out is not None:  # under every dtype, the widest copies
            sizes = {f: max(n, sizes[f]) for f, n in out.items() if f in sizes}
        out = sizes
    return out or {}


def parts_of(
    optimizer: Any, model: Any, slots: dict[Part, int]
) -> tuple[dict[Part, tuple[Part, ...]], dict[Move, int]]:
    """The parts one level down (`Part("blocks", "mlp")`) of each top-level field
    with two or more, and of each of its state slots, which `plan` can place apart
    from the rest of the field; with the device bytes each frees by estimate."""
    sizes: Counter[Move] = Counter()
    children: dict[Part, dict[Part, None]] = {}  # (ordered sets)

    def add(knob: Knob, part: Part, n: int) -> None:
        sizes[Move(knob, part, "pinned_host")] += n
        children.setdefault(part.whole, {})[part] = None

    for leaf in _paths.leaves(model):
        if is_trainable(leaf.value) and (part := _part(leaf.path)) is not None:
            add("params", part, _nbytes(leaf.value))
    for s in _owned(optimizer, model):
        if (part := _part(s.owner_path)) is not None:
            # A part of one state slot, or of all of the field's state.
            slot = None if part.whole in slots else s.part
            add("opt_state", part._replace(slot=slot), _nbytes(s.leaf.value))
    split = {w: tuple(p) for w, p in children.items() if len(p) > 1}
    kept = {m: n for m, n in sizes.items() if any(m.name in p for p in split.values())}
    return split, kept


def tables_of(model: Any) -> dict[str, int]:
    """The vocabulary tables `plan` can keep on the host
    (`Policy(host_tables=...)`): the two largest trainable `[vocab, dim]` leaves
    outside any `Stacked`, of 1024 rows or more (an embedding and a head), with
    their bytes. Whether the model reads one only through `eo.embed` and
    `eo.chunked_cross_entropy`, as streaming needs, the compile says."""
    found = {
        leaf.path: _nbytes(leaf.value)
        for leaf in _paths.leaves(model)
        if is_trainable(leaf.value)
        and leaf.stacked is None
        and leaf.value.ndim == 2
        and leaf.value.shape[0] >= 1024
    }
    largest = sorted(found, key=lambda p: -found[p])[:2]
    return {p: n for p, n in found.items() if p in largest}


def _owned(optimizer: Any, model: Any) -> list[Any]:
    """The optimizer state's leaves that mirror a parameter (`state_leaves`, with
    an `owner_path`)."""
    state = init_opt_state(optimizer, model, Policy())
    transformation = as_transformation(optimizer, "`plan`")
    leaves = state_leaves(transformation, state, trainable(model))
    return [s for s in leaves if s.owner_path is not None]


def _part(path: str) -> Part | None:
    """The part of a top-level field a leaf path is in: `Part("blocks", "mlp")` of
    `"blocks.mlp.layers[0].weight"`; `None` for a leaf that is the field itself or
    is in a list of it."""
    field = field_of(path)
    rest = path[len(field) :]
    if not rest.startswith("."):
        return None
    return Part(field, rest[1:].split(".", 1)[0].split("[", 1)[0])


def _nbytes(x: Any) -> int:
    return x.size * x.dtype.itemsize
