"""The loop bodies of a train step as compiled for a TPU or GPU: host reads (`S`
start, `D` done), writes (`s`, `d`) and matmuls (`g`) in scheduled order, with the
step-time estimate, for `Policy(prefetch=0)` and `1` (`docs/step-time.md`, "Reading
layers ahead").

    JAX_PLATFORMS=cpu python benchmarks/prefetch_schedule.py --arch llama \\
        --width 2048 --depth 4 --target gpu-h100 --option \\
        xla_gpu_experimental_parallel_async_compute_limit=16

Everything it prints is read from a compiled program, not timed."""

import argparse

import compile_matrix as cm
import jax.numpy as jnp
import optax
from _compiles import compiles

import eqx_offload as eo
import eqx_offload.internal as eoi


def schedules(arch, width, depth, target, prefetch, policy, options, **fields):
    """The report of `arch`'s train step compiled for `target` with `options`,
    and the order of each loop body with a host read (`loop_schedules`);
    `fields`: more `Policy` fields (`update_timing`)."""
    model, loss, batch = cm.case(arch, width, depth, jnp.bfloat16)
    p = cm.policy_for(arch, policy, prefetch=prefetch, **fields)
    model = eo.place(model, p)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = eo.init_opt_state(optimizer, model, p)
    step = eo.train_step(loss, optimizer, p)
    with compiles(options) as texts:
        report = eo.memory_report(step, model, opt_state, *batch, target=target)
    module = eoi.parse_hlo(texts[-1])
    orders = {
        name: eoi.hlo_program_order(events)
        for name, events in eoi.loop_schedules(module).items()
    }
    return report, {k: o for k, o in orders.items() if "S" in o}


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--arch", default="llama", choices=cm.ARCHS)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--target", default="gpu-h100")
    parser.add_argument("--policy", default="offload_all", choices=list(cm.POLICIES))
    parser.add_argument("--option", action="append", default=[], help="NAME=VALUE")
    args = parser.parse_args()
    options = {}
    for option in args.option:
        name, value = option.split("=", 1)
        options[name] = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(options[name], str) and options[name].isdigit():
            options[name] = int(options[name])
    for prefetch in (0, 1):
        report, orders = schedules(
            args.arch,
            args.width,
            args.depth,
            args.target,
            prefetch,
            args.policy,
            options,
        )
        step_time = report.time
        print(f"prefetch={prefetch} {options or ''}")
        print(f"  device bytes {report.device_bytes / 2**20:.1f} MiB")
        if step_time is not None:
            print(f"  step time (estimate) {step_time.seconds * 1e3:.1f} ms")
            exposed = step_time.exposed_transfer_seconds * 1e3
            print(f"  transfers not hidden {exposed:.1f} ms")
        for name, order in orders.items():
            print(f"  {name}: {order}")


if __name__ == "__main__":
    main()
