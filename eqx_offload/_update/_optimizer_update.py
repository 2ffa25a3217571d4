"""`optimizer_update`: the optimizer update of `train_step`, for a step you write
yourself."""

import jax
import jax.core
import optax
from jaxtyping import PyTree

from .. import _scopes
from .._errors import see
from .._memory_kinds import is_arraylike
from .._policy import check_policy, Policy
from . import _dispatch, _optim


def optimizer_update(
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    grads: PyTree,
    opt_state: PyTree,
    model: PyTree,
    policy: Policy,
    *,
    metrics: bool = False,
) -> tuple[PyTree, ...]:
    """Applies `optimizer` to `model` inside your own jitted step.

    It updates as `eqx_offload.train_step` does (`Policy(update=...)`). Parameters,
    gradients and optimizer state on the host are updated piece by piece on the
    device. A piece is one layer of each `Stacked`, or one block of rows of each
    large leaf. Each piece is written back in place. Every leaf comes back in the
    memory kind the policy gives it.

    Call it inside a jitted function (`eqx.filter_jit`). Pass the gradients of
    `eqx.filter_value_and_grad(eqx_offload.filter_offload(loss_fn, policy))`.
    Donate the model and state, so that the update happens in place. Use
    `donate="all-except-first"` with the batch last, or `donate="all"`.

    **Arguments:**

    - `optimizer`: an `optax.GradientTransformation` (or `optax.MultiSteps`).
    - `grads`: the gradients, with the structure of
        `eqx.filter(model, eqx.is_inexact_array)`.
    - `opt_state`: from `eqx_offload.init_opt_state(optimizer, model, policy)`.
    - `model`: the model, placed with `eqx_offload.place(model, policy)`.
    - `policy`: the `eqx_offload.Policy` the model and state are placed with.
    - `metrics`: also return global norms, as `train_step(..., metrics=True)` does.
        They are of the gradients, the updates and the new parameters.

    **Returns:**

    `(model, opt_state, metrics)`: `metrics` is `None` unless `metrics=True`.

    **Raises:**

    `ValueError` if it is called outside a jitted function. Also if a leaf is not
    where the policy puts it; the error names the leaf and the fix.

    !!! Example

        ```python
        @eqx.filter_jit(donate="all-except-first")
        def step(batch, model, opt_state):
            loss, grads = eqx.filter_value_and_grad(eo.filter_offload(loss_fn, policy))(
                model, *batch
            )
            model, opt_state, _ = eo.optimizer_update(
                optimizer, grads, opt_state, model, policy
            )
            return loss, model, opt_state
        ```
    """
    where = "`optimizer_update`"
    optimizer = _optim.as_transformation(optimizer, f"`{where[1:-1]}(optimizer=...)`")
    check_policy(policy, "`optimizer_update(policy=...)`")
    if policy.update_timing != "now":
        raise ValueError(
            f"{where} cannot hold the update over to the next step "
            f"(`Policy(update_timing={policy.update_timing!r})`); only `train_step` "
            "can. Use `update_timing='now'` in a hand-written step." + see(138)
        )
    arrays = [x for x in jax.tree.leaves((model, opt_state)) if is_arraylike(x)]
    if arrays and not any(isinstance(x, jax.core.Tracer) for x in arrays):
        raise ValueError(
            f"{where} is called outside a jitted function. Call it inside a "
            "jitted step (`eqx.filter_jit`)." + see(93)
        )
    wrapped, kinds = _optim.check_step(optimizer, opt_state, model, policy, where)
    args = (wrapped, grads, opt_state, model, policy, *kinds, metrics)
    with jax.named_scope(_scopes.UPDATE):
        model, opt_state, norms = _dispatch.update(_dispatch.UpdateArgs(*args))
        with jax.named_scope(_scopes.PARAMS):
            model = _dispatch.to_kinds(model, kinds[0])
        with jax.named_scope(_scopes.OPT_STATE):
            opt_state = _dispatch.to_kinds(opt_state, kinds[1])
    return model, opt_state, norms
