"""What `plan` returns: the `Plan` it chose, and `PlanInterrupted`, the
`KeyboardInterrupt` that carries the best so far of a plan stopped by Ctrl-C."""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import PyTree

from .._errors import see
from .._placement import place
from .._policy import Policy
from .._report import MemoryReport
from .._train_step import train_step, TrainStep
from .._update import apply_pending, init_opt_state
from ._table import PlanTable


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `plan` chose, and why.

    - `policy`: the chosen `Policy`.
    - `microbatches`: the chosen micro-batch count. It is 1 unless
        `plan(microbatches=...)` offered others, or searched them (`"search"`).
    - `examples`: the examples per update (the batch's leading size; `None` for a
        batch of scalars). `sequence`: the tokens per example, where the first
        batch argument is an integer `[examples, tokens]` array; else `None`.
        `tokens_per_update`, `tokens_per_microbatch`: their products.
    - `report`: its compiled `MemoryReport`, with its step time in `report.time`.
    - `target`: the target planned for.
    - `mesh`: for a slice (or several GPUs), an `AbstractMesh` of one axis over
        every device. The policy's FSDP layout and batch split name that axis.
        `None` for one device.
    - `table`: every candidate considered, a `PlanTable`. Use `print(plan.table)`
        or `plan.table.to_dict()`.
    - `compiled`: how many were compiled.
    - `reused`: how many of them an earlier `plan` in this process had compiled.
        They are kept by step, shapes, policy and target.
    - `seconds`: the planning time. For `eo.fewest_chips`, of every target it
        planned.
    - `tried`: for `eo.fewest_chips`, the other targets and why each was not chosen.
    - `interrupted`: the planning was stopped (Ctrl-C) before the search ended: this
        is the best of what it had compiled (`PlanInterrupted.plan`).
    - `workspace_margin`: the device bytes left free under the device budget
        (`plan(workspace_margin=...)`); `table.device_budget` is the budget less it.
    - `train_step()`: the chosen step. Call it with `place(model)` and
        `init_opt_state(...)`'s state.
    - `place(model)`: the model in the memory kinds the policy gives it. On a
        slice, also in its layout.
    """

    policy: Policy
    report: MemoryReport
    table: PlanTable
    compiled: int
    seconds: float
    loss_fn: Callable = dataclasses.field(repr=False)
    optimizer: optax.GradientTransformation | optax.MultiSteps = dataclasses.field(
        repr=False
    )
    has_aux: bool = False
    microbatches: int = 1
    target: str | None = None
    mesh: AbstractMesh | None = None
    tried: tuple[tuple[str, str], ...] = ()
    reused: int = 0
    interrupted: bool = False
    examples: int | None = None
    sequence: int | None = None

    @property
    def workspace_margin(self) -> int:
        return self.table.workspace_margin

    @property
    def tokens_per_update(self) -> int | None:
        return None if self.sequence is None else (self.examples or 0) * self.sequence

    @property
    def tokens_per_microbatch(self) -> int | None:
        tokens = self.tokens_per_update
        return None if tokens is None else tokens // self.microbatches

    def _batch_text(self) -> str:
        """`"Per update: 64 examples (262,144 tokens), in 4 micro-batches of 16
        examples (65,536 tokens)."`"""
        if self.examples is None:
            return ""

        def amount(n: int) -> str:
            tokens = "" if self.sequence is None else f" ({n * self.sequence:,} tokens)"
            return f"{n:,} example{'s' * (n != 1)}{tokens}"

        k = self.microbatches
        return (
            f"Per update: {amount(self.examples)}, in {k} micro-batch"
            f"{'es' * (k != 1)} of {amount(self.examples // k)}.\n"
        )

    def train_step(self) -> TrainStep:
        """The chosen step, an `eo.TrainStep`.

        It is `eo.train_step(loss_fn, optimizer, plan.policy,
        microbatches=plan.microbatches)`.
        """
        return train_step(
            self.loss_fn,
            self.optimizer,
            self.policy,
            has_aux=self.has_aux,
            microbatches=self.microbatches,
        )

    def place(self, model: PyTree, mesh: Mesh | None = None) -> PyTree:
        """`eo.place(model, plan.policy)`.

        For a plan with a `mesh`, an abstract model is laid out on `plan.mesh`. A
        concrete one is laid out on `mesh`. That is a `jax.sharding.Mesh` of as many
        devices, with the same axis name. By default it is `jax.make_mesh` over this
        backend's devices.
        """
        if self.mesh is None or mesh is not None:
            return place(model, self.policy, mesh=mesh)
        if not any(isinstance(x, jax.Array) for x in jtu.tree_leaves(model)):
            return place(model, self.policy, mesh=self.mesh)
        if len(jax.devices()) != self.mesh.size:
            raise ValueError(
                f"`Plan.place`: the plan is for {self.mesh.size} devices, this "
                f"backend has {len(jax.devices())}. Pass `mesh=` (axis "
                f"{self.mesh.axis_names[0]!r})." + see(120)
            )
        here = jax.make_mesh(
            self.mesh.axis_sizes, self.mesh.axis_names, axis_types=self.mesh.axis_types
        )
        return place(model, self.policy, mesh=here)

    def init_opt_state(self, model: PyTree) -> PyTree:
        """`eo.init_opt_state(optimizer, model, plan.policy)` for a placed model."""
        return init_opt_state(self.optimizer, model, self.policy)

    def apply_pending(self, model: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
        """`eo.apply_pending(model, opt_state, optimizer, plan.policy)`.

        Where the plan chose `update_timing="next_forward"`, it applies the update
        the last step left pending. Otherwise it returns the arguments as they are.
        """
        return apply_pending(model, opt_state, self.optimizer, self.policy)

    def __str__(self) -> str:
        chosen = next(r for r in self.table.rows if r.status == "chosen")
        on = "" if self.target is None else f" on {self.target}"
        head = "".join(f"{t}: {why}\n" for t, why in self.tried)
        if self.interrupted:
            head += "Interrupted: the best of the candidates compiled so far.\n"
        reused = f", {self.reused} of them earlier" if self.reused else ""
        return (
            f"{head}Plan{on}: {chosen.label} "
            f"({self.compiled} compiled{reused} in {self.seconds:.1f} s)\n"
            f"{self._batch_text()}{self.table}"
        )


class PlanInterrupted(KeyboardInterrupt):
    """`plan` (or `fewest_chips`) stopped by Ctrl-C (a `KeyboardInterrupt`), with
    what it had found. It is a `KeyboardInterrupt`: uncaught, it stops the program as
    Ctrl-C does. The compile under way when it came is lost (XLA does not stop
    mid-compile, so it comes when that compile ends).

    - `plan`: the best of the candidates compiled so far that fit (a `Plan` with
        `interrupted=True`; train with it as with any plan), or `None` if none fits
        yet.
    - `tried`: the table of every candidate compiled so far (`None` if none was).
    """

    def __init__(self, plan: "Plan | None", tried: PlanTable | None, compiled: int):
        where = "" if plan is None or plan.target is None else f" for {plan.target}"
        best = "none of them fits yet" if compiled else "nothing to show"
        best = "the best so far is `e.plan`" if plan is not None else best
        super().__init__(
            f"`plan`{where} interrupted after {compiled} compiled candidates: {best}."
        )
        self.plan = plan
        self.tried = tried


def batch_size(batch: tuple) -> tuple[int | None, int | None]:
    """A batch's examples (its first array's leading size) and, where its first
    argument is an integer `[examples, tokens]` array, the tokens per example."""
    arrays = [x for x in jtu.tree_leaves(batch) if getattr(x, "ndim", 0) > 0]
    if not arrays:
        return None, None
    first = batch[0] if batch else None
    if isinstance(first, jax.ShapeDtypeStruct | jax.Array) and first.ndim == 2:
        if jnp.issubdtype(first.dtype, jnp.integer):
            return arrays[0].shape[0], first.shape[1]
    return arrays[0].shape[0], None
