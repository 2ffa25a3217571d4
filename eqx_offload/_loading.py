"""`load`: a step saved by `eqx_offload.save`, checked against what the caller
describes, with every leaf where a policy puts it."""

import os
import warnings
from typing import Any, NamedTuple, overload

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, SingleDeviceSharding
from jaxtyping import PyTree

from . import _compat, _update
from ._placement import place
from ._policy import check_policy, Policy
from ._saving import (
    _check_global,
    _directory,
    _flatten,
    _FORMAT,
    _is_key,
    _manager,
    _name,
    _wait_for,
    saved_steps,
)


# The saved items `like` describes, in its order, and `extra`.
_ITEMS = ("model", "opt_state", "extra")


class Restored(NamedTuple):
    """What `eqx_offload.load` returns: `model, opt_state, step = load(...)`."""

    model: PyTree
    opt_state: PyTree
    step: int


class RestoredWithExtra(NamedTuple):
    """What `eqx_offload.load(..., extra=template)` returns: `model, opt_state,
    step, extra = load(...)`."""

    model: PyTree
    opt_state: PyTree
    step: int
    extra: PyTree


@overload
def load(
    path: str | os.PathLike,
    like: tuple[PyTree, PyTree],
    policy: Policy,
    *,
    optimizer: optax.GradientTransformation | optax.MultiSteps | None = None,
    step: int | None = None,
    extra: None = None,
) -> Restored: ...


@overload
def load(
    path: str | os.PathLike,
    like: tuple[PyTree, PyTree],
    policy: Policy,
    *,
    optimizer: optax.GradientTransformation | optax.MultiSteps | None = None,
    step: int | None = None,
    extra: PyTree,
) -> RestoredWithExtra: ...


def load(
    path: str | os.PathLike,
    like: tuple[PyTree, PyTree],
    policy: Policy,
    *,
    optimizer: optax.GradientTransformation | optax.MultiSteps | None = None,
    step: int | None = None,
    extra: PyTree = None,
) -> Restored | RestoredWithExtra:
    """Loads a step saved by `eqx_offload.save`, with every leaf where `policy`
    puts it.

    `like` describes the model and optimizer state to rebuild. It may be abstract
    (`jax.ShapeDtypeStruct` leaves, from `eqx.filter_eval_shape`), so that resuming
    never allocates a model only to overwrite it; concrete arrays work too (only
    their shapes, dtypes and shardings are used). Each model leaf is restored in
    the memory kind `eqx_offload.place(model, policy)` gives it, and the optimizer
    state where `eqx_offload.init_opt_state` would put it (step counts on the
    device), each with its sharding (orbax stages the data in host memory on the
    way: a load peaks at about twice the state).
    Non-array leaves come from `like`. The result feeds `eqx_offload.train_step`
    as it is.

    **Arguments:**

    - `path`: the checkpoint directory given to `save`.
    - `like`: `(model, opt_state)`, of the same structure, shapes and dtypes as
        those saved. `opt_state` may be abstract, e.g.
        `eqx_offload.init_opt_state(optimizer, abstract_model, policy)`.
    - `policy`: the `eqx_offload.Policy` to place the leaves with (it need not be
        the one they were saved under).
    - `optimizer`: the optimizer the state belongs to, to tell its
        parameter-shaped leaves from its step counts exactly as `init_opt_state`
        does. Without it, the parameter-shaped leaves are the subtrees of the
        state with the structure of the model's trainable leaves (Adam's `mu` and
        `nu`), which is the same for optax's optimizers.
    - `step`: the step to load; `None` (the default) loads the latest.
    - `extra`: a template of the `extra` given to `save` (arrays or
        `jax.ShapeDtypeStruct`s, Python scalars of the right type); its arrays are
        restored in the sharding and memory kind of the template's leaves (on the
        default device if it has none), PRNG keys on the device.

    **Returns:**

    `(model, opt_state, step)` (a `Restored` named tuple), or, given an `extra`
    template, `(model, opt_state, step, extra)` (a `RestoredWithExtra`).

    **Raises:**

    `FileNotFoundError` if `path` holds no finished step, or not `step` (naming
    the steps it holds); `ValueError` if what was saved does not match `like` or
    `extra` (naming the first leaf that differs); `TypeError` for a `like` that is
    not a pair.

    !!! Example

        ```python
        policy = eo.Policy.offload_all()
        optimizer = optax.adamw(3e-4)
        model = eqx.filter_eval_shape(Model, key=jax.random.key(0))
        opt_state = eo.init_opt_state(optimizer, model, policy)  # abstract too
        model, opt_state, step = eo.load("ckpt", (model, opt_state), policy)
        model, opt_state, step, extra = eo.load(  # with your own state
            "ckpt", (model, opt_state), policy,
            extra={"key": jax.random.key(0), "batch": 0},
        )
        ```
    """
    directory = _directory(path, "`load(path=...)`")
    if optimizer is not None:
        optimizer = _update.as_transformation(optimizer, "`load(optimizer=...)`")
    check_policy(policy, "`load(policy=...)`")
    if not isinstance(like, tuple | list) or len(like) != 2:
        raise TypeError(
            "`load(like=...)` must be a pair `(model, opt_state)` describing what to "
            f"restore (abstract is fine), got {type(like).__name__}."
        )
    if step is not None and (isinstance(step, bool) or step < 0):
        raise ValueError(
            f"`load(step=...)` must be None (the latest) or an int >= 0, got {step!r}."
        )
    _wait_for(directory)
    available = saved_steps(directory)
    if not available:
        raise FileNotFoundError(
            f"`load`: no saved step in {directory!r}"
            + ("" if os.path.isdir(directory) else " (no such directory)")
            + "; save one with `eqx_offload.save(path, model, opt_state, step=...)`."
        )
    if step is None:
        step = available[-1]
    elif step not in available:
        raise FileNotFoundError(
            f"`load(step={step})`: no such step in {directory!r}; steps saved: "
            f"{', '.join(map(str, available))}."
        )

    _check_global(like, extra, "load")
    model = place(_abstract(like[0]), policy)
    # A checkpoint holds no pending update (`save` refuses one): the state comes
    # back with none waiting, whatever `like`'s state says (a static field).
    opt_state = _update.place_state(
        optimizer,
        _update.structure(_abstract(like[1])),
        model,
        policy,
        "`eqx_offload.load`",
    )
    targets = {"model": model, "opt_state": opt_state}
    if extra is not None:
        targets["extra"] = _abstract(extra)

    manager = _manager(directory, create=False)
    try:
        meta = manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )["meta"]
        if meta.get("format") != _FORMAT:
            raise ValueError(
                f"`load`: step {step} in {directory!r} was not written by "
                "`eqx_offload.save` (or by a version with another layout)."
            )
        args, flats = {}, {}
        for name, target in targets.items():
            flats[name] = _flatten(target)
            abstract = _check_match(name, meta["leaves"][name], flats[name], step)
            if abstract:
                args[name] = ocp.args.StandardRestore(abstract)
        arrays = manager.restore(step, args=ocp.args.Composite(**args)) if args else {}
    finally:
        manager.close()

    out = {}
    for name, target in targets.items():
        saved = meta["leaves"][name]
        values = meta["values"][name]
        impls = {leaf_path: impl for leaf_path, _, _, impl in saved}
        restored = []
        for leaf_path, x in flats[name]:
            if isinstance(x, jax.ShapeDtypeStruct):
                data = _host_aval(arrays[name][_name(leaf_path)])
                impl = impls[leaf_path]
                restored.append(data if impl is None else _wrap_key(data, impl))
            elif name == "extra":
                restored.append(type(x)(values[leaf_path]))
            else:
                restored.append(x)
        out[name] = jtu.tree_unflatten(jtu.tree_structure(target), restored)
    if extra is None:
        return Restored(out["model"], out["opt_state"], step)
    return RestoredWithExtra(out["model"], out["opt_state"], step, out["extra"])


def _wrap_key(data: jax.Array, impl: str) -> jax.Array:
    return jax.random.wrap_key_data(data, impl=impl)


def _host_aval(x: jax.Array) -> jax.Array:
    """`x`, with the memory space of its type matching its sharding's memory kind
    (see `_compat.retype_in_host_memory`): a `train_step` would otherwise take a
    restored `pinned_host` leaf for a device one. Should that stop working, a copy
    (one leaf at a time) does it."""
    host = x.sharding.memory_kind in ("pinned_host", "unpinned_host")
    if not host or jax.typeof(x).memory_space == jax.memory.Space.Host:
        return x
    try:
        return _compat.retype_in_host_memory(x)
    except NotImplementedError as e:
        warnings.warn(
            "`eqx_offload.load`: this JAX version no longer lets a restored "
            f"host-resident array be rewrapped ({e}); each one is "
            "copied instead, which takes twice its host memory while it is.",
            RuntimeWarning,
            stacklevel=3,
        )
    return jax.device_put(x, x.sharding, may_alias=False)


def _abstract(tree: Any) -> Any:
    """`tree` with every array leaf a `jax.ShapeDtypeStruct` of its sharding."""

    def to_struct(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if eqx.is_array(x):
            sharding = x.sharding if isinstance(x, jax.Array) else None
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return x

    return jtu.tree_map(to_struct, tree)


def _restore_target(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """What orbax restores a leaf into: its sharding and memory kind (a one-device
    mesh, as abstract placements use, becomes the `SingleDeviceSharding` that
    `place` gives a concrete array); key data for a key."""
    sharding = x.sharding
    if sharding is None:
        sharding = SingleDeviceSharding(jax.devices()[0])
    elif isinstance(sharding, NamedSharding) and len(sharding.device_set) == 1:
        (device,) = sharding.device_set
        sharding = SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
    if _is_key(x):
        x = jax.eval_shape(jax.random.key_data, x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _check_match(
    name: str, saved: list, flat: list[tuple[str, Any]], step: int
) -> dict[str, jax.ShapeDtypeStruct]:
    """The restore targets of one saved item, after checking that what was saved is
    what `like` (or the `extra` template) describes, leaf by leaf."""
    argument = "extra" if name == "extra" else f"like[{_ITEMS.index(name)}]"
    fix = (
        "pass a template of the `extra` given to `save`"
        if name == "extra"
        else "build `like` the way the saved model and optimizer were built (same "
        "configuration and optimizer), e.g. with `eqx.filter_eval_shape`"
    )
    wanted = []
    for leaf_path, x in flat:
        if isinstance(x, jax.ShapeDtypeStruct):
            wanted.append([leaf_path, list(x.shape), str(x.dtype)])
        elif name == "extra":
            if isinstance(x, np.generic):
                x = x.item()
            wanted.append([leaf_path, None, type(x).__name__])
    have = [[p, shape, dtype] for p, shape, dtype, _ in saved]
    if name == "extra" and not have and wanted:
        raise ValueError(
            f"`load(extra=...)`: step {step} was saved without `extra`; leave "
            "`extra` out, or load a step saved with it."
        )
    for i in range(max(len(have), len(wanted))):
        a = have[i] if i < len(have) else None
        b = wanted[i] if i < len(wanted) else None
        if a == b:
            continue
        if a is None or b is None or a[0] != b[0]:
            saved_leaf = "nothing" if a is None else repr(a[0])
            like_leaf = "nothing" if b is None else repr(b[0])
            detail = (
                f"leaf {i} is {saved_leaf} in the checkpoint but {like_leaf} in "
                f"`{argument}`"
            )
        else:
            detail = (
                f"leaf {a[0]!r} is {_describe(a)} in the checkpoint but "
                f"{_describe(b)} in `{argument}`"
            )
        raise ValueError(
            f"`load`: the {name} saved at step {step} does not match `{argument}` "
            f"({len(have)} leaves saved, {len(wanted)} in `{argument}`): first "
            f"difference: {detail}; {fix}."
        )
    return {
        _name(leaf_path): _restore_target(x)
        for leaf_path, x in flat
        if isinstance(x, jax.ShapeDtypeStruct)
    }


def _describe(leaf: list) -> str:
    _, shape, dtype = leaf
    if shape is None:
        return f"a Python {dtype}"
    return f"{dtype}{shape}"
