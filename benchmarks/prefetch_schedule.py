"""The loop bodies of a train step as compiled for a TPU or GPU: host reads (`S`
start, `D` done), writes (`s`, `d`) and matmuls (`g`) in scheduled order, with the
step-time estimate, for `Policy(prefetch=0)` and `1` (`docs/step-time.md`, "Reading
layers ahead").

    JAX_PLATFORMS=cpu python benchmarks/prefetch_schedule.py --arch llama \\
        --width 2048 --depth 4 --target gpu-h100 --option \\
        xla_gpu_experimental_parallel_async_compute_limit=16

Everything it prints is read from a compiled program, not timed."""

import argparse
from typing import Any, Literal, NamedTuple

import compile_matrix as cm
import jax.numpy as jnp
import optax
from _compiles import compiles

import eqx_offload as eo
import eqx_offload.internal as eoi


class Event(NamedTuple):
    """One step of a loop body's schedule: the start or end of a move between host
    and device memory, or a matmul."""

    what: Literal["read", "write", "matmul"]  # read: host to device
    phase: Literal["start", "done", ""]
    start: str  # the name of the move's start instruction ("" for a matmul)
    nbytes: int = 0


def loop_schedules(module: Any) -> dict[str, list[Event]]:
    """Each `while` body of a scheduled program (`eoi.parse_hlo` of one compiled
    for a TPU or GPU), with its host-memory moves and matmuls in the order the
    compiler scheduled them. A move is asynchronous (a `*-start` and its `*-done`;
    a GPU's is a `fusion-start` of a wrapped slice); a synchronous one (a `fusion`
    of a slice) is a start and a done in a row."""
    comps = module.computations
    bodies = {
        inst.computation("body")
        for comp in comps.values()
        for inst in comp.insts.values()
        if inst.opcode == "while"
    }
    out = {}
    for name in sorted(b for b in bodies if b in comps):
        comp = comps[name]
        events: list[Event] = []
        starts: dict[str, Event] = {}
        for inst in comp.insts.values():
            move = _async_move(comps, comp, inst)
            if move is not None:
                direction, nbytes = move
                what = "read" if direction == "host_to_device" else "write"
                event = Event(what, "start", inst.name, nbytes)
                if inst.opcode.endswith("-start"):
                    starts[inst.name] = event
                    events.append(event)
                else:
                    events += [event, event._replace(phase="done")]
            elif inst.opcode.endswith("-done") and inst.operands:
                begun = starts.get(inst.operands[0])
                if begun is not None:
                    events.append(begun._replace(phase="done"))
            elif _is_matmul(comps, inst):
                events.append(Event("matmul", "", ""))
        out[name] = events
    return out


_MOVES = ("dynamic-slice", "slice", "copy", "dynamic-update-slice")


def _async_move(comps: dict, comp: Any, inst: Any) -> tuple[str, int] | None:
    found = eoi.hlo_moved(comp, inst)
    if found is None and inst.opcode in ("fusion-start", "fusion"):
        # A fusion of a slice (then, perhaps, a copy into another layout).
        called = comps.get(inst.computation("calls") or "")
        if called is not None:
            for inner in called.insts.values():
                found = eoi.hlo_moved(called, inner) if inner.opcode in _MOVES else None
                if found is not None:
                    break
    return None if found is None else found[:2]


def _is_matmul(comps: dict, inst: Any) -> bool:
    """A `dot` or `convolution`, a cuBLAS call, or a fusion of one."""
    if inst.opcode in ("dot", "convolution"):
        return True
    if inst.opcode == "custom-call":
        return "cublas" in inst.attrs
    if inst.opcode == "fusion":
        called = comps.get(inst.computation("calls") or "")
        if called is not None:
            return any(
                i.opcode in ("dot", "convolution") for i in called.insts.values()
            )
    return False


def order(events: list[Event]) -> str:
    """A schedule as letters: `S`/`D` a read's start and done, `s`/`d` a write's,
    `g` a matmul."""
    letters = {("read", "start"): "S", ("read", "done"): "D"}
    letters |= {("write", "start"): "s", ("write", "done"): "d"}
    return "".join(letters.get((e.what, e.phase), "g") for e in events)


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
    orders = {name: order(events) for name, events in loop_schedules(module).items()}
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
