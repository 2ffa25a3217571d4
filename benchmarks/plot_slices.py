"""Plots the slice results: device bytes per chip and host bytes per host of the 7.8B
GPT's train step against the chip count, per policy.

    python benchmarks/plot_slices.py [benchmarks/results/slices.json] [docs/slices.png]
"""

import json
import sys
from pathlib import Path

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


LABELS = {
    "remat": "FSDP alone (remat)",
    "offload_residuals": "FSDP + offload_residuals",
    "offload_all": "FSDP + offload_all",
}


def main():
    source = Path(
        sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/slices.json"
    )
    target = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/slices.png")
    rows = json.loads(source.read_text())["results"]["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for policy, label in LABELS.items():
        mine = [r for r in rows if r["policy"] == policy and r["device GiB/chip"]]
        chips = [r["chips"] for r in mine]
        axes[0].plot(
            chips, [r["device GiB/chip"] for r in mine], marker="o", label=label
        )
        axes[1].plot(chips, [r["host GiB/host"] for r in mine], marker="o", label=label)
    axes[0].axhline(15.75, color="grey", linestyle="--", linewidth=1)
    axes[0].text(4, 15.75, " v5e HBM per chip", va="bottom", fontsize=8, color="grey")
    for ram, text in ((178.8, "4-chip VM RAM"), (357.6, "8-chip VM RAM")):
        axes[1].axhline(ram, color="grey", linestyle="--", linewidth=1)
        axes[1].text(64, ram, f" {text}", va="bottom", fontsize=8, color="grey")
    for ax, title in zip(axes, ("device (HBM) per chip", "pinned host per host (VM)")):
        ax.set_title(title)
        ax.set_xlabel("v5e chips (FSDP over all)")
        ax.set_ylabel("GiB")
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            [4, 8, 16, 32, 64, 128, 256], ["4", "8", "16", "32", "64", "128", "256"]
        )
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "Train step of a 7.8B-parameter GPT (fp32, AdamW, seq 2048, 1 sequence per "
        "chip), compiled for TPU v5e slices",
        fontsize=10,
    )
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=120)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
