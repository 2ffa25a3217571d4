"""A pending update applied by the forward scan (`Policy(update_timing=...)`):
what `train_step` hands a `Stacked`'s scan, and the record that each was applied.

The step sets, for the duration of its loss, the update each `Stacked` (by path)
still owes its layers (`Layers`); the configured scan takes it (`take`) and applies
it a layer at a time before the layer computes (`_prefetch.py`). The new values
come back to the step as the cotangents of `Layers.aux`: the only way out of a loss
that the user wrote is its gradient.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple


class Layers(NamedTuple):
    """The update one `Stacked` applies in its forward scan.

    - `paths`: the paths of the leaves it updates, in `jax.tree.leaves` order.
    - `update(aux, held) -> aux`: one layer's update, on the device: its slice
        of `aux` and `held` to its new slice.
    - `aux`: `(params, grads, state)`, the stacked arrays of the leaves at
        `paths`, their waiting gradients and their optimizer state. The forward
        scan writes the new slices into the slots `writes` marks, in place: the
        new parameters over the old ones, or over the gradients where the layers
        compute with the old ones (`"delayed"`); the layers compute with the
        parameters slot. The arrays at the end are the cotangent of `aux`.
    - `held`: the values computed from the whole tree the update reads.
    - `writes`: which of the three slots of `aux` the update writes.
    """

    paths: tuple[str, ...]
    update: Callable[[Any, Any], Any]
    aux: Any
    held: Any
    writes: tuple[bool, bool, bool]


_OWED: contextvars.ContextVar[dict[str, Layers] | None] = contextvars.ContextVar(
    "eqx_offload_pending", default=None
)
_TAKEN: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "eqx_offload_pending_taken", default=None
)


@contextlib.contextmanager
def owed(layers: dict[str, Layers]) -> Iterator[list[str]]:
    """Within: each `Stacked` at a path of `layers` applies its update. Yields the
    paths of the scans that took theirs, in order."""
    taken: list[str] = []
    owed_token = _OWED.set(layers)
    taken_token = _TAKEN.set(taken)
    try:
        yield taken
    finally:
        _OWED.reset(owed_token)
        _TAKEN.reset(taken_token)


def take(path: str) -> Layers | None:
    """The update the `Stacked` at `path` owes its layers, if any (recorded as
    taken)."""
    owed, taken = _OWED.get(), _TAKEN.get()
    if owed is None or taken is None or path not in owed:
        return None
    taken.append(path)
    return owed[path]


def check_taken(owed: dict[str, Any], taken: list[str], where: str) -> None:
    """Raises unless each `Stacked` that owed an update applied it exactly once."""
    for path in owed:
        count = taken.count(path)
        if count != 1:
            ran = "never ran it" if count == 0 else f"ran it {count} times"
            raise ValueError(
                f"{where}: `Policy(update_timing=...)` applies the pending update of "
                f"the `Stacked` at {path!r} in its forward scan, but the loss "
                f"{ran}; under this option each `Stacked` runs exactly once per "
                "loss. Use `update_timing='now'` for this loss."
            )
