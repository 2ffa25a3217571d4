"""A pending update applied by the forward scan (`Policy(update_timing=...)`).

This is what `train_step` hands a `Stacked`'s scan, the record that each was
applied, and the mark of a `Stacked` one update behind.

While its loss runs, the step sets the update each `Stacked` still owes its layers
(`Layers`, by path). The configured scan takes it (`take`). It applies it a layer at
a time, before the layer computes (`_prefetch.py`). The new values come back to the
step as the cotangents of `Layers.aux`. A gradient is the only way out of a loss
that the user wrote.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Collection, Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from . import _paths
from ._errors import see


class PendingUpdate(eqx.Module):
    """The optimizer state under `Policy(update_timing="next_forward")`.

    It holds the optimizer's own state. It also holds the stacked layers' update,
    kept over to the next step.

    - `inner`: the wrapped optimizer's state.
    - `grads`: the gradient of each stacked layer parameter whose update waits.
        The other parameters have `optax.MaskedNode()`.
    - `held`: per `Stacked`, the values its update reads besides its own pieces.
        These are step counts and global norms, computed with the gradients.
    - `ready`: whether an update is waiting. It is False after `init_opt_state` and
        `apply_pending`.
    """

    inner: PyTree
    grads: PyTree
    held: tuple
    ready: bool = eqx.field(static=True)


def structure(state: Any) -> Any:
    """`state` as `init_opt_state` makes it, for checking its structure.

    Whether an update waits is a static field.
    """
    return ready_as(state, False)


def steady(state: Any) -> Any:
    """The state of every step but the first. `memory_report` compiles this one.

    Under `Policy(update_timing=...)` it has an update pending. `init_opt_state`
    gives one with none. Its first step applies nothing: a program of its own.
    """
    return ready_as(state, True)


def ready_as(state: Any, ready: bool) -> Any:
    """A `PendingUpdate` `state` with its static `ready` flag set (else `state`)."""
    if isinstance(state, PendingUpdate):
        return dataclasses.replace(state, ready=ready)
    return state


def check_ready(where: str, state: Any = None, model: Any = None) -> None:
    """Raises if `state` holds an update still waiting, or `model` is marked as
    one update behind."""
    if isinstance(state, PendingUpdate) and state.ready:
        what = "`opt_state` holds a pending update"
    elif marked(model):
        what = f"the model's {_paths.quoted(marked(model))} is one update behind"
    else:
        return
    raise ValueError(
        f"{where}: {what}. Call `eqx_offload.apply_pending(model, opt_state, "
        "optimizer, policy)` first." + see(_PENDING_ENTRIES.get(where, 148))
    )


# The catalogue's entry for each caller's refusal (`docs/errors.md`).
_PENDING_ENTRIES = {"`verify`": 133, "`save`": 134}


def _is_stack(x: Any) -> bool:
    return isinstance(x, _paths.AbstractLayerStack)


def marked(model: Any) -> list[str]:
    """The paths of the `Stacked`s of `model` marked as one update behind: those
    whose update the step that returned them left pending."""
    return [
        _paths.join("", keys)
        for keys, x in jtu.tree_leaves_with_path(model, is_leaf=_is_stack)
        if _is_stack(x) and getattr(x, "pending", False)
    ]


def mark(model: Any, paths: Collection[str]) -> Any:
    """`model` with the `Stacked`s at `paths` marked, and the others not."""

    def set_mark(keys: Any, x: Any) -> Any:
        pending = _paths.join("", keys) in paths
        if not _is_stack(x) or getattr(x, "pending", False) == pending:
            return x
        return dataclasses.replace(x, pending=pending)

    return jtu.tree_map_with_path(set_mark, model, is_leaf=_is_stack)


def refuse(path: str) -> None:
    """Raises for the marked `Stacked` at `path`, run outside the step that owes
    it its update. (That step runs it unmarked: `unmarked`.)"""
    raise ValueError(
        f"`{path}` is one optimizer update behind: the "
        "`Policy(update_timing='next_forward')` step that returned it left its "
        "update pending. Call `eqx_offload.apply_pending(model, opt_state, "
        "optimizer, policy)` before running it outside the step." + see(148)
    )


def unmarked(model: Any, state: Any, where: str) -> Any:
    """`model` without its marks, for the step that applies the update `state`
    holds. Raises if `model` is marked and `state` holds none (a fresh state)."""
    paths = marked(model)
    if paths and not (isinstance(state, PendingUpdate) and state.ready):
        raise ValueError(
            f"{where}: the model's {_paths.quoted(paths)} is one update behind, but "
            "`opt_state` holds no pending update. Pass the state the step "
            "returned, or `eqx_offload.apply_pending` both first." + see(148)
        )
    return mark(model, ())


class Layers(NamedTuple):
    """The update one `Stacked` applies in its forward scan.

    - `paths`: the paths of the leaves it updates, in `jax.tree.leaves` order.
    - `update(aux, held) -> aux`: one layer's update, on the device. It maps its
        slice of `aux` and `held` to its new slice.
    - `aux`: `(params, grads, state)`. These are the stacked arrays of the leaves at
        `paths`, their waiting gradients and their optimizer state. The forward
        scan writes the new parameters and state over the old, in place, and the
        layers compute with the new. The arrays at the end are the cotangent of
        `aux`.
    - `held`: the values computed from the whole tree the update reads.
    """

    paths: tuple[str, ...]
    update: Callable[[Any, Any], Any]
    aux: Any
    held: Any


class Record(NamedTuple):
    """What happened to the updates owed during one trace of the loss.

    It lists, in order, the paths of the scans that took theirs. It lists those
    whose backward pass ran. It keeps the traces a scan may take one in (`allow`).
    """

    layers: dict[str, Layers]
    taken: list[str]
    backward: list[str]
    traces: list[Any]

    def applied_once(self) -> bool:
        """Whether each `Stacked` took its update, and ran its backward pass, once.

        The backward pass gives the new values back. Otherwise the new values are
        wrong. They are added up if a `Stacked` ran twice, or in a loop traced once.
        They are zero if it never ran, or its output was not differentiated.
        """
        return all(
            self.taken.count(p) == 1 and self.backward.count(p) == 1
            for p in self.layers
        )


_RECORD: contextvars.ContextVar[Record | None] = contextvars.ContextVar(
    "eqx_offload_pending", default=None
)


@contextlib.contextmanager
def owed(layers: dict[str, Layers], trace: Any) -> Iterator[Record]:
    """Within, each `Stacked` at a path of `layers` may apply its update.

    It may where it runs in `trace` (the trace current here) or one `allow`ed.
    Yields the record of what happened.
    """
    record = Record(layers, [], [], [trace])
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


def allow(trace: Any) -> None:
    """A trace in which a scan may take its update too.

    This is `filter_offload`'s own trace of the loss. It evaluates the jaxpr in the
    step's trace.
    """
    record = _RECORD.get()
    if record is not None:
        record.traces.append(trace)


def traces() -> list[Any]:
    """The traces in which a scan may take its update (none outside a step)."""
    record = _RECORD.get()
    return [] if record is None else list(record.traces)


def take(path: str) -> Layers | None:
    """The update the `Stacked` at `path` owes its layers, if any.

    It is recorded as taken.
    """
    record = _RECORD.get()
    if record is None or path not in record.layers:
        return None
    record.taken.append(path)
    return record.layers[path]


def on_backward(path: str) -> Callable[[], None]:
    """What the scan that took `path`'s update calls when its backward is built.

    It notes that in this step's record. The backward pass may be built after the
    loss has returned, outside `owed`.
    """
    record = _RECORD.get()

    def ran() -> None:
        if record is not None:
            record.backward.append(path)

    return ran
