"""Two processes on this machine (two CPU devices each, gloo collectives) train one
model on a 4-device global mesh under `Policy.offload_all()`, save it and resume
from the checkpoint: the losses and parameters are those of one process with four
devices (this one, on 4 of its devices), up to rounding.

Not bit for bit: the two processes sum the examples' losses and gradients over
their devices (gloo) in another order than one process does: losses and
parameters differ in their last bits. The same float32 values in another order: the
losses compare with `F32`, the parameters' updates over the 5 SGD steps with
`TRAINED` (`tests/numerics.py`)."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

from . import multiprocess_worker as worker
from .numerics import assert_close, excess, TRAINED


ROOT = os.path.dirname(os.path.dirname(__file__))
STEPS = 5  # 4, then one after loading


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run(nproc: int, outdir: str) -> list[tuple[dict, dict]]:
    port = str(_free_port())
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.multiprocess_worker"]
            + [str(nproc), str(i), port, outdir],
            cwd=ROOT,  # `from .helpers` works
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(nproc)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:  # one failed and the other waits for it: stop it
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    results = []
    for i in range(nproc):
        with open(os.path.join(outdir, f"result_{nproc}_{i}.json")) as f:
            result = json.load(f)
        arrays = {
            what: {path: np.asarray(x, np.float32) for path, x in tree.items()}
            for what, tree in result.pop("arrays").items()
        }
        results.append((result, arrays))
    return results


def test_two_processes_train_and_resume_like_one(tmp_path):
    # The reference in this process, on 4 of its devices: no process to start.
    one, reference = worker.main(worker.Run.of(1, 0), str(tmp_path / "one"))
    two = _run(2, str(tmp_path / "two"))
    start = reference["start"]
    for result, arrays in two:
        assert_close(result["losses"], one["losses"])
        assert_close(
            arrays["params"],
            reference["params"],
            tol=TRAINED,
            origin=start,
            steps=STEPS,
        )
        assert result["saved_step"] == 4
        assert result["memory_kinds"] == ["pinned_host"]
        assert result["compiled_on"] == [0]  # 5 steps (one after loading), 1 compile
        # Loaded into an abstract model laid out like the saved one: every leaf in
        # its spec and memory kind, as in one process.
        assert result["restored_layouts"] == result["saved_layouts"]
        assert result["restored_layouts"] == one["restored_layouts"]
        # `verify` compares leaves laid out over both processes.
        assert result["verified"]
        assert (
            "leaf '[0].blocks.layers.layers[0].weight' is not laid out over the "
            in (result["errors"]["load"])
        )
        assert "`save`: leaf 'extra.key'" in result["errors"]["save"]
    # The negative control: every step against the gradient (the same compiled
    # step, its learning rate negated) is far beyond both tolerances.
    assert excess(one["control_losses"], one["losses"]) > 10
    updates = excess(
        reference["control_params"],
        reference["params"],
        tol=TRAINED,
        origin=start,
        steps=STEPS,
    )
    assert updates > 10
    layouts = {(spec, kind) for _, spec, kind in one["restored_layouts"]}
    assert ("P(None, 'fsdp')", "pinned_host") in layouts  # sharded, on the host
    assert ("P()", "device") in layouts  # the optimizer's step count
    assert one["restored_layouts"] == one["saved_layouts"]
    assert one["compiled_on"] == [0]  # the control's steps too
    assert one["errors"] == {}  # one process: nothing refused
