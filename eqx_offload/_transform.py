"""`filter_offload`: the filtered transform that configures every `Stacked`."""

import functools
from collections.abc import Callable
from typing import Any, cast, overload, ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import PartitionSpec

from . import (
    _checkpoint_name_log,
    _compat,
    _grad_taps,
    _jaxpr,
    _jaxpr_host_leaves,
    _layout,
    _paths,
    _pending,
)
from ._errors import see
from ._jaxpr_host_leaves import Argument, arguments
from ._memory_kinds import is_host
from ._policy import check_policy, checkpoint_patterns, Policy, replace
from ._scan_body import configure
from ._stacked import array_paths, Stacked
from ._warn import warn_at_caller


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _is_stacked(x: Any) -> bool:
    return isinstance(x, Stacked)


def _configure_all(
    args: tuple, kwargs: dict, policy: Policy, tables: set[str]
) -> tuple[tuple, dict]:
    """Replaces every top-level `Stacked` in the arguments by its configured view.

    It also moves host-resident leaves outside any `Stacked` to the device, except the
    model's host `tables`.

    Every half of an `eqx.partition`ed model is configured alike. So `eqx.combine`
    inside `fun` sees matching pytrees. Two halves may share a path. Two different layer
    stacks (with arrays at the same leaves) may not: their names would collide.
    """
    owners: dict[str, tuple[str, set[str]]] = {}

    def stacked(x: Stacked, path: str, argument: Argument) -> Stacked:
        arrays = set(array_paths(x.layers))
        other, other_arrays = owners.get(path, (None, set()))
        if other is not None and arrays & other_arrays:
            raise ValueError(
                f"`filter_offload`: {other} and {argument.name} both hold a "
                f"`Stacked` at {path!r}. Pass them in one pytree (a tuple)." + see(32)
            )
        owners[path] = (argument.name, arrays | other_arrays)
        return configure(x, path, policy)

    def array(x: Any, path: str, argument: Argument) -> Any:
        stays = argument.is_model and path in tables
        if is_host(x) and not stays:
            x = jax.device_put(x, jax.memory.Space.Device)
        if argument.is_model:
            found = _grad_taps.lookup(path)
            if found is not None:
                x = _grad_taps.tap(x, *found)
            if not stays:
                x = _layout.gather_fsdp(x, path, policy.shard)
        return x

    def prepare(argument: Argument) -> Any:
        def leaf(keys: Any, x: Any) -> Any:
            if isinstance(x, Stacked):
                return stacked(x, _paths.join("", keys), argument)
            return array(x, _paths.join("", keys), argument) if eqx.is_array(x) else x

        return jtu.tree_map_with_path(leaf, argument.value, is_leaf=_is_stacked)

    # Validated in flattening order.
    done = {a.key: prepare(a) for a in arguments(args, kwargs)}
    return tuple(done[i] for i in range(len(args))), {k: done[k] for k in kwargs}


def _host_table_paths(model: Any, policy: Policy) -> set[str]:
    """The paths of the model's leaves that `Policy(host_tables=...)` keeps on the host
    inside the step.

    Each pattern must match a host-resident `[vocab, dim]` leaf outside any `Stacked`.
    """
    if not policy.host_tables:
        return set()
    arrays = {
        leaf.path: leaf.value
        for leaf in _paths.leaves(model)
        if leaf.stacked is None and eqx.is_array(leaf.value)
    }
    found = set()
    for pattern in policy.host_tables:
        matched = {p for p in arrays if _paths.prefix_match(pattern, p) is not None}
        if not matched:
            leaves = _paths.quoted(sorted(arrays), 5)
            raise ValueError(
                f"`Policy(host_tables=...)`: {pattern!r} matches no leaf outside a "
                f"`Stacked`. Leaves include {leaves}." + see(97)
            )
        for path in sorted(matched):
            x = arrays[path]
            if not is_host(x) or x.ndim != 2:
                where = "on the device" if not is_host(x) else f"of shape {x.shape}"
                raise ValueError(
                    f"`Policy(host_tables=...)`: leaf {path!r} is {where}, not a "
                    "host `[vocab, dim]` table. Place it on the host." + see(98)
                )
        found |= matched
    return found


def _warn_layer_lists(args: tuple, kwargs: dict, tables: set[str]) -> None:
    """Warns of layers held in a Python list or tuple with host-resident parameters.

    Outside a `Stacked`, host-resident leaves are moved to the device where the function
    starts. So every layer is on the device at once, and nothing streams.
    """
    for argument in arguments(args, kwargs):
        flat = jtu.tree_flatten_with_path(
            argument.value, is_leaf=lambda x: _is_stacked(x) or _is_layer_list(x)
        )[0]
        for keys, x in flat:
            if not _is_layer_list(x):
                continue
            path = _paths.join("", keys)
            host = array_paths(x, path, host=True)
            if argument.is_model:
                host = [p for p in host if p not in tables]
            if not host:
                continue
            name = path.rsplit(".", 1)[-1] or "layers"
            where = repr(path) if argument.is_model else f"{path!r} of {argument.name}"
            warn_at_caller(
                f"`filter_offload`: {where} is a Python {type(x).__name__} of "
                f"{len(x)} layers of one structure with host-resident parameters "
                f"({_paths.quoted(host, 3)}). Outside a `Stacked`, host-resident "
                "leaves are moved to the device where the function starts: all "
                f"{len(x)} layers are moved to the device whole, each step, and "
                "nothing streams. Hold them in an `eo.Stacked` (`eo.Stacked."
                f"from_layers({name})`, or `eo.Stacked.from_fn(make_layer, {len(x)}, "
                f"key=key)`) and apply it as `self.{name}(x)`: its scan brings one "
                "layer to the device at a time." + see(126)
            )


def _is_layer_list(x: Any) -> bool:
    """A list or tuple of two or more modules of one structure: repeated layers.

    The structure includes leaf shapes and dtypes.
    """
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
    `Auto` axes.

    It uses `jax.sharding.auto_axes`, as plain JAX code is written. The partitioner lays
    out what `fn` computes where JAX's sharding types would refuse it. (A gather of
    token ids split over the batch, a scatter into a cache.)

    The array leaves of the arguments enter laid out as they are. (A cast onto `Auto`
    axes, which moves nothing.) So their cotangents come back laid out like them: a
    gradient like its parameter. The array leaves of the output come back replicated
    over the mesh. So do the arrays of `fn` itself (an `eqx.Module`). So do the gradient
    taps of the current step: accumulators the loss reaches through a context
    (`_grad_taps.py`). Arrays closed over otherwise cannot enter.
    """
    # (A `_grad_taps.Tap` is a pytree: its accumulator enters as an argument.)
    taps = _grad_taps.current()
    dynamic, static = eqx.partition((fn, args, kwargs, taps), eqx.is_array)
    flat, treedef = jtu.tree_flatten(dynamic)
    out_static = []

    def inner(*flat: Any) -> list:
        fn, args, kwargs, taps = eqx.combine(jtu.tree_unflatten(treedef, flat), static)
        with _grad_taps.taps(taps):
            out = fn(*args, **kwargs)
        out_dynamic, rest = eqx.partition(out, eqx.is_array)
        leaves, out_treedef = jtu.tree_flatten(out_dynamic)
        out_static.append((out_treedef, rest))
        return leaves

    on_auto = jax.sharding.auto_axes(inner, out_sharding=PartitionSpec())
    leaves = cast(list, on_auto(*flat))
    out_treedef, rest = out_static[0]
    return eqx.combine(jtu.tree_unflatten(out_treedef, leaves), rest)


def _trace(fun: Callable, args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    """`fun` traced to a jaxpr on the array leaves of its arguments: the `ClosedJaxpr`,
    and the array leaves (abstract) and the rest of its output."""

    def traced(*args: Any, **kwargs: Any) -> Any:
        _pending.allow(_compat.current_trace())  # (evaluated in the caller's)
        return fun(*args, **kwargs)

    return eqx.filter_make_jaxpr(traced)(*args, **kwargs)


def _names(fun: Callable, args: tuple, kwargs: dict) -> _checkpoint_name_log.NameLog:
    """The checkpoint names in `fun` on these arguments (traced, never run)."""
    return _checkpoint_name_log.NameLog.of(_trace(fun, args, kwargs)[0])


class Offloaded(eqx.Module):
    """What `filter_offload` returns: the function and its policy."""

    fun: Callable
    policy: Policy = eqx.field(static=True)

    @property
    def __wrapped__(self) -> Callable:
        return self.fun

    def __get__(self, instance: Any, owner: Any) -> Any:
        # A decorated method: bound to its instance, as `eqx.filter_jit` binds.
        return self if instance is None else jtu.Partial(self, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.policy.loss_axes == "auto" and _layout.explicit_axes():
            # `Policy(loss_axes="auto")`: this call again, on `Auto` axes.
            return call_on_auto_axes(self, args, kwargs)
        try:
            return self.run(args, kwargs)
        except _checkpoint_name_log.UnusedName as e:
            # The names this trace saw are only those the policy asked for: list
            # every residual name the model offers instead (one more trace, only
            # on this error).
            raise e.with_offered(_offered(self, args, kwargs) or e.offered) from None

    def run(self, args: tuple, kwargs: dict) -> Any:
        tables = _host_table_paths(args[0] if args else None, self.policy)
        _warn_layer_lists(args, kwargs, tables)
        args, kwargs = _configure_all(args, kwargs, self.policy, tables)
        host_stacked = bool(tables) or any(
            x.stacked is not None and eqx.is_array(x.value) and is_host(x.value)
            for x in _paths.leaves((args, kwargs))
        )
        with _checkpoint_name_log.collecting() as log:
            if host_stacked:
                # Checking needs the jaxpr before any outer transformation sees it:
                # trace, check, then evaluate it, so `fun` still runs once.
                closed, out_dynamic, out_static = _trace(self.fun, args, kwargs)
                flat = jtu.tree_leaves((args, kwargs))
                at = [i for i, x in enumerate(flat) if eqx.is_array(x)]
                _jaxpr_host_leaves.check(closed.jaxpr, at, args, kwargs, tables)
                names = _checkpoint_name_log.NameLog.of(closed)
                _checkpoint_name_log.check(self.policy, names)
                outputs = _jaxpr.evaluate(closed, *(flat[i] for i in at))
                outputs = jtu.tree_unflatten(jtu.tree_structure(out_dynamic), outputs)
                return eqx.combine(outputs, out_static)
            out = self.fun(*args, **kwargs)
        if checkpoint_patterns(self.policy):
            try:
                _checkpoint_name_log.check(self.policy, log)
            except _checkpoint_name_log.UnusedName:
                # Scans served from an inner `jax.jit`'s cache were not traced now,
                # so they recorded nothing; the jaxpr has them all.
                _checkpoint_name_log.check(self.policy, _names(self.fun, args, kwargs))
        return out


def _offered(wrapper: Offloaded, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """The residual names `wrapper`'s function offers on these arguments.

    They are traced (never run) under a policy that saves every name. Empty if that
    trace fails (e.g. there is no `Stacked`).
    """
    probe = Offloaded(wrapper.fun, replace(wrapper.policy, save=("**",), offload=()))
    try:
        # `run`, not the probe itself: its own error must not ask for a hint.
        names = _names(lambda *a, **k: probe.run(a, k), args, kwargs)
    except Exception:  # only a hint for the error being raised: that error wins
        return ()
    return tuple(names.residual_names)


@overload
def filter_offload(
    *, policy: Policy
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...


@overload
def filter_offload(fun: Callable[_P, _T], policy: Policy) -> Callable[_P, _T]: ...


def filter_offload(fun: Callable | None = None, policy: Policy | None = None) -> Any:
    """Applies an offloading `Policy` to `fun`, the way `eqx.filter_jit` applies
    `jax.jit`.

    Array leaves of the arguments are traced; everything else is static.

    Before calling `fun`, every `Stacked` in its arguments is replaced by a configured
    view. The view is still a `Stacked`, with static configuration. Its scan body

    1. moves that layer's host-resident parameter slices to the device,
    2. names the carry entering the layer `"<path>.input"` (its first operation). It
    also names the output of every submodule whose path a policy pattern matches.
    3. wraps the layer in `jax.checkpoint` with the policy's `save`/`offload` names.
    There is no checkpoint with `save="all"`.

    Host-resident leaves outside any `Stacked` are moved to the device where `fun`
    starts. `filter_offload` does not compile by itself. Compose it with `jax.jit`,
    `eqx.filter_jit`, `jax.grad`, `eqx.filter_value_and_grad`, ... as usual. Without a
    gradient, `eqx.filter_jit(filter_offload(fn, policy))` evaluates or samples a
    host-resident model outside the step.

    **Arguments:**

    - `fun`: the function, e.g. a loss `loss_fn(model, *batch)`.
    - `policy`: an `eqx_offload.Policy`. Only `save`, `offload` and `offload_dst` matter
        here. (Parameter placement is the job of `place` and `train_step`.)

    **Returns:**

    A callable with the signature of `fun`.

    **Raises (while tracing):**

    - `ValueError` if a `save`/`offload` name or pattern never occurs, or names no
        residual (e.g. a block's output). It lists the names that did occur.
    - `ValueError` if `fun` uses a host-resident stacked leaf outside its scan. (E.g. an
        L2 penalty over `pinned_host` layers.) It names the leaf and the fix.
    - `ValueError` if two arguments hold different `Stacked`s at the same path;
    - `ValueError` if a `Stacked` that is not in the arguments (closed over, or rebuilt)
        is applied inside `fun`.

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
    if fun is None:  # a decorator: `@filter_offload(policy=policy)`
        return functools.partial(cast(Callable, filter_offload), policy=policy)
    if policy is None:
        raise TypeError(
            "`filter_offload(fun, policy)` needs a policy, e.g. "
            "`eqx_offload.Policy.offload_residuals()`." + see(15)
        )
    if not callable(fun):
        raise TypeError(f"`filter_offload(fun=...)` must be callable, got {fun!r}.")
    check_policy(policy, "`filter_offload(policy=...)`")
    return eqx.module_update_wrapper(Offloaded(fun, policy))
