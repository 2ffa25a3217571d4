"""Plots the depth-scaling results: device and host memory of the gradient
computation per preset and depth.

    python benchmarks/plot.py [benchmarks/results/depth.json] [docs/depth.png]
"""

import json
import sys
from pathlib import Path

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    source = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/depth.json")
    target = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/depth.png")
    rows = json.loads(source.read_text())["results"]
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for preset in presets:
        mine = [
            r for r in rows if r["preset"] == preset and r["device MiB"] is not None
        ]
        layers = [r["layers"] for r in mine]
        for ax, key in zip(axes, ("device MiB", "host MiB")):
            ax.plot(layers, [r[key] / 1024 for r in mine], marker="o", label=preset)
    for ax, title in zip(axes, ("device (HBM)", "pinned host")):
        ax.set_title(f"{title} memory")
        ax.set_xlabel("layers")
        ax.set_ylabel("GiB")
        ax.set_xscale("log", base=2)
        ax.set_xticks([4, 8, 16, 32], ["4", "8", "16", "32"])
        ax.grid(alpha=0.3)
    axes[0].axhline(15.75, color="grey", linestyle="--", linewidth=1)
    axes[0].text(4, 15.75, " v5e HBM", va="bottom", fontsize=8, color="grey")
    axes[0].legend(title="Policy")
    fig.suptitle(
        "Gradient of a GPT-style stack (dim 1024, seq 1024, batch 8, vocab 32768), "
        "compiled for one TPU v5e chip",
        fontsize=10,
    )
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=120)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
