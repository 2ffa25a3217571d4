"""`verify`: an offloaded train step checked against the plain one.

It runs on a slice of the model small enough to run both.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from . import _compat, _cutting, _layout, _mesh, _microbatch, _mixed_precision
from ._errors import see
from ._memory_kinds import kind_of
from ._pending import check_ready
from ._placement import place_batch
from ._policy import Policy, replace
from ._traced_step import value_and_grad
from ._train_step import TrainStep
from ._transform import call_on_auto_axes
from ._update import apply_pending, is_trainable, own_state, stepping, trainable
from ._verify_compare import array_leaves, check_kinds, compare, update_pairs
from ._verify_report import raise_if_failed, VerifyReport


@eqx.filter_jit
def _reference(step: TrainStep, dtypes: tuple | None, model: Any, batch: tuple) -> Any:
    """Plain `value_and_grad`: no transform, so every `Stacked` is a plain scan.

    It runs on the axis types the step runs the loss on. Over a mesh with `Explicit`
    axes under `Policy(loss_axes="auto")`, those are `Auto` ones.

    It reads the step's loss, `has_aux` and `Policy(loss_axes=...)`. With `dtypes` (one
    per trainable leaf), the loss sees each trainable leaf cast to its dtype. The
    gradient comes back in the leaf's own dtype (the cast's transpose). Over the step's
    micro-batches it gives the mean of the loss and gradient, in float32. Micro-batch
    `i` of `k` is examples `i, i + k, ...` (what `train_step` defines).
    """
    loss_fn, has_aux, k = step.loss_fn, step.has_aux, step.microbatches

    def loss(model: Any, *batch: Any) -> Any:
        if dtypes is not None:
            params, rest = eqx.partition(model, is_trainable)
            flat, treedef = jtu.tree_flatten(params)
            cast = [x.astype(d) for x, d in zip(flat, dtypes, strict=True)]
            model = eqx.combine(jtu.tree_unflatten(treedef, cast), rest)
        if step.policy.loss_axes == "auto" and _layout.explicit_axes():
            return call_on_auto_axes(loss_fn, (model, *batch), {})
        return loss_fn(model, *batch)

    grad = eqx.filter_value_and_grad(loss, has_aux=has_aux)
    if k == 1:
        return grad(model, *batch)

    def parts(x: Any) -> Any:
        return jnp.stack([x[i::k] for i in range(k)])

    def one(part: tuple) -> Any:
        whole = (b if p is None else p for b, p in zip(batch, part, strict=True))
        return grad(model, *whole)

    split_batch = tuple(
        None if position in step.unsplit else jtu.tree_map(parts, argument)
        for position, argument in enumerate(batch)
    )

    def mean(x: Any) -> Any:
        return jnp.sum(x.astype(jnp.float32), 0) / k

    value, grads = jax.lax.map(one, split_batch)
    grads = jtu.tree_map(lambda g: mean(g).astype(g.dtype), grads)
    return ((mean(value[0]), value[1]) if has_aux else mean(value)), grads


@eqx.filter_jit
def _offloaded(step: TrainStep, arguments: tuple[Any, Any, tuple]) -> Any:
    """The forward and backward pass as `train_step` computes them (its own code),
    on `arguments = (model, opt_state, batch)`."""
    return value_and_grad(step, arguments, "`verify`")


def _loss(value: Any, has_aux: bool) -> Any:
    return value[0] if has_aux else value


def _own_update(policy: Policy, model: PyTree, opt_state: PyTree) -> str | None:
    """The update of its own `train_step` runs here, to check against optax's on the
    device.

    `"streamed"` where it streams on some backend (`"auto"` streams on all but the CPU).
    `"host"` on the host's CPU. None for optax's own.
    """
    leaves = jtu.tree_leaves((trainable(model), opt_state))
    host = any(kind_of(x) != "device" for x in leaves if eqx.is_array(x))
    if policy.update == "host":
        return "host"
    return "streamed" if policy.update in ("streamed", "auto") and host else None


def _refuses_old_forms(verify: Callable) -> Callable:
    """`verify`, refusing its old forms with their new spelling.

    It refuses them before the type checker sees them: the loss, optimizer and
    policy instead of the step, and `microbatch=`. It unwraps `eqx.filter_jit(step)`.
    """

    @functools.wraps(verify)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if "microbatch" in kwargs:
            raise TypeError(
                "`verify(microbatch=...)` is now `verify(examples=...)`: how many "
                "examples to keep." + see(141)
            )
        if "step" in kwargs:
            kwargs["step"] = _compat.inside_filter_jit(kwargs["step"])
        elif args:
            args = (_compat.inside_filter_jit(args[0]), *args[1:])
        step = kwargs["step"] if "step" in kwargs else (args[0] if args else None)
        moved = {"has_aux", "microbatches", "unsplit"}.intersection(kwargs)
        if not isinstance(step, TrainStep) or moved:
            raise TypeError(_OLD_FORM + see(142))
        return verify(*args, **kwargs)

    return checked


_OLD_FORM = (
    "`verify` takes the step, as `memory_report` does: `verify(step, model, "
    "opt_state, *batch)`, with `step = eqx_offload.train_step(loss_fn, optimizer, "
    "policy, has_aux=..., microbatches=...)`."
)


class _Slice(NamedTuple):
    """What `verify` checks, and what was kept.

    The model, optimizer state and batch are cut to their first layers and examples.
    """

    model: PyTree  # on the device: the reference's input
    opt_state: PyTree
    batch: tuple  # laid out as the step lays it out
    layers: int | None  # None: every layer
    examples: int | None  # the examples in the batch kept (None: no leading axis)
    whole_batch: bool


def _cut(
    step: TrainStep,
    arguments: tuple[PyTree, PyTree, tuple],
    layers: int | None,
    examples: int | None,
) -> _Slice:
    """Every `Stacked` of `arguments = (model, opt_state, batch)` cut to its first
    `layers` layers.

    The optimizer state that mirrors them is cut too. The batch is cut to its first
    `examples` examples. They are rounded up to whole micro-batches (of whole blocks of
    `Policy(batch=...)`).
    """
    model, opt_state, batch = arguments
    policy, unsplit = step.policy, step.unsplit
    # The optimizer the step runs: under a compute dtype, its state holds the
    # compute copies (`ComputeCopyState`), and under `update_timing` it is a
    # `PendingUpdate` holding the waiting gradients; both are cut with their
    # parameters.
    runs = stepping(step.optimizer, trainable(model), policy)
    model_sizes = _cutting.model_sizes(model, layers)
    small = _cutting.cut(model, model_sizes)
    state_sizes = _cutting.state_sizes(runs, opt_state, trainable(small))
    small_state = _cutting.cut(opt_state, state_sizes)
    kept = _cutting.whole_parts(examples, policy, model, step.microbatches)
    small_batch = _cutting.cut(batch, _cutting.batch_sizes(batch, kept, unsplit))
    count = _cutting.examples(small_batch, unsplit)
    whole_batch = count == _cutting.examples(batch, unsplit)
    if _cutting.model_sizes(model, None) == model_sizes:
        layers = None  # every layer
    # Laid out as `train_step` lays it out, so that its micro-batches are checked
    # against the blocks the step splits.
    mesh = _mesh.tree_mesh(model)
    small_batch = place_batch(small_batch, policy.batch, mesh, "`verify`", unsplit)
    if step.microbatches > 1:
        what = "the whole batch" if whole_batch else f"{count} examples"
        where = f"`verify` ({what}, `train_step(microbatches={step.microbatches})`)"
        _microbatch.check(small_batch, step.microbatches, unsplit, where, see(125))
    return _Slice(small, small_state, small_batch, layers, count, whole_batch)


def _gradient_pairs(
    step: TrainStep,
    dtypes: tuple | None,
    cut: _Slice,
    arguments: tuple[PyTree, PyTree, tuple],
) -> tuple[Any, list, list]:
    """The reference loss, and the `compare` pairs of the loss and of each leaf's
    gradient.

    They compare the step's own forward and backward pass against plain JAX. Both run on
    the slice of `arguments = (model, opt_state, batch)`.
    """
    model, opt_state, batch = arguments
    # In the model's mesh, as `train_step` traces the loss.
    with _mesh.context(cut.model, cut.batch):
        try:
            ref_value, ref_grads = _reference(step, dtypes, cut.model, cut.batch)
        except Exception as e:  # the loss's own error, explained if the cut did it
            kept = None if cut.whole_batch else cut.examples
            error = _cutting.cut_error(
                step.loss_fn, model, batch, cut.model, cut.batch, cut.layers, kept, e
            )
            if error is None:
                raise
            raise error from e
        copies = (
            _cutting.copy_into(cut.model, model),
            _cutting.copy_into(own_state(cut.opt_state), own_state(opt_state)),
            cut.batch,
        )
        value, grads = _offloaded(step, copies)
    ref_loss = _loss(ref_value, step.has_aux)
    losses = [("loss", _loss(value, step.has_aux), ref_loss, ref_loss, 0.0)]
    gradients = [
        (r.path, o.value, r.value, r.value, 0.0)
        for o, r in zip(array_leaves(grads), array_leaves(ref_grads), strict=True)
    ]
    return ref_loss, losses, gradients


def _run_step(
    step: TrainStep, policy: Policy, cut: _Slice, model: PyTree, opt_state: PyTree
) -> tuple[PyTree, PyTree, list]:
    """Donating steps under `policy` on copies of the slice, on its batch.

    It gives the model, the optimizer state (its own, without a pending update) and
    each step's loss. One step, or two under `Policy(update_timing=...)`: the second
    applies the update the first held over in its forward scan. Then
    `apply_pending` applies the second's.
    """
    # Under `update_timing="now"` (the whole update's), its own optimizer state.
    own = (lambda x: x) if policy.update_timing != "now" else own_state
    run = dataclasses.replace(step, policy=policy, metrics=False)
    new_model = _cutting.copy_into(cut.model, model)
    new_state = _cutting.copy_into(own(cut.opt_state), own(opt_state))
    values = []
    for _ in range(1 if step.policy.update_timing == "now" else 2):
        new_model, new_state, value, _ = run(new_model, new_state, *cut.batch)
        values.append(value)
    # (With nothing pending, `apply_pending` gives back what it is given.)
    new_model, new_state = apply_pending(new_model, new_state, step.optimizer, policy)
    return new_model, own_state(new_state), values


def _step_checks(
    step: TrainStep, cut: _Slice, model: PyTree, opt_state: PyTree, ref_loss: Any
) -> tuple[list, list | None]:
    """The step itself, on a slice whose gradients are right.

    A streamed step (or one updating on the host) runs against the whole update. Any
    other step runs once. Either way its own program is exercised: placements, donation,
    outputs. Under `update_timing`, two steps run, the second applying the first's
    held-over update in its forward scan, then `apply_pending`: against two whole
    updates now, loss by loss.

    **Returns:** the `compare` pairs of the steps' losses, and of the update (`None`
    where nothing streams).
    """
    policy = step.policy
    own = _own_update(policy, model, opt_state)
    timing = policy.update_timing != "now"
    streams = own is not None or timing
    losses, outputs, values = [], [], []
    for mode in (own or policy.update, "whole") if streams else (policy.update,):
        mine = mode != "whole"
        timed = {} if mine else {"update_timing": "now"}
        chosen = replace(policy, update=mode, **timed)
        new_model, new_state, value = _run_step(step, chosen, cut, model, opt_state)
        step_name = f"{mode}, {policy.update_timing}" if mine and timing else mode
        name = f"loss ({step_name} step)" if streams else "loss (step)"
        losses.append((name, _loss(value[0], step.has_aux), ref_loss, ref_loss, 0.0))
        outputs.append((new_model, new_state))
        values.append(_loss(value[-1], step.has_aux))
    if timing:  # the second steps' losses: the held-over update applied first
        losses.append(("loss (second step)", values[0], values[1], values[1], 0.0))
    check_kinds(outputs[0], (model, own_state(opt_state)))
    # Both updates are the optimizer's on the masters, in their own dtype.
    return losses, update_pairs(cut.model, *outputs) if streams else None


@_refuses_old_forms
def verify(
    step: TrainStep,
    model: PyTree,
    opt_state: PyTree,
    *batch: Any,
    layers: int | None = 2,
    examples: int | None = 2,
    rtol: float | None = None,
    atol: float | None = None,
) -> VerifyReport:
    """Checks that a `train_step` computes what plain training computes.

    It runs on a slice of the model small enough to run both. Every `Stacked` is cut to
    its first `layers` layers. The optimizer state that mirrors them is cut too (compute
    copies included). Every batch array is cut to its first `examples` examples. On that
    slice, `verify` compares

    1. **the loss** and 2. **each leaf's gradient** as the step computes them, with the
    reference. The step runs `filter_offload(loss_fn, policy)`. Each leaf is in the
    memory kind it has in `model`. The step uses its micro-batches and compute copies.
    The reference has every leaf on the device and no remat. It is plain
    `eqx.filter_value_and_grad` of the loss, averaged over the same micro-batches. Its
    model is cast to `Policy(compute_dtype=...)`, but for the `keep_dtype` leaves.
    3. **the update**: the model and optimizer state after one donating step. A step
    with `Policy(update="streamed")` (or `"host"`, the policy's own) runs against one
    with `update="whole"` (plain optax on the device). This runs when the step streams
    or updates on the host and the first two checks pass. Both steps' losses join the
    loss check. Any other step runs once, and its loss joins the loss check. Under
    `Policy(update_timing="next_forward")` two steps run on the batch, the second
    applying the update the first held over in its forward scan, then
    `eqx_offload.apply_pending`: against two whole updates with
    `update_timing="now"`. So neither `opt_state` nor `model` may have an update
    pending: give a fresh state from `init_opt_state`, or both after `apply_pending`.

    It never donates or changes the caller's arrays: the steps it runs get copies.

    Each check passes if, for every leaf, `max |ours - reference| <= atol + rtol *
    scale`. `scale` is the reference's largest magnitude over the leaf. For parameters
    after the update it is the largest change. So entries near zero, where cancellation
    leaves only rounding, do not fail a correct step.

    The default tolerances (`rtol`, `atol`) go by the leaf's dtype. For the loss and
    gradients, a narrower dtype they were computed in decides: the values carry its
    rounding. 32- and 64-bit floats `1e-4, 1e-8`; 16-bit floats `5e-2, 1e-5`; 8-bit
    floats `0.2, 1e-3`; integers exact. A correct step differs from the reference by
    rounding in reassociated sums. On the CPU that is under `3.6e-7` of a leaf's scale
    in float32. A wrong residual or transfer differs by the order of the values
    themselves. docs/verify.md says why these values.

    **Arguments:**

    - `step`: the `eqx_offload.TrainStep` to check, from `train_step`. Its loss is
        compared, not its `aux`. The batch arguments in its `unsplit` are passed whole,
        and not cut.
    - `model`, `opt_state`, `*batch`: as for the step, already placed
        (`eqx_offload.place`, `eqx_offload.init_opt_state`).
    - `layers`: how many layers of each `Stacked` to keep (nested ones too), or `None`
        for all. Two, by default: the fewest that still pass a carry from one layer to
        the next through a real loop. (Its offloaded residual too.)
    - `examples`: how many examples to keep. Every batch array with at least one
        dimension is cut along its first axis. `None` keeps the batch whole (e.g. when
        its arrays are not batch-major). Two, by default, so that a bug mixing examples
        can show. It is rounded up to a multiple of the step's `microbatches`, times the
        parts a `Policy(batch=...)` splits the batch into.
    - `rtol`, `atol`: override the default tolerances for every check.

    **Returns:**

    A `VerifyReport` with each check's largest difference; `print` it for a table.

    **Raises:**

    - `eqx_offload.DoesNotMatch` (a `ValueError`) naming the first check that fails
        (loss, gradients, update). It names its leaf, the difference and the tolerance.
        `error.report` has all of them.
    - `ValueError` naming `layers=` (or `examples=`) when `loss_fn` fails on the slice
        but traces on the whole. Such a loss sizes something by the configured depth,
        not by the `Stacked` it gets. (E.g. one KV cache per layer from a config.)
    - `ValueError` naming `microbatches=` when the examples kept do not split into the
        step's micro-batches. (Micro-batches of whole blocks of `Policy(batch=...)`.)

    !!! Example

        ```python
        policy = eo.Policy.offload_all(compute_dtype=jnp.bfloat16)
        model = eo.place(model, policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(loss_fn, optimizer, policy, microbatches=2)
        print(eo.verify(step, model, opt_state, tokens, targets))  # then train
        ```
    """
    for value, argument in ((layers, "layers"), (examples, "examples")):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(
                f"`verify({argument}=...)` must be a positive int, or None to keep "
                f"all, got {value!r}."
            )
    policy = step.policy
    # A pending update (`Policy(update_timing=...)`) was computed for the whole
    # model: it cannot be cut, and the model is one update behind.
    check_ready("`verify`", opt_state, model)
    params = trainable(model)
    wrapped = _mixed_precision.for_policy(step.optimizer, params, policy)
    _mixed_precision.check_state(
        wrapped is not step.optimizer, own_state(opt_state), "`verify`"
    )
    # Computed in the compute dtype, whatever dtype they are kept in: its rounding
    # (each gradient in its leaf's: `keep_dtype` leaves are computed in their own).
    dtypes, by_leaf = None, {}
    if policy.compute_dtype is not None:
        _mixed_precision.check_keep_dtype(params, policy, "`verify`")
        dtypes = tuple(_mixed_precision.compute_dtypes(params, policy))
        by_leaf = dict(zip([x.path for x in array_leaves(params)], dtypes, strict=True))
    arguments = (model, opt_state, batch)
    cut = _cut(step, arguments, layers, examples)
    ref_loss, losses, gradients = _gradient_pairs(step, dtypes, cut, arguments)
    loss_check = compare(losses, rtol, atol, policy.compute_dtype)
    gradient_check = compare(gradients, rtol, atol, by_leaf)
    update = None
    if loss_check.passed and gradient_check.passed:
        more, pairs = _step_checks(step, cut, model, opt_state, ref_loss)
        loss_check = compare(losses + more, rtol, atol, policy.compute_dtype)
        update = None if pairs is None else compare(pairs, rtol, atol)

    report = VerifyReport(
        loss=loss_check,
        gradients=gradient_check,
        update=update,
        layers=cut.layers,
        examples=cut.examples,
        whole_batch=cut.whole_batch,
        microbatches=step.microbatches,
    )
    raise_if_failed(report)
    return report
