"""`filter_offload`: the filtered transform that configures every `Stacked`."""

import functools
from collections.abc import Callable
from typing import Any, cast, NamedTuple

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.tree_util as jtu
from jax.sharding import PartitionSpec

from . import (
    _checkpoint_name_log,
    _compat,
    _grad_taps,
    _jaxpr,
    _layout,
    _paths,
    _pending,
    _tiling,
    _vocab_blocks,
)
from ._memory_kinds import is_host, is_host_aval
from ._policy import check_policy, checkpoint_patterns, Policy, replace
from ._scan_body import configure
from ._stacked import Stacked
from ._warn import warn_at_caller


def _is_stacked(x: Any) -> bool:
    return isinstance(x, Stacked)


def _named_arguments(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The arguments in the order `jax.tree.flatten((args, kwargs))` visits them."""
    return [(f"argument {i}", a) for i, a in enumerate(args)] + [
        (f"argument `{k}`", kwargs[k]) for k in sorted(kwargs)
    ]


def _configure_all(
    args: tuple, kwargs: dict, policy: Policy, streamed: set[str]
) -> tuple[tuple, dict]:
    """Replaces every top-level `Stacked` in the arguments by its configured view,
    and moves host-resident leaves outside any `Stacked` to the device, except the
    model's `streamed` ones.

    Every half of an `eqx.partition`ed model is configured alike, so `eqx.combine`
    inside `fun` sees matching pytrees. Two halves may share a path; two different
    layer stacks (with arrays at the same leaves) may not: their names would collide.
    """
    owners: dict[str, tuple[str, set[str]]] = {}

    def prepare(arg: Any, argument: str) -> Any:
        flat, treedef = jtu.tree_flatten_with_path(arg, is_leaf=_is_stacked)
        out = []
        for keys, x in flat:
            if isinstance(x, Stacked):
                path = _paths.join("", keys)
                arrays = {
                    leaf.path
                    for leaf in _paths.leaves(x.layers)
                    if eqx.is_array(leaf.value)
                }
                other, other_arrays = owners.get(path, (None, set()))
                if other is not None and arrays & other_arrays:
                    raise ValueError(
                        f"`filter_offload`: {other} and {argument} both hold a "
                        f"`Stacked` at path {path!r} with arrays at the same leaves, "
                        "so their checkpoint names would collide; pass them inside "
                        "one pytree (e.g. a tuple or dict) instead."
                    )
                owners[path] = (argument, arrays | other_arrays)
                x = configure(x, path, policy)
            elif eqx.is_array(x):
                path = _paths.join("", keys)
                # The model (argument 0) is what `Policy` describes.
                stays = argument == "argument 0" and path in streamed
                if is_host(x) and not stays:
                    x = jax.device_put(x, jax.memory.Space.Device)
                if argument == "argument 0":
                    found = _grad_taps.lookup(path)
                    if found is not None:
                        x = _grad_taps.tap(x, found.acc, found.dtype, found.read)
                    if not stays:
                        x = _layout.gather_fsdp(x, path, policy.shard)
            out.append(x)
        return jtu.tree_unflatten(treedef, out)

    named = dict(_named_arguments(args, kwargs))  # validate in flattening order
    done = {name: prepare(arg, name) for name, arg in named.items()}
    args = tuple(done[f"argument {i}"] for i in range(len(args)))
    kwargs = {k: done[f"argument `{k}`"] for k in kwargs}
    return args, kwargs


def _streamed_paths(model: Any, policy: Policy) -> set[str]:
    """The paths of the model's leaves that `Policy(stream=...)` keeps on the host
    inside the step. Each pattern must match a host-resident `[vocab, dim]` leaf
    outside any `Stacked`."""
    if not policy.stream:
        return set()
    flat = jtu.tree_flatten_with_path(model, is_leaf=_is_stacked)[0]
    arrays = {
        _paths.join("", keys): x
        for keys, x in flat
        if eqx.is_array(x) and not isinstance(x, Stacked)
    }
    found = set()
    for pattern in policy.stream:
        matched = {p for p in arrays if _paths.prefix_match(pattern, p) is not None}
        if not matched:
            raise ValueError(
                f"`Policy(stream=...)` has {pattern!r}, which matches no leaf of the "
                "model outside a `Stacked` (layers are streamed by their scan "
                f"already); leaves include {_paths.quoted(sorted(arrays), 5)}."
            )
        for path in sorted(matched):
            x = arrays[path]
            if not is_host(x) or x.ndim != 2:
                where = "on the device" if not is_host(x) else f"of shape {x.shape}"
                raise ValueError(
                    f"`Policy(stream=...)`: leaf {path!r} is {where}; a streamed "
                    "leaf is a host-resident `[vocab, dim]` table. Place it on the "
                    f"host (`Policy(params={{{path!r}: 'pinned_host'}})` or "
                    "`offload_all`) or drop the pattern."
                )
        found |= matched
    return found


def _warn_layer_lists(args: tuple, kwargs: dict, streamed: set[str]) -> None:
    """Warns of layers held in a Python list or tuple with host-resident parameters:
    outside a `Stacked`, host-resident leaves are moved to the device where the
    function starts, so every layer is on the device at once and nothing streams."""
    for argument, arg in _named_arguments(args, kwargs):
        flat = jtu.tree_flatten_with_path(
            arg, is_leaf=lambda x: _is_stacked(x) or _is_layer_list(x)
        )[0]
        for keys, x in flat:
            if not _is_layer_list(x):
                continue
            path = _paths.join("", keys)
            host = [
                _paths.join(path, leaf.path)
                for leaf in _paths.leaves(x)
                if eqx.is_array(leaf.value) and is_host(leaf.value)
            ]
            model = argument == "argument 0"  # what `Policy(stream=...)` is of
            if model:
                host = [p for p in host if p not in streamed]
            if not host:
                continue
            name = path.rsplit(".", 1)[-1] or "layers"
            where = repr(path) if model else f"{path!r} of {argument}"
            warn_at_caller(
                f"`filter_offload`: {where} is a Python {type(x).__name__} of "
                f"{len(x)} layers of one structure with host-resident parameters "
                f"({_paths.quoted(host, 3)}). Outside a `Stacked`, host-resident "
                "leaves are moved to the device where the function starts: all "
                f"{len(x)} layers are moved to the device whole, each step, and "
                "nothing streams. Hold them in an `eo.Stacked` (`eo.Stacked."
                f"from_layers({name})`, or `eo.Stacked.from_fn(make_layer, {len(x)}, "
                f"key=key)`) and apply it as `self.{name}(x)`: its scan brings one "
                "layer to the device at a time."
            )


def _is_layer_list(x: Any) -> bool:
    """A list or tuple of two or more modules of one structure (leaf shapes and
    dtypes included): repeated layers."""
    if not isinstance(x, list | tuple) or len(x) < 2:
        return False
    if not all(isinstance(m, eqx.Module) and not _is_stacked(m) for m in x):
        return False

    def signature(module: Any) -> tuple:
        leaves, treedef = jtu.tree_flatten(module)
        return treedef, [(a.shape, a.dtype) for a in leaves if eqx.is_array(a)]

    first = signature(x[0])
    try:
        return all(signature(m) == first for m in x[1:])
    except (TypeError, ValueError):  # a static field that is an array: not layers
        return False


def call_on_auto_axes(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` inside a trace over a mesh with `Explicit` axes, run on
    `Auto` axes (`jax.sharding.auto_axes`), as plain JAX code is written: the
    partitioner lays out what `fn` computes (a gather of token ids split over the
    batch, a scatter into a cache) where JAX's sharding types would refuse it.

    The array leaves of the arguments enter laid out as they are (a cast onto
    `Auto` axes, which moves nothing), so their cotangents come back laid out like
    them: a gradient like its parameter. The array leaves of the output come back
    replicated over the mesh. So do the arrays of `fn` itself (an `eqx.Module`)
    and the gradient taps of the current step (`_grad_taps.py`: accumulators the
    loss reaches through a context); arrays closed over otherwise cannot enter."""
    table = _grad_taps.current()
    taps = None
    if table is not None:
        taps = {path: (t.acc, t.dtype, t.read) for path, t in table.taps.items()}
    dynamic, static = eqx.partition((fn, args, kwargs, taps), eqx.is_array)
    flat, treedef = jtu.tree_flatten(dynamic)
    out_static = []

    def inner(*flat: Any) -> list:
        dynamic = jtu.tree_unflatten(treedef, flat)
        fn, args, kwargs, taps = eqx.combine(dynamic, static)
        inside = None
        if taps is not None:
            inside = {path: _grad_taps.Tap(*tap) for path, tap in taps.items()}
        with _grad_taps.taps(inside):
            out = fn(*args, **kwargs)
        out_dynamic, rest = eqx.partition(out, eqx.is_array)
        leaves, out_treedef = jtu.tree_flatten(out_dynamic)
        out_static.append((out_treedef, rest))
        return leaves

    on_auto = jax.sharding.auto_axes(inner, out_sharding=PartitionSpec())
    leaves = cast(list, on_auto(*flat))
    out_treedef, rest = out_static[0]
    return eqx.combine(jtu.tree_unflatten(out_treedef, leaves), rest)


class _Watched(NamedTuple):
    """A host-resident stacked leaf as it flows through a jaxpr."""

    argument: str
    leaf: _paths.Leaf
    is_slice: bool  # one layer's slice, inside a scan over the whole leaf
    streamed: bool = False  # a `Policy(stream=...)` table (or one `embed` returned)


def _find_misuse(
    jaxpr: Any, watched: dict[Any, _Watched], reading: bool = False
) -> tuple[_Watched, str] | None:
    """Finds an operation that computes on a host-resident stacked leaf outside the
    scan that brings it to the device one layer at a time.

    The whole leaf may flow through calls and control flow and be scanned over; its
    slice, inside such a scan, may only be moved to the device.
    """
    consumed: dict[Any, str] = {}  # streamed table -> the block loop that read it
    for eqn in jaxpr.eqns:
        used = {
            i: watched[v]
            for i, v in enumerate(eqn.invars)
            if not _jaxpr.is_literal(v) and v in watched
        }
        if not used:
            continue
        if all(w.streamed for w in used.values()) and _vocab_blocks.SCOPE in str(
            eqn.source_info.name_stack
        ):
            # `embed` / `chunked_cross_entropy` reading the table by blocks. Each
            # table is read by one of them: two would sum two host gradients.
            for i, w in used.items():
                if eqn.invars[i] in consumed:
                    return w, "twice"
                consumed[eqn.invars[i]] = _jaxpr.primitive_name(eqn)
            for out in eqn.outvars:  # the table `embed` hands on
                if _host_table(out.aval):
                    watched[out] = next(iter(used.values()))
            continue
        if _jaxpr.is_device_put(eqn):
            destinations = _jaxpr.device_put_destinations(eqn)
            for i, w in used.items():
                # A slice inside the scan, or (for a leaf the TPU compiler cannot
                # slice on the host) the whole leaf, moved to the device by the scan.
                whole_ok = not _tiling.slices_by_layer(w.leaf.value.shape)
                if (
                    not (w.is_slice or whole_ok)
                    or destinations[i] != jax.memory.Space.Device
                ):
                    return w, "device_put"
            continue
        if (
            reading
            and set(used) == {0}
            and (
                _jaxpr.is_dynamic_slice(eqn)
                or (used[0].is_slice and _jaxpr.is_squeeze(eqn))
            )
        ):
            # A layer read ahead by a prefetching scan (`_prefetch._at`, a
            # `custom_vmap` slice): like a slice the scan takes, it may only be
            # moved to the device.
            watched[eqn.outvars[0]] = used[0]._replace(is_slice=True)
            continue
        subs = _jaxpr.sub_jaxprs(eqn)
        if subs is None:
            return next(iter(used.values())), _jaxpr.primitive_name(eqn)
        for sub, operands, sliced in subs:
            inner = {}
            for i, k in operands.items():
                if i in used:
                    w = used[i]
                    inner[sub.invars[k]] = w._replace(is_slice=True) if sliced else w
            inside = reading or _jaxpr.is_custom_vmap(eqn)
            found = _find_misuse(sub, inner, inside) if inner else None
            if found is not None:
                return found
            if not sliced and len(sub.outvars) == len(eqn.outvars):
                # A call that returns a watched value as it is (a gradient tap of
                # the same dtype, an inner `jax.jit`) hands it on.
                for inner_out, out in zip(sub.outvars, eqn.outvars):
                    if _jaxpr.is_literal(inner_out):  # a constant output
                        continue
                    w = inner.get(inner_out)
                    if w is not None and (w.streamed or w.is_slice):
                        watched[out] = w
    return None


def _host_table(aval: Any) -> bool:
    return is_host_aval(aval) and getattr(aval, "ndim", 0) == 2


def _misuse_error(w: _Watched, primitive: str) -> ValueError:
    if w.streamed and primitive == "twice":
        return ValueError(
            f"`filter_offload`: the streamed table {w.leaf.path!r} of {w.argument} "
            "is read by two of `eo.embed` / `eo.chunked_cross_entropy`, whose two "
            "host-resident gradients cannot be added. For a tied embedding, pass "
            "the table `eo.embed` returns to the output projection: "
            "`h, table = eo.embed(model.embed, tokens)`, then "
            "`eo.chunked_cross_entropy(hidden, table, targets)`."
        )
    if w.streamed:
        return ValueError(
            f"`filter_offload`: leaf {w.leaf.path!r} of {w.argument} is streamed "
            "from the host (`Policy(stream=...)`), so only `eo.embed` and "
            "`eo.chunked_cross_entropy` can read it, block by block; here it is "
            f"computed on by `{primitive}`, on the host, which no backend can do. "
            "Use those two functions, or drop the leaf from `Policy(stream=...)` "
            "so that it moves to the device whole."
        )
    keep = (
        "Policy(params='device')"
        if not w.leaf.stacked
        else (f"Policy(params={{{w.leaf.stacked!r}: 'device'}})")
    )
    return ValueError(
        f"`filter_offload`: leaf {w.leaf.path!r} of {w.argument} is a host-resident "
        f"layer of the `Stacked` at {w.leaf.stacked!r}. It is brought to the device "
        "one layer at a time inside that `Stacked`'s scan, but here it is computed on "
        f"outside it (by `{primitive}`), on the host, which the backward pass (and "
        "accelerators) cannot do. Compute this inside the layers (cast inside a "
        "layer, not the whole model); for weight decay use "
        f"`optax.add_decayed_weights`; or keep these parameters on the device, e.g. "
        f"`{keep}`."
    )


class _Traced(NamedTuple):
    """`fun` traced to a jaxpr on the array leaves of its arguments."""

    closed: Any  # the `ClosedJaxpr`
    dynamic: list  # its inputs
    positions: list[int]  # where they are among the flattened arguments
    rebuild: Callable[[list], Any]  # output leaves -> the output of `fun`


def _trace(fun: Callable, args: tuple, kwargs: dict) -> _Traced:
    flat, treedef = jtu.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if eqx.is_array(x)]
    out_parts = []

    def flat_fun(*dynamic: Any) -> list:
        _pending.allow(_compat.current_trace())  # (evaluated in the caller's)
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

    def rebuild(out_leaves: list) -> Any:
        out_treedef, out_static = out_parts[0]
        return eqx.combine(jtu.tree_unflatten(out_treedef, out_leaves), out_static)

    return _Traced(closed, dynamic, positions, rebuild)


def _check_host_leaves(
    traced: _Traced, args: tuple, kwargs: dict, streamed: set[str]
) -> None:
    """Host-resident stacked leaves must only be used inside their scans, streamed
    tables only by the functions that read them by blocks."""
    info = [
        (argument, leaf)
        for argument, arg in _named_arguments(args, kwargs)
        for leaf in _paths.leaves(arg)
    ]

    def stream(argument: str, leaf: _paths.Leaf) -> bool:
        return argument == "argument 0" and leaf.path in streamed

    watched = {
        var: _Watched(*info[i], is_slice=False, streamed=stream(*info[i]))
        for var, i in zip(traced.closed.jaxpr.invars, traced.positions)
        if (info[i][1].stacked is not None or stream(*info[i]))
        and is_host(info[i][1].value)
    }
    misuse = _find_misuse(traced.closed.jaxpr, watched)
    if misuse is not None:
        raise _misuse_error(*misuse)


class _OffloadWrapper(eqx.Module):
    _fun: Callable
    _policy: Policy = eqx.field(static=True)

    @property
    def __wrapped__(self) -> Callable:
        return self._fun

    def __get__(self, instance: Any, owner: Any) -> Any:
        # A decorated method: bound to its instance, as `eqx.filter_jit` binds.
        if instance is None:
            return self
        return jtu.Partial(self, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._policy.loss_axes == "auto" and _layout.explicit_axes():
            # `Policy(loss_axes="auto")`: this call again, on `Auto` axes.
            return call_on_auto_axes(self, args, kwargs)
        try:
            return self._call(args, kwargs)
        except _checkpoint_name_log.UnusedName as e:
            # The names this trace saw are only those the policy asked for: list
            # every residual name the model offers instead (one more trace, only
            # on this error).
            raise e.with_offered(_offered(self, args, kwargs) or e.offered) from None

    def _call(self, args: tuple, kwargs: dict) -> Any:
        streamed = _streamed_paths(args[0] if args else None, self._policy)
        _warn_layer_lists(args, kwargs, streamed)
        args, kwargs = _configure_all(args, kwargs, self._policy, streamed)
        host_stacked = bool(streamed) or any(
            leaf.stacked is not None
            and eqx.is_array(leaf.value)
            and is_host(leaf.value)
            for leaf in _paths.leaves((args, kwargs))
        )
        with _checkpoint_name_log.collecting() as log:
            if host_stacked:
                # Checking needs the jaxpr before any outer transformation sees it:
                # trace, check, then evaluate it, so `fun` still runs once.
                traced = _trace(self._fun, args, kwargs)
                _check_host_leaves(traced, args, kwargs, streamed)
                _checkpoint_name_log.check(
                    self._policy, _checkpoint_name_log.NameLog.of(traced.closed)
                )
                outputs = jex.jaxpr_as_fun(traced.closed)(*traced.dynamic)
                return traced.rebuild(outputs)
            out = self._fun(*args, **kwargs)
        if checkpoint_patterns(self._policy):
            try:
                _checkpoint_name_log.check(self._policy, log)
            except _checkpoint_name_log.UnusedName:
                # Scans served from an inner `jax.jit`'s cache were not traced now,
                # so they recorded nothing; the jaxpr has them all.
                traced = _trace(self._fun, args, kwargs)
                _checkpoint_name_log.check(
                    self._policy, _checkpoint_name_log.NameLog.of(traced.closed)
                )
        return out


def _offered(wrapper: _OffloadWrapper, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """The residual names `wrapper`'s function offers on these arguments: traced
    (never run) under a policy that saves every name. Empty if that trace fails
    (e.g. there is no `Stacked`)."""
    everything = replace(wrapper._policy, save=("**",), offload=())
    probe = _OffloadWrapper(wrapper._fun, everything)
    try:
        # `_call`, not the probe itself: its own error must not ask for a hint.
        traced = _trace(lambda *a, **k: probe._call(a, k), args, kwargs)
    except Exception:  # only a hint for the error being raised: that error wins
        return ()
    return tuple(_checkpoint_name_log.NameLog.of(traced.closed).residual_names)


def filter_offload(fun: Callable | None = None, policy: Policy | None = None) -> Any:
    """Applies an offloading `Policy` to `fun`, the way `eqx.filter_jit` applies
    `jax.jit`: array leaves of the arguments are traced, everything else is static.

    Before calling `fun`, every `Stacked` in its arguments is replaced by a
    configured view (still a `Stacked`, with static configuration) whose scan body

    1. moves that layer's host-resident parameter slices to the device,
    2. names the carry entering the layer `"<path>.input"` (its first operation) and
       the output of every submodule whose path a policy pattern matches,
    3. wraps the layer in `jax.checkpoint` with the policy's `save`/`offload` names
       (no checkpoint with `save="all"`).

    Host-resident leaves outside any `Stacked` are moved to the device where `fun`
    starts. `filter_offload` does not compile by itself: compose it with `jax.jit`,
    `eqx.filter_jit`, `jax.grad`, `eqx.filter_value_and_grad`, ... as usual.
    Without a gradient, `eqx.filter_jit(filter_offload(fn, policy))` is how a
    host-resident model is evaluated or sampled outside the step.

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
    - `ValueError` if two arguments hold different `Stacked`s at the same path;
    - `ValueError` if a `Stacked` that is not in the arguments (closed over, or
        rebuilt) is applied inside `fun`.

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
    if not callable(fun):
        raise TypeError(f"`filter_offload(fun=...)` must be callable, got {fun!r}.")
    check_policy(policy, "`filter_offload(policy=...)`")
    return eqx.module_update_wrapper(_OffloadWrapper(fun, policy))
