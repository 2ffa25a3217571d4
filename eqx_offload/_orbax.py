"""What `save` and `load` share: a checkpoint directory, its orbax manager, the
saved leaves' names, and the check that each leaf spans every process."""

import os
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import orbax.checkpoint as ocp

from . import _paths
from ._errors import see


# Bumped if the layout of a step's directory changes.
FORMAT = 1


def directory(path: Any, where: str) -> str:
    """The absolute directory of a checkpoint `path` (`where` names the argument)."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"{where} must be a directory path (a `str` or `os.PathLike`), got "
            f"{type(path).__name__}."
        )
    return os.path.abspath(os.fspath(path))


def manager(
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


def flatten(tree: Any) -> list[tuple[str, Any]]:
    """Leaves of `tree` (`None` is no leaf) with their dotted paths."""
    return [(_paths.join("", keys), x) for keys, x in jtu.tree_leaves_with_path(tree)]


def name(leaf_path: str) -> str:
    """A leaf's name in the saved item (a flat dict): its path; the root of a tree
    that is a single array has no path."""
    return leaf_path or "(root)"


# The fix for a leaf `save` cannot write from every process.
_SAVE_GLOBAL_FIX = (
    "Lay it out over a mesh of all devices first (for a PRNG key, its "
    "`jax.random.key_data`), or keep it in `extra` as a Python scalar."
)


def check_global_save(trees: dict[str, Any]) -> None:
    """In a run of several processes, refuses (on every process alike, before orbax
    is asked) an array leaf of `trees` that is not laid out over the devices of
    every process: orbax cannot save one ("host local jax.Array")."""
    for leaf_path, has in _not_global(trees):
        raise ValueError(
            f"`save`: leaf {leaf_path!r} is not laid out over the devices of all "
            f"{jax.process_count()} processes ({has}). " + _SAVE_GLOBAL_FIX + see(62)
        )


def check_global_load(like: Any, extra: Any) -> None:
    """In a run of several processes, refuses a leaf of `like` or `extra` that is
    not laid out over the devices of every process: orbax would restore it on one
    process's device only, fail on the others and leave that one waiting."""
    for argument, tree in (("like", like), ("extra", extra)):
        for leaf_path, has in _not_global(tree):
            raise ValueError(
                f"`load({argument}=...)`: leaf {leaf_path!r} is not laid out over "
                f"the devices of all {jax.process_count()} processes ({has}). Give it "
                "a global `NamedSharding`." + see(63)
            )


def _not_global(tree: Any) -> Iterator[tuple[str, str]]:
    """The array leaves of `tree` not laid out over every process's devices, each
    with what it has instead; none in a run of one process."""
    count = jax.process_count()
    for leaf_path, x in flatten(tree) if count > 1 else ():
        if not eqx.is_array(x) and not isinstance(x, jax.ShapeDtypeStruct):
            continue
        if getattr(x, "sharding", None) is None:
            yield leaf_path, "it has no sharding"
        elif len(processes := {d.process_index for d in x.sharding.device_set}) < count:
            yield leaf_path, f"it has a sharding on {len(processes)} of them"
