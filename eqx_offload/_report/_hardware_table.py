"""The figures of `Hardware`'s table: one device of each target, where each figure
comes from, and what one H200 measured and the step-time model fitted to it. Plain
data: `_hardware.py` builds the `Hardware` rows from it."""

from typing import Any


_GB = 1e9
_T = 1e12


def _row(
    matmul_flops: dict, link: float, spec: str, via: str, host: str, **fields: Any
) -> dict[str, Any]:
    """A row's fields, as `Hardware(...)` takes them: matmul FLOP/s by precision,
    the host link (the same each way), `fields` (HBM bandwidth, host memory and
    FLOP/s per device), and the sources: the chip's specifications (`spec`), the
    host link's (`via`), `_PRECISION`, and the host's estimate (`_HOST` of `host`)."""
    return dict(
        matmul_flops=matmul_flops,
        host_to_device_bytes_per_second=link,
        device_to_host_bytes_per_second=link,
        **fields,
        sources=(spec, via, _PRECISION, _HOST.format(host)),
    )


def _tpu(bf16: float, int8: float) -> dict[str, float]:
    return {"bf16": bf16, "bf16x3": bf16 / 3, "bf16x6": bf16 / 6, "int8": int8}


_TPU_SPECS = "https://cloud.google.com/tpu/docs/{}"
_SCALING_BOOK = (
    "https://jax-ml.github.io/scaling-book/tpus/: host link (PCIe) 16 GB/s each "
    "way for v4, about 1.5e10 B/s per chip in general, 32 GB/s for v6e"
)
_PRECISION = (
    "https://docs.jax.dev/en/latest/_autosummary/jax.lax.Precision.html: a float32 "
    "dot takes 1, 3 or 6 bfloat16 passes on a TPU at DEFAULT, HIGH, HIGHEST; TF32 "
    "on an H100 at DEFAULT and HIGH, float32 at HIGHEST"
)
_NVIDIA = (
    "https://www.nvidia.com/en-us/data-center/{}/ (SXM): tensor-core rates listed "
    "with sparsity, halved here for dense (bf16 989.4, tf32 494.7, fp8 and int8 "
    "1979 TFLOP/s), fp32 67 TFLOP/s, PCIe Gen5 128 GB/s (64 each way); not read "
    "from nvidia.com itself but from copies of it and "
    "https://jax-ml.github.io/scaling-book/gpus/ (bf16 9.9e14, fp8 2.0e15)"
)

_HOST = (
    "host memory bandwidth and FLOP/s per device: ESTIMATES until measured (the "
    "memory bandwidth is not used: every row takes the host update's rate "
    "measured on an H200's host), from the host's memory channels (a DDR4-3200 "
    "channel moves 25.6 GB/s, DDR5-4800 38.4 GB/s) and cores (float32 FMA: 16 "
    "FLOPs a cycle per 256-bit unit, two units a core), over the devices the "
    "host serves; {}"
)

# The tensor-core rates of the H100 SXM, which the H200 shares (dense).
_HOPPER = {
    "fp8": 1979 * _T,
    "int8": 1979 * _T,
    "bf16": 989.4 * _T,
    "tf32": 494.7 * _T,
    "f32": 67 * _T,
    "f64": 67 * _T,
}

# One device of each target, and where each figure comes from. Host links are the
# links' nominal rates: what a program gets is lower (a plain `jax.device_put` to
# the host measured 2.7 GB/s on an H100 PCIe, jax#21438): override them with
# what you measure.
_ROWS: dict[str, dict[str, Any]] = {
    "tpu-v5e": _row(
        _tpu(197 * _T, 393 * _T),
        hbm_bytes_per_second=819 * _GB,
        link=15 * _GB,
        host_memory_bytes=48 * 10**9,
        host_flops=1.1 * _T,
        spec=_TPU_SPECS.format("v5e") + ": 197 TFLOP/s bf16, 393 TOP/s int8, 16 GB "
        "of HBM at 819 GB/s; VM ct5lp-hightpu-4t: 4 chips, 192 GB of memory "
        "(48 GB a chip)",
        via=_SCALING_BOOK + " (v5e: the general figure; PCIe generation not published)",
        host="v5e: 8 chips a host, VM ct5lp-hightpu-8t 224 vCPUs on 2 NUMA nodes "
        "(the v5e page); CPU not published: taken as two sockets of eight "
        "DDR4-3200 channels (410 GB/s, 51 GB/s a chip) and 112 cores at 2.5 "
        "GHz with AVX2 FMA (9 TFLOP/s, 1.1 a chip)",
    ),
    "tpu-v6e": _row(
        _tpu(918 * _T, 1836 * _T),
        hbm_bytes_per_second=1640 * _GB,
        link=32 * _GB,
        host_memory_bytes=180 * 10**9,
        host_flops=1.6 * _T,
        spec=_TPU_SPECS.format("v6e") + ": 918 TFLOP/s bf16, 1836 TOP/s int8, 32 GB "
        "of HBM at 1640 GB/s, PCIe Gen5 to the host; VM ct6e-standard-4t: 4 "
        "chips, 720 GB of memory (180 GB a chip)",
        via=_SCALING_BOOK,
        host="v6e: 8 chips a host (the v6e page); CPU and memory channels not "
        "published: taken as an 8-GPU node's host, two sockets of eight "
        "DDR5-4800 channels (614 GB/s, 77 GB/s a chip) and 104 cores at 2 "
        "GHz with AVX-512 FMA (13 TFLOP/s, 1.6 a chip)",
    ),
    "tpu-v5p": _row(
        _tpu(459 * _T, 918 * _T),
        hbm_bytes_per_second=2765 * _GB,
        link=15 * _GB,
        host_memory_bytes=112 * 10**9,
        host_flops=3.3 * _T,
        spec=_TPU_SPECS.format("v5p-training") + ": 459 TFLOP/s bf16, 95 GB of HBM "
        "at 2765 GB/s, a 4-chip VM with 448 GB of RAM (112 GB a chip); int8 "
        "918 TOP/s from the scaling book",
        via=_SCALING_BOOK + " (v5p: the general figure; PCIe generation not published)",
        host="v5p: 4 chips a host, 208 vCPUs on 2 NUMA nodes (the v5p-training "
        "page); CPU not published: taken as two sockets of eight DDR5-4800 "
        "channels (614 GB/s, 154 GB/s a chip) and 104 cores at 2 GHz with "
        "AVX-512 FMA (13 TFLOP/s, 3.3 a chip)",
    ),
    # A `tpu-v4` device is one TensorCore, half a chip (`_targets.HBM_BYTES`).
    "tpu-v4": _row(
        _tpu(275 * _T / 2, 275 * _T / 2),
        hbm_bytes_per_second=1200 * _GB / 2,
        link=8 * _GB,
        host_memory_bytes=407 * 10**9 // 8,
        host_flops=1.2 * _T,
        spec=_TPU_SPECS.format("v4") + ": 275 TFLOP/s (bf16 or int8), 32 GiB of HBM "
        "at 1200 GB/s per chip; VM ct4p-hightpu-4t: 4 chips, 407 GB of memory; "
        "all halved for one of a chip's two TensorCores",
        via=_SCALING_BOOK + " (v4: 16 GB/s a chip, halved)",
        host="v4: 4 chips (8 TensorCores) a host; CPU not published: taken as "
        "two sockets of eight DDR4-3200 channels (410 GB/s, 51 GB/s a "
        "TensorCore) and 120 cores at 2.5 GHz with AVX2 FMA (9.6 TFLOP/s, "
        "1.2 a TensorCore)",
    ),
    "gpu-h100": _row(
        _HOPPER,
        hbm_bytes_per_second=3350 * _GB,
        link=64 * _GB,
        host_memory_bytes=234 * 10**9,
        host_flops=1.6 * _T,
        spec=_NVIDIA.format("h100") + "; 80 GB of HBM3 at 3.35 TB/s",
        via="https://cloud.google.com/compute/docs/gpus: a3-highgpu-8g, 8 H100s "
        "with 1,872 GB of memory (234 GB a GPU), 208 vCPUs",
        host="an 8-H100 node: two sockets of eight DDR5-4800 channels (614 GB/s, "
        "77 GB/s a GPU) and 104 cores (a3-highgpu-8g's 208 vCPUs) at 2 GHz "
        "with AVX-512 FMA (13 TFLOP/s, 1.6 a GPU)",
    ),
    "gpu-h200": _row(
        _HOPPER,
        hbm_bytes_per_second=4800 * _GB,
        link=64 * _GB,
        host_memory_bytes=256 * 10**9,
        host_flops=1.6 * _T,
        spec=_NVIDIA.format("h200") + "; 141 GB of HBM3e at 4.8 TB/s",
        via="NVIDIA's MLPerf Training system description of an 8-H200 node: 2 TB "
        "of memory (32 x 64 GB; 256 GB a GPU)",
        host="an 8-H200 node, as the H100's: two sockets of eight DDR5-4800 "
        "channels (614 GB/s, 77 GB/s a GPU) and 104 cores at 2 GHz with "
        "AVX-512 FMA (13 TFLOP/s, 1.6 a GPU)",
    ),
}

# Each row named by its key.
ROWS = {name: {"name": name, **row} for name, row in _ROWS.items()}

# What one H200 measured (`benchmarks/gpu_check.py` in a session lent one;
# benchmarks/results/gpu_check_h200_gpt02b.json), and the step-time model's
# parameters fitted to that run's seven 0.2B steps (`benchmarks/calibration.py`,
# which tests/test_calibration.py reruns on the programs those steps compiled; the
# run's four 0.9B steps are held out).

H200_RUN = "gpu_check_h200_gpt02b.json (one H200, jax 0.11.2, 2026-11-27)"
H200_MEASURED = {
    # pinned host <-> device copies of 1 GiB, median of 5: 52.53 and 52.53 GB/s
    "host_to_device_bytes_per_second": 52.5 * _GB,
    "device_to_host_bytes_per_second": 52.5 * _GB,
    # the host update's AdamW on the host's CPU: 4.70 GB in 0.432 s (median)
    "host_memory_bytes_per_second": 10.9 * _GB,
}
H200_FITTED = {
    # nothing overlapped compute
    "transfer_overlap": 0.0,
    # the 0.2B `remat` step (device work only) over its estimate at peak
    "compute_efficiency": 0.68,
}
# No measured step had both directions in flight at once, so the fit cannot tell
# how the link shares itself: taken as one direction's rate (the serial sum that
# fit every step) until `gpu_check.py --calibrate` measures it.
H200_BOTH_WAYS = 52.5 * _GB
# The largest |estimate / measured - 1| of the calibrated model over all 11
# steps (0.2B fitted, 0.9B held out), by kind, rounded up to 5%
# (`benchmarks/calibration.py`: 2.4%, 2.9% and 7.2%).
H200_ERROR = {"device": 0.05, "host link": 0.05, "host compute": 0.1}

TPU_ASSUMED = {
    "both_ways_bytes_per_second": "assumed: full duplex (no public figure for "
    "both directions at once)",
    "transfer_overlap": "assumed: XLA's TPU scheduler overlaps host transfers "
    "with compute (JAX's host-offloading docs); never measured",
    "compute_efficiency": "assumed: the roofline's peak; never measured",
    "error": "assumed: what the model showed on the H200 before it was "
    "calibrated; no TPU step has been measured",
    "host_memory_bytes_per_second": "assumed: the only measurement of the host "
    f"update, on an H200's host ({H200_RUN}); the host's memory channels allow "
    "more (see `sources`)",
}
