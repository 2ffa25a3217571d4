"""One process of a multi-process training run, started by `test_multiprocess.py`
(and runnable by hand the same way on a TPU pod, one process per host), from the
repository's root:

    python -m tests.multiprocess_worker NPROC PROCESS_ID PORT OUTDIR

With NPROC=2: two processes on this machine, two CPU devices each, one 4-device
global mesh (gloo collectives). With NPROC=1: one process with four devices. Each
lays the model out with the policy's FSDP rule (`eo.place` builds global arrays
from the same values in every process), trains 4 SGD steps under
`Policy.offload_all()`, saves, loads into an abstract model, trains one more
step, and writes its losses, the layouts (spec, memory kind) of what it saved and
loaded and its parameters after the last step to
OUTDIR/result_<NPROC>_<PROCESS_ID>.json. Several processes also run `verify` and
try what they must refuse. One process also gives the parameters it started
from, and a negative control: the same 5 steps against the gradient (the
learning rate negated in the optimizer state: the same compiled step).

The test runs the one-process reference in its own process (`main`, on 4 of its
8 devices), and two processes of this script.
"""

import json
import os
import sys
from typing import NamedTuple


if __name__ == "__main__":
    # 4 devices in all; the test run's other flags (`conftest.py`: the CPU
    # compiler's optimizations off) kept.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={4 // int(sys.argv[1])}"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402


if __name__ == "__main__":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if int(sys.argv[1]) > 1:
        jax.distributed.initialize(
            coordinator_address=f"localhost:{sys.argv[3]}",
            num_processes=int(sys.argv[1]),
            process_id=int(sys.argv[2]),
        )

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import Array, Float, PRNGKeyArray  # noqa: E402

import eqx_offload as eo  # noqa: E402

from .helpers import CountCompiles, StackedNet  # noqa: E402


# Every leaf splits over the 4 devices (FSDP): 4 outputs, not 1.
DIM, HIDDEN, DEPTH, BATCH, OUT = 16, 32, 3, 8, 4
# SGD with momentum: its update is Lipschitz in the gradient, so two runs whose
# gradients differ by rounding (the processes sum them in another order than one
# process does) have updates that differ by as little (`tests/numerics.py`,
# `TRAINED`). The learning rate is in the optimizer state, for the control.
LR = 1e-2
OPTIMIZER = optax.inject_hyperparams(optax.sgd)(learning_rate=LR, momentum=0.9)


class Run(NamedTuple):
    """This process's part: of how many, which, and the 4-device mesh."""

    processes: int
    index: int
    mesh: jax.sharding.Mesh

    @classmethod
    def of(cls, processes: int, index: int) -> "Run":
        # The first 4 devices: all of them in a run of its own, 4 of 8 in a test.
        devices = jax.devices()[:4]
        mesh = jax.make_mesh((4,), ("fsdp",), (AxisType.Auto,), devices=devices)
        return cls(processes, index, mesh)


@eqx.filter_jit  # one program, not an eager dispatch per operation
def make_model(*, key: PRNGKeyArray) -> StackedNet:
    """`DEPTH` MLPs in a `Stacked`, then a linear head to `OUT` outputs."""
    return StackedNet(
        lambda k: eqx.nn.MLP(DIM, DIM, HIDDEN, 1, key=k), DEPTH, (DIM, OUT), key=key
    )


def loss_fn(model: StackedNet, x: Float[Array, "b dim"], y: Float[Array, "b out"]):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def batch(run: Run, i: int) -> tuple[jax.Array, jax.Array]:
    """Batch `i`, split over the processes along the batch axis."""
    rng = np.random.default_rng(i)
    x = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    y = rng.normal(size=(BATCH, OUT)).astype(np.float32)
    n, p = run.processes, run.index
    rows = slice(p * BATCH // n, (p + 1) * BATCH // n)
    sharding = NamedSharding(run.mesh, P("fsdp"))
    return (
        jax.make_array_from_process_local_data(sharding, x[rows], x.shape),
        jax.make_array_from_process_local_data(sharding, y[rows], y.shape),
    )


def scalar(x: jax.Array) -> float:
    return float(np.asarray(x.addressable_data(0)))


def layouts(tree) -> list[list[str]]:
    """Each array leaf's path, spec and memory kind (as JSON)."""
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return [
        [jax.tree_util.keystr(path), str(x.sharding.spec), x.sharding.memory_kind]
        for path, x in leaves
    ]


@eqx.filter_jit
def _replicated(params, mesh: jax.sharding.Mesh):
    return jax.lax.with_sharding_constraint(params, NamedSharding(mesh, P()))


def values(run: Run, model) -> dict[str, np.ndarray]:
    """Every array leaf of `model` by its path, whole in every process."""
    params = _replicated(eqx.filter(model, eqx.is_array), run.mesh)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return {
        jax.tree_util.keystr(path): np.asarray(x.addressable_data(0))
        for path, x in leaves
    }


def fresh(run: Run, policy: eo.Policy, lr: float = LR):
    """The model and optimizer state training starts from, with learning rate
    `lr`."""
    with jax.set_mesh(run.mesh):
        model = eo.place(make_model(key=jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(OPTIMIZER, model, policy)
    if lr == LR:
        return model, opt_state
    now = opt_state.hyperparams["learning_rate"]  # where the step expects it
    hyperparams = {
        **opt_state.hyperparams,
        "learning_rate": jax.device_put(jnp.asarray(lr, now.dtype), now.sharding),
    }
    return model, opt_state._replace(hyperparams=hyperparams)


def main(run: Run, outdir: str) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    """The run's results, and its parameters (`arrays[what][path]`)."""
    policy = eo.Policy.offload_all(shard=eo.FSDP("fsdp", min_size=0))
    model, opt_state = fresh(run, policy)
    start = values(run, model)
    step = CountCompiles(eo.train_step(loss_fn, OPTIMIZER, policy))
    losses = []
    for i in range(4):
        model, opt_state, loss, _ = step(model, opt_state, *batch(run, i))
        losses.append(scalar(loss))
    kinds = {
        x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    }

    # Save, load into an abstract model laid out the same way, train one more step.
    directory = os.path.join(outdir, "checkpoint")
    saved_layouts = layouts((model, opt_state))
    eo.save(directory, model, opt_state, step=4)
    abstract = eqx.filter_eval_shape(make_model, key=jax.random.key(0))
    abstract = eo.place(abstract, policy, mesh=run.mesh)
    like = (abstract, eo.init_opt_state(OPTIMIZER, abstract, policy))
    restored, restored_state, saved_step = eo.load(directory, like, policy)
    restored_layouts = layouts((restored, restored_state))
    restored, restored_state, loss, _ = step(restored, restored_state, *batch(run, 4))
    arrays = {"params": values(run, restored)}
    result = {
        "losses": [*losses, scalar(loss)],
        "saved_step": saved_step,
        "memory_kinds": sorted(kinds),
        "saved_layouts": saved_layouts,
        "restored_layouts": restored_layouts,
        "errors": {},
    }
    if run.processes > 1:
        # `verify` compares leaves laid out over every process.
        check = eo.train_step(loss_fn, OPTIMIZER, policy)
        report = eo.verify(check, restored, restored_state, *batch(run, 5))
        result["verified"] = report.passed
    # An abstract model without shardings would be restored on one process's
    # device only: refused on every process, before orbax is asked.
    bare = eqx.filter_eval_shape(make_model, key=jax.random.key(0))
    try:
        eo.load(directory, (bare, like[1]), eo.Policy.offload_all())
    except ValueError as e:
        result["errors"]["load"] = str(e)
    try:  # a process-local PRNG key cannot be saved by orbax in such a run
        eo.save(directory, model, opt_state, step=5, extra={"key": jax.random.key(0)})
    except ValueError as e:
        result["errors"]["save"] = str(e)
    if run.processes == 1:
        arrays["start"] = start
        # The negative control: the same steps, each against the gradient.
        model, opt_state = fresh(run, policy, -LR)
        control = []
        for i in range(5):
            model, opt_state, loss, _ = step(model, opt_state, *batch(run, i))
            control.append(scalar(loss))
        result["control_losses"] = control
        arrays["control_params"] = values(run, model)
    result["compiled_on"] = step.compiled_on
    return result, arrays


if __name__ == "__main__":
    processes, index, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4]
    result, arrays = main(Run.of(processes, index), outdir)
    result["arrays"] = {
        what: {path: x.tolist() for path, x in tree.items()}  # float32: exact
        for what, tree in arrays.items()
    }
    path = os.path.join(outdir, f"result_{processes}_{index}.json")
    with open(path, "w") as f:
        json.dump(result, f)
    if processes > 1:
        jax.distributed.shutdown()
