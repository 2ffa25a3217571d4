"""Checkpoints: `save` a model, its optimizer state and your own state.

They go to a directory of numbered steps. `load` in `_loading.py` reads them back.
"""

import atexit
import os
import threading
from typing import Any

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
from jaxtyping import PyTree

from . import _orbax
from ._errors import see
from ._memory_kinds import is_key
from ._pending import check_ready


# JSON-able leaves of `extra` (a data position, an epoch); saved by value.
_SCALARS = (bool, int, float, str)


class Saving:
    """A save in progress, returned by `eqx_offload.save`; `wait()` for it to finish.

    A save with `wait=True` has finished when it is returned. One with `wait=False`
    finishes in a background thread. Its step is loadable (and listed by `saved_steps`)
    once it has. Some calls wait for it first: a later `save` or `load` of the same
    directory, and `eqx_offload.wait_until_finished()`. So does the end of the Python
    process.
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

    A list of step numbers. It is empty if the directory does not exist or holds no
    finished step. (An interrupted save leaves none.)

    !!! Example

        ```python
        if eo.saved_steps("ckpt"):
            model, opt_state, step, _ = eo.load("ckpt", like, policy, optimizer=opt)
        ```
    """
    directory = _orbax.directory(path, "`saved_steps(path=...)`")
    wait_for(directory)
    if not os.path.isdir(directory):
        return []
    manager = _orbax.manager(directory, create=False)
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
    """Saves a model, its optimizer state and your own state as step `step` of `path`.

    Each step is a subdirectory of the checkpoint directory `path`. It is written under
    a temporary name and renamed when complete. So a process killed in the middle of a
    save leaves the steps saved before it loadable. The array leaves are saved (with
    `orbax-checkpoint`). Everything else in `model` and `opt_state` comes from the
    `like` given to `eqx_offload.load`. (That is static fields, activation functions.)
    PRNG key arrays are saved as their key data and rewrapped on load.

    **Arguments:**

    - `path`: the checkpoint directory; created if missing.
    - `model`: the model, wherever its leaves live.
    - `opt_state`: its optimizer state. Under `Policy(update_timing="next_forward")`,
        first apply the update the last step left pending
        (`eqx_offload.apply_pending`). Until then the model's stacked layers are one
        update behind, and `save` refuses them.
    - `step`: the step number (an `int` >= 0), usually the number of steps trained. It
        must not be saved already.
    - `extra`: your own state, restored by `load(..., extra=template)`. A pytree of
        arrays (a PRNG key, metrics) and Python scalars. The scalars are `int`, `float`,
        `bool` or `str` (a position in the data).
    - `keep`: keep only the `keep` most recent steps. Older ones are deleted once this
        one is saved. `None` keeps all.
    - `wait`: if `False`, return once a copy of the arrays has been taken in host
        memory. A background thread writes it to disk. So training can go on at once:
        the next step may donate the saved buffers. A copy of every array lives in host
        memory until the write has finished.

    **Returns:**

    A `Saving` handle; `handle.wait()` blocks until the step is committed.

    **Raises:**

    - `ValueError` if `step` is negative, already saved or below the latest saved step.
        Also if `keep` < 1, or if an update is pending (in `opt_state` or the model).
    - `TypeError` for an abstract leaf (a `jax.ShapeDtypeStruct`). Also for a leaf of
        `extra` that is neither an array nor a scalar.

    !!! Example

        ```python
        for i in range(start, steps):
            model, opt_state, loss, _ = step_fn(model, opt_state, *batch)
            key, _ = jax.random.split(key)
            if (i + 1) % 100 == 0:
                eo.save("ckpt", model, opt_state, step=i + 1,
                        extra={"key": key, "batch": i + 1}, keep=3, wait=False)
        eo.wait_until_finished()
        ```
    """
    directory = _orbax.directory(path, "`save(path=...)`")
    # The parameters of a model one update behind would be saved as its own.
    check_ready("`save`", opt_state, model)
    if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 0:
        raise ValueError(
            f"`save(step=...)` must be an int >= 0, got {step!r}." + see(60)
        )
    step = int(step)
    if keep is not None and (isinstance(keep, bool) or keep < 1):
        raise ValueError(
            f"`save(keep=...)` must be None (keep every step) or an int >= 1, got "
            f"{keep!r}."
        )
    wait_for(directory)
    manager = _orbax.manager(directory, keep=keep, asynchronous=not wait)
    try:
        steps = manager.all_steps()
        if step in steps:
            raise ValueError(
                f"`save(step=...)`: step {step} is already saved in {directory!r}. "
                "Save under a new step number."
            )
        if steps and step < max(steps):
            # Orbax would skip it without a word: steps only go up in a directory.
            raise ValueError(
                f"`save(step={step})`: {directory!r} already holds step {max(steps)}, "
                "and steps only go up. Save to a new directory." + see(61)
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
    """The orbax items of a step.

    The array leaves of each tree go in a flat dict from path to array (a copy for an
    asynchronous save). A JSON description goes with them.
    """
    trees = {"model": model, "opt_state": opt_state, "extra": extra}
    _orbax.check_global_save(trees)
    meta: dict[str, Any] = dict(format=_orbax.FORMAT, step=step, leaves={}, values={})
    args = {}
    for name, tree in trees.items():
        leaves, values, arrays = [], {}, {}
        for leaf_path, x in _orbax.flatten(tree):
            if isinstance(x, jax.ShapeDtypeStruct):
                raise TypeError(
                    f"`save({name}=...)`: leaf {leaf_path!r} is abstract (a "
                    "`jax.ShapeDtypeStruct`). Save concrete arrays." + see(59)
                )
            if eqx.is_array(x):
                # A PRNG key array: its key data, and its implementation's name.
                impl = str(jax.random.key_impl(x)) if is_key(x) else None
                data = x if impl is None else jax.random.key_data(x)
                if not wait:
                    data = _snapshot(data)
                arrays[_orbax.name(leaf_path)] = data
                leaves.append([leaf_path, list(x.shape), str(x.dtype), impl])
            elif name == "extra":
                if isinstance(x, np.generic):
                    x = x.item()
                if not isinstance(x, _SCALARS):
                    raise TypeError(
                        f"`save(extra=...)`: leaf {leaf_path!r} is a "
                        f"{type(x).__name__}. Give arrays or Python scalars (int, "
                        "float, bool, str)."
                    )
                values[leaf_path] = x
                leaves.append([leaf_path, None, type(x).__name__, None])
        meta["leaves"][name] = leaves
        meta["values"][name] = values
        if arrays:
            args[name] = ocp.args.StandardSave(arrays)
    args["meta"] = ocp.args.JsonSave(meta)
    return args


def wait_for(directory: str) -> None:
    """Waits for the asynchronous save in progress in `directory`, if any.

    Orbax saves one step of a directory at a time, and a load must see it.
    """
    saving = _pending.get(directory)
    if saving is not None:
        saving.wait()


def _snapshot(x: Any) -> Any:
    """A copy of an array that orbax would read in place, for an asynchronous save.

    The step after `save` returns may donate (and overwrite) the array while it is
    written. Orbax copies arrays in accelerator memory to the host itself before `save`
    returns. It reads host-resident arrays where they are. On the CPU backend it reads
    every array where it is.
    """
    if isinstance(x, jax.Array):
        host = x.sharding.memory_kind in ("pinned_host", "unpinned_host")
        cpu = all(d.platform == "cpu" for d in x.sharding.device_set)
        return jax.device_put(x, x.sharding, may_alias=False) if host or cpu else x
    return np.array(x, copy=True)  # NumPy: the caller may change it in place
