# ruff: noqa: E501  (HLO text keeps the compiler's long lines)
"""`MemoryReport.time`: the step time estimated from the compiled program, checked
where the answer is known: the matmul FLOPs of a stack of two-matmul blocks (6 and
7 x parameters x tokens, and the traced program's dot FLOPs times the scan
lengths), host-link bytes equal to the compiled transfers, linear growth in depth,
batch doubling, the precision each dot runs at, and figures that are never
negative."""

import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jaxtyping import Array, Float

import eqx_offload as eo
import eqx_offload.internal as eoi
from eqx_offload.internal import time_text


D, H = 256, 512  # the blocks' width and hidden width


class TwoMatmuls(eqx.Module):
    w1: Float[Array, "d h"]
    w2: Float[Array, "h d"]

    def __call__(self, x: Float[Array, "t d"]) -> Float[Array, "t d"]:
        return x + jax.nn.relu(x @ self.w1) @ self.w2


class Stack(eqx.Module):
    blocks: eo.Stacked[TwoMatmuls]

    def __call__(self, x: Float[Array, "t d"]) -> Float[Array, "t d"]:
        return self.blocks(x)


def _stack(depth: int, *, key) -> Stack:
    def block(k):
        k1, k2 = jax.random.split(k)
        return TwoMatmuls(jax.random.normal(k1, (D, H)), jax.random.normal(k2, (H, D)))

    return Stack(eo.Stacked.from_fn(block, depth, key=key))


def _loss(model: Stack, x: Float[Array, "t d"]) -> Float[Array, ""]:
    return jnp.mean(model(x) ** 2)  # no matmul outside the blocks


def _step(preset: str, depth: int, tokens: int):
    policy = getattr(eo.Policy, preset)()
    optimizer = optax.sgd(0.1)
    abstract = eqx.filter_eval_shape(_stack, depth, key=jax.random.key(0))
    model = eo.place(abstract, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    x = jax.ShapeDtypeStruct((tokens, D), jnp.float32)
    return eo.train_step(_loss, optimizer, policy), model, opt_state, x


_REPORTS: dict = {}


def _report(preset: str, target: str, depth: int = 4, tokens: int = 512):
    key = (preset, target, depth, tokens)
    if key not in _REPORTS:
        step, *args = _step(preset, depth, tokens)
        _REPORTS[key] = eo.memory_report(step, *args, target=target)
    return _REPORTS[key]


def _traced_dot_flops(closed, times: int = 1) -> float:
    """The dot FLOPs of a traced program, each scan's body counted `length` times
    (the first branch of a `cond`, as the compiled program's first branch)."""
    total = 0.0
    for eqn in closed.jaxpr.eqns if hasattr(closed, "jaxpr") else closed.eqns:
        if eoi.primitive_name(eqn) == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            inner = math.prod(lhs[d] for d in contracting)
            total += times * 2 * math.prod(eqn.outvars[0].aval.shape) * inner
            continue
        if eoi.is_scan(eqn):
            layout = eoi.scan_layout(eqn)
            total += _traced_dot_flops(layout.body, times * layout.length)
            continue
        if eoi.is_cond(eqn):
            total += _traced_dot_flops(eoi.cond_branches(eqn)[0], times)
            continue
        for sub in eoi.sub_jaxprs(eqn) or []:
            total += _traced_dot_flops(sub.jaxpr, times)
    return total


# The compute term.


@pytest.mark.parametrize("target", ["tpu-v5e", "gpu-h100"])
@pytest.mark.parametrize("preset, per_token", [("none", 6), ("remat", 7)])
def test_flops_are_the_traced_dot_flops_with_trip_counts(target, preset, per_token):
    """A stack of two-matmul blocks: forward 2, backward 4 FLOPs per parameter and
    token; under `remat` plus the forward's first matmul again (its last is not
    recomputed: its output is the next layer's carry, which is saved)."""
    depth, tokens = 4, 512
    report = _report(preset, target, depth, tokens)
    assert report.time is not None
    params = depth * 2 * D * H
    expected = per_token * params * tokens
    assert report.time.flops == pytest.approx(expected, rel=0.05)
    assert _traced_flops(preset, depth, tokens) == pytest.approx(expected, rel=0.05)


@functools.cache
def _traced_flops(preset: str, depth: int, tokens: int) -> float:
    """The traced step's dot FLOPs (the same for every target)."""
    step, *args = _step(preset, depth, tokens)
    return _traced_dot_flops(step.trace(*args).jaxpr)


def test_float32_dots_run_as_the_platform_runs_them():
    """At the default precision a float32 dot is one bfloat16 pass on a TPU and
    TF32 on an H100; `HIGHEST` is six passes and float32."""
    tpu = _report("none", "tpu-v5e").time
    gpu = _report("none", "gpu-h100").time
    assert tpu is not None and gpu is not None
    assert set(tpu.flops_by_precision) == {"bf16"}
    assert set(gpu.flops_by_precision) == {"tf32"}
    v5e, h100 = eo.Hardware.of("tpu-v5e"), eo.Hardware.of("gpu-h100")
    assert tpu.compute_seconds == pytest.approx(tpu.flops / v5e.matmul_flops["bf16"])
    # (at the share of the peak the H200 measured)
    tf32 = h100.matmul_flops["tf32"] * h100.compute_efficiency
    assert gpu.compute_seconds == pytest.approx(gpu.flops / tf32)

    def highest(a, b):
        return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)

    a = jax.ShapeDtypeStruct((256, 384), jnp.float32)
    b = jax.ShapeDtypeStruct((384, 128), jnp.float32)
    flops = 2 * 256 * 384 * 128
    for target, used in (("tpu-v5e", "bf16x6"), ("gpu-h100", "f32")):
        t = eo.memory_report(jax.jit(highest), a, b, target=target).time
        assert t is not None and t.flops_by_precision == {used: flops}
    half = (jax.ShapeDtypeStruct((256, 384), jnp.bfloat16),) * 2
    t = eo.memory_report(jax.jit(lambda x, y: x @ y.T), *half, target="gpu-h100").time
    assert t is not None and t.flops_by_precision == {"bf16": 2 * 256 * 384 * 256}


def test_precision_names():
    assert eoi.costs_precision(("f32", "f32"), [], "tpu") == "bf16"
    assert eoi.costs_precision(("f32", "f32"), ["high", "high"], "tpu") == "bf16x3"
    assert eoi.costs_precision(("f32", "f32"), ["high", "high"], "gpu") == "tf32"
    assert eoi.costs_precision(("bf16", "bf16"), ["highest"], "gpu") == "bf16"
    assert eoi.costs_precision(("s8", "s8"), [], "tpu") == "int8"
    assert eoi.costs_precision(("f8e4m3fn", "bf16"), [], "gpu") == "fp8"
    # A precision the chip has no rate for runs at a slower one it has.
    assert eo.Hardware.of("tpu-v5e").flops_per_second("fp8")[0] == "bf16"
    assert eo.Hardware.of("tpu-v5e").flops_per_second("f32")[0] == "bf16x6"


# The host link.


@pytest.mark.parametrize("target", ["tpu-v5e", "gpu-h100"])
def test_host_link_bytes_are_the_compiled_transfers(target):
    report = _report("offload_all", target)
    t = report.time
    assert t is not None and report.compiled_transfers
    assert t.host_to_device_bytes == report.host_to_device_bytes > 0
    assert t.device_to_host_bytes == report.device_to_host_bytes > 0
    hw = eo.Hardware.of(target)
    assert t.host_to_device_seconds == pytest.approx(
        report.host_to_device_bytes / hw.host_to_device_bytes_per_second
    )
    # Nothing moves without offloading, and nothing is waited for.
    plain = _report("none", target).time
    assert plain is not None
    assert plain.host_to_device_bytes == plain.device_to_host_bytes == 0
    assert plain.exposed_transfer_seconds == 0 and plain.bound != "host link"


@pytest.mark.parametrize("target", ["tpu-v5e", "gpu-h100"])
def test_what_is_not_hidden_is_split_by_phase(target):
    """The exposed link time by part of the step sums to the whole; the layers'
    reads and gradients are in the forward and backward scans, the optimizer
    state's in the update, and nothing is outside the layers in this model (no
    leaf outside its `Stacked`)."""
    t = _report("offload_all", target).time
    assert t is not None
    assert set(t.exposed_seconds_by_phase) == set(t.transfer_seconds_by_phase)
    assert set(t.exposed_seconds_by_phase) == {
        "forward",
        "backward",
        "outside",
        "update",
    }
    total = sum(t.exposed_seconds_by_phase.values())
    assert total == pytest.approx(t.exposed_transfer_seconds, rel=1e-9)
    link = t.transfer_seconds_by_phase
    assert sum(link.values()) == pytest.approx(
        t.host_to_device_seconds + t.device_to_host_seconds, rel=1e-9
    )
    assert link["forward"] > 0 and link["backward"] > 0 and link["update"] > 0
    assert link["outside"] == 0
    # A phase's wait can include the link still busy with another phase's
    # transfer queued before its own; the waits together never exceed the link.
    assert all(seconds >= 0 for seconds in t.exposed_seconds_by_phase.values())
    assert total <= sum(link.values()) * (1 + 1e-9)
    # Kept through `to_dict` (the benchmarks' JSON).
    again = eo.StepTime.from_dict(t.to_dict())
    assert again.exposed_seconds_by_phase == t.exposed_seconds_by_phase
    assert "of which the update" in str(t)


def test_what_is_not_hidden_is_read_from_the_schedule(monkeypatch):
    """In this program every layer's weights are read from the host at the top of
    its iteration and used at once: the transfers hide behind nothing, so the
    step is bound by the host link, and a faster link shortens it by the time
    saved (`memory_report(hardware=...)`; a slower way back priced from the same
    compiled program, as `memory_report` prices it)."""
    report = _report("offload_all", "tpu-v5e")
    t = report.time
    assert t is not None and t.bound == "host link"
    assert t.exposed_transfer_seconds >= 0.9 * t.host_to_device_seconds
    assert t.seconds >= t.exposed_transfer_seconds + 0.5 * t.compute_seconds
    faster = dataclasses.replace(
        eo.Hardware.of("tpu-v5e"),
        host_to_device_bytes_per_second=150e9,
        device_to_host_bytes_per_second=150e9,
    )
    step, *args = _step("offload_all", 4, 512)
    estimate, texts = eoi.step_time_estimate, []

    def recording(text, hardware, platform, options=None):
        texts.append(text)
        return estimate(text, hardware, platform, options)

    monkeypatch.setattr("eqx_offload._report._step_time.estimate", recording)
    quick = eo.memory_report(step, *args, target="tpu-v5e", hardware=faster).time
    assert quick is not None and quick.hardware is faster
    assert quick.exposed_transfer_seconds < t.exposed_transfer_seconds / 5
    assert quick.seconds < t.seconds
    assert quick.flops == t.flops and quick.hbm_bytes == t.hbm_bytes
    # Each direction at its own rate: a slower way back, and the step waits longer.
    back = dataclasses.replace(
        eo.Hardware.of("tpu-v5e"), device_to_host_bytes_per_second=1.5e9
    )
    (text,) = texts  # the program `memory_report` compiled, as it priced it
    slow = estimate(text, back, "tpu")
    assert slow.host_to_device_seconds == pytest.approx(t.host_to_device_seconds)
    assert slow.device_to_host_seconds == pytest.approx(10 * t.device_to_host_seconds)
    assert slow.exposed_transfer_seconds > t.exposed_transfer_seconds + (
        5 * t.device_to_host_seconds
    )


def test_a_transfer_hides_behind_the_compute_scheduled_before_its_done():
    """An asynchronous read issued before a matmul and waited for after it costs
    only what the matmul does not cover; a synchronous one costs all of it."""
    hw = eo.Hardware.of("tpu-v5e")
    layer = 4 * 1024 * 1024  # f32[1024,1024]: 4 MiB, 280 us at 15 GB/s
    link = layer / hw.host_to_device_bytes_per_second
    flops = 2 * 4096 * 1024 * 1024
    matmul = flops / hw.matmul_flops["bf16"]  # 43.6 us
    t = eoi.step_time_estimate(_hlo(asynchronous=True), hw, "tpu")
    assert t.host_to_device_bytes == layer and t.flops == flops
    assert t.exposed_transfer_seconds == pytest.approx(link - matmul, rel=0.02)
    assert t.seconds == pytest.approx(link, rel=0.02)
    sync = eoi.step_time_estimate(_hlo(asynchronous=False), hw, "tpu")
    assert sync.host_to_device_bytes == layer and sync.flops == flops
    assert sync.exposed_transfer_seconds == pytest.approx(link, rel=0.02)
    assert sync.seconds == pytest.approx(link + matmul, rel=0.05)
    # Where no share of a transfer overlaps compute (the H200), the asynchronous
    # read costs what the synchronous one does. At half, the matmul fits in the
    # half that overlaps; at a tenth (28 us), 28 of its 43.6 us hide.
    for share, seconds in (
        (0.0, link + matmul),
        (0.5, link),
        (0.1, 0.9 * link + matmul),
    ):
        held = dataclasses.replace(hw, transfer_overlap=share)
        t_held = eoi.step_time_estimate(_hlo(asynchronous=True), held, "tpu")
        assert t_held.seconds == pytest.approx(seconds, rel=0.05)
    # The matmul reads x and w and writes y in device memory; the host copy is
    # the link's, not HBM traffic; an operand in on-chip memory (S(1)) neither.
    x, w, y = 4096 * 1024 * 2, 1024 * 1024 * 2, 4096 * 1024 * 4
    assert t.hbm_bytes == x + w + y
    assert t.hbm_seconds == pytest.approx((x + w + y) / hw.hbm_bytes_per_second)
    on_chip = _hlo(asynchronous=True).replace(
        "%w = bf16[1024,1024]{1,0:T(8,128)(2,1)}",
        "%w = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)}",
    )
    assert eoi.step_time_estimate(on_chip, hw, "tpu").hbm_bytes == x + y


def _hlo(asynchronous: bool) -> str:
    """A host read, a matmul, the read waited for (hand-written, in the TPU
    compiler's form)."""
    device = "f32[1024,1024]{1,0:T(8,128)}"
    host = "f32[1024,1024]{1,0:T(8,128)S(5)}"
    if asynchronous:
        before = f"  %cs = ({device}, {host}, u32[]{{:S(2)}}) copy-start(%h)"
        after = f"  %c = {device} copy-done(%cs)"
    else:
        before, after = f"  %c = {device} copy(%h)", ""
    return f"""HloModule jit_f, is_scheduled=true

%fused (p0: bf16[4096,1024], p1: bf16[1024,1024]) -> f32[4096,1024] {{
  %p0 = bf16[4096,1024]{{1,0:T(8,128)(2,1)}} parameter(0)
  %p1 = bf16[1024,1024]{{1,0:T(8,128)(2,1)}} parameter(1)
  ROOT %convolution = f32[4096,1024]{{1,0:T(8,128)}} convolution(%p0, %p1), dim_labels=bf_io->bf
}}

ENTRY %main (x: bf16[4096,1024], w: bf16[1024,1024], h: f32[1024,1024]) -> (f32[4096,1024], f32[1024,1024]) {{
  %x = bf16[4096,1024]{{1,0:T(8,128)(2,1)}} parameter(0)
  %w = bf16[1024,1024]{{1,0:T(8,128)(2,1)}} parameter(1)
  %h = {host} parameter(2)
{before}
  %y = f32[4096,1024]{{1,0:T(8,128)}} fusion(%x, %w), kind=kOutput, calls=%fused
{after}
  ROOT %out = (f32[4096,1024]{{1,0:T(8,128)}}, {device}) tuple(%y, %c)
}}
"""


# Depth and batch.


@pytest.mark.parametrize("target", ["tpu-v5e", "gpu-h100"])
def test_the_estimate_grows_linearly_in_depth(target):
    times = [_report("remat", target, depth).time for depth in (2, 4, 6)]
    assert all(t is not None for t in times)
    s = [t.seconds for t in times if t is not None]
    flops = [t.flops for t in times if t is not None]
    assert s[2] - s[1] == pytest.approx(s[1] - s[0], rel=0.02)
    assert s[1] > s[0]
    assert flops[2] - flops[1] == pytest.approx(flops[1] - flops[0], rel=1e-6)


@pytest.mark.parametrize("target", ["tpu-v5e", "gpu-h100"])
def test_doubling_the_batch_doubles_compute_not_parameter_transfers(target):
    small = _report("offload_all", target, 4, 512)
    large = _report("offload_all", target, 4, 1024)
    assert small.time is not None and large.time is not None
    for direction in ("host_to_device", "device_to_host"):
        assert large.transfer_seconds(direction, what="params") == pytest.approx(
            small.transfer_seconds(direction, what="params")
        )
    assert small.transfer_seconds("host_to_device", what="params") > 0
    assert large.time.compute_seconds == pytest.approx(2 * small.time.compute_seconds)
    assert large.time.flops == pytest.approx(2 * small.time.flops)


# What reaches the user.


def test_figures_are_never_negative_nor_missing():
    """These programs are ones the TPU compiler's `cost_analysis()` prices at a
    negative time (`optimal_seconds` -1 s and -2 s at depths 2 and 4 for `none`,
    `remat` and `offload_residuals`, and FLOPs that do not grow with depth; libtpu
    0.0.42.1): the estimate, which does not use it, is finite and non-negative."""
    for preset in ("none", "remat", "offload_residuals", "offload_all"):
        for target in ("tpu-v5e", "gpu-h100"):
            t = _report(preset, target).time
            assert t is not None
            values = [v for v in dataclasses.asdict(t).values() if isinstance(v, float)]
            assert all(math.isfinite(v) and v >= 0 for v in values), (preset, target)
            assert t.seconds >= max(t.compute_seconds, t.exposed_transfer_seconds)
            assert t.bound in ("compute", "HBM", "host link")


def test_the_report_prints_and_keeps_the_time():
    report = _report("offload_all", "gpu-h100")
    text = str(report)
    assert "time per step, gpu-h100" in text and "transfers not hidden" in text
    back = eo.MemoryReport.from_dict(report.to_dict())
    assert back.time == report.time
    assert report.to_dict()["time"]["hardware"]["name"] == "gpu-h100"


def test_no_time_on_the_cpu_backend():
    step, *args = _step("none", 2, 64)
    report = eo.memory_report(step, *args)
    assert report.time is None
    with pytest.raises(ValueError, match="no step time"):
        report.transfer_seconds("host_to_device")
    with pytest.raises(ValueError, match="Pass a `target=`"):
        eo.memory_report(step, *args, hardware=eo.Hardware.of("tpu-v5e"))
    with pytest.raises(TypeError, match="hardware"):
        eo.memory_report(step, *args, target="tpu-v5e", hardware="tpu-v5e")  # pyright: ignore[reportArgumentType]


def test_hardware_is_sourced_and_checked():
    for target in ("tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4", "gpu-h100", "gpu-h200"):
        hw = eo.Hardware.of(target + (":8" if target.startswith("gpu") else ""))
        assert hw.name == target and hw.sources
        assert hw.host_memory_bytes > 10**10
    assert eo.Hardware.of("tpu-v5e:4x4") is eo.Hardware.of("tpu-v5e")
    with pytest.raises(ValueError, match="unknown target"):
        eo.Hardware.of("tpu-v9")
    with pytest.raises(ValueError, match="`host_to_device_bytes_per_second` is -1"):
        dataclasses.replace(
            eo.Hardware.of("gpu-h100"), host_to_device_bytes_per_second=-1
        )
    with pytest.raises(ValueError, match="needs `'bf16'`"):
        dataclasses.replace(eo.Hardware.of("gpu-h100"), matmul_flops={"f32": 1e12})


@pytest.mark.parametrize("target", ["tpu-v5e:2x2", "gpu-h200:8"])
def test_every_target_and_kind_of_function_has_a_time(target):
    """A `filter_offload` gradient on a slice, and on a node of the other GPU: the
    same per-device FLOPs (replicated, every device runs the whole step), priced
    with the chip's own entry; a plain jitted function too. (The other TPU
    generations: `test_memory_report.py`,
    `test_every_tpu_target_compiles_a_train_step`.)"""
    policy = eo.Policy.remat()
    model = eo.place(eqx.filter_eval_shape(_stack, 2, key=jax.random.key(0)), policy)
    loss = eo.filter_offload(_loss, policy)
    x = jax.ShapeDtypeStruct((512, D), jnp.float32)
    report = eo.memory_report(loss, model, x, target=target)
    t = report.time
    assert t is not None and report.compiled == "filter_offload"
    assert t.hardware == eo.Hardware.of(target)
    assert t.flops == pytest.approx(7 * 2 * (2 * D * H) * 512, rel=0.05)
    assert t.seconds > 0
    plain = eo.memory_report(jax.jit(lambda a: a @ a.T), x, target=target).time
    assert plain is not None and plain.flops == 2 * 512 * 512 * D


def test_the_plot_shows_the_time():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    report = _report("offload_all", "gpu-h100")
    ax = report.plot(labels=["offload_all"])
    shown = [t.get_text() for t in ax.texts]
    assert any(s.startswith("offload_all\n") and "(host link)" in s for s in shown)
    assert time_text(report.time.seconds) in " ".join(shown)


@pytest.mark.parametrize("target", ["tpu-v5e", "gpu-h100"])
def test_a_batched_matmul_is_counted_once_per_batch(target):
    """Attention scores: the TPU compiler writes the batched matmul as a
    convolution whose batch dimensions are spatial and dilated (`lhs_dilate`), so
    that one window position in each lands on the input; the others are holes."""

    def scores(q, k):
        return jnp.einsum("bhqd,bhkd->bhqk", q, k)

    q = jax.ShapeDtypeStruct((8, 4, 256, 64), jnp.bfloat16)
    t = eo.memory_report(jax.jit(scores), q, q, target=target).time
    assert t is not None and t.flops == 2 * 8 * 4 * 256 * 256 * 64
    assert t.flops_by_precision == {"bf16": t.flops}
    # On a GPU the report says attention is priced as XLA runs it, not fused.
    assert (ATTENTION_NOTE in t.notes) == target.startswith("gpu")
    assert any(line == f"note: {ATTENTION_NOTE}" for line in str(t).splitlines()) == (
        target.startswith("gpu")
    )
    m = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16)
    plain = eo.memory_report(jax.jit(lambda a, b: a @ b.T), m, m, target=target)
    assert plain.time is not None and plain.time.notes == ()


ATTENTION_NOTE = eoi.ATTENTION_NOTE


def _cublas_hlo(precision: str) -> str:
    """A GEMM as XLA:GPU writes it when it calls cuBLAS (after autotuning on a real
    GPU; compile-only GPUs here emit Triton fusions instead, so this form is
    hand-written after XLA's own tests, not captured)."""
    config = (
        '{"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":'
        '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],'
        '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"precision_config":'
        f'{{"operand_precision":["{precision}","{precision}"],"algorithm":"ALG_UNSET"}},'
        '"epilogue":"DEFAULT"}}'
    )
    return f"""HloModule jit_f, is_scheduled=true

ENTRY %main (a: f32[512,384], b: f32[384,256]) -> f32[512,256] {{
  %a = f32[512,384]{{1,0}} parameter(0)
  %b = f32[384,256]{{1,0}} parameter(1)
  %gemm = (f32[512,256]{{1,0}}, s8[4194304]{{0}}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={config}
  ROOT %out = f32[512,256]{{1,0}} get-tuple-element(%gemm), index=0
}}
"""


def test_a_cublas_call_is_a_matmul():
    h100 = eo.Hardware.of("gpu-h100")
    flops = 2 * 512 * 384 * 256
    t = eoi.step_time_estimate(_cublas_hlo("DEFAULT"), h100, "gpu")
    assert t.flops_by_precision == {"tf32": flops}
    t = eoi.step_time_estimate(_cublas_hlo("HIGHEST"), h100, "gpu")
    assert t.flops_by_precision == {"f32": flops}
    f32 = h100.matmul_flops["f32"] * h100.compute_efficiency
    assert t.compute_seconds == pytest.approx(flops / f32)


def test_the_compile_options_come_from_one_place_and_are_reported():
    """`train_step` and `memory_report` take their options from
    `_compiler.compile_options`; the step time prints what it was compiled with."""
    options = eoi.compile_options("tpu", host_remat=True)
    assert options == {"xla_tpu_rematerialization_use_host_memory_offload": True}
    assert eoi.compile_options("gpu", host_remat=True) is None
    assert eoi.compile_options("tpu", host_remat=False) is None
    hw = eo.Hardware.of("tpu-v5e")
    t = eoi.step_time_estimate(_hlo(asynchronous=True), hw, "tpu", options)
    assert t.compile_options == options
    assert "compiled with: xla_tpu_rematerialization_use_host_memory_offload=True" in (
        str(t).splitlines()
    )
    plain = eoi.step_time_estimate(_hlo(asynchronous=True), hw, "tpu")
    assert plain.compile_options == {} and "compiled with" not in str(plain)
    assert "rates: link nominal, assumed" in str(plain)
