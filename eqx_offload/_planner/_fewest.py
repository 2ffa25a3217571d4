"""`fewest_chips`: the smallest slice (or number of GPUs) that fits a training step.

The slice is of one chip kind. The step fits with its best plan.
"""

import bisect
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.tree_util as jtu
import optax
from jaxtyping import DTypeLike, PyTree

from .._memory_kinds import is_arraylike
from .._report import DoesNotFit, Hardware, size_text
from .._report._targets import device_count, target_sizes
from . import _budget
from ._choice import Experimental
from ._plan import search_plan, Searched
from ._plan_type import Plan


def fewest_chips(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    model: PyTree,
    *batch: PyTree,
    chip: str,
    device_budget: int | str | None = None,
    host_budget: int | str | None = None,
    batch_per_device: bool = False,
    has_aux: bool = False,
    axis: str = "fsdp",
    microbatches: Sequence[int] | Literal["search"] = (1,),
    compute_dtypes: Sequence[DTypeLike | None] = (None,),
    progress: bool = False,
    experimental: Sequence[Experimental] = (),
    workspace_margin: int | str | None = None,
    hardware: Hardware | None = None,
) -> Plan:
    """The fewest devices of `chip` on which the training step fits, and its plan.

    It runs `eo.plan` on the chip's targets, from one device up. A slice is laid
    out FSDP over every device. It compiles, and never runs.

    **Arguments:**

    - `loss_fn`, `optimizer`, `model`, `*batch`, `has_aux`, `axis`, `microbatches`,
        `compute_dtypes`, `progress`, `experimental`, `workspace_margin`,
        `hardware`: as for `eo.plan`.
    - `chip`: `"tpu-v5e"`, `"tpu-v6e"`, `"tpu-v5p"`, `"tpu-v4"`, `"gpu-h100"` or
        `"gpu-h200"`. The targets tried start with one chip. Then:
        - for a v5e or v6e, the slices `2x2`, `2x4`, `4x4` ... `16x16`;
        - for a v5p or v4, `2x2x1` ... `4x8x8`;
        - for a GPU, 2, 4, 8 GPUs of one host, then hosts of eight (`2x8` ...
            `8x8`).
    - `device_budget`, `host_budget`: per device, as for `eo.plan`. The defaults
        are the chip's capacity and its host RAM per device. That is 48 GB for a
        v5e chip: the RAM of a host over the chips it serves. So a plan within it
        fits on every host.
    - `batch_per_device`: `False` (default): `batch` is the whole batch, split
        over the devices. A target whose device count does not divide its leading
        size is skipped. `True`: `batch` is one device's share. The whole batch
        then grows with the devices: the leading sizes times the device count.

    **The search.** A step that fits on `n` devices is taken to fit on more. FSDP
    splits parameters, state and the batch further. So it bisects the targets.
    That takes three or four probes for the eight of a v5e (one chip and seven
    slices). A probe is `eo.plan`'s search, stopped at the first candidate that
    fits. A target where nothing fits is searched in full. The fewest devices
    found are then planned in full.

    **Returns:**

    The `Plan` of the fewest devices (`plan.target`, `plan.mesh`). `plan.tried`
    says, of each other target planned, why it was not chosen.

    **Raises:**

    `DoesNotFit` if the step fits on none of them. It gives the smallest footprint
    on the largest, and the budgets it exceeds there (`e.exceeded`). As in
    `eo.plan`, a target fits when its device and host bytes are within their
    budgets, both per device. On Ctrl-C, `PlanInterrupted` (as for `eo.plan`) with
    the best plan so far of the target it was planning (`e.plan.target`), which
    need not be the fewest.
    """
    # Its arguments `plan` takes, passed on as they are (the first statement: the
    # locals are the arguments).
    options = {k: v for k, v in locals().items() if k not in _NOT_PLANS}
    start = time.perf_counter()
    targets = list(target_sizes(chip))
    counts = {t: device_count(t) for t in targets}
    skipped: list[tuple[str, str]] = []
    if not batch_per_device:
        most = 1 if isinstance(microbatches, str) else max(microbatches, default=1)
        targets, skipped = _splitting(targets, counts, batch, most)
    tried: dict[str, Plan | DoesNotFit | None] = {}  # None: fits (not planned)
    searches: list[Searched] = []

    def attempt(target: str, full: bool = False) -> Plan | DoesNotFit | None:
        if target not in tried or (full and tried[target] is None):
            local = batch if not batch_per_device else _scaled(batch, counts[target])
            searched = search_plan(
                batch=local, target=target, first_fit=not full, **options
            )
            searches.append(searched)
            tried[target] = searched.found
        return tried[target]

    # The first target that fits, bisected (what fits on n devices fits on more).
    low = bisect.bisect_left(
        targets, True, key=lambda t: not isinstance(attempt(t), DoesNotFit)
    )
    chosen_target = targets[low] if low < len(targets) else None
    notes = tuple(skipped) + tuple(
        (t, _why(r)) for t, r in tried.items() if t != chosen_target
    )
    if low == len(targets):
        raise _none_fits(chip, targets, tried, notes)
    chosen = attempt(targets[low], full=True)
    assert isinstance(chosen, Plan), chosen_target
    return dataclasses.replace(
        chosen,
        tried=notes,
        compiled=sum(s.compiled for s in searches),
        reused=sum(s.reused for s in searches),
        seconds=time.perf_counter() - start,
    )


# `fewest_chips`' arguments that `plan` does not take as they are.
_NOT_PLANS = ("batch", "chip", "batch_per_device")


def _splitting(
    targets: list[str], counts: dict[str, int], batch: tuple, microbatches: int
) -> tuple[list[str], list[tuple[str, str]]]:
    """The targets whose devices split the batch's leading sizes, and the others.

    The devices are counted times the most micro-batches offered. Each other
    target comes with why it is skipped.
    """
    leading = {x.shape[0] for x in jtu.tree_leaves(batch) if getattr(x, "ndim", 0) > 0}
    parts = "" if microbatches == 1 else f" (in {microbatches} micro-batches)"
    kept = [
        t for t in targets if not any(n % (counts[t] * microbatches) for n in leading)
    ]
    why = f"do not split a batch of leading size {sorted(leading)}{parts}"
    skipped = [
        (t, f"skipped: {counts[t]} devices {why}") for t in targets if t not in kept
    ]
    return kept, skipped


def _scaled(batch: tuple, n: int) -> tuple:
    """`batch` with the leading size of each array leaf times `n`."""

    def grow(x: Any) -> Any:
        if not is_arraylike(x) or x.ndim == 0:
            return x
        return jax.ShapeDtypeStruct((x.shape[0] * n, *x.shape[1:]), x.dtype)

    return jtu.tree_map(grow, batch)


def _why(result: "Plan | DoesNotFit | None") -> str:
    """Why a target planned was not chosen: the memories its best candidate
    exceeds, with its footprints."""
    if not isinstance(result, DoesNotFit):
        return "fits: more devices than needed"
    need, host = result.required_bytes, result.host_required_bytes
    if result.exceeded == ("host",):
        footprint = "" if not host else f": smallest host footprint {size_text(host)}"
        return f"does not fit{footprint} (over the host budget)"
    footprint = "" if not need else f": smallest device footprint {size_text(need)}"
    why = f"does not fit{footprint}"
    if "host" in result.exceeded:
        footprint = "" if not host else f", host footprint {size_text(host)}"
        why += f" (over the host budget{footprint})"
    return why


def _none_fits(
    chip: str,
    targets: list[str],
    tried: dict[str, "Plan | DoesNotFit | None"],
    notes: tuple[tuple[str, str], ...],
) -> DoesNotFit:
    largest = targets[-1] if targets else chip
    last = tried.get(largest)
    lines = "; ".join(f"{t}: {why}" for t, why in notes)
    exceeded: tuple[Literal["device", "host"], ...] = ("device",)
    sizes, host_sizes, over = None, (None, None), ""
    if isinstance(last, DoesNotFit):
        exceeded = last.exceeded
        sizes = (last.required_bytes or 0, last.available_bytes or 0)
        host_sizes = (last.host_required_bytes, last.host_available_bytes)
        budgets = "budgets" if len(exceeded) > 1 else "budget"
        over = f"; on {largest} it exceeds the {' and '.join(exceeded)} {budgets}"
    return DoesNotFit(
        f"`fewest_chips(chip={chip!r})`: the step fits on none of the targets "
        f"tried ({lines}){over}. Give {_budget.fixes(exceeded)}, or more devices.",
        target=largest,
        sizes=sizes,
        host_sizes=host_sizes,
        exceeded=exceeded,
    )
