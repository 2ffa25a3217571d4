"""One command for a real GPU: numerics, measured memory against the reports, step
times and the host link, recorded with versions.

    python benchmarks/gpu_check.py --json benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --smoke --json /tmp/gpu_check.json   # on a CPU
    python benchmarks/gpu_check.py --deviceless                         # no GPU

Run from the source tree (`PYTHONPATH=.` if eqx_offload is not installed) on the
machine's own JAX. Every part runs in a fresh process of its own, so that one
process's memory never counts in another's peak, and a part that fails is recorded
(with its error) rather than ending the run:

1. **Numerics** (tiny GPT-style model, `matmul` precision "highest"): three steps of
   `train_step` under every configuration below against plain Equinox + optax on the
   device (losses and parameters); `eo.verify` on each; every leaf still in its
   memory kind after the steps; and the pattern behind XLA's silent wrong-gradient
   fix for GPUs (openxla/xla#46231): a `jax.lax.scan` whose residuals are offloaded
   with `save_and_offload_only_these_names`, its gradient (the backward pass reads
   the residuals in reverse) against the same scan without offloading, for a
   forward and a reversed scan.
2. **Memory and time**, for each configuration at two sizes of the GPT-style model
   of `depth.py` (AdamW, fp32, batch 8 x 1024): the model and the optimizer state
   made on the host for host-resident leaves and copied into their memory kinds (the
   device never holds what the policy puts on the host); the measured peak device
   memory (`memory_stats()["peak_bytes_in_use"]`, before and after the steps), the
   report of the GPU's own compile (`memory_report(..., target=None)`), and the
   deviceless `gpu-h200` report compiled without a GPU (`--deviceless` writes
   `benchmarks/results/gpu_check_deviceless.json`, which is read here); the step
   time, median of 10 after 2 warm-up steps, next to the estimated one
   (`report.time` of the GPU's own compile, at the hardware table's rates and
   with the host link as measured in part 3, and of the deviceless compile) and
   their ratio; and whether the configurations come in the same order by measured
   and by estimated time (`time order`).
3. **The host link**: pinned host <-> device copies of 1 GiB, median of 5, in GB/s
   (measured before part 2, which prices its estimates with it).

Configurations: the four presets, `offload_all` with the streamed and with the whole
optimizer update (which is faster on a GPU had not been measured).
`--smoke` runs the same on a tiny model with 3 timed steps, for CI on a CPU. A run
of part 2 starts only within `--budget` seconds of the start (450 by default, for
the whole to stay under 8 minutes); later ones are recorded as skipped.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any


HERE = Path(__file__).parent
DEVICELESS = HERE / "results" / "gpu_check_deviceless.json"
MARK = "GPU_CHECK_RESULT "
CONFIGS = (
    "none",
    "remat",
    "offload_residuals",
    "offload_all, streamed update",
    "offload_all, whole update",
)
# name -> (vocab, dim, layers, batch, seq)
SIZES = {
    "GPT 0.2B": (32768, 1024, 12, 8, 1024),
    "GPT 0.9B": (32768, 2048, 24, 8, 1024),
}
SMOKE_SIZES = {"smoke": (256, 32, 2, 2, 16)}
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt")
PACKAGES += ("jax-cuda13-plugin", "jax-cuda13-pjrt", "equinox", "optax", "jaxtyping")
PACKAGES += ("numpy",)


# --- In the child processes -------------------------------------------------------


def _policy(config: str):
    import eqx_offload as eo

    if config.startswith("offload_all"):
        update = "whole" if config.endswith("whole update") else "streamed"
        return eo.Policy.offload_all(update=update)
    return getattr(eo.Policy, config)()


def _model(vocab: int, dim: int, layers: int):
    import equinox as eqx
    import jax
    from gpt import GPT

    return eqx.filter_eval_shape(GPT, vocab, dim, layers, key=jax.random.key(0))


def _materialise(abstract: Any, seed: int | None) -> Any:
    """Arrays for the `jax.ShapeDtypeStruct` leaves of `abstract`, made on the host
    with NumPy and copied straight into each leaf's sharding (memory kind included):
    small normal values for floating leaves, zeros for integers, and zeros
    everywhere without a `seed` (Adam's own initial state)."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed or 0)

    def make(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        if seed is None or not np.issubdtype(x.dtype, np.floating):
            value = np.zeros(x.shape, x.dtype)
        else:
            value = (rng.standard_normal(x.shape, np.float32) * 0.02).astype(x.dtype)
        return jax.device_put(value, x.sharding)

    return jax.tree.map(make, abstract)


def _peak() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if stats is None else int(stats.get("peak_bytes_in_use", 0))


def _link(report: Any, measured: dict[str, Any]) -> Any:
    """`report`'s hardware with the host link as measured (`bandwidth`), or None."""
    import dataclasses

    to_device = measured.get("pinned host -> device GB/s")
    to_host = measured.get("device -> pinned host GB/s")
    if report.time is None or not to_device or not to_host:
        return None
    return dataclasses.replace(
        report.time.hardware,
        host_to_device_bytes_per_second=to_device * 1e9,
        device_to_host_bytes_per_second=to_host * 1e9,
    )


def measure(
    config: str, size: tuple[int, ...], steps: int, link: dict[str, Any]
) -> dict[str, Any]:
    """One configuration at one size: memory measured and reported, step time
    measured and estimated (`report.time`: at the hardware table's rates, and with
    the host link `link` measured by `bandwidth`)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from gpt import loss_fn

    import eqx_offload as eo

    vocab, dim, layers, batch, seq = size
    policy = _policy(config)
    optimizer = optax.adamw(1e-4)
    abstract = eo.place(_model(vocab, dim, layers), policy)
    model = _materialise(abstract, seed=0)
    opt_state = _materialise(eo.init_opt_state(optimizer, abstract, policy), seed=None)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, vocab)
    step = eo.train_step(loss_fn, optimizer, policy)
    out: dict[str, Any] = {"peak bytes after init": _peak()}
    report = eo.memory_report(step, model, opt_state, tokens, tokens)
    out["report device bytes"] = report.device_bytes
    out["report host bytes"] = report.host_bytes
    out["report estimate"] = report.estimate
    out["estimated step s"] = None if report.time is None else report.time.seconds
    out["estimate bound"] = None if report.time is None else report.time.bound
    hardware = _link(report, link)
    if hardware is not None:
        again = eo.memory_report(
            step, model, opt_state, tokens, tokens, hardware=hardware
        )
        assert again.time is not None
        out["estimated step s, measured link"] = again.time.seconds
    times = []
    for i in range(2 + steps):
        start = time.perf_counter()
        model, opt_state, loss = step(model, opt_state, tokens, tokens)
        jax.block_until_ready((model, opt_state, loss))
        if i >= 2:
            times.append(time.perf_counter() - start)
    out["peak bytes after steps"] = _peak()
    out["step s median"] = statistics.median(times)
    for key in ("estimated step s", "estimated step s, measured link"):
        if out.get(key):
            out[key.replace("estimated step s", "estimate / measured")] = (
                out[key] / out["step s median"]
            )
    out["step s min"] = min(times)
    out["loss"] = float(jnp.asarray(loss))
    kinds = {
        x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    }
    out["parameter memory kinds"] = sorted(str(k) for k in kinds)
    return out


def deviceless(configs: list[str], sizes: dict[str, tuple[int, ...]]) -> list[dict]:
    """The `gpu-h200` reports of every configuration and size, compiled without a
    GPU (run with `JAX_PLATFORMS=cpu` and JAX's CUDA plugin)."""
    import jax
    import jax.numpy as jnp
    import optax
    from gpt import loss_fn

    import eqx_offload as eo

    rows = []
    for name, (vocab, dim, layers, batch, seq) in sizes.items():
        for config in configs:
            policy = _policy(config)
            optimizer = optax.adamw(1e-4)
            model = eo.place(_model(vocab, dim, layers), policy)
            opt_state = eo.init_opt_state(optimizer, model, policy)
            tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
            step = eo.train_step(loss_fn, optimizer, policy)
            r = eo.memory_report(
                step, model, opt_state, tokens, tokens, target="gpu-h200"
            )
            rows.append(
                {
                    "size": name,
                    "config": config,
                    "device bytes": r.device_bytes,
                    "host bytes": r.host_bytes,
                    "estimated step s": None if r.time is None else r.time.seconds,
                    "jax": jax.__version__,
                }
            )
    return rows


def numerics(configs: list[str]) -> dict[str, Any]:
    """Every configuration against plain training; `eo.verify`; placements; the
    offloaded-scan gradient (openxla/xla#46231); matmuls at "highest" precision."""
    import jax

    with jax.default_matmul_precision("highest"):
        return _numerics(configs)


def _numerics(configs: list[str]) -> dict[str, Any]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from gpt import GPT, loss_fn

    import eqx_offload as eo

    optimizer = optax.adamw(1e-2)
    tokens = jax.random.randint(jax.random.key(1), (3, 4, 8), 0, 64)

    def arrays(tree: Any) -> list:
        return jax.tree.leaves(eqx.filter(tree, eqx.is_array))

    # The reference: plain Equinox + optax, everything on the device.
    @eqx.filter_jit
    def plain_step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, x)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    ref = GPT(64, 32, 3, key=jax.random.key(0))
    ref_state, ref_losses = optimizer.init(eqx.filter(ref, eqx.is_inexact_array)), []
    for x in tokens:
        ref, ref_state, loss = plain_step(ref, ref_state, x)
        ref_losses.append(float(loss))
    ref_leaves = arrays(ref)

    out: dict[str, Any] = {"presets": {}}
    for config in configs:
        row: dict[str, Any] = {}
        try:
            policy = _policy(config)
            # A fresh model each time: the step donates it.
            placed = eo.place(GPT(64, 32, 3, key=jax.random.key(0)), policy)
            kinds = [x.sharding.memory_kind for x in arrays(placed)]
            opt_state = eo.init_opt_state(optimizer, placed, policy)
            x = tokens[0]
            report = eo.verify(loss_fn, optimizer, policy, placed, opt_state, x, x)
            row["verify passed"] = report.passed
            step = eo.train_step(loss_fn, optimizer, policy)
            losses, ours = [], placed
            for x in tokens:
                ours, opt_state, loss = step(ours, opt_state, x, x)
                losses.append(float(loss))
            leaves = arrays(ours)
            row["max |loss - plain|"] = max(
                abs(a - b) for a, b in zip(losses, ref_losses)
            )
            row["max |params - plain|"] = max(
                float(jnp.max(jnp.abs(jax.device_put(a, jax.memory.Space.Device) - b)))
                for a, b in zip(leaves, ref_leaves)
            )
            row["placements kept"] = kinds == [x.sharding.memory_kind for x in leaves]
            row["passed"] = (
                row["verify passed"]
                and row["placements kept"]
                and row["max |loss - plain|"] <= 1e-4
                and row["max |params - plain|"] <= 1e-4
            )
        except Exception as e:
            row = {"passed": False, "error": _error(e)}
        out["presets"][config] = row
    out["offloaded scan (openxla/xla#46231)"] = _offloaded_scan()
    out["passed"] = all(r["passed"] for r in out["presets"].values()) and all(
        r["passed"] for r in out["offloaded scan (openxla/xla#46231)"].values()
    )
    return out


def _offloaded_scan() -> dict[str, Any]:
    """`jax.checkpoint` with `save_and_offload_only_these_names` over a scan: the
    gradient with the carry offloaded against the same without offloading."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["carry"],
        offload_src="device",
        offload_dst="pinned_host",
    )

    def layer(carry, w):
        carry = checkpoint_name(carry, "carry")
        return jnp.tanh(carry @ w), None

    keys = jax.random.split(jax.random.key(2), 2)
    ws = jax.random.normal(keys[0], (16, 64, 64)) / 8
    x = jax.random.normal(keys[1], (32, 64))
    out = {}
    for reverse in (False, True):

        def loss(ws, x, policy):
            body = jax.checkpoint(layer, policy=policy)
            y, _ = jax.lax.scan(body, x, ws, reverse=reverse)
            return jnp.sum(y**2)

        plain = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
        ref = plain(ws, x, jax.checkpoint_policies.nothing_saveable)
        got = plain(ws, x, offload)
        diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, ref))
        scale = max(float(jnp.max(jnp.abs(b))) for b in ref)
        out["reversed scan" if reverse else "scan"] = {
            "max |grad - plain|": diff,
            "scale": scale,
            "passed": diff <= 1e-4 * scale,
        }
    return out


def bandwidth(mib: int) -> dict[str, Any]:
    """Pinned host <-> device copies of `mib` MiB: median of 5, GB/s."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    x = jax.device_put(jnp.ones((mib, 2**18), jnp.float32), on_device)
    out: dict[str, Any] = {"bytes": x.nbytes}
    for label, to, start in (
        ("device -> pinned host GB/s", on_host, x),
        ("pinned host -> device GB/s", on_device, jax.device_put(x, on_host)),
    ):
        jax.block_until_ready(jax.device_put(start, to))  # warm-up
        times = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(jax.device_put(start, to))
            times.append(time.perf_counter() - t)
        out[label] = x.nbytes / statistics.median(times) / 1e9
    return out


def environment() -> dict[str, Any]:
    import jax

    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device": devices[0].device_kind,
        "devices": len(devices),
        "memories": [str(m.kind) for m in devices[0].addressable_memories()],
        "jax_environment": jax.print_environment_info(return_string=True),
    }


def _error(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    kind, *rest = args.child
    if kind == "measure":
        link = json.loads(rest[2]) if len(rest) > 2 else {}
        result: Any = measure(rest[0], tuple(json.loads(rest[1])), args.steps, link)
    elif kind == "numerics":
        result = {"numerics": numerics(list(CONFIGS)), **environment()}
    elif kind == "bandwidth":
        result = bandwidth(int(rest[0]))
    elif kind == "deviceless":
        configs: list[str] = json.loads(rest[1]) if len(rest) > 1 else [*CONFIGS]
        result = deviceless(configs, json.loads(rest[0]))
    else:
        raise ValueError(f"`gpu_check.py --child {kind}`: unknown part")
    print(MARK + json.dumps(result), flush=True)


# --- In the parent process ----------------------------------------------------------


def run_child(
    argv: list[str], timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs one part in a fresh process; its result, or what went wrong."""
    start = time.perf_counter()
    command = [sys.executable, str(Path(__file__).resolve()), "--child", *argv]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "seconds": timeout}
    seconds = round(time.perf_counter() - start, 1)
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            return {"result": json.loads(line[len(MARK) :]), "seconds": seconds}
    tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
    return {"error": "\n".join(tail), "seconds": seconds}


def time_order(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size, the configurations fastest first as measured and as estimated
    (at the table's rates, and with the measured link), and whether they agree."""
    out: dict[str, Any] = {}
    for size in dict.fromkeys(r["size"] for r in runs):
        mine = [r for r in runs if r["size"] == size and r.get("step s median")]
        found: dict[str, Any] = {}
        for key in (
            "step s median",
            "estimated step s",
            "estimated step s, measured link",
        ):
            if mine and all(r.get(key) for r in mine):
                found[key] = [r["config"] for r in sorted(mine, key=lambda r: r[key])]
        measured = found.get("step s median")
        for key in ("estimated step s", "estimated step s, measured link"):
            if measured and key in found:
                found[f"same order ({key})"] = found[key] == measured
        out[size] = found
    return out


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results to this file")
    p.add_argument("--smoke", action="store_true", help="a tiny model, for a CPU")
    p.add_argument("--deviceless", action="store_true", help=f"write {DEVICELESS}")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--steps", type=int, default=None, help="timed steps (10)")
    p.add_argument(
        "--budget",
        type=float,
        default=450.0,
        help="seconds after which no further run starts (recorded as skipped)",
    )
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.steps = args.steps or (3 if args.smoke else 10)
    if args.child:
        return child(args)
    sizes = SMOKE_SIZES if args.smoke else SIZES
    cpu = {"JAX_PLATFORMS": "cpu"}
    if args.deviceless:
        part = run_child(["deviceless", json.dumps(sizes)], 1200, cpu)
        if "error" in part:
            sys.exit(f"gpu_check.py --deviceless failed:\n{part['error']}")
        DEVICELESS.write_text(json.dumps({"rows": part["result"]}, indent=2) + "\n")
        print(f"wrote {DEVICELESS}")
        return
    start = time.perf_counter()
    results: dict[str, Any] = {"versions": versions(), "smoke": args.smoke}
    env = run_child(["numerics"], 600)
    results["numerics"] = env.get("result", {}).pop("numerics", env)
    results["environment"] = env.get("result", {"error": env.get("error")})
    print(f"numerics: passed = {results['numerics'].get('passed')}", flush=True)
    part = run_child(["bandwidth", "16" if args.smoke else "1024"], 300)
    results["host link"] = part.get("result", part)
    print(f"host link: {results['host link']}", flush=True)
    if args.smoke:
        figures = run_child(
            ["deviceless", json.dumps(sizes), json.dumps(args.configs)], 600, cpu
        )
        rows = figures.get("result", [])
    else:
        rows = json.loads(DEVICELESS.read_text())["rows"] if DEVICELESS.exists() else []
    known = {(r["size"], r["config"]): r for r in rows}
    results["runs"] = []
    for name, size in sizes.items():
        for config in args.configs:
            row: dict[str, Any] = {"size": name, "config": config}
            if time.perf_counter() - start > args.budget:
                row["error"] = f"skipped: past the {args.budget:.0f} s budget"
                results["runs"].append(row)
                continue
            link = json.dumps(results["host link"])
            part = run_child(["measure", config, json.dumps(size), link], 300)
            row["seconds"] = part["seconds"]
            row.update(part.get("result", {"error": part.get("error")}))
            figure = known.get((name, config))
            row["deviceless gpu-h200 device bytes"] = figure and figure["device bytes"]
            row["deviceless gpu-h200 host bytes"] = figure and figure["host bytes"]
            row["deviceless gpu-h200 estimated step s"] = figure and figure.get(
                "estimated step s"
            )
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    results["time order"] = time_order(results["runs"])
    print(f"presets by time: {results['time order']}", flush=True)
    results["seconds"] = round(time.perf_counter() - start, 1)
    print(f"done in {results['seconds']} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
