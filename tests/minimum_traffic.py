"""A test oracle, not a test file: the least host <-> device traffic a train step
can have, per device, for a model's placement, the policy's update mode and compute
dtype, the optimizer's state and the micro-batch count. `test_minimum_traffic.py`
checks the compiled program's bytes against it; `benchmarks/minimum_bytes.py` prints
its tables (docs/step-time.md). It was `eo.MinimumTraffic` and a row of the memory
report until issue 53.

The rules, per trainable array leaf (a leaf laid out over a mesh counts the shard
one device holds):

- **Forward and backward.** A leaf whose compute value lives on the host (its
  `compute_dtype` copy where it has one, else the master) moves to the device each
  time the step needs it and the policy does not keep it there: a layer-sliced
  leaf of a `Stacked` (two or more dimensions per layer) or a `host_tables` table
  is read in the forward scan and again in the backward scan of every micro-batch
  (once under `save="all"`); a leaf the device holds whole once a step.
- **The gradient**, in the compute dtype:
    - the update on the device (`"whole"`, `"streamed"`; `"auto"` is `"streamed"`
      on a TPU or GPU): a layer-sliced host-resident leaf's gradient goes to the
      host and comes back for the update; with `k` micro-batches it is added up in
      the master dtype, reading the accumulator back: `k` master-dtype copies each
      way. Other gradients stay on the device.
    - the update on the host (`"host"`): a layer-sliced host-resident leaf's
      gradient goes there once per micro-batch, any other's once a step (in the
      compute dtype if that is fewer bytes than the master dtype's one copy). A
      device-resident leaf updated on the host also sends its master and receives
      the new one.
- **The update on the device.** Each host-resident master is read once (unless the
  device holds it whole and computes with it in its own dtype) and written once;
  each host-resident state leaf is read and written once; a host-resident compute
  copy is written. Step counts live on the device.
- **The update on the host** moves no host-resident state; the step counts go to
  the host once. A leaf whose master and state are all on the device is updated
  there, moving nothing.
- **A held-over update** (`update_timing=...`): the stacked layers' gradients wait
  in `PendingUpdate.grads`; one kept in host memory goes there and comes back once
  a step, unless the rules above already move it.
- **Residuals** offloaded by `Policy(offload=...)` go to the host and come back
  once per micro-batch (listed apart).
"""

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import eqx_offload as eo
import eqx_offload.internal as eoi


@dataclasses.dataclass(frozen=True)
class MinimumTraffic:
    """The bytes one step must move between host and device memory, per device, by
    what they are (`params`: masters and compute copies read for the passes, masters
    read and written by the update; `opt_state`: moments, compute copies written,
    step counts; `residuals`: what `Policy(offload=...)` saves on the host)."""

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
        return self.bytes("host_to_device")

    @property
    def device_to_host(self) -> int:
        return self.bytes("device_to_host")

    def bytes(
        self,
        direction: Literal["host_to_device", "device_to_host"],
        residuals: bool = True,
    ) -> int:
        """The total one way, with or without the residuals."""
        end = "_to_device" if direction == "host_to_device" else "_to_host"
        return sum(
            getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name.endswith(end) and (residuals or not f.name.startswith("resid"))
        )


def _nbytes(x: Any) -> int:
    """The bytes of the shard of `x` one device holds."""
    shape = tuple(x.shape)
    if isinstance(getattr(x, "sharding", None), NamedSharding):
        shape = x.sharding.shard_shape(shape)
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def _on_host(x: Any) -> bool:
    return eoi.kind_of(x) != "device"


@dataclasses.dataclass
class _Leaf:
    """A trainable array leaf, with what the rules read of it."""

    value: Any  # the master
    source: Any  # what its compute value is made from (its compute copy, or it)
    sliced: bool  # read by the layer (or by blocks of rows), not whole
    grad: int  # bytes of its gradient, in the compute dtype
    held: Any = None  # its gradient held over to the next step
    copy: Any = None  # its compute copy in the optimizer state
    state: list = dataclasses.field(default_factory=list)  # its state leaves

    @property
    def master(self) -> int:
        return _nbytes(self.value)


def minimum_traffic(
    model: Any,
    opt_state: Any,
    policy: eo.Policy,
    optimizer: Any = None,
    *,
    microbatches: int = 1,
    residual_bytes: int = 0,
    platform: str = "tpu",
) -> MinimumTraffic:
    """The bytes a train step must move each way per step (the rules above), for a
    placed `model` and its `opt_state` (arrays or `jax.ShapeDtypeStruct`s);
    `residual_bytes` is what one micro-batch offloads (per device); `platform` is
    what `update="auto"` resolves on."""
    k = microbatches
    mode = policy.update
    if mode == "auto":
        mode = "whole" if platform in eoi.WHOLE_ON else "streamed"
    leaves, counts = _leaves(model, opt_state, policy, optimizer)
    passes = 1 if policy.save == "all" else 2
    totals = dict.fromkeys((f.name for f in dataclasses.fields(MinimumTraffic)), 0)
    reads_counts = False
    for leaf in leaves:
        if _on_host(leaf.source):
            reads = passes * k if leaf.sliced else 1
            totals["params_to_device"] += reads * _nbytes(leaf.source)
        if mode == "host":
            reads_counts |= _host_update(leaf, k, totals)
        else:
            _device_update(leaf, k, totals)
    if reads_counts:
        totals["opt_state_to_host"] += sum(
            _nbytes(c) for c in counts if not _on_host(c)
        )
    totals["residuals_to_host"] = totals["residuals_to_device"] = k * residual_bytes
    return MinimumTraffic(**totals)


def _leaves(
    model: Any, opt_state: Any, policy: eo.Policy, optimizer: Any
) -> tuple[list[_Leaf], list[Any]]:
    """Each trainable array leaf with its state, copy and held-over gradient; and
    the state that mirrors no parameter (step counts)."""
    held: list[Any] = []
    if isinstance(opt_state, eo.PendingUpdate):
        masked = jax.tree.leaves(opt_state.grads, is_leaf=eoi.is_masked)
        held = [None if eoi.is_masked(g) else g for g in masked]
        opt_state = eoi.own_state(opt_state)
    params = eoi.trainable(model)
    paths = [p for p in eoi.paths_leaves(params) if eoi.is_arraylike(p.value)]
    sources = eoi.compute_sources(model, params, opt_state)
    sources = {p.path: p.value for p in eoi.paths_leaves(sources)}
    dtypes = eoi.compute_dtypes(params, policy)
    out = []
    for p, dtype, grad in zip(paths, dtypes, held or [None] * len(paths), strict=True):
        x = p.value
        in_table = any(
            eoi.prefix_match(t, p.path) is not None for t in policy.host_tables
        )
        stacked = p.stacked is not None and eoi.slices_by_layer(x.shape)
        size = _nbytes(x) * jnp.dtype(dtype).itemsize // jnp.dtype(x.dtype).itemsize
        sliced = bool(in_table or stacked)
        out.append(_Leaf(x, sources.get(p.path, x), sliced, size, held=grad))
    if optimizer is not None:
        optimizer = eoi.for_policy(optimizer, params, policy)
    copies = isinstance(opt_state, eoi.ComputeCopyState)
    counts = []
    # (`owner` indexes `paths.leaves(params)`: every leaf of `trainable` is an array.)
    for s in eoi.state_leaves(optimizer, opt_state, params):
        if s.owner is None:
            counts.append(s.leaf.value)
        elif copies and s.leaf.path.startswith(eoi.COPIES + "."):
            out[s.owner].copy = s.leaf.value
        else:
            out[s.owner].state.append(s.leaf.value)
    return out, counts


def _host_update(leaf: _Leaf, k: int, totals: dict[str, int]) -> bool:
    """Adds what the update on the host moves for `leaf`; whether the host updates
    it (else the device does, moving nothing)."""
    on_host = _on_host(leaf.value)
    if not (on_host or any(_on_host(s) for s in leaf.state)):
        return False
    sent = k * leaf.grad
    totals["gradients_to_host"] += (
        sent if on_host and leaf.sliced else min(sent, leaf.master)
    )
    if not on_host:
        totals["params_to_host"] += leaf.master
        totals["params_to_device"] += leaf.master
    for s in leaf.state:
        if not _on_host(s):
            totals["opt_state_to_host"] += _nbytes(s)
            totals["opt_state_to_device"] += _nbytes(s)
    if leaf.copy is not None and not _on_host(leaf.copy):
        totals["opt_state_to_device"] += _nbytes(leaf.copy)
    return True


def _both_ways(totals: dict[str, int], what: str, n: int) -> None:
    totals[f"{what}_to_host"] += n
    totals[f"{what}_to_device"] += n


def _device_update(leaf: _Leaf, k: int, totals: dict[str, int]) -> None:
    """Adds what the update on the device moves for `leaf`."""
    on_host = _on_host(leaf.value)
    sliced_on_host = on_host and leaf.sliced
    if leaf.held is not None and _on_host(leaf.held) and not sliced_on_host:
        _both_ways(totals, "gradients", _nbytes(leaf.held))
    if sliced_on_host:
        _both_ways(totals, "gradients", leaf.grad if k == 1 else k * leaf.master)
    if on_host:
        if leaf.sliced or leaf.source is not leaf.value:
            totals["params_to_device"] += leaf.master
        totals["params_to_host"] += leaf.master
    for s in leaf.state:
        if _on_host(s):
            _both_ways(totals, "opt_state", _nbytes(s))
    if leaf.copy is not None and _on_host(leaf.copy):
        totals["opt_state_to_host"] += _nbytes(leaf.copy)


def offloaded_bytes(report: eo.MemoryReport) -> int:
    """What a report's residual rows keep in host memory, per device."""
    rows = report.residuals or ()
    kept = sum(r.bytes for r in rows if r.memory_kind != "device")
    return kept // (report.chips or 1)
