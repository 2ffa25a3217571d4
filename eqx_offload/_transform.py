"""`filter_offload`: the filtered transform that configures every `Stacked`."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.tree_util as jtu

from . import _context, _names, _paths
from ._memory_kinds import is_host
from ._policy import Policy
from ._stacked import Stacked


def _is_stacked(x: Any) -> bool:
    return isinstance(x, Stacked)


class _ArgLeaf(NamedTuple):
    argument: str  # "argument 0" or "argument `key`"
    leaf: _paths.Leaf


def _argument_leaves(args: tuple, kwargs: dict) -> list[_ArgLeaf]:
    """Every leaf of `(args, kwargs)`, in `jax.tree.flatten` order, with its path
    from the argument holding it."""
    out = []
    for argument, arg in _named_arguments(args, kwargs):
        out.extend(_ArgLeaf(argument, leaf) for leaf in _paths.leaves(arg))
    return out


def _find_stacked(args: tuple, kwargs: dict) -> list[_context.StackedArgument]:
    """Every top-level `Stacked` in the arguments, with its path. Two halves of one
    model (`eqx.partition`) may share a path; two different layer stacks may not, as
    their checkpoint names would collide."""
    found: list[_context.StackedArgument] = []
    for argument, arg in _named_arguments(args, kwargs):
        flat, _ = jtu.tree_flatten_with_path(arg, is_leaf=_is_stacked)
        for keys, x in flat:
            if not isinstance(x, Stacked):
                continue
            path = _paths.join("", keys)
            entry = _context.StackedArgument(
                path, argument, *_context.describe(x.layers)
            )
            leaves = {p for p, _ in entry.signature}
            for other in found:
                if other.path == path and leaves & {p for p, _ in other.signature}:
                    raise ValueError(
                        f"`filter_offload`: {other.argument} and {argument} both "
                        f"hold a `Stacked` at path {path!r} with arrays at the same "
                        "leaves, so their checkpoint names would collide; pass them "
                        "inside one pytree (e.g. a tuple or dict) instead."
                    )
            found.append(entry)
    return found


def _named_arguments(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    return [(f"argument {i}", a) for i, a in enumerate(args)] + [
        (f"argument `{k}`", kwargs[k]) for k in sorted(kwargs)
    ]


def _host_to_device(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Moves host-resident leaves outside any `Stacked` to the device."""

    def move(x: Any) -> Any:
        if eqx.is_array(x) and is_host(x):
            return jax.device_put(x, jax.memory.Space.Device)
        return x

    return jtu.tree_map(move, (args, kwargs), is_leaf=_is_stacked)


class _Misuse(NamedTuple):
    leaf: _ArgLeaf
    primitive: str


def _find_misuse(
    jaxpr: Any, watched: dict[Any, tuple[_ArgLeaf, bool]]
) -> _Misuse | None:
    """Finds an operation that touches a host-resident stacked leaf outside the scan
    that brings it to the device layer by layer.

    `watched` maps a variable to its leaf and whether it is one layer's slice (inside
    a scan over it) rather than the whole stacked leaf. A whole leaf may only be
    scanned over; a slice may only be moved to the device. Both may pass through
    calls (`jit`, `checkpoint`, custom derivatives), which are followed inside.
    """
    for eqn in jaxpr.eqns:
        used = [
            (i, watched[v])
            for i, v in enumerate(eqn.invars)
            if not isinstance(v, jex.Literal) and v in watched
        ]
        if not used:
            continue
        name = eqn.primitive.name
        subs = list(jex.jaxprs_in_params(eqn.params))
        if name == "scan":
            body = subs[0]
            first_x = eqn.params["num_consts"] + eqn.params["num_carry"]
            inner = {}
            for i, (leaf, is_slice) in used:
                if i < first_x or is_slice:
                    return _Misuse(leaf, "scan")
                inner[body.invars[i]] = (leaf, True)
            found = _find_misuse(body, inner)
        elif name == "device_put":
            found = None
            for i, (leaf, is_slice) in used:
                if not is_slice or eqn.params["devices"][i] != jax.memory.Space.Device:
                    return _Misuse(leaf, name)
        elif len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
            found = _find_misuse(subs[0], {subs[0].invars[i]: w for i, w in used})
        else:
            return _Misuse(used[0][1][0], name)
        if found is not None:
            return found
    return None


def _call_checked(fun: Callable, args: tuple, kwargs: dict) -> Any:
    """Calls `fun`, tracing it to a jaxpr first to check that no host-resident stacked
    leaf is used outside its scan; the jaxpr is then evaluated, so `fun` runs once."""
    flat, treedef = jtu.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if eqx.is_array(x)]
    info = _argument_leaves(args, kwargs)
    out_parts = []

    def flat_fun(*dynamic: Any) -> list:
        leaves = list(flat)
        for i, x in zip(positions, dynamic):
            leaves[i] = x
        a, k = jtu.tree_unflatten(treedef, leaves)
        out_dynamic, out_static = eqx.partition(fun(*a, **k), eqx.is_array)
        out_leaves, out_treedef = jtu.tree_flatten(out_dynamic)
        out_parts.append((out_treedef, out_static))
        return out_leaves

    dynamic = [flat[i] for i in positions]
    closed = jax.make_jaxpr(flat_fun)(*dynamic)
    watched = {
        var: (info[i], False)
        for var, i in zip(closed.jaxpr.invars, positions)
        if info[i].leaf.stacked is not None and is_host(flat[i])
    }
    misuse = _find_misuse(closed.jaxpr, watched)
    if misuse is not None:
        leaf = misuse.leaf.leaf
        raise ValueError(
            f"`filter_offload`: leaf {leaf.path!r} of {misuse.leaf.argument} is a "
            f"host-resident layer of the `Stacked` at {leaf.stacked!r}; it is brought "
            "to the device one layer at a time inside that `Stacked`'s scan, but "
            f"here it is used outside it (by `{misuse.primitive}`). Compute this "
            "inside the layers instead; for weight decay use "
            "`optax.add_decayed_weights`; or keep these parameters on the device, "
            f"e.g. `Policy(params={{{leaf.stacked!r}: 'device'}})`."
        )
    out_treedef, out_static = out_parts[0]
    out_dynamic = jtu.tree_unflatten(out_treedef, jex.jaxpr_as_fun(closed)(*dynamic))
    return eqx.combine(out_dynamic, out_static)


class _OffloadWrapper(eqx.Module):
    _fun: Callable
    _policy: Policy = eqx.field(static=True)

    @property
    def __wrapped__(self) -> Callable:
        return self._fun

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _host_to_device(args, kwargs)
        host_stacked = any(
            a.leaf.stacked is not None and is_host(a.leaf.value)
            for a in _argument_leaves(args, kwargs)
            if eqx.is_array(a.leaf.value)
        )
        if host_stacked:
            return _call_checked(self._run, args, kwargs)
        return self._run(*args, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        context = _context.CallContext(self._policy, _find_stacked(args, kwargs))
        with _context.calling(context):
            out = self._fun(*args, **kwargs)
        _names.check(self._policy, context.log)
        return out


def filter_offload(fun: Callable | None = None, policy: Policy | None = None) -> Any:
    """Applies an offloading `Policy` to `fun`, the way `eqx.filter_jit` applies
    `jax.jit`: array leaves of the arguments are traced, everything else is static.

    Every `Stacked` in the arguments is applied, inside `fun`, as a configured view
    (still a `Stacked`) whose scan body

    1. moves that layer's host-resident parameter slices to the device,
    2. names the carry entering the layer `"<path>.input"` (its first operation) and
       the output of every submodule whose path a policy pattern matches,
    3. wraps the layer in `jax.checkpoint` with the policy's `save`/`offload` names
       (no checkpoint with `save="all"`).

    Host-resident leaves outside any `Stacked` are moved to the device where `fun`
    starts. `filter_offload` does not compile by itself: compose it with `jax.jit`,
    `eqx.filter_jit`, `jax.grad`, `eqx.filter_value_and_grad`, ... as usual.

    **Arguments:**

    - `fun`: the function, e.g. a loss `loss_fn(model, *batch)`.
    - `policy`: an `eqx_offload.Policy`; only `save`, `offload` and `offload_dst`
        matter here (parameter placement is `place`'s and `train_step`'s job).

    **Returns:**

    A callable with the signature of `fun`.

    **Raises (while tracing):**

    - `ValueError` if a `save`/`offload` name or pattern never occurs, or occurs but
        names no residual (e.g. a block's output), listing the names that did occur;
    - `ValueError` if `fun` uses a host-resident stacked leaf outside its scan (e.g.
        an L2 penalty over `pinned_host` layers), naming the leaf and the fix;
    - `ValueError` if two arguments hold a `Stacked` at the same path.

    !!! Example

        ```python
        policy = eo.Policy.offload_residuals()

        @eqx.filter_jit
        @eqx.filter_grad
        @eo.filter_offload(policy=policy)
        def loss(model, x, y):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)
        ```
    """
    if fun is None:
        return functools.partial(filter_offload, policy=policy)
    if policy is None:
        raise TypeError(
            "`filter_offload(fun, policy)` needs a policy, e.g. "
            "`eqx_offload.Policy.offload_residuals()`."
        )
    return eqx.module_update_wrapper(_OffloadWrapper(fun, policy))
