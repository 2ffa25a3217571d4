"""Soak test: a long run of the quickstart model (examples/quickstart.py) under
`Policy.offload_all()`, saving an asynchronous checkpoint every `--every` steps
(keeping the last `--keep`) and calling `eo.memory_report` now and then. Reports
the resident set size after warm-up and at the end, the disk use of the
checkpoints, and how many times the step was compiled.

    python benchmarks/soak.py [--steps 2000] [--every 100] [--keep 3] [--json FILE]

Targets: RSS grows < 5% from the end of warm-up (the first `--warmup` steps, with
their checkpoints and memory reports) to the end; the step compiles once. At the
end the latest checkpoint is loaded into an abstract model and compared with the
live model, bit for bit.
"""

import ctypes
import os
import shutil
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import numpy as np
import optax
from _common import example, MIB, parser, table, write_json

import eqx_offload as eo


def rss() -> int:
    """Resident set size of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def trimmed_rss() -> int:
    """RSS after glibc has returned its free heap memory to the system
    (`malloc_trim`): what the process still holds, without the allocator's cache."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss()


# What `jax.monitoring` reports each time a program is compiled for a backend.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CountingCompiles:
    """`fn`, counting the calls during which JAX compiled a program (a step that
    compiles once, on its first call, counts 1 however often it is called)."""

    def __init__(self, fn):
        self.fn = fn
        self.compiling_calls = 0
        self._compiled = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration_secs: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            self._compiled = True

    def __call__(self, *args):
        self._compiled = False
        out = self.fn(*args)
        self.compiling_calls += self._compiled
        self._compiled = False
        return out


def disk_use(directory: str) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def restores_exactly(qs, directory, policy, optimizer, model, opt_state):
    """Whether the latest checkpoint, loaded into an abstract model, equals the live
    model and optimizer state bit for bit; and its step."""
    vocab, dim, depth, seq = 64, 64, 4, 32
    abstract = eqx.filter_eval_shape(
        qs.GPT, vocab, dim, depth, seq, key=jax.random.key(0)
    )
    like = (abstract, eo.init_opt_state(optimizer, abstract, policy))
    restored = eo.load(directory, like, policy, optimizer=optimizer)
    leaves = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_array))  # noqa: E731
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(leaves(restored[:2]), leaves((model, opt_state)), strict=True)
    )
    return same, restored.step


def main():
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=100, help="checkpoint interval")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument(
        "--wait", action="store_true", help="save synchronously (`wait=True`)"
    )
    p.add_argument("--report-every", type=int, default=250, help="0: never")
    p.add_argument(
        "--no-save",
        dest="save",
        action="store_false",
        help="save no checkpoint (RSS is still sampled every `--every` steps)",
    )
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument(
        "--directory", help="checkpoint directory (default: a temporary one)"
    )
    args = p.parse_args()
    qs = example("quickstart")
    vocab, dim, depth, seq, batch_size = 64, 64, 4, 32, 16

    policy = eo.Policy.offload_all()
    optimizer = optax.adamw(3e-3)
    model = eo.place(qs.GPT(vocab, dim, depth, seq, key=jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    train_step = eo.train_step(qs.loss_fn, optimizer, policy)
    step = CountingCompiles(train_step)
    rng = np.random.default_rng(0)
    directory = args.directory or tempfile.mkdtemp(prefix="soak-")
    shutil.rmtree(directory, ignore_errors=True)

    samples, losses, reports = [], [], 0
    warm = warm_trimmed = None
    start = time.perf_counter()
    for i in range(1, args.steps + 1):
        batch = qs.counting_sequences(rng, batch_size, seq, vocab)
        model, opt_state, loss, _ = step(model, opt_state, *batch)
        if args.report_every and (i % args.report_every == 0 or i == 1):
            eo.memory_report(train_step, model, opt_state, *batch)
            reports += 1
        if i % args.every == 0:
            losses.append(float(loss))
            samples.append((i, rss(), trimmed_rss()))
            if i == args.warmup:
                warm, warm_trimmed = samples[-1][1:]
        if args.save and i % args.every == 0:
            eo.save(
                directory,
                model,
                opt_state,
                step=i,
                extra={"data_step": i},
                keep=args.keep,
                wait=args.wait,
            )
    eo.wait_until_finished()
    seconds = time.perf_counter() - start
    end, end_trimmed = rss(), trimmed_rss()
    if warm is None or warm_trimmed is None:
        warm, warm_trimmed = samples[0][1:]

    same, restored_step = None, None
    if args.save:
        same, restored_step = restores_exactly(
            qs, directory, policy, optimizer, model, opt_state
        )
    results = {
        "steps": args.steps,
        "seconds": seconds,
        "rss_after_warmup_bytes": warm,
        "rss_end_bytes": end,
        "rss_growth": end / warm - 1,
        "trimmed_rss_after_warmup_bytes": warm_trimmed,
        "trimmed_rss_end_bytes": end_trimmed,
        "trimmed_rss_growth": end_trimmed / warm_trimmed - 1,
        "rss_samples": samples,
        "checkpoint_steps": eo.saved_steps(directory),
        "disk_bytes": disk_use(directory),
        "state_bytes": sum(
            x.nbytes
            for x in jax.tree.leaves(eqx.filter((model, opt_state), eqx.is_array))
        ),
        "compiles": step.compiling_calls,
        "memory_reports": reports,
        "losses_at_checkpoints": losses,
        "restored_step": restored_step,
        "restored_equals_live": same,
    }
    if args.directory is None:
        shutil.rmtree(directory, ignore_errors=True)

    print(
        f"{args.steps} steps in {seconds:.0f} s ({1e3 * seconds / args.steps:.1f} ms "
        f"a step), checkpoint every {args.every} "
        f"({'wait=True' if args.wait else 'async'}, keep {args.keep}), "
        f"{reports} memory reports\n"
    )
    print(
        table(
            ["measure", "value", "target"],
            [
                [
                    f"RSS after warm-up (step {args.warmup})",
                    f"{warm / MIB:.1f} MiB",
                    "",
                ],
                ["RSS at the end", f"{end / MIB:.1f} MiB", ""],
                ["RSS growth", f"{100 * results['rss_growth']:+.2f}%", "< 5%"],
                [
                    "the same after `malloc_trim`",
                    f"{warm_trimmed / MIB:.1f} -> {end_trimmed / MIB:.1f} MiB, "
                    f"{100 * results['trimmed_rss_growth']:+.2f}%",
                    "< 5%",
                ],
                ["compiles of the step", results["compiles"], "1"],
                ["checkpoints on disk", str(results["checkpoint_steps"]), ""],
                ["disk use", f"{results['disk_bytes'] / MIB:.2f} MiB", ""],
                [
                    "parameters + optimizer state",
                    f"{results['state_bytes'] / MIB:.2f} MiB",
                    "",
                ],
                ["latest checkpoint == live model", str(same), "True"],
            ],
        )
    )
    write_json(args.json, "soak", results)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    main()
