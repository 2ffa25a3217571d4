"""The compiled programs of the 11 step configurations measured on one H200
(`results/gpu_check_h200_gpt02b.json` and `results/gpu_check_h200_gpt09b.json`, the
rows with a measured step), compiled again without a GPU, as fixtures for the
step-time model's tests.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/h200_programs.py  # compile, write
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/h200_programs.py --price  # price

The H200 run saved no program text. This script takes the code as it was when the
steps ran (`REV`, extracted with `git archive` into a temporary folder, never checked
out), and in a child process that imports that code (`PYTHONPATH`, checked) builds
each configuration as that revision's `benchmarks/gpu_check.py` built it: its own
`deviceless()` (its `SIZES`, `optax.adamw(1e-4)`, 8 x 1024 tokens, its `_policy`),
with its `XLA_FLAGS` for the configurations that name a flag (`_flag_env`, set for
the child process as the GPU run set it for its own). The text is the one that
revision's `memory_report(..., target="gpu-h200")` compiled and priced, taken where
the report hands it to its step-time estimate; under `update_timing`, for the state
the timed steps had (an update waiting).

Which revision: the runs' own records (`nvidia-smi` at 07:50:36 and 07:56:32 on 27
November) put them after 691e848 (07:48:31, which added the `next_forward` rows) and
c2e1555 (07:55:03, `--sizes`, which the 0.9B-only run needs), and before the next
commits (07:57:26 on); the results were committed in 27db6a0, an ancestor of f7ef023
(11:58:32). The library is the same at 691e848 and c2e1555. The issue names f7ef023:
each row is compiled there too, and the manifest says whether the program is the
same (metadata aside; it is, but for `next_forward`, which da1d42c changed).

It writes `tests/fixtures/h200_steps/<slug>.hlo.gz` (one per row, gzip, the same
bytes on a rerun) and `tests/fixtures/h200_steps/manifest.json` (per row: the
measured figures, the deviceless ones, and how this compile differs from the one the
GPU ran). Then it re-prices every fixture with this checkout's `eqx_offload` and
prints the estimate beside the measured step and the seconds each estimate takes.
"""

import argparse
import ast
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


HERE = Path(__file__).parent
ROOT = HERE.parent
RESULTS = HERE / "results"
OUT = ROOT / "tests" / "fixtures" / "h200_steps"
REV = "c2e1555"  # the code the H200 ran (module docstring)
ALSO = "f7ef023"  # the revision the issue names, compared
# result file -> the rows of it that were measured
MEASURED = {"gpu_check_h200_gpt02b.json": 7, "gpu_check_h200_gpt09b.json": 4}
MARK = "H200_PROGRAM "
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "equinox")
PACKAGES += ("optax",)

# Run in the child, with the revision's code first on `sys.path` (`PYTHONPATH`).
CHILD = r"""
import gzip, hashlib, json, os, sys, time
tree, jobs = sys.argv[1], json.loads(sys.argv[2])
import eqx_offload
from eqx_offload._report import _step_time
import gpu_check
def check():  # the library, the benchmark and its model: all from `tree`
    names = ["eqx_offload", "gpu_check", "models.gpt", "gpt"]
    for module in [sys.modules[n] for n in names if n in sys.modules]:
        where = os.path.realpath(module.__file__)
        if not where.startswith(os.path.realpath(tree) + os.sep):
            raise SystemExit(f"{module.__name__} imported from {where}, not {tree}")
check()
texts = []
priced = _step_time.estimate
def estimate(text, hardware, platform):
    t = priced(text, hardware, platform)
    texts.append((text, t))
    return t
_step_time.estimate = estimate  # the text `memory_report` prices, kept
# The steps timed are every step but the first two: under `update_timing`, those
# take a state with an update waiting (`ready`, a static field: a program of its
# own). From a4bba48 on `memory_report` compiles that program itself; before, the
# first step's. `steady` gives it the waiting state either way.
init, state_kind = eqx_offload.init_opt_state, {}
def steady(*args, **kwargs):
    state = init(*args, **kwargs)
    if type(state).__name__ == "PendingUpdate" and not state.ready:
        state_kind["pending"] = True
        if state_kind["steady"]:
            state = type(state)(state.inner, state.grads, state.held, True)
    return state
eqx_offload.init_opt_state = steady
def one(size, config, waiting):
    texts.clear()
    state_kind.update(steady=waiting, pending=False)
    start = time.perf_counter()
    (row,) = gpu_check.deviceless([config], {size: gpu_check.SIZES[size]})
    row["seconds"] = round(time.perf_counter() - start, 1)
    check()
    if len(texts) != 1:
        raise SystemExit(f"{size}, {config}: {len(texts)} texts priced, not 1")
    return row, *texts[0]
for size, config, path in jobs:
    row, text, t = one(size, config, True)
    # The file table names the temporary folder: relative paths keep a rerun's bytes.
    for prefix in {tree, os.path.realpath(tree)}:
        text = text.replace(prefix.rstrip("/") + "/", "")
    data = text.encode()
    with open(path, "wb") as f:
        f.write(gzip.compress(data, compresslevel=9, mtime=0))
    row.update(
        bound=t.bound,
        sha256=hashlib.sha256(data).hexdigest(),
        chars=len(data),
        files=[sys.modules[n].__file__ for n in ("eqx_offload", "gpu_check")],
        size_tuple=list(gpu_check.SIZES[size]),
        waiting=state_kind["pending"],
    )
    if state_kind["pending"]:  # the first step's program too, as a figure
        first, _, _ = one(size, config, False)
        row["first step"] = {k: first[k] for k in ("device bytes", "estimated step s")}
    print("H200_PROGRAM " + json.dumps(row), flush=True)
"""


def slug(size: str, config: str) -> str:
    """`GPT 0.2B`, `offload_all, streamed update, next_forward` ->
    `gpt02b_offload_all_streamed_next_forward`."""
    name = size.lower().replace(" ", "").replace(".", "")
    words = config.replace(" update", "").replace("async limit ", "async")
    return f"{name}_{re.sub(r'[^a-z0-9]+', '_', words).strip('_')}"


def measured_rows() -> list[dict[str, Any]]:
    rows = []
    for file, count in MEASURED.items():
        for run in json.loads((RESULTS / file).read_text())["runs"][:count]:
            assert run.get("step s median"), (file, run["config"])
            rows.append({"result file": file, **run})
    return rows


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    import jaxlib.version

    out["jaxlib git hash"] = getattr(jaxlib.version, "_git_hash", None)
    return out


def extract(tree: Path, rev: str) -> None:
    """`rev`'s files into `tree`, by `git archive` (no checkout, no worktree)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)


def flagged(tree: Path) -> dict[str, str]:
    """The revision's `gpu_check.FLAGGED` (config -> `XLA_FLAGS` flag), read from
    its file without importing the rest of it here."""
    source = (tree / "benchmarks" / "gpu_check.py").read_text()
    names = {"FLAG", "ASYNC_LIMIT", "FLAGGED"}
    module = ast.parse(source)
    module.body = [
        node
        for node in module.body
        if isinstance(node, ast.Assign)
        and {getattr(t, "id", None) for t in node.targets} <= names
    ]
    scope: dict[str, Any] = {}
    exec(compile(module, "gpu_check.py", "exec"), scope)
    return scope["FLAGGED"]


def compile_all(rows: list[dict[str, Any]], tree: Path, out: Path) -> dict[str, dict]:
    """Runs `CHILD` once per `XLA_FLAGS` setting; the child's row per slug."""
    flags = flagged(tree)
    groups: dict[str, list] = {}
    for r in rows:
        flag = flags.get(r["config"])
        # As `_flag_env` set it, on a GPU machine with no `XLA_FLAGS` of its own.
        value = f"--{flag}" if flag else ""
        path = str(out / f"{slug(r['size'], r['config'])}.hlo.gz")
        groups.setdefault(value, []).append([r["size"], r["config"], path])
    found: dict[str, dict] = {}
    for value, jobs in groups.items():
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(JAX_PLATFORMS="cpu", PYTHONPATH=f"{tree}:{tree / 'benchmarks'}")
        if value:
            env["XLA_FLAGS"] = value
        print(f"compiling {len(jobs)} (XLA_FLAGS={value!r})", flush=True)
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(tree), json.dumps(jobs)],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
        )
        for line in done.stdout.splitlines():
            if line.startswith(MARK):
                row = json.loads(line[len(MARK) :])
                row["XLA_FLAGS"] = value
                found[slug(row["size"], row["config"])] = row
                print(f"  {row['size']}, {row['config']}: {row['seconds']} s")
        if done.returncode:
            sys.exit(f"the child failed:\n{done.stderr[-4000:]}")
    return found


def _pct(a: float | None, b: float | None) -> str | None:
    return None if not a or not b else f"{100 * (a - b) / b:+.1f}%"


def program(text: str) -> list[str]:
    """The text without what only describes it: the file and stack tables, each
    instruction's `metadata`, the module's fingerprint."""
    out, tables = [], False
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            tables = True
        elif tables and line.startswith(("%", "ENTRY", "HloModule")):
            tables = False
        if not tables:
            line = re.sub(r",? metadata=\{[^}]*\}", "", line)
            out.append(re.sub(r'fingerprint_before_lhs="\w*"', "", line))
    return out


def counts(text: str) -> dict[str, int]:
    """What in the text a compile on the GPU would do otherwise."""
    return {
        "cuBLAS calls": text.count('custom_call_target="__cublas$'),
        "cuDNN calls": text.count('custom_call_target="__cudnn$'),
        "Triton GEMM fusions": text.count('"kind":"__triton_nested_gemm_fusion"'),
        "copy-start": len(re.findall(r" copy-start\(", text)),
    }


def differs(r: dict[str, Any], d: dict[str, Any], text: str, rev: str) -> list[str]:
    """How this compile differs from the one the GPU ran, in short sentences."""
    c = counts(text)
    out = [
        "jax/jaxlib 0.10.2 with the CUDA 12 plugin, compile only (no GPU), against "
        "0.11.2 with the CUDA 13 plugin on the H200: another XLA. "
        f"{rev}'s pyproject allows jax<=0.10.2: the GPU ran a newer JAX than the "
        "code was written for.",
        "No autotuning without a GPU: the "
        f"{c['Triton GEMM fusions']} GEMMs are Triton fusions at a default tiling "
        f"(no cuBLAS: {c['cuBLAS calls']} calls), where the GPU chose among cuBLAS "
        f"and tuned Triton configurations; {c['cuDNN calls']} cuDNN calls, and the "
        "benchmark GPT has no attention (LayerNorm + MLP blocks), so no fused "
        "attention is at stake.",
        "The GPU timed the train step's own `jax.jit`; this is the program "
        "`memory_report` compiles from the same step (`keep_unused=True`, model and "
        "state donated).",
    ]
    if d["XLA_FLAGS"]:
        out.append(
            f"XLA_FLAGS={d['XLA_FLAGS']}, as on the GPU (`_flag_env`: the flag "
            "alone, the GPU machine having none of its own recorded)."
        )
    else:
        out.append("No XLA_FLAGS, as on the GPU.")
    on_gpu, peak = r.get("report device bytes"), r.get("peak bytes after steps")
    out.append(
        f"Device bytes {d['device bytes']}: {_pct(d['device bytes'], peak)} against "
        f"the measured peak ({peak}), {_pct(d['device bytes'], on_gpu)} against "
        f"the on-GPU compile's memory analysis ({on_gpu})."
    )
    if d["waiting"]:
        first = d["first step"]
        out.append(
            "The steps timed had an update waiting (`PendingUpdate.ready`), a "
            f"program of its own: this one. {rev}'s `memory_report` compiled the "
            "first step's (nothing waiting), on the GPU too: its deviceless "
            f"estimate {first['estimated step s']:.4g} s and "
            f"{first['device bytes']} device bytes, against the on-GPU report's "
            f"{r['estimated step s']:.4g} s and {on_gpu}. The JSON's `estimate / "
            "measured` for this row compares the first step's estimate with the "
            "steady step's time."
        )
    recorded = r.get("deviceless gpu-h200 estimated step s")
    if recorded is not None:
        same = recorded == d["estimated step s"]
        out.append(
            f"{rev}'s own estimate of this text ({d['estimated step s']:.6g} s) "
            + ("equals" if same else "differs from")
            + f" the deviceless estimate recorded in the JSON ({recorded:.6g} s"
            + (
                ")."
                if same
                else f", {_pct(d['estimated step s'], recorded)}: that figure "
                "came from gpu_check_deviceless.json, written by older code)."
            )
        )
    else:
        out.append("The JSON records no deviceless estimate for this row.")
    also = d.get("also")
    if also is not None:
        out.append(
            f"At {ALSO} the program is "
            + ("the same" if also["same program"] else "different")
            + f" (metadata aside): {also['device bytes']} device bytes, {ALSO}'s "
            f"estimate {also['estimated step s']:.4g} s."
        )
    return out


def write(
    rows: list[dict[str, Any]], found: dict[str, dict], out: Path, rev: str
) -> None:
    here = versions()
    manifest = []
    for r in rows:
        name = slug(r["size"], r["config"])
        d = found[name]
        path = out / f"{name}.hlo.gz"
        text = gzip.decompress(path.read_bytes()).decode()
        manifest.append(
            {
                "slug": name,
                "size": r["size"],
                "config": r["config"],
                "file": path.name,
                "model": dict(
                    zip(["vocab", "dim", "layers", "batch", "seq"], d["size_tuple"])
                ),
                "optimizer": "optax.adamw(1e-4)",
                "xla flags": d["XLA_FLAGS"],
                "update waiting": d["waiting"],
                "measured step s": r["step s median"],
                "measured step s min": r["step s min"],
                "measured peak bytes after steps": r["peak bytes after steps"],
                "measured on": "one NVIDIA H200, jax 0.11.2, CUDA 13 plugin, "
                + r["result file"],
                "on-GPU report device bytes": r["report device bytes"],
                "on-GPU report host bytes": r["report host bytes"],
                "on-GPU estimated step s": r["estimated step s"],
                "compiled with": {
                    "revision": rev,
                    "target": "gpu-h200",
                    "deviceless": True,
                    **here,
                },
                "deviceless device bytes": d["device bytes"],
                "deviceless host bytes": d["host bytes"],
                "deviceless device bytes vs measured peak": _pct(
                    d["device bytes"], r["peak bytes after steps"]
                ),
                "deviceless estimated step s": d["estimated step s"],
                "deviceless estimate bound": d["bound"],
                "recorded deviceless estimated step s": r.get(
                    "deviceless gpu-h200 estimated step s"
                ),
                f"at {ALSO}": d.get("also"),
                "text sha256": d["sha256"],
                "text chars": d["chars"],
                "text counts": counts(text),
                "differs": differs(r, d, text, rev),
            }
        )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {out / 'manifest.json'}")


def price(out: Path) -> None:
    """Every fixture priced by this checkout's `eqx_offload` at `gpu-h200`."""
    import eqx_offload
    import eqx_offload.internal as eoi

    hardware = eqx_offload.Hardware.of("gpu-h200")
    manifest = json.loads((out / "manifest.json").read_text())
    print(f"{'slug':50} {'measured ms':>11} {'today ms':>9} {'ratio':>6} {'s':>5}")
    total = 0.0
    for row in manifest:
        text = gzip.decompress((out / row["file"]).read_bytes()).decode()
        assert hashlib.sha256(text.encode()).hexdigest() == row["text sha256"]
        start = time.perf_counter()
        t = eoi.step_time_estimate(text, hardware, "gpu")
        seconds = time.perf_counter() - start
        total += seconds
        m = row["measured step s"]
        print(
            f"{row['slug']:50} {1e3 * m:11.1f} {1e3 * t.seconds:9.1f} "
            f"{t.seconds / m:6.2f} {seconds:5.2f}"
        )
    size = sum(p.stat().st_size for p in out.glob("*.hlo.gz"))
    print(f"{len(manifest)} fixtures, {size} bytes gzip, priced in {total:.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--price", action="store_true", help="only re-price the fixtures")
    p.add_argument("--rev", default=REV, help=f"the code to compile ({REV})")
    p.add_argument("--out", type=Path, default=OUT, help=f"where to write ({OUT})")
    args = p.parse_args()
    if not args.price:
        args.out.mkdir(parents=True, exist_ok=True)
        rows = measured_rows()
        with tempfile.TemporaryDirectory() as tmp:
            tree, also = Path(tmp) / "tree", Path(tmp) / "also"
            tree.mkdir()
            extract(tree, args.rev)
            found = compile_all(rows, tree, args.out)
            if args.rev != ALSO:
                shutil.rmtree(tree)
                tree.mkdir()
                extract(tree, ALSO)
                also.mkdir()
                compared = compile_all(rows, tree, also)
                for name, d in found.items():
                    e = compared[name]
                    d["also"] = {
                        "same program": program(_read(args.out / f"{name}.hlo.gz"))
                        == program(_read(also / f"{name}.hlo.gz")),
                        "device bytes": e["device bytes"],
                        "estimated step s": e["estimated step s"],
                    }
        write(rows, found, args.out, args.rev)
    price(args.out)


def _read(path: Path) -> str:
    return gzip.decompress(path.read_bytes()).decode()


if __name__ == "__main__":
    main()
