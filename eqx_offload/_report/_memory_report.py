"""`memory_report`: where every byte of a step lives, without running anything.

It compiles for this backend, a TPU chip, a whole TPU slice, or NVIDIA GPUs.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu

from .. import _compat, _compiler, _jaxpr_flops, _mesh, _pending, _train_step
from .._checkpoint_names import one_microbatch
from .._diagnose import DoesNotCompile, out_of_memory
from .._errors import see
from .._flatten import flatten, unflatten
from .._memory_kinds import is_arraylike
from .._train_step import TrainStep
from .._transform import Offloaded
from . import _compiled_traffic, _costs, _step_time, _targets, _traffic
from ._compile_job import (
    abstract_arguments,
    bytes_by_kind,
    CompileJob,
    inputs,
    kind_not_kept,
    outputs,
    policy_of,
    split_estimate,
)
from ._does_not_fit import DoesNotFit, Held, microbatches_of, split_copies, too_big
from ._hardware import Hardware
from ._memory_report_type import DESCRIPTIONS, MemoryReport
from ._memory_table import PARTS
from ._saved_for_backward import differentiated, Saved, saved_for_backward
from ._targets import HostLimit, Where, where_of
from ._units import host_total, size_text


def _train_step_job(step: TrainStep, args: tuple, kwargs: dict) -> CompileJob:
    if kwargs or len(args) < 2:
        raise TypeError(
            "`memory_report(step, ...)` takes the step's arguments by position: "
            "`memory_report(step, model, opt_state, *batch)`."
        )
    model, opt_state, *batch = args
    opt_state = _pending.steady(opt_state)
    dynamic, statics = _train_step.flat_arguments(step, model, opt_state, *batch)
    batch = unflatten(dynamic[2], statics.batch)  # as `Policy(batch=...)` lays it out
    # `keep_unused`: the compiled signature then lists every argument, which is
    # how `_split_estimate` matches arguments to their memory kinds.
    jitted = jax.jit(
        _train_step.flat_function(step),
        static_argnums=3,
        donate_argnums=(0, 1),
        keep_unused=True,
    )

    def residuals() -> Saved:
        fn, seen = differentiated(step, model, opt_state)
        return saved_for_backward(fn, seen, *one_microbatch(step, batch))

    return CompileJob(
        lambda: jitted.trace(*dynamic, statics),
        "train_step",
        {"model": model, "opt_state": opt_state, "batch": tuple(batch)},
        model,
        opt_state,
        residuals,
        functools.partial(_train_step.rejected, step, model=model, opt_state=opt_state),
    )


def _has_aux(fn: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a `filter_offload` function returns `loss` or `(loss, aux)`."""
    out = eqx.filter_eval_shape(fn, *args, **kwargs)
    if is_arraylike(out) and out.shape == ():
        return False
    pair = isinstance(out, tuple) and len(out) == 2 and is_arraylike(out[0])
    if pair and out[0].shape == ():
        return True
    shapes = jax.tree.map(lambda x: getattr(x, "shape", x), out)
    raise ValueError(
        "`memory_report(fn, ...)`: a `filter_offload` function must return a scalar "
        f"loss or `(loss, aux)`, for its gradient; it returned {shapes}. Pass a "
        "`train_step`, or wrap it yourself (`eqx.filter_grad`)." + see(38)
    )


def _function_job(fn: Any, args: tuple, kwargs: dict) -> CompileJob:
    named = {f"argument {i}": a for i, a in enumerate(args)}
    named.update({f"argument `{k}`": v for k, v in kwargs.items()})
    named = {
        k: v for k, v in named.items() if any(map(is_arraylike, jtu.tree_leaves(v)))
    }
    if hasattr(fn, "trace"):  # a `jax.jit` function: its donation and statics hold
        return CompileJob(lambda: fn.trace(*args, **kwargs), "function", named)
    # `eqx.filter_jit` functions are re-jitted from the function they wrap (they
    # treat `ShapeDtypeStruct`s as static), keeping their donation.
    parts = _compat.filter_jit_parts(fn)
    donate = () if parts is None else parts.donated
    fn = _compat.inside_filter_jit(fn)
    compiled, params, residuals = "function", None, None
    if isinstance(fn, Offloaded):
        compiled, params = "filter_offload", args[0] if args else None
        residuals = functools.partial(saved_for_backward, fn, *args, **kwargs)
        fn = eqx.filter_value_and_grad(fn, has_aux=_has_aux(fn, args, kwargs))
    first, first_static = flatten(args[:1])
    rest, rest_static = flatten((args[1:], kwargs))

    def call(first: list, rest: list, statics: tuple) -> Any:
        (*a,) = unflatten(first, statics[0])
        more, k = unflatten(rest, statics[1])
        return eqx.filter(fn(*a, *more, **k), is_arraylike)  # arrays only, as jit needs

    jitted = jax.jit(call, static_argnums=2, donate_argnums=donate, keep_unused=True)
    trace = lambda: jitted.trace(first, rest, (first_static, rest_static))  # noqa: E731
    return CompileJob(trace, compiled, named, params, None, residuals)


def memory_report(
    fn: Callable,
    *args: Any,
    target: str | None = None,
    hardware: Hardware | None = None,
    **kwargs: Any,
) -> MemoryReport:
    """Compiles `fn(*args, **kwargs)` (without running it) and reports where its
    memory lives.

    **Arguments:**

    - `fn`: an `eo.TrainStep`, a `filter_offload` function, or any function JAX can
        jit. A `jax.jit`/`eqx.filter_jit` function is re-jitted from the function it
        wraps. Non-array arguments are static.
    - `*args`, `**kwargs`: its arguments, in their memory kinds. They are arrays or
        `jax.ShapeDtypeStruct`s, e.g. `eo.place(eqx.filter_eval_shape(Model, ...),
        policy)`. Nothing is allocated or run.
    - `target`: where to compile, here. A TPU needs libtpu (the `tpu` extra).
        - `None`: this backend.
        - `"tpu-v5e"`, `"tpu-v6e"`, `"tpu-v5p"` or `"tpu-v4"`: one chip of that
            TPU. Every argument is placed whole on it. Meshes are ignored.
        - `"tpu-v5e:16x16"`: a chip and a topology, the whole slice as one SPMD
            program. Any topology libtpu accepts works, such as `"tpu-v5e:2x2"` ...
            `"tpu-v5e:16x16"`, `"tpu-v6e:4x4"`, `"tpu-v5p:2x2x2"`, `"tpu-v4:2x2x2"`.
            Arguments laid out with `NamedSharding`s over a mesh keep their specs
            and memory kinds. That mesh is an `AbstractMesh` of the slice's shape,
            or a concrete `Mesh` (e.g. of CPU devices). They move to a mesh of the
            slice's chips with the same axis names, sizes and types. The mesh must
            have as many devices as the slice has chips. Other arguments are
            replicated on every chip. The exception is the batch that a
            `train_step` with `Policy(batch=...)` lays out.
        - `"gpu-h100"`, `"gpu-h200"` (one GPU), `"gpu-h100:8"` (a node of eight),
            `"gpu-h100:4x8"` (hosts x GPUs per host): compiled with JAX's CUDA
            plugin (the `gpu-aot` extra). No GPU is needed, as for a slice. The
            capacity is the share of the GPU's memory that JAX's allocator takes.
            That share is `XLA_PYTHON_CLIENT_MEM_FRACTION`, default 0.75.

    - `hardware`: the rates the step time (`report.time`) is priced at. It also
        gives the host memory behind one device (`report.host_capacity`; on a GPU
        at most its share of JAX's pinned host cap, `report.host_limit`).
        `report.fits_host` compares `host_bytes` with that. The default is
        `eo.Hardware.of(target)`, or the backend's entry on a TPU or H100/H200.
        Pass one to change a figure, as in
        `dataclasses.replace(eo.Hardware.of("tpu-v5e"),
        host_memory_bytes=64 * 2**30)`.

    `target` and `hardware` are reserved. Bind a function argument of either name
    with `functools.partial`.

    **Returns:**

    A `MemoryReport` of the device and host footprints. Their parts come from
    `compiled.memory_analysis()`. Device memory is per chip on a TPU. Host memory is
    that of one host of a slice. For `train_step` and `filter_offload` objects it
    also counts parameters, optimizer state and saved residuals, by memory kind. For
    a TPU or GPU it estimates the step time (`report.time`, a `StepTime`). On the
    CPU backend the host/device split is an estimate (see `MemoryReport`). There is
    no step time there.

    **Raises:**

    - `ValueError` for a target it does not know, or a topology libtpu rejects. Also
        for arguments laid out on a mesh whose size is not the slice's chip count.
    - `DoesNotFit` when a chip's device memory is too small. A step over only the
        host's memory is reported, with `report.fits_host` `False`.
    - `DoesNotCompile` when the compiler rejects the step.

    !!! Example

        ```python
        batch = (tokens, targets)
        report = eo.memory_report(step, model, opt_state, *batch, target="tpu-v5e")
        print(report)                  # a table
        report.device_bytes, report.host_bytes
        ```

    !!! Example "A slice you do not have"

        ```python
        mesh = jax.sharding.AbstractMesh((256,), ("fsdp",))
        policy = eo.Policy.offload_all(shard="fsdp", batch="fsdp")
        model = eo.place(eqx.filter_eval_shape(Model, key=key), policy, mesh=mesh)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        tokens = jax.ShapeDtypeStruct((256, 2048), jnp.int32)
        report = eo.memory_report(
            step, model, opt_state, tokens, tokens, target="tpu-v5e:16x16"
        )
        report.device_bytes, report.host_bytes    # one chip
        report.host_bytes_per_host                # one host (4 chips)
        ```
    """
    where = where_of(target, (args, kwargs))
    on_target = where.mesh is not None
    platform = _targets.platform(where.name) if on_target else jax.default_backend()
    hardware = _step_time.hardware_for(target, platform, hardware)
    args, kwargs = abstract_arguments(fn, args, kwargs, where, platform)
    traced = _TracedJob(
        fn, where, platform, hardware, *_trace(fn, args, kwargs, where, platform)
    )
    report = _build(traced, *_compile(traced))
    if platform == "gpu":
        _check_host_kept(report, where)
        # (None on a GPU itself.) Only the device raises: over the host alone, it
        # is reported (`fits_host` False).
        if report.fits_device is False:
            sizes = (report.device_bytes, report.capacity or 0)
            message = (
                f"the program needs {size_text(sizes[0])} of device memory; "
                f"{where.name} has {size_text(sizes[1])} for it (the share JAX's "
                "allocator takes, `XLA_PYTHON_CLIENT_MEM_FRACTION`)"
            )
            raise _too_big(traced, message, sizes, report.host_bytes)
    return report


def _host_capacity(traced: "_TracedJob") -> tuple[int | None, HostLimit | None]:
    """Like `capacity`, known for a target only (on this backend, its own RAM), and
    what bounds it (`_targets.host_memory`)."""
    hardware, where = traced.hardware, traced.where
    if where.mesh is None or hardware is None:
        return None, None
    return _targets.host_memory(where.name, hardware.host_memory_bytes)


def _held(traced: "_TracedJob") -> Held:
    """What the step holds, by memory kind (per chip on a target): the compute
    copies apart from the rest of the optimizer state; of a train step, its
    micro-batches and the most its batch allows."""
    job, chips = traced.job, traced.where.chips or 1
    count = functools.partial(bytes_by_kind, per_chip=traced.where.mesh is not None)
    state, copies = split_copies(job.opt_state)
    return Held(
        arguments={k: count(v) for k, v in job.arguments.items()},
        params=None if job.params is None else count(job.params),
        opt_state=None if state is None else count(state),
        residuals=None if traced.saved is None else traced.saved.rows,
        copies=None if copies is None else count(copies),
        microbatches=microbatches_of(traced.fn, job.arguments.get("batch"), chips),
    )


class _TracedJob(NamedTuple):
    """A compile job traced and lowered, with what its trace says, and what it is
    compiled for."""

    fn: Any  # what `memory_report` was given
    where: Where
    platform: str  # the compiler's
    hardware: Hardware | None  # the rates its step time is priced at
    job: CompileJob
    lowered: Any  # a `jax.stages.Lowered`
    saved: Saved | None  # what it saves for the backward pass
    transfers: Any  # `_traffic.count`'s
    model_flops: float | None  # per device (`StepTime.model_flops`)


def _trace(fn: Any, args: tuple, kwargs: dict, where: Where, platform: str) -> tuple:
    """(`CompileJob`, lowered, saved, transfers, model FLOPs) of `fn(*args,
    **kwargs)`."""
    with _mesh.context(args, kwargs):
        make = _train_step_job if isinstance(fn, TrainStep) else _function_job
        job = make(fn, args, kwargs)
        traced = job.trace()
        lowered = traced.lower()
        saved = None if job.residuals is None else job.residuals()
        transfers = _traffic.count(traced.jaxpr, inputs(job), platform)
        # (Only a TPU or GPU step has a time to put them against.)
        gpu_or_tpu = platform in ("tpu", "gpu")
        flops = _model_flops(fn, args, where.chips or 1) if gpu_or_tpu else None
    return job, lowered, saved, transfers, flops


def _model_flops(fn: Any, args: tuple, devices: int) -> float | None:
    """A train step's model FLOPs per device (`StepTime.model_flops`): 3 × its
    loss's forward matmul FLOPs on one micro-batch, × the micro-batches, over
    `devices`. The loss is traced plainly, on its arguments' shapes (no memory
    kinds, no policy). `None` for anything else."""
    if not isinstance(fn, TrainStep):
        return None
    model, _, *batch = args
    plain = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if is_arraylike(x) else x,
        (model, one_microbatch(fn, batch)),
    )
    try:
        closed, *_ = eqx.filter_make_jaxpr(fn.loss_fn)(plain[0], *plain[1])
    except (TypeError, ValueError, NameError, RuntimeError):
        # The step traced this loss already (under its policy), so what fails
        # here needs the step around it (a streamed table: ValueError; a mesh
        # axis: NameError; a tracer's or sharding's check: TypeError,
        # RuntimeError). Then the report has no MFU, rather than no report.
        return None
    return 3 * _jaxpr_flops.matmul_flops(closed) * fn.microbatches / devices


def compile_options_of(fn: Any, platform: str) -> dict[str, Any] | None:
    """The compiler options the library compiles `fn` with for `platform`."""
    host_remat = isinstance(fn, TrainStep) and fn.policy.host_remat
    return _compiler.compile_options(platform, host_remat=host_remat)


def _compile(traced: _TracedJob) -> tuple[Any, Any]:
    """The compiled program and its memory analysis, or the error that says why
    there is none."""
    fn, job, where = traced.fn, traced.job, traced.where
    options = compile_options_of(fn, traced.platform)
    if options is None and isinstance(fn, TrainStep) and fn.policy.host_remat:
        raise ValueError(
            "`memory_report`: `Policy(host_remat=True)` is a TPU compiler "
            f"option, and this step is compiled for {where.name}. Compile it "
            "for a TPU (`target='tpu-v5e'`), or drop `host_remat`." + see(121)
        )
    what = DESCRIPTIONS[job.compiled]
    try:
        compiled = traced.lowered.compile(compiler_options=options)
        stats = compiled.memory_analysis()
    except jax.errors.JaxRuntimeError as e:
        if out_of_memory(e):
            raise _too_big(traced, str(e)) from e
        if where.mesh is not None and job.rejected is not None:
            message = f"`memory_report`: {what}, compiled for {where.name}"
            raise job.rejected(message, str(e), where.chip_mesh) from e
        raise DoesNotCompile(
            f"`memory_report`: the {where.name} compiler rejected {what}: {e}"
        ) from e
    if stats is None:
        raise ValueError(
            f"`memory_report`: the {where.name} compiler gives no memory analysis; "
            "try another `target=`."
        )
    return compiled, stats


# What a report keeps of what a step holds (`Held`'s other fields are for the advice
# of `DoesNotFit`).
_HELD = ("arguments", "params", "residuals")


def _build(traced: _TracedJob, compiled: Any, stats: Any) -> MemoryReport:
    """The report of a compiled program."""
    job, saved, transfers = traced.job, traced.saved, traced.transfers
    where, platform, hardware = traced.where, traced.platform, traced.hardware
    estimate = where.mesh is None and jax.default_backend() == "cpu"
    if estimate:
        device, host = split_estimate(stats, traced.lowered)
    else:
        device = {p: int(getattr(stats, f"{p}_size_in_bytes")) for p in PARTS}
        host = {p: int(getattr(stats, f"host_{p}_size_in_bytes")) for p in PARTS}
    # (Parsed once, for the traffic, the step time and host compute's temporaries.)
    accelerator = platform in ("tpu", "gpu")
    program = _costs.Program(compiled.as_text(), platform) if accelerator else None
    host_capacity, host_limit = _host_capacity(traced)
    held = _held(traced)
    count = functools.partial(bytes_by_kind, per_chip=where.mesh is not None)
    options = compile_options_of(traced.fn, platform)
    return MemoryReport(
        target=where.name,
        capacity=where.capacity,
        compiled=job.compiled,
        estimate=estimate,
        device=device,
        host=host,
        **{k: v for k, v in held._asdict().items() if k in _HELD},
        # (The report's optimizer state holds its compute copies; `held` splits
        # them off for `DoesNotFit`'s advice.)
        opt_state=None if job.opt_state is None else count(job.opt_state),
        largest_unnamed=None if saved is None else saved.largest_unnamed,
        chips=where.chips,
        chips_per_host=where.chips_per_host,
        host_capacity=host_capacity,
        host_limit=host_limit,
        transfers=transfers,
        compiled_transfers=None
        if program is None
        else _compiled_traffic.count(program, inputs(job), outputs(job), transfers),
        time=None
        if program is None or hardware is None
        else dataclasses.replace(
            _step_time.estimate(program, hardware, platform, options),
            model_flops=traced.model_flops,
        ),
        host_compute_temp=0 if program is None else _costs.host_temporaries(program),
    )


def _check_host_kept(report: MemoryReport, where: Where) -> None:
    """Refuses a GPU compile that counted host arguments as device memory.

    This is the trap `_compat.named_sharding` works around. It refuses, not misreports.
    """
    on_host = sum(host_total(by_kind) for by_kind in report.arguments.values())
    if on_host > 0 and report.host["argument"] == 0:
        raise kind_not_kept(
            where.name, f"host memory ({size_text(on_host)} of arguments)"
        )


def _too_big(
    traced: _TracedJob,
    message: str,
    sizes: tuple[int, int] | None = None,
    host_bytes: int | None = None,
) -> DoesNotFit:
    """The error for a program too big for the device memory it is compiled for
    (`_does_not_fit.too_big`), with the compiler's `message`, and what is known
    of the program without compiling it."""
    return too_big(
        message,
        traced.where,
        traced.job.compiled,
        policy_of(traced.fn),
        _held(traced),
        _host_capacity(traced),
        sizes,
        host_bytes,
    )
