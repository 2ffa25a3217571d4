"""What a checkpoint costs in host memory: the peak resident set size above the
model and optimizer state while `save` (synchronous and `wait=False`) and `load`
run, for a stack of linear layers under `Policy.offload_all()` (parameters and
AdamW state in pinned host memory).

    python benchmarks/checkpoint_memory.py [--mib 256] [--json FILE]

Peaks are read from `/proc/self/status` (`VmHWM`, reset before each phase through
`/proc/self/clear_refs`), so this runs on Linux only.
"""

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import MIB, parser, table, write_json
from models.layers import TanhLayer

import eqx_offload as eo


PHASES = ("save", "async", "load")
LABELS = {
    "save": "save (wait=True)",
    "async": "save (wait=False)",
    "load": "load (beyond the restored state)",
}


def status(field: str) -> int:
    """A `VmRSS`/`VmHWM` line of `/proc/self/status`, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> int:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def measure(phase: str, root: str, mib: int) -> dict:
    """One phase, in a process of its own (so that memory freed by another phase
    and kept by the allocator does not hide this one's peak)."""
    dim, depth = 1024, max(1, mib * MIB // (1024 * 1024 * 4))
    policy = eo.Policy.offload_all()
    optimizer = optax.adamw(1e-3)
    stack = eo.Stacked.from_fn(
        lambda k: TanhLayer(dim, key=k), depth, key=jax.random.key(0)
    )
    model = eo.place(stack, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    state = nbytes((model, opt_state))
    eo.save(f"{root}/warmup-{phase}", {"a": jnp.zeros(4)}, None, step=0)
    eo.load(
        f"{root}/warmup-{phase}",
        ({"a": jnp.zeros(4)}, None),
        policy,
        optimizer=optimizer,
    )
    out: dict = {"state_bytes": state, "layers": depth, "dim": dim}
    if phase == "load":
        like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x,
            (model, opt_state),
        )
        del model, opt_state, stack
        before = reset_peak()
        t = time.perf_counter()
        restored = eo.load(f"{root}/save", like, policy, optimizer=optimizer)
        out["seconds"] = time.perf_counter() - t
        out["peak_extra_bytes"] = status("VmHWM") - before - nbytes(restored[:2])
        return out
    before = reset_peak()
    t = time.perf_counter()
    saving = eo.save(f"{root}/{phase}", model, opt_state, step=1, wait=phase == "save")
    out["returned_seconds"] = time.perf_counter() - t
    out["held_bytes_on_return"] = status("VmRSS") - before
    saving.wait()
    out["seconds"] = time.perf_counter() - t
    out["peak_extra_bytes"] = status("VmHWM") - before
    return out


def main():
    p = parser(__doc__)
    p.add_argument("--mib", type=int, default=256, help="size of the parameters")
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        print(json.dumps(measure(args.phase, args.root, args.mib)))
        return
    root = tempfile.mkdtemp()
    results, rows = {}, []
    for phase in PHASES:
        command = [sys.executable, __file__, "--phase", phase, "--root", root]
        command += ["--mib", str(args.mib)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        r = results[phase] = json.loads(done.stdout.strip().splitlines()[-1])
        extra, state = r["peak_extra_bytes"], r["state_bytes"]
        note = ""
        if phase == "async":
            note = (
                f"returned after {r['returned_seconds']:.2f} s, holding "
                f"{r['held_bytes_on_return'] / MIB:.0f} MiB"
            )
        rows.append(
            [
                LABELS[phase],
                f"{extra / MIB:.0f}",
                f"{extra / state:.2f}",
                f"{r['seconds']:.2f}",
                note,
            ]
        )
    shutil.rmtree(root)
    r = results["save"]
    print(
        f"{r['layers']} layers of {r['dim']}x{r['dim']} float32 under offload_all: "
        f"parameters + AdamW state = {r['state_bytes'] / MIB:.0f} MiB in pinned host "
        "memory\n"
    )
    print(table(["phase", "peak extra host MiB", "x state", "seconds", ""], rows))
    write_json(args.json, "checkpoint_memory", results)


if __name__ == "__main__":
    main()
