"""`Hardware`: the rates a step-time estimate prices a compiled program at.

They are for one device of a target. They give matmul throughput by precision, HBM
bandwidth, and the host link each way. They also give the host memory behind each
device, and the host's memory bandwidth and FLOP/s for host compute. There is a
table per target, sourced below. Any figure can be replaced (`dataclasses.replace`).
"""

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any, Literal

import jax

from .._errors import see


# Matmul precisions, as the compiled program runs them (`_step_time.precision`):
# "bf16x3"/"bf16x6" are float32 dots at `Precision.HIGH`/`HIGHEST` on a TPU, which
# take 3 or 6 bfloat16 passes (JAX's `jax.lax.Precision` docs); "tf32" is a
# float32 dot at the default (or `HIGH`) precision on an H100, "f32" at `HIGHEST`.
PRECISIONS = ("fp8", "int8", "bf16", "bf16x3", "bf16x6", "tf32", "f32", "f64")

# A precision the hardware has no rate for runs at the next one listed here (as
# XLA converts: fp8 and int8 to bfloat16 on chips without them).
FALLBACK = {
    "fp8": "bf16",
    "int8": "bf16",
    "f64": "f32",
    "f32": "bf16x6",
    "tf32": "f32",
    "bf16x6": "bf16",
    "bf16x3": "bf16",
}

_GB = 1e9
_T = 1e12


# The kinds of step `error` is kept for (`StepTime.kind`).
KINDS = ("device", "host link", "host compute")
Origin = Literal["measured", "nominal", "assumed"]
ORIGINS: tuple[Origin, ...] = ("measured", "nominal", "assumed")
CALIBRATION = "eqx_offload calibration"

_LINK = (
    "host_to_device_bytes_per_second",
    "device_to_host_bytes_per_second",
    "both_ways_bytes_per_second",
    "transfer_overlap",
)
_RATES = (
    "matmul_flops",
    "hbm_bytes_per_second",
    "host_to_device_bytes_per_second",
    "device_to_host_bytes_per_second",
    "host_memory_bytes",
    "host_memory_bytes_per_second",
    "host_flops",
)
# The fields a label can name.
LABELLED = (
    *_RATES,
    "both_ways_bytes_per_second",
    "transfer_overlap",
    "compute_efficiency",
    "error",
)
# What a calibration file measures (`from_measurements`).
_CALIBRATED = (
    "host_to_device_bytes_per_second",
    "device_to_host_bytes_per_second",
    "both_ways_bytes_per_second",
    "transfer_overlap",
    "host_memory_bytes_per_second",
)

# The error of an estimate nothing has measured: what the model showed on the H200
# before it was calibrated (0.72-0.85 of the measured step on the device, 0.31-0.76
# with the host link or host compute).
_ASSUMED_ERROR = {"device": 0.3, "host link": 0.7, "host compute": 0.7}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What one device of a target can do, for `MemoryReport.time`.

    - `name`: e.g. `"tpu-v5e"`.
    - `matmul_flops`: peak dense matmul FLOP/s by precision. The precisions are
        `"bf16"`, `"int8"`, `"fp8"`, `"tf32"`, `"f32"`, and on TPUs
        `"bf16x3"`/`"bf16x6"`. The last two are a float32 dot at `HIGH`/`HIGHEST`
        precision. A precision without a rate runs at a slower one. So `fp8`/`int8`
        run at `bf16`, and `f32` at `bf16x6`.
    - `hbm_bytes_per_second`: device memory bandwidth.
    - `host_to_device_bytes_per_second`, `device_to_host_bytes_per_second`: the
        host link of one device, each way.
    - `host_memory_bytes`: host RAM per device: the host's RAM over the devices it
        serves. It is the `MemoryReport.host_capacity`. `fits_host` compares a
        report's `host_bytes` (per device) with it. It is also `eo.plan`'s default
        `host_budget`.
    - `sources`: where the figures come from.
    - `host_memory_bytes_per_second`, `host_flops`: the host's memory bandwidth
        and its CPUs' float32 FLOP/s. Both are per device: the host's over the
        devices it serves. Host compute is priced at these rates. That covers
        `compute_on("device_host")` and `Policy(update="host")`. The table's are
        estimates from the hosts' memory channels and cores, until measured.
        Without them, they are 50 GB/s and 1 TFLOP/s.

    How the host link behaves, as a step-time estimate prices it (`MemoryReport.time`):

    - `both_ways_bytes_per_second`: the link's total rate (both directions together)
        while both directions move at once. `None`: full duplex, the sum of the two
        rates. On the H200 it measured the rate of one direction: the two directions
        took turns.
    - `transfer_overlap`: the share of a transfer's time that can run beside the
        device work scheduled between its start and its done (0 to 1). The rest
        holds the device up. On the H200 it measured 0: nothing overlapped.
    - `compute_efficiency`: the share of the per-instruction roofline (matmul FLOPs
        at peak, or HBM bytes at its bandwidth) that device work achieves (0 to 1).
    - `error`: how far the estimate has been off, relative, by the kind of step
        (`StepTime.kind`: `"device"`, `"host link"`, `"host compute"`). A measured
        step is expected within `seconds × (1 ± error)`.
    - `labels`: where each figure comes from, by field name. A label starts with
        `measured:` (and names the run), `nominal:` (a datasheet or a published
        figure) or `assumed:`. `label(field)` gives the first word.

    `Hardware.of(target)` is the table's entry for a `memory_report` target.
    `Hardware.from_measurements(path)` is a table entry with what
    `benchmarks/gpu_check.py --calibrate` measured. To replace figures yourself,
    use `eo.Hardware.of("gpu-h100").measured("my run",
    host_to_device_bytes_per_second=25e9)` (labelled measured), or
    `dataclasses.replace` (which keeps the old labels).
    Pass it as `memory_report(..., hardware=...)` or `plan(..., hardware=...)`.
    """

    name: str
    matmul_flops: Mapping[str, float | int]
    hbm_bytes_per_second: float | int
    host_to_device_bytes_per_second: float | int
    device_to_host_bytes_per_second: float | int
    host_memory_bytes: int
    sources: tuple[str, ...] = ()
    # After `sources`, so that positional constructions from before they existed
    # still mean what they meant.
    host_memory_bytes_per_second: float | int = 50 * 10**9
    host_flops: float | int = 10**12
    both_ways_bytes_per_second: float | int | None = None
    transfer_overlap: float | int = 1.0
    compute_efficiency: float | int = 1.0
    error: Mapping[str, float | int] = dataclasses.field(
        default_factory=lambda: dict(_ASSUMED_ERROR)
    )
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        rates: dict[str, Any] = {
            "hbm_bytes_per_second": self.hbm_bytes_per_second,
            "host_to_device_bytes_per_second": self.host_to_device_bytes_per_second,
            "device_to_host_bytes_per_second": self.device_to_host_bytes_per_second,
            "host_memory_bytes": self.host_memory_bytes,
            "host_memory_bytes_per_second": self.host_memory_bytes_per_second,
            "host_flops": self.host_flops,
        }
        if self.both_ways_bytes_per_second is not None:
            rates["both_ways_bytes_per_second"] = self.both_ways_bytes_per_second
        rates.update({f"matmul_flops[{k!r}]": v for k, v in self.matmul_flops.items()})
        rates.update({f"error[{k!r}]": v for k, v in self.error.items()})
        for field, value in rates.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"`Hardware(name={self.name!r})`: `{field}` is {value!r}. Give a "
                    "positive, finite number." + see(111)
                )
        unknown = set(self.matmul_flops) - set(PRECISIONS)
        if unknown or "bf16" not in self.matmul_flops:
            raise ValueError(
                f"`Hardware(name={self.name!r})`: `matmul_flops` has "
                f"{sorted(self.matmul_flops)}. Key it by precision; it needs `'bf16'`."
                + see(111)
            )
        for field, above_zero in (
            ("transfer_overlap", False),
            ("compute_efficiency", True),
        ):
            value = getattr(self, field)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not (0 < value <= 1 if above_zero else 0 <= value <= 1):
                raise ValueError(
                    f"`Hardware(name={self.name!r})`: `{field}` is {value!r}. Give a "
                    f"share: a number from 0 to 1{' (above 0)' if above_zero else ''}."
                    + see(111)
                )
        kinds = set(self.error) - set(KINDS)
        if kinds:
            raise ValueError(
                f"`Hardware(name={self.name!r})`: `error` has {sorted(kinds)}. Key it "
                f"by the kind of step: {list(KINDS)}." + see(111)
            )
        labelled = set(self.labels) - set(LABELLED)
        if labelled or not all(
            str(text).split(":")[0] in ORIGINS for text in self.labels.values()
        ):
            raise ValueError(
                f"`Hardware(name={self.name!r})`: `labels` are by field "
                f"({', '.join(LABELLED)}) and each starts with 'measured:', "
                "'nominal:' or 'assumed:'." + see(111)
            )
        object.__setattr__(self, "matmul_flops", dict(self.matmul_flops))
        object.__setattr__(self, "error", {**_ASSUMED_ERROR, **self.error})
        object.__setattr__(self, "labels", dict(self.labels))

    def label(self, field: str) -> Origin:
        """Where `field`'s figure comes from: `"measured"`, `"nominal"` or
        `"assumed"`. A field without a label is nominal if it is a rate of the
        hardware, and assumed if it is a parameter of the model (the link's
        behaviour, the efficiency, the error)."""
        if field not in LABELLED:
            raise ValueError(
                f"`Hardware.label({field!r})`: not a labelled field. Use one of "
                f"{', '.join(LABELLED)}."
            )
        text = self.labels.get(field)
        if text is None:
            return "nominal" if field in _RATES else "assumed"
        origin = text.split(":")[0]
        assert origin in ORIGINS
        return origin  # type: ignore[return-value]

    def measured(self, source: str, **figures: Any) -> "Hardware":
        """This hardware with `figures` replaced and labelled measured by `source`
        (the run that measured them, e.g. `"my H100, 2026-11-29"`)."""
        unknown = set(figures) - set(LABELLED)
        if unknown:
            raise ValueError(
                f"`Hardware.measured(...)`: {sorted(unknown)} are not figures of a "
                f"`Hardware`. Use {', '.join(LABELLED)}."
            )
        labels = {**self.labels, **{f: f"measured: {source}" for f in figures}}
        return dataclasses.replace(self, **figures, labels=labels)

    def rates_text(self) -> str:
        """Which of the link's and the compute's figures are measured, in words
        ("link measured, compute nominal")."""
        link = {self.label(f) for f in _LINK}
        compute = {self.label(f) for f in ("matmul_flops", "compute_efficiency")}
        host = self.label("host_memory_bytes_per_second")

        def word(origins: set[str]) -> str:
            for origin in ORIGINS:
                if origin in origins and len(origins) == 1:
                    return origin
            return "partly measured" if "measured" in origins else "nominal, assumed"

        return f"link {word(link)}, compute {word(compute)}, host memory {host}"

    @classmethod
    def from_measurements(cls, path: "str | os.PathLike[str]") -> "Hardware":
        """The table's entry for the GPU `benchmarks/gpu_check.py --calibrate`
        measured, with its figures replaced by what it measured (labelled
        measured, with the file and the date).

        It reads the file `--calibrate` wrote (JSON). Its link rates, the rate of
        both directions at once, the share of a copy that overlapped a matmul,
        and the host update's memory rate replace the table's; its matmul rate
        sets `compute_efficiency` (measured over the table's peak, at most 1).
        """
        import json

        where = f"`Hardware.from_measurements({str(path)!r})`"
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{where}: cannot read it ({e}). Give the file "
                "`python benchmarks/gpu_check.py --calibrate --json PATH` wrote."
            ) from e
        if not isinstance(data, dict) or data.get("format") != CALIBRATION:
            raise ValueError(
                f"{where}: not a calibration file (its `format` is not "
                f"{CALIBRATION!r}). Give the file `python benchmarks/gpu_check.py "
                "--calibrate --json PATH` wrote."
            )
        target = data.get("target")
        if target not in TABLE:
            raise ValueError(
                f"{where}: it measured {data.get('device')!r} (`target` "
                f"{target!r}), which has no row in `eo.Hardware`'s table "
                f"({', '.join(TABLE)}). Calibrate on one of those."
            )
        missing = [k for k in _CALIBRATED if not isinstance(data.get(k), (int, float))]
        if missing:
            raise ValueError(
                f"{where}: it lacks the figures {missing}. Run `--calibrate` again "
                "with this version of eqx_offload."
            )
        base = TABLE[target]
        figures: dict[str, Any] = {k: float(data[k]) for k in _CALIBRATED}
        figures["transfer_overlap"] = min(max(figures["transfer_overlap"], 0.0), 1.0)
        if isinstance(data.get("matmul_flops_bf16"), (int, float)):
            measured = float(data["matmul_flops_bf16"]) / base.matmul_flops["bf16"]
            figures["compute_efficiency"] = min(max(measured, 1e-3), 1.0)
        source = f"{path} ({data.get('device')}, {data.get('date')})"
        return base.measured(source, **figures)

    def flops_per_second(self, precision: str) -> tuple[str, float]:
        """The precision a dot of `precision` runs at here, and its rate."""
        while precision not in self.matmul_flops:
            precision = FALLBACK.get(precision, "bf16")
        return precision, self.matmul_flops[precision]

    @classmethod
    def of(cls, target: str) -> "Hardware":
        """The table's entry for one device of `target` (`"tpu-v5e"`,
        `"tpu-v5e:4x4"`, `"gpu-h100:8"`, ...)."""
        from . import _targets  # (the target's grammar, and its errors)

        chip, _ = _targets.parse(target)
        return TABLE[chip]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"matmul_flops": dict(self.matmul_flops)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Hardware":
        """The `Hardware` `to_dict()` gave (read back from JSON, say). Saved before
        the host's rates existed, it has the defaults."""
        return cls(**{**data, "sources": tuple(data.get("sources", ()))})


def _tpu(bf16: float, int8: float | None, **rest: Any) -> dict[str, Any]:
    flops = {"bf16": bf16, "bf16x3": bf16 / 3, "bf16x6": bf16 / 6}
    if int8 is not None:
        flops["int8"] = int8
    return {"matmul_flops": flops, **rest}


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
    "host memory bandwidth and FLOP/s per device: ESTIMATES until measured, from "
    "the host's memory channels (a DDR4-3200 channel moves 25.6 GB/s, DDR5-4800 "
    "38.4 GB/s) and cores (float32 FMA: 16 FLOPs a cycle per 256-bit unit, two "
    "units a core), over the devices the host serves; {}"
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
TABLE: dict[str, Hardware] = {
    "tpu-v5e": Hardware(
        "tpu-v5e",
        **_tpu(
            197 * _T,
            393 * _T,
            hbm_bytes_per_second=819 * _GB,
            host_to_device_bytes_per_second=15 * _GB,
            device_to_host_bytes_per_second=15 * _GB,
            host_memory_bytes=48 * 10**9,
        ),
        sources=(
            _TPU_SPECS.format("v5e") + ": 197 TFLOP/s bf16, 393 TOP/s int8, 16 GB "
            "of HBM at 819 GB/s; VM ct5lp-hightpu-4t: 4 chips, 192 GB of memory "
            "(48 GB a chip)",
            _SCALING_BOOK + " (v5e: the general figure; PCIe generation not published)",
            _PRECISION,
            _HOST.format(
                "v5e: 8 chips a host, VM ct5lp-hightpu-8t 224 vCPUs on 2 NUMA nodes "
                "(the v5e page); CPU not published: taken as two sockets of eight "
                "DDR4-3200 channels (410 GB/s, 51 GB/s a chip) and 112 cores at 2.5 "
                "GHz with AVX2 FMA (9 TFLOP/s, 1.1 a chip)"
            ),
        ),
        host_memory_bytes_per_second=51 * _GB,
        host_flops=1.1 * _T,
    ),
    "tpu-v6e": Hardware(
        "tpu-v6e",
        **_tpu(
            918 * _T,
            1836 * _T,
            hbm_bytes_per_second=1640 * _GB,
            host_to_device_bytes_per_second=32 * _GB,
            device_to_host_bytes_per_second=32 * _GB,
            host_memory_bytes=180 * 10**9,
        ),
        sources=(
            _TPU_SPECS.format("v6e") + ": 918 TFLOP/s bf16, 1836 TOP/s int8, 32 GB "
            "of HBM at 1640 GB/s, PCIe Gen5 to the host; VM ct6e-standard-4t: 4 "
            "chips, 720 GB of memory (180 GB a chip)",
            _SCALING_BOOK,
            _PRECISION,
            _HOST.format(
                "v6e: 8 chips a host (the v6e page); CPU and memory channels not "
                "published: taken as an 8-GPU node's host, two sockets of eight "
                "DDR5-4800 channels (614 GB/s, 77 GB/s a chip) and 104 cores at 2 "
                "GHz with AVX-512 FMA (13 TFLOP/s, 1.6 a chip)"
            ),
        ),
        host_memory_bytes_per_second=77 * _GB,
        host_flops=1.6 * _T,
    ),
    "tpu-v5p": Hardware(
        "tpu-v5p",
        **_tpu(
            459 * _T,
            918 * _T,
            hbm_bytes_per_second=2765 * _GB,
            host_to_device_bytes_per_second=15 * _GB,
            device_to_host_bytes_per_second=15 * _GB,
            host_memory_bytes=112 * 10**9,
        ),
        sources=(
            _TPU_SPECS.format("v5p-training") + ": 459 TFLOP/s bf16, 95 GB of HBM "
            "at 2765 GB/s, a 4-chip VM with 448 GB of RAM (112 GB a chip); int8 "
            "918 TOP/s from the scaling book",
            _SCALING_BOOK + " (v5p: the general figure; PCIe generation not published)",
            _PRECISION,
            _HOST.format(
                "v5p: 4 chips a host, 208 vCPUs on 2 NUMA nodes (the v5p-training "
                "page); CPU not published: taken as two sockets of eight DDR5-4800 "
                "channels (614 GB/s, 154 GB/s a chip) and 104 cores at 2 GHz with "
                "AVX-512 FMA (13 TFLOP/s, 3.3 a chip)"
            ),
        ),
        host_memory_bytes_per_second=154 * _GB,
        host_flops=3.3 * _T,
    ),
    # A `tpu-v4` device is one TensorCore, half a chip (`_targets.HBM_BYTES`).
    "tpu-v4": Hardware(
        "tpu-v4",
        **_tpu(
            275 * _T / 2,
            275 * _T / 2,
            hbm_bytes_per_second=1200 * _GB / 2,
            host_to_device_bytes_per_second=8 * _GB,
            device_to_host_bytes_per_second=8 * _GB,
            host_memory_bytes=407 * 10**9 // 8,
        ),
        sources=(
            _TPU_SPECS.format("v4") + ": 275 TFLOP/s (bf16 or int8), 32 GiB of HBM "
            "at 1200 GB/s per chip; VM ct4p-hightpu-4t: 4 chips, 407 GB of memory; "
            "all halved for one of a chip's two TensorCores",
            _SCALING_BOOK + " (v4: 16 GB/s a chip, halved)",
            _PRECISION,
            _HOST.format(
                "v4: 4 chips (8 TensorCores) a host; CPU not published: taken as "
                "two sockets of eight DDR4-3200 channels (410 GB/s, 51 GB/s a "
                "TensorCore) and 120 cores at 2.5 GHz with AVX2 FMA (9.6 TFLOP/s, "
                "1.2 a TensorCore)"
            ),
        ),
        host_memory_bytes_per_second=51 * _GB,
        host_flops=1.2 * _T,
    ),
    "gpu-h100": Hardware(
        "gpu-h100",
        _HOPPER,
        hbm_bytes_per_second=3350 * _GB,
        host_to_device_bytes_per_second=64 * _GB,
        device_to_host_bytes_per_second=64 * _GB,
        host_memory_bytes=234 * 10**9,
        sources=(
            _NVIDIA.format("h100") + "; 80 GB of HBM3 at 3.35 TB/s",
            "https://cloud.google.com/compute/docs/gpus: a3-highgpu-8g, 8 H100s "
            "with 1,872 GB of memory (234 GB a GPU), 208 vCPUs",
            _PRECISION,
            _HOST.format(
                "an 8-H100 node: two sockets of eight DDR5-4800 channels (614 GB/s, "
                "77 GB/s a GPU) and 104 cores (a3-highgpu-8g's 208 vCPUs) at 2 GHz "
                "with AVX-512 FMA (13 TFLOP/s, 1.6 a GPU)"
            ),
        ),
        host_memory_bytes_per_second=77 * _GB,
        host_flops=1.6 * _T,
    ),
    "gpu-h200": Hardware(
        "gpu-h200",
        _HOPPER,
        hbm_bytes_per_second=4800 * _GB,
        host_to_device_bytes_per_second=64 * _GB,
        device_to_host_bytes_per_second=64 * _GB,
        host_memory_bytes=256 * 10**9,
        sources=(
            _NVIDIA.format("h200") + "; 141 GB of HBM3e at 4.8 TB/s",
            "NVIDIA's MLPerf Training system description of an 8-H200 node: 2 TB "
            "of memory (32 x 64 GB; 256 GB a GPU)",
            _PRECISION,
            _HOST.format(
                "an 8-H200 node, as the H100's: two sockets of eight DDR5-4800 "
                "channels (614 GB/s, 77 GB/s a GPU) and 104 cores at 2 GHz with "
                "AVX-512 FMA (13 TFLOP/s, 1.6 a GPU)"
            ),
        ),
        host_memory_bytes_per_second=77 * _GB,
        host_flops=1.6 * _T,
    ),
}

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


def _calibrated(hw: Hardware, run: str, how: str) -> Hardware:
    """`hw` with the H200's measured and fitted figures, labelled `how` ("measured"
    or "assumed": an H100 takes the H200's until one is measured)."""
    fitted = f"fitted to the 0.2B steps of {run}"
    labels = {
        **{k: f"{how}: {run}" for k in H200_MEASURED},
        **{k: f"{how}: {fitted}" for k in H200_FITTED},
        "both_ways_bytes_per_second": "assumed: one direction's rate; no step of "
        f"{run} had both directions in flight at once",
        "error": f"{how}: {run} and gpu_check_h200_gpt09b.json, all 11 steps",
    }
    return dataclasses.replace(
        hw,
        **H200_MEASURED,
        **H200_FITTED,
        both_ways_bytes_per_second=H200_BOTH_WAYS,
        error=H200_ERROR,
        labels=labels,
    )


TABLE["gpu-h200"] = _calibrated(TABLE["gpu-h200"], H200_RUN, "measured")
TABLE["gpu-h100"] = _calibrated(
    TABLE["gpu-h100"], f"an H200's, until an H100 is measured: {H200_RUN}", "assumed"
)

_TPU_ASSUMED = {
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
for _chip in ("tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4"):
    TABLE[_chip] = dataclasses.replace(
        TABLE[_chip],
        host_memory_bytes_per_second=H200_MEASURED["host_memory_bytes_per_second"],
        labels=_TPU_ASSUMED,
    )


# `jax.Device.device_kind` of the devices the table describes, for a report
# compiled on one (`target=None`).
_DEVICE_KINDS = {
    "TPU v5 lite": "tpu-v5e",
    "TPU v5e": "tpu-v5e",
    "TPU v6 lite": "tpu-v6e",
    "TPU v6e": "tpu-v6e",
    "TPU v5": "tpu-v5p",
    "TPU v5p": "tpu-v5p",
    "TPU v4": "tpu-v4",
}


def of_this_backend() -> Hardware | None:
    """The table's entry for this backend's first device, or None.

    There is one for a TPU or an H100/H200 it runs on. The CPU and other devices
    have none.
    """
    kind = jax.devices()[0].device_kind
    if kind in _DEVICE_KINDS:
        return TABLE[_DEVICE_KINDS[kind]]
    if kind.startswith("NVIDIA H100"):
        return TABLE["gpu-h100"]
    if kind.startswith("NVIDIA H200"):
        return TABLE["gpu-h200"]
    return None
