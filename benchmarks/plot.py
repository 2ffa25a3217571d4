"""Draws the depth-scaling figure with `MemoryReport.plot`: for each preset, the
device and host memory of the gradient computation at each depth, by category.

    python benchmarks/plot.py [benchmarks/results/depth.json] [docs/depth.png]

The reports are read back from the JSON `benchmarks/depth.py` writes
(`MemoryReport.from_dict`).
"""

import json
import sys
from pathlib import Path

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import eqx_offload as eo  # noqa: E402


def main():
    source = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/depth.json")
    target = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/depth.png")
    rows = json.loads(source.read_text())["results"]
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    fig, axes = plt.subplots(
        1,
        len(presets),
        figsize=(5.2 * len(presets), 4.8),
        sharey=True,
        layout="constrained",
    )
    handles = {}
    for ax, preset in zip(axes, presets):
        mine = [r for r in rows if r["preset"] == preset and r.get("report")]
        reports = [eo.MemoryReport.from_dict(r["report"]) for r in mine]
        labels = [f"{r['layers']} layers" for r in mine]
        reports[0].plot(*reports[1:], labels=labels, ax=ax, title=f"Policy.{preset}()")
        for handle in ax.get_legend().legend_handles:  # one legend for all panels
            handles.setdefault(handle.get_label(), handle)
        ax.get_legend().remove()
        missing = [
            str(r["layers"])
            for r in rows
            if r["preset"] == preset and not r.get("report")
        ]
        if missing:
            ax.text(
                0.98,
                0.98,
                f"{', '.join(missing)} layers: does not compile",
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize=8,
            )
    fig.legend(handles=list(handles.values()), loc="outside right upper", fontsize=8)
    fig.suptitle(
        "Gradient of a GPT-style stack (dim 1024, seq 1024, batch 8, vocab 32768), "
        "compiled for one TPU v5e chip",
        fontsize=10,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
