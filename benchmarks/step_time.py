"""What offloading costs in time: the Llama-3.2-1B-shaped model of `llama.py` on one
tpu-v5e chip and one H100, each preset's estimated step time (`report.time`) split
into compute, transfers not hidden behind it and host compute not hidden behind it
(`compute_on("device_host")`, `Policy(update="host")`), and for `offload_all`, the
tokens per device at which its transfers hide behind compute (the break-even
batch), as the compiler scheduled the step and at the link's physical limit.

    python benchmarks/step_time.py [--targets tpu-v5e gpu-h100] [--batches 1 2 4 8 16]
        [--json FILE] [--figure docs/step_time.png]
    python benchmarks/step_time.py --replot FILE.json --figure docs/step_time.png

The model, loss (`chunked`) and optimizer (AdamW) are `llama.py`'s; sequences of
1024 tokens, batch 8 for the presets. Only compiled (`memory_report`), never run:
the times are estimates from the compiled program and `eo.Hardware.of(target)`.

The break-even batch, two ways:

- *as scheduled*: the smallest batch of the sweep at which the exposed transfer
    time is under 5% of the step (none if the compiled schedule leaves them
    exposed at every batch);
- *physical limit*: the tokens at which the forward/backward compute equals the
    forward/backward host-link time (the longer direction), both fitted as
    `a + b * tokens` over the sweep: what a schedule that overlapped every
    transfer with compute could reach. The update's transfers (parameters and
    optimizer state, both ways) have no compute to hide behind at any batch.
"""

import json
import time
from pathlib import Path

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
from _common import GIB, parser, table, write_json
from llama import PRESETS
from models import decoder
from models.decoder import chunked_loss
from models.shapes import LLAMA_3_2_1B, SEQ

import eqx_offload as eo


BATCH = 8
EXPOSED = 0.05  # "hidden": exposed transfers under 5% of the step


def report(preset: str, target: str, batch: int) -> eo.MemoryReport:
    policy = getattr(eo.Policy, preset)()
    return decoder.step_report(
        LLAMA_3_2_1B, policy, chunked_loss, target=target, batch=batch, seq=SEQ
    )


def _row(target: str, preset: str, batch: int) -> dict:
    start = time.perf_counter()
    row: dict = {"target": target, "preset": preset, "batch": batch}
    row["tokens"] = batch * SEQ
    try:
        r = report(preset, target, batch)
    except eo.DoesNotFit as e:
        need = e.required_bytes
        row["fits"] = False
        row["note"] = "does not fit" + (
            f" (needs {need / GIB:.1f} GiB)" if need else ""
        )
        return row
    t = r.time
    assert t is not None
    link = ("host_to_device", "device_to_host")
    fwd_bwd = [r.transfer_seconds(d, phase="forward/backward") for d in link]
    update = [r.transfer_seconds(d, phase="update") for d in link]
    row.update(
        {
            "fits": r.fits,
            "device GiB": r.device_bytes / GIB,
            "host GiB": r.host_bytes / GIB,
            "seconds": t.seconds,
            "bound": t.bound,
            "compute s": t.compute_seconds,
            "hbm s": t.hbm_seconds,
            "to device s": t.host_to_device_seconds,
            "to host s": t.device_to_host_seconds,
            "exposed s": t.exposed_transfer_seconds,
            "host compute s": t.host_compute_seconds,
            "host exposed s": t.exposed_host_compute_seconds,
            "fwd/bwd link s": max(fwd_bwd),
            "update link s": max(update),
            "tflops": t.flops / 1e12,
            "note": "",
            "compile s": time.perf_counter() - start,
        }
    )
    return row


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares `y = a + b x`."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def break_even(sweep: list[dict]) -> dict:
    """The tokens per device at which `offload_all`'s transfers hide (see the
    module's docstring), from its rows at growing batches."""
    fitted = [r for r in sweep if r.get("seconds")]
    scheduled = next(
        (r["tokens"] for r in fitted if r["exposed s"] <= EXPOSED * r["seconds"]),
        None,
    )
    physical = None
    if len(fitted) >= 2:
        tokens = [r["tokens"] for r in fitted]
        a_c, b_c = _fit(tokens, [r["compute s"] for r in fitted])
        a_l, b_l = _fit(tokens, [r["fwd/bwd link s"] for r in fitted])
        if b_c > b_l:
            physical = max((a_l - a_c) / (b_c - b_l), 0.0)
    largest = max((r["tokens"] for r in fitted), default=None)
    update = fitted[-1]["update link s"] if fitted else None
    return {
        "as scheduled": scheduled,
        "largest batch tried": largest,
        "physical limit": physical,
        "update link s": update,
    }


def figure(rows: list[dict], sweeps: dict[str, list[dict]], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(sweeps)
    fig, axes = plt.subplots(
        1, len(targets) + 1, figsize=(5 * (len(targets) + 1), 4.2), layout="constrained"
    )
    for ax, target in zip(axes, targets):
        mine = [r for r in rows if r["target"] == target]
        names = [r["preset"] for r in mine]
        exposed = [r.get("exposed s") or 0 for r in mine]
        # (0 in results saved before host compute was priced)
        host = [r.get("host exposed s") or 0 for r in mine]
        hidden = [
            (r.get("seconds") or 0) - e - h for r, e, h in zip(mine, exposed, host)
        ]
        ax.bar(names, hidden, color="#4c72b0", label="compute and HBM")
        ax.bar(
            names, exposed, bottom=hidden, color="#dd8452", label="transfers not hidden"
        )
        if any(host):
            below = [a + b for a, b in zip(hidden, exposed)]
            ax.bar(
                names,
                host,
                bottom=below,
                color="#da8bc3",
                label="host compute not hidden",
            )
        for i, r in enumerate(mine):
            if not r.get("seconds"):
                ax.annotate(
                    "does not fit",
                    (i, 0.03),
                    xycoords=("data", "axes fraction"),
                    ha="center",
                    va="bottom",
                    rotation=90,
                )
        ax.set_title(f"{target}: batch {BATCH} x {SEQ}")
        ax.set_ylabel("estimated seconds per step")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(fontsize=8)
    ax = axes[-1]
    for target, colour in zip(targets, ("#4c72b0", "#55a868", "#c44e52")):
        fitted = [r for r in sweeps[target] if r.get("seconds")]
        tokens = [r["tokens"] for r in fitted]
        for key, style, what in (
            ("compute s", "-o", "compute"),
            ("fwd/bwd link s", "--", "fwd/bwd transfers"),
            ("exposed s", ":", "not hidden"),
        ):
            ax.plot(
                tokens,
                [r[key] for r in fitted],
                style,
                color=colour,
                label=f"{target}: {what}",
            )
        limit = break_even(sweeps[target])["physical limit"]
        if limit:
            ax.axvline(limit, color=colour, linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per device (offload_all)")
    ax.set_ylabel("seconds per step")
    ax.set_title("offload_all: when do transfers hide?")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    p = parser(__doc__)
    p.add_argument("--targets", nargs="+", default=["tpu-v5e", "gpu-h100"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--figure", help="draw the figure to this file (PNG)")
    p.add_argument("--replot", help="only draw --figure from this JSON of results")
    args = p.parse_args()
    if args.replot:
        done = json.loads(Path(args.replot).read_text())["results"]
        return figure(done["rows"], done["sweeps"], args.figure)
    print(f"{decoder.parameters(LLAMA_3_2_1B) / 1e9:.3f}e9 parameters")
    rows, sweeps = [], {}
    for target in args.targets:
        for preset in PRESETS:
            rows.append(_row(target, preset, BATCH))
            print(rows[-1], flush=True)
        sweeps[target] = []
        for batch in args.batches:
            found = [r for r in rows if r["target"] == target and r["batch"] == batch]
            done = [r for r in found if r["preset"] == "offload_all"]
            sweeps[target].append(
                done[0] if done else _row(target, "offload_all", batch)
            )
            print(sweeps[target][-1], flush=True)
    headers = [
        "target",
        "preset",
        "fits",
        "seconds",
        "bound",
        "compute s",
        "hbm s",
        "to device s",
        "to host s",
        "exposed s",
        "host compute s",
        "note",
    ]
    print(table(headers, [[r.get(h) for h in headers] for r in rows]))
    evens = {t: break_even(s) for t, s in sweeps.items()}
    for target, found in evens.items():
        print(target, "offload_all break-even:", found)
    if args.figure:
        figure(rows, sweeps, args.figure)
    write_json(
        args.json,
        "step_time",
        {
            "parameters": decoder.parameters(LLAMA_3_2_1B),
            "hardware": {t: eo.Hardware.of(t).to_dict() for t in args.targets},
            "rows": rows,
            "sweeps": sweeps,
            "break_even": evens,
        },
    )


if __name__ == "__main__":
    main()
