"""The optimizer update on the host's CPU (`Policy(update="host")`).

The optax update of the host-resident parameters and state runs where they live.
It runs inside the step, as JAX's host compute (`_compat.on_host`). So the update
moves only two things over the host link. These are the gradients the device sends,
and the parameters it computes with.

The update is traced once on the whole tree. It is inlined into a flat jaxpr
(`_jaxpr_dataflow.flatten`). An output is computed on the host if it lives there. It is
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

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jax.core import Tracer

from .. import _compat, _jaxpr, _jaxpr_dataflow as _dataflow, _scopes
from .._memory_kinds import is_host, to_space
from . import _metrics


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
    apply, leaves, (p_def, s_def) = _metrics.flat_update(
        optimizer, (grads, opt_state, params), _metrics.squares if metrics else None
    )
    inputs = leaves[0] + leaves[1] + leaves[2]
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
    closed = jax.make_jaxpr(apply)(*avals)
    check_runnable(closed)
    jaxpr = _dataflow.flatten(closed)
    kinds = out_kinds[0] + out_kinds[1]
    n_new, n_p = len(kinds), len(leaves[2])
    kinds += ["device"] * (len(jaxpr.outs) - n_new)
    outs = _split(jaxpr, inputs, kinds, form, len(leaves[0]))
    new_params = jtu.tree_unflatten(p_def, outs[:n_p])
    new_state = jtu.tree_unflatten(s_def, outs[n_p:n_new])
    norms = _metrics.from_squares(outs[n_new:], n_p) if metrics else None
    return new_params, new_state, norms


def _split(
    jaxpr: _dataflow.FlatJaxpr,
    inputs: list,
    kinds: list[str],
    form: _compat.HostForm,
    n_grads: int,
) -> list:
    """The outputs of `jaxpr` on `inputs` (the first `n_grads` are gradients), each
    in its memory kind (`kinds`): computed on the host if it lives there or
    depends on a host-resident array (not a scalar: both sides read a step count),
    else on the device."""
    value_of = dict(zip(jaxpr.ins, inputs))
    host_arrays = {i for i, x in value_of.items() if is_host(x) and x.ndim}
    tainted = _dataflow.dependents(jaxpr, host_arrays)
    on_host = [_on_host_output(r, k, tainted) for r, k in zip(jaxpr.outs, kinds)]
    host = [(r, k) for r, k, h in zip(jaxpr.outs, kinds, on_host) if h]
    grads = frozenset(jaxpr.ins[:n_grads])
    host_values = _on_host(jaxpr, host, value_of, form, grads) if host else []
    device_refs = [r for r, h in zip(jaxpr.outs, on_host) if not h]
    compute, ins = _evaluator(jaxpr, device_refs)
    device_values = compute(*[to_space(value_of[i], "device", "") for i in ins])
    found = iter(host_values), iter(device_values)
    return [
        to_space(jnp.asarray(next(found[0] if h else found[1])), kind, "")
        for h, kind in zip(on_host, kinds, strict=True)
    ]


def _on_host_output(ref: Any, kind: str, tainted: set[int]) -> bool:
    """Whether the host computes an output: one that lives there, or depends on a
    host-resident array."""
    return isinstance(ref, int) and (kind == "pinned_host" or ref in tainted)


def _evaluator(jaxpr: _dataflow.FlatJaxpr, refs: list) -> tuple[Any, list[int]]:
    """A function that computes `refs` (values of `jaxpr`) from the inputs it
    needs, and those inputs (in input order)."""
    ops = _dataflow.needed(jaxpr, refs)
    read = _dataflow.reads(jaxpr, ops, refs)
    ins = [i for i in jaxpr.ins if i in read]
    consts = {i: _as_constant(c) for i, c in jaxpr.consts.items()}

    def compute(*xs: Any) -> list:
        env = _dataflow.run(jaxpr, ops, {**consts, **dict(zip(ins, xs))})
        return [_dataflow.value(r, env) for r in refs]

    return compute, ins


def _on_host(
    jaxpr: _dataflow.FlatJaxpr,
    outs: list[tuple[int, str]],
    value_of: dict[int, Any],
    form: _compat.HostForm,
    grads: frozenset[int],
) -> list:
    """The values of `outs` (values of `jaxpr`, with their memory kinds), computed
    on the host from the inputs they need, moved to host memory first; the inputs
    in `grads` (gradients, computed in the step) as `_default_layout` gives them.
    Non-scalar results the device keeps are written to device memory by the host
    computation itself (not to the host, then copied)."""
    compute, ins = _evaluator(jaxpr, [r for r, _ in outs])
    to_device = tuple(k == "device" and bool(jaxpr.avals[r].shape) for r, k in outs)
    with jax.named_scope(_scopes.GRAD):  # (device-resident values: mostly gradients)
        xs = [_default_layout(value_of[i]) if i in grads else value_of[i] for i in ins]
        args = [to_space(x, "pinned_host", "") for x in xs]
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
