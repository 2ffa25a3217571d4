"""`verify`: an offloaded train step checked against the plain one, on a slice of
the model small enough to run both."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import PyTree

from . import _cutting, _layout, _mesh, _paths
from ._memory_kinds import kind_of
from ._policy import check_policy, Policy, replace
from ._train_step import train_step
from ._transform import call_on_auto_axes, filter_offload
from ._update import as_transformation, is_trainable, trainable


# Default tolerances by the compared leaf's floating-point width (bytes): see
# `verify`'s docstring and docs/verify.md for why these values.
_DEFAULT_TOLERANCES = {
    8: (1e-4, 1e-8),
    4: (1e-4, 1e-8),
    2: (5e-2, 1e-5),
    1: (2e-1, 1e-3),
}
_UPSTREAM = (
    "Offloading and remat change where values are stored and what is recomputed, "
    "never the mathematics, so a difference beyond rounding is a bug: in the step, "
    "or in the compiler (upstream XLA has produced silently wrong gradients for "
    "offloaded scan residuals on GPU, openxla/xla#46231). Narrow it down by "
    "verifying with less offloading (`Policy.offload_residuals()`, then "
    "`Policy.remat()`, `opt_state='device'`, `update='whole'`) and train with the "
    "policy that passes."
)


_SCALES = {
    "loss": "the reference loss",
    "gradients": "the largest entry of the reference gradient",
    "update": "the largest change of a parameter in the whole update, which also "
    "allows one rounding of the parameter; the largest entry of a state leaf",
}


class DoesNotMatch(ValueError):
    """Raised by `verify` when the offloaded step differs from the reference beyond
    the tolerance. The message names the check, the leaf and the difference;
    `error.report` holds every check's largest difference."""

    report: "VerifyReport"

    def __init__(self, message: str, report: "VerifyReport"):
        super().__init__(message)
        self.report = report


class Difference(NamedTuple):
    """The largest difference one check found, relative to its tolerance."""

    leaf: str
    """The leaf (its dotted path; `"loss"` for the loss) nearest to its tolerance."""
    difference: float
    """The largest absolute difference over that leaf."""
    scale: float
    """What the tolerance is relative to: the reference's largest magnitude over
    the leaf (for parameters after the update: the largest change)."""
    tolerance: float
    """`atol + rtol * scale` (for a parameter after the update, plus one rounding
    of it); the check passes if `difference <= tolerance`."""

    @property
    def passed(self) -> bool:
        return self.difference <= self.tolerance


class VerifyReport(eqx.Module):
    """What `verify` compared and the largest difference of each check. Print it
    for a table.

    - `loss`: the offloaded loss against the reference loss.
    - `gradients`: each leaf's offloaded gradient against the reference gradient;
        the leaf nearest to its tolerance.
    - `update`: the model and optimizer state after the streamed update against
        those after the whole update, or `None` when not checked: the step does
        not stream (`Policy(update="whole")`, or nothing parameter-shaped on the
        host), or the loss or gradients already differ.
    - `layers`, `microbatch`: the slice checked (`None`: all of it): the layers
        kept of each `Stacked`, and the examples kept of the batch (fewer than
        `verify(microbatch=...)` asked for when the batch is smaller).
    - `examples`: how many examples the checked batch holds (its leading axis;
        `None` for a batch without one).
    """

    loss: Difference
    gradients: Difference
    update: Difference | None
    layers: int | None
    microbatch: int | None
    examples: int | None = None

    @property
    def passed(self) -> bool:
        checks = (self.loss, self.gradients, self.update)
        return all(c.passed for c in checks if c is not None)

    def __str__(self) -> str:
        rows = [("check", "leaf", "max |difference|", "tolerance", "")]
        for name in ("loss", "gradients", "update"):
            check = getattr(self, name)
            if check is None:
                rows.append((name, "(not checked)", "-", "-", ""))
                continue
            verdict = "ok" if check.passed else "FAILED"
            difference, tolerance = f"{check.difference:.3g}", f"{check.tolerance:.3g}"
            rows.append((name, check.leaf, difference, tolerance, verdict))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        where = _slice_text(self.layers, self.microbatch, self.examples)
        lines = [
            f"eqx_offload.verify: {where}",
            *(
                "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4]
                for row in rows
            ),
        ]
        return "\n".join(line.rstrip() for line in lines)


def _slice_text(
    layers: int | None, microbatch: int | None, examples: int | None = None
) -> str:
    def first(n: int, noun: str) -> str:
        return f"the first {noun}" if n == 1 else f"the first {n} {noun}s"

    where = "every layer" if layers is None else first(layers, "layer")
    what = "the whole batch" if microbatch is None else first(microbatch, "example")
    if microbatch is None and examples is not None:
        what += f" ({examples} example{'' if examples == 1 else 's'})"
    return f"{where} of each `Stacked`, {what}"


def _check_count(value: Any, argument: str) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < 1
    ):
        raise ValueError(
            f"`verify({argument}=...)` must be a positive int, or None to keep all, "
            f"got {value!r}."
        )


def _abstract(tree: Any) -> Any:
    """`tree` with its arrays as device-resident `jax.ShapeDtypeStruct`s."""
    return jtu.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x,
        tree,
    )


def _traces(loss_fn: Callable, model: Any, batch: tuple) -> bool:
    """Whether `loss_fn` traces on (abstract, device-resident) `model` and `batch`."""
    try:
        eqx.filter_eval_shape(loss_fn, _abstract(model), *_abstract(batch))
    except Exception:  # whatever the loss raises: it does not trace
        return False
    return True


def _cut_error(
    loss_fn: Callable,
    model: Any,
    batch: tuple,
    small: Any,
    small_batch: tuple,
    layers: int | None,
    microbatch: int | None,
    error: Exception,
) -> ValueError | None:
    """Why the loss fails on the slice `verify` cut, when it traces on the whole
    model and batch (and so the cut is to blame), as an error naming `verify`'s
    argument and the fix; `None` when the cut is not to blame."""
    if (layers is None and microbatch is None) or not _traces(loss_fn, model, batch):
        return None
    if _traces(loss_fn, small, small_batch):
        return None  # it traces on the slice too: the cut is not to blame
    if layers is not None and not _traces(loss_fn, small, batch):
        what = f"the model cut to the first {layers} layer(s) of each `Stacked`"
        how = (
            "it sizes something by the model's configured depth (e.g. one KV cache "
            "per layer from `config.n_layers`) rather than by the `Stacked` it "
            "gets. Size it by `len(model.blocks)` (or `stacked.scan` over "
            "per-layer inputs cut with it), or verify every layer with "
            "`verify(..., layers=None)`"
        )
        argument = f"layers={layers}"
    else:
        what = f"the batch cut to its first {microbatch} example(s)"
        how = (
            "it depends on the batch size (e.g. a shape from a config). Make it "
            "follow the batch's shape, or verify the whole batch with "
            "`verify(..., microbatch=None)`"
        )
        argument = f"microbatch={microbatch}"
    return ValueError(
        f"`verify({argument})`: `loss_fn` fails on {what}, though it traces on the "
        f"whole model and batch: {how}. It raised {type(error).__name__}: {error}"
    )


def _tolerance(dtype: Any, rtol: float | None, atol: float | None) -> tuple:
    if jnp.issubdtype(dtype, jnp.inexact):
        default = _DEFAULT_TOLERANCES.get(np.dtype(dtype).itemsize, (1e-4, 1e-8))
    else:
        default = (0.0, 0.0)  # integers, booleans, PRNG keys: exactly
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


def _rounding(x: Any) -> float:
    """One rounding of the largest entry of a floating-point array."""
    largest = float(np.nanmax(np.abs(_as_float(x)), initial=0.0))
    return float(jnp.finfo(x.dtype).eps) * largest


def _as_float(x: Any) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        # Laid out over several processes' devices: each process compares the
        # whole value.
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x).astype(np.float64)


def _compare(
    pairs: list[tuple[str, Any, Any, Any, float]],
    rtol: float | None,
    atol: float | None,
) -> Difference:
    """The worst of `(leaf, ours, reference, scale_of, slack)` comparisons: the
    largest difference relative to its tolerance, `atol + rtol * scale + slack`,
    where `scale` is the largest magnitude of the array `scale_of`."""
    worst: Difference | None = None
    for leaf, ours, ref, scale_of, slack in pairs:
        r, a = _tolerance(ref.dtype, rtol, atol)
        ours, ref = _as_float(ours), _as_float(ref)
        with np.errstate(invalid="ignore"):
            gap = np.where(ours == ref, 0.0, np.abs(ours - ref))
        # NaNs where the reference has them are equal; anywhere else they differ.
        gap = np.where(np.isnan(ours) & np.isnan(ref), 0.0, gap)
        gap = np.where(np.isnan(gap), np.inf, gap)
        difference = float(np.max(gap, initial=0.0))
        scale = float(np.nanmax(np.abs(_as_float(scale_of)), initial=0.0))
        found = Difference(leaf, difference, scale, a + r * scale + slack)
        if worst is None or _ratio(found) > _ratio(worst):
            worst = found
    assert worst is not None
    return worst


def _ratio(d: Difference) -> float:
    if d.tolerance == 0:
        return 0.0 if d.difference == 0 else float("inf")
    return d.difference / d.tolerance


def _array_leaves(tree: Any) -> list[_paths.Leaf]:
    return [leaf for leaf in _paths.leaves(tree) if eqx.is_array(leaf.value)]


@eqx.filter_jit
def _reference(
    loss_fn: Callable, loss_axes: str, has_aux: bool, model: Any, batch: tuple
) -> Any:
    """Plain `value_and_grad`: no transform, so every `Stacked` is a plain scan. On
    the axis types the step runs the loss on: `Auto` ones over a mesh with
    `Explicit` axes under `Policy(loss_axes="auto")`."""

    def loss(model: Any, *batch: Any) -> Any:
        if loss_axes == "auto" and _layout.explicit_axes():
            return call_on_auto_axes(loss_fn, (model, *batch), {})
        return loss_fn(model, *batch)

    return eqx.filter_value_and_grad(loss, has_aux=has_aux)(model, *batch)


@eqx.filter_jit
def _offloaded(
    loss_fn: Callable, policy: Policy, has_aux: bool, model: Any, batch: tuple
) -> Any:
    """The forward and backward pass as `train_step` computes them."""
    loss = filter_offload(loss_fn, policy)
    return eqx.filter_value_and_grad(loss, has_aux=has_aux)(model, *batch)


def _loss(value: Any, has_aux: bool) -> Any:
    return value[0] if has_aux else value


def _streams(policy: Policy, model: PyTree, opt_state: PyTree) -> bool:
    """Whether `train_step` streams this update (`_update.update`) on some backend
    (`"auto"` streams on all but the CPU)."""
    leaves = jtu.tree_leaves((trainable(model), opt_state))
    host = any(kind_of(x) != "device" for x in leaves if eqx.is_array(x))
    return policy.update in ("streamed", "auto") and host


def verify(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    policy: Policy,
    model: PyTree,
    opt_state: PyTree,
    *batch: Any,
    has_aux: bool = False,
    layers: int | None = 2,
    microbatch: int | None = 2,
    rtol: float | None = None,
    atol: float | None = None,
) -> VerifyReport:
    """Checks that `train_step(loss_fn, optimizer, policy)` computes what plain
    training computes, on a slice of the model small enough to run both.

    Every `Stacked` is cut to its first `layers` layers (with the optimizer state
    that mirrors them) and every batch array to its first `microbatch` examples.
    On that slice, `verify` compares

    1. **the loss** and 2. **each leaf's gradient** of the offloaded forward and
        backward pass (`filter_offload(loss_fn, policy)`, each leaf in the memory
        kind it has in `model`) with the reference: every leaf on the device, no
        remat, plain `eqx.filter_value_and_grad`;
    3. **the update**: the model and optimizer state after one donating
        `train_step` with `Policy(update="streamed")` against one with
        `update="whole"` (plain optax on the device), when the step streams and
        the first two checks pass. Both steps' losses join the loss check. A
        step that does not stream runs once, and its loss joins the loss check.

    It never donates or changes the caller's arrays: only copies are given to the
    steps it runs.

    Each check passes if, for every leaf, `max |ours - reference| <= atol + rtol *
    scale`, where `scale` is the reference's largest magnitude over the leaf (the
    largest change, for parameters after the update): a tolerance relative to the
    leaf as a whole, not to each element, so that entries near zero (where
    cancellation leaves only rounding) do not fail a correct step.

    Default tolerances, by the leaf's dtype (`rtol`, `atol`): 32- and 64-bit floats
    `1e-4, 1e-8`; 16-bit floats `5e-2, 1e-5`; 8-bit floats `0.2, 1e-3`; integers
    exact. Remat and offloading only change where values are stored and what is
    recomputed, so a correct step differs from the reference by rounding in
    reassociated sums: measured on the CPU, under `3.6e-7` of a leaf's scale in
    float32 (`rtol` leaves a factor of 250) and nothing in bfloat16 (`rtol` allows
    about 13 roundings of `2**-8`, for backends that fuse differently). A wrong
    residual or transfer is off by the order of the values themselves. `atol` only
    decides leaves whose reference is (nearly) all zeros.

    **Arguments:**

    - `loss_fn`, `optimizer`, `policy`, `has_aux`: as for `train_step` (with
        `has_aux=True` the loss is compared, not `aux`).
    - `model`, `opt_state`, `*batch`: as for the step, already placed
        (`eqx_offload.place`, `eqx_offload.init_opt_state`).
    - `layers`: how many layers of each `Stacked` to keep (nested ones too), or
        `None` for all. Two, by default: the fewest that still pass a carry (and
        its offloaded residual) from one layer to the next through a real loop.
    - `microbatch`: how many examples to keep: every batch array with at least one
        dimension is cut along its first axis. `None` keeps the batch whole (e.g.
        when its arrays are not batch-major). Two, by default, so that a bug
        mixing examples can show; rounded up to a multiple of the parts a
        `Policy(batch=...)` splits the batch into.
    - `rtol`, `atol`: override the default tolerances for every check.

    **Returns:**

    A `VerifyReport` with each check's largest difference; `print` it for a table.

    **Raises:**

    - `eqx_offload.DoesNotMatch` (a `ValueError`) naming the first check that
        fails (loss, gradients, update), its leaf, the difference and the
        tolerance; `error.report` has all of them.
    - `ValueError` naming `layers=` (or `microbatch=`) when `loss_fn` fails on
        the slice but traces on the whole model and batch: a loss that sizes
        something by the configured depth (one KV cache per layer from a
        config) rather than by the `Stacked` it gets.

    !!! Example

        ```python
        policy = eo.Policy.offload_all()
        model = eo.place(model, policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        print(eo.verify(loss_fn, optimizer, policy, model, opt_state, tokens, targets))
        step = eo.train_step(loss_fn, optimizer, policy)   # then train as usual
        ```
    """
    if not callable(loss_fn):
        raise TypeError(f"`verify(loss_fn=...)` must be callable, got {loss_fn!r}.")
    _check_count(layers, "layers")
    _check_count(microbatch, "microbatch")
    transformation = as_transformation(optimizer, "`verify(optimizer=...)`")
    check_policy(policy, "`verify(policy=...)`")

    model_sizes = _cutting.model_sizes(model, layers)
    small = _cutting.cut(model, model_sizes)  # on the device: the reference's input
    state_sizes = _cutting.state_sizes(transformation, opt_state, trainable(small))
    small_state = _cutting.cut(opt_state, state_sizes)
    microbatch = _cutting.whole_parts(microbatch, policy, model)
    small_batch = _cutting.cut(batch, _cutting.batch_sizes(batch, microbatch))
    examples = _cutting.examples(small_batch)
    if examples == _cutting.examples(batch):
        microbatch = None  # the whole batch, whatever was asked
    if _cutting.model_sizes(model, None) == model_sizes:
        layers = None  # every layer

    # In the model's mesh, as `train_step` traces the loss.
    with _mesh.context(small, small_batch):
        try:
            ref_value, ref_grads = _reference(
                loss_fn, policy.loss_axes, has_aux, small, small_batch
            )
        except Exception as e:  # the loss's own error, explained if the cut did it
            cut = _cut_error(
                loss_fn, model, batch, small, small_batch, layers, microbatch, e
            )
            if cut is None:
                raise
            raise cut from e
        value, grads = _offloaded(
            loss_fn, policy, has_aux, _cutting.copy_into(small, model), small_batch
        )
    ref_loss = _loss(ref_value, has_aux)
    losses = [("loss", _loss(value, has_aux), ref_loss, ref_loss, 0.0)]
    gradients = [
        (r.path, o.value, r.value, r.value, 0.0)
        for o, r in zip(_array_leaves(grads), _array_leaves(ref_grads), strict=True)
    ]

    loss_check = _compare(losses, rtol, atol)
    gradient_check = _compare(gradients, rtol, atol)
    update = None
    # The update is checked on a step whose gradients are right.
    if (
        loss_check.passed
        and gradient_check.passed
        and _streams(policy, model, opt_state)
    ):
        outputs = []
        for mode in ("streamed", "whole"):
            step = train_step(
                loss_fn,
                optimizer,
                replace(policy, update=mode),
                has_aux=has_aux,
            )
            new_model, new_state, value = step(
                _cutting.copy_into(small, model),
                _cutting.copy_into(small_state, opt_state),
                *small_batch,
            )
            loss = _loss(value, has_aux)
            losses.append((f"loss ({mode} step)", loss, ref_loss, ref_loss, 0.0))
            outputs.append((new_model, new_state))
        _check_kinds(outputs[0], (model, opt_state))
        (streamed_model, streamed_state), (whole_model, whole_state) = outputs
        pairs = []
        for s, w, old in zip(
            _array_leaves(streamed_model),
            _array_leaves(whole_model),
            _array_leaves(small),
            strict=True,
        ):
            if is_trainable(old.value):
                # Relative to the change, which is what the update computes, give or
                # take one rounding of the new parameter (a change below it rounds
                # away, in bfloat16 often).
                change = _as_float(w.value) - _as_float(old.value)
                rounding = _rounding(w.value)
                pairs.append((s.path, s.value, w.value, change, rounding))
            else:
                pairs.append((s.path, s.value, w.value, w.value, 0.0))
        for s, w in zip(
            _array_leaves(streamed_state), _array_leaves(whole_state), strict=True
        ):
            pairs.append((f"opt_state.{s.path}", s.value, w.value, w.value, 0.0))
        update = _compare(pairs, rtol, atol)
        loss_check = _compare(losses, rtol, atol)
    elif loss_check.passed and gradient_check.passed:
        # No streaming to compare with: the step itself still runs once, so that
        # its own program (placements, donation, outputs) is exercised.
        step = train_step(loss_fn, optimizer, policy, has_aux=has_aux)
        outputs = step(
            _cutting.copy_into(small, model),
            _cutting.copy_into(small_state, opt_state),
            *small_batch,
        )
        _check_kinds(outputs[:2], (model, opt_state))
        losses.append(
            ("loss (step)", _loss(outputs[2], has_aux), ref_loss, ref_loss, 0.0)
        )
        loss_check = _compare(losses, rtol, atol)

    report = VerifyReport(
        loss=loss_check,
        gradients=gradient_check,
        update=update,
        layers=layers,
        microbatch=microbatch,
        examples=examples,
    )
    _raise_if_failed(report)
    return report


def _check_kinds(outputs: tuple, inputs: tuple) -> None:
    for out, into in zip(_array_leaves(outputs), _array_leaves(inputs), strict=True):
        if kind_of(out.value) != kind_of(into.value):
            raise ValueError(
                f"`verify`: the train step returned leaf {out.path!r} in "
                f"{kind_of(out.value)!r}, but it lives in {kind_of(into.value)!r}. "
                "This is a bug in eqx_offload; please report it."
            )


def _raise_if_failed(report: VerifyReport) -> None:
    reference = "the reference (every leaf on the device, no remat)"
    for name in ("loss", "gradients", "update"):
        check = getattr(report, name)
        if check is None or check.passed:
            continue
        if name == "loss":
            subject = f"the {check.leaf}"  # "the loss", "the loss (streamed step)"
            against = reference
        elif name == "gradients":
            subject = f"the gradient of leaf {check.leaf!r}"
            against = reference
        else:
            subject = f"leaf {check.leaf!r} after the streamed update"
            against = "the whole update (`Policy(update='whole')`: plain optax)"
        raise DoesNotMatch(
            f"`verify`: {subject} differs between the offloaded step and {against} "
            f"by {check.difference:.3g}, beyond the tolerance {check.tolerance:.3g} "
            f"(`atol + rtol * scale`, scale {check.scale:.3g}: {_SCALES[name]}). "
            "Checked on "
            f"{_slice_text(report.layers, report.microbatch, report.examples)}. "
            f"{_UPSTREAM}\n{report}",
            report,
        )
