"""`plan`'s arguments checked and resolved before it compiles: the budgets (less
the workspace margin), the settings offered (micro-batch counts, compute dtypes,
the FSDP axis), and the model and batch made abstract."""

import math
from collections.abc import Sequence
from typing import cast, Literal

import jax
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, AxisType
from jaxtyping import DTypeLike, PyTree

from .._errors import see
from .._memory_kinds import is_arraylike
from .._policy import Policy
from .._report import Hardware
from .._report._targets import (
    abstract as abstract_leaf,
    capacity,
    device_count,
    host_memory,
    platform as target_platform,
)
from ._budget import parse_bytes, workspace_margin as margin_of
from ._candidates import Settings


def settings(
    target: str | None,
    axis: str,
    microbatches: Sequence[int] | Literal["search"],
    compute_dtypes: Sequence[DTypeLike | None],
    batch: tuple,
) -> tuple[list[Settings], tuple[int, ...], AbstractMesh | None]:
    """Every combination of the micro-batch counts and compute dtypes offered, the
    first ones first; FSDP over `axis` on a target of several devices. And with
    `microbatches="search"`, the counts searched (`searched`; else none), the
    settings then in one micro-batch, where the search starts. And the mesh of a
    target of several devices: one axis, `axis`, over all of them."""
    if not isinstance(axis, str) or not axis:
        raise ValueError(
            f"`plan(axis={axis!r})` is not a mesh axis name. Give one, such as "
            "'fsdp'." + see(118)
        )
    devices = 1 if target is None else device_count(target)
    search = microbatches == "search"
    # (Another string is refused there, as no sequence of counts.)
    counts = _counts(
        (1,) if search else cast(Sequence[int], microbatches), batch, devices
    )
    dtypes = tuple(compute_dtypes)
    if not dtypes:
        raise ValueError(
            "`plan(compute_dtypes=())` offers no dtype. Give at least one, such as "
            "`(None,)`." + see(118)
        )
    names = tuple(None if d is None else _dtype_name(d, dtypes) for d in dtypes)
    sharded = axis if devices > 1 else None
    found = searched(batch, devices) if search else ()
    mesh = AbstractMesh((devices,), (axis,), axis_types=(AxisType.Auto,))
    offered = [Settings(sharded, k, d) for k in counts for d in names]
    return offered, found, mesh if sharded else None


def searched(batch: tuple, devices: int) -> tuple[int, ...]:
    """The micro-batch counts `plan(microbatches="search")` chooses from: those that
    split every leading size of the batch over `devices`, ascending (the largest
    micro-batch first); only 1 for a batch with a scalar argument."""
    leaves = [x for x in jtu.tree_leaves(batch) if hasattr(x, "ndim")]
    if not leaves or any(x.ndim == 0 for x in leaves):
        return (1,)
    n = math.gcd(*(x.shape[0] for x in leaves))
    return tuple(k for k in range(1, n + 1) if n % (k * devices) == 0)


def _counts(microbatches: Sequence[int], batch: tuple, devices: int) -> tuple[int, ...]:
    """The micro-batch counts offered, each checked to split the batch."""
    counts = tuple(microbatches)
    if not counts or not all(_is_count(k) for k in counts):
        raise ValueError(
            f"`plan(microbatches={microbatches!r})` needs positive micro-batch "
            'counts. Offer e.g. `(1, 2, 4)`, or `"search"`.' + see(118)
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


def budgets(
    device: int | str | None,
    host: int | str | None,
    target: str | None,
    margin: int | str | None = None,
    hardware: Hardware | None = None,
) -> tuple[tuple[int, int], int]:
    """The device budget less the workspace margin, and the host budget (the
    budgets given, or the target's capacity and host memory per device: RAM, or a
    GPU's share of JAX's pinned host cap, `_targets.host_memory`); and the margin
    (`_budget.workspace_margin`)."""
    d = None if device is None else parse_bytes(device, "device_budget")
    h = None if host is None else parse_bytes(host, "host_budget")
    if target is None:
        if d is None or h is None:
            missing = "device_budget" if d is None else "host_budget"
            raise ValueError(
                f"`plan({missing}=None)` on this backend, which states no memory. "
                "Give both budgets, or a `target=`." + see(113)
            )
        platform = jax.default_backend()
    else:
        d = capacity(target) if d is None else d
        ram = (hardware or Hardware.of(target)).host_memory_bytes
        h = host_memory(target, ram)[0] if h is None else h  # (a GPU's pinned cap)
        platform = target_platform(target)
    left = margin_of(margin, d, platform)
    return (d - left, h), left


def abstract(tree: PyTree) -> PyTree:
    """Array leaves as `jax.ShapeDtypeStruct`s in their memory kinds and layouts
    (as `memory_report` takes them): each candidate places its own copy."""
    return jtu.tree_map(
        lambda x: abstract_leaf(x, None) if is_arraylike(x) else x, tree
    )
