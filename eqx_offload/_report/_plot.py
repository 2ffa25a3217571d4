"""Pictures of memory reports: device and host bytes by category, stacked bars,
several reports side by side (matplotlib, the `plot` extra)."""

import zlib
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, TYPE_CHECKING

from .._errors import see
from ._units import time_text


if TYPE_CHECKING:  # an import cycle, not a type switch: `MemoryReport.plot` calls us
    from ._memory_report_type import MemoryReport

_MEMORIES = ("device", "host")
_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}
# Fixed colours per category; saved activations take shades of one hue by name.
_COLOURS = {
    "parameters": "#4c72b0",
    "optimizer state": "#dd8452",
    "other arguments, tile padding": "#8c8c8c",
    "temporaries": "#c7c7c7",
    "host compute temporaries": "#da8bc3",
    "new outputs": "#937860",
    # Saved activations without a checkpoint name; named ones are shades of green.
    "saved: (other)": "#b5cf6b",
    "saved: (unnamed, in stacked layers)": "#8172b2",
}


def categories(report: "MemoryReport", memory: str) -> dict[str, int]:
    """The footprint of one memory (`"device"` or `"host"`) of a report, split so
    that the parts add up to it: parameters, optimizer state, other arguments
    (the batch; on a TPU also the padding of every argument to the compiler's
    tiles, which the parameter and state figures, as traced, do not count),
    saved activations by checkpoint name (`"saved: <name>"`, as traced; one-chip
    reports only; on the CPU, whose estimate counts temporaries as device memory,
    all of them on the device), the rest of the temporaries, what host compute
    takes while it runs (host only, `MemoryReport.host_compute_temp`), and outputs
    not written in place."""
    parts = report.device if memory == "device" else report.host

    def of(by_kind: dict[str, int] | None) -> int:
        if by_kind is None:
            return 0
        if memory == "device":
            return by_kind.get("device", 0)
        return sum(v for k, v in by_kind.items() if k != "device")

    params, opt_state = of(report.params), of(report.opt_state)
    argument = parts["argument"]
    # The compiler pads arrays to its tiles: clamp so that no part is negative.
    params = min(params, argument)
    opt_state = min(opt_state, argument - params)
    out = {
        "parameters": params,
        "optimizer state": opt_state,
        "other arguments, tile padding": argument - params - opt_state,
    }
    temp = parts["temp"]
    if report.residuals is not None and (report.chips or 1) == 1:
        saved: dict[str, int] = defaultdict(int)
        for r in report.residuals:
            # The CPU's estimate counts every temporary as device memory.
            on_device = report.estimate or r.memory_kind == "device"
            if on_device == (memory == "device"):
                saved[r.name] += r.bytes
        for name, n in saved.items():
            n = min(n, temp)
            out[f"saved: {name}"] = n
            temp -= n
    out["temporaries"] = temp
    if memory == "host" and report.host_compute_temp:
        out["host compute temporaries"] = report.host_compute_temp
    out["new outputs"] = max(parts["output"] - parts["alias"], 0)
    return out


def _near(report: "MemoryReport", device: float | int) -> bool:
    """Whether a device bar comes within half of the chip's capacity (only then is
    the capacity drawn: far above the bars it would flatten them)."""
    return report.capacity is not None and device >= report.capacity / 2


def plot(
    reports: Sequence["MemoryReport"],
    labels: Sequence[str] | None = None,
    *,
    ax: Any = None,
    unit: str | None = None,
    title: str | None = None,
) -> Any:
    """Draws `reports` side by side (see `MemoryReport.plot`); returns the axes."""
    try:
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            "`MemoryReport.plot` needs matplotlib. Install it: `pip install "
            "matplotlib` (from a clone, the `plot` extra)."
        ) from e
    if unit is not None and unit not in _UNITS:
        raise ValueError(
            f"`MemoryReport.plot(unit={unit!r})` is not a unit. Use one of "
            f"{', '.join(_UNITS)}." + see(102)
        )
    if labels is None:
        labels = [r.target for r in reports]
        if len(set(labels)) < len(labels):
            labels = [f"{i}: {r.target}" for i, r in enumerate(reports)]
    labels = list(labels)
    if len(labels) != len(reports):
        raise ValueError(
            f"`MemoryReport.plot(labels=...)`: {len(labels)} labels for "
            f"{len(reports)} reports. Give one label per report." + see(102)
        )
    split = [{m: categories(r, m) for m in _MEMORIES} for r in reports]
    if unit is None:  # the largest unit in which the tallest bar is at least 1
        tallest = max(sum(s[m].values()) for s in split for m in _MEMORIES)
        unit = next((u for u, n in _UNITS.items() if tallest >= n), "B")
    scale = _UNITS[unit]
    names = list(dict.fromkeys(k for s in split for m in _MEMORIES for k in s[m]))
    cmap = plt.get_cmap("Greens")
    colours: dict[str, Any] = dict(_COLOURS)
    for n in names:
        if n not in colours:  # a checkpoint name: the same shade in every figure
            colours[n] = cmap(0.4 + 0.5 * (zlib.crc32(n.encode()) % 1000) / 999)
    if ax is None:
        width = max(4.0, 1.6 * len(reports) + 2.5)
        _, ax = plt.subplots(figsize=(width, 4.5), layout="constrained")
    positions, ticks = [], []
    for i, (report, s) in enumerate(zip(reports, split)):
        for j, memory in enumerate(_MEMORIES):
            x = 3 * i + j
            positions.append(x)
            ticks.append(memory)
            bottom = 0.0
            for name in names:
                height = s[memory].get(name, 0) / scale
                if height > 0:
                    ax.bar(x, height, bottom=bottom, color=colours[name], width=0.8)
                    bottom += height
    near = {r.capacity for r in reports if r.capacity and _near(r, r.device_bytes)}
    for capacity in sorted(c for c in near if c is not None):
        ax.axhline(capacity / scale, color="#c44e52", linestyle="dashed", linewidth=1)
    ax.set_xticks(positions, ticks, fontsize=10 if len(reports) <= 3 else 8)
    for i, (label, report) in enumerate(zip(labels, reports)):
        if report.time is not None:  # the estimated step time under the label
            t = report.time
            label += f"\n{time_text(t.seconds)} a step ({t.bound})"
            if t.host_compute_seconds:
                label += f"\nhost compute {time_text(t.host_compute_seconds)}"
        ax.annotate(
            label,
            xy=(3 * i + 0.5, 0),
            xycoords=("data", "axes fraction"),
            xytext=(0, -24),
            textcoords="offset points",
            ha="center",
            va="top",
        )
    ax.set_ylabel(f"{unit} per chip" if reports[0].chips else unit)
    used = [
        n for n in names if any(s[m].get(n, 0) > 0 for s in split for m in _MEMORIES)
    ]
    handles = [Patch(color=colours[n], label=n) for n in reversed(used)]
    if any(_near(r, r.device_bytes) for r in reports):
        handles.append(
            Patch(facecolor="none", edgecolor="#c44e52", label="chip capacity")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    if title is not None:
        ax.set_title(title)
    return ax
