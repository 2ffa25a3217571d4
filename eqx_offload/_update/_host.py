"""The optimizer update on the host's CPU (`Policy(update="host")`): the optax
update of the host-resident parameters and state runs where they live, inside the
step (JAX's host compute, `_compat.on_host`), so that the only bytes the update
moves over the host link are the gradients the device sends and the parameters it
computes with.

The update is traced once on the whole tree and inlined into a flat program
(`_dataflow.flatten`). Every output is computed on the host if it lives there or
depends on a host-resident array (a global norm over host-resident gradients makes
every new leaf depend on all of them), and on the device otherwise: a parameter
whose state the policy keeps on the device is updated there. Each side evaluates
only the equations its outputs need; shared scalars (step counts, learning rates)
are computed on both.

The host computation's inputs and outputs are all in host memory (the TPU compiler
aborts on a device-memory step count aliased to a host output); how JAX types the
values inside is `_compat.on_host`'s business.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jax.core import Tracer

from .. import _compat, _jaxpr, _scopes
from .._memory_kinds import is_host, to_space
from . import _dataflow, _metrics
from ._dataflow import Literal


class NotOnHost(ValueError):
    """The optimizer does something the host computation cannot run."""


def update(
    optimizer: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    out_kinds: tuple[list[str], list[str]],
    metrics: bool = False,
    form: _compat.HostForm = "decorator",
) -> tuple[Any, Any, dict[str, Any] | None]:
    """`optax.apply_updates(params, optimizer.update(grads, opt_state, params))`
    with the host-resident part computed on the host's CPU. `params` is the
    trainable part of the model; `out_kinds` the memory kind of each new parameter
    and state leaf; `metrics`: also the global norms of the gradients, the updates
    and the new parameters (each leaf's sum of squares computed where the leaf
    is, so that the norms tie no leaf to the host, and added on the device);
    `form`: the form of JAX's host compute (`_compat.on_host`).

    **Returns:** the new parameters and optimizer state, in their memory kinds,
    and the metrics (on the device) or None.

    **Raises:**

    `NotOnHost` naming the optax code that cannot run on the host.
    """
    p_leaves, p_def = jtu.tree_flatten(params)
    g_leaves = jtu.tree_leaves(grads)
    s_leaves, s_def = jtu.tree_flatten(opt_state)
    n_p, n_g, n_s = len(p_leaves), len(g_leaves), len(s_leaves)
    inputs = g_leaves + s_leaves + p_leaves

    def apply(*xs: Any) -> list:
        g, s, p = xs[:n_g], xs[n_g : n_g + n_s], xs[n_g + n_s :]
        # A gradient sent in the compute dtype, cast where the update runs.
        g = [_upcast(gi, pi) for gi, pi in zip(g, p, strict=True)]
        grads = jtu.tree_unflatten(p_def, g)
        p_tree = jtu.tree_unflatten(p_def, p)
        updates, state = optimizer.update(grads, jtu.tree_unflatten(s_def, s), p_tree)
        new = eqx.apply_updates(p_tree, updates)
        out = jtu.tree_leaves(new) + jtu.tree_leaves(state)
        if metrics:  # each leaf's sum of squares, computed where the leaf is
            for tree in (grads, updates, new):
                out += [_metrics.squares(x) for x in jtu.tree_leaves(tree)]
        return out

    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
    closed = jax.make_jaxpr(apply)(*avals)
    check_runnable(closed)
    program = _dataflow.flatten(closed)
    kinds = out_kinds[0] + out_kinds[1]
    kinds += ["device"] * (len(program.outs) - len(kinds))

    # Which values depend on a host-resident array (scalars are not counted: a
    # step count is read by both sides).
    host_ins = {i for i, x in zip(program.ins, inputs) if is_host(x) and x.ndim}
    tainted = set(host_ins)
    for e in program.eqns:
        if any(isinstance(r, int) and r in tainted for r in e.ins):
            tainted.update(e.outs)
    on_host = [
        isinstance(ref, int) and (kind == "pinned_host" or ref in tainted)
        for ref, kind in zip(program.outs, kinds)
    ]
    value_of = dict(zip(program.ins, inputs))
    outs: list[Any] = [None] * len(program.outs)

    host_refs = [r for r, h in zip(program.outs, on_host) if h]
    if host_refs:
        # Non-scalar results the device keeps are written to device memory by the
        # host computation itself (not to the host, then copied).
        to_device = tuple(
            kind == "device" and bool(program.avals[r].shape)
            for r, kind, h in zip(program.outs, kinds, on_host)
            if h
        )
        values = _on_host(program, host_refs, value_of, form, to_device)
        for position, value in zip(
            [k for k, h in enumerate(on_host) if h], values, strict=True
        ):
            outs[position] = value

    device_refs = [r for r, h in zip(program.outs, on_host) if not h]
    env: dict[int, Any] = {i: _as_constant(c) for i, c in program.consts.items()}
    device_eqns = _dataflow.needed(program, device_refs)
    for i in _inputs_of(program, device_eqns, device_refs):
        env[i] = to_space(value_of[i], "device", "")
    _dataflow.run(program, device_eqns, env)
    for position, (ref, h) in enumerate(zip(program.outs, on_host)):
        if not h:
            outs[position] = ref.value if isinstance(ref, Literal) else env[ref]

    outs = [
        to_space(jnp.asarray(x), kind, "") for x, kind in zip(outs, kinds, strict=True)
    ]
    new_params = jtu.tree_unflatten(p_def, outs[:n_p])
    new_state = jtu.tree_unflatten(s_def, outs[n_p : len(out_kinds[0] + out_kinds[1])])
    if not metrics:
        return new_params, new_state, None
    squares = outs[len(out_kinds[0] + out_kinds[1]) :]
    sums = [sum(squares[i * n_p : (i + 1) * n_p]) for i in range(3)]
    return new_params, new_state, dict(zip(_metrics.METRICS, map(jnp.sqrt, sums)))


def _upcast(g: Any, p: Any) -> Any:
    """A gradient in a narrower dtype than its parameter (sent in the compute
    dtype) in the parameter's; any other as it is."""
    if g is None or g.dtype.itemsize >= p.dtype.itemsize:
        return g
    return g.astype(p.dtype)


def _on_host(
    program: _dataflow.FlatJaxpr,
    refs: list,
    value_of: dict[int, Any],
    form: _compat.HostForm,
    to_device: tuple[bool, ...],
) -> list:
    """The values of `refs` (variables of `program`), computed on the host from the
    inputs they need, moved to host memory first."""
    eqns = _dataflow.needed(program, refs)
    ins = _inputs_of(program, eqns, refs)
    with jax.named_scope(_scopes.GRAD):  # (device-resident values: mostly gradients)
        args = [to_space(value_of[i], "pinned_host", "") for i in ins]
    consts = {i: _as_constant(c) for i, c in program.consts.items()}

    def compute(*xs: Any) -> list:
        env = dict(consts)
        env.update(zip(ins, xs))
        env = _dataflow.run(program, eqns, env)
        return [env[r] for r in refs]

    return list(_compat.on_host(compute, form, to_device)(*args))


def _inputs_of(program: _dataflow.FlatJaxpr, eqns: list[int], refs: list) -> list[int]:
    """The inputs of `program` that computing `refs` with the equations `eqns`
    reads (in input order)."""
    read = {r for n in eqns for r in program.eqns[n].ins if isinstance(r, int)}
    read.update(r for r in refs if isinstance(r, int))
    return [i for i in program.ins if i in read]


def _as_constant(c: Any) -> Any:
    """A constant the update closes over, as a NumPy array: a constant of the
    traced program wherever it is used, not an array committed to a device. A
    traced value (a learning rate passed to the step) stays as it is: the host
    computation takes it as an operand."""
    if isinstance(c, Tracer) or not isinstance(c, jax.Array):
        return c
    return np.asarray(c)


def check_runnable(closed: Any) -> None:
    """Raises `NotOnHost` for an equation of the update that the host computation
    cannot run: a loop (`while`, `scan`: an optax line search) or a side effect (a
    callback), naming the optax code it comes from."""
    for eqn in _jaxpr.equations(closed):
        loop = _jaxpr.is_while(eqn) or _jaxpr.is_scan(eqn)
        if not (loop or _jaxpr.has_effects(eqn)):
            continue
        what = _jaxpr.primitive_name(eqn)
        source = _jaxpr.source_function(eqn, "optax")
        where = f" in optax's {source}" if source else ""
        kind = "a loop" if loop else "a side effect"
        raise NotOnHost(f"`{what}` ({kind}){where}")
