"""What a candidate's step-time estimate rests on, as `plan`'s table shows it: the
rates it used, each measured, nominal or assumed (`Hardware.label`), and how far
it can be off (`StepTime.error`)."""

from typing import Any

from .._report._step_time import StepTime


# The error of an estimate whose `StepTime` states none (a report saved before it
# existed): what the model showed on the H200 before it was calibrated for a step
# without host traffic (0.72-0.85 of the measured step).
UNSTATED_ERROR = 0.3

# The rates a step uses, and the `Hardware` fields each rests on. Every step uses
# the first two; a step that moves bytes over the host link uses "link"; one that
# computes on the host, "host memory".
_GROUPS: dict[str, tuple[str, ...]] = {
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
# From the most trusted to the least.
_ORIGINS = ("measured", "nominal", "assumed")


def error_of(time: StepTime | None) -> float:
    """How far `time` can be off, relative (0 without a step time: the CPU
    backend, where the smallest footprint is chosen)."""
    if time is None:
        return 0.0
    return float(getattr(time, "error", UNSTATED_ERROR))


def error_origin(time: StepTime) -> str:
    """Where `time.error` comes from: `"measured"` (what the model showed on
    measured steps), `"assumed"`, or `"unstated"` (a `StepTime` without one)."""
    if not hasattr(time, "error"):
        return "unstated"
    return _origin(time.hardware, ("error",), default="assumed")


def kind_of(time: StepTime | None) -> str | None:
    """What the step's host traffic makes it: `"device"`, `"host link"` or
    `"host compute"` (`StepTime.kind`)."""
    if time is None:
        return None
    kind = getattr(time, "kind", None)
    if kind is not None:
        return str(kind)
    if time.host_compute_seconds > 0:
        return "host compute"
    moved = time.host_to_device_bytes + time.device_to_host_bytes
    return "host link" if moved else "device"


def used(time: StepTime | None) -> tuple[tuple[str, str], ...]:
    """The rates `time` used, each with where it comes from (`"measured"`,
    `"nominal"`, `"assumed"`; a rate resting on several figures takes the least
    trusted of them): `(("compute", "nominal"), ("HBM", "nominal"), ("link",
    "measured"))`."""
    if time is None:
        return ()
    groups = ["compute", "HBM"]
    if time.host_to_device_bytes + time.device_to_host_bytes:
        groups.append("link")
    if time.host_compute_seconds > 0:
        groups.append("host memory")
    return tuple((g, _origin(time.hardware, _GROUPS[g])) for g in groups)


def text(rates: tuple[tuple[str, str], ...]) -> str:
    """The rates in words, by origin: `"link measured; compute, HBM nominal"`."""
    parts = []
    for origin in _ORIGINS:
        names = [g for g, o in rates if o == origin]
        if names:
            parts.append(f"{', '.join(names)} {origin}")
    return "; ".join(parts)


def _origin(hardware: Any, fields: tuple[str, ...], default: str = "nominal") -> str:
    """The least trusted origin of `fields` (`Hardware.label`), or `default`
    where the hardware labels none of them."""
    label = getattr(hardware, "label", None)
    if label is None:  # (a `Hardware` from before labels)
        return default
    origins = set()
    for field in fields:
        try:
            origins.add(label(field))
        except ValueError:  # a field this `Hardware` does not label
            continue
    return next((o for o in reversed(_ORIGINS) if o in origins), default)
