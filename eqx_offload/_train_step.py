"""`train_step` and the step it returns, `TrainStep`.

A `TrainStep` is a jitted step with its loss, optimizer, policy and options as fields.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, final

import equinox as eqx
import jax
import jax.core
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jaxtyping import PyTree

from . import _compiler, _diagnose, _mesh, _microbatch, _paths, _pending, _update
from ._diagnose import DoesNotCompile
from ._errors import see
from ._flatten import flatten, unflatten
from ._placement import place_batch
from ._policy import check_policy, Policy
from ._traced_step import Statics, traced_step
from ._update._deferred import held_paths


def _mesh_shardings(dynamic: list) -> tuple:
    """The input shardings that sharding propagation might not give back.

    Those are the shardings of leaves laid out over several devices (else None). (A
    static argument of the jitted step.)
    """
    return tuple(
        s if isinstance(s, NamedSharding) and len(s.device_set) > 1 else None
        for s in (getattr(x, "sharding", None) for x in dynamic)
    )


def _deleted(x: Any) -> bool:
    concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    return concrete and x.is_deleted()


def _raise_deleted(model: PyTree, opt_state: PyTree) -> None:
    for name, tree in (("model", model), ("opt_state", opt_state)):
        for leaf in _paths.leaves(tree):
            if _deleted(leaf.value):
                raise ValueError(
                    f"`train_step`: {name} leaf {leaf.path!r} has been deleted "
                    "(donated to a step). Use what the step returned." + see(46)
                )


@final
class TrainStep(eqx.Module):
    """A jitted training step: loss, gradients, optimizer update and placements.

    `eqx_offload.train_step` builds one. Call it as `step(model, opt_state, *batch)`.
    Its fields are what it was built from. `memory_report`, `verify`, `checkpoint_names`
    and `python -m eqx_offload plan` read them.

    To change a field, build a new step. The compiled step keeps the fields it was built
    with. (`eqx.tree_at` on a step changes nothing it computes.)

    !!! Example

        ```python
        step = eo.train_step(loss_fn, optimizer, policy, metrics=True)
        model, opt_state, loss, metrics = step(model, opt_state, tokens, targets)
        print(step.policy, step.microbatches)
        ```
    """

    loss_fn: Callable[..., Any]
    """`loss_fn(model, *batch) -> loss`, or `-> (loss, aux)` with `has_aux`."""
    optimizer: optax.GradientTransformation
    """The optimizer (of an `optax.MultiSteps`, its `GradientTransformation`)."""
    policy: Policy
    """Where the model, its optimizer state and its residuals live."""
    has_aux: bool
    """Whether `loss_fn` returns `(loss, aux)`."""
    microbatches: int
    """How many micro-batches the step splits each batch into."""
    unsplit: tuple[int, ...]
    """The batch arguments (by position) passed whole to every micro-batch."""
    metrics: bool
    """Whether the step computes the gradient, update and parameter norms."""
    # `flat_function`, bound once: the step and every report of it trace one function.
    # Not `__init__` arguments: `dataclasses.replace(step, policy=...)` builds a step.
    _flat: Callable = eqx.field(repr=False, init=False)
    _jitted: Callable = eqx.field(repr=False, init=False)

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation | optax.MultiSteps,
        policy: Policy,
        *,
        has_aux: bool = False,
        microbatches: int = 1,
        unsplit: Sequence[int] = (),
        metrics: bool = False,
    ):
        """**Arguments:** as for `eqx_offload.train_step`, which builds a step."""
        if not callable(loss_fn):
            raise TypeError(
                f"`train_step(loss_fn=...)` must be callable, got {loss_fn!r}."
            )
        optimizer = _update.as_transformation(optimizer, "`train_step(optimizer=...)`")
        check_policy(policy, "`train_step(policy=...)`")
        if metrics and policy.update_timing != "now":
            raise ValueError(
                "`train_step(metrics=True)`: no update to measure under "
                f"`update_timing={policy.update_timing!r}`. Drop `metrics=True`, or "
                "use `update_timing='now'`." + see(137)
            )
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.policy = policy
        self.has_aux = has_aux
        self.microbatches = microbatches
        self.unsplit = _microbatch.check_unsplit(unsplit, microbatches, "`train_step`")
        self.metrics = metrics
        options = _compiler.compile_options(
            jax.default_backend(), host_remat=policy.host_remat
        )
        # The step's fields are bound, not a static argument: `loss_fn` may be a
        # module holding arrays, which are not hashable.
        self._flat = functools.partial(traced_step, self)
        self._jitted = jax.jit(
            self._flat,
            static_argnums=(3,),
            donate_argnums=(0, 1),
            compiler_options=options,
        )

    def __call__(
        self, model: PyTree, opt_state: PyTree, *batch: Any, **keywords: Any
    ) -> tuple[PyTree, PyTree, Any, dict[str, Any] | None]:
        """One training step.

        **Arguments:**

        - `model`, `opt_state`: where the policy puts them (`eqx_offload.place`,
            `eqx_offload.init_opt_state`). Both are donated.
        - `*batch`: `loss_fn`'s batch arguments, by position.

        **Returns:**

        `(model, opt_state, loss, metrics)`. The new model and optimizer state have each
        leaf where the policy puts it. `loss` is `(loss, aux)` with `has_aux`. `metrics`
        holds the norms with `metrics=True`, else it is `None`.
        """
        if keywords:
            raise TypeError(
                "`train_step`: got keyword batch argument(s) "
                f"{_paths.quoted(keywords)}. Pass them by position: "
                "`step(model, opt_state, *batch)`." + see(50)
            )
        if self.policy.host_remat and jax.default_backend() != "tpu":
            raise ValueError(
                "`Policy(host_remat=True)` is a TPU compiler option, and this "
                f"backend is {jax.default_backend()!r}. Drop it, or report for a TPU: "
                "`memory_report(..., target='tpu-v5e')`." + see(121)
            )
        dynamic, statics = flat_arguments(self, model, opt_state, *batch)
        if any(_deleted(x) for x in dynamic[0] + dynamic[1]):
            _raise_deleted(model, opt_state)
        try:
            with _mesh.context(dynamic):
                outputs = self._jitted(*dynamic, statics)
                model_dynamic, opt_dynamic, value, norms = outputs
        except ValueError:
            # JAX names argument positions for leaves on incompatible devices:
            # name the leaves instead, if that is what went wrong.
            trees = {"model": model, "opt_state": opt_state, "batch": batch}
            _mesh.check_devices(trees, "`train_step`")
            raise
        except jax.errors.JaxRuntimeError as e:
            # On a TPU the compiler may reject streaming a leaf of some shapes
            # (`_diagnose.py`): name the leaves and the way out.
            if jax.default_backend() != "tpu" or _diagnose.out_of_memory(e):
                raise
            mesh = Mesh(np.array(jax.devices()[:1]), ("chip",))
            raise rejected(self, "`train_step`", str(e), mesh, model, opt_state) from e
        model = unflatten(model_dynamic, statics.model)
        opt_state = unflatten(opt_dynamic, statics.opt_state)
        if isinstance(opt_state, _pending.PendingUpdate):  # (static fields)
            opt_state = _pending.ready_as(opt_state, True)
            held = held_paths(_update.trainable(model), opt_state)
            model = _pending.mark(model, held)
        return model, opt_state, value, norms

    def trace(self, model: PyTree, opt_state: PyTree, *batch: Any) -> jax.stages.Traced:
        """The step traced on these arguments, without running it.

        As `jax.jit(fn).trace`: `step.trace(model, opt_state, *batch).lower()`
        gives its program, and `.lower().compile()` compiles it ahead of time.
        The arguments may be `jax.ShapeDtypeStruct`s.
        """
        dynamic, statics = flat_arguments(self, model, opt_state, *batch)
        with _mesh.context(dynamic):
            return self._jitted.trace(*dynamic, statics)


def flat_arguments(
    step: TrainStep, model: PyTree, opt_state: PyTree, *batch: Any
) -> tuple[tuple[list, list, list], Statics]:
    """The arguments of `flat_function(step)`.

    They are the array leaves of the model, the optimizer state and the batch, and the
    static rest. The batch is laid out as `Policy(batch=...)` says.
    """
    policy = step.policy
    model_dynamic, model_static = flatten(model)
    model_shardings = _mesh_shardings(model_dynamic)
    if policy.batch is not None:
        mesh = next((s.mesh for s in model_shardings if s is not None), None)
        batch = place_batch(batch, policy.batch, mesh, "`train_step`", step.unsplit)
    if step.microbatches > 1:
        _microbatch.check(batch, step.microbatches, step.unsplit, "`train_step`")
    opt_dynamic, opt_static = flatten(opt_state)
    batch_dynamic, batch_static = flatten(batch)
    opt_shardings = _mesh_shardings(opt_dynamic)
    statics = Statics(
        model_static, opt_static, batch_static, model_shardings, opt_shardings
    )
    return (model_dynamic, opt_dynamic, batch_dynamic), statics


def flat_function(step: TrainStep) -> Callable:
    """The step on flat arguments, before `jax.jit`.

    `f(model_leaves, opt_state_leaves, batch_leaves, statics)` returns the new model's
    and optimizer state's leaves, the loss and the metrics. `flat_arguments` gives its
    arguments. `memory_report` jits it to compile it for a target. It is bound to the
    step's fields when the step is built, as the step's own `jax.jit` is: one
    function per step, so that tracing it again hits JAX's cache.
    """
    return step._flat


def rejected(
    step: TrainStep,
    what: str,
    message: str,
    mesh: Mesh,
    model: PyTree,
    opt_state: PyTree,
) -> DoesNotCompile:
    """The error for a step the compiler for `mesh` rejected with `message`.

    It names the host-resident leaves the compiler cannot stream, compiled alone, and a
    way out.
    """
    leaves = _update.streamed_leaves(step.optimizer, model, opt_state)
    kinds = step.policy.params, step.policy.opt_state
    return DoesNotCompile(_diagnose.explain(what, message, leaves, mesh, *kinds))


def train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    policy: Policy,
    *,
    has_aux: bool = False,
    microbatches: int = 1,
    unsplit: Sequence[int] = (),
    metrics: bool = False,
) -> TrainStep:
    """A jitted training step that applies `policy` to a model and its optimizer.

    `step(model, opt_state, *batch)` computes `loss_fn(model, *batch)` and its gradient
    through `filter_offload(loss_fn, policy)`. It applies the optax update and returns
    `(model, opt_state, loss, metrics)`. The model and optimizer state are donated.
    Every output leaf comes back in the memory kind the policy gives it. So the outputs
    feed the next call without retracing.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, *batch) -> loss`, or `-> (loss, aux)` with
        `has_aux=True`. Gradients are taken with respect to the floating-point arrays of
        `model`.
    - `optimizer`: an `optax.GradientTransformation` (or `optax.MultiSteps`).
    - `policy`: an `eqx_offload.Policy`.
    - `has_aux`: whether `loss_fn` returns `(loss, aux)`; `aux` must be a pytree of
        arrays.
    - `microbatches`: split the batch into this many micro-batches along the leading
        axis of every batch array. Their gradients accumulate inside the one compiled
        step (a `lax.scan`). Each parameter's accumulator is in the memory kind of its
        gradient. Micro-batch `i` holds examples `i, i + k, i + 2k, ...`. The loss and
        gradient are the mean over micro-batches, summed in float32. So they equal the
        whole batch's for a loss that is a mean over examples. (A sum over examples
        comes out divided by `k`.) With `has_aux=True` the aux of every micro-batch
        comes back stacked (leading axis `k`). A batch whose leading axis does not split
        into `k` parts is a `ValueError`.
    - `unsplit`: positions of arguments passed whole to every micro-batch: a PRNG key, a
        mask shared by all examples. Positions count among the batch arguments: 0 is the
        first after the optimizer state.
    - `metrics`: also compute a dict of float32 scalars (on the device). They are the
        global L2 norms of the gradients (`"grad_norm"`, as the optimizer gets them), of
        the updates (`"update_norm"`) and of the new parameters (`"param_norm"`). The
        gradients' norm is the mean over micro-batches, in fp32 under a compute dtype.
        Under the streamed update the norms are computed a layer at a time, like the
        update.

    **Returns:**

    An `eqx_offload.TrainStep`. `step(model, opt_state, *batch)` returns `(model,
    opt_state, loss, metrics)`. `loss` is `(loss, aux)` with `has_aux=True`. `metrics`
    is `None` unless `metrics=True`. Inputs must already be where the policy says
    (`eqx_offload.place`, `eqx_offload.init_opt_state`). A leaf found elsewhere is a
    `ValueError` naming it. The batch is passed by position, in `loss_fn`'s order.
    Inside another transform (`eqx.filter_jit(step)`, a scan over steps) the step runs
    as part of that program. That program then decides donation.

    !!! Example

        ```python
        policy = eo.Policy.offload_all()
        model = eo.place(model, policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(loss_fn, optimizer, policy)
        for tokens, targets in batches:
            model, opt_state, loss, _ = step(model, opt_state, tokens, targets)
        ```
    """
    return TrainStep(
        loss_fn,
        optimizer,
        policy,
        has_aux=has_aux,
        microbatches=microbatches,
        unsplit=unsplit,
        metrics=metrics,
    )
