import re
import runpy
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest


ROOT = Path(__file__).parent.parent


@pytest.fixture
def run_example(tmp_path, monkeypatch, capsys):
    """`run_example("x.py", *args)` runs `examples/x.py` with these arguments in this
    process, as `python examples/x.py ...` would from `tmp_path` (where it writes its
    picture and checkpoints), and returns what it printed. In this process, the
    examples reuse the programs the tests compiled before them."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # `from quickstart import GPT`

    def run(name: str, *args: str) -> str:
        monkeypatch.setattr(sys, "argv", [name, *args])
        try:
            runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
        finally:
            plt.close("all")
        return capsys.readouterr().out

    return run


def _readme_quickstart_output() -> str:
    readme = (ROOT / "README.md").read_text()
    fence = '```text title="Output of bash scripts/quickstart.sh"\n'
    return readme.split(fence, 1)[1].split("```", 1)[0]


def test_quickstart_prints_what_the_readme_shows(tmp_path, run_example):
    """`bash scripts/quickstart.sh` (the quickstart with its defaults, in this
    process): it trains, saves its picture, and prints what the README shows,
    figure for figure (the losses to 0.02: the machine's float rounding)."""
    out = run_example("quickstart.py")
    assert (tmp_path / "quickstart_memory.png").stat().st_size > 0
    losses = re.compile(r"loss: first step ([\d.]+), last step ([\d.]+)")
    first, last = map(float, losses.search(out).groups())  # pyright: ignore
    assert last < first / 2
    shown = _readme_quickstart_output()
    expected = [float(x) for x in losses.search(shown).groups()]  # pyright: ignore
    np.testing.assert_allclose([first, last], expected, atol=0.02)
    assert losses.sub("loss: ...", out) == losses.sub("loss: ...", shown)


def test_own_step_matches_train_step(tmp_path, run_example):
    """`examples/own_step.py`: a hand-written step with `eo.optimizer_update`
    trains like `eo.train_step` and needs the same memory on a TPU v5e chip."""
    out = run_example(
        "own_step.py",
        *("--steps", "3", "--dim", "512", "--target", "tpu-v5e"),
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
    checkpoint's files)."""
    tiny = [
        *("--dim", "32", "--depth", "2", "--seq", "32", "--batch", "4"),
        *("--eval-batches", "1", "--sample", "20", "--save-every", "3"),
    ]
    out = run_example("char_gpt.py", *tiny, "--steps", "6")
    assert "compiled for tpu-v5e" in out and "blocks.input" in out
    before = re.search(r"held-out loss at step 0: ([\d.]+)", out)
    after = re.search(r"held-out loss at step 6: ([\d.]+)", out)
    assert before and after and float(after[1]) < float(before[1])
    assert "steps [3, 6]" in out
    assert re.search(r"sample:\nAnd God said.{20}", out, re.S)
    assert (tmp_path / "char_gpt_memory.png").stat().st_size > 0
    out = run_example("char_gpt.py", *tiny, "--steps", "8", "--target", "none")
    assert "resumed from" in out and "at step 6" in out
    assert "held-out loss at step 8" in out


def test_offloading_tutorial_prints_the_three_tables(tmp_path, run_example):
    out = run_example("offloading_tutorial.py", "--tiny")
    for table in ("1. activations", "2. parameters", "3. optimizer state"):
        assert table in out
    assert "input" in out and "on pinned_host" in out and "tpu-v5e device" in out
    assert (tmp_path / "offloading_tutorial_memory.png").stat().st_size > 0


def test_vit_port_matches_the_original_and_trains(tmp_path, run_example):
    out = run_example(
        "vit.py", *("--steps", "3", "--dim", "32", "--depth", "2", "--test", "16")
    )
    difference = re.search(r"largest logit difference: ([\d.e+-]+)", out)
    assert difference and float(difference[1]) < 1e-5
    assert "compiled for tpu-v5e" in out and "held-out accuracy after 3 steps" in out
    assert (tmp_path / "vit_memory.png").stat().st_size > 0


def test_sharded_run_matches_one_device(tmp_path, run_example):
    """In this process: the tests' 8 CPU devices are the 8 the example asks for."""
    out = run_example(
        "sharded.py", *("--steps", "3", "--dim", "64", "--depth", "2", "--seq", "16")
    )
    assert "mesh: {'fsdp': 8}" in out and "compiled for tpu-v5e:2x4" in out
    difference = re.search(r"two runs' losses: ([\d.e+-]+)", out)
    assert difference and float(difference[1]) < 1e-4
    assert (tmp_path / "sharded_memory.png").stat().st_size > 0


def test_bf16_microbatches_run(tmp_path, run_example):
    out = run_example(
        "bf16_microbatches.py",
        *("--steps", "4", "--dim", "64", "--depth", "2", "--seq", "16"),
        *("--batch", "8"),
    )
    rows = dict(
        re.findall(r"^(fp32|bf16)\s+[\d.]+ MiB\s+[\d.]+ MiB\s+([\d.]+) MiB", out, re.M)
    )
    assert float(rows["bf16"]) <= 0.55 * float(rows["fp32"])  # half the weights' bytes
    assert "masters: float32 on pinned_host" in out
    assert (tmp_path / "bf16_microbatches_memory.png").stat().st_size > 0


def test_plan_example_plans_and_trains_as_the_plain_step(run_example):
    """`examples/plan.py` with a budget the plain step fits (one compile): the plan
    is `Policy.none()`, and its first loss is the plain step's."""
    out = run_example(
        "plan.py", *("--steps", "3", "--dim", "32", "--device-budget", "1GiB")
    )
    assert "Plan on tpu-v5e: no remat, all on device: Policy.none() (1 compiled" in out
    found = re.search(r"first step: loss ([\d.]+) with the plan, ([\d.]+) with", out)
    assert found is not None and found[1] == found[2]
    assert "parameters live in ['device']" in out
