"""The scan body of a `Stacked` configured by `filter_offload`.

- Host slices move to the device one layer at a time, through their gradient taps.
  A tap's accumulator on the device rides in the scan's carry, so each layer's
  gradient is added into it in place (`_carrying_sums`).
- The carry and named submodules' outputs are named.
- `jax.checkpoint` applies with the policy's names, at one site.
- The layers run in a plain `jax.lax.scan` or in the prefetching scan
  (`_prefetch.py`), which may also apply a pending update: `_prefetches` picks.

The container (`_stacked.py`) knows only `AbstractScan`; this is its implementation.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.ad_checkpoint import checkpoint_name

from . import (
    _checkpoint_name_log,
    _compat,
    _grad_taps,
    _jaxpr,
    _layout,
    _paths,
    _pending,
    _prefetch,
    _residuals,
    _scopes,
)
from ._errors import see
from ._memory_kinds import is_host
from ._policy import checkpoint_patterns, Policy, split_names
from ._stacked import (
    AbstractScan,
    array_paths,
    keep_carry_sharding,
    map_arrays,
    Stacked,
    to_device,
    whole_to_device,
)
from ._warn import warn_at_caller


class ScanConfig(AbstractScan):
    """How `filter_offload` configured a `Stacked`: its path and the policy."""

    path: str
    policy: Policy

    def scan(
        self, f: Callable, carry: Any, dynamic: Any, static: Any, xs: Any, length: int
    ) -> tuple[Any, Any]:
        # Each leaf with a gradient tap (`_grad_taps.py`) is scanned over with its
        # accumulator, and tapped as its layer slice reaches the device.
        taps = _layer_taps(self.path, dynamic)
        accs = None
        if taps is not None:
            accs = [None if t is None else whole_to_device(t.acc) for t in taps]
        layers = (dynamic, accs)
        read, layer_fn = _body_parts(self, f, static, taps)

        def body(c: Any, inputs: Any) -> Any:  # inputs: a layer's slices and x
            return layer_fn(c, read(inputs[0]), inputs[1])

        # Named, so that a compiled program's reader tells the layers' transfers
        # from the rest of the step's (`_compiler.phase`).
        with jax.named_scope(_scopes.LAYERS):
            found = _remat_policy(self, body, carry, layers, xs)

            def remat(fn: Callable) -> Callable:  # the layer, with its read if plain
                if found is None:
                    return fn
                return jax.checkpoint(fn, policy=found[0], prevent_cse=False)

            owed = _pending.take(self.path)
            if owed is not None and not _can_apply(carry, dynamic, xs, taps):
                owed = None  # (the step sees it untaken: it applies it before)
            out = None
            if _prefetches(self, layers, found, owed):
                pending, arrays = _pending_update(self.path, layers, owed)
                how = _prefetch.How(
                    remat(layer_fn), read, length, taps is None, pending
                )
                out = _prefetch.scan(how, carry, layers, xs, arrays)
            # (Only where the prefetching scan did not run the layers.)
            if out is None:
                sums = _carrying_sums(self, f, static, taps, remat)
                out = None if sums is None else sums(carry, layers, xs, length)
            if out is None:  # (forward mode: `_prefetch.scan` cannot)
                out = jax.lax.scan(remat(body), carry, (layers, xs), length=length)
            return out

    def check_slice(self, layers: Any, how: str) -> None:
        """Slicing host-resident layers inside a step is a computation on the host."""
        path, host = self.path, array_paths(layers, self.path, host=True)
        if host:
            raise ValueError(
                f"{how}: the layers of the `Stacked` at {path!r} are host-resident "
                f"({_paths.quoted(host, 3)}), and slicing them inside a step is a "
                f"computation on the host. Apply `{path}(x)` whole, slice the model "
                f"before the step, or use `Policy(params={{{path!r}: 'device'}})`."
                + see(36)
            )

    def check_bypass(self, layers: Any, how: str) -> None:
        """A layer taken out of a configured `Stacked` (`stacked[i]`, iteration) is
        applied outside its scan: an error for host-resident layers, which are moved to
        the device only inside the scan; a warning when the policy asks for a
        `jax.checkpoint` or offloading that then never happens."""
        path, host = self.path, array_paths(layers, self.path, host=True)
        if _layer_taps(path, layers) is not None:
            raise ValueError(
                f"{how}: a layer is taken out of the `Stacked` at {path!r} in a step "
                "with micro-batches or a compute dtype, so it gets no gradient. Apply "
                f"the layers with `{path}(x)` or `{path}.scan(f, carry)`." + see(88)
            )
        if host:
            raise ValueError(
                f"{how}: the layers of the `Stacked` at {path!r} are host-resident "
                f"({_paths.quoted(host, 3)}) and reach the device only inside its "
                f"scan. Apply the layers with `{path}(x)` or `{path}.scan(f, carry)`, "
                f"or use `Policy(params={{{path!r}: 'device'}})`." + see(34)
            )
        if self.policy.save != "all":
            warn_at_caller(
                f"{how} takes layers out of the `Stacked` at {path!r} and applies "
                "them outside its scan, so the policy's `jax.checkpoint` (and any "
                "offloading of their activations) does not apply to them: every "
                "layer's activations stay on the device. Apply the layers with "
                f"`{path}(x)` or `{path}.scan(f, carry)`." + see(37)
            )


def _can_apply(carry: Any, dynamic: Any, xs: Any, taps: list | None) -> bool:
    """Whether the forward scan can apply a pending update here: in the step's
    trace of the loss, or under `jax.vmap`s of it over examples (not over the
    layers: an ensemble), not in forward mode, without gradient taps or
    `Explicit` axes. Anywhere else (a loop, a `jax.checkpoint`, a `jax.jit` in
    the loss) it would run a different number of times than it is traced."""
    return (
        taps is None
        and _compat.only_batched_since(_pending.traces())
        and not _compat.batched(dynamic)
        and not _compat.forward_mode((carry, dynamic, xs))
        and not _layout.explicit_axes()
    )


def _prefetches(
    config: "ScanConfig", layers: Any, found: tuple | None, owed: Any
) -> bool:
    """Whether the prefetching scan runs the layers (else the plain scan).

    - It applies `owed`, a pending update (`Policy(update_timing="next_forward")`),
        whatever `prefetch` says.
    - It runs under `Policy(prefetch=1)`, where there is something to read
        ahead (parameters on the host or a residual offloaded), except over a
        mesh with `Explicit` axes (not yet supported).
    - The plain scan runs otherwise, and where `_prefetch.scan` cannot run
        (forward-mode differentiation)."""
    if owed is not None:
        return True
    offload = found is not None and found[1]
    return bool(
        config.policy.prefetch
        and not _layout.explicit_axes()
        and (array_paths(layers[0], config.path, host=True) or offload)
    )


def _pending_update(
    path: str, layers: Any, owed: _pending.Layers | None
) -> tuple[_prefetch.Pending | None, Any]:
    """`owed`, the pending update of the layers' parameters, as the prefetching
    scan applies it to each layer before it computes (`_pending.py`), and its
    arrays (`_prefetch.scan`'s `owed`)."""
    if owed is None:
        return None, None
    names = array_paths(layers[0], path)
    positions = [names.index(p) for p in owed.paths]

    def apply(aux: Any, held: Any) -> Any:
        with jax.named_scope(_scopes.UPDATE):
            return owed.update(to_device(aux), held)

    def merge(piece: Any, params: Any) -> Any:
        arrays, treedef = jtu.tree_flatten(piece[0])
        for k, new in zip(positions, params, strict=True):
            arrays[k] = new
        return (jtu.tree_unflatten(treedef, arrays), piece[1])

    pending = _prefetch.Pending(apply, merge, _pending.on_backward(path))
    return pending, (owed.aux, owed.held)


def configure(stacked: Stacked, path: str, policy: Policy) -> Stacked:
    """The configured view of `stacked` (still a `Stacked`): the same layers, with the
    static configuration that makes `scan` name, checkpoint and offload."""
    return dataclasses.replace(stacked, _scan=ScanConfig(path, policy))


def _carrying_sums(
    config: ScanConfig, f: Callable, static: Any, taps: list | None, remat: Callable
) -> Callable | None:
    """The scan of the layers where a tap's accumulator is on the device, else None.

    Such an accumulator rides in the carry: each layer reads its slice, and its
    gradient is added into it in place (`_grad_taps.seed`). Scanned over instead,
    it would be read while a second buffer of its size took the sums."""
    carried = [t is not None and not is_host(t.acc) for t in taps or ()]
    if not any(carried):
        return None
    assert taps is not None
    inner = [t._replace(read=False) if c else t for t, c in zip(taps, carried)]
    read, layer_fn = _body_parts(config, f, static, inner)

    def body(state: Any, inputs: Any) -> Any:
        (c, sums), ((arrays, slices), i, x) = state, inputs
        slices = [
            jax.lax.dynamic_index_in_dim(h, i, keepdims=False) if h is not None else a
            for a, h in zip(slices, sums, strict=True)
        ]
        c, y = layer_fn(c, read((arrays, slices)), x)
        return (c, sums), y

    def scan(carry: Any, layers: tuple, xs: Any, length: int) -> tuple[Any, Any]:
        dynamic, accs = layers
        sums = [a if c else None for a, c in zip(accs, carried, strict=True)]
        scanned = [None if c else a for a, c in zip(accs, carried, strict=True)]
        per_layer = ((dynamic, scanned), jnp.arange(length), xs)
        (c, sums), ys = jax.lax.scan(
            remat(body), (carry, sums), per_layer, length=length
        )
        reads = [t.read for t, c in zip(taps, carried) if c]
        return _grad_taps.seed(c, [x for x in sums if x is not None], reads), ys

    return scan


def _layer_taps(path: str, layers: Any) -> list[_grad_taps.Tap | None] | None:
    """The gradient tap of each array leaf of the layers of the `Stacked` at
    `path` (in `jax.tree.leaves` order), or None when there are none."""
    found = [_grad_taps.lookup(p) for p in array_paths(layers, path)]
    return found if any(t is not None for t in found) else None


def _body_parts(
    config: ScanConfig, f: Callable, static: Any, taps: list | None
) -> tuple[Callable, Callable]:
    """The scan body in two parts: `read(layer_arrays, accs)`, a layer slice moved
    to the device (through its gradient taps; gathered, under FSDP), and
    `layer_fn(carry, layer_arrays, x)`, which names the carry and the named
    submodules' outputs and applies `f`."""
    path, policy = config.path, config.policy
    if isinstance(static, Stacked):
        raise ValueError(
            f"`filter_offload`: the layers of the `Stacked` at {path!r} are themselves "
            "a `Stacked`. Make the layer a module with the inner `Stacked` as a field."
            + see(12)
        )
    carry_name = _paths.join(path, "input")
    patterns = checkpoint_patterns(policy)

    def configure_inside(module: Any, sub_path: str) -> Any:
        if isinstance(module, Stacked):  # a nested `Stacked` names its own carry
            return (
                configure(module, sub_path, policy) if module._scan is None else module
            )
        if any(_paths.matches(q, sub_path) for q in patterns):
            return _with_class(module, _named_class(type(module), sub_path))
        return module

    def read(layers: Any) -> Any:
        layer_arrays, accs = layers
        layer_arrays = to_device(layer_arrays)
        if taps is not None:  # each leaf seen through its tap
            leaves, treedef = jtu.tree_flatten(layer_arrays)
            tapped = [
                x if t is None else _grad_taps.tap(x, acc, t.dtype, t.read, layer=True)
                for x, acc, t in zip(leaves, accs, taps, strict=True)
            ]
            layer_arrays = jtu.tree_unflatten(treedef, tapped)
        return _layout.gather_fsdp(layer_arrays, path, policy.shard)

    def layer_fn(c: Any, layer_arrays: Any, x: Any) -> Any:
        if policy.save != "all":
            # Named first, before any use: a name on anything downstream of the
            # carry (e.g. the previous layer's output) is not a residual here.
            c = jtu.tree_map(lambda v: checkpoint_name(v, carry_name), c)
        layer = eqx.combine(layer_arrays, static)
        layer = _map_submodules(layer, path, configure_inside)
        with _grad_taps.taps(None):  # a nested `Stacked`'s leaves are tapped here
            new, y = f(layer, c, x)
        return keep_carry_sharding(new, c), y

    return read, layer_fn


def _remat_policy(
    config: ScanConfig, body: Callable, carry: Any, dynamic: Any, xs: Any
) -> tuple[Callable, list[str]] | None:
    """The `jax.checkpoint` policy of the policy's names that occur in `body` (one
    layer, traced once to learn them), and the names it offloads; None under
    `save="all"`, which has no checkpoint (names would mean nothing)."""
    policy = config.policy
    if policy.save == "all":
        return None
    names, residual_names = (), ()
    if checkpoint_patterns(policy):
        names, residual_names = _probe_names(body, carry, dynamic, xs)
    save, offload = split_names(policy, names)
    checkpoint_policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=save,
        names_which_can_be_offloaded=offload,
        offload_src="device",
        offload_dst=policy.offload_dst,
    )
    occurrence = _checkpoint_name_log.Occurrence(config.path, names, residual_names)
    _checkpoint_name_log.record(checkpoint_policy, occurrence)
    return checkpoint_policy, offload


def _probe_names(
    body: Callable, carry: Any, dynamic: Any, xs: Any
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Traces one layer, once, to learn which checkpoint names occur in it (ours and
    the user's own) and which of them are residuals: naming anything else does
    nothing. Under a policy that saves every named value, the residuals that are
    named are exactly the names the backward pass needs."""
    first = functools.partial(map_arrays, lambda a: a[0])
    every_name = lambda p, *_, **__: _jaxpr.is_checkpoint_name(p)  # noqa: E731
    probe = jax.checkpoint(body, policy=every_name, prevent_cse=False)
    residuals, closed = _residuals.trace_vjp(
        lambda c, d, x: probe(c, (first(d), first(x))), carry, dynamic, xs
    )
    names = _residuals.checkpoint_names(closed)
    return tuple(names), tuple(r.name for r in residuals if r.name is not None)


def _map_submodules(node: Any, prefix: str, fn: Callable[[Any, str], Any]) -> Any:
    """Rebuilds `node` with `fn(module, path)` applied to every `eqx.Module` strictly
    inside it, innermost first, not looking inside a nested `Stacked` (whose own
    configured scan handles its layers). Paths continue from `prefix`."""

    def visit(x: Any, path: str) -> Any:
        if not isinstance(x, Stacked):
            x = jtu.tree_map_with_path(
                lambda k, c: (
                    visit(c, _paths.join(path, k)) if isinstance(c, eqx.Module) else c
                ),
                x,
                is_leaf=lambda c: c is not x and isinstance(c, eqx.Module),
            )
        return fn(x, path) if path != prefix else x

    return visit(node, prefix)


def _with_class(module: Any, cls: type) -> Any:
    """A copy of `module` as an instance of `cls`, as `jax.tree_util` unflattening
    builds it (no `__init__`)."""
    # As Equinox's own unflattening does: a user's `__init__` takes its own
    # arguments (not the fields) and would rerun `__check_init__` on values that
    # may be tracers; `cls` is a subclass made by `_named_class`.
    out = object.__new__(cls)
    for field in dataclasses.fields(module):
        object.__setattr__(out, field.name, getattr(module, field.name))
    return out


@functools.cache
def _named_class(cls: type, name: str) -> type:
    """A subclass of `cls` whose `__call__` names its array outputs `name`, so the
    instance still passes `isinstance` checks and type annotations."""

    def __call__(self, *args, **kwargs):
        out = cls.__call__(self, *args, **kwargs)
        return jtu.tree_map(
            lambda x: checkpoint_name(x, name) if eqx.is_array(x) else x, out
        )

    namespace = {"__call__": __call__, "__module__": cls.__module__}
    return type(cls)(cls.__name__, (cls,), namespace)
