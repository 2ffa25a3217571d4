"""`memory_report`: where every byte of a step lives, on this backend or compiled for
a TPU chip, without running anything."""

from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import PyTree

from . import _residuals
from ._memory_kinds import is_arraylike, kind_of
from ._targets import abstract, chip_mesh, TargetArg
from ._train_step import _TrainStep, join, split
from ._transform import _OffloadWrapper, filter_offload


_PARTS = ("argument", "output", "temp", "alias")
_KINDS = ("device", "pinned_host")


class DoesNotFit(ValueError):
    """Raised by `memory_report` when the compiler finds the program too big for the
    target's memory; the message gives the compiler's numbers."""


class ResidualRow(NamedTuple):
    """Bytes saved for the backward pass under one checkpoint name and memory kind."""

    name: str  # a checkpoint name, or "(unnamed, in stacked layers)", "(other)"
    memory_kind: str
    bytes: int


class MemoryReport(eqx.Module):
    """Where the memory of one compiled step lives. Print it for a table.

    - `device_bytes`, `host_bytes`: the footprints, `argument + output + temp -
        alias` of each memory (`device` and `host` hold the parts).
    - `params`, `opt_state`: bytes by memory kind between steps (`train_step` and
        `filter_offload` objects; `None` otherwise).
    - `residuals`: bytes saved for the backward pass, by checkpoint name and memory
        kind (`train_step` and `filter_offload` objects; `None` otherwise).
    - `arguments`: bytes of each argument by memory kind.
    - `estimate`: `True` on the CPU backend, whose compiler does not tell host from
        device memory: the split there follows the leaves' memory kinds, and
        temporaries are counted as device memory.
    """

    target: str
    kind: str  # "train_step", "filter_offload" or "function"
    estimate: bool
    device: dict[str, int]
    host: dict[str, int]
    arguments: dict[str, dict[str, int]]
    params: dict[str, int] | None = None
    opt_state: dict[str, int] | None = None
    residuals: tuple[ResidualRow, ...] | None = None

    @property
    def device_bytes(self) -> int:
        d = self.device
        return d["argument"] + d["output"] + d["temp"] - d["alias"]

    @property
    def host_bytes(self) -> int:
        h = self.host
        return h["argument"] + h["output"] + h["temp"] - h["alias"]

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable data (bytes as ints)."""
        return {
            "target": self.target,
            "kind": self.kind,
            "estimate": self.estimate,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "device": dict(self.device),
            "host": dict(self.host),
            "arguments": {k: dict(v) for k, v in self.arguments.items()},
            "params": None if self.params is None else dict(self.params),
            "opt_state": None if self.opt_state is None else dict(self.opt_state),
            "residuals": None
            if self.residuals is None
            else [r._asdict() for r in self.residuals],
        }

    def __str__(self) -> str:
        if self.estimate:
            lines = [
                f"Memory report for a {self.kind}, compiled for this CPU backend",
                "(an estimate: XLA's CPU compiler has one memory, so the split follows "
                "the leaves' memory kinds",
                "and temporaries count as device memory)",
            ]
        else:
            lines = [f"Memory report for a {self.kind}, compiled for {self.target}"]
        header = f"{'':<34}{'device':>14}{'host':>14}"
        lines += [header, "-" * len(header)]

        def row(label: str, device: int, host: int) -> None:
            lines.append(f"{label:<34}{_size(device):>14}{_size(host):>14}")

        row("footprint", self.device_bytes, self.host_bytes)
        for part, label in zip(_PARTS, ("arguments", "outputs", "temporaries")):
            row(f"  {label}", self.device[part], self.host[part])
        row(
            "  aliased (donated, counted once)",
            -self.device["alias"],
            -self.host["alias"],
        )
        for label, by_kind in (
            ("parameters", self.params),
            ("optimizer state", self.opt_state),
        ):
            if by_kind is not None:
                row(label, by_kind.get("device", 0), _host(by_kind))
        if self.residuals is not None:
            lines.append("saved for the backward pass")
            totals: dict[str, dict[str, int]] = defaultdict(dict)
            for r in self.residuals:
                totals[r.name][r.memory_kind] = r.bytes
            for name, by_kind in totals.items():
                row(f"  {name}", by_kind.get("device", 0), _host(by_kind))
            if not totals:
                lines.append("  (nothing)")
        if self.params is None:
            lines.append("arguments")
            for name, by_kind in self.arguments.items():
                row(f"  {name}", by_kind.get("device", 0), _host(by_kind))
        return "\n".join(lines)


def _host(by_kind: dict[str, int]) -> int:
    return sum(v for k, v in by_kind.items() if k != "device")


def _size(n: int) -> str:
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n} B"


def _nbytes(x: Any) -> int:
    return int(x.size) * x.dtype.itemsize


def bytes_by_kind(tree: PyTree) -> dict[str, int]:
    """Bytes of the array leaves of `tree`, by memory kind."""
    out: dict[str, int] = defaultdict(int)
    for x in jtu.tree_leaves(tree):
        if is_arraylike(x):
            out[kind_of(x)] += _nbytes(x)
    return dict(out)


def residual_rows(fun: Callable, *args: Any, **kwargs: Any) -> tuple[ResidualRow, ...]:
    """What `fun` saves for its backward pass, by checkpoint name and memory kind;
    its arguments (already counted) are left out."""
    totals: dict[tuple[str, str], int] = defaultdict(int)
    for r in _residuals.saved_residuals(fun, *args, **kwargs):
        if r.source == "argument":
            continue
        if r.name is not None:
            label = r.name
        elif r.per_iteration:
            label = "(unnamed, in stacked layers)"
        else:
            label = "(other)"
        totals[label, "pinned_host" if r.host else "device"] += r.nbytes
    return tuple(ResidualRow(name, kind, n) for (name, kind), n in totals.items())


class _Plan(NamedTuple):
    """What to compile (`trace()`), and how to describe it."""

    trace: Callable[[], Any]  # -> a `jax.stages.Traced`
    kind: str
    arguments: dict[str, Any]
    params: Any = None
    opt_state: Any = None
    residuals: Callable[[], tuple[ResidualRow, ...]] | None = None


def _unwrap_filter_jit(fn: Any) -> Any:
    """The function inside an `eqx.filter_jit` (which cannot be traced for another
    target by itself); `jax.jit` functions are traced as they are."""
    while (
        not isinstance(fn, (_TrainStep, _OffloadWrapper))
        and not hasattr(fn, "trace")
        and hasattr(fn, "lower")
        and getattr(fn, "__wrapped__", None) is not None
    ):
        fn = fn.__wrapped__
    return fn


def _plan(fn: Any, args: tuple, kwargs: dict) -> _Plan:
    if isinstance(fn, _TrainStep):
        if kwargs or len(args) < 2:
            raise TypeError(
                "`memory_report(step, model, opt_state, *batch)`: a `train_step` takes "
                "the model, the optimizer state and the batch, positionally."
            )
        model, opt_state, *batch = args
        dynamic, statics = fn.split(model, opt_state, *batch)
        jitted = jax.jit(fn.fun, static_argnums=3, donate_argnums=(0, 1))
        loss = filter_offload(fn.loss_fn, fn.policy)

        def residuals() -> tuple[ResidualRow, ...]:
            def wrt_model(model: Any, *batch: Any) -> Any:
                batch = jtu.tree_map(
                    lambda x: jax.lax.stop_gradient(x) if eqx.is_array(x) else x, batch
                )
                out = loss(model, *batch)
                return out[0] if fn.has_aux else out

            return residual_rows(wrt_model, model, *batch)

        return _Plan(
            lambda: jitted.trace(*dynamic, statics),
            "train_step",
            {"model": model, "opt_state": opt_state, "batch": tuple(batch)},
            model,
            opt_state,
            residuals,
        )
    named = {f"argument {i}": a for i, a in enumerate(args)}
    named.update({f"argument `{k}`": v for k, v in kwargs.items()})
    if hasattr(fn, "trace"):  # a `jax.jit` function: its donation and statics hold
        return _Plan(lambda: fn.trace(*args, **kwargs), "function", named)
    dynamic, static = split((args, kwargs))

    def call(dynamic: list, static: tuple) -> Any:
        a, k = join(dynamic, static)
        return fn(*a, **k)

    jitted = jax.jit(call, static_argnums=1)
    trace = lambda: jitted.trace(dynamic, static)  # noqa: E731
    if isinstance(fn, _OffloadWrapper):
        return _Plan(
            trace,
            "filter_offload",
            named,
            args[0] if args else None,
            None,
            lambda: residual_rows(fn, *args, **kwargs),
        )
    return _Plan(trace, "function", named)


def memory_report(
    fn: Callable, *args: Any, target: TargetArg | None = None, **kwargs: Any
) -> MemoryReport:
    """Compiles `fn(*args, **kwargs)` (without running it) and reports where its
    memory lives.

    **Arguments:**

    - `fn`: a `train_step`, a `filter_offload` function, or any function JAX can
        jit (a `jax.jit`/`eqx.filter_jit` function is re-jitted from the function
        it wraps). Non-array arguments are static.
    - `*args`, `**kwargs`: its arguments: arrays or `jax.ShapeDtypeStruct`s (e.g.
        `eo.place(eqx.filter_eval_shape(Model, ...), policy)`), in their memory
        kinds. Nothing is allocated or run.
    - `target`: `None` for this backend; `"tpu-v5e"`, `"tpu-v6e"`, `"tpu-v5p"` or
        `"tpu-v4"` to compile for one chip of that TPU here, with libtpu (the
        `tpu` extra). `target` is reserved: a function argument of that name can be
        bound with `functools.partial`.

    **Returns:**

    A `MemoryReport`: device and host footprints with their parts (from
    `compiled.memory_analysis()`), and, for `train_step` and `filter_offload`
    objects, the bytes of parameters, optimizer state and saved residuals by memory
    kind. On the CPU backend the host/device split is an estimate (see
    `MemoryReport`).

    !!! Example

        ```python
        batch = (tokens, targets)
        report = eo.memory_report(step, model, opt_state, *batch, target="tpu-v5e")
        print(report)                  # a table
        report.device_bytes, report.host_bytes
        ```
    """
    mesh = None if target is None else chip_mesh(target)
    fn = _unwrap_filter_jit(fn)

    def to_abstract(tree: Any) -> Any:
        return jtu.tree_map(lambda x: abstract(x, mesh) if is_arraylike(x) else x, tree)

    plan = _plan(fn, to_abstract(args), to_abstract(kwargs))
    traced = plan.trace()
    try:
        stats = traced.lower().compile().memory_analysis()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise DoesNotFit(
            f"`memory_report`: this {plan.kind} does not fit in the memory of one "
            f"{target or jax.default_backend()} chip; the compiler says: "
            f"{str(e).rstrip('.')}. Use a "
            "policy that offloads more, or a chip with more memory."
        ) from e
    if stats is None:
        raise ValueError(
            f"`memory_report`: the {target or jax.default_backend()!r} compiler gives "
            "no memory analysis for this function."
        )
    estimate = mesh is None and jax.default_backend() == "cpu"
    if estimate:
        device, host = _split_estimate(stats, traced)
    else:
        device = {p: int(getattr(stats, f"{p}_size_in_bytes")) for p in _PARTS}
        host = {p: int(getattr(stats, f"host_{p}_size_in_bytes")) for p in _PARTS}
    return MemoryReport(
        target=target or jax.default_backend(),
        kind=plan.kind,
        estimate=estimate,
        device=device,
        host=host,
        arguments={k: bytes_by_kind(v) for k, v in plan.arguments.items()},
        params=None if plan.params is None else bytes_by_kind(plan.params),
        opt_state=None if plan.opt_state is None else bytes_by_kind(plan.opt_state),
        residuals=None if plan.residuals is None else plan.residuals(),
    )


def _split_estimate(stats: Any, traced: Any) -> tuple[dict[str, int], dict[str, int]]:
    """Device and host parts on a backend that reports one memory: arguments and
    outputs by their memory kinds, temporaries on the device, and donated host
    inputs aliased to host outputs of the same shape."""

    def host(aval: Any) -> bool:
        return getattr(aval, "memory_space", None) == jax.memory.Space.Host

    inputs = jtu.tree_leaves(traced.in_avals)
    donated = [i.donated for i in jtu.tree_leaves(traced.args_info)]
    outputs = jtu.tree_leaves(traced.out_avals)
    host_argument = sum(_nbytes(a) for a in inputs if host(a))
    host_output = sum(_nbytes(a) for a in outputs if host(a))
    free = [(a.shape, a.dtype) for a in outputs if host(a)]
    host_alias = 0
    for aval, is_donated in zip(inputs, donated, strict=True):
        if is_donated and host(aval) and (aval.shape, aval.dtype) in free:
            free.remove((aval.shape, aval.dtype))
            host_alias += _nbytes(aval)
    host_alias = min(host_alias, int(stats.alias_size_in_bytes))
    device = {
        "argument": int(stats.argument_size_in_bytes) - host_argument,
        "output": int(stats.output_size_in_bytes) - host_output,
        "temp": int(stats.temp_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes) - host_alias,
    }
    host_parts = {
        "argument": host_argument,
        "output": host_output,
        "temp": 0,
        "alias": host_alias,
    }
    return device, host_parts
