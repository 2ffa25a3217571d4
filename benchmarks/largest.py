"""The largest GPT-style model whose train step fits one TPU v5e chip (15.75 GiB of
HBM) with 48 GB of host memory: with `Policy.remat()`, with each offloading preset,
and with `eo.plan`; fp32 parameters and AdamW, batch 8 x 1024 tokens.

    python benchmarks/largest.py [--width 2048] [--json FILE] [--probe 65]

The model: `models/decoder.py`'s GPT-2 style (LayerNorm, multi-head attention, a
GELU MLP
of 4 x width, learned positions, a tied 32768-token table), `width / 64` heads,
with the chunked loss. Only the depth grows (the width is fixed): for
`Policy.remat()` and each preset, the largest depth that fits is bisected (each
depth one compile). `plan` is asked in full at the best preset's largest depth
(is its step time no worse?); its own largest depth is bisected between that
and the physical cap with probes (each stops at the first candidate that fits,
or raises `DoesNotFit` when none does), and that depth is planned in full. The
physical cap is (HBM + host) / 16 bytes a parameter (the parameter, its
gradient, Adam's two moments). Only compiled, never run. `--probe DEPTH ...`
only probes `plan` at those depths, printing the candidates the compiler
refused or crashed on where nothing fits.
"""

import functools
import time
from collections.abc import Callable
from typing import Any

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import GIB, parser, table, write_json
from models import decoder
from models.decoder import chunked_loss, Shape

import eqx_offload as eo
import eqx_offload.internal as eoi


TARGET, HOST = "tpu-v5e", 48 * 10**9
BATCH, SEQ, VOCAB = 8, 1024, 32768
PRESETS = ("remat", "offload_residuals", "offload_all")


def shape(width: int, depth: int) -> Shape:
    return Shape(
        vocab=VOCAB,
        dim=width,
        layers=depth,
        heads=width // 64,
        kv_heads=width // 64,
        head_dim=64,
        mlp=4 * width,
        tied=True,
        style="gpt2",
        positions=SEQ,
    )


def fits(width: int, depth: int, preset: str) -> dict[str, Any] | None:
    s = shape(width, depth)
    try:
        r = decoder.step_report(
            s,
            getattr(eo.Policy, preset)(),
            chunked_loss,
            target=TARGET,
            batch=BATCH,
            seq=SEQ,
        )
    except eo.DoesNotFit:
        return None
    if not r.fits_device or r.host_bytes > HOST:
        return None
    return {
        "device GiB": r.device_bytes / GIB,
        "host GiB": r.host_bytes / GIB,
        "step s": None if r.time is None else r.time.seconds,
    }


def largest(fits: Callable[[int], Any], low: int, high: int) -> tuple[int, Any, int]:
    """The largest depth in [low, high) at which `fits` gives something (low - 1
    if none), bisected; what it gave there; how many depths were tried."""
    found, tries = None, 0
    best = low - 1
    while low < high:
        middle = (low + high) // 2
        tries += 1
        r = fits(middle)
        print({"depth": middle, "fits": r is not None}, flush=True)
        if r is not None:
            best, found, low = middle, r, middle + 1
        else:
            high = middle
    return best, found, tries


def attempt(
    width: int,
    depth: int,
    probe: bool,
    experimental: tuple[eoi.Experimental, ...] = (),
) -> eo.Plan | bool | eo.DoesNotFit:
    """`eo.plan` at this depth (a probe: `True` at the first candidate that fits),
    or its `DoesNotFit` (`e.tried`: what it compiled). Without the experimental
    stages unless `experimental` names some (`plan(experimental=...)`)."""
    abstract = eqx.filter_eval_shape(
        decoder.Decoder, shape(width, depth), key=jax.random.key(0)
    )
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    found = eoi.search_plan(
        chunked_loss,
        optax.adamw(1e-4),
        abstract,
        (tokens, tokens),
        target=TARGET,
        host_budget=HOST,
        progress=True,
        first_fit=probe,
        experimental=experimental,
    ).found
    return True if found is None else found


def probe_only(width: int, depths: list[int]) -> None:
    """`--probe`: whether `plan` fits at each depth and, where nothing does, the
    candidates the compiler refused or crashed on."""
    for depth in depths:
        start = time.perf_counter()
        outcome = attempt(width, depth, probe=True)
        fits = outcome is True
        print({"depth": depth, "fits": fits, "seconds": time.perf_counter() - start})
        if isinstance(outcome, eo.DoesNotFit) and outcome.tried is not None:
            for row in outcome.tried.rows:
                if row.status.startswith(("compiler crashed", "does not compile")):
                    print(f"  {row.label}: {row.status}", flush=True)


def parameters(width: int, depth: int) -> int:
    return decoder.parameters(shape(width, depth))


def main():
    p = parser(__doc__)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--max-depth", type=int, default=160)
    p.add_argument(
        "--probe", type=int, nargs="+", help="only probe `plan` at these depths"
    )
    args = p.parse_args()
    width = args.width
    if args.probe:
        return probe_only(width, args.probe)
    rows: list[dict[str, Any]] = []
    cap = (eoi.targets_capacity(TARGET) + HOST) / 16
    print(f"physical cap: {cap / 1e9:.2f}e9 parameters", flush=True)
    deepest: dict[str, int] = {}
    for preset in PRESETS:
        start = time.perf_counter()
        depth, found, compiles = largest(
            functools.partial(fits, width, preset=preset), 1, args.max_depth
        )
        deepest[preset] = depth
        row = {"how": f"Policy.{preset}()", "depth": depth}
        row["parameters"] = parameters(width, depth) if depth > 0 else 0
        row |= found or {}
        row |= {"compiles": compiles, "seconds": time.perf_counter() - start}
        print(row, flush=True)
        rows.append(row)
    best = max(deepest, key=lambda k: deepest[k])
    start = time.perf_counter()
    low = high = deepest[best] + 1
    while parameters(width, high) <= cap:
        high += 1
    plan_depth, _, probes = largest(
        lambda depth: attempt(width, depth, probe=True) is True or None, low, high
    )
    bisected = time.perf_counter() - start
    for depth in sorted({deepest[best], plan_depth}):
        start = time.perf_counter()
        fitted = attempt(width, depth, probe=False)
        assert isinstance(fitted, eo.Plan), depth
        row: dict[str, Any] = {"how": "plan", "depth": depth}
        row["parameters"] = parameters(width, depth)
        row |= {
            "device GiB": fitted.report.device_bytes / GIB,
            "host GiB": fitted.report.host_bytes / GIB,
            "step s": None
            if fitted.report.time is None
            else fitted.report.time.seconds,
            "plan": next(r.label for r in fitted.table.rows if r.status == "chosen"),
            "compiles": fitted.compiled,
            "seconds": time.perf_counter() - start,
        }
        if depth == plan_depth:
            row |= {"probes": probes, "probe seconds": bisected}
        print(row, flush=True)
        rows.append(row)
    headers = ["how", "depth", "parameters", "device GiB", "host GiB", "step s"]
    print(table(headers, [[r.get(h) for h in headers] for r in rows]))
    write_json(
        args.json, "largest", {"width": width, "cap parameters": cap, "rows": rows}
    )


if __name__ == "__main__":
    main()
