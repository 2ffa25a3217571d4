"""The loss `train_step` differentiates, checked: a floating-point scalar, or
`(loss, aux)` with `has_aux=True`, else an error naming what it returned."""

import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu

from ._errors import see
from ._memory_kinds import is_arraylike


def _describe(out: Any) -> str:
    """What a loss returned, for an error message: `float32[8]`, `(float32[],
    {'acc': float32[]})`."""

    def one(x: Any) -> str:
        if is_arraylike(x):
            return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
        return type(x).__name__

    return str(jtu.tree_map(lambda x: _Text(one(x)), out, is_leaf=lambda x: x is None))


class _Text(str):
    def __repr__(self) -> str:
        return str(self)


def _is_loss(x: Any) -> bool:
    return is_arraylike(x) and x.shape == () and jnp.issubdtype(x.dtype, jnp.floating)


# The fix, by `has_aux` and whether `loss_fn` returned what the other `has_aux` wants.
_FIXES = {
    (False, True): "for `(loss, aux)`, pass `has_aux=True`",
    (True, True): "it returns the loss alone: drop `has_aux=True`",
    (True, False): "with `has_aux=True` it returns `(loss, aux)`, `loss` a scalar",
    (False, False): "the loss must be one floating-point scalar (e.g. `jnp.mean` over "
    "the examples); for `(loss, aux)`, pass `has_aux=True`",
}


def checked_loss(loss_fn: Callable, has_aux: bool, where: str) -> Callable:
    """`loss_fn`, raising a `ValueError` that names `has_aux` and the fix when it
    returns something other than what the step differentiates: a floating-point
    scalar, or `(loss, aux)` with `has_aux=True`."""

    @functools.wraps(loss_fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        out = loss_fn(*args, **kwargs)
        pair = isinstance(out, tuple | list) and len(out) == 2 and _is_loss(out[0])
        if pair if has_aux else _is_loss(out):
            return out
        fix = _FIXES[has_aux, _is_loss(out) if has_aux else pair]
        raise ValueError(
            f"{where}: `loss_fn` returned {_describe(out)}; {fix}." + see(49)
        )

    return checked
