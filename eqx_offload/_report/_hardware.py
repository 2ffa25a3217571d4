"""`Hardware`: the rates a step-time estimate prices a compiled program at.

They are for one device of a target. They give matmul throughput by precision, HBM
bandwidth, and the host link each way. They also give the host memory behind each
device, and the host's memory bandwidth and FLOP/s for host compute. There is a
table per target, sourced below. Any figure can be replaced (`dataclasses.replace`).
"""

import dataclasses
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any, Literal

import jax

from .._errors import see
from ._hardware_table import (
    H200_BOTH_WAYS,
    H200_ERROR,
    H200_FITTED,
    H200_MEASURED,
    H200_RUN,
    ROWS,
    TPU_ASSUMED,
)
from ._targets import parse


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

# The kinds of step `error` is kept for (`StepTime.kind`).
KINDS = ("device", "host link", "host compute")
Origin = Literal["measured", "nominal", "assumed"]
ORIGINS: tuple[Origin, ...] = ("measured", "nominal", "assumed")
CALIBRATION = "eqx_offload calibration"

# The rates a step uses, and the fields each rests on (`rates_text`, and the rates
# `plan`'s table shows, `_planner/_rates.py`). Every step uses the first two; a step
# that moves bytes over the host link uses "link"; one that computes on the host,
# "host memory".
GROUPS: dict[str, tuple[str, ...]] = {
    "compute": ("matmul_flops", "compute_efficiency"),
    "HBM": ("hbm_bytes_per_second",),
    "link": (
        "host_to_device_bytes_per_second",
        "device_to_host_bytes_per_second",
        "both_ways_bytes_per_second",
        "transfer_overlap",
    ),
    "host memory": ("host_memory_bytes_per_second", "host_flops"),
}
_LINK = GROUPS["link"]
_RATES = (
    "matmul_flops",
    "hbm_bytes_per_second",
    *_LINK[:2],
    "host_memory_bytes",
    "host_memory_bytes_per_second",
    "host_flops",
)
# The fields a label can name.
LABELLED = (*_RATES, *_LINK[2:], "compute_efficiency", "error")
# What a calibration file measures (`from_measurements`).
_CALIBRATED = (*_LINK, "host_memory_bytes_per_second")

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
        serves. It is the `MemoryReport.host_capacity` (on a GPU, unless JAX's cap
        on pinned host memory is lower: `MemoryReport.host_limit`). `fits_host`
        compares a report's `host_bytes` (per device) with it. It is also
        `eo.plan`'s default `host_budget`, with the same cap.
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
        where = f"`Hardware(name={self.name!r})`"
        _check_rates(where, self)
        unknown = set(self.matmul_flops) - set(PRECISIONS)
        if unknown or "bf16" not in self.matmul_flops:
            raise ValueError(
                f"{where}: `matmul_flops` has {sorted(self.matmul_flops)}. Key it by "
                "precision; it needs `'bf16'`." + see(111)
            )
        _check_share(where, "transfer_overlap", self.transfer_overlap, 0.0)
        _check_share(where, "compute_efficiency", self.compute_efficiency, 1e-9)
        _check_keys(where, self)
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
        if (text := self.labels.get(field)) is None:
            return "nominal" if field in _RATES else "assumed"
        origin = text.split(":")[0]
        assert origin in ORIGINS
        return origin  # type: ignore[return-value]

    def measured(self, source: str, **figures: Any) -> "Hardware":
        """This hardware with `figures` replaced and labelled measured by `source`
        (the run that measured them, e.g. `"my H100, 2026-11-29"`)."""
        if unknown := set(figures) - set(LABELLED):
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
        compute = {self.label(f) for f in GROUPS["compute"]}
        host = self.label("host_memory_bytes_per_second")

        def word(origins: set[str]) -> str:
            if len(origins) == 1:
                return next(iter(origins))
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
            data = json.loads(pathlib.Path(path).read_text())
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
        if (target := data.get("target")) not in TABLE:
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
        return TABLE[parse(target)[0]]  # (the target's grammar, and its errors)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"matmul_flops": dict(self.matmul_flops)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Hardware":
        """The `Hardware` `to_dict()` gave (read back from JSON, say). Saved before
        the host's rates existed, it has the defaults."""
        return cls(**{**data, "sources": tuple(data.get("sources", ()))})


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_rates(where: str, hw: Hardware) -> None:
    """The figures of `hw` that must be positive are."""
    rates = {f: getattr(hw, f) for f in _RATES if f != "matmul_flops"}
    if hw.both_ways_bytes_per_second is not None:
        rates["both_ways_bytes_per_second"] = hw.both_ways_bytes_per_second
    rates.update({f"matmul_flops[{k!r}]": v for k, v in hw.matmul_flops.items()})
    rates.update({f"error[{k!r}]": v for k, v in hw.error.items()})
    for field, value in rates.items():
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"{where}: `{field}` is {value!r}. Give a positive, finite number."
                + see(111)
            )


def _check_share(where: str, field: str, value: Any, least: float) -> None:
    if not _is_number(value) or not least <= value <= 1:
        above = " (above 0)" if least > 0 else ""
        raise ValueError(
            f"{where}: `{field}` is {value!r}. Give a share: a number from 0 to "
            f"1{above}." + see(111)
        )


def _check_keys(where: str, hw: Hardware) -> None:
    """The keys of `hw.error` are kinds of step, those of `hw.labels` fields, and
    each label starts with its origin."""
    if kinds := set(hw.error) - set(KINDS):
        raise ValueError(
            f"{where}: `error` has {sorted(kinds)}. Key it by the kind of step: "
            f"{list(KINDS)}." + see(111)
        )
    unknown = set(hw.labels) - set(LABELLED)
    if unknown or not all(str(t).split(":")[0] in ORIGINS for t in hw.labels.values()):
        raise ValueError(
            f"{where}: `labels` are by field ({', '.join(LABELLED)}) and each starts "
            "with 'measured:', 'nominal:' or 'assumed:'." + see(111)
        )


# The table: one device of each target (`_hardware_table.py` has the figures and
# their sources).
TABLE: dict[str, Hardware] = {k: Hardware(**row) for k, row in ROWS.items()}


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

for _chip in ("tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4"):
    TABLE[_chip] = dataclasses.replace(
        TABLE[_chip],
        host_memory_bytes_per_second=H200_MEASURED["host_memory_bytes_per_second"],
        labels=TPU_ASSUMED,
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
    if kind.startswith(("NVIDIA H100", "NVIDIA H200")):
        return TABLE[f"gpu-h{kind[8:11]}"]  # "NVIDIA H100 80GB HBM3": "gpu-h100"
    return TABLE[_DEVICE_KINDS[kind]] if kind in _DEVICE_KINDS else None
