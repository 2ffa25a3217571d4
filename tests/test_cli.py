"""`python -m eqx_offload plan module:factory ...`: plans from a factory function
named on the command line and prints the table; bad input is an exit with the
argument named."""

import json
import os
import runpy
import signal
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload as eo
from eqx_offload import __main__
from eqx_offload.__main__ import main
from eqx_offload.internal import compile_report

from .helpers import MLPBlock, StackedNet


ROOT = Path(__file__).parent.parent
# One optimizer object for `small_factory`'s steps: the plans of this file share
# their compiles.
OPTIMIZER = optax.adam(1e-3)


def _squared(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def small_factory():
    """For `python -m eqx_offload plan tests.test_cli:small_factory`: the step of a
    stack of two small MLP blocks (quick to compile for a TPU), the model
    (abstract), its optimizer state and a batch, as `memory_report` takes them."""
    optimizer, policy = OPTIMIZER, eo.Policy.none()
    model = eqx.filter_eval_shape(
        lambda k: StackedNet(lambda k: MLPBlock(32, 64, key=k), 2, key=k),
        jax.random.key(0),
    )
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(_squared, optimizer, policy)
    return step, model, opt_state, (jax.ShapeDtypeStruct((8, 32), jnp.float32),)


def _tokens_loss(model, tokens):
    return jnp.mean(jax.vmap(model)(tokens.astype(jnp.float32)) ** 2)


def tokens_factory():
    """`small_factory`'s model over a batch of 8 sequences of 32 token ids."""
    step, model, opt_state, _ = small_factory()
    step = eo.train_step(_tokens_loss, step.optimizer, step.policy)
    return step, model, opt_state, (jax.ShapeDtypeStruct((8, 32), jnp.int32),)


def test_tokens_per_update_sets_the_batch_and_searches_micro_batches(
    tmp_path, monkeypatch, capsys
):
    """`--tokens-per-update 2048` makes the factory's batch of 32-token sequences
    64 of them, and searches the micro-batch count (`plan(microbatches="search")`):
    within 1 GiB, the fewest is one. A count that is not a multiple of the
    sequence, and a batch of no token ids, are refused naming the flag."""
    monkeypatch.chdir(ROOT)
    searched = []
    monkeypatch.setattr(
        __main__,
        "plan",
        lambda *a, **k: searched.append((a[3:], k["microbatches"])) or eo.plan(*a, **k),
    )
    out = tmp_path / "plan.json"
    budgets = ["--device-budget", "1GiB", "--host-budget", "1GiB", "--json", str(out)]
    main(
        ["plan", "tests.test_cli:tokens_factory", "--tokens-per-update", "2048"]
        + budgets
    )
    ((batch, microbatches),) = searched
    assert batch == (jax.ShapeDtypeStruct((64, 32), jnp.int32),)
    assert microbatches == "search"
    printed = capsys.readouterr().out
    assert "Per update: 64 examples (2,048 tokens), in 1 micro-batch of 64" in printed
    written = json.loads(out.read_text())
    assert (written["tokens_per_update"], written["microbatches"]) == (2048, 1)
    message = _refused("tests.test_cli:tokens_factory", "--tokens-per-update", "100")
    assert "--tokens-per-update 100 is not a multiple of the sequence length, 32" in (
        message
    )
    message = _refused("tests.test_cli:small_factory", "--tokens-per-update", "64")
    assert "--tokens-per-update needs an integer [examples, sequence]" in message


def test_plan_prints_the_table(tmp_path, monkeypatch, capsys):
    """The command's `main` in this process."""
    out = tmp_path / "plan.json"
    monkeypatch.chdir(ROOT)  # `module:factory` is imported from here
    main(
        [
            "plan",
            "tests.test_cli:small_factory",
            "--target",
            "tpu-v5e",
            "--host-budget",
            "48GB",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "Plan on tpu-v5e: no remat, all on device: Policy.none() (1" in printed
    assert "budgets per device: 15.75 GiB device, 44.70 GiB host" in printed
    table = json.loads(out.read_text())
    assert [r["status"] for r in table["rows"]] == ["chosen"]
    assert table["host_budget"] == 48 * 10**9 and table["fits"] is True


def test_an_interrupted_plan_prints_and_writes_the_best_so_far(
    tmp_path, monkeypatch, capsys
):
    """Ctrl-C during the third candidate's compile (`offload_residuals`): the
    command prints the best plan of the two before (`Policy.none()` too big,
    `Policy.remat()` fits), writes it to `--json` with `"interrupted": true`, and
    exits with 130; a SIGTERM (`timeout`'s) before any compile writes an empty
    table, and exits with 143."""
    report = compile_report

    def interrupted(task, policy, microbatches):
        if policy.offload:
            raise KeyboardInterrupt
        return report(task, policy, microbatches)

    monkeypatch.chdir(ROOT)
    out = tmp_path / "plan.json"
    # 1.28 MiB for `Policy.none()`, 1.24 MiB for `Policy.remat()` on a v5e chip
    plan = ["plan", "tests.test_cli:small_factory", "--target", "tpu-v5e"]
    plan += ["--device-budget", "1400000", "--workspace-margin", "80000"]
    plan += ["--json", str(out)]
    monkeypatch.setattr("eqx_offload._planner._compile.report", interrupted)
    with pytest.raises(SystemExit) as e:
        main(plan)
    assert e.value.code == 130
    printed, said = capsys.readouterr()
    assert printed.startswith("Interrupted: the best of the candidates compiled")
    assert "recompute all: Policy.remat()" in printed.splitlines()[1]
    assert "(78.12 KiB of 1.34 MiB left free" in printed
    assert "stopped by SIGINT: `plan` for tpu-v5e interrupted after 2" in said
    written = json.loads(out.read_text())
    assert written["interrupted"] is True and written["fits"] is True
    assert written["workspace_margin"] == 80000
    assert [r["status"] for r in written["rows"]] == ["compiled", "chosen"]

    def terminated(*args):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr("eqx_offload._planner._plan._start", terminated)
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        main(plan)
    assert e.value.code == 143 and signal.getsignal(signal.SIGTERM) == previous
    assert json.loads(out.read_text()) == {
        "fits": False,
        "interrupted": True,
        "message": "`plan` interrupted after 0 compiled candidates: nothing to show.",
        "rows": [],
    }


def test_nothing_fits_prints_the_table_and_writes_the_json(
    tmp_path, monkeypatch, capsys
):
    """When no candidate fits, the table of what was tried is printed (a long
    label on two lines) and written with `"fits": false`, and the command ends with the
    message and a non-zero status (`plan` itself is stubbed: nothing compiles)."""
    label = "params on host: blocks; opt_state on host: blocks (mu); offload "
    label += "blocks.input; save the rest; bfloat16 compute"
    tried = eo.PlanTable((eo.PlanRow(label, eo.Policy(), "compiled", 2**30),), 1, 2)

    def nothing_fits(*args, **kwargs):
        error = eo.DoesNotFit(
            "`plan`: no candidate fits the budgets",
            target="tpu-v5e",
            compiler_message="",
            arguments={},
        )
        error.tried = tried
        raise error

    monkeypatch.setattr(__main__, "plan", nothing_fits)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "plan.json"
    factory = "tests.helpers:plan_factory"
    message = _refused(factory, "--target", "tpu-v5e", "--json", str(out))
    assert message == "eqx_offload plan: `plan`: no candidate fits the budgets"
    printed = capsys.readouterr().out
    assert str(tried) in printed and "\n  the rest; bfloat16 compute\n" in printed
    written = json.loads(out.read_text())
    assert written["fits"] is False and written["message"] in message
    assert [r["label"] for r in written["rows"]] == [label]


def test_python_dash_m_runs_the_command(monkeypatch, capsys):
    """`python -m eqx_offload` is the command above: the package's `__main__` run
    as `-m` runs it (`runpy`, in this process; its namespace starts from the
    imported module's, where the tests' type checker keeps its decorator)."""
    monkeypatch.setattr(sys, "argv", ["-m", "plan", "--help"])
    monkeypatch.delitem(sys.modules, "eqx_offload.__main__")  # run afresh
    with pytest.raises(SystemExit) as e:
        runpy.run_module(
            "eqx_offload", dict(vars(__main__)), run_name="__main__", alter_sys=True
        )
    assert e.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: python -m eqx_offload plan")
    assert "module:function returning (step, model, opt_state," in printed


def test_bad_input_names_the_argument():
    """Each refusal is an exit with its message (the command's own `main`, in this
    process: nothing is compiled)."""
    message = _refused("tests.helpers", "--target", "tpu-v5e")
    assert "is not `module:function`" in message
    assert "cannot load the factory" in _refused("tests.helpers:nothing_here")
    factory = "tests.helpers:plan_factory"
    message = _refused(factory, "--device-budget", "lots")
    assert "`plan(device_budget='lots')` is not a size. Give positive bytes" in message
    message = _refused(factory, "--target", "tpu-v5e", "--microbatches", "3")
    assert "`plan(microbatches=(3,))`: 3 micro-batches do not split" in message
    assert "`fewest_chips(chip='tpu-v9')`" in _refused(factory, "--chip", "tpu-v9")
    message = _refused(factory, "--target", "tpu-v5e", "--batch-per-device")
    assert "--batch-per-device needs --chip" in message
    message = _refused(factory, "--target", "gpu-h100", "--workspace-margin", "lots")
    assert "`plan(workspace_margin='lots')` is not a size" in message
    message = _refused(factory, "--target", "gpu-h200", "--hardware", "nowhere.json")
    assert "`Hardware.from_measurements('nowhere.json')`: cannot read it" in message


def test_the_old_factory_and_flag_name_the_new_form():
    """A factory of the old `(loss_fn, optimizer, model, batch)`, and `--has-aux`
    (the step says it now): exits naming what to write instead."""
    message = _refused("tests.helpers:old_plan_factory", "--target", "tpu-v5e")
    assert "returned a function first" in message
    assert "`(step, model, opt_state, batch)`, `step` an `eo.TrainStep`" in message
    assert "not `(loss_fn, optimizer, model, batch)`" in message
    message = _refused("tests.helpers:plan_factory", "--has-aux")
    assert "--has-aux is gone" in message and "train_step(..., has_aux=True)" in message


def _refused(*args: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(["plan", *args])
    assert isinstance(e.value.code, str)  # a message, not a status
    return e.value.code


def test_a_step_with_unsplit_is_refused(monkeypatch):
    """The planner splits every batch argument: a step's `unsplit` is refused."""
    from .helpers import plan_factory

    step, *rest = plan_factory()
    step = eo.train_step(
        step.loss_fn, step.optimizer, step.policy, microbatches=2, unsplit=(1,)
    )
    monkeypatch.setattr(__main__, "_factory", lambda _: (step, *rest))
    message = _refused("tests.helpers:plan_factory", "--target", "tpu-v5e")
    assert "`unsplit=(1,)`" in message and "without `unsplit`" in message
