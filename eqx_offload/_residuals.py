"""Residuals: the values a function saves in its forward pass for its backward pass.

This is `jax.ad_checkpoint.print_saved_residuals` as data, built from public APIs
only (`jax.make_jaxpr` of `jax.vjp`): each residual's abstract value (which carries
its memory space, `f32<host>[...]`) and where it came from, including the checkpoint
name when it is the output of `checkpoint_name`, and the line of the user's code
that computed it (from the equation's traceback).
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

from . import _jaxpr
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
    flat, treedef = jax.tree.flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if is_arraylike(x)]

    def flat_f(*xs):
        leaves = list(flat)
        for i, x in zip(positions, xs):
            leaves[i] = x
        a, k = jax.tree.unflatten(treedef, leaves)
        return f(*a, **k)

    closed, shapes = jax.make_jaxpr(
        lambda *xs: jax.vjp(flat_f, *xs), return_shape=True
    )(*[flat[i] for i in positions])
    jaxpr = closed.jaxpr
    num_res = len(jax.tree.leaves(shapes[1]))
    outvars = jaxpr.outvars[len(jaxpr.outvars) - num_res :]
    producers: dict[int, dict] = {}  # per jaxpr, the equation producing each var
    residuals = [_origin(v, jaxpr, producers)._replace(aval=v.aval) for v in outvars]
    return residuals, closed


def _origin(v: Any, jaxpr: Any, producers: dict[int, dict]) -> Residual:
    """Where residual `v` of `jaxpr` comes from. Looks through `jit` calls,
    `reduce_precision`, a cast onto `Auto` axes, the `device_put` that offloads a
    named value, and into the body of a scan whose per-iteration output (one slice
    per layer) it is."""
    return _WalkBack(v, jaxpr, producers).find()


class _WalkBack:
    """A walk back from a value to the equation or input it comes from."""

    def __init__(self, v: Any, jaxpr: Any, producers: dict[int, dict]):
        self.v = v
        self.jaxpr = jaxpr
        self.producers = producers  # per jaxpr, the equation producing each var
        self.enclosing: list[tuple[Any, Any]] = []  # (outer jaxpr, jit or scan)
        self.per_iteration = False  # inside a scan, for its stacked output

    def find(self) -> Residual:
        found = None
        while found is None:
            found = self._step()
        return found

    def _step(self) -> Residual | None:
        """One step back: the residual if it is found, else None."""
        if _jaxpr.is_literal(self.v):
            return self._found("literal")
        eqn = _producers(self.jaxpr, self.producers).get(self.v)
        if eqn is None:
            return self._out_of_call()
        return self._through(eqn)

    def _out_of_call(self) -> Residual | None:
        """`v` is an input of the jaxpr: on to the operand of the call around it."""
        invars = self.jaxpr.invars
        if not (self.enclosing and self.v in invars):
            return self._found("argument" if self.v in invars else "constant")
        outer, call = self.enclosing.pop()
        position = invars.index(self.v)
        if _jaxpr.is_scan(call):
            scan = _jaxpr.scan_layout(call)
            if scan.consts <= position < scan.consts + scan.carry:
                # The carry entering an iteration (a layer's input), saved.
                names = [
                    _jaxpr.checkpoint_name_of(e)
                    for e in self.jaxpr.eqns
                    if _jaxpr.is_checkpoint_name(e) and e.invars[0] is self.v
                ]
                return self._found("named", names[0]) if names else self._found("carry")
        self.v, self.jaxpr = call.invars[position], outer
        return None

    def _through(self, eqn: Any) -> Residual | None:
        """On through `eqn`, which computes `v`, where it only passes a value on."""
        index = eqn.outvars.index(self.v)
        body = _jaxpr.jit_body(eqn)
        if _jaxpr.is_reduce_precision(eqn) or (
            _jaxpr.is_reshard(eqn) and _to_auto(eqn)
        ):
            self.v = eqn.invars[0]
        elif body is not None:
            self.enclosing.append((self.jaxpr, eqn))
            self.jaxpr = body
            self.v = body.outvars[index]
        elif _jaxpr.is_scan(eqn) and index >= _jaxpr.scan_layout(eqn).carry:
            self.enclosing.append((self.jaxpr, eqn))
            self.per_iteration = True
            self.jaxpr = _jaxpr.scan_layout(eqn).body
            self.v = self.jaxpr.outvars[index]
        else:
            return self._computed(eqn, index)
        return None

    def _computed(self, eqn: Any, index: int) -> Residual:
        """`v` computed by `eqn`: a named value (perhaps offloaded), or the user's."""
        named = eqn
        if _jaxpr.is_device_put(eqn):  # the offload of a named value?
            named = _producers(self.jaxpr, self.producers).get(eqn.invars[index])
        if named is not None and _jaxpr.is_checkpoint_name(named):
            return self._found("named", _jaxpr.checkpoint_name_of(named))
        # An equation inside a `jit` keeps only the frames below that call: the
        # calls around it have the rest.
        calls = [eqn] + [call for _, call in reversed(self.enclosing)]
        where = _user_line([e.source_info for e in calls])
        return self._found(_jaxpr.primitive_name(eqn), where=where)

    def _found(
        self, source: str, name: str | None = None, where: str | None = None
    ) -> Residual:
        return Residual(self.v.aval, source, name, self.per_iteration, where)


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


def _user_line(source_infos: list[Any]) -> str | None:
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


def _to_auto(eqn: Any) -> bool:
    """Whether a `reshard` casts onto a mesh of `Auto` axes only (the way into
    `jax.sharding.auto_axes`, `Policy(loss_axes="auto")`): the same buffer, in the
    layout it had (JAX emits no sharding constraint for it)."""
    mesh = _jaxpr.reshard_destination(eqn).mesh
    return all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def _producers(jaxpr: Any, cache: dict[int, dict]) -> dict:
    if id(jaxpr) not in cache:
        cache[id(jaxpr)] = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    return cache[id(jaxpr)]


def checkpoint_names(closed: Any) -> list[str]:
    """Every `checkpoint_name` in a (closed) jaxpr, nested jaxprs included, in order
    of first occurrence."""
    seen: dict[str, None] = {}
    for eqn in _jaxpr.equations(closed):
        if _jaxpr.is_checkpoint_name(eqn):
            seen.setdefault(_jaxpr.checkpoint_name_of(eqn), None)
    return list(seen)
