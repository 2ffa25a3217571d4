"""A pending update applied by the forward scan (`Policy(update_timing=...)`).

This is what `train_step` hands a `Stacked`'s scan, and the record that each was
applied.

While its loss runs, the step sets the update each `Stacked` still owes its layers
(`Layers`, by path). The configured scan takes it (`take`). It applies it a layer at
a time, before the layer computes (`_prefetch.py`). The new values come back to the
step as the cotangents of `Layers.aux`. A gradient is the only way out of a loss
that the user wrote.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import equinox as eqx
from jaxtyping import PyTree

from ._errors import see


class PendingUpdate(eqx.Module):
    """The optimizer state under `Policy(update_timing="next_forward")` or `"delayed"`.

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
    if isinstance(state, PendingUpdate):
        return PendingUpdate(state.inner, state.grads, state.held, False)
    return state


def steady(state: Any) -> Any:
    """The state of every step but the first. `memory_report` compiles this one.

    Under `Policy(update_timing=...)` it has an update pending. `init_opt_state`
    gives one with none. Its first step applies nothing: a program of its own.
    """
    if isinstance(state, PendingUpdate) and not state.ready:
        return PendingUpdate(state.inner, state.grads, state.held, True)
    return state


def check_ready(state: Any, where: str) -> None:
    """Raises if `state` holds an update still waiting."""
    if isinstance(state, PendingUpdate) and state.ready:
        raise ValueError(
            f"{where}: `opt_state` holds a pending update. Call "
            "`eqx_offload.apply_pending` first." + see(_PENDING_ENTRIES.get(where, 133))
        )


# The catalogue's entry for each caller's refusal (`docs/errors.md`).
_PENDING_ENTRIES = {"`verify`": 133, "`save(opt_state=...)`": 134}


class Layers(NamedTuple):
    """The update one `Stacked` applies in its forward scan.

    - `paths`: the paths of the leaves it updates, in `jax.tree.leaves` order.
    - `update(aux, held) -> aux`: one layer's update, on the device. It maps its
        slice of `aux` and `held` to its new slice.
    - `aux`: `(params, grads, state)`. These are the stacked arrays of the leaves at
        `paths`, their waiting gradients and their optimizer state. The forward
        scan writes the new slices in place, into the slots `writes` marks. The new
        parameters go over the old ones. Under `"delayed"` the layers compute with
        the old ones, so they go over the gradients. The layers compute with the
        parameters slot. The arrays at the end are the cotangent of `aux`.
    - `held`: the values computed from the whole tree the update reads.
    - `writes`: which of the three slots of `aux` the update writes.
    """

    paths: tuple[str, ...]
    update: Callable[[Any, Any], Any]
    aux: Any
    held: Any
    writes: tuple[bool, bool, bool]


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
