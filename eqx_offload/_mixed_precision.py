"""Mixed precision, `Policy(compute_dtype=...)`.

The master parameters keep their dtype (fp32) where the policy puts them. The loss
computes with a `compute_dtype` (bf16) view of them.

Host memory cannot be computed on, so a host-resident parameter cannot be cast
where it lives. Casting on the device would move the fp32 master there first. So
each such parameter gets a persistent *compute copy* in the compute dtype, kept in
the optimizer state. The optimizer is wrapped (`with_compute_copies`). Its update
then also writes the new parameter's copy next to the new master. The streamed
update writes it piece by piece. The loss then reads the copies, and half the
bytes move to the device. Parameters on the device are cast where the loss uses
them (`_grad_taps.tap`), with no copy.
"""

from typing import Any, NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import PyTree

from . import _paths
from ._errors import see
from ._memory_kinds import is_arraylike, is_masked, kind_of
from ._policy import Policy


_STATE_FOR_POLICY = (
    "Build it for this policy with "
    "`eqx_offload.init_opt_state(optimizer, model, policy)`, or restore it with "
    "`eqx_offload.load(..., policy)`."
)


class ComputeCopyState(NamedTuple):
    """The optimizer state under `Policy(compute_dtype=...)`.

    `inner` is the wrapped optimizer's own state. `copies` holds the compute-dtype
    copy of every host-resident parameter, and `optax.MaskedNode()` for the others.
    """

    inner: PyTree
    copies: PyTree


def compute_dtypes(params: PyTree, policy: Policy) -> list[Any]:
    """The dtype the loss computes with, for each array leaf of `params`.

    `params` is the trainable part of the model; the order is `jax.tree.leaves`'.
    """

    def dtype(leaf: _paths.Leaf) -> Any:
        x = leaf.value
        keep = policy.compute_dtype is None or not jnp.issubdtype(x.dtype, jnp.floating)
        keep = keep or _paths.under(leaf.path, policy.keep_dtype)
        return x.dtype if keep else jnp.dtype(policy.compute_dtype)

    return [dtype(leaf) for leaf in _paths.leaves(params) if is_arraylike(leaf.value)]


def check_keep_dtype(params: PyTree, policy: Policy, where: str) -> None:
    """Raises if a `Policy(keep_dtype=...)` pattern matches no trainable leaf."""
    paths = [leaf.path for leaf in _paths.leaves(params) if is_arraylike(leaf.value)]
    for pattern in policy.keep_dtype:
        if not any(_paths.under(p, (pattern,)) for p in paths):
            raise ValueError(
                f"{where}: `Policy(keep_dtype=...)` has {pattern!r}, which matches no "
                f"trainable leaf. Leaves include {_paths.quoted(paths, 5)}." + see(91)
            )


def _cast(x: Any, dtype: Any) -> Any:
    # `optax.tree_utils.tree_map_params` calls `init` on placeholders: keep them.
    return x.astype(dtype) if hasattr(x, "astype") else x


def with_compute_copies(
    optimizer: optax.GradientTransformation, mask: PyTree, dtype: Any
) -> optax.GradientTransformation:
    """`optimizer`, whose state also holds `dtype` copies of the parameters in `mask`.

    Its update rewrites each copy from the new parameter, `params + updates`: the
    value `eqx.apply_updates` gives.
    """

    def init(params: PyTree) -> ComputeCopyState:
        copies = jtu.tree_map(
            lambda p, m: _cast(p, dtype) if m else optax.MaskedNode(), params, mask
        )
        return ComputeCopyState(optimizer.init(params), copies)

    def update(
        grads: PyTree, state: ComputeCopyState, params: PyTree = None
    ) -> tuple[PyTree, ComputeCopyState]:
        if params is None:
            raise ValueError(
                "`Policy(compute_dtype=...)`: pass `params` to the optimizer update, "
                "which writes the compute copies from them."
            )
        grads = jtu.tree_map(lambda g, p: g.astype(p.dtype), grads, params)
        updates, inner = optimizer.update(grads, state.inner, params)

        def copy(c: Any, p: Any, u: Any) -> Any:
            return c if is_masked(c) else (p + u).astype(c.dtype)

        copies = jtu.tree_map(copy, state.copies, params, updates, is_leaf=is_masked)
        return updates, ComputeCopyState(inner, copies)

    return optax.GradientTransformation(init, update)  # pyright: ignore


def for_policy(
    optimizer: optax.GradientTransformation, params: PyTree, policy: Policy
) -> optax.GradientTransformation:
    """The optimizer a step runs for `policy`.

    It is wrapped to keep compute copies when some parameter needs one.
    """
    if policy.compute_dtype is None:
        return optimizer
    # A leaf gets a copy if it is host-resident and computed with in another dtype.
    dtypes = iter(compute_dtypes(params, policy))
    mask = jtu.tree_map(
        lambda x: next(dtypes) != x.dtype and kind_of(x) != "device", params
    )
    if not any(jtu.tree_leaves(mask)):
        return optimizer
    return with_compute_copies(optimizer, mask, jnp.dtype(policy.compute_dtype))


def check_state(wants: bool, opt_state: PyTree, where: str) -> None:
    """Raises unless `opt_state` has compute copies just when the step `wants` them."""
    has = isinstance(opt_state, ComputeCopyState)
    if wants and not has:
        raise ValueError(
            f"{where}: `Policy(compute_dtype=...)` keeps compute copies in the "
            "optimizer state, and this state has none. " + _STATE_FOR_POLICY + see(92)
        )
    if has and not wants:
        raise ValueError(
            f"{where}: the optimizer state holds compute copies (`ComputeCopyState`) "
            "the policy does not keep. Use its policy, or `opt_state.inner`." + see(92)
        )


def sources(model: PyTree, params: PyTree, opt_state: PyTree) -> PyTree:
    """`model` with each parameter that has a compute copy replaced by the copy.

    This is what the loss reads.
    """
    if not isinstance(opt_state, ComputeCopyState):
        return model
    copies = jtu.tree_leaves(opt_state.copies, is_leaf=is_masked)
    arrays = [leaf for leaf in _paths.leaves(params) if is_arraylike(leaf.value)]
    by_path = {
        leaf.path: c for leaf, c in zip(arrays, copies, strict=True) if not is_masked(c)
    }
    leaves = [by_path.get(leaf.path, leaf.value) for leaf in _paths.leaves(model)]
    return jtu.tree_unflatten(jtu.tree_structure(model), leaves)
