"""The least host <-> device traffic a step can have: the bytes each direction must
move per step for a model's placement, the policy's update mode and compute dtype,
the optimizer's state and the micro-batch count, next to which `memory_report`
shows what the compiled program moves.

The rules, per trainable array leaf (bytes per device; a leaf laid out over a mesh
counts the shard one device holds):

- **Forward and backward.** A leaf whose compute value lives on the host (its
  `compute_dtype` copy where it has one, else the master) moves to the device each
  time the step needs it and the policy does not keep it there: a layer-sliced
  leaf of a `Stacked` (two or more dimensions per layer, `_tiling.slices_by_layer`)
  or a table `Policy(host_tables=...)` reads by blocks of rows is read in the forward
  scan and again in the backward scan of every micro-batch (once per micro-batch
  under `save="all"`, which keeps what it read); a leaf the device holds whole
  (outside every `Stacked`, or a per-layer vector such as a bias) once a step.
- **The gradient**, in the compute dtype it is computed in:
    - the update on the device (`"whole"`, `"streamed"`; `"auto"` is `"streamed"`
      on a TPU or GPU): a layer-sliced host-resident leaf's gradient goes to the
      host as the backward scan makes it and comes back for the update. With `k`
      micro-batches it is added up in the master dtype on the device, reading the
      accumulator back: `k` times the master-dtype bytes each way. A leaf the device
      holds whole keeps its gradient there (nothing moves); so does a
      device-resident leaf.
    - the update on the host (`"host"`): every gradient the host update reads
      goes there once: a layer-sliced host-resident leaf's once per micro-batch
      (the host adds them up), any other leaf's once a step (added up on the
      device; in the compute dtype if that is fewer bytes than the master dtype's
      one copy). A device-resident leaf updated on the host also sends its master
      and receives the new one.
- **The update on the device.** Each host-resident master is read once (unless the
  device holds it whole and computes with it in its own dtype: the forward pass
  brought it) and written once; each host-resident optimizer-state leaf is read
  and written once; a host-resident compute copy is written (never read). The
  optimizer's other state (step counts) lives on the device.
- **The update on the host** moves no host-resident state; the step counts it reads
  go to the host once. A leaf whose master and state are all on the device is
  updated there, moving nothing (a global-norm clip that ties it to host-resident
  gradients is not counted).
- **A held-over update** (`Policy(update_timing=...)`): the stacked layers'
  gradients wait in the optimizer state (`PendingUpdate.grads`) for the next
  step. One kept in host memory goes there and comes back once a step, unless
  the rules above already move it (a layer-sliced host-resident leaf's).
- **Residuals** offloaded by `Policy(offload=...)` go to the host in the forward
  pass and come back in the backward pass, once per micro-batch: `k` times the
  bytes one micro-batch saves there, each way (listed apart).

`minimum_traffic` applies them; `table_lines` prints them beside a report's
transfers.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jaxtyping import PyTree

from .. import _mixed_precision, _paths, _scopes, _tiling
from .._memory_kinds import is_arraylike, is_masked, kind_of
from .._policy import Policy
from .._update import own_state, PendingUpdate, state_leaves, trainable
from ._units import size_text


@dataclasses.dataclass(frozen=True)
class MinimumTraffic:
    """The bytes one step must move between host and device memory, per device.

    The bytes are split by what they are. `memory_report` fills
    `MemoryReport.minimum_transfers` with it.

    - `params_*`: masters and compute copies read for the forward and backward passes.
        Also masters read and written by the update.
    - `gradients_*`: the gradients.
    - `opt_state_*`: the optimizer state: moments, the compute copies written, step
        counts.
    - `residuals_*`: what `Policy(offload=...)` saves in host memory, both ways.
    - `host_to_device` and `device_to_host`: the totals, residuals included.
        `MemoryReport.host_to_device_bytes` counts them the same way.
    """

    params_to_device: int = 0
    params_to_host: int = 0
    gradients_to_device: int = 0
    gradients_to_host: int = 0
    opt_state_to_device: int = 0
    opt_state_to_host: int = 0
    residuals_to_device: int = 0
    residuals_to_host: int = 0

    @property
    def host_to_device(self) -> int:
        return sum(n for f, n in self._items() if f.endswith("_to_device"))

    @property
    def device_to_host(self) -> int:
        return sum(n for f, n in self._items() if f.endswith("_to_host"))

    def _items(self) -> list[tuple[str, int]]:
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]

    def bytes(
        self,
        direction: Literal["host_to_device", "device_to_host"],
        residuals: bool = True,
    ) -> int:
        """The total one way, with or without the residuals."""
        if direction == "host_to_device":
            total, apart = self.host_to_device, self.residuals_to_device
        elif direction == "device_to_host":
            total, apart = self.device_to_host, self.residuals_to_host
        else:
            raise ValueError(
                f"`MinimumTraffic.bytes(direction={direction!r})` is unknown. "
                "Use 'host_to_device' or 'device_to_host'."
            )
        return total if residuals else total - apart


def _nbytes(x: Any) -> int:
    """The bytes of the shard of `x` one device holds."""
    shape = tuple(x.shape)
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        shape = sharding.shard_shape(shape)
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def _on_host(x: Any) -> bool:
    return kind_of(x) != "device"


class _TrainableLeaf(NamedTuple):
    """A trainable array leaf, with what the rules read of it."""

    value: Any  # the master
    source: Any  # what its compute value is made from (its compute copy, or it)
    state: list[Any]  # its optimizer-state leaves
    copy: Any  # its compute copy in the optimizer state, or None
    held: Any  # its gradient held over to the next step, or None
    master: int  # bytes of the master
    grad: int  # bytes of its gradient, in the compute dtype
    sliced: bool  # read by the layer (or by blocks of rows), not whole


class _StateOf(NamedTuple):
    """The optimizer state by trainable leaf: its own leaves and its compute copy.

    Also the state that mirrors no parameter (step counts).
    """

    states: list[list[Any]]
    copies: list[Any]
    counts: list[Any]


def minimum_traffic(
    model: PyTree,
    opt_state: PyTree,
    policy: Policy,
    optimizer: optax.GradientTransformation | None = None,
    *,
    microbatches: int = 1,
    residual_bytes: int = 0,
    platform: str = "tpu",
) -> MinimumTraffic:
    """The bytes a train step must move each way per step (the rules above).

    **Arguments:**

    - `model`: the model, placed (`eo.place`): arrays or `jax.ShapeDtypeStruct`s in
        their memory kinds.
    - `opt_state`: its optimizer state from `eo.init_opt_state`. It is placed, with the
        compute copies of `Policy(compute_dtype=...)`.
    - `policy`: the step's `eo.Policy`: its update mode, compute dtype, `save`,
        `host_tables`.
    - `optimizer`: the optimizer the state belongs to. It tells which state leaves
        mirror which parameter. Without it, they are the state's subtrees shaped like
        the parameters.
    - `microbatches`: the step's `train_step(microbatches=...)`.
    - `residual_bytes`: what one micro-batch offloads to the host for the backward pass
        (per device).
    - `platform`: what `update="auto"` resolves on. The whole update on `"cpu"`, the
        streamed one elsewhere.

    **Returns:**

    A `MinimumTraffic`.
    """
    k = microbatches
    mode = _update_mode(policy, platform)
    leaves, counts = _trainable_leaves(model, opt_state, policy, optimizer)
    passes = 1 if policy.save == "all" else 2
    totals = dict.fromkeys((f.name for f in dataclasses.fields(MinimumTraffic)), 0)
    host_update_reads_counts = False
    for leaf in leaves:
        if _on_host(leaf.source):
            reads = passes * k if leaf.sliced else 1
            totals["params_to_device"] += reads * _nbytes(leaf.source)
        if mode == "host":
            host_update_reads_counts |= _host_update(leaf, k, totals)
        else:
            _device_update(leaf, k, totals)
    if host_update_reads_counts:
        totals["opt_state_to_host"] += sum(
            _nbytes(c) for c in counts if not _on_host(c)
        )
    totals["residuals_to_host"] = totals["residuals_to_device"] = k * residual_bytes
    return MinimumTraffic(**totals)


def _update_mode(policy: Policy, platform: str) -> str:
    """Where `policy` updates on `platform`: `"whole"`, `"streamed"` or `"host"`."""
    if policy.update == "auto":
        return "whole" if platform in _tiling.WHOLE_ON else "streamed"
    if policy.update in ("whole", "streamed", "host"):
        return policy.update
    raise ValueError(
        f"`minimum_traffic`: unknown `Policy(update={policy.update!r})`. "
        "Use 'auto', 'streamed', 'whole' or 'host'."
    )


def _trainable_leaves(
    model: PyTree,
    opt_state: PyTree,
    policy: Policy,
    optimizer: optax.GradientTransformation | None,
) -> tuple[list[_TrainableLeaf], list[Any]]:
    """Each trainable array leaf with its state, copy and held-over gradient.

    Also the state that mirrors no parameter.
    """
    held: list[Any] = []  # per trainable leaf: its gradient held over, or None
    if isinstance(opt_state, PendingUpdate):
        held = [
            None if is_masked(g) else g
            for g in jax.tree.leaves(opt_state.grads, is_leaf=is_masked)
        ]
        opt_state = own_state(opt_state)
    params = trainable(model)
    leaves = [leaf for leaf in _paths.leaves(params) if is_arraylike(leaf.value)]
    dtypes = _mixed_precision.compute_dtypes(params, policy)
    sources = {
        leaf.path: leaf.value
        for leaf in _paths.leaves(_mixed_precision.sources(model, params, opt_state))
    }
    if optimizer is not None:
        optimizer = _mixed_precision.for_policy(optimizer, params, policy)
    state = _state_of(optimizer, opt_state, params, len(leaves))
    out = []
    for leaf, dtype, mine, copy, grad in zip(
        leaves,
        dtypes,
        state.states,
        state.copies,
        held or [None] * len(leaves),
        strict=True,
    ):
        x = leaf.value
        master = _nbytes(x)
        in_table = any(
            _paths.prefix_match(p, leaf.path) is not None for p in policy.host_tables
        )
        sliced = in_table or (
            leaf.stacked is not None and _tiling.slices_by_layer(tuple(x.shape))
        )
        out.append(
            _TrainableLeaf(
                value=x,
                source=sources.get(leaf.path, x),
                state=mine,
                copy=copy,
                held=grad,
                master=master,
                grad=master * jnp.dtype(dtype).itemsize // jnp.dtype(x.dtype).itemsize,
                sliced=bool(sliced),
            )
        )
    return out, state.counts


def _state_of(
    optimizer: optax.GradientTransformation | None,
    opt_state: PyTree,
    params: PyTree,
    n: int,
) -> _StateOf:
    """`opt_state`'s leaves by the trainable leaf (of `n`) each belongs to."""
    found = _StateOf([[] for _ in range(n)], [None] * n, [])
    has_copies = isinstance(opt_state, _mixed_precision.ComputeCopyState)
    # (`owner` indexes `_paths.leaves(params)`: every leaf of `trainable` is an array.)
    for s in state_leaves(optimizer, opt_state, params):
        if s.owner is None:
            found.counts.append(s.leaf.value)
        elif has_copies and s.leaf.path.startswith(_scopes.COPIES + "."):
            found.copies[s.owner] = s.leaf.value
        else:
            found.states[s.owner].append(s.leaf.value)
    return found


def _host_update(leaf: _TrainableLeaf, k: int, totals: dict[str, int]) -> bool:
    """Adds what the update on the host moves for `leaf`.

    Returns whether the host updates it. Otherwise the device does, moving nothing.
    """
    x, on_host = leaf.value, _on_host(leaf.value)
    if not (on_host or any(_on_host(s) for s in leaf.state)):
        return False
    if on_host and leaf.sliced:
        totals["gradients_to_host"] += k * leaf.grad
    else:
        totals["gradients_to_host"] += min(k * leaf.grad, leaf.master)
    if not _on_host(x):
        totals["params_to_host"] += leaf.master
        totals["params_to_device"] += leaf.master
    for s in leaf.state:
        if not _on_host(s):
            totals["opt_state_to_host"] += _nbytes(s)
            totals["opt_state_to_device"] += _nbytes(s)
    if leaf.copy is not None and not _on_host(leaf.copy):
        totals["opt_state_to_device"] += _nbytes(leaf.copy)
    return True


def _device_update(leaf: _TrainableLeaf, k: int, totals: dict[str, int]) -> None:
    """Adds what the update on the device moves for `leaf`."""
    x, on_host = leaf.value, _on_host(leaf.value)
    held = leaf.held
    if held is not None and _on_host(held) and not (on_host and leaf.sliced):
        totals["gradients_to_host"] += _nbytes(held)
        totals["gradients_to_device"] += _nbytes(held)
    if on_host:
        if leaf.sliced:
            moved = leaf.grad if k == 1 else k * leaf.master
            totals["gradients_to_host"] += moved
            totals["gradients_to_device"] += moved
        if leaf.sliced or leaf.source is not x:
            totals["params_to_device"] += leaf.master
        totals["params_to_host"] += leaf.master
    for s in leaf.state:
        if _on_host(s):
            totals["opt_state_to_device"] += _nbytes(s)
            totals["opt_state_to_host"] += _nbytes(s)
    if leaf.copy is not None and _on_host(leaf.copy):
        totals["opt_state_to_host"] += _nbytes(leaf.copy)


def of_step(fn: Any, job: Any, residuals: Any, platform: str, where: Any) -> Any:
    """`memory_report`'s minimum for what it compiled (`job`, for `where`).

    For a `train_step`, it counts the residuals it saw in host memory. They are
    `ResidualRow`s of whole arrays, divided between the devices of a slice. `None` for
    anything else.
    """
    if job.compiled != "train_step":
        return None
    return minimum_traffic(
        job.params,
        job.opt_state,
        fn.policy,
        fn.optimizer,
        microbatches=fn.microbatches,
        residual_bytes=offloaded_bytes(residuals) // (where.chips or 1),
        platform=platform,
    )


def offloaded_bytes(rows: Any) -> int:
    """What `MemoryReport.residuals` rows keep in host memory."""
    return sum(r.bytes for r in rows or () if r.memory_kind != "device")


def to_dict(minimum: MinimumTraffic | None) -> dict[str, int] | None:
    return None if minimum is None else dataclasses.asdict(minimum)


def from_dict(data: dict[str, int] | None) -> MinimumTraffic | None:
    """The record `to_dict` gave (`None`, as in a report saved before it existed)."""
    return None if data is None else MinimumTraffic(**data)


def table_lines(report: Any) -> list[str]:
    """The rows a `MemoryReport`'s traffic section ends with.

    They are the total of its transfers (compiled where there are some) and its minimum,
    residuals apart.
    """
    minimum = report.minimum_transfers
    if minimum is None:
        return []

    def row(label: str, h2d: int, d2h: int) -> str:
        return f"{label:<34}{size_text(h2d):>14}{size_text(d2h):>14}"

    lines = []
    transfers: Sequence[Any] = report.compiled_transfers or report.transfers or ()
    if transfers:
        moved = {
            d: sum(t.bytes for t in transfers if t.direction == d)
            for d in ("host_to_device", "device_to_host")
        }
        lines.append(row("  total", moved["host_to_device"], moved["device_to_host"]))
    lines.append(row("  minimum", minimum.host_to_device, minimum.device_to_host))
    if minimum.residuals_to_device or minimum.residuals_to_host:
        lines.append(
            row(
                "    of which residuals",
                minimum.residuals_to_device,
                minimum.residuals_to_host,
            )
        )
    return lines
