"""Optimizer state: where it lives (`init_opt_state`) and how a step updates it."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
import optax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from jaxtyping import PyTree

from .. import _diagnose, _mesh, _mixed_precision, _paths, _scopes, _tiling
from .._errors import see
from .._memory_kinds import (
    backend_kinds,
    is_arraylike,
    is_host,
    kind_of,
    ParamsSpec,
    to_space,
)
from .._placement import move, resolve
from .._policy import check_policy, Policy
from . import _deferred, _host, _metrics, _streaming
from ._state_kinds import state_leaf_kinds
from ._state_tree import check_matches, state_leaves, state_owners, StateLeaf


# What `init_opt_state` and `train_step` accept. `optax.MultiSteps` is a class of its
# own, not a `GradientTransformation`; it is used through the one it wraps itself in.
def as_transformation(optimizer: Any, where: str) -> optax.GradientTransformation:
    """The `GradientTransformation` an optimizer argument stands for, or a
    `TypeError` naming the argument and the fix."""
    if isinstance(optimizer, optax.MultiSteps):
        return optimizer.gradient_transformation()
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    hint = ""
    name = getattr(optimizer, "__name__", None)
    if callable(optimizer) and name is not None:
        module = getattr(optimizer, "__module__", "") or ""
        prefix = "optax." if module.startswith("optax") else ""
        hint = (
            f" `{prefix}{name}` builds an optimizer: call it, e.g. "
            f"`{prefix}{name}(learning_rate=3e-4)`."
        )
    raise TypeError(
        f"{where} must be an `optax.GradientTransformation` (or `optax.MultiSteps`), "
        f"got {type(optimizer).__name__} {optimizer!r}.{hint}" + see(39)
    )


def is_trainable(x: Any) -> bool:
    """Floating-point arrays (or their `jax.ShapeDtypeStruct`s): what gets gradients."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
    return eqx.is_inexact_array(x)


def trainable(model: PyTree) -> PyTree:
    """The parameters an optimizer sees: `model` with non-trainable leaves `None`."""
    return eqx.filter(model, is_trainable)


def with_params(model: PyTree, params: PyTree) -> PyTree:
    """`model` with its trainable leaves replaced by those of `params`."""
    return eqx.combine(params, eqx.filter(model, is_trainable, inverse=True))


def param_kinds(
    params: PyTree, model_kinds: list[tuple[_paths.Leaf, str]]
) -> list[str]:
    """The memory kind of each array leaf of `params` (the trainable part of the
    model), from the kinds of the model's leaves (`check_model`)."""
    kind_by_path = {leaf.path: kind for leaf, kind in model_kinds}
    return [
        kind_by_path[leaf.path]
        for leaf in _paths.leaves(params)
        if is_arraylike(leaf.value)
    ]


def state_kinds(
    optimizer: optax.GradientTransformation | None,
    opt_state: PyTree,
    params: PyTree,
    spec: ParamsSpec,
    where: str = "`train_step`",
) -> list[tuple[_paths.Leaf, str]]:
    """Each array leaf of `opt_state` with its memory kind: the one `spec` gives
    its parameter (and part of the state, `"nu:**"`) for the parameter-shaped
    state (moments, momenta, ...), `"device"` for the rest (step counts and other
    scalars), in `jax.tree.leaves` order."""
    return [
        (s.leaf, kind) for s, kind in _kinds(optimizer, opt_state, params, spec, where)
    ]


def _kinds(
    optimizer: optax.GradientTransformation | None,
    opt_state: PyTree,
    params: PyTree,
    spec: ParamsSpec,
    where: str,
) -> list[tuple[StateLeaf, str]]:
    leaves = state_leaves(optimizer, opt_state, params)
    kinds = state_leaf_kinds(spec, leaves, _paths.leaves(params), where)
    available = backend_kinds()
    for s, kind in zip(leaves, kinds):
        if kind not in available:
            raise ValueError(  # parameter-shaped state: the rest is on the device
                f"{where}: the optimizer state of {s.owner_path!r} "
                f"({s.leaf.path!r}) is to live in {kind!r} (`Policy(opt_state=...)`), "
                f"which the {jax.default_backend()!r} backend lacks; valid kinds here: "
                f"{_paths.quoted(available)}." + see(19)
            )
    return list(zip(leaves, kinds))


def _state_device_sharding(params: PyTree) -> Any:
    """Where non-parameter state (step counts) goes: replicated over the
    parameters' devices, on the device."""
    for p in jtu.tree_leaves(params):
        sharding = getattr(p, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
        if isinstance(sharding, SingleDeviceSharding):
            return sharding.with_memory_kind("device")
    return SingleDeviceSharding(jax.devices()[0])


def stepping(
    optimizer: optax.GradientTransformation, params: PyTree, policy: Policy
) -> optax.GradientTransformation:
    """The optimizer a step runs for `policy`: wrapped to keep compute copies
    (`Policy(compute_dtype=...)`) and to hold the stacked layers' update over to
    the next step (`Policy(update_timing=...)`) where the policy asks."""
    optimizer = _mixed_precision.for_policy(optimizer, params, policy)
    if policy.update_timing != "now":
        optimizer = _deferred.with_pending(optimizer)
    return optimizer


def init_opt_state(
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    model: PyTree,
    policy: Policy,
) -> PyTree:
    """Initialises `optimizer` for `model`'s trainable leaves, placed by `policy`.

    The parameter-shaped state (Adam's moments, momentum, ...) goes to
    `policy.opt_state`, with each parameter's sharding. The rest (step counts) stays
    on the device, replicated over the parameters' devices. An abstract model gives
    an abstract state and allocates nothing. Its leaves are `jax.ShapeDtypeStruct`s,
    e.g. from `eqx.filter_eval_shape`. `optax.masked` and `optax.multi_transform`
    states are supported.

    **Arguments:**

    - `optimizer`: an `optax.GradientTransformation` (or `optax.MultiSteps`).
    - `model`: the model, usually already placed with `eqx_offload.place`. The
        optimizer sees `eqx.filter(model, eqx.is_inexact_array)`.
    - `policy`: an `eqx_offload.Policy`.

    **Returns:**

    The optimizer state, ready for `eqx_offload.train_step`.

    !!! Example

        ```python
        opt_state = eo.init_opt_state(optax.adamw(3e-4), model, policy)
        ```
    """
    optimizer = as_transformation(optimizer, "`init_opt_state(optimizer=...)`")
    check_policy(policy, "`init_opt_state(policy=...)`")
    params = trainable(model)
    _mixed_precision.check_keep_dtype(params, policy, "`init_opt_state`")
    optimizer = stepping(optimizer, params, policy)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jtu.tree_leaves(params)):
        state = jax.eval_shape(optimizer.init, params)
    else:
        # Eager ops on host-resident arrays fail ("Memory kind mismatch"); jitted
        # ones work, and return the state on the default device.
        _mesh.check_devices({"model": params}, "`init_opt_state`")
        with _mesh.context(params, explicit_only=True):
            state = jax.jit(optimizer.init)(params)
    return _place_state(
        optimizer, state, params, policy, "`eqx_offload.init_opt_state`"
    )


def place_opt_state(
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    opt_state: PyTree,
    model: PyTree,
    policy: Policy,
) -> PyTree:
    """Moves an existing optimizer state to where `init_opt_state` puts it.

    Its values are kept. Use it for a state restored or built by hand, or made for
    another policy. `eqx_offload.place(opt_state, policy)` is not the same. It does
    not know which leaves are step counts, which stay on the device. It would move
    them to the host with the rest. A fresh `init_opt_state` would restart the
    optimizer, with Adam's moments at zero.

    The parameter-shaped state (Adam's moments, momentum, ...) goes to
    `policy.opt_state`, with each parameter's sharding. The rest (step counts) goes
    to the device, replicated over the parameters' devices. Leaves already in place
    are not copied. Abstract leaves (`jax.ShapeDtypeStruct`s) get the memory kind
    and sharding in their `sharding`. Nothing is allocated for them.

    **Arguments:**

    - `optimizer`: the `optax.GradientTransformation` (or `optax.MultiSteps`) the
        state belongs to.
    - `opt_state`: its state, with the structure of `optimizer.init(params)`.
    - `model`: the model, placed where `policy` puts it (or abstract).
    - `policy`: an `eqx_offload.Policy`.

    **Returns:**

    The optimizer state with every array leaf in its memory kind and sharding,
    ready for `eqx_offload.train_step`.

    !!! Example

        ```python
        policy = eo.Policy.offload_all()
        model = eo.place(model, policy)
        opt_state = eo.place_opt_state(optimizer, opt_state, model, policy)
        ```
    """
    optimizer = as_transformation(optimizer, "`place_opt_state(optimizer=...)`")
    check_policy(policy, "`place_opt_state(policy=...)`")
    optimizer = stepping(optimizer, trainable(model), policy)
    check_matches(
        optimizer, _deferred.structure(opt_state), trainable(model), "`place_opt_state`"
    )
    return _place_state(
        optimizer,
        opt_state,
        trainable(model),
        policy,
        "`eqx_offload.place_opt_state`",
    )


def place_state(
    optimizer: optax.GradientTransformation | None,
    opt_state: PyTree,
    model: PyTree,
    policy: Policy,
    where: str,
) -> PyTree:
    """`place_opt_state` without its checks, for `load` (which checks what it
    restores against the checkpoint). Without an optimizer, the parameter-shaped
    state is the subtrees of `opt_state` with the structure of the model's
    trainable leaves."""
    if optimizer is not None:
        optimizer = stepping(optimizer, trainable(model), policy)
    return _place_state(optimizer, opt_state, trainable(model), policy, where)


def _place_state(
    optimizer: optax.GradientTransformation | None,
    state: PyTree,
    params: PyTree,
    policy: Policy,
    where: str,
) -> PyTree:
    """Every array leaf of `state` in the kind and sharding `init_opt_state` gives."""
    device = _state_device_sharding(params)
    leaves = jtu.tree_leaves(params)
    shardings = [getattr(p, "sharding", None) for p in leaves]
    shapes = [tuple(p.shape) for p in leaves]
    flat, treedef = jtu.tree_flatten(state)
    placed = iter(
        move(s.leaf.value, kind, "", _sharding(s, shardings, shapes, device))
        for s, kind in _kinds(optimizer, state, params, policy.opt_state, where)
    )
    return jtu.tree_unflatten(
        treedef, [next(placed) if is_arraylike(x) else x for x in flat]
    )


def _sharding(
    s: StateLeaf, shardings: list[Any], shapes: list[tuple[int, ...]], device: Any
) -> Any:
    """Parameter-shaped state takes its parameter's sharding; the rest (and a
    factored moment, of another shape) the device's."""
    if s.owner is None or shardings[s.owner] is None:
        return device
    if tuple(s.leaf.value.shape) != shapes[s.owner]:
        return device
    return shardings[s.owner]


def check_model(
    model: PyTree, policy: Policy, where: str
) -> list[tuple[_paths.Leaf, str]]:
    """Each leaf of `model` with the memory kind the policy gives it; raises if a
    leaf is elsewhere."""
    kinds = resolve(model, policy.params, where)
    for leaf, kind in kinds:
        if kind == "unpinned_host":
            to_space(leaf.value, kind, leaf.path)  # raises: jit can't keep it there
        if kind_of(leaf.value) != kind:
            raise ValueError(
                f"{where}: model leaf {leaf.path!r} is in {kind_of(leaf.value)!r} "
                f"but should live in {kind!r}; place the model first with "
                "`eqx_offload.place(model, policy)`."
                + see(_NOT_PLACED_ENTRIES.get(where, 40))
            )
    return kinds


def check_state(
    optimizer: optax.GradientTransformation,
    opt_state: PyTree,
    model: PyTree,
    policy: Policy,
    where: str = "`train_step`",
) -> list[tuple[_paths.Leaf, str]]:
    """The kinds `opt_state` should be in; raises if a leaf is elsewhere."""
    kinds = state_kinds(optimizer, opt_state, trainable(model), policy.opt_state, where)
    for leaf, kind in kinds:
        if kind == "unpinned_host":
            to_space(leaf.value, kind, f"opt_state.{leaf.path}")  # raises
        if kind_of(leaf.value) != kind:
            raise ValueError(
                f"{where}: optimizer state leaf {leaf.path!r} is in "
                f"{kind_of(leaf.value)!r} but the policy puts it in {kind!r}. "
                + _MISPLACED_STATE_HELP
                + see(41)
            )
    return kinds


# The catalogue's entry for a model not placed, by caller (`docs/errors.md`).
_NOT_PLACED_ENTRIES = {"`optimizer_update`": 94}
_MISPLACED_STATE_HELP = (
    "Move a trained state there with `eqx_offload.place_opt_state(optimizer, "
    "opt_state, model, policy)`; make a new one with "
    "`eqx_offload.init_opt_state(optimizer, model, policy)`, not `optimizer.init`."
)


class UpdateArgs(NamedTuple):
    """The arguments of one optimizer update.

    `model_kinds` and `opt_kinds` are the memory kinds of the leaves, from
    `check_model` and `check_state`. `metrics` asks for the global norms."""

    optimizer: optax.GradientTransformation
    grads: PyTree
    opt_state: PyTree
    model: PyTree
    policy: Policy
    model_kinds: list[tuple[_paths.Leaf, str]]
    opt_kinds: list[tuple[_paths.Leaf, str]]
    metrics: bool = False


def update(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    opt_state: PyTree,
    model: PyTree,
    policy: Policy,
    model_kinds: list[tuple[_paths.Leaf, str]],
    opt_kinds: list[tuple[_paths.Leaf, str]],
    metrics: bool = False,
) -> tuple[PyTree, PyTree, dict[str, Any] | None]:
    """One optimizer update: the new model and state, in their memory kinds.

    With `metrics`, also the global norms of the gradients, the updates and the
    new parameters (`_metrics.norms`); else None. `policy.update` chooses how
    (`_UPDATES`): whole on the device, streamed (`_streaming.py`) or on the host
    (`_host.py`). `"auto"` chooses by platform when anything is on the host."""
    args = UpdateArgs(
        optimizer, grads, opt_state, model, policy, model_kinds, opt_kinds, metrics
    )
    if policy.update == "auto" and _any_on_host(args):
        return _by_platform(args)
    return _UPDATES.get(policy.update, _whole_update)(args)


def _any_on_host(args: UpdateArgs) -> bool:
    """Whether any gradient, state leaf or trainable parameter is on the host."""
    trees = (args.grads, args.opt_state, trainable(args.model))
    return any(is_host(x) for x in jtu.tree_leaves(trees) if eqx.is_array(x))


def _new_kinds(args: UpdateArgs) -> tuple[list[str], list[str]]:
    """The memory kinds of the new parameters and of the new state leaves."""
    params = trainable(args.model)
    return param_kinds(params, args.model_kinds), [k for _, k in args.opt_kinds]


def _host_update(args: UpdateArgs) -> tuple[PyTree, PyTree, dict[str, Any] | None]:
    """`Policy(update="host")`: the update on the host's CPU (`_host.py`)."""
    _check_host_state(args.opt_kinds)
    params = trainable(args.model)
    try:
        new_params, opt_state, norms = _host.update(
            args.optimizer,
            args.grads,
            args.opt_state,
            params,
            _new_kinds(args),
            args.metrics,
        )
    except _host.NotOnHost as e:
        raise ValueError(
            f"`Policy(update='host')`: the optimizer's update cannot run on the "
            f"host's CPU: {e}. Use `Policy(update='streamed')` (or `'auto'`), or "
            "change that part of the optimizer." + see(130)
        ) from e
    return with_params(args.model, new_params), opt_state, norms


def _streamed_update(args: UpdateArgs) -> tuple[PyTree, PyTree, dict[str, Any] | None]:
    """`Policy(update="streamed")`: one layer or row block of each host-resident
    leaf on the device at a time (`_streaming.py`); whole with nothing on the
    host."""
    if not _any_on_host(args):
        return _whole_update(args)
    params = trainable(args.model)
    leaves = _paths.leaves(params)
    layers = [
        leaf.value.shape[0] if leaf.stacked is not None else None for leaf in leaves
    ]
    try:
        new_params, opt_state, norms = _streaming.update(
            args.optimizer,
            args.grads,
            args.opt_state,
            params,
            layers,
            _new_kinds(args),
            [leaf.path for leaf in leaves],
            args.metrics,
        )
    except _streaming.NotStreamable as e:
        raise ValueError(
            "`train_step`: this optimizer's update cannot be streamed piece by "
            f"piece unchanged: {e}. Use `Policy(update='whole')` or "
            "`Policy(opt_state='device')`." + see(45)
        ) from e
    return with_params(args.model, new_params), opt_state, norms


def _whole_update(args: UpdateArgs) -> tuple[PyTree, PyTree, dict[str, Any] | None]:
    """`Policy(update="whole")`: gradients, state and parameters brought to the
    device and updated there all at once."""

    def to_device(tree: PyTree) -> PyTree:
        return jtu.tree_map(
            lambda x: to_space(x, "device", "") if eqx.is_array(x) else x, tree
        )

    model = to_device(args.model)
    with jax.named_scope(_scopes.GRAD):  # named for `memory_report`'s traffic
        grads = to_device(args.grads)
    # A gradient sent in the compute dtype (`_microbatch`), cast on the device.
    grads = jtu.tree_map(
        lambda g, p: (
            g.astype(p.dtype)
            if g is not None and g.dtype.itemsize < p.dtype.itemsize
            else g
        ),
        grads,
        trainable(model),
        is_leaf=lambda x: x is None,
    )
    updates, opt_state = args.optimizer.update(
        grads, to_device(args.opt_state), trainable(model)
    )
    model = eqx.apply_updates(model, updates)
    norms = _metrics.norms(grads, updates, trainable(model)) if args.metrics else None
    return model, opt_state, norms


_UPDATES = {
    "whole": _whole_update,
    "streamed": _streamed_update,
    "host": _host_update,
}


def _check_host_state(opt_kinds: list[tuple[_paths.Leaf, str]]) -> None:
    """`Policy(update="host")` needs optimizer state on the host to update there."""
    if not any(kind == "pinned_host" for _, kind in opt_kinds):
        raise ValueError(
            "`Policy(update='host')`: the policy keeps no optimizer state on the "
            "host. Put it there with `Policy(opt_state='pinned_host')`, or use "
            "`Policy(update='auto')`." + see(129)
        )


def _by_platform(args: UpdateArgs) -> tuple[PyTree, PyTree, dict[str, Any] | None]:
    """`Policy(update="auto")` with leaves on the host.

    The update is whole on the backends of `_tiling.WHOLE_ON`, streamed on the
    others. The choice is made inside the traced program
    (`jax.lax.platform_dependent`): a step traced here and compiled for a TPU
    streams. Both give every leaf back in its memory kind."""
    kinds = [kind for _, kind in args.model_kinds + args.opt_kinds]
    leaves = jtu.tree_leaves((args.model, args.opt_state))
    found = iter(kinds)
    targets = [next(found) if is_arraylike(x) else None for x in leaves]
    # Only arrays pass through `platform_dependent`; the rest is closed over.
    trees = (args.grads, args.opt_state, args.model)
    arrays, static = eqx.partition(trees, is_arraylike)

    def branch(how: Callable[[UpdateArgs], tuple]) -> Callable[[PyTree], PyTree]:
        def run(arrays: PyTree) -> PyTree:
            grads, opt_state, model = eqx.combine(arrays, static)
            new_model, new_state, norms = how(
                args._replace(grads=grads, opt_state=opt_state, model=model)
            )
            leaves, treedef = jtu.tree_flatten((new_model, new_state))
            n_model = len(jtu.tree_leaves(new_model))
            leaves = [
                _back(x, kind, i < n_model)
                for i, (x, kind) in enumerate(zip(leaves, targets, strict=True))
            ]
            new = eqx.filter(jtu.tree_unflatten(treedef, leaves), is_arraylike)
            return new, norms

        return run

    whole = {platform: branch(_whole_update) for platform in _tiling.WHOLE_ON}
    streamed = branch(_streamed_update)
    new, norms = jax.lax.platform_dependent(arrays, **whole, default=streamed)
    rest = eqx.filter((args.model, args.opt_state), is_arraylike, inverse=True)
    new_model, new_state = eqx.combine(new, rest)
    return new_model, new_state, norms


def _back(x: Any, kind: str | None, param: bool) -> Any:
    """A new leaf in its memory kind (None: not an array, as it is)."""
    if kind is None:
        return x
    with jax.named_scope(_scopes.PARAMS if param else _scopes.OPT_STATE):
        return to_space(x, kind, "")


def streamed_leaves(
    optimizer: optax.GradientTransformation, model: PyTree, opt_state: PyTree
) -> list[_diagnose.Streamed]:
    """The host-resident parameters and optimizer state a train step slices: the
    layers of a `Stacked` (in the forward pass and the update), the row blocks of a
    large leaf (in the update)."""
    params = trainable(model)
    leaves = _paths.leaves(params)
    out = []
    rows: list[int | None] = []  # rows per piece in the update, None: whole
    for i, leaf in enumerate(leaves):
        x = leaf.value
        layers = x.shape[0] if leaf.stacked is not None else None
        cut = _streaming.pieces(x, layers, i)
        rows.append(None if cut is None else cut[2])
        sliced = layers is not None and _tiling.slices_by_layer(x.shape)
        n = 1 if sliced else rows[-1]
        if kind_of(x) == "pinned_host" and n is not None:
            out.append(
                _diagnose.Streamed(leaf.path, tuple(x.shape), x.dtype, n, sliced)
            )
    states = [s for s in jtu.tree_leaves(opt_state) if is_arraylike(s)]
    owners = state_owners(optimizer, opt_state, params)
    for s, owner in zip(states, owners):
        n = None if owner is None else rows[owner]
        if owner is not None and n is not None and kind_of(s) == "pinned_host":
            path = leaves[owner].path
            out.append(_diagnose.Streamed(path, tuple(s.shape), s.dtype, n, False))
    return list(dict.fromkeys(out))
