"""The parameters an optimizer sees (`trainable`), and the update's dispatch
(`UpdateArgs`): whole on the device, streamed (`_streaming.py`) or on the host
(`_host.py`), or chosen by platform."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
import optax
from jaxtyping import PyTree

from .. import _paths, _pending, _scopes, _tiling
from .._errors import see
from .._memory_kinds import is_arraylike, is_host, to_device, to_space
from .._policy import Policy
from . import _host, _metrics, _streaming


def is_trainable(x: Any) -> bool:
    """Floating-point arrays (or their `jax.ShapeDtypeStruct`s): what gets gradients."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
    return eqx.is_inexact_array(x)


def trainable(model: PyTree) -> PyTree:
    """The parameters an optimizer sees: `model` with non-trainable leaves `None`
    (and without the marks of a pending update, which its state does not mirror)."""
    return eqx.filter(_pending.mark(model, ()), is_trainable)


def with_params(model: PyTree, params: PyTree) -> PyTree:
    """`model` (unmarked) with its trainable leaves replaced by those of `params`."""
    rest = eqx.filter(_pending.mark(model, ()), is_trainable, inverse=True)
    return eqx.combine(params, rest)


def param_kinds(
    params: PyTree, model_kinds: list[tuple[_paths.Leaf, str]]
) -> list[str]:
    """The memory kind of each array leaf of `params` (the trainable part of the
    model), from the kinds of the model's leaves (`check_step`)."""
    kind_by_path = {leaf.path: kind for leaf, kind in model_kinds}
    return [
        kind_by_path[x.path] for x in _paths.leaves(params) if is_arraylike(x.value)
    ]


class UpdateArgs(NamedTuple):
    """The arguments of one optimizer update.

    `model_kinds` and `opt_kinds` are the memory kinds of the leaves, from
    `check_step`. `metrics` asks for the global norms."""

    optimizer: optax.GradientTransformation
    grads: PyTree
    opt_state: PyTree
    model: PyTree
    policy: Policy
    model_kinds: list[tuple[_paths.Leaf, str]]
    opt_kinds: list[tuple[_paths.Leaf, str]]
    metrics: bool = False


def update(args: UpdateArgs) -> tuple[PyTree, PyTree, dict[str, Any] | None]:
    """One optimizer update: the new model and state, in their memory kinds.

    With `args.metrics`, also the global norms of the gradients, the updates and
    the new parameters (`_metrics.norms`); else None. `policy.update` chooses how
    (`_UPDATES`): whole on the device, streamed (`_streaming.py`) or on the host
    (`_host.py`). `"auto"` chooses by platform when anything is on the host."""
    if args.policy.update == "auto" and _any_on_host(args):
        return _by_platform(args)
    return _UPDATES.get(args.policy.update, _whole_update)(args)


def _any_on_host(args: UpdateArgs) -> bool:
    """Whether any gradient, state leaf or trainable parameter is on the host."""
    trees = (args.grads, args.opt_state, trainable(args.model))
    return any(is_host(x) for x in jtu.tree_leaves(trees) if eqx.is_array(x))


def _in_pieces(
    args: UpdateArgs, host: bool
) -> tuple[PyTree, PyTree, dict[str, Any] | None]:
    """`Policy(update="host")`: the update on the host's CPU (`_host.update`). It
    needs optimizer state on the host to update there.

    `Policy(update="streamed")`: one layer or row block of each host-resident
    leaf on the device at a time (`_streaming.update`); whole with nothing on the
    host.

    Each new leaf comes back in its memory kind; a refusal is explained."""
    if host and not any(kind == "pinned_host" for _, kind in args.opt_kinds):
        raise ValueError(
            "`Policy(update='host')`: the policy keeps no optimizer state on the "
            "host. Put it there with `Policy(opt_state='pinned_host')`, or use "
            "`Policy(update='auto')`." + see(129)
        )
    if not host and not _any_on_host(args):
        return _whole_update(args)
    params = trainable(args.model)
    kinds = param_kinds(params, args.model_kinds), [k for _, k in args.opt_kinds]
    given = (args.optimizer, args.grads, args.opt_state, params)
    try:
        if host:
            new_params, opt_state, norms = _host.update(*given, kinds, args.metrics)
        else:
            layers, paths, shards = _streaming.layout(params, args.policy)
            new_params, opt_state, norms = _streaming.update(
                *given, layers, kinds, paths, args.metrics, shards
            )
    except _host.NotOnHost as e:
        raise ValueError(
            f"`Policy(update='host')`: the optimizer's update cannot run on the "
            f"host's CPU: {e}. Use `Policy(update='streamed')` (or `'auto'`), or "
            "change that part of the optimizer." + see(130)
        ) from e
    except _streaming.NotStreamable as e:
        raise ValueError(
            "`train_step`: this optimizer's update cannot be streamed piece by "
            f"piece unchanged: {e}. Use `Policy(update='whole')` or "
            "`Policy(opt_state='device')`." + see(45)
        ) from e
    return with_params(args.model, new_params), opt_state, norms


def _whole_update(args: UpdateArgs) -> tuple[PyTree, PyTree, dict[str, Any] | None]:
    """`Policy(update="whole")`: gradients, state and parameters brought to the
    device and updated there all at once."""

    model = to_device(args.model)
    with jax.named_scope(_scopes.GRAD):  # named for `memory_report`'s traffic
        grads = to_device(args.grads)
    # A gradient sent in the compute dtype (`_microbatch`), cast on the device.
    grads = jtu.tree_map(
        _metrics.widened, grads, trainable(model), is_leaf=lambda x: x is None
    )
    state = to_device(args.opt_state)
    updates, opt_state = args.optimizer.update(grads, state, trainable(model))
    model = eqx.apply_updates(model, updates)
    norms = _metrics.norms(grads, updates, trainable(model)) if args.metrics else None
    return model, opt_state, norms


_UPDATES = {
    "whole": _whole_update,
    "streamed": functools.partial(_in_pieces, host=False),
    "host": functools.partial(_in_pieces, host=True),
}


def _by_platform(args: UpdateArgs) -> tuple[PyTree, PyTree, dict[str, Any] | None]:
    """`Policy(update="auto")` with leaves on the host.

    The update is whole on the backends of `_tiling.WHOLE_ON`, streamed on the
    others. The choice is made inside the traced program
    (`jax.lax.platform_dependent`): a step traced here and compiled for a TPU
    streams. Both give every leaf back in its memory kind."""
    # Only arrays pass through `platform_dependent`; the rest is closed over.
    trees = (args.grads, args.opt_state, args.model)
    arrays, static = eqx.partition(trees, is_arraylike)

    def branch(how: Callable[[UpdateArgs], tuple]) -> Callable[[PyTree], PyTree]:
        def run(arrays: PyTree) -> PyTree:
            grads, opt_state, model = eqx.combine(arrays, static)
            moved = args._replace(grads=grads, opt_state=opt_state, model=model)
            new_model, new_state, norms = how(moved)
            with jax.named_scope(_scopes.PARAMS):
                new_model = to_kinds(new_model, args.model_kinds)
            with jax.named_scope(_scopes.OPT_STATE):
                new_state = to_kinds(new_state, args.opt_kinds)
            return eqx.filter((new_model, new_state), is_arraylike), norms

        return run

    whole = {platform: branch(_whole_update) for platform in _tiling.WHOLE_ON}
    streamed = branch(_UPDATES["streamed"])
    new, norms = jax.lax.platform_dependent(arrays, **whole, default=streamed)
    rest = eqx.filter((args.model, args.opt_state), is_arraylike, inverse=True)
    new_model, new_state = eqx.combine(new, rest)
    return new_model, new_state, norms


def to_kinds(tree: PyTree, kinds: list[tuple[_paths.Leaf, str]]) -> PyTree:
    """Every array leaf of `tree` in its memory kind (`kinds`, in order: from
    `check_step`)."""
    found = iter(kinds)
    return jtu.tree_map(
        lambda x: to_space(x, next(found)[1], "") if is_arraylike(x) else x, tree
    )
