"""One command for a real GPU: numerics, measured memory against the reports, step
times, the host link and the optimizer update on the host's CPU, recorded with
versions.

    python benchmarks/gpu_check.py --json benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --smoke --json /tmp/gpu_check.json   # on a CPU
    python benchmarks/gpu_check.py --deviceless                         # no GPU
    python benchmarks/gpu_check.py --overlap --calibrate --json out.json  # first

Run from the source tree (`PYTHONPATH=.` if eqx_offload is not installed) on the
machine's own JAX. Every part runs in a fresh process of its own, so that one
process's memory never counts in another's peak, and a part that fails is recorded
(with its error) rather than ending the run:

1. **Numerics** (tiny GPT-style model, `matmul` precision "highest"): three steps of
   `train_step` under every configuration below against plain Equinox + optax on the
   device (losses and parameters); `eo.verify` on each; every leaf still in its
   memory kind after the steps; the update on the host's CPU (`update="host"`) with
   AdamW behind `optax.clip_by_global_norm` (clipping every step) against the same
   optimizer under `Policy.none()`, losses to `rtol=1e-5`; and the pattern behind
   XLA's silent wrong-gradient fix for GPUs (openxla/xla#46231): a `jax.lax.scan`
   whose residuals are offloaded with `save_and_offload_only_these_names`, its
   gradient (the backward pass reads the residuals in reverse) against the same
   scan without offloading, for a forward and a reversed scan.
2. **Memory and time**, for each configuration at two sizes of the GPT-style model
   of `depth.py` (AdamW, fp32, batch 8 x 1024): the model and the optimizer state
   made on the host for host-resident leaves and copied into their memory kinds (the
   device never holds what the policy puts on the host); the measured peak device
   memory (`memory_stats()["peak_bytes_in_use"]`, before and after the steps), the
   report of the GPU's own compile (`memory_report(..., target=None)`), and the
   deviceless `gpu-h200` report compiled without a GPU (`--deviceless` writes
   `benchmarks/results/gpu_check_deviceless.json`, which is read here); the step
   time, median of 10 after 2 warm-up steps, next to the estimated one
   (`report.time` of the GPU's own compile, at the hardware table's rates and
   with the host link as measured in part 3, and of the deviceless compile) and
   their ratio; and whether the configurations come in the same order by measured
   and by estimated time (`time order`).
3. **The host link**: pinned host <-> device copies of 1 GiB, median of 5, in GB/s
   (measured before part 2, which prices its estimates with it).
4. **The host update alone**, at each size of part 2: AdamW's update of the model's
   parameters, gradients and state, all in pinned host memory, run on the host's
   CPU (`eoi.on_host`) in each form of JAX's host compute this JAX has (the
   `compute_on2` decorator and the `compute_on` context manager of jax 0.10), timed
   (median of 5 after one warm-up, state and parameters donated as the step donates
   them) against the same update on the device; the host memory it reads and writes
   per second; whether the forms give the same numbers (exactly) and the device the
   same with each leaf relative to its scale (a parameter through its update, to
   1e-4 plus one float32 unit of max |p_0| per step, as `tests/numerics.py`
   compares), a learning rate 1% off caught at ten times that; the element-by-element
   `rtol=1e-5` count of the H200 runs is still recorded.
5. **XLA's `xla_gpu_enable_pipelined_host_offloading`**: on a GPU any host-compute
   op turns XLA's latency-hiding scheduler off unless this flag (or optimization
   level O1) is set. Whether this jaxlib accepts it as a compile option (a made-up
   flag is refused, as the control), on this backend and, without a GPU, for a
   compile-only `gpu-h100`, and whether it changes the compiled host update; part 2
   times `offload_all` with the host update with it set (`XLA_FLAGS`).

Configurations: the four presets; `offload_all` with the streamed, the whole and the
host update (which of the first two is faster on a GPU had not been measured), and
with the host update and the flag of part 5; `offload_all` reading layers ahead
(`Policy(prefetch=1)`), at XLA:GPU's default limit of asynchronous host copies and
at 16 (`xla_gpu_experimental_parallel_async_compute_limit`, through `XLA_FLAGS`);
and `offload_all` applying the stacked layers' update in the next step's forward
scan (`Policy(update_timing="next_forward")`), at both limits. `--configs`
chooses some of them, for parts 1 and 2 alike; it also takes the configurations
at the batch people train (`at_scale.py`), not in the default set:
`"copies on device, k=4"` and `"copies on device, k=16"`, the masters and Adam
moments in pinned host memory, the bf16 compute copies and the gradient
accumulators on the device, the batch in 4 or 16 micro-batches. Their size is
`--sizes Llama-3-8B` (a Llama-3-8B-shaped decoder, 16 sequences of 4096 tokens;
its process raises JAX's pinned host cap, `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`, and
has 20 minutes; no host-update part), on an H200 (an H100 has not the memory):

    python benchmarks/gpu_check.py --sizes Llama-3-8B --steps 3 --budget 3000 \
        --configs "copies on device, k=4" "copies on device, k=16" --json out.json

Their numerics are not compared here (bf16 compute; `tests/test_accumulation.py`
checks k micro-batches against one batch). `--smoke` runs the same on a tiny
model with 3 timed steps, for CI on a CPU. A run of parts 2 and 4 starts only within
`--budget` seconds of the start (450 by default, for the whole to stay under 8
minutes); later ones are recorded as skipped.

**Programs.** With `--json PATH`, the compiled program of every configuration
timed in part 2, and of every deviceless compile (`--deviceless`: beside
`gpu_check_deviceless.json`), is saved as gzip-compressed text in the folder
`<PATH stem>.programs/` beside it; each row names its file (`"program"`, and
`"deviceless gpu-h200 program"`) from the results' folder.

**`--calibrate`** (about 1 minute on a GPU): pinned host -> device and device ->
host copies of 1 GiB inside one jitted program each, alone and both at once
(median of 5 after a warm-up); the copy beside an independent chain of bf16
matmuls (each alone, then both in one program: the share of the shorter hidden,
`(t_copy + t_matmul - t_both) / min(t_copy, t_matmul)`); the dense bf16 matmul
rate; the host update's memory rate (part 4 at the 0.2B size). It writes the
calibration file `eo.Hardware.from_measurements` reads (`--json`,
`calibration.json` by default): the format, the target it refines (from the
device kind: `gpu-h100`, `gpu-h200`; `cpu` on a CPU), the device, the date, the
versions, each rate in bytes or FLOP per second, and the raw timings under
`details`. It exits with an error if a rate could not be measured.

**`--overlap`** (3-4 minutes on a GPU; the first thing to run on one): what
overlaps on this machine, each pair timed alone and in one program, printed with
its overlap share: (a) a 1 GiB host -> device copy beside an independent ~40 ms
matmul chain; (b) the same bytes read as 8 dynamic slices of a host stack in a
loop at offset `i` (a scan over `arange`, as the library's piece and prefetching
loops; (b') a `fori_loop`'s counter; (b'') a scan over the host stack itself)
beside the loop's matmuls; (c) the same at the clamped
offset `min(i+1, n-1)`, which XLA:GPU cannot turn into copy-engine transfers;
(d) a host -> device copy beside an independent device -> host copy; and
`CUDA_DEVICE_MAX_CONNECTIONS`. The probes' on-device compiles are dumped too
(`<stem>.programs/xla-dump-probes/`: `*thunk_sequence.txt` says which reads
became memcpys and which kernels). Then the 0.2B step of `offload_all` with the
streamed update as the library runs it, with `Policy(prefetch=1)`, and with
`xla_gpu_enable_pipelined_host_offloading` (`--configs` chooses others; the
first is the reference), each in its own process, its parameters and losses
after the 2 warm-up steps checked against the reference's, beside the time
measured on an H200 before (`results/gpu_check_h200_gpt02b.json`); and one 0.9B
step of the reference under `jax.profiler.trace`, its profile read back
(`.xplane.pb` through `jax.profiler.ProfileData`, else the trace viewer's
`.trace.json.gz`): the share of copy time that overlaps kernels, and of host ->
device time that overlaps device -> host. A part that fails is recorded with its
error; none starts after `--budget` seconds (240 by default). With both options,
`--overlap` runs first and each writes its own file (`<stem>.overlap.json`,
`<stem>.calibrate.json`). With `--smoke`, both run at tiny sizes on a CPU.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import _gpu_probes as probes
from _compiles import compiles


HERE = Path(__file__).parent
DEVICELESS = HERE / "results" / "gpu_check_deviceless.json"
MARK = "GPU_CHECK_RESULT "
CONFIGS: tuple[str, ...] = (
    "none",
    "remat",
    "offload_residuals",
    "offload_all, streamed update",
    "offload_all, whole update",
    "offload_all, host update",
    "offload_all, host update, pipelined host offloading",
    "offload_all, streamed update, prefetch",
    "offload_all, streamed update, prefetch, async limit 16",
    "offload_all, streamed update, next_forward",
    "offload_all, streamed update, next_forward, async limit 16",
)
# XLA's flag that keeps the GPU's latency-hiding scheduler on in a program with host
# compute (and pipelines host transfers across loop iterations); set, for the
# configuration that names it, through `XLA_FLAGS` in its process.
FLAG = "xla_gpu_enable_pipelined_host_offloading"
# XLA:GPU's cap on asynchronous host copies in flight (2 by default): raised, the
# prefetching scans' reads of a layer overlap its compute (docs/step-time.md).
ASYNC_LIMIT = "xla_gpu_experimental_parallel_async_compute_limit"
FLAGGED = {
    "offload_all, host update, pipelined host offloading": f"{FLAG}=true",
    "offload_all, streamed update, prefetch, async limit 16": f"{ASYNC_LIMIT}=16",
    "offload_all, streamed update, next_forward, async limit 16": f"{ASYNC_LIMIT}=16",
    # (`--overlap` only)
    "offload_all, streamed update, pipelined host offloading": f"{FLAG}=true",
}
# `--overlap`'s step: the streamed update as the library runs it (the reference),
# reading layers ahead, and with XLA's pipelining of host transfers.
OVERLAP_CONFIGS: tuple[str, ...] = (
    "offload_all, streamed update",
    "offload_all, streamed update, prefetch",
    "offload_all, streamed update, pipelined host offloading",
)
# Issue 54's placement at the batch people train (`at_scale.py`): masters and Adam
# moments on the host, bf16 compute copies and gradient accumulators on the device,
# k micro-batches; not in the default run (an 8B step takes tens of seconds).
AT_SCALE_CONFIGS: tuple[str, ...] = (
    "copies on device, k=4",
    "copies on device, k=16",
)
# name -> (vocab, dim, layers, batch, seq)
SIZES = {
    "GPT 0.2B": (32768, 1024, 12, 8, 1024),
    "GPT 0.9B": (32768, 2048, 24, 8, 1024),
}
# (the same, and the decoder shape of `models/shapes.py` they resize), run only when
# named (`--sizes Llama-3-8B`): 16 sequences of 4096 tokens, 64K tokens an update.
AT_SCALE_SIZES = {"Llama-3-8B": (128256, 4096, 32, 16, 4096, "LLAMA_3_8B")}
# A size's host memory, pinned: over JAX's 64 GB default on a GPU for the 8B model.
HOST_LIMIT = {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "120"}
SMOKE_SIZES = {"smoke": (256, 32, 2, 2, 16)}
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt")
PACKAGES += ("jax-cuda13-plugin", "jax-cuda13-pjrt", "equinox", "optax", "jaxtyping")
PACKAGES += ("numpy",)


# --- In the child processes -------------------------------------------------------


def _policy(config: str):
    import jax.numpy as jnp

    import eqx_offload as eo

    if config in AT_SCALE_CONFIGS:
        return eo.Policy.remat(
            params="pinned_host",
            opt_state={"**": "pinned_host", "copies:**": "device"},
            compute_dtype=jnp.bfloat16,
        )
    if config.startswith("offload_all"):
        parts = config.removeprefix("offload_all, ").split(", ")
        update = parts[0].removesuffix(" update")
        prefetch = 1 if "prefetch" in parts else 0
        timing = "next_forward" if "next_forward" in parts else "now"
        return eo.Policy.offload_all(
            update=update, prefetch=prefetch, update_timing=timing
        )
    return getattr(eo.Policy, config)()


def _model(vocab: int, dim: int, layers: int, *shape: str):
    """The abstract model of a size: the GPT-style model, or the decoder `shape`
    names (`models/shapes.py`) at this vocabulary, width and depth."""
    import equinox as eqx
    import jax
    from models import decoder, shapes
    from models.gpt import GPT

    if shape:
        resized = getattr(shapes, shape[0])._replace(
            vocab=vocab, dim=dim, layers=layers
        )
        return eqx.filter_eval_shape(decoder.Decoder, resized, key=jax.random.key(0))
    return eqx.filter_eval_shape(GPT, vocab, dim, layers, key=jax.random.key(0))


def _step(config: str, size: tuple) -> tuple[Any, Any, Any, Any]:
    """The step of `config` at `size`, its abstract model and optimizer state (in
    their memory kinds) and the tokens' shape."""
    import jax
    import jax.numpy as jnp
    import optax
    from models.decoder import chunked_loss
    from models.gpt import loss_fn

    import eqx_offload as eo

    vocab, dim, layers, batch, seq, *shape = size
    policy = _policy(config)
    optimizer = optax.adamw(1e-4)
    model = eo.place(_model(vocab, dim, layers, *shape), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    k = int(config.split("k=")[1]) if config in AT_SCALE_CONFIGS else 1
    loss = chunked_loss if shape else loss_fn
    step = eo.train_step(loss, optimizer, policy, microbatches=k)
    return step, model, opt_state, jax.ShapeDtypeStruct((batch, seq), jnp.int32)


def _materialise(abstract: Any, seed: int | None) -> Any:
    """Arrays for the `jax.ShapeDtypeStruct` leaves of `abstract`, made on the host
    with NumPy and copied straight into each leaf's sharding (memory kind included):
    small normal values for floating leaves, zeros for integers, and zeros
    everywhere without a `seed` (Adam's own initial state)."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed or 0)

    def make(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        if seed is None or not np.issubdtype(x.dtype, np.floating):
            value = np.zeros(x.shape, x.dtype)
        else:
            value = (rng.standard_normal(x.shape, np.float32) * 0.02).astype(x.dtype)
        return jax.device_put(value, x.sharding)

    return jax.tree.map(make, abstract)


def _peak() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if stats is None else int(stats.get("peak_bytes_in_use", 0))


def _host_compute(step: Any, *args: Any) -> bool:
    """Whether `step`'s program computes on the host's CPU (JAX's `compute_on`,
    `compute_on2`): the mark of `update="host"` where, on a CPU, the numbers alone
    cannot tell it from an update on the device."""
    import equinox as eqx

    closed = eqx.filter_make_jaxpr(step)(*args)[0]
    return "compute_on" in str(closed)


def _link(report: Any, measured: dict[str, Any]) -> Any:
    """`report`'s hardware with the host link as measured (`bandwidth`), or None."""
    import dataclasses

    to_device = measured.get("pinned host -> device GB/s")
    to_host = measured.get("device -> pinned host GB/s")
    if report.time is None or not to_device or not to_host:
        return None
    return dataclasses.replace(
        report.time.hardware,
        host_to_device_bytes_per_second=to_device * 1e9,
        device_to_host_bytes_per_second=to_host * 1e9,
    )


def _setup(config: str, size: tuple) -> tuple[Any, Any, Any, Any]:
    """The step of `config` and its model, optimizer state and tokens at `size`."""
    import jax

    step, abstract, state, tokens = _step(config, size)
    model = _materialise(abstract, seed=0)
    opt_state = _materialise(state, seed=None)
    tokens = jax.random.randint(jax.random.key(1), tokens.shape, 0, size[0])
    return step, model, opt_state, tokens


def measure(
    config: str,
    size: tuple[int, ...],
    steps: int,
    link: dict[str, Any],
    program: str = "",
    check: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One configuration at one size: memory measured and reported, step time
    measured and estimated (`report.time`: at the hardware table's rates, and with
    the host link `link` measured by `bandwidth`); the program timed saved to
    `program` (gzip text), if given; the parameters after the two warm-up steps
    saved or compared (`check`, `probes.parameters`), if given."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqx_offload as eo

    step, model, opt_state, tokens = _setup(config, size)
    out: dict[str, Any] = {"peak bytes after init": _peak()}
    out["host compute"] = _host_compute(step, model, opt_state, tokens, tokens)
    report = eo.memory_report(step, model, opt_state, tokens, tokens)
    out["report device bytes"] = report.device_bytes
    out["report host bytes"] = report.host_bytes
    out["report estimate"] = report.estimate
    out["estimated step s"] = None if report.time is None else report.time.seconds
    out["estimate bound"] = None if report.time is None else report.time.bound
    hardware = _link(report, link)
    if hardware is not None:
        again = eo.memory_report(
            step, model, opt_state, tokens, tokens, hardware=hardware
        )
        assert again.time is not None
        out["estimated step s, measured link"] = again.time.seconds
    times, losses = [], []
    for i in range(2 + steps):
        start = time.perf_counter()
        model, opt_state, loss, _ = step(model, opt_state, tokens, tokens)
        jax.block_until_ready((model, opt_state, loss))
        if i >= 2:
            times.append(time.perf_counter() - start)
        else:
            losses.append(float(jnp.asarray(loss)))
        if i == 1 and check:
            out["parameters after 2 steps"] = probes.parameters(model, losses, check)
    out["peak bytes after steps"] = _peak()
    if program:  # (the program just run: compiled again from JAX's cache)
        traced = step.trace(model, opt_state, tokens, tokens)
        out["program"] = probes.save_program(
            traced.lower().compile().as_text(), program
        )
    out["step s median"] = statistics.median(times)
    for key in ("estimated step s", "estimated step s, measured link"):
        if out.get(key):
            out[key.replace("estimated step s", "estimate / measured")] = (
                out[key] / out["step s median"]
            )
    out["step s min"] = min(times)
    out["loss"] = float(jnp.asarray(loss))
    kinds = {
        x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    }
    out["parameter memory kinds"] = sorted(str(k) for k in kinds)
    return out


def deviceless(
    configs: list[str], sizes: dict[str, tuple], programs: str = ""
) -> list[dict]:
    """The `gpu-h200` reports of every configuration and size, compiled without a
    GPU (run with `JAX_PLATFORMS=cpu` and JAX's CUDA plugin); each step's compiled
    program saved under `programs` (gzip text), if given."""
    import jax

    import eqx_offload as eo

    rows = []
    for name, size in sizes.items():
        for config in configs:
            step, model, opt_state, tokens = _step(config, tuple(size))
            with compiles() as texts:
                r = eo.memory_report(
                    step, model, opt_state, tokens, tokens, target="gpu-h200"
                )
            row = {
                "size": name,
                "config": config,
                "device bytes": r.device_bytes,
                "host bytes": r.host_bytes,
                "estimated step s": None if r.time is None else r.time.seconds,
                "jax": jax.__version__,
                "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            }
            if programs:  # (the step's: compiled last)
                file = f"deviceless-gpu-h200-{probes.slug(name)}-{probes.slug(config)}"
                path = Path(programs) / f"{file}.hlo.gz"
                row["program"] = probes.save_program(texts[-1], path)
            rows.append(row)
    return rows


def numerics(configs: list[str]) -> dict[str, Any]:
    """Every configuration against plain training; `eo.verify`; placements; the
    offloaded-scan gradient (openxla/xla#46231); matmuls at "highest" precision."""
    import jax

    with jax.default_matmul_precision("highest"):
        return _numerics(configs)


def _numerics(configs: list[str]) -> dict[str, Any]:
    import equinox as eqx
    import jax
    import optax
    from models.gpt import GPT, loss_fn

    import eqx_offload as eo

    optimizer = optax.adamw(1e-2)
    tokens = jax.random.randint(jax.random.key(1), (3, 4, 8), 0, 64)

    def arrays(tree: Any) -> list:
        return jax.tree.leaves(eqx.filter(tree, eqx.is_array))

    # The reference: plain Equinox + optax, everything on the device.
    @eqx.filter_jit
    def plain_step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, x)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    ref = GPT(64, 32, 3, key=jax.random.key(0))
    ref_state, ref_losses = optimizer.init(eqx.filter(ref, eqx.is_inexact_array)), []
    for x in tokens:
        ref, ref_state, loss = plain_step(ref, ref_state, x)
        ref_losses.append(float(loss))
    ref_leaves = arrays(ref)

    out: dict[str, Any] = {"presets": {}}
    for config in configs:
        if config in FLAGGED or config in AT_SCALE_CONFIGS:
            # The same policy as another configuration's; bf16 compute at scale
            # (tests/test_accumulation.py checks k micro-batches against one batch).
            continue
        row: dict[str, Any] = {}
        try:
            policy = _policy(config)
            # A fresh model each time: the step donates it.
            placed = eo.place(GPT(64, 32, 3, key=jax.random.key(0)), policy)
            kinds = [x.sharding.memory_kind for x in arrays(placed)]
            opt_state = eo.init_opt_state(optimizer, placed, policy)
            x = tokens[0]
            step = eo.train_step(loss_fn, optimizer, policy)
            try:
                report = eo.verify(step, placed, opt_state, x, x)
                row["verify passed"] = report.passed
            except Exception as e:  # recorded; the steps are still compared
                row["verify passed"], row["verify error"] = False, _error(e)
            losses, ours = [], placed
            for x in tokens:
                ours, opt_state, loss, _ = step(ours, opt_state, x, x)
                losses.append(float(loss))
            # (`update_timing="next_forward"`: the last update is still pending)
            ours, opt_state = eo.apply_pending(ours, opt_state, optimizer, policy)
            leaves = arrays(ours)
            row["max |loss - plain|"] = max(
                abs(a - b) for a, b in zip(losses, ref_losses)
            )
            row["max |params - plain|"] = _max_difference(leaves, ref_leaves)
            row["placements kept"] = kinds == [x.sharding.memory_kind for x in leaves]
            row["passed"] = (
                row["verify passed"]
                and row["placements kept"]
                and row["max |loss - plain|"] <= 1e-4
                and row["max |params - plain|"] <= 1e-4
            )
        except Exception as e:
            row = {"passed": False, "error": _error(e)}
        out["presets"][config] = row
    out[HOST_NUMERICS] = _host_numerics(tokens)
    out["offloaded scan (openxla/xla#46231)"] = _offloaded_scan()
    out["passed"] = all(
        all(r["passed"] for r in out[part].values())
        for part in ("presets", HOST_NUMERICS, "offloaded scan (openxla/xla#46231)")
    )
    return out


def _max_difference(xs: list, ys: list) -> float:
    """The largest `|x - y|` over the leaves, in float32 with NumPy on the host (the
    same numbers as on the device, without a program compiled for each leaf's
    shape)."""
    import jax
    import numpy as np

    return max(
        float(np.max(np.abs(np.asarray(jax.device_get(x)) - np.asarray(y))))
        for x, y in zip(xs, ys, strict=True)
    )


HOST_NUMERICS = "host update, AdamW + clip_by_global_norm"
HOST_POLICIES = {
    "offload_all(update='host')": {"update": "host"},
    "remat(opt_state='pinned_host', update='host')": {
        "opt_state": "pinned_host",
        "update": "host",
    },
}


def _host_numerics(tokens: Any) -> dict[str, Any]:
    """The update on the host's CPU (`update="host"`), with parameters on the host
    and on the device, against `Policy.none()`'s step with the same optimizer: AdamW
    behind a global-norm clip that clips every step (so that every new leaf depends
    on every gradient)."""
    import equinox as eqx
    import jax
    import optax
    from models.gpt import GPT, loss_fn

    import eqx_offload as eo

    clip = 0.1
    optimizer = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(1e-2))

    def arrays(tree: Any) -> list:
        return jax.tree.leaves(eqx.filter(tree, eqx.is_array))

    def train(policy: Any) -> tuple[Any, list[float], list[float], bool]:
        placed = eo.place(GPT(64, 32, 3, key=jax.random.key(0)), policy)
        kinds = [x.sharding.memory_kind for x in arrays(placed)]
        opt_state = eo.init_opt_state(optimizer, placed, policy)
        step = eo.train_step(loss_fn, optimizer, policy, metrics=True)
        losses, norms = [], []
        for x in tokens:
            placed, opt_state, loss, metrics = step(placed, opt_state, x, x)
            assert metrics is not None
            losses.append(float(loss))
            norms.append(float(metrics["grad_norm"]))
        kept = kinds == [x.sharding.memory_kind for x in arrays(placed)]
        return placed, losses, norms, kept

    ref, ref_losses, ref_norms, _ = train(eo.Policy.none())
    out: dict[str, Any] = {}
    for name, fields in HOST_POLICIES.items():
        row: dict[str, Any] = {}
        try:
            if name.startswith("offload_all"):
                policy = eo.Policy.offload_all(**fields)
            else:
                policy = eo.Policy.remat(**fields)
            placed = eo.place(GPT(64, 32, 3, key=jax.random.key(0)), policy)
            opt_state = eo.init_opt_state(optimizer, placed, policy)
            x = tokens[0]
            step = eo.train_step(loss_fn, optimizer, policy)
            try:
                report = eo.verify(step, placed, opt_state, x, x)
                row["verify passed"] = report.passed
            except Exception as e:  # recorded; the steps are still compared
                row["verify passed"], row["verify error"] = False, _error(e)
            row["host compute"] = _host_compute(step, placed, opt_state, x, x)
            ours, losses, norms, row["placements kept"] = train(policy)
            row["smallest gradient norm"] = min(ref_norms)
            row["clipped every step"] = min(ref_norms) > clip
            row["max |loss - plain| / |plain|"] = max(
                abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)
            )
            row["max |params - plain|"] = _max_difference(arrays(ours), arrays(ref))
            row["passed"] = (
                row["verify passed"]
                and row["host compute"]
                and row["placements kept"]
                and row["clipped every step"]
                and row["max |loss - plain| / |plain|"] <= 1e-5
                and row["max |params - plain|"] <= 1e-4
            )
        except Exception as e:
            row = {"passed": False, "error": _error(e)}
        out[name] = row
    return out


def _offloaded_scan() -> dict[str, Any]:
    """`jax.checkpoint` with `save_and_offload_only_these_names` over a scan: the
    gradient with the carry offloaded against the same without offloading."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.ad_checkpoint import checkpoint_name

    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["carry"],
        offload_src="device",
        offload_dst="pinned_host",
    )

    def layer(carry, w):
        carry = checkpoint_name(carry, "carry")
        return jnp.tanh(carry @ w), None

    keys = jax.random.split(jax.random.key(2), 2)
    ws = jax.random.normal(keys[0], (16, 64, 64)) / 8
    x = jax.random.normal(keys[1], (32, 64))
    out = {}
    for reverse in (False, True):

        def loss(ws, x, policy):
            body = jax.checkpoint(layer, policy=policy)
            y, _ = jax.lax.scan(body, x, ws, reverse=reverse)
            return jnp.sum(y**2)

        plain = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
        ref = plain(ws, x, jax.checkpoint_policies.nothing_saveable)
        got = plain(ws, x, offload)
        diff = _max_difference(got, ref)
        scale = max(float(np.max(np.abs(np.asarray(b)))) for b in ref)
        out["reversed scan" if reverse else "scan"] = {
            "max |grad - plain|": diff,
            "scale": scale,
            "passed": diff <= 1e-4 * scale,
        }
    return out


def _host_update_fn(optimizer: Any, form: str | None) -> Any:
    """`(grads, state, params) -> (params, state)`, the optimizer's update applied,
    jitted with the state and parameters donated: on the host's CPU in `form` of
    JAX's host compute (`eoi.on_host`), its inputs and outputs in host memory;
    or, with `form=None`, on the device."""
    import jax
    import optax

    import eqx_offload.internal as eoi

    def update(grads: Any, state: Any, params: Any) -> Any:
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    if form is None:
        return jax.jit(update, donate_argnums=(1, 2))

    def on_host(grads: Any, state: Any, params: Any) -> Any:
        flat, tree = jax.tree.flatten((grads, state, params))
        out_tree = jax.tree.structure(jax.eval_shape(update, grads, state, params))

        def compute(*xs: Any) -> list:
            # Typed as device memory inside (as `_update/_host.py` does): JAX 0.10
            # refuses to add a host value to one `zeros_like` makes.
            xs = tuple(jax.device_put(x, jax.memory.Space.Device) for x in xs)
            out = update(*jax.tree.unflatten(tree, xs))
            return [
                jax.device_put(y, jax.memory.Space.Host) for y in jax.tree.leaves(out)
            ]

        outs = eoi.on_host(compute, form)(*flat)  # pyright: ignore[reportArgumentType]
        return jax.tree.unflatten(out_tree, outs)

    return jax.jit(on_host, donate_argnums=(1, 2))


def host_update(size: tuple[int, ...], steps: int) -> dict[str, Any]:
    """AdamW's update of the float leaves of the GPT-style model of `size`, on the
    host's CPU in each form of host compute and on the device: median seconds,
    the host memory read and written per second, and whether the results agree.

    The host and the device agree if each leaf does relative to its scale, as
    `tests/numerics.py` compares (`F32 = 1e-4`): a parameter through its update
    `p_n - p_0`, within `1e-4` of the device's largest plus one float32 unit of
    `max |p_0|` per step; a moment within `1e-4` of its largest; the step count
    exactly. Not element by element: Adam's bias correction `1 - b2**t` (0.001 at
    the first step) turns one unit in the last place of `b2**t`, which the GPU's
    `pow` and the CPU's may round apart, into `6e-5 / t` of `1 - b2**t`: every
    element's update moves by about `3e-5 / t` of itself. Over `1 + steps` steps
    that is `3e-5 * H / (1 + steps)` of the update's scale (`H`, the harmonic
    sum: `1.2e-5` at 6 steps, `4.9e-5` for four units), inside `1e-4`; but a
    parameter that the updates bring near zero is off by more than `1e-5` of
    itself (the check of the H200 runs, `rtol=1e-5` element by element, still
    recorded as the number of elements beyond it). A negative control, the device
    update with a learning rate 1% larger, must land at least ten times beyond
    the tolerance."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import eqx_offload.internal as eoi

    vocab, dim, layers = size[:3]
    leaves = [
        x
        for x in jax.tree.leaves(_model(vocab, dim, layers))
        if isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.floating)
    ]
    optimizer = optax.adamw(1e-3)
    device = jax.devices()[0]
    kinds = {
        "pinned_host": jax.sharding.SingleDeviceSharding(
            device, memory_kind="pinned_host"
        ),
        "device": jax.sharding.SingleDeviceSharding(device, memory_kind="device"),
    }
    keys = jax.random.split(jax.random.key(3), len(leaves))

    def inputs(kind: str) -> tuple[list, Any, list]:
        """The same gradients, parameters and (zero) state each time, in `kind`."""
        to = kinds[kind]
        grads = [
            jax.device_put(jax.random.normal(k, x.shape, x.dtype) * 1e-3, to)
            for k, x in zip(keys, leaves)
        ]
        params = [
            jax.device_put(jax.random.normal(k, x.shape, x.dtype) * 2e-2, to)
            for k, x in zip(jnp.flip(keys, 0), leaves)
        ]
        state = jax.tree.map(
            lambda x: jax.device_put(np.zeros(x.shape, x.dtype), to),
            jax.eval_shape(optimizer.init, params),
        )
        return grads, state, params

    def run(form: str | None, optimizer: Any = optimizer) -> tuple[list[float], Any]:
        fn = _host_update_fn(optimizer, form)
        grads, state, params = inputs("device" if form is None else "pinned_host")
        times = []
        for i in range(1 + steps):
            start = time.perf_counter()
            params, state = jax.block_until_ready(fn(grads, state, params))
            if i:
                times.append(time.perf_counter() - start)
        return times, (params, state)

    n = sum(x.size for x in leaves)
    # Read: gradient, parameter, both moments; written: parameter, both moments.
    nbytes = sum(x.size * x.dtype.itemsize for x in leaves) * 7
    out: dict[str, Any] = {"parameters": n, "host memory bytes per update": nbytes}
    out["forms"] = {}
    first: Any = None
    for form in eoi.host_forms():
        row: dict[str, Any] = {}
        try:
            times, result = run(form)
            row["update s median"] = statistics.median(times)
            row["update s min"] = min(times)
            row["host memory GB/s"] = nbytes / row["update s median"] / 1e9
            kinds_out = {x.sharding.memory_kind for x in jax.tree.leaves(result)}
            row["memory kinds after"] = sorted(str(k) for k in kinds_out)
            if first is None:
                first = result
            else:
                row["max |update - first form's|"] = max(
                    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(first))
                )
        except Exception as e:
            row = {"error": _error(e)}
        out["forms"][form] = row

    def agreement(host: Any, device: Any, control: Any) -> dict[str, Any]:
        """`host`'s results against `device`'s, each leaf by its scale (the
        docstring), and `control`'s (a wrong learning rate) against `device`'s."""
        tol, eps = 1e-4, float(np.finfo(np.float32).eps)  # (eps: 2 ** -23)
        origin = [np.asarray(p, np.float64) for p in inputs("device")[2]]
        worst = {"parameter updates": 0.0, "optimizer state": 0.0, "control": 0.0}
        beyond, exact = 0, True  # (elements beyond rtol 1e-5; step counts equal)

        def excess(x: Any, ref: Any, origin: Any = None) -> float:
            """max |x - ref| over what the tolerance allows (above 1: beyond)."""
            x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
            if origin is None:
                allowed = tol * np.max(np.abs(ref))
            else:
                allowed = tol * np.max(np.abs(ref - origin))
                allowed += (1 + steps) * eps * np.max(np.abs(origin))
            return float(np.max(np.abs(x - ref)) / max(allowed, 1e-30))

        def note(key: str, value: float) -> None:
            worst[key] = max(worst[key], value)

        for h, d, c, o in zip(host[0], device[0], control[0], origin, strict=True):
            note("parameter updates", excess(h, d, o))
            note("control", excess(c, d, o))
            beyond += int(np.sum(~np.isclose(h, d, rtol=1e-5, atol=1e-12)))
        states = zip(jax.tree.leaves(host[1]), jax.tree.leaves(device[1]), strict=True)
        for h, d in states:
            h, d = np.asarray(h), np.asarray(d)
            if not np.issubdtype(d.dtype, np.floating):
                exact = exact and bool(np.array_equal(h, d))
                continue
            note("optimizer state", excess(h, d))
            beyond += int(np.sum(~np.isclose(h, d, rtol=1e-5, atol=1e-12)))
        control = worst.pop("control")
        return {
            "host agrees with device (leaf scale, tol 1e-4)": (
                exact and max(worst.values()) <= 1
            ),
            "host - device, max over the tolerance": worst,
            "control (learning rate x 1.01) over the tolerance": control,
            "control caught (>= 10x the tolerance)": control >= 10,
            "elements beyond rtol 1e-5 (the check before)": beyond,
            "host agrees with device (rtol 1e-5)": beyond == 0,
        }

    try:
        times, on_device = run(None)
        out["device update s median"] = statistics.median(times)
        if first is not None:
            host = out["forms"][eoi.host_forms()[0]]["update s median"]
            out["host / device"] = host / out["device update s median"]
            _, control = run(None, optax.adamw(1.01e-3))
            out.update(agreement(first, on_device, control))
    except Exception as e:
        out["device error"] = _error(e)
    forms = out["forms"].values()
    out["forms agree"] = len(out["forms"]) > 0 and all(
        "error" not in r and r.get("max |update - first form's|", 0.0) == 0.0
        for r in forms
    )
    out["passed"] = (
        out["forms agree"]
        and all(r["memory kinds after"] == ["pinned_host"] for r in forms)
        and out.get("host agrees with device (leaf scale, tol 1e-4)", False)
        and out.get("control caught (>= 10x the tolerance)", False)
    )
    return out


def flag() -> dict[str, Any]:
    """Whether this jaxlib takes `FLAG` as a compile option of a program with host
    compute (a made-up flag is refused, the control): on this backend, and, on a
    CPU, for a compile-only `gpu-h100` (JAX's CUDA plugin), with whether it changes
    the compiled program there."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec

    import eqx_offload.internal as eoi

    optimizer = optax.adamw(1e-3)
    shapes = [(64, 32), (2, 32, 128), (32,)]

    def compile_for(sharding: Any, options: dict[str, Any]) -> Any:
        params = [
            jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes
        ]
        state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(optimizer.init, params),
        )
        fn = _host_update_fn(optimizer, eoi.host_forms()[0])
        lowered = fn.trace(params, state, params).lower()
        return lowered.compile(compiler_options=options)

    def accepts(sharding: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        texts = {}
        for label, options in (
            ("without", {}),
            ("accepted", {FLAG: True}),
            ("made-up flag accepted", {FLAG + "_made_up": True}),
        ):
            try:
                texts[label] = compile_for(sharding, options).as_text()
                out[label] = True
            except Exception as e:
                out[label] = False
                out[f"{label}: error"] = _error(e)[:300]
        out.pop("without")
        if len(texts) >= 2:
            out["host compute in the program"] = "HostExecute" in texts["without"]
            out["program changed by the flag"] = texts["without"] != texts["accepted"]
        return out

    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    result: dict[str, Any] = {"flag": FLAG, "jaxlib": jax.lib.__version__}
    result[jax.default_backend()] = accepts(host)
    if jax.default_backend() == "cpu":
        try:
            import eqx_offload.internal as eoi

            mesh = eoi.chip_mesh("gpu-h100")
            sharding = eoi.named_sharding(mesh, PartitionSpec(), "pinned_host")
            result["gpu-h100 (compile-only)"] = accepts(sharding)
        except Exception as e:
            result["gpu-h100 (compile-only)"] = {"error": _error(e)}
    return result


def bandwidth(mib: int) -> dict[str, Any]:
    """Pinned host <-> device copies of `mib` MiB: median of 5, GB/s."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    x = jax.device_put(jnp.ones((mib, 2**18), jnp.float32), on_device)
    out: dict[str, Any] = {"bytes": x.nbytes}
    for label, to, start in (
        ("device -> pinned host GB/s", on_host, x),
        ("pinned host -> device GB/s", on_device, jax.device_put(x, on_host)),
    ):
        jax.block_until_ready(jax.device_put(start, to))  # warm-up
        times = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(jax.device_put(start, to))
            times.append(time.perf_counter() - t)
        out[label] = x.nbytes / statistics.median(times) / 1e9
    return out


def profile(config: str, size: tuple[int, ...], directory: str) -> dict[str, Any]:
    """One step of `config` at `size` under `jax.profiler` (`probes.profile`)."""
    import jax

    step, model, opt_state, tokens = _setup(config, size)

    def once(state: tuple[Any, Any]) -> tuple[Any, Any]:
        model, opt_state, loss, _ = step(*state, tokens, tokens)
        jax.block_until_ready((model, opt_state, loss))
        return model, opt_state

    return probes.profile(once, (model, opt_state), directory)


def environment() -> dict[str, Any]:
    import jax

    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device": devices[0].device_kind,
        "devices": len(devices),
        "memories": [str(m.kind) for m in devices[0].addressable_memories()],
        "jax_environment": jax.print_environment_info(return_string=True),
    }


def _error(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    kind, *rest = args.child
    if kind == "measure":
        link = json.loads(rest[2]) if len(rest) > 2 else {}
        program = rest[3] if len(rest) > 3 else ""
        check = json.loads(rest[4]) if len(rest) > 4 else None
        size = tuple(json.loads(rest[1]))
        result: Any = measure(rest[0], size, args.steps, link, program, check)
    elif kind == "numerics":
        chosen = json.loads(rest[0]) if rest else [*CONFIGS]
        result = {"numerics": numerics(chosen), **environment()}
    elif kind == "bandwidth":
        result = bandwidth(int(rest[0]))
    elif kind == "host update":
        steps = int(rest[1]) if len(rest) > 1 else args.steps
        result = host_update(tuple(json.loads(rest[0])), steps)
    elif kind == "flag":
        result = flag()
    elif kind == "deviceless":
        configs: list[str] = json.loads(rest[1]) if len(rest) > 1 else [*CONFIGS]
        result = deviceless(configs, json.loads(rest[0]), *rest[2:3])
    elif kind == "link":
        result = probes.link(**json.loads(rest[0]))
    elif kind == "profile":
        result = profile(rest[0], tuple(json.loads(rest[1])), rest[2])
    else:
        raise ValueError(f"`gpu_check.py --child {kind}`: unknown part")
    print(MARK + json.dumps(result), flush=True)


# --- In the parent process ----------------------------------------------------------


def run_child(
    argv: list[str], timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs one part in a fresh process; its result, or what went wrong."""
    start = time.perf_counter()
    command = [sys.executable, str(Path(__file__).resolve()), "--child", *argv]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "seconds": timeout}
    seconds = round(time.perf_counter() - start, 1)
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            return {"result": json.loads(line[len(MARK) :]), "seconds": seconds}
    tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
    return {"error": "\n".join(tail), "seconds": seconds}


def _flag_env(config: str) -> dict[str, str]:
    """The environment `config` runs in: `XLA_FLAGS` with its flag set, if it names
    one."""
    if config not in FLAGGED:
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags} --{FLAGGED[config]}".strip()}


def deviceless_rows(
    sizes: dict[str, tuple],
    configs: list[str],
    timeout: float,
    json_path: Path | None = None,
) -> dict[str, Any]:
    """The deviceless part (`JAX_PLATFORMS=cpu`): one process for the
    configurations without a flag, one for each with `XLA_FLAGS` naming its flag;
    their rows together, or the first error. The programs are saved beside
    `json_path`, if given, and each row names its file from there."""
    plain = [c for c in configs if c not in FLAGGED]
    groups = [(plain, {})] if plain else []
    groups += [([c], _flag_env(c)) for c in configs if c in FLAGGED]
    rows: list[dict[str, Any]] = []
    for group, env in groups:
        argv = ["deviceless", json.dumps(sizes), json.dumps(group)]
        if json_path is not None:
            argv.append(str(probes.programs_folder(json_path)))
        part = run_child(argv, timeout, {"JAX_PLATFORMS": "cpu", **env})
        if "error" in part:
            return part
        rows += part["result"]
    for row in rows:
        if json_path is not None and row.get("program"):
            row["program"] = probes.relative(row["program"], json_path)
    return {"result": rows}


def time_order(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size, the configurations fastest first as measured and as estimated
    (at the table's rates, and with the measured link), and whether they agree."""
    out: dict[str, Any] = {}
    for size in dict.fromkeys(r["size"] for r in runs):
        mine = [r for r in runs if r["size"] == size and r.get("step s median")]
        found: dict[str, Any] = {}
        for key in (
            "step s median",
            "estimated step s",
            "estimated step s, measured link",
        ):
            if mine and all(r.get(key) for r in mine):
                found[key] = [r["config"] for r in sorted(mine, key=lambda r: r[key])]
        measured = found.get("step s median")
        for key in ("estimated step s", "estimated step s, measured link"):
            if measured and key in found:
                found[f"same order ({key})"] = found[key] == measured
        out[size] = found
    return out


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def link_main(args: argparse.Namespace) -> None:
    """`--calibrate` and `--overlap` (`--overlap` first when both are given)."""
    for wanted, default in (
        ("overlap", "overlap.json"),
        ("calibrate", "calibration.json"),
    ):
        if not getattr(args, wanted):
            continue
        both = args.calibrate and args.overlap
        path = args.json or Path(default)
        if both and args.json:  # one file each
            path = args.json.with_name(f"{args.json.stem}.{wanted}.json")
        if wanted == "overlap":
            sizes = SMOKE_SIZES if args.smoke else SIZES
            result = probes.overlap(
                run_child,
                smoke=args.smoke,
                json_path=path,
                step_size=next(iter(sizes.items())),
                profile_size=list(sizes.items())[-1],
                configs=args.configs or [*OVERLAP_CONFIGS],
                flag_env=_flag_env,
                budget=240.0 if args.budget is None else args.budget,
            )
            result = {"versions": versions(), "smoke": args.smoke, **result}
        else:
            size = SMOKE_SIZES["smoke"] if args.smoke else SIZES["GPT 0.2B"]
            result = probes.calibrate(
                run_child,
                smoke=args.smoke,
                json_path=path,
                host_size=size,
                versions=versions(),
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", flush=True)
        if wanted == "calibrate" and result["details"]["missing"]:
            sys.exit(f"not measured: {result['details']['missing']}")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results to this file")
    p.add_argument("--smoke", action="store_true", help="a tiny model, for a CPU")
    p.add_argument("--deviceless", action="store_true", help=f"write {DEVICELESS}")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the host link, a copy beside a matmul, the matmul rate and "
        "the host update's memory rate; write the calibration file that "
        "`eo.Hardware.from_measurements` reads (--json, calibration.json by default)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="settle what overlaps on this GPU: copies beside a matmul, affine and "
        "clamped slices, both directions at once; the 0.2B step with prefetching and "
        f"with {FLAG}; one profiled 0.9B step (--json, overlap.json by default)",
    )
    choices = list(dict.fromkeys(CONFIGS + OVERLAP_CONFIGS + AT_SCALE_CONFIGS))
    p.add_argument(
        "--configs",
        nargs="+",
        choices=choices,
        metavar="CONFIG",
        default=None,
        help="configurations (all of the main run's; --overlap: its three, the "
        "first the reference its parameters are checked against): "
        + "; ".join(choices),
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (10)")
    p.add_argument(
        "--sizes",
        nargs="+",
        choices=[*SIZES, *AT_SCALE_SIZES],
        default=list(SIZES),
        help="models (Llama-3-8B: with the 'copies on device' configurations, on a "
        "GPU with 80 GiB free and 128 GiB of host RAM: an H200, not an H100)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds after which no further run starts (recorded as skipped): "
        "450 by default, 240 with --overlap",
    )
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.steps = args.steps or (3 if args.smoke else 10)
    if args.child:
        return child(args)
    if args.calibrate or args.overlap:
        return link_main(args)
    args.configs = args.configs or [*CONFIGS]
    args.budget = 450.0 if args.budget is None else args.budget
    known_sizes: dict[str, tuple] = {**SIZES, **AT_SCALE_SIZES}
    sizes = SMOKE_SIZES if args.smoke else {k: known_sizes[k] for k in args.sizes}
    cpu = {"JAX_PLATFORMS": "cpu"}
    if args.deviceless:
        part = deviceless_rows(sizes, args.configs, 1200, DEVICELESS)
        if "error" in part:
            sys.exit(f"gpu_check.py --deviceless failed:\n{part['error']}")
        # The rows of the configurations given replace theirs; the others are kept.
        old = json.loads(DEVICELESS.read_text()) if DEVICELESS.exists() else {}
        rows = [r for r in old.get("rows", []) if r["config"] not in args.configs]
        flagged = run_child(["flag"], 600, cpu)
        written = {
            "rows": rows + part["result"],
            FLAG: flagged.get("result", flagged),
        }
        DEVICELESS.write_text(json.dumps(written, indent=2) + "\n")
        print(f"wrote {DEVICELESS}")
        return
    start = time.perf_counter()
    results: dict[str, Any] = {"versions": versions(), "smoke": args.smoke}
    env = run_child(["numerics", json.dumps(args.configs)], 600)
    results["numerics"] = env.get("result", {}).pop("numerics", env)
    results["environment"] = env.get("result", {"error": env.get("error")})
    print(f"numerics: passed = {results['numerics'].get('passed')}", flush=True)
    part = run_child(["bandwidth", "16" if args.smoke else "1024"], 300)
    results["host link"] = part.get("result", part)
    print(f"host link: {results['host link']}", flush=True)
    part = run_child(["flag"], 600)
    results[FLAG] = part.get("result", part)
    print(f"{FLAG}: {results[FLAG]}", flush=True)
    if args.smoke:
        part = deviceless_rows(sizes, args.configs, 600, args.json)
        rows = part.get("result", [])
        if "error" in part:  # recorded, not hidden behind the rows' empty figures
            results["deviceless error"] = part["error"]
    else:
        rows = json.loads(DEVICELESS.read_text())["rows"] if DEVICELESS.exists() else []
    known = {(r["size"], r["config"]): r for r in rows}
    results["host update"] = {}
    for name, size in sizes.items():
        if time.perf_counter() - start > args.budget:
            found: dict[str, Any] = {
                "error": f"skipped: past the {args.budget:.0f} s budget"
            }
        elif name in AT_SCALE_SIZES:
            found = {"error": "skipped: the GPT sizes' part"}
        else:
            # (median of 5 on a GPU: a 0.9B update on the host takes seconds)
            steps = str(min(args.steps, 5))
            part = run_child(["host update", json.dumps(size), steps], 300)
            found = {"seconds": part["seconds"], **part.get("result", part)}
        results["host update"][name] = found
        print(f"host update, {name}: {json.dumps(found)}", flush=True)
    results["runs"] = []
    for name, size in sizes.items():
        for config in args.configs:
            row: dict[str, Any] = {"size": name, "config": config}
            if time.perf_counter() - start > args.budget:
                row["error"] = f"skipped: past the {args.budget:.0f} s budget"
                results["runs"].append(row)
                continue
            link = json.dumps(results["host link"])
            argv = ["measure", config, json.dumps(size), link]
            if args.json:  # the program timed, beside the results
                file = f"{probes.slug(name)}-{probes.slug(config)}.hlo.gz"
                argv.append(str(probes.programs_folder(args.json) / file))
            big = name in AT_SCALE_SIZES  # (minutes to make, compile and time)
            env = _flag_env(config) | (HOST_LIMIT if big else {})
            part = run_child(argv, 1200 if big else 300, env)
            row["seconds"] = part["seconds"]
            row.update(part.get("result", {"error": part.get("error")}))
            if args.json and row.get("program"):
                row["program"] = probes.relative(row["program"], args.json)
            figure = known.get((name, config))
            if args.json and figure and figure.get("program"):
                there = args.json if args.smoke else DEVICELESS
                path = there.parent / figure["program"]
                row["deviceless gpu-h200 program"] = probes.relative(path, args.json)
            row["deviceless gpu-h200 device bytes"] = figure and figure["device bytes"]
            row["deviceless gpu-h200 host bytes"] = figure and figure["host bytes"]
            row["deviceless gpu-h200 estimated step s"] = figure and figure.get(
                "estimated step s"
            )
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    results["time order"] = time_order(results["runs"])
    print(f"presets by time: {results['time order']}", flush=True)
    results["seconds"] = round(time.perf_counter() - start, 1)
    print(f"done in {results['seconds']} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
