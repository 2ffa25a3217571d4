"""Residuals: the values a function saves in its forward pass for its backward pass.

This is `jax.ad_checkpoint.print_saved_residuals` as data, built from public APIs
only (`jax.make_jaxpr` of `jax.vjp`): each residual's abstract value (which carries
its memory space, `f32<host>[...]`) and where it came from, including the checkpoint
name when it is the output of `checkpoint_name`.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex


class Residual(NamedTuple):
    """One saved residual."""

    aval: Any  # a `jax.core.ShapedArray`
    source: str  # "argument", "constant", "literal", "named" or a primitive's name
    name: str | None = None  # the checkpoint name, when `source == "named"`
    per_iteration: bool = False  # stacked over a scan's iterations (one per layer)

    @property
    def host(self) -> bool:
        return getattr(self.aval, "memory_space", None) == jax.memory.Space.Host

    @property
    def nbytes(self) -> int:
        return int(self.aval.size) * self.aval.dtype.itemsize


def saved_residuals(f: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """The residuals `jax.vjp(f, *args, **kwargs)` saves, traced abstractly."""
    flat, treedef = jax.tree.flatten((args, kwargs))

    def flat_f(*xs):
        a, k = jax.tree.unflatten(treedef, xs)
        return f(*a, **k)

    closed, shapes = jax.make_jaxpr(
        lambda *xs: jax.vjp(flat_f, *xs), return_shape=True
    )(*flat)
    jaxpr = closed.jaxpr
    num_res = len(jax.tree.leaves(shapes[1]))
    outvars = jaxpr.outvars[len(jaxpr.outvars) - num_res :]
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    invars, constvars = set(jaxpr.invars), set(jaxpr.constvars)
    out = []
    for v in outvars:
        if isinstance(v, jex.Literal):
            out.append(Residual(v.aval, "literal"))
            continue
        # A value rounded by `reduce_precision` is attributed to what it rounds.
        while v in producer and producer[v].primitive.name == "reduce_precision":
            v = producer[v].invars[0]
        if v in invars:
            out.append(Residual(v.aval, "argument"))
        elif v in constvars:
            out.append(Residual(v.aval, "constant"))
        elif producer[v].primitive.name == "name":
            out.append(Residual(v.aval, "named", producer[v].params["name"]))
        elif producer[v].primitive.name == "scan":
            eqn = producer[v]
            per_iteration = eqn.outvars.index(v) >= eqn.params["num_carry"]
            out.append(Residual(v.aval, "scan", per_iteration=per_iteration))
        else:
            out.append(Residual(v.aval, producer[v].primitive.name))
    return out


def checkpoint_names(closed: Any) -> list[str]:
    """Every `checkpoint_name` in a (closed) jaxpr, nested jaxprs included, in order
    of first occurrence."""
    seen: dict[str, None] = {}

    def visit(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                seen.setdefault(eqn.params["name"], None)
            for sub in jex.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(getattr(closed, "jaxpr", closed))
    return list(seen)
