"""Every example runs, in a small configuration, and shows what it claims: the
README's quickstart output, the hand-written step's losses and memory, the ported
ViT's logits, the sharded run's and the plan's first losses."""

import re
import runpy
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import matplotlib.pyplot as plt
import pytest

from .numerics import assert_close, excess


ROOT = Path(__file__).parent.parent
# The quickstart's GPT at one small size for `sharded.py`, `bf16_microbatches.py`
# and `plan.py` (and `char_gpt.py`'s blocks), so that in this process its eager
# initialisation compiles once, and the bf16 example's fp32 step is the sharded
# example's one-device step, read back from the compilation cache. One block, dim 32
# and a batch of 8 also keep the TPU compiles (a 2x4 slice, one chip) small: a
# slice's compile time grows with the depth, a chip's with the batch.
GPT_SIZE = ("--dim", "32", "--depth", "1", "--seq", "16")


@pytest.fixture
def run_example(tmp_path, monkeypatch, capsys):
    """`run_example("x.py", *args)` runs `examples/x.py` with these arguments in this
    process, as `python examples/x.py ...` would from `tmp_path` (where it writes its
    picture and checkpoints), and returns what it printed and what its `main()`
    returned. In this process, the examples reuse the programs the tests compiled
    before them."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # `from quickstart import GPT`

    def run(name: str, *args: str) -> tuple[str, Any]:
        monkeypatch.setattr(sys, "argv", [name, *args])
        try:
            # The script's module, then its `main()`, as its `__main__` block does.
            script = runpy.run_path(str(ROOT / "examples" / name), run_name="example")
            returned = script["main"]()
        finally:
            plt.close("all")
        return capsys.readouterr().out, returned

    return run


def _readme_quickstart_output() -> str:
    readme = (ROOT / "README.md").read_text()
    fence = '```text title="Output of bash scripts/quickstart.sh"\n'
    return readme.split(fence, 1)[1].split("```", 1)[0]


def test_quickstart_prints_what_the_readme_shows(tmp_path, run_example):
    """`bash scripts/quickstart.sh` (the quickstart with its defaults, in this
    process) prints what the README shows: its policy, its memory report, the
    picture it saves, its first loss (of the step from the initial weights, to
    the digit) and where the trained model lives. It trains 3 steps here, not
    300: the loss falls, and its last figure (300 AdamW steps, which no tolerance
    bounds by construction) is not compared."""
    out, _ = run_example("quickstart.py", "--steps", "3")
    assert (tmp_path / "quickstart_memory.png").stat().st_size > 0
    losses = re.compile(r"loss: first step ([\d.]+), last step ([\d.]+)")
    first, last = losses.search(out).groups()  # pyright: ignore[reportOptionalMemberAccess]
    shown = _readme_quickstart_output()
    assert first == losses.search(shown)[1]  # pyright: ignore[reportOptionalSubscript]
    assert float(last) < float(first)
    assert losses.sub("loss: ...", out) == losses.sub("loss: ...", shown)


def test_own_step_matches_train_step(tmp_path, run_example):
    """`examples/own_step.py`: a hand-written step with `eo.optimizer_update`
    computes the losses `eo.train_step` does, bit for bit (the same loss and update,
    traced alike), and needs the same memory on a TPU v5e chip (but for 31.5 KiB
    of its own). Two blocks, so that the update streams them one at a time; dim
    192, where those 31.5 KiB are device bytes, under 0.5% of them (at dim 128 they
    are host bytes); at dim 256 the TPU compiles take longer."""
    out, _ = run_example(
        "own_step.py",
        *("--steps", "2", "--dim", "192", "--depth", "2", "--target", "tpu-v5e"),
        *("--plot", str(tmp_path / "memory.png")),
    )
    assert "largest difference between their losses: 0.00e+00" in out
    rows = re.findall(r"(own step|train_step)\s+([\d,]+)\s+([\d,]+)", out)
    (_, own_device, own_host), (_, device, host) = rows
    assert own_host == host
    own_device, device = int(own_device.replace(",", "")), int(device.replace(",", ""))
    assert abs(own_device - device) <= 0.005 * device
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_char_gpt_trains_samples_and_resumes(tmp_path, run_example):
    """It trains, reports, saves, samples; run again with more steps, it resumes
    from its checkpoint (in this process too: it reads everything back from the
    checkpoint's files). (The report for this machine only: the examples' reports
    for a TPU are checked with `own_step.py`, `sharded.py` and
    `bf16_microbatches.py`.)"""
    tiny = [
        *(*GPT_SIZE, "--batch", "4", "--eval-batches", "1", "--sample", "20"),
        *("--save-every", "3", "--target", "none"),
    ]
    out, _ = run_example("char_gpt.py", *tiny, "--steps", "6")
    assert "compiled for this CPU backend" in out and "blocks.input" in out
    before = re.search(r"held-out loss at step 0: ([\d.]+)", out)
    after = re.search(r"held-out loss at step 6: ([\d.]+)", out)
    assert before and after and float(after[1]) < float(before[1])
    assert "steps [3, 6]" in out
    assert re.search(r"sample:\nAnd God said.{20}", out, re.S)
    assert (tmp_path / "char_gpt_memory.png").stat().st_size > 0
    out, _ = run_example("char_gpt.py", *tiny, "--steps", "8", "--plot", "")
    assert "resumed from" in out and "at step 6" in out
    assert "held-out loss at step 8" in out


def test_offloading_tutorial_prints_the_three_tables(tmp_path, run_example):
    out, _ = run_example("offloading_tutorial.py", "--tiny")
    for table in ("1. activations", "2. parameters", "3. optimizer state"):
        assert table in out
    assert "input" in out and "on pinned_host" in out and "tpu-v5e device" in out
    assert (tmp_path / "offloading_tutorial_memory.png").stat().st_size > 0


def test_vit_port_matches_the_original_and_trains(tmp_path, run_example):
    """The port's logits are the original's, up to float32 rounding (a scan and a
    loop), and far from those of the original without its last block."""
    out, port = run_example(
        "vit.py",
        *("--steps", "2", "--dim", "32", "--depth", "2", "--test", "16"),
        *("--target", "none"),
    )
    assert "port vs original, largest logit difference" in out
    assert_close(port["ours"], port["theirs"])
    original = port["original"]
    dropped = eqx.tree_at(lambda m: m.blocks, original, original.blocks[:-1])
    assert excess(port["ours"], dropped(port["image"], inference=True)) > 10
    assert "held-out accuracy after 2 steps" in out
    assert (tmp_path / "vit_memory.png").stat().st_size > 0


def test_sharded_run_matches_one_device(tmp_path, run_example):
    """In this process: the tests' 8 CPU devices are the 8 the example asks for.
    The first step's losses (the same weights and batch) are the one-device run's
    up to float32 rounding, and the next step's loss is far from them (later
    steps, after AdamW updates, are not compared: `tests/numerics.py`)."""
    out, (losses, expected) = run_example(
        "sharded.py",
        *("--steps", "2", *GPT_SIZE, "--batch", "8"),
    )
    assert "mesh: {'fsdp': 8}" in out and "compiled for tpu-v5e:2x4" in out
    assert "largest difference between the two runs' losses" in out
    assert_close(losses[0], expected[0])
    assert excess(losses[0], expected[1]) > 10
    assert (tmp_path / "sharded_memory.png").stat().st_size > 0


def test_bf16_microbatches_run(run_example):
    """The fp32, bf16 and micro-batched bf16 runs train, with fp32 masters on the
    host. (Its TPU report, where bf16 moves half the parameters' bytes, is not
    compiled here: `test_minimum_traffic.py` checks the bytes a bf16 compute copy
    moves on a TPU and a GPU.)"""
    out, _ = run_example(
        "bf16_microbatches.py",
        *("--steps", "1", *GPT_SIZE, "--batch", "8"),
        *("--microbatches", "2", "--target", "none"),
    )
    assert "bf16, 2 micro-batches" in out
    assert "masters: float32 on pinned_host" in out


def test_plan_example_plans_and_trains_as_the_plain_step(run_example):
    """`examples/plan.py` with a budget the plain step fits (one compile): the plan
    is `Policy.none()`, and its first loss is the plain step's (the same weights
    and batch), far from its loss after one update."""
    out, (losses, plain_loss) = run_example(
        "plan.py",
        *("--steps", "2", *GPT_SIZE, "--batch", "8", "--device-budget", "1GiB"),
    )
    assert "Plan on tpu-v5e: no remat, all on device: Policy.none() (1 compiled" in out
    assert_close(losses[0], plain_loss)
    assert excess(losses[1], plain_loss) > 10
    assert "parameters live in ['device']" in out


def test_finetune_8b_dry_run_plans_and_prints(run_example):
    """`examples/finetune_8b.py --dry-run` at a tiny width, planned for this CPU
    backend (one compile: the plain step fits the budget): the parameters of its
    Llama shape (counted by hand), the plan in bf16 with the micro-batches given,
    the memory report, and no training."""
    dim, layers, vocab, seq = 32, 1, 64, 32
    out, plan = run_example(
        "finetune_8b.py",
        *("--dim", str(dim), "--layers", str(layers), "--vocab", str(vocab)),
        *("--seq", str(seq), "--tokens-per-update", str(4 * seq)),
        *("--microbatches", "2", "--target", "none", "--dry-run"),
        *("--device-budget", "1GiB", "--host-budget", "1GiB"),
    )
    heads, mlp = 1, int(3.5 * dim)  # (heads of 128, at least one)
    kv = max(heads // 4, 1) * dim // heads
    block = 2 * dim * dim + 2 * dim * kv + 3 * dim * mlp + 2 * dim
    count = 2 * vocab * dim + dim + layers * block
    assert f"{count:,} parameters; 4 sequences of {seq} tokens an update" in out
    assert plan.policy.compute_dtype == jnp.bfloat16
    assert "2 micro-batches, bfloat16 compute" in out
    assert "Memory report for a train step" in out
    assert out.rstrip().endswith("not training: --dry-run")
