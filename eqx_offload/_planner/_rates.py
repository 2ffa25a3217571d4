"""What a candidate's step-time estimate rests on, as `plan`'s table shows it: the
rates it used, each measured, nominal or assumed (`Hardware.label`), and those in
words. (Its kind of step and how far it can be off are `StepTime.kind` and
`StepTime.error`.)"""

from .._report._hardware import GROUPS, ORIGINS
from .._report._step_time import StepTime


def used(time: StepTime) -> tuple[tuple[str, str], ...]:
    """The rates `time` used, each with where it comes from (`"measured"`,
    `"nominal"`, `"assumed"`; a rate resting on several figures takes the least
    trusted of them): `(("compute", "nominal"), ("HBM", "nominal"), ("link",
    "measured"))`."""
    groups = ["compute", "HBM"]
    if time.host_to_device_bytes + time.device_to_host_bytes:
        groups.append("link")
    if time.host_compute_seconds > 0:
        groups.append("host memory")
    return tuple(
        (g, max(map(time.hardware.label, GROUPS[g]), key=ORIGINS.index)) for g in groups
    )


def text(rates: tuple[tuple[str, str], ...]) -> str:
    """The rates in words, by origin: `"link measured; compute, HBM nominal"`."""
    by = {origin: [g for g, o in rates if o == origin] for origin in ORIGINS}
    return "; ".join(f"{', '.join(names)} {o}" for o, names in by.items() if names)
