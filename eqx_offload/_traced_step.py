"""The function a `TrainStep` jits: the checks of its arguments, the loss and
its gradient, the optimizer update, and every output leaf placed where it lives."""

import dataclasses
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from . import _layout, _microbatch, _mixed_precision, _paths, _pending, _scopes, _update
from ._checked_loss import checked_loss
from ._compat import current_trace
from ._errors import see
from ._flatten import flatten, Static, unflatten
from ._memory_kinds import is_arraylike, is_host, is_key, to_space
from ._policy import Policy
from ._policy_args import warn_once
from ._transform import filter_offload


def _place_outputs(tree: Any, kinds: list, shardings: tuple) -> Any:
    """Every array leaf back in its memory kind and, if it is laid out over a mesh,
    in its input sharding, so the outputs feed the next call without recompiling."""
    leaves = jtu.tree_leaves(tree)
    found = zip(kinds, [s for x, s in zip(leaves, shardings) if eqx.is_array(x)])

    def place(x: Any) -> Any:
        if not eqx.is_array(x):
            return x
        (leaf, kind), sharding = next(found)
        if sharding is not None and is_host(x):
            # Constrained where it is: a round trip through the device (which
            # the compiler folds into a host-side copy) costs a copy of the
            # leaf in host memory.
            x = jax.lax.with_sharding_constraint(x, sharding)
        elif sharding is not None:
            plain = NamedSharding(sharding.mesh, sharding.spec)
            x = jax.lax.with_sharding_constraint(to_space(x, "device", ""), plain)
        return to_space(x, kind, leaf.path)

    return jtu.tree_map(place, tree)


def _check_layout(model: PyTree, policy: Policy, shardings: tuple) -> None:
    """Raises, naming the leaf, if a model leaf is not laid out as
    `Policy(shard=...)` declares (at trace time, from the input shardings)."""
    if policy.shard is None:
        return
    pairs = [
        (leaf, sharding)
        for leaf, sharding in zip(_paths.leaves(model), shardings, strict=True)
        if is_arraylike(leaf.value) and not is_key(leaf.value)
    ]
    leaves = [leaf for leaf, _ in pairs]
    declared = _declared(leaves, policy.shard, shardings, policy.host_tables)
    for (leaf, sharding), spec in zip(pairs, declared):
        if spec is None:
            continue
        ndim = len(leaf.value.shape)
        actual = None if sharding is None else _layout.normalise(sharding.spec, ndim)
        wanted = _layout.normalise(spec, ndim)
        if actual != wanted:
            where = "on one device" if sharding is None else f"laid out as {actual}"
            raise ValueError(
                f"`train_step`: model leaf {leaf.path!r} is {where}, but "
                f"`Policy(shard=...)` lays it out as {wanted}. Place it first: "
                "`eqx_offload.place(model, policy, mesh=mesh)`." + see(79)
            )


def _declared(
    leaves: list, rules: _layout.Rules, shardings: tuple, tables: tuple
) -> list:
    """The spec `Policy(shard=rules)` declares for each leaf (None: no rule), on the
    mesh of the input shardings (`P()` for a ruled leaf without one)."""
    meshes = [s.mesh for s in shardings if s is not None]
    if meshes:
        return _layout.specs(leaves, rules, meshes[0], False, tables)
    return [None if _layout.rule_of(x.path, rules) is None else P() for x in leaves]


class Statics(NamedTuple):
    """The static argument of a step's flat function (hashable): the non-array
    parts of its arguments, and the input shardings its outputs keep."""

    model: Static
    opt_state: Static
    batch: Static
    model_shardings: tuple
    opt_shardings: tuple


def value_and_grad(step: Any, arguments: tuple, where: str) -> tuple[Any, PyTree]:
    """The loss and gradient of `step` (a `TrainStep`) on `arguments = (model,
    opt_state, batch)`: `filter_offload(loss_fn, policy)` differentiated, in
    micro-batches and from the compute copies in `opt_state` where the policy asks
    for them. (`verify` checks this against plain JAX.)"""
    (model, opt_state, batch), policy = arguments, step.policy
    loss = filter_offload(checked_loss(step.loss_fn, step.has_aux, where), policy)
    if step.microbatches == 1 and policy.compute_dtype is None:
        return eqx.filter_value_and_grad(loss, has_aux=step.has_aux)(model, *batch)
    params = _update.trainable(model)
    _mixed_precision.check_keep_dtype(params, policy, where)
    sources = _mixed_precision.sources(model, params, opt_state)
    dtypes = _mixed_precision.compute_dtypes(params, policy)
    split = (step.microbatches, step.unsplit, step.has_aux, policy.host_tables)
    return _microbatch.value_and_grad(
        loss, sources, params, dtypes, batch, *split, policy.update == "host", policy
    )


def traced_step(
    step: Any,
    model_dynamic: list,
    opt_dynamic: list,
    batch_dynamic: list,
    statics: Statics,
) -> tuple[list, list, Any, dict[str, Any] | None]:
    """The step on flat arguments (`_flatten.flatten`'s): `step` is the
    `TrainStep` (its public fields). Returns the new model's and optimizer state's
    array leaves, the loss, and the metrics or `None`."""
    optimizer, policy, where = step.optimizer, step.policy, "`train_step`"
    opt_state = unflatten(opt_dynamic, statics.opt_state)
    # Without the marks of the `Stacked`s whose update this step applies (a static
    # field, which the optimizer state's trees do not have).
    model = _pending.unmarked(unflatten(model_dynamic, statics.model), opt_state, where)
    batch = unflatten(batch_dynamic, statics.batch)
    wrapped, kinds = _update.check_step(optimizer, opt_state, model, policy, where)
    _check_layout(model, policy, statics.model_shardings)
    if policy.update_timing != "now":
        return _pending_step(step, wrapped, model, opt_state, batch, statics, kinds)
    value, grads = value_and_grad(step, (model, opt_state, batch), where)
    with jax.named_scope(_scopes.UPDATE):
        args = (wrapped, grads, opt_state, model, policy, *kinds, step.metrics)
        model, opt_state, norms = _update.update(_update.UpdateArgs(*args))
    return _outputs(model, opt_state, kinds, statics) + (value, norms)


# The compiled program keeps its name, `jit__step` (profiles and captured HLO show it).
traced_step.__name__ = traced_step.__qualname__ = "_step"


def _outputs(
    model: PyTree, opt_state: PyTree, kinds: tuple[list, list], statics: Statics
) -> tuple[list, list]:
    """The step's new model and optimizer state, flattened as `jitted` returns
    them, every leaf back where it lives. (With `device_put` to a memory space
    inside the traced function: the same trace then compiles for any backend.)"""
    with jax.named_scope(_scopes.UPDATE):
        with jax.named_scope(_scopes.PARAMS):
            model = _place_outputs(model, kinds[0], statics.model_shardings)
        with jax.named_scope(_scopes.OPT_STATE):
            opt_state = _place_outputs(opt_state, kinds[1], statics.opt_shardings)
    return flatten(model)[0], flatten(opt_state)[0]


def _pending_step(
    step: Any,
    optimizer: optax.GradientTransformation,
    model: PyTree,
    opt_state: _pending.PendingUpdate,
    batch: tuple,
    statics: Statics,
    kinds: tuple[list, list],
) -> tuple[list, list, Any, dict[str, Any] | None]:
    """`traced_step` under `Policy(update_timing="next_forward")`: the waiting
    update of the stacked layers applied in the forward scan (where it cannot, in
    a loop of its own before the loss, with a warning), and this step's held over.
    `optimizer` is the step's, wrapped for the policy."""
    params = _update.trainable(model)
    new_kinds = (_update.param_kinds(params, kinds[0]), [k for _, k in kinds[1]])
    cause = _not_in_forward(step) if opt_state.ready else None
    applied = None
    if opt_state.ready and cause is None:
        applied = _applying(step, optimizer, model, opt_state, batch, new_kinds)
        cause = None if applied else _NOT_ONCE
    if cause is not None:
        warn_once(
            f"`Policy(update_timing='next_forward')` {cause}: the step applies the "
            "held-over update before the loss, hiding nothing (the numbers are the "
            "same). Use `update_timing='now'`."
        )
    if applied is not None:
        value, grads, model, opt_state = applied
    else:
        with jax.named_scope(_scopes.UPDATE):  # (nothing where none waits)
            new, opt_state = _update.apply_waiting(
                optimizer, opt_state, params, new_kinds
            )
        model = _update.with_params(model, new)
        state = _update.own_state(opt_state)
        value, grads = value_and_grad(step, (model, state, batch), "`train_step`")
    with jax.named_scope(_scopes.UPDATE):
        new, opt_state = _update.hold_update(
            optimizer, grads, opt_state, _update.trainable(model), new_kinds
        )
    model = _update.with_params(model, new)
    return _outputs(model, opt_state, kinds, statics) + (value, None)


_NOT_ONCE = (
    "where a `Stacked`'s forward scan did not run, differentiated, exactly once "
    "in the loss (it ran twice, in a loop, under `jax.checkpoint` or a `jax.jit`)"
)


def _not_in_forward(step: Any) -> str | None:
    """Why the forward scan cannot apply the held-over update, or None."""
    if step.microbatches > 1:
        return f"with `microbatches={step.microbatches}`"
    if step.policy.compute_dtype is not None:
        return "with `compute_dtype`"
    return "under `Explicit` mesh axes" if _layout.explicit_axes() else None


def _applying(
    step: Any,
    optimizer: optax.GradientTransformation,
    model: PyTree,
    opt_state: Any,
    batch: tuple,
    kinds: tuple[list[str], list[str]],
) -> tuple[Any, PyTree, PyTree, Any] | None:
    """The loss and gradient, with each `Stacked`'s forward scan applying the
    update `opt_state` holds for it (`_pending.py`): its new parameters and state
    come back as the gradient of its `aux`. **Returns:** the loss, the gradients,
    and the model and state with the update applied; or None where a `Stacked`
    did not apply its update exactly once (the caller applies it before the
    loss instead)."""
    params = _update.trainable(model)
    owed, back = _update.layer_updates(optimizer, opt_state, params, kinds)
    loss = filter_offload(
        checked_loss(step.loss_fn, step.has_aux, "`train_step`"), step.policy
    )
    records = []

    def outer(both: tuple[PyTree, dict], *batch: Any) -> Any:
        model, aux = both
        layers = {path: owed[path]._replace(aux=aux[path]) for path in owed}
        with _pending.owed(layers, current_trace()) as record:
            records.append(record)
            return loss(model, *batch)

    aux = {path: layers.aux for path, layers in owed.items()}
    value, (grads, new_aux) = eqx.filter_value_and_grad(outer, has_aux=step.has_aux)(
        (model, aux), *batch
    )
    if not records[0].applied_once():
        # Its new values did not come back as the cotangent. (What was traced
        # here is left unused: the compiler removes it.)
        return None
    new_params, inner = back(new_aux)
    model = _update.with_params(model, new_params)
    return value, grads, model, dataclasses.replace(opt_state, inner=inner, ready=False)
