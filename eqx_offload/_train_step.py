"""`train_step`: loss, gradients, optimizer update and placements in one jitted step."""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.core
import jax.tree_util as jtu
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from . import (
    _compat,
    _compiler,
    _diagnose,
    _layout,
    _mesh,
    _microbatch,
    _mixed_precision,
    _paths,
    _pending,
    _scopes,
    _update,
)
from ._checked_loss import checked_loss
from ._diagnose import DoesNotCompile
from ._memory_kinds import is_arraylike, is_host, to_space
from ._placement import place_batch
from ._policy import check_policy, Policy
from ._transform import filter_offload
from ._update import check_matches


def split(tree: Any) -> tuple[list, tuple]:
    """Array leaves (traced; `jax.ShapeDtypeStruct`s too), and everything else as a
    hashable static part."""
    leaves, treedef = jtu.tree_flatten(tree)
    dynamic = [x if is_arraylike(x) else None for x in leaves]
    static = tuple(None if is_arraylike(x) else x for x in leaves)
    return dynamic, (treedef, static)


def join(dynamic: list, static: tuple) -> Any:
    treedef, static_leaves = static
    leaves = [s if d is None else d for d, s in zip(dynamic, static_leaves)]
    return jtu.tree_unflatten(treedef, leaves)


def _mesh_shardings(dynamic: list) -> tuple:
    """The input shardings that sharding propagation might not give back: those of
    leaves laid out over several devices. (A static argument of the jitted step.)"""
    return tuple(_over_a_mesh(x) for x in dynamic)


def _over_a_mesh(x: Any) -> NamedSharding | None:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and len(sharding.device_set) > 1:
        return sharding
    return None


def _place_outputs(tree: Any, kinds: list, shardings: tuple) -> Any:
    """Every array leaf back in its memory kind and, if it is laid out over a mesh,
    in its input sharding, so the outputs feed the next call without recompiling."""
    leaves, treedef = jtu.tree_flatten(tree)
    array_shardings = [s for x, s in zip(leaves, shardings) if eqx.is_array(x)]
    out, position = [], 0
    for x in leaves:
        if eqx.is_array(x):
            (leaf, kind), sharding = kinds[position], array_shardings[position]
            position += 1
            if sharding is not None and is_host(x):
                # Constrained where it is: a round trip through the device (which
                # the compiler folds into a host-side copy) costs a copy of the
                # leaf in host memory.
                x = jax.lax.with_sharding_constraint(x, sharding)
            elif sharding is not None:
                plain = NamedSharding(sharding.mesh, sharding.spec)
                x = jax.lax.with_sharding_constraint(to_space(x, "device", ""), plain)
            x = to_space(x, kind, leaf.path)
        out.append(x)
    return jtu.tree_unflatten(treedef, out)


def _deleted(x: Any) -> bool:
    concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    return concrete and x.is_deleted()


def _raise_deleted(model: PyTree, opt_state: PyTree) -> None:
    for name, tree in (("model", model), ("opt_state", opt_state)):
        for leaf in _paths.leaves(tree):
            if _deleted(leaf.value):
                raise ValueError(
                    f"`train_step`: {name} leaf {leaf.path!r} has been deleted. The "
                    "step donates the model and the optimizer state: the arrays "
                    "passed to an earlier call are gone, and so are the ones "
                    "`eqx_offload.place` was given, where nothing had to move (it "
                    "returns those buffers as they are). Keep using what the step "
                    "returns: `model, opt_state, loss = step(model, opt_state, "
                    "*batch)`."
                )


def _check_layout(model: PyTree, policy: Policy, shardings: tuple) -> None:
    """Raises, naming the leaf, if a model leaf is not laid out as
    `Policy(shard=...)` declares (at trace time, from the input shardings)."""
    if policy.shard is None:
        return
    meshes = [s.mesh for s in shardings if s is not None]
    pairs = [
        (leaf, sharding)
        for leaf, sharding in zip(_paths.leaves(model), shardings, strict=True)
        if is_arraylike(leaf.value)
        and not jax.dtypes.issubdtype(leaf.value.dtype, jax.dtypes.prng_key)
    ]
    declared = (
        _layout.specs(
            [leaf for leaf, _ in pairs],
            policy.shard,
            meshes[0],
            False,
            policy.host_tables,
        )
        if meshes
        else [
            None if _layout.rule_of(leaf.path, policy.shard) is None else P()
            for leaf, _ in pairs
        ]
    )
    for (leaf, sharding), spec in zip(pairs, declared):
        if spec is None:
            continue
        ndim = len(leaf.value.shape)
        actual = None if sharding is None else _layout.normalise(sharding.spec, ndim)
        if actual != _layout.normalise(spec, ndim):
            where = "on one device" if sharding is None else f"laid out as {actual}"
            raise ValueError(
                f"`train_step`: model leaf {leaf.path!r} is {where}, but "
                f"`Policy(shard=...)` lays it out as {_layout.normalise(spec, ndim)}; "
                "place the model first with `model = eqx_offload.place(model, "
                "policy)` (on the mesh: inside `with jax.set_mesh(mesh):`)."
            )


class _Config(eqx.Module):
    """What `train_step` was given, checked: everything its step is built from."""

    loss_fn: Callable
    optimizer: optax.GradientTransformation
    policy: Policy
    has_aux: bool
    microbatches: int
    unsplit: tuple[int, ...]
    metrics: bool


class _Statics(NamedTuple):
    """The static argument of the jitted step (hashable): the non-array parts of
    its arguments, and the input shardings its outputs keep."""

    model: tuple
    opt_state: tuple
    batch: tuple
    model_shardings: tuple
    opt_shardings: tuple


def value_and_grad(
    loss_fn: Callable,
    policy: Policy,
    has_aux: bool,
    microbatches: int,
    unsplit: tuple[int, ...],
    arguments: tuple[PyTree, PyTree, tuple],
    where: str,
) -> tuple[Any, PyTree]:
    """The loss and gradient of the step on `arguments = (model, opt_state,
    batch)`: `filter_offload(loss_fn, policy)` differentiated, in micro-batches and
    from the compute copies in `opt_state` where the policy asks for them. (`verify`
    checks this against plain JAX.)"""
    model, opt_state, batch = arguments
    loss = filter_offload(checked_loss(loss_fn, has_aux, where), policy)
    if microbatches == 1 and policy.compute_dtype is None:
        return eqx.filter_value_and_grad(loss, has_aux=has_aux)(model, *batch)
    params = _update.trainable(model)
    _mixed_precision.check_keep_dtype(params, policy, where)
    return _microbatch.value_and_grad(
        loss,
        _mixed_precision.sources(model, params, opt_state),
        params,
        _mixed_precision.compute_dtypes(params, policy),
        batch,
        microbatches,
        unsplit,
        has_aux,
        policy.host_tables,
        policy.update == "host",
    )


def _step(
    config: _Config,
    model_dynamic: list,
    opt_dynamic: list,
    batch_dynamic: list,
    statics: _Statics,
) -> tuple[list, list, Any, dict[str, Any] | None]:
    optimizer, policy, has_aux = config.optimizer, config.policy, config.has_aux
    microbatches = config.microbatches
    model = join(model_dynamic, statics.model)
    opt_state = join(opt_dynamic, statics.opt_state)
    batch = join(batch_dynamic, statics.batch)
    model_kinds = _update.check_model(model, policy, "`train_step`")
    _check_layout(model, policy, statics.model_shardings)
    params = _update.trainable(model)
    wrapped = _mixed_precision.for_policy(optimizer, params, policy)
    copies = wrapped is not optimizer
    _mixed_precision.check_state(copies, _update.own_state(opt_state), "`train_step`")
    stepping = _update.stepping(optimizer, params, policy)
    check_matches(stepping, _update.structure(opt_state), params, "`train_step`")
    opt_kinds = _update.check_state(stepping, opt_state, model, policy)
    if policy.update_timing != "now":
        return _pending_step(
            config, model, opt_state, batch, statics, model_kinds, opt_kinds
        )

    value, grads = value_and_grad(
        config.loss_fn,
        policy,
        has_aux,
        microbatches,
        config.unsplit,
        (model, opt_state, batch),
        "`train_step`",
    )
    with jax.named_scope(_scopes.UPDATE):
        model, opt_state, norms = _update.update(
            wrapped,
            grads,
            opt_state,
            model,
            policy,
            model_kinds,
            opt_kinds,
            config.metrics,
        )
    return _outputs(model, opt_state, model_kinds, opt_kinds, statics) + (value, norms)


def _outputs(
    model: PyTree,
    opt_state: PyTree,
    model_kinds: list,
    opt_kinds: list,
    statics: _Statics,
) -> tuple[list, list]:
    """The step's new model and optimizer state, flattened as `jitted` returns
    them, every leaf back where it lives. (With `device_put` to a memory space
    inside the traced function: the same trace then compiles for any backend.)"""
    with jax.named_scope(_scopes.UPDATE):
        with jax.named_scope(_scopes.PARAMS):
            model = _place_outputs(model, model_kinds, statics.model_shardings)
        with jax.named_scope(_scopes.OPT_STATE):
            opt_state = _place_outputs(opt_state, opt_kinds, statics.opt_shardings)
    return split(model)[0], split(opt_state)[0]


def _pending_step(
    config: _Config,
    model: PyTree,
    opt_state: "_update.PendingUpdate",
    batch: tuple,
    statics: _Statics,
    model_kinds: list,
    opt_kinds: list,
) -> tuple[list, list, Any, dict[str, Any] | None]:
    """`_step` under `Policy(update_timing=...)`: the waiting update of the
    stacked layers applied before the loss (`"next_forward"`) or after it
    (`"delayed"`), and this step's held over."""
    policy = config.policy
    params = _update.trainable(model)
    optimizer = _mixed_precision.for_policy(config.optimizer, params, policy)
    param_kinds = _update.param_kinds(params, model_kinds)
    state_kinds = [kind for _, kind in opt_kinds]

    def apply(model: PyTree, opt_state: Any) -> tuple[PyTree, Any]:
        with jax.named_scope(_scopes.UPDATE):
            new, opt_state = _update.apply_waiting(
                optimizer, opt_state, _update.trainable(model), param_kinds, state_kinds
            )
        return _update.with_params(model, new), opt_state

    in_forward = (
        opt_state.ready
        and config.microbatches == 1
        and policy.compute_dtype is None
        and not _layout.explicit_axes()
    )
    applied = None
    if in_forward:
        applied = _value_and_grad_applying(
            config, optimizer, model, opt_state, batch, param_kinds, state_kinds
        )
    if applied is not None:
        value, grads, model, opt_state = applied
    else:
        if policy.update_timing == "next_forward":
            model, opt_state = apply(model, opt_state)
        value, grads = value_and_grad(
            config.loss_fn,
            policy,
            config.has_aux,
            config.microbatches,
            config.unsplit,
            (model, _update.own_state(opt_state), batch),
            "`train_step`",
        )
        if policy.update_timing == "delayed":
            model, opt_state = apply(model, opt_state)
    with jax.named_scope(_scopes.UPDATE):
        new, opt_state = _update.hold_update(
            optimizer,
            grads,
            opt_state,
            _update.trainable(model),
            param_kinds,
            state_kinds,
        )
    model = _update.with_params(model, new)
    return _outputs(model, opt_state, model_kinds, opt_kinds, statics) + (value, None)


def _value_and_grad_applying(
    config: _Config,
    optimizer: optax.GradientTransformation,
    model: PyTree,
    opt_state: Any,
    batch: tuple,
    param_kinds: list[str],
    state_kinds: list[str],
) -> tuple[Any, PyTree, PyTree, Any] | None:
    """The loss and gradient, with each `Stacked`'s forward scan applying the
    update `opt_state` holds for it (`_pending.py`): its new parameters and state
    come back as the gradient of its `aux`. **Returns:** the loss, the gradients,
    and the model and state with the update applied; or None where a `Stacked`
    did not apply its update exactly once (the caller applies it before the
    loss instead)."""
    policy = config.policy
    params = _update.trainable(model)
    owed, back = _update.layer_updates(
        optimizer,
        opt_state,
        params,
        param_kinds,
        state_kinds,
        policy.update_timing == "delayed",
    )
    loss = filter_offload(
        checked_loss(config.loss_fn, config.has_aux, "`train_step`"), policy
    )

    records = []

    def outer(both: tuple[PyTree, dict], *batch: Any) -> Any:
        model, aux = both
        layers = {path: owed[path]._replace(aux=aux[path]) for path in owed}
        with _pending.owed(layers, _compat.current_trace()) as record:
            records.append(record)
            return loss(model, *batch)

    aux = {path: layers.aux for path, layers in owed.items()}
    value, (grads, new_aux) = eqx.filter_value_and_grad(outer, has_aux=config.has_aux)(
        (model, aux), *batch
    )
    if not records[0].applied_once():
        # A `Stacked` run twice, in a loop, not at all or not differentiated: its
        # new values did not come back as the cotangent. (What was traced here
        # is left unused: the compiler removes it.)
        return None
    new_params, inner = back(new_aux)
    model = _update.with_params(model, new_params)
    opt_state = _update.PendingUpdate(inner, opt_state.grads, opt_state.held, False)
    return value, grads, model, opt_state


class _TrainStep(eqx.Module):
    """The object `train_step` returns; call it as `step(model, opt_state, *batch)`."""

    config: _Config
    fun: Callable  # the step on flattened arguments, before `jax.jit`
    jitted: Callable

    def __call__(
        self, model: PyTree, opt_state: PyTree, *batch: Any, **keywords: Any
    ) -> tuple:
        if keywords:
            raise TypeError(
                "`train_step`: the step takes the batch by position, "
                "`step(model, opt_state, *batch)` in `loss_fn`'s order (it splits "
                "and lays out each batch argument by position); got keyword "
                f"argument(s) {_paths.quoted(keywords)}. Pass them by position, or "
                "bind constants into the loss: `functools.partial(loss_fn, ...)`."
            )
        if self.config.policy.host_remat and jax.default_backend() != "tpu":
            raise ValueError(
                "`Policy(host_remat=True)` is an option of the TPU compiler, and "
                f"this backend is {jax.default_backend()!r}; drop it here (it "
                "changes where values wait, not what is computed), or compile "
                "for a TPU with `memory_report(target='tpu-v5e')`."
            )
        dynamic, statics = self.split(model, opt_state, *batch)
        if any(_deleted(x) for x in dynamic[0] + dynamic[1]):
            _raise_deleted(model, opt_state)
        try:
            with _mesh.context(dynamic):
                outputs = self.jitted(*dynamic, statics)
                model_dynamic, opt_dynamic, value, norms = outputs
        except ValueError:
            # JAX names argument positions for leaves on incompatible devices:
            # name the leaves instead, if that is what went wrong.
            trees = {"model": model, "opt_state": opt_state, "batch": batch}
            _mesh.check_devices(trees, "`train_step`")
            raise
        except jax.errors.JaxRuntimeError as e:
            # On a TPU the compiler may reject streaming a leaf of some shapes
            # (`_diagnose.py`): name the leaves and the way out.
            if jax.default_backend() != "tpu" or _diagnose.out_of_memory(e):
                raise
            mesh = Mesh(np.array(jax.devices()[:1]), ("chip",))
            raise self.rejected("`train_step`", str(e), mesh, model, opt_state) from e
        model, opt_state = (
            join(model_dynamic, statics.model),
            join(opt_dynamic, statics.opt_state),
        )
        if isinstance(opt_state, _update.PendingUpdate):  # (a static field)
            opt_state = _update.PendingUpdate(
                opt_state.inner, opt_state.grads, opt_state.held, True
            )
        return (
            (model, opt_state, value, norms)
            if self.config.metrics
            else (model, opt_state, value)
        )

    def rejected(
        self, what: str, message: str, mesh: Mesh, model: PyTree, opt_state: PyTree
    ) -> DoesNotCompile:
        """The error for a step the compiler for `mesh` rejected with `message`:
        the host-resident leaves it cannot stream, compiled alone, and a way out."""
        leaves = _update.streamed_leaves(self.config.optimizer, model, opt_state)
        policy = self.config.policy
        return DoesNotCompile(
            _diagnose.explain(
                what, message, leaves, mesh, policy.params, policy.opt_state
            )
        )

    def split(
        self, model: PyTree, opt_state: PyTree, *batch: Any
    ) -> tuple[tuple[list, list, list], _Statics]:
        """The arguments of `jitted` (and `fun`): the array leaves of the model, the
        optimizer state and the batch, and the static rest."""
        config = self.config
        model_dynamic, model_static = split(model)
        model_shardings = _mesh_shardings(model_dynamic)
        if config.policy.batch is not None:
            meshes = (s.mesh for s in model_shardings if s is not None)
            mesh = next(meshes, None)
            batch = place_batch(
                batch, config.policy.batch, mesh, "`train_step`", config.unsplit
            )
        if config.microbatches > 1:
            _microbatch.check(
                batch, config.microbatches, config.unsplit, "`train_step`"
            )
        opt_dynamic, opt_static = split(opt_state)
        batch_dynamic, batch_static = split(batch)
        statics = _Statics(
            model_static,
            opt_static,
            batch_static,
            model_shardings,
            _mesh_shardings(opt_dynamic),
        )
        return (model_dynamic, opt_dynamic, batch_dynamic), statics


def train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    policy: Policy,
    *,
    has_aux: bool = False,
    microbatches: int = 1,
    unsplit: Sequence[int] = (),
    metrics: bool = False,
) -> Callable[..., tuple]:
    """A jitted training step that applies `policy` to a model and its optimizer.

    `step(model, opt_state, *batch)` computes `loss_fn(model, *batch)` and its
    gradient through `filter_offload(loss_fn, policy)`, applies the optax update,
    and returns `(model, opt_state, loss)` (or `(model, opt_state, (loss, aux))`
    with `has_aux=True`). The model and optimizer state are donated, and every
    output leaf is returned in the memory kind the policy gives it, so the outputs
    feed the next call without retracing.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, *batch) -> loss`, or `-> (loss, aux)` with
        `has_aux=True`. Gradients are taken with respect to the floating-point
        arrays of `model`.
    - `optimizer`: an `optax.GradientTransformation` (or `optax.MultiSteps`).
    - `policy`: an `eqx_offload.Policy`.
    - `has_aux`: whether `loss_fn` returns `(loss, aux)`; `aux` must be a pytree of
        arrays.
    - `microbatches`: split the batch into this many micro-batches along the
        leading axis of every batch array, and accumulate their gradients inside
        the one compiled step (a `lax.scan`), each parameter's accumulator in the
        memory kind of its gradient. Micro-batch `i` holds examples `i, i + k,
        i + 2k, ...`. The loss and gradient are the mean over micro-batches, so
        they equal the whole batch's for a loss that is a mean over examples (a
        loss that sums over examples comes out divided by `k`), summed in
        float32. With `has_aux=True` the aux of every micro-batch comes back
        stacked (leading axis `k`). A batch whose leading axis does not split
        into `k` parts is a `ValueError`.
    - `unsplit`: positions (among the batch arguments, 0 for the first after the
        optimizer state) of arguments passed whole to every micro-batch: a PRNG
        key, a mask shared by all examples.
    - `metrics`: also return a dict of float32 scalars (on the device): the
        global L2 norms of the gradients (`"grad_norm"`, as the optimizer gets
        them: the mean over micro-batches, fp32 under a compute dtype), of the
        updates (`"update_norm"`) and of the new parameters (`"param_norm"`).
        Under the streamed update they are streamed reductions, computed a
        layer at a time like the update: no host-resident array is brought to
        the device whole.

    **Returns:**

    The step function: `step(model, opt_state, *batch)` returns `(model,
    opt_state, loss)`, or `(model, opt_state, loss, metrics)` with `metrics=True`
    (`loss` is `(loss, aux)` with `has_aux=True`). Inputs must already be where
    the policy says (use `eqx_offload.place` and `eqx_offload.init_opt_state`); a
    leaf found elsewhere is a `ValueError` naming it. The batch is passed by
    position, in `loss_fn`'s order. The step is jitted: inside another transform
    (`eqx.filter_jit(step)`, a scan over steps) it runs as part of that program,
    which then decides donation.

    !!! Example

        ```python
        policy = eo.Policy.offload_all()
        model = eo.place(model, policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(loss_fn, optimizer, policy)
        for tokens, targets in batches:
            model, opt_state, loss = step(model, opt_state, tokens, targets)
        ```
    """
    if not callable(loss_fn):
        raise TypeError(f"`train_step(loss_fn=...)` must be callable, got {loss_fn!r}.")
    optimizer = _update.as_transformation(optimizer, "`train_step(optimizer=...)`")
    check_policy(policy, "`train_step(policy=...)`")
    if metrics and policy.update_timing != "now":
        raise ValueError(
            "`train_step(metrics=True)` reports the norms of this step's update, "
            f"and `Policy(update_timing={policy.update_timing!r})` applies the "
            "stacked layers' update in the next step; drop `metrics=True`, or use "
            "`update_timing='now'`."
        )
    unsplit = _microbatch.check_unsplit(unsplit, microbatches, "`train_step`")
    config = _Config(
        loss_fn, optimizer, policy, has_aux, microbatches, unsplit, metrics
    )
    # The configuration is bound, not a static argument: `loss_fn` may be a
    # module holding arrays, which are not hashable.
    fun = functools.partial(_step, config)
    options = None
    if policy.host_remat:
        options = _compiler.host_remat_options(jax.default_backend())
    jitted = jax.jit(
        fun, static_argnums=(3,), donate_argnums=(0, 1), compiler_options=options
    )
    return _TrainStep(config, fun, jitted)
