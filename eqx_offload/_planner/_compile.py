"""Compiling one candidate of `plan`: here, or in a child process for a compiler
option that can abort the process it runs in. libtpu 0.0.42's remat to host
(`Policy(host_remat=True)`) ended a whole Python process compiling a 66-layer GPT
(a failed check in its rematerialization pass: no Python exception to catch), so
`plan` compiles those candidates in a child: it sends back the report, or what the
compile raised, and a child that dies is a `CompilerCrashed` row, not the end of
the plan."""

import os
import pickle
import subprocess
import sys
import tempfile
from typing import Any

import jax
from jax.sharding import AbstractMesh

from .._compiler import crash_line
from .._placement import place
from .._report import memory_report, MemoryReport
from .._train_step import train_step
from .._update import init_opt_state


# A child's compile that takes longer than this is stopped (and counted as crashed).
CHILD_SECONDS = 1800


class CompilerCrashed(Exception):
    """The compiler ended the child process that compiled a candidate: its exit
    status (negative: the signal), and the last line it wrote to stderr."""

    def __init__(self, returncode: int, last_line: str):
        super().__init__(
            f"the compiler ended its process (exit status {returncode}): {last_line}"
        )
        self.returncode = returncode
        self.last_line = last_line


def report(
    loss_fn: Any,
    optimizer: Any,
    model: Any,
    batch: tuple,
    policy: Any,
    microbatches: int,
    has_aux: bool,
    target: str | None,
    mesh: AbstractMesh | None,
) -> MemoryReport:
    """`memory_report` of the step under `policy`, compiled in this process."""
    placed = place(model, policy, mesh=mesh)
    opt_state = init_opt_state(optimizer, placed, policy)
    step = train_step(
        loss_fn, optimizer, policy, has_aux=has_aux, microbatches=microbatches
    )
    return memory_report(step, placed, opt_state, *batch, target=target)


def report_in_child(*arguments: Any) -> MemoryReport:
    """`report(*arguments)` compiled in a child process (the same Python, `sys.path`
    and environment; the functions sent with `cloudpickle`). Raises what the
    compile raised there (`DoesNotFit`, `DoesNotCompile`, `UnusedName`,
    `ValueError`), or `CompilerCrashed`."""
    try:
        import cloudpickle
    except ImportError:
        raise ImportError(
            "`plan`: where nothing fits on a TPU, it compiles the best candidate "
            "with `Policy(host_remat=True)` in a child process, which needs "
            "cloudpickle: `pip install 'eqx_offload[tpu]'` (or `cloudpickle`)."
        ) from None

    sixty_four = jax.dtypes.canonicalize_dtype(float) == jax.numpy.float64
    payload = cloudpickle.dumps(arguments)
    with tempfile.TemporaryDirectory() as folder:
        sent, received = (os.path.join(folder, n) for n in ("sent", "received"))
        with open(sent, "wb") as f:
            pickle.dump((list(sys.path), sixty_four, payload), f)
        try:
            done = subprocess.run(
                [sys.executable, "-m", __name__, sent, received],
                capture_output=True,
                text=True,
                timeout=CHILD_SECONDS,
            )
        except subprocess.TimeoutExpired:
            raise CompilerCrashed(-9, f"no answer in {CHILD_SECONDS} s") from None
        if done.returncode != 0 or not os.path.exists(received):
            last = crash_line(done.stderr)[:300]
            raise CompilerCrashed(done.returncode, last)
        with open(received, "rb") as f:
            answer = pickle.load(f)
    if isinstance(answer, Exception):
        raise answer
    return answer


def _child(sent: str, received: str) -> None:
    with open(sent, "rb") as f:
        path, sixty_four, payload = pickle.load(f)
    sys.path[:] = path
    jax.config.update("jax_enable_x64", sixty_four)
    arguments = pickle.loads(payload)
    try:
        answer: MemoryReport | ValueError = report(*arguments)
    except ValueError as e:  # `DoesNotFit`, `DoesNotCompile`, `UnusedName`, ...
        answer = e
    with open(received, "wb") as f:
        pickle.dump(answer, f)


if __name__ == "__main__":
    _child(*sys.argv[1:3])
