"""The command line: `python -m eqx_offload plan module:factory --target tpu-v5e
--device-budget 16GiB --host-budget 48GB` plans a training step (`eo.plan`) and
prints the table of candidates (when nothing fits too, before the message, and
`--json` writes it with `"fits": false`); `--chip tpu-v5e` instead of `--target`
finds the fewest devices (`eo.fewest_chips`). `--experimental prefetch
next_forward host_update` turns on `plan`'s experimental stages,
`--workspace-margin 1GiB` sets the device memory left free, `--hardware FILE` prices
the steps with a calibration file (`eo.Hardware.from_measurements`).
`--tokens-per-update 262144` makes the batch that many tokens (the factory's
batch's sequence length kept) and searches the micro-batch count
(`plan(microbatches="search")`), as `--microbatches search` does for the
factory's batch.

Stopped by Ctrl-C or a SIGTERM (`timeout`), it prints the best plan of what it has
compiled and its table, writes `--json` (with `"interrupted": true`), and exits
with 128 + the signal's number (130, 143).

The factory is a function of no arguments, named by its module's dotted path and
its name (`mypackage.models:llama_1b`). It returns the arguments of
`memory_report(step, model, opt_state, *batch)` as `(step, model, opt_state,
batch)`: an `eo.TrainStep`, and the model, its optimizer state and the batch (a
tuple of the loss's batch arguments) as arrays or `jax.ShapeDtypeStruct`s, e.g.
`eqx.filter_eval_shape(Model, key=key)`. The plan keeps the step's loss,
optimizer and `has_aux`, and chooses its own policy. It ignores `metrics`, which
changes no placement. A step with `unsplit` is refused: the planner splits every
batch argument.
"""

import argparse
import contextlib
import functools
import importlib
import json
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jax

from ._errors import see
from ._planner import fewest_chips, Plan, plan, PlanInterrupted, PlanTable
from ._planner._choice import EXPERIMENTAL
from ._planner._plan_type import batch_size
from ._report import DoesNotFit, Hardware
from ._train_step import TrainStep


_RETURNS = "`(step, model, opt_state, batch)`, `step` an `eo.TrainStep`"


def _factory(spec: str) -> Any:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise SystemExit(
            f"eqx_offload plan: the factory {spec!r} is not `module:function` (e.g. "
            "`mypackage.models:llama_1b`)."
        )
    sys.path.insert(0, str(Path.cwd()))
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"eqx_offload plan: cannot load the factory {spec!r}: {e}.")
    made = found()
    if not (isinstance(made, tuple) and len(made) == 4 and isinstance(made[3], tuple)):
        raise SystemExit(
            f"eqx_offload plan: the factory {spec!r} returned "
            f"{type(made).__name__}. Return {_RETURNS} and `batch` a tuple."
        )
    if not isinstance(made[0], TrainStep):
        raise SystemExit(
            f"eqx_offload plan: the factory {spec!r} returned a "
            f"{type(made[0]).__name__} first. Return {_RETURNS}, as "
            "`memory_report` takes them (not `(loss_fn, optimizer, model, batch)`)."
        )
    return made


# `plan`'s options besides where it plans: flag -> `add_argument`'s keywords.
_OPTIONS: dict[str, dict[str, Any]] = {
    "--batch-per-device": dict(
        action="store_true", help="with --chip: the batch is one device's share"
    ),
    "--tokens-per-update": dict(
        type=int,
        metavar="N",
        help="tokens per optimizer update: the batch becomes this many tokens over "
        "the sequence length of the factory's first batch argument (an integer "
        "[examples, sequence] array), and the micro-batch count is searched",
    ),
    "--microbatches": dict(
        type=lambda text: text if text == "search" else int(text),
        nargs="+",
        metavar="K",
        help="counts to offer, or 'search': the fewest that fit (by default the "
        "step's own; 'search' with --tokens-per-update)",
    ),
    "--compute-dtypes": dict(
        nargs="+",
        default=["model"],
        help="dtypes to offer: 'model' (its own), 'bfloat16', ...",
    ),
    "--device-budget": dict(help="device memory per device: '16GiB', bytes"),
    "--host-budget": dict(help="host memory per device: '48GB', bytes"),
    "--experimental": dict(
        nargs="+",
        choices=EXPERIMENTAL,
        default=[],
        help="experimental stages to run, off by default: their gain rests on an "
        "overlap no measurement has shown (on an H200, measured: prefetch 173.6 ms "
        "a step against 173.3 ms without; next_forward 1-3%% faster; host_update "
        "2.75x slower than the streamed update)",
    ),
    "--workspace-margin": dict(
        type=lambda text: int(text) if text.strip().isdigit() else text,  # bytes
        help="device memory left free under the budget: '1GiB', bytes, 0 (default: "
        "2GiB on a GPU, 0 on a TPU)",
    ),
    "--hardware": dict(
        type=Path,
        help="price steps with this calibration file (`benchmarks/gpu_check.py "
        "--calibrate`)",
    ),
    # The step says it now (`train_step(has_aux=True)`): refused with the way.
    "--has-aux": dict(action="store_true", help=argparse.SUPPRESS),
    "--json": dict(
        type=Path, help="also write the table to this file (with whether anything fits)"
    ),
}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eqx_offload")
    sub = p.add_subparsers(dest="command", required=True).add_parser(
        "plan", help="the fastest placement of a training step within budgets"
    )
    sub.add_argument(
        "factory", help="module:function returning (step, model, opt_state, batch)"
    )
    where = sub.add_mutually_exclusive_group()
    where.add_argument("--target", help="'tpu-v5e', 'tpu-v5e:4x4', 'gpu-h100', ...")
    where.add_argument(
        "--chip", help="the fewest devices of this chip kind: 'tpu-v5e', 'gpu-h100'"
    )
    for flag, keywords in _OPTIONS.items():
        sub.add_argument(flag, **keywords)
    args = p.parse_args(argv)
    if args.batch_per_device and args.chip is None:
        raise SystemExit("eqx_offload plan: --batch-per-device needs --chip.")
    if args.has_aux:
        raise SystemExit(
            "eqx_offload plan: --has-aux is gone; the factory's step says it: "
            "`train_step(..., has_aux=True)`."
        )
    step, model, _, batch = _factory(args.factory)
    if args.tokens_per_update is not None:
        batch = _per_update(batch, args.tokens_per_update)
    if step.unsplit:
        raise SystemExit(
            f"eqx_offload plan: the step has `unsplit={step.unsplit}`, which the "
            "planner cannot keep. Build the factory's step without `unsplit`."
        )
    hardware = None
    if args.hardware is not None:
        try:
            hardware = Hardware.from_measurements(args.hardware)
        except ValueError as e:
            raise SystemExit(f"eqx_offload plan: {e}") from None
    if args.chip is None:
        search = functools.partial(plan, target=args.target)
    else:
        chip, per_device = args.chip, args.batch_per_device
        search = functools.partial(fewest_chips, chip=chip, batch_per_device=per_device)
    options = dict(
        device_budget=args.device_budget,
        host_budget=args.host_budget,
        has_aux=step.has_aux,
        microbatches=_microbatches(args, step),
        compute_dtypes=tuple(None if d == "model" else d for d in args.compute_dtypes),
        progress=True,
        experimental=tuple(args.experimental),
        workspace_margin=args.workspace_margin,
        hardware=hardware,
    )
    search = functools.partial(search, step.loss_fn, step.optimizer, model, *batch)
    signals: list[int] = []
    try:
        with _sigterm_interrupts(signals):
            result = _plan(args.json, functools.partial(search, **options))
    except PlanInterrupted as e:
        _interrupted(e, args.json, signals[0] if signals else signal.SIGINT)
    _show(args.json, result, result.table)


def _per_update(batch: tuple, tokens: int) -> tuple:
    """The factory's batch with `tokens` per update: each array's leading size
    `tokens / sequence`, the sequence the second axis of the first argument."""
    _, sequence = batch_size(batch)
    if sequence is None:
        raise SystemExit(
            "eqx_offload plan: --tokens-per-update needs an integer [examples, "
            "sequence] first batch argument." + see(149)
        )
    if tokens <= 0 or tokens % sequence:
        raise SystemExit(
            f"eqx_offload plan: --tokens-per-update {tokens} is not a multiple of the "
            f"sequence length, {sequence}." + see(149)
        )

    def resized(x: Any) -> Any:
        shape = (tokens // sequence, *x.shape[1:])
        return jax.ShapeDtypeStruct(shape, x.dtype) if getattr(x, "ndim", 0) else x

    return jax.tree.map(resized, batch)


def _microbatches(args: argparse.Namespace, step: TrainStep) -> Any:
    """The micro-batch counts offered: those given, or `"search"`; by default the
    step's own, `"search"` with --tokens-per-update."""
    default = "search" if args.tokens_per_update else step.microbatches
    offered = args.microbatches or [default]
    return "search" if offered == ["search"] else tuple(offered)


def _plan(path: Path | None, search: Callable[[], Plan]) -> Plan:
    """`search()` (`plan` or `fewest_chips` of the factory's step); what nothing
    fits prints and writes (to `path`) before the command ends with its message;
    bad input ends it too."""
    try:
        return search()
    except DoesNotFit as e:  # what was tried, then the message and a status
        _show(path, None, e.tried, message=str(e))
        raise SystemExit(f"eqx_offload plan: {e}") from None
    except (ValueError, TypeError) as e:  # bad input
        if isinstance(e, TypeError) and not str(e).startswith("`plan("):
            raise  # from the factory's model or loss: with its traceback
        raise SystemExit(f"eqx_offload plan: {e}") from None


@contextlib.contextmanager
def _sigterm_interrupts(received: list[int]) -> Iterator[None]:
    """A SIGTERM (`timeout`'s) stops the plan as Ctrl-C does (a
    `KeyboardInterrupt`), its number kept in `received`; the handler before is
    put back after. (Off the main thread, where no handler can be set: as
    before.)"""

    def interrupt(signum: int, frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    with contextlib.ExitStack() as stack:
        with contextlib.suppress(ValueError):  # not the main thread
            previous = signal.signal(signal.SIGTERM, interrupt)
            stack.callback(signal.signal, signal.SIGTERM, previous)
        yield


def _interrupted(e: PlanInterrupted, path: Path | None, signum: int) -> NoReturn:
    """The best plan so far and its table (or the table of what was compiled),
    written to `path` too; then the end, with status 128 + `signum`."""
    table = e.plan.table if e.plan is not None else e.tried
    empty = {"rows": []} if table is None else {}
    _show(path, e.plan, table, interrupted=True, message=str(e), **empty)
    name = signal.Signals(signum).name
    print(f"eqx_offload plan: stopped by {name}: {e}", file=sys.stderr)
    raise SystemExit(128 + signum)


def _show(
    path: Path | None, plan: Plan | None, table: PlanTable | None, **more: Any
) -> None:
    """Prints the plan and its policy, or else the table of what was tried; and
    writes `path` (if any): whether a plan fits, `more`, and the table."""
    if plan is not None:
        print(plan)
        print(f"\npolicy: {plan.policy}")
        more |= {
            "microbatches": plan.microbatches,
            "examples_per_update": plan.examples,
            "tokens_per_update": plan.tokens_per_update,
        }
    elif table is not None:
        print(table)
    if path is not None:
        rows = {} if table is None else table.to_dict()
        path.write_text(
            json.dumps({"fits": plan is not None, **more, **rows}, indent=2) + "\n"
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
