"""Pictures of memory reports: device and host bytes by category, stacked bars,
several reports side by side (matplotlib, the `plot` extra). A report is read by
its fields: `MemoryReport.plot` calls this module, which imports nothing of it."""

import zlib
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from .._errors import see
from ._units import host_total, time_text


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


def categories(report: Any, memory: str) -> dict[str, int]:
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
        by_kind = by_kind or {}
        return by_kind.get("device", 0) if memory == "device" else host_total(by_kind)

    argument = parts["argument"]
    # The compiler pads arrays to its tiles: clamp so that no part is negative.
    params = min(of(report.params), argument)
    opt_state = min(of(report.opt_state), argument - params)
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


def _near(report: Any) -> bool:
    """Whether a device bar comes within half of the chip's capacity (only then is
    the capacity drawn: far above the bars it would flatten them)."""
    return bool(report.capacity) and report.device_bytes >= report.capacity / 2


def plot(
    reports: Sequence[Any],
    labels: Sequence[str] | None = None,
    *,
    ax: Any = None,
    unit: str | None = None,
    title: str | None = None,
) -> Any:
    """Draws `reports` side by side (see `MemoryReport.plot`); returns the axes."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "`MemoryReport.plot` needs matplotlib. Install it: `pip install "
            "matplotlib` (from a clone, the `plot` extra)."
        ) from e
    labels = _labels(reports, labels, unit)
    split = [{m: categories(r, m) for m in _MEMORIES} for r in reports]
    unit = unit or _unit(split)
    names = list(dict.fromkeys(k for s in split for m in _MEMORIES for k in s[m]))
    colours = _colours(names, plt.get_cmap("Greens"))
    if ax is None:
        width = max(4.0, 1.6 * len(reports) + 2.5)
        _, ax = plt.subplots(figsize=(width, 4.5), layout="constrained")
    _bars(ax, split, names, colours, _UNITS[unit])
    near = {r.capacity for r in reports if _near(r)}
    for capacity in sorted(near):
        ax.axhline(
            capacity / _UNITS[unit], color="#c44e52", linestyle="dashed", linewidth=1
        )
    for i, (label, report) in enumerate(zip(labels, reports)):
        ax.annotate(
            _label(label, report.time),
            xy=(3 * i + 0.5, 0),
            xycoords=("data", "axes fraction"),
            xytext=(0, -24),
            textcoords="offset points",
            ha="center",
            va="top",
        )
    ax.set_ylabel(f"{unit} per chip" if reports[0].chips else unit)
    _legend(ax, _used(names, split), colours, bool(near))
    if title is not None:
        ax.set_title(title)
    return ax


def _labels(
    reports: Sequence[Any], labels: Sequence[str] | None, unit: str | None
) -> list[str]:
    """One label per report (by default its target), the unit checked."""
    if unit is not None and unit not in _UNITS:
        raise ValueError(
            f"`MemoryReport.plot(unit={unit!r})` is not a unit. Use one of "
            f"{', '.join(_UNITS)}." + see(102)
        )
    if labels is None:
        labels = [r.target for r in reports]
        if len(set(labels)) < len(labels):
            labels = [f"{i}: {r.target}" for i, r in enumerate(reports)]
    if len(labels) != len(reports):
        raise ValueError(
            f"`MemoryReport.plot(labels=...)`: {len(labels)} labels for "
            f"{len(reports)} reports. Give one label per report." + see(102)
        )
    return list(labels)


def _unit(split: list[dict[str, dict[str, int]]]) -> str:
    """The largest unit in which the tallest bar is at least 1."""
    tallest = max(sum(s[m].values()) for s in split for m in _MEMORIES)
    return next((u for u, n in _UNITS.items() if tallest >= n), "B")


def _used(names: list[str], split: list[dict[str, dict[str, int]]]) -> list[str]:
    """The categories some bar shows."""
    return [
        n for n in names if any(s[m].get(n, 0) > 0 for s in split for m in _MEMORIES)
    ]


def _colours(names: list[str], cmap: Any) -> dict[str, Any]:
    """Each category's colour; a checkpoint name's the same shade in every figure."""
    shade = {n: 0.4 + 0.5 * (zlib.crc32(n.encode()) % 1000) / 999 for n in names}
    return {n: cmap(s) for n, s in shade.items() if n not in _COLOURS} | _COLOURS


def _bars(
    ax: Any, split: list[dict], names: list[str], colours: dict, scale: int
) -> None:
    """A stacked bar per report and memory, two apart for each report."""
    for i, s in enumerate(split):
        for j, memory in enumerate(_MEMORIES):
            bottom = 0.0
            for name in names:
                if (height := s[memory].get(name, 0) / scale) > 0:
                    ax.bar(3 * i + j, height, bottom=bottom, color=colours[name])
                    bottom += height
    positions = [3 * i + j for i in range(len(split)) for j in range(len(_MEMORIES))]
    ticks = list(_MEMORIES) * len(split)
    ax.set_xticks(positions, ticks, fontsize=10 if len(split) <= 3 else 8)


def _legend(ax: Any, names: list[str], colours: dict, capacity: bool) -> None:
    """The legend: the categories `names` (the top of a bar first), and the chip's
    capacity if drawn."""
    from matplotlib.patches import Patch

    handles = [Patch(color=colours[n], label=n) for n in reversed(names)]
    if capacity:
        handles.append(
            Patch(facecolor="none", edgecolor="#c44e52", label="chip capacity")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)


def _label(label: str, t: Any) -> str:
    """A report's label, with its estimated step time (a `StepTime`) under it."""
    if t is not None:
        label += f"\n{time_text(t.seconds)} a step ({t.bound})"
        if t.host_compute_seconds:
            label += f"\nhost compute {time_text(t.host_compute_seconds)}"
    return label
