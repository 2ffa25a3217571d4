"""`checkpoint_names`: the names a model offers to `Policy(save=...)` and
`Policy(offload=...)`.

Each comes with what it would save.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu

from . import _checkpoint_name_log, _residuals
from ._errors import see
from ._memory_kinds import abstract_sharding, is_arraylike
from ._mixed_precision import compute_dtypes
from ._policy import Policy, replace
from ._train_step import TrainStep
from ._transform import Offloaded
from ._update import is_trainable, trainable


class CheckpointName(NamedTuple):
    """One checkpoint name a policy can select.

    - `name`: the dotted name: `"blocks.input"`, `"blocks.mlp"`, or a `checkpoint_name`
        of your own inside a layer.
    - `residual`: whether the backward pass saves it. Selecting a name that is not a
        residual would do nothing (a block's output, say). So policies refuse it.
    - `bytes`: what saving it costs over all layers, as `memory_report` counts
        residuals. 0 if it is not a residual.
    """

    name: str
    residual: bool
    bytes: int


def checkpoint_names(
    fn: Callable, *args: Any, **kwargs: Any
) -> tuple[CheckpointName, ...]:
    """The checkpoint names `fn` offers, traced (never run) on its arguments.

    `fn` is a loss, `loss_fn(model, *batch)`, a `filter_offload` function, or a
    `train_step`. A step is given as it is called: `checkpoint_names(step, model,
    opt_state, *batch)`. Then its loss is traced on one micro-batch, with the model in
    the policy's `compute_dtype`, as the step computes it. The arguments may be arrays
    or `jax.ShapeDtypeStruct`s.

    Every `Stacked` in them offers `"<path>.input"`: the carry entering each layer. It
    also offers the outputs of its layer's submodules (`"<path>.<submodule>"`). So does
    every `checkpoint_name` you call inside a layer. Each is traced as
    `Policy.remat(save=(name,))` would trace it. It is reported with the bytes the
    backward pass then keeps under that name, summed over the layers. (One layer's value
    times the number of layers.) That is one trace per name: seconds for a large model,
    never a compile.

    **Arguments:**

    - `fn`: the function whose gradient a policy would checkpoint (with respect to its
        first argument), or a `train_step`.
    - `*args`, `**kwargs`: its arguments.

    **Returns:**

    A tuple of `eqx_offload.CheckpointName(name, residual, bytes)`, in the order the
    names occur. Print them, or pass the residual ones to a `Policy`.

    **Raises:**

    - `ValueError` if the arguments hold no `Stacked`. Only stacked layers have names a
        policy can select.

    !!! Example

        ```python
        for row in eo.checkpoint_names(loss_fn, model, tokens, targets):
            print(row.name, row.residual, row.bytes)
        ```
    """
    base = Policy()
    if isinstance(fn, Offloaded):
        fn = fn.__wrapped__
    elif isinstance(fn, TrainStep):
        base = fn.policy
        fn, args = fn.loss_fn, _as_the_step_calls_it(fn, args, kwargs)
    if not callable(fn):
        raise TypeError(f"`checkpoint_names(fn=...)` must be callable, got {fn!r}.")
    if not args:
        raise TypeError(
            "`checkpoint_names(fn, *args)` needs `fn`'s arguments, the model first "
            "(arrays or `jax.ShapeDtypeStruct`s)." + see(101)
        )
    try:
        # Every name occurs when a pattern matches every submodule.
        everything = Offloaded(fn, replace(base, save=("**",), offload=()))
        closed = eqx.filter_make_jaxpr(everything.run)(args, kwargs)[0]
    except _checkpoint_name_log.UnusedName as e:
        if not e.never_occurred:
            raise
        raise ValueError(
            "`checkpoint_names(fn, ...)`: `fn`'s arguments hold no `Stacked` "
            "layers, so no checkpoint names. Store repeated layers as an "
            "`eqx_offload.Stacked`." + see(101)
        ) from None
    # Whether a value is saved depends on what else is (two names of one value,
    # say), so each name is traced as a policy saving it alone would trace it.
    names = _checkpoint_name_log.NameLog.of(closed).names
    return tuple(_alone(fn, base, name, args, kwargs) for name in names)


def _as_the_step_calls_it(step: TrainStep, args: tuple, kwargs: dict) -> tuple:
    """The arguments a train step gives its loss.

    They are the model, its trainable floating-point leaves in the policy's compute
    dtype (as abstract values), and one micro-batch of the batch. (The first `1/k` of
    each split argument.)
    """
    if kwargs or len(args) < 2:
        raise TypeError(
            "`checkpoint_names(step, ...)` takes the step's arguments: "
            "`checkpoint_names(step, model, opt_state, *batch)`." + see(104)
        )
    model, _, *batch = args
    dtypes = iter(compute_dtypes(trainable(model), step.policy))

    def in_compute_dtype(x: Any) -> Any:
        if not is_trainable(x):
            return x
        dtype = next(dtypes)
        return x if dtype == x.dtype else _abstract(x, x.shape, dtype)

    return (jax.tree.map(in_compute_dtype, model), *one_microbatch(step, batch))


def _abstract(x: Any, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    sharding = abstract_sharding(getattr(x, "sharding", None))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def one_microbatch(step: TrainStep, batch: Sequence[Any]) -> list[Any]:
    """The batch arguments of one micro-batch of a train step (abstract).

    That is the first `1/k` of each argument it splits, and the ones in `unsplit` whole.
    """
    k = step.microbatches

    def one_part(x: Any) -> Any:
        if not is_arraylike(x) or k == 1:
            return x
        return _abstract(x, (x.shape[0] // k, *x.shape[1:]), x.dtype)

    return [
        arg if i in step.unsplit else jax.tree.map(one_part, arg)
        for i, arg in enumerate(batch)
    ]


def _alone(
    fn: Callable, base: Policy, name: str, args: tuple, kwargs: dict
) -> CheckpointName:
    """`name` as `base` (its streamed tables and layout) saving it alone, offloading
    nothing, traces it."""
    loss = Offloaded(fn, replace(base, save=(name,), offload=()))

    def wrt_first(first: Any, *rest: Any, **kw: Any) -> Any:
        rest, kw = jtu.tree_map(
            lambda x: jax.lax.stop_gradient(x) if eqx.is_array(x) else x, (rest, kw)
        )
        out = loss.run((first, *rest), kw)
        return out[0] if isinstance(out, tuple) else out

    try:
        saved = _residuals.saved_residuals(wrt_first, *args, **kwargs)
    except _checkpoint_name_log.UnusedName as e:
        if e.never_occurred:
            raise
        return CheckpointName(name, False, 0)
    total = sum(r.nbytes for r in saved if r.name == name and r.source != "argument")
    return CheckpointName(name, True, total)
