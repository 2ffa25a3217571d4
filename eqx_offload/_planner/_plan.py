"""`plan`: the fastest placement of a training step that fits the memory budgets.

The budgets are a device and a host memory. The placement is chosen from compiled
candidates, by the step-time estimate within its error (`_choice`, `_outcome`).
Here are `plan`, the order of its search's stages, and what a search stopped by
Ctrl-C found; `Plan` and `PlanInterrupted` are in `_plan_type`, the arguments'
checks in `_arguments`.
"""

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import optax
from jaxtyping import DTypeLike, PyTree

from .._errors import see
from .._report import DoesNotFit, Hardware
from .._report._targets import platform as target_platform
from .._update import NotOnHost
from . import _arguments, _choice, _outcome
from ._candidates import Candidate, Knob, Part, presets, Settings
from ._choice import Experimental
from ._compile import Task
from ._plan_type import Plan, PlanInterrupted
from ._progress import Progress
from ._search import IMPROVE_COMPILES, Search
from ._sizes import copies_of, estimates, param_bytes, parts_of, state_slots, tables_of


# Where nothing fits on a TPU, the best candidate is compiled once more with the
# compiler's own remat to host (`Policy(host_remat=True)`), in a child process.
HOST_REMAT = True
# The experimental stages (`_choice.EXPERIMENTAL`), in the order they run, each
# only when `plan(experimental=...)` names it: how many candidates each compiles
# again (`_again`) with its setting (`_choice.SETS`).
AGAIN: dict[Experimental, int] = {"host_update": 3, "prefetch": 2, "next_forward": 2}


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
    microbatches: Sequence[int] | Literal["search"] = (1,),
    compute_dtypes: Sequence[DTypeLike | None] = (None,),
    progress: bool = False,
    experimental: Sequence[Experimental] = (),
    workspace_margin: int | str | None = None,
    hardware: Hardware | None = None,
) -> Plan:
    """Chooses where a training step's parameters, state and saved activations live.

    The plan is a candidate that fits both memory budgets, with the lowest
    estimated step time up to the estimate's error (below). It compiles
    candidates (`memory_report`), and never runs them.

    **Arguments:**

    - `loss_fn`, `optimizer`: as for `eo.train_step`.
    - `model`, `*batch`: the model and one batch (the whole batch, on a slice).
        They are arrays or `jax.ShapeDtypeStruct`s (`eqx.filter_eval_shape(Model,
        ...)`). The model's memory kinds are ignored: each candidate places it.
    - `device_budget`, `host_budget`: bytes of device memory and of host memory
        per device. Each is an int or a string (`"16GiB"`, `"48GB"`). The defaults
        are the target's capacity (`MemoryReport.capacity`) and its host RAM per
        device (`hardware.host_memory_bytes`). On the CPU backend, give both.
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
        go. The local search may keep them on the device, and one candidate keeps
        all of them there, with everything else on the host.
        `microbatches="search"`: `batch` is the batch per update, and each
        placement the search compiles takes the fewest micro-batches that fit
        the device budget, of the counts that divide the batch. That count is
        found by compiling (the placement's own count, then bisected), not by
        estimate.
    - `progress`: a progress bar over the compiles (tqdm, if installed). Its
        total is the candidates compiled, plus the most the search still plans to
        compile.
    - `experimental`: the experimental stages to run, none by default. Their gain
        rests on host transfers (or host compute) overlapping device work, which no
        measurement has shown (on an H200 nothing overlapped). Any of `"prefetch"`
        (`Policy(prefetch=1)`: a step of 173.6 ms against 173.3 ms without, on an
        H200), `"next_forward"` (`Policy(update_timing="next_forward")`: 1-3%
        faster there) and `"host_update"` (`Policy(update="host")`: 2.75 times
        slower there than the streamed update).
    - `workspace_margin`: device bytes left free under `device_budget` (an int, a
        string such as `"1GiB"`, or `0`): a candidate fits if its device bytes are
        within the budget less the margin. The default, `None`, is 2 GiB on a GPU
        target (an eighth of a device budget under 16 GiB) and 0 elsewhere. A
        compile without the GPU sees neither what its autotuner adds (a Triton
        GEMM split over its contraction keeps `split_k` float32 partial products
        of its output: a [2048, 8192] weight gradient split 16 ways takes 1 GiB;
        cuBLASLt takes up to 32 MiB of workspace a call on Hopper) nor any cuDNN
        workspace (fused attention, convolutions), nor what JAX's allocator holds
        beside the step (the next batch, fragmentation). A TPU compile sees every
        buffer. The table and `plan.workspace_margin` say what was left free.
    - `hardware`: the rates candidates are priced at (`eo.Hardware`, e.g.
        `eo.Hardware.from_measurements(path)`), as for `memory_report`. By
        default the target's (`eo.Hardware.of(target)`).

    **The search** (`docs/plan.md`) tries `Policy.none()` first: the plan, if it
    fits. Else it tries, in turn:

    - the presets;
    - the single moves that free the most device memory, by estimate. A move sends
        a field's parameters or a part of its optimizer state to the host. Or it
        offloads or recomputes a checkpoint name;
    - the combinations of compiled moves estimated to fit, fastest first;
    - a local search, one knob at a time, from the best so far.

    Then it tries each other micro-batch count and compute dtype offered, on the
    best candidate, and the local search again. (Searching the micro-batch counts,
    each candidate is compiled in the fewest that fit.) For a TPU target where
    nothing fits yet, it tries the best candidate with the compiler's own remat to
    host. That is `Policy(host_remat=True)`, in a child process. The local search
    then runs again. Then the experimental stages asked for: the fastest
    candidates with their update on the host, reading their layers ahead, or
    updating in the next forward pass. Each step is compiled once in a process.
    `plan` again reuses what an earlier one compiled for the same `loss_fn` and
    `optimizer` objects, shapes, policy, target and hardware.

    **The choice.** An estimate is expected within `seconds × (1 ± error)` of the
    measured step, where `error` is what the model has shown for that kind of step
    on that hardware (`report.time.error`, by `report.time.kind`: device only,
    host link, host compute). So among the candidates that fit, those whose
    estimate exceeds the fastest's by at most the larger of the two errors (as a
    share of the fastest's: `seconds - fastest <= max(error, fastest_error) *
    fastest`) are tied with it. Of the tied ones, the plan is one that uses no
    experimental stage if any does; then the one with the most headroom (the
    device budget less its footprint), counted up to a tenth of the budget; then
    the fastest. (Uncapped, a tie would go to whatever offloads the most, the kind
    of step the model has under-priced.) On the CPU backend (no step time) every
    candidate is tied: the smallest device footprint wins. The table marks the
    tied rows, and says which rates each estimate used (measured, nominal,
    assumed) and its error.

    **Interrupted** (Ctrl-C): it raises `PlanInterrupted`, a `KeyboardInterrupt`
    with the best plan of what it had compiled (`e.plan`, `None` if none fits yet)
    and the table of it (`e.tried`). `python -m eqx_offload plan` prints them and
    writes its `--json` on Ctrl-C or a `SIGTERM` (`timeout`).

    **Returns:**

    A `Plan`: `plan.policy`, `plan.report`, `plan.table`, `plan.train_step()`,
    `plan.place(model)`, `plan.mesh`.

    **Raises:**

    - `DoesNotFit` when no candidate fits. It gives the smallest device footprint
        found, and which budget it broke. `e.tried` is the table of every candidate.
    - `ValueError` for a budget or margin that is not a size, or a margin of the
        whole budget. Also for a micro-batch count that does not split the batch,
        and an `experimental` stage it does not know.
    - `PlanInterrupted` on Ctrl-C (above).
    """
    # Its arguments, passed on as they are (the first statement: the locals are
    # the arguments).
    found = search_plan(**locals()).found
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
    microbatches: Sequence[int] | Literal["search"] = (1,),
    compute_dtypes: Sequence[DTypeLike | None] = (None,),
    progress: bool = False,
    first_fit: bool = False,
    experimental: Sequence[Experimental] = (),
    workspace_margin: int | str | None = None,
    hardware: Hardware | None = None,
) -> Searched:
    """`plan`'s search. With `first_fit`, it stops at the first candidate that
    fits (the probe of `fewest_chips`). On Ctrl-C, `PlanInterrupted` with the
    best of what it compiled."""
    start = time.perf_counter()
    if isinstance(target, str) and target.endswith(":*"):
        raise ValueError(
            f"`plan(target={target!r})`: `plan` takes one target. Call "
            f"`eo.fewest_chips(..., chip={target[:-2]!r})`." + see(119)
        )
    stages = _choice.experimental_names(experimental)
    if hardware is not None and not isinstance(hardware, Hardware):
        raise TypeError(
            f"`plan(hardware={hardware!r})` is not an `eo.Hardware`. Give e.g. "
            "`eo.Hardware.from_measurements(path)`, or `None` for the target's."
        )
    budgets, margin = _arguments.budgets(
        device_budget, host_budget, target, workspace_margin, hardware
    )
    batch = tuple(_arguments.abstract(b) for b in batch)
    settings, counts, mesh = _arguments.settings(
        target, axis, microbatches, compute_dtypes, batch
    )
    model = _arguments.abstract(model)
    task = Task(loss_fn, optimizer, model, batch, has_aux, target, mesh, hardware)
    search = Search(task, budgets, Progress(progress), first_fit, margin, start)
    search.counts = counts
    try:
        # The steps of the search (`plan`'s docstring), from `Policy.none()` in
        # the first settings; then the experimental stages asked for.
        base, names = _start(search, settings)
        with search.progress.stage(1):
            label = "no remat, all on device: Policy.none()"
            base = search.evaluate(base, label).candidate
        if search.fits(base):
            search.compile_each(_in(search, base, settings[1:]))
        else:
            _moves(search, base, names, settings)
        for stage in AGAIN:
            if stage in stages:
                _again(search, stage)
    except KeyboardInterrupt:
        raise _interrupted(search) from None
    finished = None if search.stopped else _outcome.finish(search)
    return Searched(finished, len(search.results), search.reused)


def _interrupted(search: Search) -> PlanInterrupted:
    """What a search stopped by Ctrl-C found: the best plan of what it compiled
    (`None` if none fits), and the table of it (`None` if nothing compiled)."""
    search.interrupted = True
    search.progress.close()
    if not search.results:
        return PlanInterrupted(None, None, 0)
    finished = _outcome.finish(search)
    if isinstance(finished, DoesNotFit):
        return PlanInterrupted(None, finished.tried, len(search.results))
    return PlanInterrupted(finished, finished.table, len(search.results))


def _moves(
    search: Search, base: Candidate, names: tuple[str, ...], settings: list[Settings]
) -> None:
    """Where `Policy.none()` does not fit: the presets, single moves and their
    combinations, the local search, the other settings; on a TPU where nothing
    fits yet, the compiler's own remat to host."""
    search.progress.expect(search.most(base, names, settings))
    search.compile_each(presets(base, names, settings))
    search.combine(base, names)
    search.improve(names)
    best = search.best()
    if settings[1:] and best is not None:
        search.compile_each(_in(search, best, settings[1:]))
        search.improve(names)
        best = search.best()
    target = search.task.target
    on_tpu = target is not None and target_platform(target) == "tpu"
    if HOST_REMAT and on_tpu and best is not None and not search.fits(best):
        # Compiled in a child process: it can abort the process.
        search.progress.expect(1 + IMPROVE_COMPILES)
        search.compile_each([(None, best.with_settings(host_remat=True))])
        search.improve(names)


def _in(
    search: Search, candidate: Candidate, settings: list[Settings]
) -> list[tuple[None, Candidate]]:
    """`candidate` in each of `settings`, for `compile_each`; where the search
    chooses the micro-batch counts, from the candidate's own."""
    k = candidate.settings.microbatches
    kept = [s._replace(microbatches=k) if search.counts else s for s in settings]
    return [(None, candidate.with_settings(s)) for s in kept]


def _again(search: Search, stage: Experimental) -> None:
    """The fastest candidates that fit that `stage` applies to (up to
    `AGAIN[stage]`) compiled again with it; the estimate chooses.

    - `"host_update"`: those with optimizer state on the host (else the nearest to
        fitting), the fastest with all of it there first (where the host update
        saves most), with `update="host"`. It moves no optimizer state over the
        host link but costs host memory bandwidth.
    - `"prefetch"`: those that read from the host inside their scans, with
        `Policy(prefetch=1)`: one more layer on the device, and reads the compiler
        may hide behind compute. On a GPU it may already move some reads of the
        plain scan.
    - `"next_forward"`: those with optimizer state on the host updated through
        the device, with `Policy(update_timing="next_forward")`: the stacked
        layers' update is applied in the next step's forward scan, where its
        transfers may hide behind the layers' compute (same numbers).
    """
    ranked = search.fastest()
    if stage == "host_update" and not ranked:  # none fits: the nearest to fitting
        ranked = [c for c in [search.best()] if c is not None]
    ranked = [c for c in ranked if _applies(c, stage)]
    if stage == "host_update":
        whole = [c for c in ranked if "device" not in c.opt_state.values()]
        ranked = list(dict.fromkeys(whole[:1] + ranked))
    field, value = _choice.SETS[stage]
    tried = [c.with_settings(**{field: value}) for c in ranked]
    with search.progress.stage(len(tried[: AGAIN[stage]])):
        for candidate in search.until_stopped(tried[: AGAIN[stage]]):
            try:
                search.evaluate(candidate)
            except ValueError as e:
                if not isinstance(e.__cause__, NotOnHost):
                    raise
                return  # an optimizer the host cannot run (a loop): none will


def _applies(c: Candidate, stage: Experimental) -> bool:
    """Whether `stage` changes `c`: the prefetch where a `Stacked` reads from the
    host inside its scans (parameters on the host, or a residual offloaded), the
    others where its optimizer state is on the host and its update is not."""
    used = c.settings.experimental
    if stage == "prefetch":
        offloaded = "offload" in (c.residuals or {}).values()
        reads = offloaded or any(k != "device" for k in c.params.values())
        return reads and stage not in used
    state_on_host = any(k != "device" for k in c.opt_state.values())
    return state_on_host and stage not in used and "host_update" not in used


def _start(
    search: Search, settings: list[Settings]
) -> tuple[Candidate, tuple[str, ...]]:
    """What `search` knows before compiling (the bytes each move frees by
    estimate, the parts of fields that can be placed apart), where it starts
    (`Policy.none()` in the first settings), and the checkpoint names offered."""
    model, optimizer, mesh = search.task.model, search.task.optimizer, search.task.mesh
    params = param_bytes(model)
    # (The checkpoint names are traced once a process.)
    offered = [n for n in search.cache.checkpoint_names(search.task) if n.residual]
    slots = state_slots(optimizer, model)
    search.parts, finer = parts_of(optimizer, model, slots)
    sizes: dict[Knob, dict[Any, int]] = {
        "params": {Part(f): n for f, n in params.items()},
        "opt_state": slots,
        # Streamed tables stay whole on every device: offered on one device only.
        "host_tables": tables_of(model) if mesh is None else {},
        # Compute copies of host parameters, under the compute dtypes offered.
        "copies": copies_of(model, tuple(s.compute_dtype for s in settings)),
    }
    # FSDP splits the parameters, the state and the batch.
    split = 1 if mesh is None else mesh.size
    moves = estimates(sizes, offered) | finer
    search.estimates = {m: n // split for m, n in moves.items()}
    tables, copies = tuple(sizes["host_tables"]), tuple(sizes["copies"])
    base = Candidate.start(tuple(params), tuple(slots), settings[0], tables, copies)
    return base, tuple(n.name for n in offered)
