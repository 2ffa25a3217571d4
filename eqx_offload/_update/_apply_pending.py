"""`apply_pending`: the stacked layers' update a `Policy(update_timing=...)` step
held over, applied."""

import equinox as eqx
import jax
import optax
from jaxtyping import PyTree

from .. import _mixed_precision
from .._errors import see
from .._memory_kinds import is_arraylike, to_space
from .._policy import check_policy, Policy
from . import _deferred
from ._optim import (
    as_transformation,
    check_model,
    check_state,
    param_kinds,
    stepping,
    trainable,
    with_params,
)


def apply_pending(
    model: PyTree,
    opt_state: PyTree,
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    policy: Policy,
) -> tuple[PyTree, PyTree]:
    """Applies the optimizer update that a `train_step` left pending.

    Steps under `Policy(update_timing="next_forward")` or `"delayed"` leave one.
    Such a step returns the stacked layers' parameters and optimizer state one
    update behind. The next step applies the update. Call this before reading the
    model in any other way: after the last step, before evaluating, exporting or
    saving. `eqx_offload.save` and `verify` refuse a state with an update pending.
    Their errors name this function. `memory_report` reports the step as it runs,
    with one pending. With nothing pending, it returns its arguments as they are.

    **Arguments:**

    - `model`, `opt_state`: what the last step returned.
    - `optimizer`, `policy`: those the step was built with.

    **Returns:**

    `(model, opt_state)`: the model with the update applied, and the state with
    nothing pending. The next step then applies none. Both inputs are donated.

    !!! Example

        ```python
        for batch in batches:
            model, opt_state, loss, _ = step(model, opt_state, *batch)
        model, opt_state = eo.apply_pending(model, opt_state, optimizer, policy)
        ```
    """
    optimizer = as_transformation(optimizer, "`apply_pending(optimizer=...)`")
    check_policy(policy, "`apply_pending(policy=...)`")
    if not isinstance(opt_state, _deferred.PendingUpdate):
        if policy.update_timing != "now":
            raise ValueError(
                "`apply_pending`: `opt_state` is not from a "
                f"`Policy(update_timing={policy.update_timing!r})` step. Build it "
                "with `eqx_offload.init_opt_state`." + see(139)
            )
        return model, opt_state
    if policy.update_timing == "now":
        raise ValueError(
            "`apply_pending`: `opt_state` holds a pending update, but `policy` has "
            "`update_timing='now'`. Pass the step's policy." + see(139)
        )
    if not opt_state.ready:
        return model, opt_state
    return _apply(model, opt_state, optimizer, policy)


@eqx.filter_jit(donate="all")
def _apply(
    model: PyTree,
    opt_state: _deferred.PendingUpdate,
    optimizer: optax.GradientTransformation,
    policy: Policy,
) -> tuple[PyTree, PyTree]:
    where = "`apply_pending`"
    model_kinds = check_model(model, policy, where)
    params = trainable(model)
    full = stepping(optimizer, params, policy)
    opt_kinds = check_state(full, opt_state, model, policy)
    state_kinds = [kind for _, kind in opt_kinds]
    inner = _mixed_precision.for_policy(optimizer, params, policy)
    new, opt_state = _deferred.apply_waiting(
        inner, opt_state, params, param_kinds(params, model_kinds), state_kinds
    )
    model = with_params(model, new)
    leaves, treedef = jax.tree.flatten(opt_state)
    kinds = iter(state_kinds)
    leaves = [to_space(x, next(kinds), "") if is_arraylike(x) else x for x in leaves]
    return model, jax.tree.unflatten(treedef, leaves)
