"""`apply_pending`: the stacked layers' update a
`Policy(update_timing="next_forward")` step held over, applied."""

import equinox as eqx
import optax
from jaxtyping import PyTree

from .. import _pending
from .._errors import see
from .._policy import check_policy, Policy
from . import _deferred, _dispatch, _optim


def apply_pending(
    model: PyTree,
    opt_state: PyTree,
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    policy: Policy,
) -> tuple[PyTree, PyTree]:
    """Applies the optimizer update that a `train_step` left pending.

    Steps under `Policy(update_timing="next_forward")` leave one. Such a step
    returns the stacked layers' parameters and optimizer state one update behind,
    and marks those `Stacked`s. The next step applies the update. Call this before
    using the model in any other way: after the last step, before evaluating,
    exporting or saving. A marked `Stacked` refuses to run outside the step, and
    `save`, `state_dict` and `verify` refuse it; their errors name this function.
    `memory_report` reports the step as it runs, with one pending. With nothing
    pending, it returns its arguments as they are.

    **Arguments:**

    - `model`, `opt_state`: what the last step returned.
    - `optimizer`, `policy`: those the step was built with.

    **Returns:**

    `(model, opt_state)`: the model with the update applied (its marks cleared),
    and the state with nothing pending. The next step then applies none. Both
    inputs are donated.

    !!! Example

        ```python
        for batch in batches:
            model, opt_state, loss, _ = step(model, opt_state, *batch)
        model, opt_state = eo.apply_pending(model, opt_state, optimizer, policy)
        ```
    """
    optimizer = _optim.as_transformation(optimizer, "`apply_pending(optimizer=...)`")
    check_policy(policy, "`apply_pending(policy=...)`")
    pending = isinstance(opt_state, _pending.PendingUpdate)
    if pending == (policy.update_timing == "now"):  # (a state of another policy)
        mismatch = (
            "holds a pending update, but `policy` has `update_timing='now'`. Pass "
            "the step's policy."
            if pending
            else "is not from a "
            f"`Policy(update_timing={policy.update_timing!r})` step. Build it with "
            "`eqx_offload.init_opt_state`."
        )
        raise ValueError(f"`apply_pending`: `opt_state` {mismatch}" + see(139))
    if not pending or not opt_state.ready:
        return model, opt_state
    return _apply(model, opt_state, optimizer, policy)


@eqx.filter_jit(donate="all")
def _apply(
    model: PyTree,
    opt_state: _pending.PendingUpdate,
    optimizer: optax.GradientTransformation,
    policy: Policy,
) -> tuple[PyTree, PyTree]:
    model = _pending.mark(model, ())  # (cleared: the update is applied)
    inner, (model_kinds, opt_kinds) = _optim.check_step(
        optimizer, opt_state, model, policy, "`apply_pending`"
    )
    params = _dispatch.trainable(model)
    kinds = _dispatch.param_kinds(params, model_kinds), [k for _, k in opt_kinds]
    new, opt_state = _deferred.apply_waiting(inner, opt_state, params, kinds)
    return _dispatch.with_params(model, new), _dispatch.to_kinds(opt_state, opt_kinds)
