"""The optimizer update on the host's CPU (`Policy(update="host")`).

The optax update of the host-resident parameters and state runs where they live.
It runs inside the step, as JAX's host compute (`_compat.on_host`). So the update
moves only two things over the host link. These are the gradients the device sends,
and the parameters it computes with.

The update is traced once on the whole tree. It is inlined into a flat jaxpr
(`_dataflow.flatten`). An output is computed on the host if it lives there. It is
also computed there if it depends on a host-resident array. A global norm over
host-resident gradients makes every new leaf depend on all of them. Other outputs
are computed on the device. So a parameter whose state the policy keeps on the
device is updated there. Each side evaluates only the equations its outputs need.
Shared scalars (step counts, learning rates) are computed on both.

The host computation's inputs and outputs are all in host memory. The TPU compiler
aborts on a device-memory step count aliased to a host output. How JAX types the
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
    """`optax.apply_updates(params, optimizer.update(grads, opt_state, params))`.

    The host-resident part is computed on the host's CPU.

    - `params`: the trainable part of the model.
    - `out_kinds`: the memory kind of each new parameter and state leaf.
    - `metrics`: also the global norms of the gradients, updates and new parameters.
        Each leaf's sum of squares is computed where the leaf is. The sums are added
        on the device. So the norms tie no leaf to the host.
    - `form`: the form of JAX's host compute (`_compat.on_host`).

    **Returns:** the new parameters and optimizer state, in their memory kinds,
    and the metrics (on the device) or None.

    **Raises:**

    `NotOnHost` naming the optax code that cannot run on the host.
    """
    p_leaves, p_def = jtu.tree_flatten(params)
    s_leaves, s_def = jtu.tree_flatten(opt_state)
    args = (jtu.tree_leaves(grads), s_leaves, p_leaves)
    jaxpr = _trace(optimizer, args, (p_def, s_def), metrics)
    inputs = args[0] + args[1] + args[2]
    n_new = len(out_kinds[0] + out_kinds[1])
    kinds = out_kinds[0] + out_kinds[1]
    kinds += ["device"] * (len(jaxpr.outs) - len(kinds))
    on_host = _on_host_outputs(jaxpr, inputs, kinds)
    value_of = dict(zip(jaxpr.ins, inputs))
    outs: list[Any] = [None] * len(jaxpr.outs)
    if any(on_host):
        grads = frozenset(jaxpr.ins[: len(args[0])])
        values = _host_values(jaxpr, on_host, kinds, value_of, form, grads)
        positions = [k for k, h in enumerate(on_host) if h]
        for position, value in zip(positions, values, strict=True):
            outs[position] = value
    for position, value in _device_values(jaxpr, on_host, value_of).items():
        outs[position] = value
    outs = [
        to_space(jnp.asarray(x), kind, "") for x, kind in zip(outs, kinds, strict=True)
    ]
    n_p = len(p_leaves)
    new_params = jtu.tree_unflatten(p_def, outs[:n_p])
    new_state = jtu.tree_unflatten(s_def, outs[n_p:n_new])
    if not metrics:
        return new_params, new_state, None
    squares = outs[n_new:]
    sums = [sum(squares[i * n_p : (i + 1) * n_p]) for i in range(3)]
    return new_params, new_state, dict(zip(_metrics.METRICS, map(jnp.sqrt, sums)))


def _trace(
    optimizer: optax.GradientTransformation,
    args: tuple[list, list, list],
    trees: tuple[Any, Any],
    metrics: bool,
) -> _dataflow.FlatJaxpr:
    """The update on the leaves `args` (gradients, state, parameters), as a flat
    jaxpr; `trees` are the treedefs of the parameters and the state."""
    p_def, s_def = trees
    n_g, n_s = len(args[0]), len(args[1])

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

    inputs = args[0] + args[1] + args[2]
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
    closed = jax.make_jaxpr(apply)(*avals)
    check_runnable(closed)
    return _dataflow.flatten(closed)


def _on_host_outputs(
    jaxpr: _dataflow.FlatJaxpr, inputs: list, kinds: list[str]
) -> list[bool]:
    """Per output: whether the host computes it. It does for an output that lives
    there or depends on a host-resident array (scalars are not counted: a step
    count is read by both sides)."""
    tainted = {i for i, x in zip(jaxpr.ins, inputs) if is_host(x) and x.ndim}
    for e in jaxpr.eqns:
        if any(isinstance(r, int) and r in tainted for r in e.ins):
            tainted.update(e.outs)
    return [
        isinstance(ref, int) and (kind == "pinned_host" or ref in tainted)
        for ref, kind in zip(jaxpr.outs, kinds)
    ]


def _host_values(
    jaxpr: _dataflow.FlatJaxpr,
    on_host: list[bool],
    kinds: list[str],
    value_of: dict[int, Any],
    form: _compat.HostForm,
    grads: frozenset[int],
) -> list:
    """The outputs the host computes, in order. Non-scalar results the device
    keeps are written to device memory by the host computation itself (not to
    the host, then copied). `grads`: the inputs that are gradients."""
    refs = [r for r, h in zip(jaxpr.outs, on_host) if h]
    to_device = tuple(
        kind == "device" and bool(jaxpr.avals[r].shape)
        for r, kind, h in zip(jaxpr.outs, kinds, on_host)
        if h
    )
    return _on_host(jaxpr, refs, value_of, form, to_device, grads)


def _device_values(
    jaxpr: _dataflow.FlatJaxpr, on_host: list[bool], value_of: dict[int, Any]
) -> dict[int, Any]:
    """The outputs the device computes, by position."""
    refs = [r for r, h in zip(jaxpr.outs, on_host) if not h]
    env: dict[int, Any] = {i: _as_constant(c) for i, c in jaxpr.consts.items()}
    eqns = _dataflow.needed(jaxpr, refs)
    for i in _inputs_of(jaxpr, eqns, refs):
        env[i] = to_space(value_of[i], "device", "")
    _dataflow.run(jaxpr, eqns, env)
    return {
        position: ref.value if isinstance(ref, Literal) else env[ref]
        for position, (ref, h) in enumerate(zip(jaxpr.outs, on_host))
        if not h
    }


def _upcast(g: Any, p: Any) -> Any:
    """A gradient in a narrower dtype than its parameter (sent in the compute
    dtype) in the parameter's; any other as it is."""
    if g is None or g.dtype.itemsize >= p.dtype.itemsize:
        return g
    return g.astype(p.dtype)


def _on_host(
    jaxpr: _dataflow.FlatJaxpr,
    refs: list,
    value_of: dict[int, Any],
    form: _compat.HostForm,
    to_device: tuple[bool, ...],
    grads: frozenset[int],
) -> list:
    """The values of `refs` (variables of `jaxpr`), computed on the host from the
    inputs they need, moved to host memory first; the inputs in `grads`
    (gradients, computed in the step) as `_default_layout` gives them."""
    eqns = _dataflow.needed(jaxpr, refs)
    ins = _inputs_of(jaxpr, eqns, refs)
    with jax.named_scope(_scopes.GRAD):  # (device-resident values: mostly gradients)
        xs = [_default_layout(value_of[i]) if i in grads else value_of[i] for i in ins]
        args = [to_space(x, "pinned_host", "") for x in xs]
    consts = {i: _as_constant(c) for i, c in jaxpr.consts.items()}

    def compute(*xs: Any) -> list:
        env = dict(consts)
        env.update(zip(ins, xs))
        env = _dataflow.run(jaxpr, eqns, env)
        return [env[r] for r in refs]

    return list(_compat.on_host(compute, form, to_device)(*args))


def _default_layout(x: Any) -> Any:
    """`x`, a gradient, as the host computation's operand: on a GPU, given a
    leading axis of one and reshaped back, with an optimization barrier between,
    so that it is laid out by default.

    XLA:GPU makes the host computation's parameters before its layout
    assignment, in the layouts their operands have then, and never revisits
    them. The gradient of `x @ w` is the transpose of a product, first laid out
    transposed; layout assignment later gives the operand the default layout,
    and the compiler rejects the step: "The async-start expects the async shape
    at index {0} to match async computation parameter shape". A reshape is laid
    out by default, and the barrier keeps the pair from being folded away before
    the host computation is made. On a GPU each reshape then compiles to a
    bitcast; no axis is merged, so a sharded gradient keeps its sharding. A TPU
    lays the operand out itself: there the pair would cost a relayout on the
    host's CPU, so it is left out (`platform_dependent`)."""
    if jnp.ndim(x) < 2:
        return x

    def relaid(x: Any) -> Any:
        return jax.lax.reshape(jax.lax.optimization_barrier(x[None]), x.shape)

    return jax.lax.platform_dependent(x, cuda=relaid, rocm=relaid, default=lambda x: x)


def _inputs_of(jaxpr: _dataflow.FlatJaxpr, eqns: list[int], refs: list) -> list[int]:
    """The inputs of `jaxpr` that computing `refs` with the equations `eqns`
    reads (in input order)."""
    read = {r for n in eqns for r in jaxpr.eqns[n].ins if isinstance(r, int)}
    read.update(r for r in refs if isinstance(r, int))
    return [i for i in jaxpr.ins if i in read]


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
        reason = "a loop" if loop else "a side effect"
        raise NotOnHost(f"`{what}` ({reason}){where}")
