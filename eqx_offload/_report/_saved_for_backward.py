"""What a function saves for its backward pass, as `memory_report` shows it: bytes
by checkpoint name and memory kind, and the lines of code that save the most
without a name; and the function a train step differentiates, whose residuals
are the step's."""

from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import PyTree

from .. import _mixed_precision, _paths, _residuals
from .._memory_kinds import is_arraylike
from .._mixed_precision import compute_dtypes
from .._train_step import TrainStep
from .._transform import filter_offload
from .._update import own_state, trainable
from ._memory_report_type import LARGEST, ResidualRow, UNNAMED, UnnamedResidual


class Saved(NamedTuple):
    """What a function saves for its backward pass, as the report shows it."""

    rows: tuple[ResidualRow, ...]
    largest_unnamed: tuple[UnnamedResidual, ...]


def _label(r: _residuals.Residual) -> str:
    return r.name if r.name is not None else UNNAMED[1 if r.per_iteration else 0]


def saved_for_backward(fun: Callable, *args: Any, **kwargs: Any) -> Saved:
    """What `fun` saves for its backward pass, by checkpoint name and memory kind,
    and the lines of code that save the most without a name; its arguments
    (already counted) are left out."""
    totals: dict[tuple[str, str], int] = defaultdict(int)
    unnamed: dict[tuple, list[_residuals.Residual]] = defaultdict(list)
    for r in _residuals.saved_residuals(fun, *args, **kwargs):
        if r.source == "argument":
            continue
        kind = "pinned_host" if r.host else "device"
        totals[_label(r), kind] += r.nbytes
        if r.name is None:
            unnamed[_label(r), kind, r.where].append(r)
    rows = tuple(ResidualRow(name, kind, n) for (name, kind), n in totals.items())
    return Saved(rows, _largest_unnamed(unnamed))


def _largest_unnamed(unnamed: dict[tuple, list]) -> tuple[UnnamedResidual, ...]:
    """The `LARGEST` lines of code saving the most without a name, of each group
    (`UNNAMED`): once per step, and in every iteration of a loop."""
    parts = []
    for (group, kind, where), found in unnamed.items():
        largest = max(found, key=lambda r: r.nbytes)
        operations = tuple(dict.fromkeys(r.source for r in found))
        # (`str`: a PRNG key's dtype, `key<fry>`, is no NumPy dtype)
        shape, dtype = tuple(largest.aval.shape), str(largest.aval.dtype)
        total = sum(r.nbytes for r in found)
        parts.append(
            UnnamedResidual(
                group, kind, where, operations, len(found), shape, dtype, total
            )
        )
    parts.sort(key=lambda p: -p.bytes)
    return tuple(
        p for group in UNNAMED for p in [q for q in parts if q.group == group][:LARGEST]
    )


def differentiated(
    step: TrainStep, model: PyTree, opt_state: PyTree
) -> tuple[Callable, PyTree]:
    """The function of the model and one micro-batch that a train step
    differentiates, and the model it is given, so that its residuals are those of
    the step, in the dtypes they are saved in: under a compute dtype or
    micro-batches (`_microbatch.value_and_grad`), the loss reads each host-resident
    parameter's compute copy from `opt_state`, and casts each device-resident one
    to its compute dtype inside (the cast value is what the backward pass keeps,
    and what each layer's input is computed from)."""
    loss = filter_offload(step.loss_fn, step.policy)
    params = trainable(model)
    arrays = [leaf.path for leaf in _paths.leaves(params) if is_arraylike(leaf.value)]
    dtypes = dict(zip(arrays, compute_dtypes(params, step.policy), strict=True))
    seen = _mixed_precision.sources(model, params, own_state(opt_state))

    def fn(seen: PyTree, *batch: Any) -> Any:
        leaves = [
            leaf.value.astype(dtypes[leaf.path])
            if leaf.path in dtypes and leaf.value.dtype != dtypes[leaf.path]
            else leaf.value
            for leaf in _paths.leaves(seen)
        ]
        seen = jtu.tree_unflatten(jtu.tree_structure(seen), leaves)
        batch = jtu.tree_map(
            lambda x: jax.lax.stop_gradient(x) if eqx.is_array(x) else x, batch
        )
        out = loss(seen, *batch)
        return out[0] if step.has_aux else out

    return fn, seen
