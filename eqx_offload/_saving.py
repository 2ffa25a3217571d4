"""Checkpoints: `save` a model, its optimizer state and your own state to a
directory of numbered steps, and `load` them back where a policy puts them."""

import atexit
import os
import threading
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

from . import _paths, _update
from ._placement import place
from ._policy import check_policy, Policy


# Bumped if the layout of a step's directory changes.
_FORMAT = 1
_ITEMS = ("model", "opt_state", "extra")
# JSON-able leaves of `extra` (a data position, an epoch); saved by value.
_SCALARS = (bool, int, float, str)


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


class Saving:
    """A save in progress, returned by `eqx_offload.save`; `wait()` for it to finish.

    A save with `wait=True` has finished when it is returned. One with `wait=False`
    finishes in a background thread; its step is loadable (and listed by
    `saved_steps`) once it has. A later `save` or `load` of the same directory, and
    `eqx_offload.wait_until_finished()`, wait for it first, as does the end of the
    Python process.
    """

    def __init__(self, manager: ocp.CheckpointManager, directory: str, step: int):
        self.directory = directory
        self.step = step
        self._manager: ocp.CheckpointManager | None = manager
        self._lock = threading.Lock()
        self._finished = threading.Event()

    def done(self) -> bool:
        """Whether the step has been written and committed."""
        with self._lock:
            manager = self._manager
        if manager is None:
            return self._finished.is_set()
        return not manager.is_saving_in_progress()

    def wait(self) -> None:
        """Blocks until the step has been written and committed."""
        with self._lock:
            manager, self._manager = self._manager, None
        if manager is not None:  # this thread finishes the save; others wait below
            try:
                manager.wait_until_finished()
            finally:
                manager.close()
                if _pending.get(self.directory) is self:
                    del _pending[self.directory]
                self._finished.set()
        self._finished.wait()

    def __repr__(self) -> str:
        state = "done" if self.done() else "in progress"
        return f"Saving(step={self.step}, directory={self.directory!r}, {state})"


# The asynchronous save in progress for each directory.
_pending: dict[str, Saving] = {}


def wait_until_finished() -> None:
    """Blocks until every asynchronous `eqx_offload.save` has finished.

    **Returns:**

    Nothing.

    !!! Example

        ```python
        eo.save("ckpt", model, opt_state, step=i, wait=False)
        ...
        eo.wait_until_finished()  # e.g. before copying the directory elsewhere
        ```
    """
    for saving in list(_pending.values()):
        saving.wait()


atexit.register(wait_until_finished)


def saved_steps(path: str | os.PathLike) -> list[int]:
    """The steps saved (and committed) in a checkpoint directory, oldest first.

    **Arguments:**

    - `path`: the directory given to `eqx_offload.save`.

    **Returns:**

    A list of step numbers; empty if the directory does not exist or holds no
    finished step (an interrupted save leaves none).

    !!! Example

        ```python
        if eo.saved_steps("ckpt"):
            model, opt_state, step, _ = eo.load("ckpt", like, policy, optimizer=opt)
        ```
    """
    directory = _directory(path, "`saved_steps(path=...)`")
    _wait_for(directory)
    if not os.path.isdir(directory):
        return []
    manager = _manager(directory, create=False)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


def save(
    path: str | os.PathLike,
    model: PyTree,
    opt_state: PyTree,
    *,
    step: int,
    extra: PyTree = None,
    keep: int | None = None,
    wait: bool = True,
) -> Saving:
    """Saves a model, its optimizer state and your own state as step `step` of the
    checkpoint directory `path`.

    Each step is a subdirectory, written under a temporary name and renamed when
    complete: a process killed in the middle of a save leaves the steps saved
    before it loadable. The array leaves are saved (with `orbax-checkpoint`);
    everything else in `model` and `opt_state` (static fields, activation
    functions) comes from the `like` given to `eqx_offload.load`. PRNG key arrays
    are saved as their key data and rewrapped on load.

    **Arguments:**

    - `path`: the checkpoint directory; created if missing.
    - `model`: the model, wherever its leaves live.
    - `opt_state`: its optimizer state.
    - `step`: the step number (an `int` >= 0), usually the number of steps trained;
        it must not be saved already.
    - `extra`: your own state, a pytree of arrays (a PRNG key, metrics) and Python
        scalars (`int`, `float`, `bool`, `str`: a position in the data); restored by
        `load(..., extra=template)`.
    - `keep`: keep only the `keep` most recent steps, deleting older ones once this
        one is saved; `None` keeps all.
    - `wait`: if `False`, return as soon as a copy of the arrays has been taken in
        host memory, and write it to disk in a background thread: training can go
        on at once (the next step may donate the saved buffers). A copy of every
        array lives in host memory until the write has finished.

    **Returns:**

    A `Saving` handle; `handle.wait()` blocks until the step is committed.

    **Raises:**

    `ValueError` if `step` is negative, already saved or below the latest saved
    step, or `keep` < 1;
    `TypeError` for an abstract leaf (a `jax.ShapeDtypeStruct`) or a leaf of
    `extra` that is neither an array nor a scalar.

    !!! Example

        ```python
        for i in range(start, steps):
            model, opt_state, loss = step_fn(model, opt_state, *batch)
            key, _ = jax.random.split(key)
            if (i + 1) % 100 == 0:
                eo.save("ckpt", model, opt_state, step=i + 1,
                        extra={"key": key, "batch": i + 1}, keep=3, wait=False)
        eo.wait_until_finished()
        ```
    """
    directory = _directory(path, "`save(path=...)`")
    if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 0:
        raise ValueError(f"`save(step=...)` must be an int >= 0, got {step!r}.")
    step = int(step)
    if keep is not None and (isinstance(keep, bool) or keep < 1):
        raise ValueError(
            f"`save(keep=...)` must be None (keep every step) or an int >= 1, got "
            f"{keep!r}."
        )
    _wait_for(directory)
    manager = _manager(directory, keep=keep, asynchronous=not wait)
    try:
        steps = manager.all_steps()
        if step in steps:
            raise ValueError(
                f"`save(step=...)`: step {step} is already saved in {directory!r}; "
                "save under a new step number, or delete that step's directory first."
            )
        if steps and step < max(steps):
            # Orbax would skip it without a word: steps only go up in a directory.
            raise ValueError(
                f"`save(step={step})`: {directory!r} already holds step {max(steps)}, "
                "and the steps of a checkpoint directory only go up (after resuming "
                "from an earlier step, for instance). Save to a new directory, or "
                "delete the later steps' directories first."
            )
        args = _save_args(model, opt_state, extra, step, wait)
    except BaseException:
        manager.close()
        raise
    manager.save(step, args=ocp.args.Composite(**args))
    saving = Saving(manager, directory, step)
    if wait:
        saving.wait()
    else:
        _pending[directory] = saving
    return saving


def _save_args(
    model: Any, opt_state: Any, extra: Any, step: int, wait: bool
) -> dict[str, Any]:
    """The orbax items of a step: the array leaves of each tree as a flat dict from
    path to array (a copy for an asynchronous save), and a JSON description."""
    trees = {"model": model, "opt_state": opt_state, "extra": extra}
    _check_global(trees, None, "save")
    meta: dict[str, Any] = {"format": _FORMAT, "step": step, "leaves": {}, "values": {}}
    args = {}
    for name, tree in trees.items():
        leaves, values, arrays = [], {}, {}
        for leaf_path, x in _flatten(tree):
            if isinstance(x, jax.ShapeDtypeStruct):
                raise TypeError(
                    f"`save({name}=...)`: leaf {leaf_path!r} is abstract (a "
                    "`jax.ShapeDtypeStruct`); save a model with concrete arrays."
                )
            if eqx.is_array(x):
                impl = _key_impl(x)
                data = x if impl is None else jax.random.key_data(x)
                if not wait:
                    data = _snapshot(data)
                arrays[_name(leaf_path)] = data
                leaves.append([leaf_path, list(x.shape), str(x.dtype), impl])
            elif name == "extra":
                if isinstance(x, np.generic):
                    x = x.item()
                if not isinstance(x, _SCALARS):
                    raise TypeError(
                        f"`save(extra=...)`: leaf {leaf_path!r} is a "
                        f"{type(x).__name__}; `extra` holds arrays and Python scalars "
                        "(int, float, bool, str). Convert it, or keep it elsewhere."
                    )
                values[leaf_path] = x
                leaves.append([leaf_path, None, type(x).__name__, None])
        meta["leaves"][name] = leaves
        meta["values"][name] = values
        if arrays:
            args[name] = ocp.args.StandardSave(arrays)
    args["meta"] = ocp.args.JsonSave(meta)
    return args


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
    opt_state = _update.place_state(
        optimizer, _abstract(like[1]), model, policy, "`eqx_offload.load`"
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


def _directory(path: Any, where: str) -> str:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"{where} must be a directory path (a `str` or `os.PathLike`), got "
            f"{type(path).__name__}."
        )
    return os.path.abspath(os.fspath(path))


def _wait_for(directory: str) -> None:
    """Orbax saves one step of a directory at a time, and a load must see it."""
    saving = _pending.get(directory)
    if saving is not None:
        saving.wait()


def _manager(
    directory: str,
    *,
    keep: int | None = None,
    asynchronous: bool = False,
    create: bool = True,
) -> ocp.CheckpointManager:
    """A manager that saves (`create=True`) or only reads."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=asynchronous,
        create=create,
        # A saver owns the directory: the temporary directory of a save that was
        # killed is removed by the next save.
        cleanup_tmp_directories=create,
    )
    return ocp.CheckpointManager(directory, options=options)


def _flatten(tree: Any) -> list[tuple[str, Any]]:
    """Leaves of `tree` (`None` is no leaf) with their dotted paths."""
    flat, _ = jtu.tree_flatten_with_path(tree)
    return [(_paths.join("", keys), x) for keys, x in flat]


def _name(leaf_path: str) -> str:
    """A leaf's name in the saved item (a flat dict): its path; the root of a tree
    that is a single array has no path."""
    return leaf_path or "(root)"


def _key_impl(x: Any) -> str | None:
    """The PRNG implementation of a key array (or its abstract value), else None."""
    if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return None
    return x.dtype._impl.name


def _wrap_key(data: jax.Array, impl: str) -> jax.Array:
    return jax.random.wrap_key_data(data, impl=impl)


def _host_aval(x: jax.Array) -> jax.Array:
    """`x`, with the memory space of its type matching its sharding's memory kind.

    JAX 0.10 builds the arrays orbax restores (`make_array_from_single_device_arrays`)
    with a device-memory type whatever their memory kind, and `jax.jit` traces them
    by type: a `train_step` would take a restored `pinned_host` leaf for a device
    one. The same buffers are rewrapped with the right type; should that private
    constructor change, a copy (one leaf at a time) does it."""
    host = x.sharding.memory_kind in ("pinned_host", "unpinned_host")
    if not host or jax.typeof(x).memory_space == jax.memory.Space.Host:
        return x
    try:
        from jax._src import array, core

        aval = core.ShapedArray(x.shape, x.dtype, memory_space=jax.memory.Space.Host)
        buffers = getattr(x, "_arrays")
        out = array.ArrayImpl(aval, x.sharding, buffers, committed=True)
        if jax.typeof(out).memory_space == jax.memory.Space.Host:
            return out
    except (ImportError, AttributeError, TypeError) as e:
        warnings.warn(
            "`eqx_offload.load`: this JAX version no longer lets a restored "
            f"host-resident array be rewrapped ({type(e).__name__}: {e}); each one is "
            "copied instead, which takes twice its host memory while it is.",
            RuntimeWarning,
            stacklevel=3,
        )
    return jax.device_put(x, x.sharding, may_alias=False)


def _snapshot(x: Any) -> Any:
    """A copy of an array that orbax would read in place, for an asynchronous save:
    the step after `save` returns may donate (and overwrite) the array while it is
    written. Orbax copies arrays in accelerator memory to the host itself before
    `save` returns; it reads host-resident arrays, and on the CPU backend every
    array, where they are."""
    if isinstance(x, jax.Array):
        host = x.sharding.memory_kind in ("pinned_host", "unpinned_host")
        cpu = all(d.platform == "cpu" for d in x.sharding.device_set)
        if host or cpu:
            return jax.device_put(x, x.sharding, may_alias=False)
        return x
    return np.array(x, copy=True)  # NumPy: the caller may change it in place


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


def _check_global(like: Any, extra: Any, what: str) -> None:
    """In a run of several processes, refuses (on every process alike, before orbax
    is asked) an array leaf that is not laid out over the devices of every process:
    orbax cannot save one ("host local jax.Array"), and would restore it on one
    process's device only, fail on the others and leave that one waiting."""
    count = jax.process_count()
    if count == 1:
        return
    names = ("like", "extra") if what == "load" else ("trees", "")
    for name, tree in zip(names, (like, extra)):
        for leaf_path, x in _flatten(tree):
            if not eqx.is_array(x) and not isinstance(x, jax.ShapeDtypeStruct):
                continue
            sharding = getattr(x, "sharding", None)
            processes = (
                {d.process_index for d in sharding.device_set} if sharding else set()
            )
            if len(processes) != count:
                has = (
                    "no sharding"
                    if sharding is None
                    else f"a sharding on {len(processes)} of them"
                )
                if what == "load":
                    where, fix = (
                        f"`load({name}=...)`",
                        "Give every leaf the global `NamedSharding` to restore it in: "
                        "`jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding("
                        "mesh, spec))` over a mesh of all devices.",
                    )
                else:
                    where, fix = (
                        "`save`",
                        "Lay it out over a mesh of all devices first (replicated: "
                        "`jax.make_array_from_callback(shape, NamedSharding(mesh, "
                        "PartitionSpec()), ...)`; for a PRNG key, its "
                        "`jax.random.key_data`), or keep it in `extra` as a Python "
                        "scalar.",
                    )
                raise ValueError(
                    f"{where}: leaf {leaf_path!r} is not laid out over the "
                    f"devices of all {count} processes of this run (it has {has}). "
                    + fix
                )


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
    if _key_impl(x) is not None:
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
