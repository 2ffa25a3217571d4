"""`plan`: the fastest placement of a training step that fits the memory budgets.

The budgets are a device and a host memory. The placement is chosen from compiled
candidates, ranked by the step-time estimate. `Plan` is what it chose.
"""

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.tree_util as jtu
import optax
from jax.sharding import AbstractMesh, AxisType, Mesh
from jaxtyping import DTypeLike, PyTree

from .._errors import see
from .._memory_kinds import is_arraylike
from .._placement import place
from .._policy import Policy
from .._report import (
    abstract,
    capacity,
    device_count,
    DoesNotFit,
    Hardware,
    MemoryReport,
    platform as target_platform,
)
from .._train_step import train_step, TrainStep
from .._update import apply_pending, init_opt_state, NotOnHost
from ._budget import parse_bytes
from ._candidates import Candidate, Move, Settings
from ._compile import Task
from ._progress import Progress
from ._search import IMPROVE_COMPILES, Search
from ._sizes import (
    copies_of,
    estimates,
    fields_of,
    parts_of,
    state_slots,
    tables_of,
)
from ._table import PlanTable


# Where nothing fits on a TPU, the best candidate is compiled once more with the
# compiler's own remat to host (`Policy(host_remat=True)`), in a child process.
HOST_REMAT = True
# Candidates compiled again with the update on the host's CPU (`_update_on_host`).
HOST_UPDATES = 3
# Candidates compiled again reading their layers ahead (`_read_ahead`).
READ_AHEAD = 2
# Candidates compiled again applying the stacked layers' update in the next
# step's forward scan (`_update_in_forward`).
UPDATE_LATER = 2


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `plan` chose, and why.

    - `policy`: the chosen `Policy`.
    - `microbatches`: the chosen micro-batch count. It is 1 unless
        `plan(microbatches=...)` offered others.
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
            self.mesh.axis_sizes,
            self.mesh.axis_names,
            axis_types=self.mesh.axis_types,
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
        others = "".join(f"{t}: {why}\n" for t, why in self.tried)
        reused = f", {self.reused} of them earlier" if self.reused else ""
        return (
            f"{others}Plan{on}: {chosen.label} "
            f"({self.compiled} compiled{reused} in {self.seconds:.1f} s)\n"
            f"{self.table}"
        )


def plan(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    model: PyTree,
    *batch: PyTree,
    device_budget: int | str | None = None,
    host_budget: int | str | None = None,
    target: str | None = None,
    has_aux: bool = False,
    axis: str = "fsdp",
    microbatches: Sequence[int] = (1,),
    compute_dtypes: Sequence[DTypeLike | None] = (None,),
    progress: bool = False,
) -> Plan:
    """Chooses where a training step's parameters, state and saved activations live.

    The plan is the candidate with the lowest estimated step time that fits. Its
    compiled step must fit both memory budgets. It compiles candidates
    (`memory_report`), and never runs them.

    **Arguments:**

    - `loss_fn`, `optimizer`: as for `eo.train_step`.
    - `model`, `*batch`: the model and one batch (the whole batch, on a slice).
        They are arrays or `jax.ShapeDtypeStruct`s (`eqx.filter_eval_shape(Model,
        ...)`). The model's memory kinds are ignored: each candidate places it.
    - `device_budget`, `host_budget`: bytes of device memory and of host memory
        per device. Each is an int or a string (`"16GiB"`, `"48GB"`). The defaults
        are the target's capacity (`MemoryReport.capacity`) and its host RAM per
        device (`eo.Hardware.of(target).host_memory_bytes`). On the CPU backend,
        give both.
    - `target`: as for `memory_report` (`"tpu-v5e"`, `"tpu-v5e:4x4"`,
        `"gpu-h100"`, `"gpu-h100:8"`, ...). On a slice (or several GPUs), every
        candidate is laid out FSDP over all devices, on `plan.mesh`. That layout
        is `Policy(shard=eo.FSDP(axis), batch=axis)`. For the fewest chips, use
        `eo.fewest_chips`.
    - `has_aux`: as for `eo.train_step`.
    - `axis`: the name of the mesh axis of a slice's FSDP layout. Use the name the
        model's own sharding constraints use, if any.
    - `microbatches`, `compute_dtypes`: the micro-batch counts and compute dtypes
        to choose from. They go to `train_step(microbatches=...)` and
        `Policy(compute_dtype=...)`, where `None` is the model's own. They change
        the numerics, so by default only `1` and `None` are tried. Opt in with
        e.g. `microbatches=(1, 2, 4)`, `compute_dtypes=(None, jnp.bfloat16)`.
        Under a compute dtype, a field's compute copies go where its parameters
        go. The local search may keep them on the device.
    - `progress`: a progress bar over the compiles (tqdm, if installed). Its
        total is the candidates compiled, plus the most the search still plans to
        compile.

    **The search** (`docs/plan.md`) tries `Policy.none()` first: the plan, if it
    fits. Else it tries, in turn:

    - the presets;
    - the single moves that free the most device memory, by estimate. A move sends
        a field's parameters or a part of its optimizer state to the host. Or it
        offloads or recomputes a checkpoint name;
    - the combinations of compiled moves estimated to fit, fastest first;
    - a local search, one knob at a time, from the best so far.

    Then it tries each other micro-batch count and compute dtype offered, on the
    best candidate, and the local search again. For a TPU target where nothing fits
    yet, it tries the best candidate with the compiler's own remat to host. That is
    `Policy(host_remat=True)`, in a child process. The local search then runs
    again. The plan is the fitting candidate with the lowest estimated step time.
    Among equals, and on the CPU backend (no step time), it has the smallest device
    footprint. Each step is compiled once in a process. `plan` again reuses what an
    earlier one compiled for the same `loss_fn` and `optimizer` objects, shapes,
    policy and target.

    **Returns:**

    A `Plan`: `plan.policy`, `plan.report`, `plan.table`, `plan.train_step()`,
    `plan.place(model)`, `plan.mesh`.

    **Raises:**

    - `DoesNotFit` when no candidate fits. It gives the smallest device footprint
        found, and which budget it broke. `e.tried` is the table of every candidate.
    - `ValueError` for a budget that is not a size. Also for a micro-batch count
        that does not split the batch.
    """
    found = search_plan(
        loss_fn,
        optimizer,
        model,
        batch,
        device_budget=device_budget,
        host_budget=host_budget,
        target=target,
        has_aux=has_aux,
        axis=axis,
        microbatches=microbatches,
        compute_dtypes=compute_dtypes,
        progress=progress,
    ).found
    if isinstance(found, DoesNotFit):
        raise found
    assert found is not None
    return found


class Searched(NamedTuple):
    """What one search found: the plan, the error when nothing fits, or `None`
    where `first_fit` stopped it at a candidate that fits. With how many
    candidates it compiled, and how many of those an earlier search had."""

    found: Plan | DoesNotFit | None
    compiled: int
    reused: int


def search_plan(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    model: PyTree,
    batch: tuple,
    *,
    device_budget: int | str | None = None,
    host_budget: int | str | None = None,
    target: str | None = None,
    has_aux: bool = False,
    axis: str = "fsdp",
    microbatches: Sequence[int] = (1,),
    compute_dtypes: Sequence[DTypeLike | None] = (None,),
    progress: bool = False,
    first_fit: bool = False,
) -> Searched:
    """`plan`'s search. With `first_fit`, it stops at the first candidate that
    fits (the probe of `fewest_chips`)."""
    start = time.perf_counter()
    if isinstance(target, str) and target.endswith(":*"):
        raise ValueError(
            f"`plan(target={target!r})`: `plan` takes one target. Call "
            f"`eo.fewest_chips(..., chip={target[:-2]!r})`." + see(119)
        )
    budgets = _budgets(device_budget, host_budget, target)
    task = Task(
        loss_fn,
        optimizer,
        _abstract(model),
        tuple(_abstract(b) for b in batch),
        has_aux,
        target,
    )
    settings = _settings(target, axis, microbatches, compute_dtypes, task.batch)
    if settings[0].axis is not None:
        assert target is not None
        n = device_count(target)
        mesh = AbstractMesh((n,), (axis,), axis_types=(AxisType.Auto,))
        task = task._replace(mesh=mesh)
    search = Search(task, budgets, Progress(progress), first_fit=first_fit)
    base, names = _start(search, settings)
    _run(search, base, names, settings)
    finished = None if search.stopped else search.finish()
    if not isinstance(finished, tuple):
        return Searched(finished, len(search.results), search.reused)
    result, table = finished
    assert result.report is not None
    found = Plan(
        result.policy,
        result.report,
        table,
        compiled=len(search.results),
        reused=search.reused,
        seconds=time.perf_counter() - start,
        loss_fn=loss_fn,
        optimizer=optimizer,
        has_aux=has_aux,
        microbatches=result.candidate.microbatches,
        target=target,
        mesh=task.mesh,
    )
    return Searched(found, found.compiled, found.reused)


def _run(
    search: Search, base: Candidate, names: tuple[str, ...], settings: list[Settings]
) -> None:
    """The steps of the search (`plan`'s docstring), from `base`: `Policy.none()`
    in the first settings."""
    with search.progress.stage(1):
        search.evaluate(base, "no remat, all on device: Policy.none()")
    if search.fits(base):
        search.variants(base, settings[1:])
    else:
        _moves(search, base, names, settings)
    _update_on_host(search)
    _read_ahead(search)
    _update_in_forward(search)


def _moves(
    search: Search, base: Candidate, names: tuple[str, ...], settings: list[Settings]
) -> None:
    """Where `Policy.none()` does not fit: the presets, single moves and their
    combinations, the local search, the other settings; on a TPU where nothing
    fits yet, the compiler's own remat to host."""
    search.progress.expect(search.most(base, names, len(settings) - 1))
    search.presets(base, names)
    search.combine(base, names)
    search.improve(names)
    if settings[1:]:
        best = search.best()
        if best is not None:
            search.variants(best, settings[1:])
            search.improve(names)
    best = search.best()
    target = search.task.target
    on_tpu = target is not None and target_platform(target) == "tpu"
    if HOST_REMAT and on_tpu and best is not None and not search.fits(best):
        # Compiled in a child process: it can abort the process.
        search.progress.expect(1 + IMPROVE_COMPILES)
        search.variants(best, [best.settings._replace(host_remat=True)])
        search.improve(names)


def _fastest(search: Search) -> list[Candidate]:
    """The compiled candidates that fit, the fastest first."""
    compiled = [c for c, r in search.results.items() if r.report is not None]
    return sorted((c for c in compiled if search.fits(c)), key=search.rank)


def _update_on_host(search: Search) -> None:
    """Where the update runs. The fastest candidates with optimizer state on the
    host (up to `HOST_UPDATES` that fit, else the nearest to fitting) compiled
    again with `update="host"`. It moves no optimizer state over the host link
    but costs host memory bandwidth; the estimate chooses."""
    ranked = _fastest(search)
    if not ranked:
        compiled = [c for c, r in search.results.items() if r.report is not None]
        ranked = sorted(compiled, key=search.over)[:1]
    ranked = [c for c in ranked if c.state_on_host and c.settings.update != "host"]
    # The fastest with all its state on the host first: where the host update
    # saves most (state split between host and device goes to the host for it).
    whole = [c for c in ranked if "device" not in c.opt_state.values()]
    tried = [
        c.with_settings(c.settings._replace(update="host"))
        for c in dict.fromkeys(whole[:1] + ranked)
    ][:HOST_UPDATES]
    with search.progress.stage(len(tried)):
        for candidate in search.until_stopped(tried):
            try:
                search.evaluate(candidate)
            except ValueError as e:
                if not isinstance(e.__cause__, NotOnHost):
                    raise
                return  # an optimizer the host cannot run (a loop): none will


def _read_ahead(search: Search) -> None:
    """The fastest candidates that read from the host inside their scans (up to
    `READ_AHEAD` that fit) compiled again with `Policy(prefetch=1)`: one more
    layer on the device, and reads the compiler may hide behind compute. On a
    GPU it may already move some reads of the plain scan; the estimate chooses."""
    ranked = [
        c for c in _fastest(search) if c.reads_from_host and not c.settings.prefetch
    ]
    tried = [c.with_settings(c.settings._replace(prefetch=1)) for c in ranked]
    with search.progress.stage(len(tried[:READ_AHEAD])):
        for candidate in search.until_stopped(tried[:READ_AHEAD]):
            search.evaluate(candidate)


def _update_in_forward(search: Search) -> None:
    """The fastest candidates with optimizer state on the host updated through
    the device (up to `UPDATE_LATER` that fit) compiled again with
    `Policy(update_timing="next_forward")`. The stacked layers' update is applied
    in the next step's forward scan, where its transfers may hide behind the
    layers' compute (same numbers); the estimate chooses."""
    ranked = [
        c
        for c in _fastest(search)
        if c.state_on_host
        and c.settings.update == "auto"
        and c.settings.update_timing == "now"
    ]
    tried = [
        c.with_settings(c.settings._replace(update_timing="next_forward"))
        for c in ranked
    ]
    with search.progress.stage(len(tried[:UPDATE_LATER])):
        for candidate in search.until_stopped(tried[:UPDATE_LATER]):
            search.evaluate(candidate)


def _start(
    search: Search, settings: list[Settings]
) -> tuple[Candidate, tuple[str, ...]]:
    """What `search` knows before compiling (the bytes each move frees by
    estimate, the parts of fields that can be placed apart), where it starts
    (`Policy.none()` in the first settings), and the checkpoint names offered."""
    model, optimizer, mesh = search.task.model, search.task.optimizer, search.task.mesh
    fields = fields_of(model)
    offered = [n for n in search.names() if n.residual]
    slots = state_slots(optimizer, model)
    search.estimates = estimates(model, fields, slots, offered)
    search.parts, finer = parts_of(optimizer, model, slots)
    search.estimates |= finer
    # Streamed tables stay whole on every device: offered on one device only.
    tables = tables_of(model) if mesh is None else {}
    search.estimates |= {
        Move("host_tables", t, "pinned_host"): n for t, n in tables.items()
    }
    # Compute copies of host parameters, under the compute dtypes offered.
    copies = copies_of(model, tuple(s.compute_dtype for s in settings))
    search.estimates |= {Move("copies", f, "pinned_host"): n for f, n in copies.items()}
    if mesh is not None:  # FSDP splits the parameters, the state and the batch
        search.estimates = {m: n // mesh.size for m, n in search.estimates.items()}
    base = Candidate.start(
        fields, tuple(slots), settings[0], tuple(tables), tuple(copies)
    )
    return base, tuple(n.name for n in offered)


def _settings(
    target: str | None,
    axis: str,
    microbatches: Sequence[int],
    compute_dtypes: Sequence[DTypeLike | None],
    batch: tuple,
) -> list[Settings]:
    """Every combination of the micro-batch counts and compute dtypes offered, the
    first ones first; FSDP over `axis` on a target of several devices."""
    if not isinstance(axis, str) or not axis:
        raise ValueError(
            f"`plan(axis={axis!r})` is not a mesh axis name. Give one, such as "
            "'fsdp'." + see(118)
        )
    devices = 1 if target is None else device_count(target)
    counts = _counts(microbatches, batch, devices)
    dtypes = tuple(compute_dtypes)
    if not dtypes:
        raise ValueError(
            "`plan(compute_dtypes=())` offers no dtype. Give at least one, such as "
            "`(None,)`." + see(118)
        )
    names = tuple(None if d is None else _dtype_name(d, dtypes) for d in dtypes)
    sharded = axis if devices > 1 else None
    return [Settings(sharded, k, d) for k in counts for d in names]


def _counts(microbatches: Sequence[int], batch: tuple, devices: int) -> tuple[int, ...]:
    """The micro-batch counts offered, each checked to split the batch."""
    counts = tuple(microbatches)
    if not counts or not all(_is_count(k) for k in counts):
        raise ValueError(
            f"`plan(microbatches={microbatches!r})` needs positive micro-batch "
            "counts. Offer e.g. `(1, 2, 4)`." + see(118)
        )
    leaves = [x for x in jtu.tree_leaves(batch) if hasattr(x, "ndim")]
    leading = {x.shape[0] for x in leaves if x.ndim}
    for k in counts:
        if any(n % (k * devices) for n in leading):
            over = "" if devices == 1 else f" over {devices} devices"
            raise ValueError(
                f"`plan(microbatches={microbatches!r})`: {k} micro-batches{over} do "
                f"not split a batch of leading size {sorted(leading)}. Offer "
                "divisors." + see(118)
            )
        if k > 1 and any(x.ndim == 0 for x in leaves):
            raise ValueError(
                f"`plan(microbatches={microbatches!r})`: micro-batches cannot split "
                "a scalar batch argument. Offer `(1,)`, or bind it into the loss."
                + see(118)
            )
    return counts


def _is_count(k: object) -> bool:
    return isinstance(k, int) and not isinstance(k, bool) and k >= 1


def _dtype_name(dtype: DTypeLike, offered: tuple) -> str:
    try:
        checked = Policy(compute_dtype=dtype).compute_dtype
    except TypeError:
        checked = None
    if checked is None:
        raise TypeError(
            f"`plan(compute_dtypes={offered!r})`: {dtype!r} is not a floating-point "
            "dtype. Offer `None` or dtypes such as `jnp.bfloat16`." + see(118)
        )
    return checked.name


def _budgets(
    device: int | str | None, host: int | str | None, target: str | None
) -> tuple[int, int]:
    """The budgets given, or the target's capacity and host RAM per device."""
    d = None if device is None else parse_bytes(device, "device_budget")
    h = None if host is None else parse_bytes(host, "host_budget")
    if target is None:
        if d is None or h is None:
            missing = "device_budget" if d is None else "host_budget"
            raise ValueError(
                f"`plan({missing}=None)` on this backend, which states no memory. "
                "Give both budgets, or a `target=`." + see(113)
            )
        return d, h
    d = capacity(target) if d is None else d
    h = Hardware.of(target).host_memory_bytes if h is None else h
    return d, h


def _abstract(tree: PyTree) -> PyTree:
    """Array leaves as `jax.ShapeDtypeStruct`s in their memory kinds and layouts
    (as `memory_report` takes them): each candidate places its own copy."""
    return jtu.tree_map(lambda x: abstract(x, None) if is_arraylike(x) else x, tree)
