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


def _start(nproc: int, outdir: str) -> list[tuple[subprocess.Popen, str]]:
    """The processes of a run, each writing its output to a file in `outdir` (not
    a pipe: nothing reads it until they end)."""
    port = str(_free_port())
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    os.makedirs(outdir, exist_ok=True)
    started = []
    for i in range(nproc):
        log = os.path.join(outdir, f"output_{i}.txt")
        with open(log, "w") as f:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.multiprocess_worker"]
                + [str(nproc), str(i), port, outdir],
                cwd=ROOT,  # `from .helpers` works
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        started.append((process, log))
    return started


def _stop(started: list[tuple[subprocess.Popen, str]]) -> None:
    for p, _ in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def _results(
    started: list[tuple[subprocess.Popen, str]], outdir: str
) -> list[tuple[dict, dict]]:
    try:
        for p, _ in started:
            p.wait(timeout=180)
    finally:
        _stop(started)  # one failed and the other waits for it: stop it
    for p, log in started:
        with open(log) as f:
            assert p.returncode == 0, f.read()[-3000:]
    results = []
    for i in range(len(started)):
        with open(os.path.join(outdir, f"result_{len(started)}_{i}.json")) as f:
            result = json.load(f)
        arrays = {
            what: {path: np.asarray(x, np.float32) for path, x in tree.items()}
            for what, tree in result.pop("arrays").items()
        }
        results.append((result, arrays))
    return results


def test_two_processes_train_and_resume_like_one(tmp_path):
    # The two processes start first; the reference runs in this process, on 4 of
    # its devices, while they start up.
    started = _start(2, str(tmp_path / "two"))
    try:
        one, reference = worker.main(worker.Run.of(1, 0), str(tmp_path / "one"))
    except BaseException:
        _stop(started)
        raise
    two = _results(started, str(tmp_path / "two"))
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
