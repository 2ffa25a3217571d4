# ruff: noqa: E501  (HLO text keeps the compiler's long lines)
"""Host compute in the step-time estimate and the memory report: a region of known
host-memory bytes and FLOPs costs them at the host's rates (`eo.Hardware`'s
`host_memory_bytes_per_second`, `host_flops`), overlapping only the device work
the schedule puts between its start and its done; the captured AdamW programs of
`tests/fixtures/<version>/*_host_update.txt` cost their 28 bytes per parameter;
the host computation's temporaries count in `host_bytes`; results saved before
these fields existed still load."""

import dataclasses
import json
from pathlib import Path

import pytest

import eqx_offload as eo
import eqx_offload.internal as eoi

from .fixtures import capture


ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / eoi.JAX_VERSION

N = 1024 * 1024  # elements of each array of the hand-written update
MIB4 = 4 * N  # its bytes, f32
MATMUL_FLOPS = 2 * 4096 * 1024 * 1024


def _update_hlo(form: str, clip: bool = False) -> str:
    """A momentum update `m = 0.9 m + g; p = p - m` of three f32[1024,1024] host
    arrays (p, m, g: 12 MiB read, 8 MiB written; 3 FLOPs an element), with a matmul
    on the device scheduled after it (hand-written, in the compilers' forms):

    - "async": a `HostExecute` start ... done around the matmul (the TPU's and
        the GPU's form of `compute_on("device_host")`);
    - "sync": a fusion marked `_xla_compute_type="host"` (XLA:GPU's inlined
        host compute), then the matmul.

    `clip` adds a global norm of g (a reduction: one more read of g, and 2 FLOPs
    an element)."""
    f32, host = "f32[1024,1024]{1,0}", "f32[1024,1024]{1,0:T(8,128)S(5)}"
    norm = (
        f"""  %sq = {f32} multiply(%g, %g)
  %zero = f32[] constant(0)
  %norm = f32[] reduce(%sq, %zero), dimensions={{0,1}}, to_apply=%sum
  %nb = {f32} broadcast(%norm), dimensions={{}}
  %gc = {f32} divide(%g, %nb)
"""
        if clip
        else f"  %gc = {f32} copy(%g)\n"
    )
    results = f"({host}, {host})"
    if form == "async":
        start = f"""  %hs = (({host}, {host}, {host}), {results}, u32[]{{:S(2)}}) custom-call-start(%hp, %hm, %hg), async_execution_thread="host", custom_call_target="HostExecute", called_computations={{%update}}
  %y = f32[4096,1024]{{1,0:T(8,128)}} fusion(%x, %w), kind=kOutput, calls=%matmul
  %hd = {results} custom-call-done(%hs)"""
    elif form == "sync":
        start = f"""  %hd = {results} fusion(%hp, %hm, %hg), kind=kLoop, calls=%update, frontend_attributes={{_xla_compute_type="host"}}
  %y = f32[4096,1024]{{1,0:T(8,128)}} fusion(%x, %w), kind=kOutput, calls=%matmul"""
    else:
        raise ValueError(form)
    return f"""HloModule jit_f, is_scheduled=true

%sum (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}, execution_thread="host"

%update (p: f32[1024,1024], m: f32[1024,1024], g: f32[1024,1024]) -> ({f32}, {f32}) {{
  %p = {f32} parameter(0)
  %m = {f32} parameter(1)
  %g = {f32} parameter(2)
{norm}  %c = f32[] constant(0.9)
  %cb = {f32} broadcast(%c), dimensions={{}}
  %m9 = {f32} multiply(%m, %cb)
  %m2 = {f32} add(%m9, %gc)
  %p2 = {f32} subtract(%p, %m2)
  ROOT %t = ({f32}, {f32}) tuple(%p2, %m2)
}}, execution_thread="host"

%matmul (p0: bf16[4096,1024], p1: bf16[1024,1024]) -> f32[4096,1024] {{
  %p0 = bf16[4096,1024]{{1,0:T(8,128)(2,1)}} parameter(0)
  %p1 = bf16[1024,1024]{{1,0:T(8,128)(2,1)}} parameter(1)
  ROOT %convolution = f32[4096,1024]{{1,0:T(8,128)}} convolution(%p0, %p1), dim_labels=bf_io->bf
}}

ENTRY %main (x: bf16[4096,1024], w: bf16[1024,1024], hp: f32[1024,1024], hm: f32[1024,1024], hg: f32[1024,1024]) -> (f32[4096,1024], {host}, {host}) {{
  %x = bf16[4096,1024]{{1,0:T(8,128)(2,1)}} parameter(0)
  %w = bf16[1024,1024]{{1,0:T(8,128)(2,1)}} parameter(1)
  %hp = {host} parameter(2)
  %hm = {host} parameter(3)
  %hg = {host} parameter(4)
{start}
  %np = {host} get-tuple-element(%hd), index=0
  %nm = {host} get-tuple-element(%hd), index=1
  ROOT %out = (f32[4096,1024]{{1,0:T(8,128)}}, {host}, {host}) tuple(%y, %np, %nm)
}}
"""


# A v5e with its host priced at its memory channels' rate (the table assumes the
# H200 host's measured 10.9 GB/s), so that the figures below are round.
V5E = dataclasses.replace(eo.Hardware.of("tpu-v5e"), host_memory_bytes_per_second=51e9)


def test_a_host_region_costs_its_bytes_at_the_host_bandwidth():
    """5 arrays of 4 MiB (three read, two written) at 51 GB/s: 411 us, against 3
    FLOPs an element at 1.1 TFLOP/s (2.9 us): bytes-bound."""
    t = eoi.step_time_estimate(_update_hlo("async"), V5E, "tpu")
    assert t.host_compute_bytes == 5 * MIB4
    assert t.host_compute_flops == 3 * N
    host = 5 * MIB4 / V5E.host_memory_bytes_per_second
    assert t.host_compute_seconds == pytest.approx(host)
    assert t.flops == MATMUL_FLOPS  # the device's work is priced as before
    # Halving the host's bandwidth doubles a bytes-bound region.
    slower = dataclasses.replace(
        V5E, host_memory_bytes_per_second=V5E.host_memory_bytes_per_second / 2
    )
    half = eoi.step_time_estimate(_update_hlo("async"), slower, "tpu")
    assert half.host_compute_seconds == pytest.approx(2 * t.host_compute_seconds)
    assert half.seconds > t.seconds + 0.9 * host
    # A host this slow at arithmetic is FLOP-bound instead: 3 FLOPs an element
    # at 1 GFLOP/s.
    weak = dataclasses.replace(V5E, host_flops=1e9)
    flops = eoi.step_time_estimate(_update_hlo("async"), weak, "tpu")
    assert flops.host_compute_seconds == pytest.approx(3 * N / 1e9)


def test_a_global_norm_reads_the_gradient_once_more():
    t = eoi.step_time_estimate(_update_hlo("async", clip=True), V5E, "tpu")
    assert t.host_compute_bytes == 6 * MIB4
    # multiply, reduce, divide of the norm; then multiply, add, subtract.
    assert t.host_compute_flops == 6 * N


def test_host_compute_overlaps_only_the_device_work_scheduled_meanwhile():
    """Started before the matmul and waited for after it, the region hides the
    matmul's time; run synchronously (a host-marked fusion, XLA:GPU's form), the
    matmul waits for it."""
    host = 5 * MIB4 / V5E.host_memory_bytes_per_second
    matmul = MATMUL_FLOPS / V5E.matmul_flops["bf16"]
    overlapped = eoi.step_time_estimate(_update_hlo("async"), V5E, "tpu")
    assert overlapped.seconds == pytest.approx(host, rel=0.01)
    assert overlapped.exposed_host_compute_seconds == pytest.approx(
        host - matmul, rel=0.01
    )
    assert overlapped.bound == "host compute"
    blocking = eoi.step_time_estimate(_update_hlo("sync"), V5E, "tpu")
    assert blocking.host_compute_bytes == 5 * MIB4
    assert blocking.host_compute_flops == 3 * N
    assert blocking.seconds == pytest.approx(host + matmul, rel=0.01)
    assert blocking.exposed_host_compute_seconds == pytest.approx(host)
    # Where the host keeps up, the device does not wait.
    fast = dataclasses.replace(V5E, host_memory_bytes_per_second=1e15)
    quick = eoi.step_time_estimate(_update_hlo("async"), fast, "tpu")
    assert quick.exposed_host_compute_seconds == 0 and quick.bound == "compute"


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize("target", ["tpu-v5e", "gpu-h100"])
def test_the_compiled_adamw_update_costs_28_bytes_a_parameter(target):
    """AdamW on the host (`tests/fixtures/capture.py`, 2 x 128 x 128 parameters):
    parameters, both moments and the gradient read, three of them written (28
    bytes a parameter; 8 more for the step count, read and written); the sum of
    the two layers' gradients into the stack on the host (8 bytes a parameter:
    a `HostExecute` on the TPU, a host-marked fusion on the GPU). On the GPU the
    region's results are copied into their buffers (3 arrays), which measured
    free on the H200 and is not host compute there."""
    platform = target.split("-")[0]
    text = _fixture(f"{platform}_host_update.txt")
    n = 2 * 128 * 128
    t = eoi.step_time_estimate(text, eo.Hardware.of(target), platform)
    copies = 0
    assert t.host_compute_bytes == 28 * n + 8 + 8 * n + copies
    assert t.host_compute_flops > 10 * n  # AdamW: about 17 an element
    hw = eo.Hardware.of(target)
    assert t.host_compute_seconds == pytest.approx(
        t.host_compute_bytes / hw.host_memory_bytes_per_second
    )
    # Nothing of the device's is scheduled between start and done here.
    assert t.exposed_host_compute_seconds == pytest.approx(t.host_compute_seconds)
    assert t.bound == "host compute"
    # One array of the update's shape, besides its parameters and results.
    assert eoi.host_temporaries(eoi.Program(text, platform)) == 4 * n


def _structure(text: str) -> list[list[tuple]]:
    """Each computation's instructions, in order: shape, opcode, and which earlier
    instructions of it are the operands (by position: the compiler numbers some
    instructions differently from run to run, with Python's hash seed)."""
    out = []
    for comp in eoi.parse_hlo(text).computations.values():
        order = {name: i for i, name in enumerate(comp.insts)}
        out.append(
            [
                (i.shape, i.opcode, [order.get(o, o) for o in i.operands], i.host_calls)
                for i in comp.insts.values()
            ]
        )
    return out


@pytest.mark.parametrize("target", ["tpu-v5e", "gpu-h100"])
def test_this_compiler_still_writes_host_compute_so(target):
    """The fixture is what this installation compiles (else: check the adapter's
    `host_calls`/`host_compute`, then capture the fixtures again)."""
    if target.startswith("tpu"):
        pytest.importorskip("libtpu")
    live = capture.host_update(target)
    platform = target.split("-")[0]
    assert _structure(live) == _structure(_fixture(f"{platform}_host_update.txt"))
    starts = [
        i
        for c in eoi.parse_hlo(live).computations.values()
        for i in c.insts.values()
        if i.host_calls
    ]
    assert starts and all(i.custom_call_target == "HostExecute" for i in starts)


def test_the_memory_report_counts_the_host_computations_temporaries():
    """The compiler's memory analysis leaves out what the host computation holds
    while it runs; the report adds its estimate to `host_bytes`, so a host
    capacity between the two no longer fits."""
    step, args = capture.host_update_step("tpu-v5e")
    report = eo.memory_report(step, *args, target="tpu-v5e")
    n = 2 * 128 * 128
    assert report.host_compute_temp == 4 * n
    h = report.host
    compiled = h["argument"] + h["output"] + h["temp"] - h["alias"]
    assert report.host_bytes == compiled + 4 * n
    assert "host compute temporaries" in str(report)
    tight = dataclasses.replace(V5E, host_memory_bytes=compiled + 2 * n)
    small = eo.memory_report(step, *args, target="tpu-v5e", hardware=tight)
    assert small.fits_host is False and small.fits_device is True
    assert report.time is not None and report.time.host_compute_seconds > 0
    back = eo.MemoryReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert back.host_compute_temp == report.host_compute_temp
    assert back.time == report.time


def test_the_table_and_the_plot_show_host_compute():
    t = eoi.step_time_estimate(_update_hlo("async"), V5E, "tpu")
    lines = eoi.step_time_lines(t)
    row = next(line for line in lines if line.startswith("  host compute "))
    assert "20.00 MiB" in row and "411 us" in row
    assert any(line.startswith("  host compute not hidden") for line in lines)
    assert "host compute-bound" in lines[2]
    # Without host compute, the table is as it was.
    plain = dataclasses.replace(
        t,
        bound="HBM",
        kind="device",
        host_compute_seconds=0.0,
        host_compute_bytes=0,
        host_compute_flops=0.0,
    )
    assert not any("host compute" in line for line in eoi.step_time_lines(plain))
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    step, args = capture.host_update_step("gpu-h100")
    report = eo.memory_report(step, *args, target="gpu-h100")
    ax = report.plot(labels=["host update"])
    shown = " ".join(text.get_text() for text in ax.texts)
    assert report.time is not None
    host = eoi.time_text(report.time.host_compute_seconds)
    assert "(host compute)" in shown and f"host compute {host}" in shown
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "host compute temporaries" in legend


def test_results_saved_before_host_compute_still_load():
    """A `Hardware` and a `StepTime` saved before the host's rates, host compute,
    the link's model parameters and the error band existed (as the first
    benchmark results were), and `depth.json`'s reports, still load."""
    first = ("name", "matmul_flops", "hbm_bytes_per_second", "host_memory_bytes")
    first += ("host_to_device_bytes_per_second", "device_to_host_bytes_per_second")
    old = {k: v for k, v in V5E.to_dict().items() if k in first}
    hw = eo.Hardware.from_dict(old)
    assert hw.host_memory_bytes_per_second == 50e9 and hw.host_flops == 1e12
    assert hw.hbm_bytes_per_second == V5E.hbm_bytes_per_second
    assert hw.transfer_overlap == 1 and hw.both_ways_bytes_per_second is None
    assert hw.label("transfer_overlap") == "assumed"
    new_fields = {
        "host_compute_seconds",
        "host_compute_bytes",
        "host_compute_flops",
        "exposed_host_compute_seconds",
        "kind",
        "error",
        "compile_options",
        "notes",
    }
    t = eoi.step_time_estimate(_update_hlo("async"), V5E, "tpu").to_dict()
    before = {k: v for k, v in t.items() if k not in new_fields} | {"hardware": old}
    loaded = eo.StepTime.from_dict(before)
    assert loaded.host_compute_seconds == loaded.exposed_host_compute_seconds == 0
    assert loaded.host_compute_bytes == 0 and loaded.seconds == t["seconds"]
    assert eo.StepTime.from_dict(json.loads(json.dumps(t))).host_compute_bytes == (
        5 * MIB4
    )
    depth = json.loads((ROOT / "benchmarks/results/depth.json").read_text())
    report = eo.MemoryReport.from_dict(depth["results"][0]["report"])
    assert report.host_compute_temp == 0
    assert report.host_bytes == depth["results"][0]["report"]["host_bytes"]


def test_the_hosts_rates_are_in_the_table_and_checked():
    for target in ("tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4", "gpu-h100", "gpu-h200"):
        hw = eo.Hardware.of(target)
        assert 5e9 < hw.host_memory_bytes_per_second < 200e9
        assert 0.5e12 < hw.host_flops < 5e12
        assert any("ESTIMATES until measured" in s for s in hw.sources)
        assert eo.Hardware.from_dict(hw.to_dict()) == hw
        # Measured on the H200's host only; every other target assumes it.
        origin = "measured" if target == "gpu-h200" else "assumed"
        assert hw.label("host_memory_bytes_per_second") == origin
        assert hw.host_memory_bytes_per_second == 10.9e9
    with pytest.raises(ValueError, match="`host_memory_bytes_per_second` is 0"):
        dataclasses.replace(V5E, host_memory_bytes_per_second=0)
    with pytest.raises(ValueError, match="`host_flops` is nan"):
        dataclasses.replace(V5E, host_flops=float("nan"))
    # Built as before the host's rates existed, a `Hardware` still works.
    positional = eo.Hardware("mine", {"bf16": 1e14}, 1e12, 1e10, 1e10, 10**11, ("x",))
    assert positional.sources == ("x",) and positional.host_flops == 1e12


def test_programs_without_host_compute_have_none():
    """A host-offloading loop (`tpu_hlo.txt`): transfers, no host compute."""
    text = _fixture("tpu_hlo.txt")
    assert not eoi.has_host_compute(text)
    t = eoi.step_time_estimate(text, V5E, "tpu")
    assert t.host_to_device_bytes > 0
    assert t.host_compute_seconds == t.host_compute_bytes == 0
    assert t.exposed_host_compute_seconds == 0 and t.bound != "host compute"
    assert eoi.host_temporaries(eoi.Program(text, "tpu")) == 0
