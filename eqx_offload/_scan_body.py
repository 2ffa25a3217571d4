"""The scan body of a `Stacked` configured by `filter_offload`.

- Host slices move to the device one layer at a time, through their gradient taps.
- The carry and named submodules' outputs are named.
- `jax.checkpoint` applies with the policy's names.

The container (`_stacked.py`) knows only `AbstractScan`; this is its implementation.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
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
from ._memory_kinds import is_arraylike, is_host
from ._policy import checkpoint_patterns, Policy, split_names
from ._stacked import (
    AbstractScan,
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
            taps = [None if t is None else (t.dtype, t.read) for t in taps]
        layers = (dynamic, accs)
        read, layer_fn = _body_parts(self, f, static, taps)

        def body(c: Any, inputs: Any) -> Any:
            layer_slices, x = inputs
            return layer_fn(c, read(layer_slices), x)

        # Named, so that a compiled program's reader tells the layers' transfers
        # from the rest of the step's (`_compiler.phase`).
        with jax.named_scope(_scopes.LAYERS):
            found = _remat_policy(self, body, carry, layers, xs)
            if found is not None:
                body = jax.checkpoint(body, policy=found[0], prevent_cse=False)

            def plain() -> tuple[Any, Any]:
                return jax.lax.scan(body, carry, (layers, xs), length=length)

            offload = [] if found is None else found[1]
            owed = _pending.take(self.path)
            if owed is not None and not _can_apply(carry, dynamic, xs):
                owed = None  # (the step sees it untaken: it applies it before)
            if owed is not None:
                if found is not None:
                    layer_fn = jax.checkpoint(
                        layer_fn, policy=found[0], prevent_cse=False
                    )
                return _updating_scan(
                    self.path, layer_fn, read, carry, layers, xs, length, taps, owed
                )
            if not _reads_ahead(self, carry, layers, xs, offload):
                return plain()
            if found is not None:
                layer_fn = jax.checkpoint(layer_fn, policy=found[0], prevent_cse=False)
            # Where a value the layers close over is differentiated in forward
            # mode, `_prefetch.scan` runs `plain` instead.
            return _prefetch.scan(
                layer_fn, read, carry, layers, xs, length, taps is None, plain
            )

    def check_slice(self, layers: Any, how: str) -> None:
        _check_host_slice(self, layers, how)

    def check_bypass(self, layers: Any, how: str) -> None:
        _check_bypass(self, layers, how)


def _can_apply(carry: Any, dynamic: Any, xs: Any) -> bool:
    """Whether the forward scan can apply a pending update here: in the step's
    trace of the loss, or under `jax.vmap`s of it over examples (not over the
    layers: an ensemble), not in forward mode, without gradient taps or
    `Explicit` axes. Anywhere else (a loop, a `jax.checkpoint`, a `jax.jit` in
    the loss) it would run a different number of times than it is traced."""
    return (
        _compat.only_batched_since(_pending.traces())
        and not _compat.batched(dynamic)
        and not _compat.forward_mode((carry, dynamic, xs))
        and not _layout.explicit_axes()
    )


def _updating_scan(
    path: str,
    layer_fn: Callable,
    read: Callable,
    carry: Any,
    layers: Any,
    xs: Any,
    length: int,
    taps: list | None,
    owed: _pending.Layers,
) -> tuple[Any, Any]:
    """The prefetching scan that applies `owed`, the pending update of the
    layers' parameters, to each layer before it computes (`_pending.py`)."""
    if taps is not None or _layout.explicit_axes():
        raise ValueError(
            "A pending update reached a scan with gradient taps or `Explicit` axes "
            "(a bug)."
        )
    names = [
        _paths.join(path, leaf.path)
        for leaf in _paths.leaves(layers[0])
        if is_arraylike(leaf.value)
    ]
    positions = [names.index(p) for p in owed.paths]

    def apply(piece: Any, aux: Any, held: Any) -> Any:
        del piece  # (the parameters are read from `aux`)
        with jax.named_scope(_scopes.UPDATE):
            return owed.update(to_device(aux), held)

    def merge(piece: Any, aux: Any) -> Any:
        arrays, treedef = jtu.tree_flatten(piece[0])
        for k, new in zip(positions, aux[0], strict=True):
            arrays[k] = new
        return (jtu.tree_unflatten(treedef, arrays), piece[1])

    writes = tuple([w] * len(part) for w, part in zip(owed.writes, owed.aux))
    pending = _prefetch.Pending(apply, merge, writes, _pending.on_backward(path))
    return _prefetch.scan(
        layer_fn,
        read,
        carry,
        layers,
        xs,
        length,
        True,
        None,
        pending,
        (owed.aux, owed.held),
    )


def configure(stacked: Stacked, path: str, policy: Policy) -> Stacked:
    """The configured view of `stacked` (still a `Stacked`): the same layers, with the
    static configuration that makes `scan` name, checkpoint and offload."""
    return Stacked(stacked.layers, _scan=ScanConfig(path, policy))


def _host_leaves(config: ScanConfig, layers: Any) -> list[str]:
    """The paths of the host-resident array leaves of a configured `Stacked`."""
    return [
        _paths.join(config.path, leaf.path)
        for leaf in _paths.leaves(layers)
        if is_arraylike(leaf.value)
        and not isinstance(leaf.value, jax.ShapeDtypeStruct)
        and is_host(leaf.value)
    ]


def _check_host_slice(config: ScanConfig, layers: Any, how: str) -> None:
    """Slicing host-resident layers inside a step is a computation on the host."""
    host = _host_leaves(config, layers)
    if host:
        path = config.path
        raise ValueError(
            f"{how}: the layers of the `Stacked` at {path!r} are host-resident "
            f"({_paths.quoted(host, 3)}), and slicing them inside a step is a "
            f"computation on the host. Apply `{path}(x)` whole, slice the model "
            f"before the step, or use `Policy(params={{{path!r}: 'device'}})`."
            + see(36)
        )


def _check_bypass(config: ScanConfig, layers: Any, how: str) -> None:
    """A layer taken out of a configured `Stacked` (`stacked[i]`, iteration) is
    applied outside its scan: an error for host-resident layers, which are moved to
    the device only inside the scan; a warning when the policy asks for a
    `jax.checkpoint` or offloading that then never happens."""
    path, policy = config.path, config.policy
    host = _host_leaves(config, layers)
    keep = f"`Policy(params={{{path!r}: 'device'}})`"
    if _layer_taps(path, layers) is not None:
        raise ValueError(
            f"{how}: a layer is taken out of the `Stacked` at {path!r} in a step with "
            "micro-batches or a compute dtype, so it gets no gradient. Apply the "
            f"layers with `{path}(x)` or `{path}.scan(f, carry)`." + see(88)
        )
    if host:
        raise ValueError(
            f"{how}: the layers of the `Stacked` at {path!r} are host-resident "
            f"({_paths.quoted(host, 3)}) and reach the device only inside its scan. "
            f"Apply the layers with `{path}(x)` or `{path}.scan(f, carry)`, or use "
            f"{keep}." + see(34)
        )
    if policy.save != "all":
        warn_at_caller(
            f"{how} takes layers out of the `Stacked` at {path!r} and applies them "
            "outside its scan, so the policy's `jax.checkpoint` (and any offloading "
            "of their activations) does not apply to them: every layer's "
            "activations stay on the device. Apply the layers with "
            f"`{path}(x)` or `{path}.scan(f, carry)`." + see(37)
        )


def _layer_taps(path: str, layers: Any) -> list[_grad_taps.Tap | None] | None:
    """The gradient tap of each array leaf of the layers of the `Stacked` at
    `path` (in `jax.tree.leaves` order), or None when there are none."""
    if _grad_taps.current() is None:
        return None
    found = [
        _grad_taps.lookup(_paths.join(path, leaf.path))
        for leaf in _paths.leaves(layers)
        if eqx.is_array(leaf.value)
    ]
    return found if any(t is not None for t in found) else None


def _tap_layer(layer_arrays: Any, accs: list, taps: list) -> Any:
    """One layer's arrays, on the device, each seen through its tap."""
    leaves, treedef = jtu.tree_flatten(layer_arrays)
    tapped = [
        x if t is None else _grad_taps.tap(x, acc, *t, layer=True)
        for x, acc, t in zip(leaves, accs, taps, strict=True)
    ]
    return jtu.tree_unflatten(treedef, tapped)


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
    nameable = sorted(_paths.join(path, p) for p in _submodule_paths(static))
    to_name = {p for p in nameable if any(_paths.matches(q, p) for q in patterns)}

    def configure_inside(module: Any, sub_path: str) -> Any:
        if isinstance(module, Stacked) and module._scan is None:
            return configure(module, sub_path, policy)  # a nested `Stacked`
        if sub_path in to_name:
            return _with_class(module, _named_class(type(module), sub_path))
        return module

    def read(layers: Any) -> Any:
        layer_arrays, accs = layers
        layer_arrays = to_device(layer_arrays)
        if taps is not None:
            layer_arrays = _tap_layer(layer_arrays, accs, taps)
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
    names: tuple[str, ...] = ()
    residual_names: tuple[str, ...] = ()
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
    _checkpoint_name_log.attach(checkpoint_policy, occurrence)
    _checkpoint_name_log.record(occurrence)
    return checkpoint_policy, offload


def _reads_ahead(
    config: ScanConfig, carry: Any, layers: Any, xs: Any, offload: list[str]
) -> bool:
    """Whether the scan reads one layer ahead (`_prefetch.py`): under
    `Policy(prefetch=1)` where there is something to read (parameters on the
    host or a residual offloaded), but not under forward-mode differentiation
    (a `custom_vjp` has none) or over a mesh with `Explicit` axes (not yet)."""
    if config.policy.prefetch == 0 or _compat.forward_mode((carry, layers, xs)):
        return False
    if _layout.explicit_axes():
        return False
    return bool(_host_leaves(config, layers[0]) or offload)


def _probe_names(
    body: Callable, carry: Any, dynamic: Any, xs: Any
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Traces one layer, once, to learn which checkpoint names occur in it (ours and
    the user's own) and which of them are residuals: naming anything else does
    nothing. Under a policy that saves every named value, the residuals that are
    named are exactly the names the backward pass needs."""
    first = functools.partial(map_arrays, lambda a: a[0])
    probe = jax.checkpoint(body, policy=_save_every_name, prevent_cse=False)
    residuals, closed = _residuals.trace_vjp(
        lambda c, d, x: probe(c, (first(d), first(x))), carry, dynamic, xs
    )
    names = _residuals.checkpoint_names(closed)
    return tuple(names), tuple(r.name for r in residuals if r.name is not None)


def _save_every_name(primitive: Any, *_: Any, **__: Any) -> bool:
    return _jaxpr.is_checkpoint_name(primitive)


def _submodule_paths(module: Any) -> list[str]:
    """Paths of the submodules whose output a name can select."""
    paths: list[str] = []

    def collect(m: Any, p: str) -> Any:
        if not isinstance(m, Stacked):  # a nested `Stacked` names its own carry
            paths.append(p)
        return m

    _map_submodules(module, "", collect)
    return paths


def _map_submodules(node: Any, prefix: str, fn: Callable[[Any, str], Any]) -> Any:
    """Rebuilds `node` with `fn(module, path)` applied to every `eqx.Module` strictly
    inside it, innermost first, not looking inside a nested `Stacked` (whose own
    configured scan handles its layers). Paths continue from `prefix`."""

    def visit(x: Any, path: str) -> Any:
        if isinstance(x, Stacked):
            return fn(x, path) if path != prefix else x
        if isinstance(x, eqx.Module):
            changed = {}
            for field in dataclasses.fields(x):
                if field.metadata.get("static", False):
                    continue
                child = getattr(x, field.name)
                new = visit(child, _paths.join(path, field.name))
                if new is not child:
                    changed[field.name] = new
            if changed:
                x = _with_fields(x, changed)
            return fn(x, path) if path != prefix else x
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            new = [visit(c, f"{path}[{i}]") for i, c in enumerate(x)]
            return x if all(a is b for a, b in zip(new, x)) else type(x)(new)
        if isinstance(x, dict):
            new = {
                k: visit(v, _paths.join(path, _paths.format_key(jtu.DictKey(k))))
                for k, v in x.items()
            }
            return x if all(new[k] is x[k] for k in x) else type(x)(new)
        return x

    return visit(node, prefix)


def _with_fields(module: Any, changed: dict[str, Any]) -> Any:
    return _with_class(module, type(module), changed)


def _with_class(module: Any, cls: type, changed: dict[str, Any] | None = None) -> Any:
    """A copy of `module` as an instance of `cls`, as `jax.tree_util` unflattening
    builds it (no `__init__`), with some fields replaced."""
    # As Equinox's own unflattening does: a user's `__init__` takes its own
    # arguments (not the fields) and would rerun `__check_init__` on values that
    # may be tracers; `cls` may be a subclass made by `_named_class`.
    changed = changed or {}
    out = object.__new__(cls)
    for field in dataclasses.fields(module):
        value = changed.get(field.name, getattr(module, field.name))
        object.__setattr__(out, field.name, value)
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
