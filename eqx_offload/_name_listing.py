"""`checkpoint_names`: the names a model offers to `Policy(save=...)` and
`Policy(offload=...)`, with what each would save."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu

from . import _names, _residuals
from ._policy import Policy
from ._transform import _OffloadWrapper, filter_offload


class CheckpointName(NamedTuple):
    """One checkpoint name a policy can select.

    - `name`: the dotted name (`"blocks.input"`, `"blocks.mlp"`, or a
        `checkpoint_name` of your own inside a layer);
    - `residual`: whether the backward pass saves it; selecting a name that is not
        a residual (a block's output, say) would do nothing, so policies refuse it;
    - `bytes`: what saving it costs over all layers, as `memory_report` counts
        residuals (0 if it is not a residual).
    """

    name: str
    residual: bool
    bytes: int


def checkpoint_names(
    fn: Callable, *args: Any, **kwargs: Any
) -> tuple[CheckpointName, ...]:
    """The checkpoint names `fn` offers, traced (never run) on its arguments.

    `fn` is a loss, `loss_fn(model, *batch)`, or a `filter_offload` function; its
    arguments may be arrays or `jax.ShapeDtypeStruct`s. Every `Stacked` in them
    offers `"<path>.input"` (the carry entering each layer) and the outputs of its
    layer's submodules (`"<path>.<submodule>"`), and every `checkpoint_name` you
    call inside a layer. Each is traced as `Policy.remat(save=(name,))` would trace
    it, and reported with the bytes the backward pass then keeps under that name,
    summed over the layers (one layer's value times the number of layers). That
    is one trace per name: seconds for a large model, never a compile.

    **Arguments:**

    - `fn`: the function whose gradient with respect to its first argument a
        policy would checkpoint.
    - `*args`, `**kwargs`: its arguments.

    **Returns:**

    A tuple of `eqx_offload.CheckpointName(name, residual, bytes)`, in the order
    the names occur; print them or pass the residual ones to a `Policy`.

    **Raises:**

    - `ValueError` if the arguments hold no `Stacked` (only stacked layers have
        names a policy can select).

    !!! Example

        ```python
        for row in eo.checkpoint_names(loss_fn, model, tokens, targets):
            print(row.name, row.residual, row.bytes)
        ```
    """
    if isinstance(fn, _OffloadWrapper):
        fn = fn.__wrapped__
    if not callable(fn):
        raise TypeError(f"`checkpoint_names(fn=...)` must be callable, got {fn!r}.")
    if not args:
        raise TypeError(
            "`checkpoint_names(fn, *args)` needs `fn`'s arguments (arrays or "
            "`jax.ShapeDtypeStruct`s), the model first."
        )
    try:
        # Every name occurs when a pattern matches every submodule.
        everything = filter_offload(fn, Policy(save=("**",)))
        closed = eqx.filter_make_jaxpr(everything)(*args, **kwargs)[0]
    except ValueError as e:
        if "never occurred" not in str(e):
            raise
        raise ValueError(
            "`checkpoint_names(fn, ...)`: `fn`'s arguments hold no `Stacked` "
            "layers, so there are no checkpoint names to select. Store repeated "
            "layers as an `eqx_offload.Stacked`."
        ) from None
    # Whether a value is saved depends on what else is (two names of one value,
    # say), so each name is traced as a policy saving it alone would trace it.
    return tuple(
        _alone(fn, name, args, kwargs) for name in _names.NameLog.of(closed).names
    )


def _alone(fn: Callable, name: str, args: tuple, kwargs: dict) -> CheckpointName:
    loss = filter_offload(fn, Policy(save=(name,)))

    def wrt_first(first: Any, *rest: Any, **kw: Any) -> Any:
        rest, kw = jtu.tree_map(
            lambda x: jax.lax.stop_gradient(x) if eqx.is_array(x) else x, (rest, kw)
        )
        out = loss(first, *rest, **kw)
        return out[0] if isinstance(out, tuple) else out

    try:
        saved = _residuals.saved_residuals(wrt_first, *args, **kwargs)
    except ValueError as e:
        if "not saved for the backward pass" not in str(e):
            raise
        return CheckpointName(name, False, 0)
    total = sum(r.nbytes for r in saved if r.name == name and r.source != "argument")
    return CheckpointName(name, True, total)
