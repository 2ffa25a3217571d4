"""The command line: `python -m eqx_offload plan module:factory --target tpu-v5e
--device-budget 16GiB --host-budget 48GB` plans a training step (`eo.plan`) and
prints the table of candidates (when nothing fits too, before the message, and
`--json` writes it with `"fits": false`); `--chip tpu-v5e` instead of `--target`
finds the fewest devices (`eo.fewest_chips`). `--experimental prefetch
next_forward host_update` turns on `plan`'s experimental stages,
`--workspace-margin 1GiB` sets the device memory left free, `--hardware FILE` prices
the steps with a calibration file (`eo.Hardware.from_measurements`).

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
import importlib
import json
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ._planner import fewest_chips, plan, PlanInterrupted
from ._planner._choice import EXPERIMENTAL
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


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eqx_offload")
    commands = p.add_subparsers(dest="command", required=True)
    sub = commands.add_parser(
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
    sub.add_argument(
        "--batch-per-device",
        action="store_true",
        help="with --chip: the batch is one device's share",
    )
    sub.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        help="counts to offer (by default the step's own)",
    )
    sub.add_argument(
        "--compute-dtypes",
        nargs="+",
        default=["model"],
        help="dtypes to offer: 'model' (its own), 'bfloat16', ...",
    )
    sub.add_argument("--device-budget", help="device memory per device: '16GiB', bytes")
    sub.add_argument("--host-budget", help="host memory per device: '48GB', bytes")
    sub.add_argument(
        "--experimental",
        nargs="+",
        choices=EXPERIMENTAL,
        default=[],
        help="experimental stages to run (off by default: their gain rests on "
        "overlap no measurement has shown)",
    )
    sub.add_argument(
        "--workspace-margin",
        help="device memory left free under the budget: '1GiB', bytes, 0 (default: "
        "2GiB on a GPU, 0 on a TPU)",
    )
    sub.add_argument(
        "--hardware",
        type=Path,
        help="price steps with this calibration file (`benchmarks/gpu_check.py "
        "--calibrate`)",
    )
    # The step says it now (`train_step(has_aux=True)`): refused with the way.
    sub.add_argument("--has-aux", action="store_true", help=argparse.SUPPRESS)
    sub.add_argument(
        "--json",
        type=Path,
        help="also write the table to this file (with whether anything fits)",
    )
    args = p.parse_args(argv)
    if args.batch_per_device and args.chip is None:
        raise SystemExit("eqx_offload plan: --batch-per-device needs --chip.")
    if args.has_aux:
        raise SystemExit(
            "eqx_offload plan: --has-aux is gone; the factory's step says it: "
            "`train_step(..., has_aux=True)`."
        )
    step, model, _, batch = _factory(args.factory)
    if step.unsplit:
        raise SystemExit(
            f"eqx_offload plan: the step has `unsplit={step.unsplit}`, which the "
            "planner cannot keep. Build the factory's step without `unsplit`."
        )
    loss_fn, optimizer = step.loss_fn, step.optimizer
    hardware = None
    if args.hardware is not None:
        try:
            hardware = Hardware.from_measurements(args.hardware)
        except ValueError as e:
            raise SystemExit(f"eqx_offload plan: {e}") from None
    common = dict(
        device_budget=args.device_budget,
        host_budget=args.host_budget,
        has_aux=step.has_aux,
        microbatches=tuple(args.microbatches or (step.microbatches,)),
        compute_dtypes=tuple(None if d == "model" else d for d in args.compute_dtypes),
        progress=True,
        experimental=tuple(args.experimental),
        workspace_margin=_margin(args.workspace_margin),
        hardware=hardware,
    )
    signals: list[int] = []
    try:
        with _sigterm_interrupts(signals):
            result = _plan(args, loss_fn, optimizer, model, batch, common)
    except PlanInterrupted as e:
        _interrupted(e, args.json, signals[0] if signals else signal.SIGINT)
    print(result)
    print(f"\npolicy: {result.policy}")
    if args.json is not None:
        _write(args.json, {"fits": True, **result.table.to_dict()})


def _plan(
    args: argparse.Namespace,
    loss_fn: Any,
    optimizer: Any,
    model: Any,
    batch: tuple,
    common: dict[str, Any],
) -> Any:
    """`fewest_chips` or `plan`; what nothing fits prints and writes before the
    command ends with its message; bad input ends it too."""
    try:
        if args.chip is not None:
            result = fewest_chips(
                loss_fn,
                optimizer,
                model,
                *batch,
                chip=args.chip,
                batch_per_device=args.batch_per_device,
                **common,
            )
        else:
            result = plan(
                loss_fn, optimizer, model, *batch, target=args.target, **common
            )
    except DoesNotFit as e:  # what was tried, then the message and a status
        if e.tried is not None:
            print(e.tried)
        if args.json is not None:
            table = {} if e.tried is None else e.tried.to_dict()
            _write(args.json, {"fits": False, "message": str(e), **table})
        raise SystemExit(f"eqx_offload plan: {e}") from None
    except (ValueError, TypeError) as e:  # bad input
        if isinstance(e, TypeError) and not str(e).startswith("`plan("):
            raise  # from the factory's model or loss: with its traceback
        raise SystemExit(f"eqx_offload plan: {e}") from None
    return result


def _margin(text: str | None) -> int | str | None:
    """`--workspace-margin` as `plan` takes it: bytes as an int, else the text."""
    if text is None:
        return None
    return int(text) if text.strip().isdigit() else text


@contextlib.contextmanager
def _sigterm_interrupts(received: list[int]) -> Iterator[None]:
    """A SIGTERM (`timeout`'s) stops the plan as Ctrl-C does (a
    `KeyboardInterrupt`), its number kept in `received`; the handler before is
    put back after. (Off the main thread, where no handler can be set: as
    before.)"""

    def interrupt(signum: int, frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupted(e: PlanInterrupted, path: Path | None, signum: int) -> NoReturn:
    """The best plan so far and its table (or the table of what was compiled),
    written to `path` too; then the end, with status 128 + `signum`."""
    name = signal.Signals(signum).name
    if e.plan is not None:
        print(e.plan)
        print(f"\npolicy: {e.plan.policy}")
    elif e.tried is not None:
        print(e.tried)
    if path is not None:
        table = e.plan.table if e.plan is not None else e.tried
        _write(
            path,
            {
                "fits": e.plan is not None,
                "interrupted": True,
                "message": str(e),
                **({"rows": []} if table is None else table.to_dict()),
            },
        )
    print(f"eqx_offload plan: stopped by {name}: {e}", file=sys.stderr)
    raise SystemExit(128 + signum)


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
