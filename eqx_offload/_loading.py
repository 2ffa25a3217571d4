"""`load`: a step saved by `eqx_offload.save`, with every leaf where a policy puts it.

The step is checked against what the caller describes.
"""

import itertools
import os
import warnings
from typing import Any, NamedTuple, overload

import jax
import jax.tree_util as jtu
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, SingleDeviceSharding
from jaxtyping import PyTree

from . import _compat, _orbax, _pending, _update
from ._errors import see
from ._memory_kinds import abstract, is_key
from ._placement import place
from ._policy import check_policy, Policy
from ._saving import saved_steps, wait_for


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
    """Loads a step saved by `eqx_offload.save`, with every leaf where `policy` puts it.

    `like` describes the model and optimizer state to rebuild. It may be abstract
    (`jax.ShapeDtypeStruct` leaves, from `eqx.filter_eval_shape`). So resuming never
    allocates a model only to overwrite it. Concrete arrays work too: only their shapes,
    dtypes and shardings are used.

    Each model leaf is restored in the memory kind `eqx_offload.place(model, policy)`
    gives it. The optimizer state goes where `eqx_offload.init_opt_state` would put it
    (step counts on the device). Each leaf gets its sharding. Orbax stages the data in
    host memory on the way: a load peaks at about twice the state. Non-array leaves come
    from `like`. The result feeds `eqx_offload.train_step` as it is.

    **Arguments:**

    - `path`: the checkpoint directory given to `save`.
    - `like`: `(model, opt_state)`, of the same structure, shapes and dtypes as those
        saved. `opt_state` may be abstract, e.g. `eqx_offload.init_opt_state(optimizer,
        abstract_model, policy)`.
    - `policy`: the `eqx_offload.Policy` to place the leaves with. It need not be the
        one they were saved under.
    - `optimizer`: the optimizer the state belongs to. It tells the state's
        parameter-shaped leaves from its step counts, exactly as `init_opt_state` does.
        Without it, the parameter-shaped leaves are the subtrees of the state shaped
        like the model's trainable leaves. (Adam's `mu` and `nu`.) For optax's
        optimizers the result is the same.
    - `step`: the step to load; `None` (the default) loads the latest.
    - `extra`: a template of the `extra` given to `save`. Its leaves are arrays or
        `jax.ShapeDtypeStruct`s, and Python scalars of the right type. Its arrays are
        restored in the sharding and memory kind of the template's leaves. A leaf with
        none goes on the default device. PRNG keys go on the device.

    **Returns:**

    `(model, opt_state, step)` (a `Restored` named tuple). Given an `extra` template,
    `(model, opt_state, step, extra)` (a `RestoredWithExtra`).

    **Raises:**

    - `FileNotFoundError` if `path` holds no finished step, or not `step`. It names the
        steps it holds.
    - `ValueError` if what was saved does not match `like` or `extra`. It names the
        first leaf that differs.
    - `TypeError` for a `like` that is not a pair.

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
    directory = _orbax.directory(path, "`load(path=...)`")
    if optimizer is not None:
        optimizer = _update.as_transformation(optimizer, "`load(optimizer=...)`")
    check_policy(policy, "`load(policy=...)`")
    _check_arguments(like, step)
    step = _saved_step(directory, step)
    _orbax.check_global_load(like, extra)
    # The saved items to restore, abstract, each leaf placed as `policy` says.
    model = place(_pending.mark(abstract(like[0]), ()), policy)
    # A checkpoint holds no pending update (`save` refuses one): the state comes
    # back with none waiting, whatever `like`'s state says (a static field).
    state = _pending.structure(abstract(like[1]))
    where = "`eqx_offload.load`"
    opt_state = _update.place_state(optimizer, state, model, policy, where)
    extras = {} if extra is None else {"extra": abstract(extra)}
    targets = {"model": model, "opt_state": opt_state, **extras}
    model, opt_state, *rest = _restore(directory, step, targets)
    if extra is None:
        return Restored(model, opt_state, step)
    return RestoredWithExtra(model, opt_state, step, *rest)


def _check_arguments(like: Any, step: int | None) -> None:
    if not isinstance(like, tuple | list) or len(like) != 2:
        raise TypeError(
            "`load(like=...)` must be a pair `(model, opt_state)` (abstract is fine), "
            f"got {type(like).__name__}."
        )
    if step is not None and (isinstance(step, bool) or step < 0):
        raise ValueError(
            f"`load(step=...)` must be None (the latest) or an int >= 0, got {step!r}."
        )


def _saved_step(directory: str, step: int | None) -> int:
    """`step`, or the latest step saved in `directory`, after checking it is there."""
    wait_for(directory)
    available = saved_steps(directory)
    if not available:
        missing = "" if os.path.isdir(directory) else " (no such directory)"
        raise FileNotFoundError(
            f"`load`: no saved step in {directory!r}{missing}. Save one with "
            "`eqx_offload.save`." + see(55)
        )
    if step is None:
        return available[-1]
    if step not in available:
        raise FileNotFoundError(
            f"`load(step={step})`: no such step in {directory!r}; steps saved: "
            f"{', '.join(map(str, available))}." + see(56)
        )
    return step


def _restore(directory: str, step: int, targets: dict[str, PyTree]) -> list[PyTree]:
    """Each target, restored from the step after checking that the step matches it."""
    manager = _orbax.manager(directory, create=False)
    try:
        meta = manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )["meta"]
        if meta.get("format") != _orbax.FORMAT:
            raise ValueError(
                f"`load`: step {step} in {directory!r} was not written by this "
                "version of `eqx_offload.save`."
            )
        flats = {name: _orbax.flatten(target) for name, target in targets.items()}
        args = {}
        for name, flat in flats.items():
            wanted = _check_match(name, meta["leaves"][name], flat, step)
            if wanted:
                args[name] = ocp.args.StandardRestore(wanted)
        arrays = manager.restore(step, args=ocp.args.Composite(**args)) if args else {}
    finally:
        manager.close()
    return [_rebuild(n, t, flats[n], meta, arrays) for n, t in targets.items()]


def _rebuild(
    name: str, target: PyTree, flat: list[tuple[str, Any]], meta: dict, arrays: Any
) -> PyTree:
    """The restored item `name`, with `target`'s structure.

    Its abstract leaves are restored from `arrays`. `extra`'s scalars come from the
    step's description. The rest comes from `target`.
    """
    impls = {leaf_path: impl for leaf_path, _, _, impl in meta["leaves"][name]}
    values = meta["values"][name]

    def restored(leaf_path: str, x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return type(x)(values[leaf_path]) if name == "extra" else x
        data = _host_aval(arrays[name][_orbax.name(leaf_path)])
        impl = impls[leaf_path]
        return data if impl is None else jax.random.wrap_key_data(data, impl=impl)

    leaves = [restored(leaf_path, x) for leaf_path, x in flat]
    return jtu.tree_unflatten(jtu.tree_structure(target), leaves)


def _host_aval(x: jax.Array) -> jax.Array:
    """`x`, with the memory space of its type matching its sharding's memory kind.

    See `_compat.retype_in_host_memory`. Otherwise a `train_step` would take a restored
    `pinned_host` leaf for a device one. Should that stop working, a copy (one leaf at a
    time) does it.
    """
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


def _restore_target(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """What orbax restores a leaf into: its sharding and memory kind, or key data for a
    key.

    A one-device mesh, as abstract placements use, becomes a `SingleDeviceSharding`.
    That is what `place` gives a concrete array.
    """
    sharding = x.sharding
    if sharding is None:
        sharding = SingleDeviceSharding(jax.devices()[0])
    elif isinstance(sharding, NamedSharding) and len(sharding.device_set) == 1:
        (device,) = sharding.device_set
        sharding = SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
    if is_key(x):
        x = jax.eval_shape(jax.random.key_data, x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _check_match(
    name: str, saved: list, flat: list[tuple[str, Any]], step: int
) -> dict[str, jax.ShapeDtypeStruct]:
    """The restore targets of one saved item.

    It first checks, leaf by leaf, that what was saved is what `like` (or the `extra`
    template) describes: each leaf as `(path, "float32[2, 3]")`, or `"a Python int"`
    for a scalar of `extra`.
    """
    have = [(p, f"a Python {d}" if s is None else f"{d}{s}") for p, s, d, _ in saved]
    wanted, targets = [], {}
    for leaf_path, x in flat:
        if isinstance(x, jax.ShapeDtypeStruct):
            wanted.append((leaf_path, f"{x.dtype}{list(x.shape)}"))
            targets[_orbax.name(leaf_path)] = _restore_target(x)
        elif name == "extra":
            x = x.item() if isinstance(x, np.generic) else x
            wanted.append((leaf_path, f"a Python {type(x).__name__}"))
    if name == "extra" and not have and wanted:
        raise ValueError(
            f"`load(extra=...)`: step {step} was saved without `extra`. Leave "
            "`extra` out." + see(58)
        )
    argument = {"model": "like[0]", "opt_state": "like[1]"}.get(name, "extra")
    difference = _first_difference(have, wanted, argument)
    if difference is not None:
        raise ValueError(
            f"`load`: the {name} saved at step {step} does not match `{argument}` "
            f"({len(have)} leaves saved, {len(wanted)} given): {difference}. "
            + (_EXTRA_FIX if name == "extra" else _LIKE_FIX)
            + see(57)
        )
    return targets


_LIKE_FIX = (
    "Build `like` the way the saved model and optimizer were built (same "
    "configuration and optimizer), e.g. with `eqx.filter_eval_shape`."
)
_EXTRA_FIX = "Pass a template of the `extra` given to `save`."


def _first_difference(have: list, wanted: list, argument: str) -> str | None:
    """The first leaf, `(path, description)`, that differs between the checkpoint and
    `argument`."""
    for i, (a, b) in enumerate(itertools.zip_longest(have, wanted)):
        if a is None or b is None or a[0] != b[0]:
            saved, given = ("nothing" if x is None else repr(x[0]) for x in (a, b))
            return f"leaf {i} is {saved} in the checkpoint but {given} in `{argument}`"
        if a != b:
            return (
                f"leaf {a[0]!r} is {a[1]} in the checkpoint but {b[1]} in `{argument}`"
            )
    return None
