"""Optimizer state: where it lives (`init_opt_state`) and how a step updates it."""

from typing import Any

import jax
import jax.tree_util as jtu
import optax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from jaxtyping import PyTree

from .. import _mesh, _mixed_precision, _paths, _pending, _tiling
from .._diagnose import Streamed
from .._errors import see
from .._memory_kinds import backend_kinds, is_arraylike, kind_of, ParamsSpec, to_space
from .._placement import move, resolve
from .._policy import check_policy, Policy
from . import _deferred, _streaming
from ._dispatch import trainable
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


def _kinds(
    optimizer: optax.GradientTransformation | None,
    opt_state: PyTree,
    params: PyTree,
    spec: ParamsSpec,
    where: str,
) -> list[tuple[StateLeaf, str]]:
    """Each array leaf of `opt_state` with its memory kind: the one `spec` gives
    its parameter (and part of the state, `"nu:**"`) for the parameter-shaped
    state (moments, momenta, ...), `"device"` for the rest (step counts and other
    scalars), in `jax.tree.leaves` order."""
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
    init = stepping(optimizer, params, policy).init
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jtu.tree_leaves(params)):
        state = jax.eval_shape(init, params)
    else:
        # Eager ops on host-resident arrays fail ("Memory kind mismatch"); jitted
        # ones work, and return the state on the default device.
        _mesh.check_devices({"model": params}, "`init_opt_state`")
        with _mesh.context(params, explicit_only=True):
            state = jax.jit(init)(params)
    return place_state(optimizer, state, model, policy, "`eqx_offload.init_opt_state`")


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
    params = trainable(model)
    full = stepping(optimizer, params, policy)
    check_matches(full, _pending.structure(opt_state), params, "`place_opt_state`")
    return place_state(
        optimizer, opt_state, model, policy, "`eqx_offload.place_opt_state`"
    )


def place_state(
    optimizer: optax.GradientTransformation | None,
    opt_state: PyTree,
    model: PyTree,
    policy: Policy,
    where: str,
) -> PyTree:
    """Every array leaf of `opt_state` in the kind and sharding `init_opt_state`
    gives: `place_opt_state` without its checks, for `load` (which checks what it
    restores against the checkpoint). Without an optimizer, the parameter-shaped
    state is the subtrees of `opt_state` with the structure of the model's
    trainable leaves."""
    params = trainable(model)
    if optimizer is not None:
        optimizer = stepping(optimizer, params, policy)
    device = _state_device_sharding(params)
    leaves = jtu.tree_leaves(params)

    def sharding(s: StateLeaf) -> Any:
        """Parameter-shaped state takes its parameter's sharding; the rest (and a
        factored moment, of another shape) the device's."""
        p = None if s.owner is None else leaves[s.owner]
        if p is None or getattr(p, "sharding", None) is None:
            return device
        return p.sharding if tuple(s.leaf.value.shape) == tuple(p.shape) else device

    placed = iter(
        move(s.leaf.value, kind, "", sharding(s))
        for s, kind in _kinds(optimizer, opt_state, params, policy.opt_state, where)
    )
    return jtu.tree_map(lambda x: next(placed) if is_arraylike(x) else x, opt_state)


def check_step(
    optimizer: optax.GradientTransformation,
    opt_state: PyTree,
    model: PyTree,
    policy: Policy,
    where: str,
) -> tuple[optax.GradientTransformation, tuple[list, list]]:
    """A step's checks of its model and optimizer state: raises if a leaf is not
    where `policy` puts it, or if `opt_state` is not one of `optimizer` for `model`.

    **Returns:** `optimizer` wrapped for the policy (`Policy(compute_dtype=...)`),
    and each leaf of `model` and each array leaf of `opt_state` with the memory
    kind the policy gives it."""
    model_fix = (
        "should live in {kind!r}; place the model first with "
        "`eqx_offload.place(model, policy)`."
    )
    model_kinds = _check_placed(
        resolve(model, policy.params, where),
        f"{where}: model leaf",
        "",
        model_fix,
        see(94 if where == "`optimizer_update`" else 40),
    )
    params = trainable(model)
    wrapped = _mixed_precision.for_policy(optimizer, params, policy)
    own = _deferred.own_state(opt_state)
    _mixed_precision.check_state(wrapped is not optimizer, own, where)
    full = stepping(optimizer, params, policy)
    check_matches(full, _pending.structure(opt_state), params, where)
    found = _kinds(full, opt_state, params, policy.opt_state, where)
    fix = (
        "the policy puts it in {kind!r}. Move a trained state there with "
        "`eqx_offload.place_opt_state(optimizer, opt_state, model, policy)`; make a "
        "new one with `eqx_offload.init_opt_state(optimizer, model, policy)`, not "
        "`optimizer.init`."
    )
    kinds = [(s.leaf, kind) for s, kind in found]
    what = f"{where}: optimizer state leaf"
    opt_kinds = _check_placed(kinds, what, "opt_state.", fix, see(41))
    return wrapped, (model_kinds, opt_kinds)


def _check_placed(
    kinds: list[tuple[_paths.Leaf, str]], what: str, prefix: str, fix: str, link: str
) -> list[tuple[_paths.Leaf, str]]:
    """`kinds`, checked: raises `what` (the caller, the tree) `fix` (formatted with
    the kind) and `link` for a leaf found elsewhere. `prefix` begins a leaf's
    path."""
    for leaf, kind in kinds:
        if kind == "unpinned_host":
            to_space(leaf.value, kind, prefix + leaf.path)  # raises: jit can't keep it
        if kind_of(leaf.value) != kind:
            raise ValueError(
                f"{what} {leaf.path!r} is in {kind_of(leaf.value)!r} but "
                + fix.format(kind=kind)
                + link
            )
    return kinds


def streamed_leaves(
    optimizer: optax.GradientTransformation, model: PyTree, opt_state: PyTree
) -> list[Streamed]:
    """The host-resident parameters and optimizer state a train step slices: the
    layers of a `Stacked` (in the forward pass and the update), the row blocks of a
    large leaf (in the update)."""
    params = trainable(model)
    leaves = _paths.leaves(params)
    out = []
    rows: list[int | None] = []  # rows per piece in the update, None: whole
    for i, (leaf, layers) in enumerate(zip(leaves, _streaming.layout(params)[0])):
        x = leaf.value
        cut = _streaming.pieces(x, layers, i)
        rows.append(None if cut is None else cut[2])
        sliced = layers is not None and _tiling.slices_by_layer(x.shape)
        n = 1 if sliced else rows[-1]
        if kind_of(x) == "pinned_host" and n is not None:
            out.append(Streamed(leaf.path, tuple(x.shape), x.dtype, n, sliced))
    states = [s for s in jtu.tree_leaves(opt_state) if is_arraylike(s)]
    for s, owner in zip(states, state_owners(optimizer, opt_state, params)):
        n = None if owner is None else rows[owner]
        if owner is not None and n is not None and kind_of(s) == "pinned_host":
            out.append(Streamed(leaves[owner].path, tuple(s.shape), s.dtype, n, False))
    return list(dict.fromkeys(out))
