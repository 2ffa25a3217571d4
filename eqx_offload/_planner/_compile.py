"""Compiling one candidate of `plan` (`report`), here or in a child process
(`report_in_child`) for a compiler option that can abort the process it runs in;
and what a process keeps of its compiles (`Cache`), so that none is repeated."""

import collections
import dataclasses
import functools
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import NamedTuple, TypeVar

import jax
import optax
from jax.sharding import AbstractMesh
from jaxtyping import PyTree

from .._checkpoint_names import checkpoint_names, CheckpointName
from .._compiler import crash_line
from .._errors import see
from .._placement import place
from .._policy import Policy
from .._report import Hardware, memory_report, MemoryReport
from .._train_step import train_step
from .._update import init_opt_state


# A child's compile that takes longer than this is stopped (and counted as crashed).
CHILD_SECONDS = 1800
# Compiles (and checkpoint names) kept by the cache; the oldest go first.
KEPT = 256


_T = TypeVar("_T")


class CompilerCrashed(Exception):
    """The compiler ended the child process that compiled a candidate: its exit
    status (negative: the signal), and the last line it wrote to stderr."""

    def __init__(self, returncode: int, last_line: str):
        super().__init__(
            f"the compiler ended its process (exit status {returncode}): {last_line}"
        )
        self.returncode = returncode
        self.last_line = last_line


class Task(NamedTuple):
    """What `plan` compiles candidates of: the step's loss, optimizer and `has_aux`,
    an abstract model and batch, and the target (`mesh`: a slice's; `hardware`: the
    rates its step time is priced at, `None` for the target's)."""

    loss_fn: Callable
    optimizer: optax.GradientTransformation | optax.MultiSteps
    model: PyTree
    batch: tuple
    has_aux: bool = False
    target: str | None = None
    mesh: AbstractMesh | None = None
    hardware: Hardware | None = None


def report(task: Task, policy: Policy, microbatches: int) -> MemoryReport:
    """`memory_report` of the task's step under `policy`, compiled here."""
    placed = place(task.model, policy, mesh=task.mesh)
    opt_state = init_opt_state(task.optimizer, placed, policy)
    step = train_step(
        task.loss_fn,
        task.optimizer,
        policy,
        has_aux=task.has_aux,
        microbatches=microbatches,
    )
    return memory_report(
        step, placed, opt_state, *task.batch, target=task.target, hardware=task.hardware
    )


def report_in_child(task: Task, policy: Policy, microbatches: int) -> MemoryReport:
    """`report(...)` compiled in a child process: the same Python, `sys.path` and
    environment, the functions sent with `cloudpickle`. Raises what the compile
    raised there (`DoesNotFit`, `UnusedName`, ...), or `CompilerCrashed`."""
    try:
        import cloudpickle
    except ImportError:
        raise ImportError(
            "`plan`: compiling `Policy(host_remat=True)` in a child process needs "
            "cloudpickle. Install it: `pip install 'eqx_offload[tpu]'`." + see(122)
        ) from None

    sixty_four = jax.dtypes.canonicalize_dtype(float) == jax.numpy.float64
    payload = cloudpickle.dumps((task, policy, microbatches))
    with tempfile.TemporaryDirectory() as folder:
        sent, received = Path(folder, "sent"), Path(folder, "received")
        sent.write_bytes(pickle.dumps((list(sys.path), sixty_four, payload)))
        try:
            done = subprocess.run(
                [sys.executable, "-m", __name__, str(sent), str(received)],
                capture_output=True,
                text=True,
                timeout=CHILD_SECONDS,
            )
        except subprocess.TimeoutExpired:
            raise CompilerCrashed(-9, f"no answer in {CHILD_SECONDS} s") from None
        if done.returncode != 0 or not received.exists():
            raise CompilerCrashed(done.returncode, crash_line(done.stderr)[:300])
        answer = pickle.loads(received.read_bytes())
    if isinstance(answer, Exception):
        raise answer
    return answer


@dataclasses.dataclass
class Cache:
    """What searches share, so that a step is compiled once in a process: each
    compile's report or what it raised (`reports`, by step, shapes, policy and
    target), and each loss's checkpoint names (`names`, by the loss and shapes).
    A step is its loss and optimizer objects, as `jax.jit` keys its cache."""

    reports: collections.OrderedDict[Hashable, MemoryReport | Exception] = (
        dataclasses.field(default_factory=collections.OrderedDict)
    )
    names: collections.OrderedDict[Hashable, tuple[CheckpointName, ...]] = (
        dataclasses.field(default_factory=collections.OrderedDict)
    )

    def report(
        self, task: Task, policy: Policy, microbatches: int
    ) -> tuple[MemoryReport | Exception, bool]:
        """The report of the task's step under `policy`, or what its compile
        raised; and whether an earlier search compiled it."""

        def compile_once() -> MemoryReport | Exception:
            # The TPU compiler's remat to host can abort the process: in a child.
            here_or_child = report_in_child if policy.host_remat else report
            try:
                return here_or_child(task, policy, microbatches)
            # `DoesNotFit`, `DoesNotCompile`, `UnusedName` and other refusals
            except (ValueError, CompilerCrashed) as e:
                return e

        step = (task.optimizer, task.target, task.mesh, repr(task.hardware))
        key = _key(task, *step, repr(policy), microbatches)
        return _keep(self.reports, key, compile_once)

    def checkpoint_names(self, task: Task) -> tuple[CheckpointName, ...]:
        """`checkpoint_names(loss_fn, model, *batch)`, traced once."""
        trace = functools.partial(
            checkpoint_names, task.loss_fn, task.model, *task.batch
        )
        return _keep(self.names, _key(task), trace)[0]


# The cache of this process's searches (`plan` again with other budgets,
# `fewest_chips` planning the target its probe found).
CACHE = Cache()


def _key(task: Task, *more: Hashable) -> Hashable | None:
    """The loss function (by identity), the model's and batch's structure and
    shapes, and `more`, as a key of the cache; `None` if it cannot be hashed (a
    static field that is not)."""
    trees = [
        (jax.tree.structure(t), *jax.tree.leaves(t)) for t in (task.model, task.batch)
    ]
    x64 = jax.dtypes.canonicalize_dtype(float)  # 64-bit or not
    key = (task.loss_fn, task.has_aux, *trees, x64, *more)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _keep(
    store: collections.OrderedDict[Hashable, _T],
    key: Hashable | None,
    make: Callable[[], _T],
) -> tuple[_T, bool]:
    """`(store[key], True)` if kept, else `(make(), False)`, kept under `key`
    (unless `None`: not hashable), dropping the oldest of more than `KEPT`."""
    if key is not None and key in store:
        store.move_to_end(key)
        return store[key], True
    value = make()
    if key is not None:
        store[key] = value
        while len(store) > KEPT:
            store.popitem(last=False)
    return value, False


def _child(sent: str, received: str) -> None:
    path, sixty_four, payload = pickle.loads(Path(sent).read_bytes())
    sys.path[:] = path
    jax.config.update("jax_enable_x64", sixty_four)
    task, policy, microbatches = pickle.loads(payload)
    try:
        answer: MemoryReport | ValueError = report(task, policy, microbatches)
    except ValueError as e:  # `DoesNotFit`, `DoesNotCompile`, `UnusedName`, ...
        answer = e
    Path(received).write_bytes(pickle.dumps(answer))


if __name__ == "__main__":
    _child(*sys.argv[1:3])
