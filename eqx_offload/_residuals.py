"""Residuals: the values a function saves in its forward pass for its backward pass.

This is `jax.ad_checkpoint.print_saved_residuals` as data, built from public APIs
only (`jax.make_jaxpr` of `jax.vjp`): each residual's abstract value (which carries
its memory space, `f32<host>[...]`) and where it came from, including the checkpoint
name when it is the output of `checkpoint_name`, and the line of the user's code
that computed it (from the equation's traceback). The walk through the jaxpr is
`_jaxpr_residuals.py`'s.
"""

import os
import sysconfig
from collections.abc import Callable
from typing import Any, NamedTuple

import beartype
import equinox as eqx
import jax
import jaxlib
import jaxtyping
import optax

from . import _jaxpr, _jaxpr_residuals
from ._memory_kinds import is_arraylike, is_host_aval


class Residual(NamedTuple):
    """One saved residual."""

    aval: Any  # a `jax.core.ShapedArray`
    source: str  # "argument", "constant", "literal", "named" or a primitive's name
    name: str | None = None  # the checkpoint name, when `source == "named"`
    per_iteration: bool = False  # stacked over a scan's iterations (one per layer)
    where: str | None = None  # the user's line that computed it, if known

    @property
    def host(self) -> bool:
        return is_host_aval(self.aval)

    @property
    def nbytes(self) -> int:
        return int(self.aval.size) * self.aval.dtype.itemsize


def saved_residuals(f: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """The residuals `jax.vjp` of `f` saves with respect to every array in the
    arguments (other leaves are static, as with `eqx.filter_vjp`), traced abstractly:
    arguments may be `jax.ShapeDtypeStruct`s."""
    return trace_vjp(f, *args, **kwargs)[0]


def trace_vjp(f: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[list, Any]:
    """`saved_residuals`, and the jaxpr of `jax.vjp` they were read from."""
    dynamic, static = eqx.partition((args, kwargs), is_arraylike)

    def dynamic_f(dynamic: Any) -> Any:
        a, k = eqx.combine(dynamic, static)
        return f(*a, **k)

    closed, shapes = jax.make_jaxpr(lambda d: jax.vjp(dynamic_f, d), return_shape=True)(
        dynamic
    )
    num_res = len(jax.tree.leaves(shapes[1]))
    residuals = [
        Residual(o.aval, o.source, o.name, o.per_iteration, _user_line(o.source_infos))
        for o in _jaxpr_residuals.residual_origins(closed, num_res)
    ]
    return residuals, closed


def _directories(*modules: Any) -> tuple[str, ...]:
    return tuple(os.path.dirname(m.__file__ or "") + os.sep for m in modules)


# Code that is not a library function the user called: JAX, runtime type checkers'
# wrappers, this library, and Python's own.
_INTERNAL = (
    *_directories(jax, jaxlib, jaxtyping, beartype),
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    sysconfig.get_paths()["stdlib"] + os.sep,
)
# Code that is not the user's: that, and the libraries a model is built from.
_NOT_THE_USERS = _INTERNAL + _directories(eqx, optax)
# beartype's wrappers are generated code, named `<@beartype(f) at 0x...>` (the
# code typed at a prompt, `<stdin>`, is the user's).
_GENERATED = "<@beartype("


def _user_line(source_infos: tuple) -> str | None:
    """`file.py:80 (loss_fn)`: the innermost frame of the user's code in the
    tracebacks of an equation and of the calls around it (innermost first), and
    `> softmax_cross_entropy` for the library function it called, if one's."""
    frames = [
        frame
        for info in source_infos
        for frame in getattr(getattr(info, "traceback", None), "frames", None) or ()
    ]
    frames = [f for f in frames if not f.file_name.startswith(_GENERATED)]
    called = next((f for f in frames if not f.file_name.startswith(_INTERNAL)), None)
    user = next((f for f in frames if not f.file_name.startswith(_NOT_THE_USERS)), None)
    if user is None:
        return None
    line = f"{os.path.basename(user.file_name)}:{user.line_num} ({_name(user)})"
    if called is not None and called is not user:
        line += f" > {_name(called)}"
    return line


def _name(frame: Any) -> str:
    """A frame's function, without the functions it is nested in."""
    return frame.function_name.rsplit("<locals>.", 1)[-1]


def checkpoint_names(closed: Any) -> list[str]:
    """Every `checkpoint_name` in a (closed) jaxpr, nested jaxprs included, in order
    of first occurrence."""
    eqns = [e for e in _jaxpr.equations(closed) if _jaxpr.is_checkpoint_name(e)]
    return list(dict.fromkeys(map(_jaxpr.checkpoint_name_of, eqns)))
