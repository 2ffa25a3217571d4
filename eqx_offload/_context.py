"""What a running `filter_offload` call knows: the `Stacked` layers in its arguments
(so that each finds its path when it is applied) and the checkpoint names seen.

A `Stacked` is configured when it is *applied*, not by rewriting the arguments: a
configured copy would have different pytree metadata, and `eqx.combine` with a
closed-over half of the model, or any other `tree_map` against the original, would
then fail. It is recognised by the identity of its arrays (so partitioned and
recombined models work) or, failing that, by its leaf paths and shapes (so a cast
`jax.tree.map(lambda x: x.astype(jnp.bfloat16), model)` works).
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

import equinox as eqx

from . import _paths
from ._names import NameLog
from ._policy import Policy


class StackedArgument(NamedTuple):
    """A `Stacked` found in the arguments."""

    path: str
    argument: str  # "argument 0", "argument `key`"
    signature: tuple[tuple[str, tuple[int, ...]], ...]  # (leaf path, shape) of arrays
    ids: frozenset[int]
    arrays: tuple  # keeps the arrays alive, so that their ids stay theirs


def describe(layers: Any) -> tuple[tuple, frozenset[int], tuple]:
    """The signature, array ids and arrays of a `Stacked`'s layers."""
    arrays = [leaf for leaf in _paths.leaves(layers) if eqx.is_array(leaf.value)]
    signature = tuple((leaf.path, tuple(leaf.value.shape)) for leaf in arrays)
    values = tuple(leaf.value for leaf in arrays)
    return signature, frozenset(id(v) for v in values), values


class CallContext:
    def __init__(self, policy: Policy, stacked: list[StackedArgument]):
        self.policy = policy
        self.stacked = stacked
        self.log = NameLog()

    def path_of(self, layers: Any) -> str:
        """The path of the argument `Stacked` whose layers these are."""
        signature, ids, _ = describe(layers)
        by_identity = {s.path for s in self.stacked if s.ids & ids}
        by_shape = {s.path for s in self.stacked if s.signature == signature}
        found = by_identity or by_shape
        if len(found) == 1:
            return next(iter(found))
        if found:
            raise ValueError(
                "A `Stacked` applied inside a `filter_offload` function matches the "
                f"`Stacked` arguments at {_paths.quoted(sorted(found))} equally well, "
                "so its checkpoint names are ambiguous. Apply the `Stacked` objects "
                "you passed in (not rebuilt copies of them)."
            )
        raise ValueError(
            "A `Stacked` was applied inside a `filter_offload` function without being "
            "one of its arguments (it was closed over, or built inside the function), "
            "so the policy cannot apply to it. Pass the model as an argument: "
            "`filter_offload(loss_fn, policy)(model, *batch)`."
        )


_current: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar(
    "eqx_offload_call", default=None
)


@contextlib.contextmanager
def calling(context: CallContext) -> Iterator[CallContext]:
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def current() -> CallContext | None:
    return _current.get()
