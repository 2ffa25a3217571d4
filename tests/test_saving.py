"""Checkpoints: `save` / `load` resume training exactly, in a new process too.

The file is also the script the tests run in a new process (`python
tests/test_saving.py resume ...`), so it imports nothing from `tests`.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import PRNGKeyArray

import eqx_offload as eo
import eqx_offload.internal as eoi

from .helpers import (
    assert_trees_equal,
    bits,
    compiles,
    CountCompiles,
    StackedNet,
    unchecked,
)


if __name__ == "__main__":  # run by a test in a new process: set up as conftest.py
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_numpy_dtype_promotion", "standard")

DIM, DEPTH, BATCH = 8, 3, 4
SAVE_AT, STEPS = 2, 4  # a step after saving donates the saved buffers
POLICIES = {
    "offload_all": eo.Policy.offload_all,
    "none": eo.Policy.none,
    # The optimizer on the host's CPU: the same state, saved and resumed exactly.
    "host update": lambda: eo.Policy.offload_all(update="host"),
}
OPTIMIZER = optax.adamw(1e-2)


def make_model(depth: int = DEPTH, *, key: PRNGKeyArray) -> StackedNet:
    """`depth` MLPs in a `Stacked`, then a linear head to 2 outputs."""
    return StackedNet(
        lambda k: eqx.nn.MLP(DIM, DIM, 2 * DIM, 1, key=k), depth, (DIM, 2), key=key
    )


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def data(key):
    x = jax.random.normal(key, (BATCH, DIM))
    return x, jnp.stack([jnp.sin(x[:, 0]), jnp.cos(x[:, 1])], axis=1)


def train(step, model, opt_state, extra, stop, on_step=None):
    """Steps `extra["step"]` to `stop`, drawing each batch from a split of
    `extra["key"]`; the losses as floats."""
    losses = []
    while extra["step"] < stop:
        key, sub = jax.random.split(extra["key"])
        model, opt_state, loss, _ = step(model, opt_state, *data(sub))
        extra = {"key": key, "step": extra["step"] + 1}
        losses.append(float(loss))
        if on_step is not None:
            on_step(model, opt_state, extra)
    return model, opt_state, extra, losses


def abstract_like(policy):
    model = eqx.filter_eval_shape(make_model, key=jax.random.key(0))
    return model, eo.init_opt_state(OPTIMIZER, model, policy)


EXTRA_TEMPLATE = {"key": jax.random.key(0), "step": 0}


def resume(checkpoints: str, out: str) -> None:
    """In a new process: load step `SAVE_AT` of each policy's checkpoint into an
    abstract `like`, train to `STEPS`, save the result to `out`."""
    results = {}
    for name, make in POLICIES.items():
        policy = make()
        model, opt_state, step, extra = eo.load(
            f"{checkpoints}/{name}",
            abstract_like(policy),
            policy,
            optimizer=OPTIMIZER,
            extra=EXTRA_TEMPLATE,
        )
        assert step == SAVE_AT == extra["step"]
        train_step = CountCompiles(eo.train_step(loss_fn, OPTIMIZER, policy))
        model, opt_state, extra, losses = train(
            train_step, model, opt_state, extra, STEPS
        )
        eo.save(f"{out}/{name}", model, opt_state, step=STEPS, extra=extra)
        results[name] = {"losses": losses, "compiled_on": train_step.compiled_on}
    Path(out, "results.json").write_text(json.dumps(results))


def save_until_killed(directory: str) -> None:
    """In a new process: step 1 small, then big steps until the parent kills us."""
    leaves = {"a": jnp.full((4,), 1.0)}
    eo.save(directory, leaves, None, step=1)
    print("saved", flush=True)
    big = [jnp.zeros((2**22,)) for _ in range(16)]  # 256 MiB
    for s in range(2, 40):
        eo.save(directory, big, None, step=s, keep=2)


def placements(tree) -> list:
    return [x.sharding for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def _child(*args: str, stderr: Any = subprocess.PIPE) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.test_saving", *args],  # `from .helpers` works
        cwd=Path(__file__).parent.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


@pytest.fixture(scope="module")
def steps():
    """Each policy's train step, compiled once for the tests that run it."""
    return {
        name: eo.train_step(loss_fn, OPTIMIZER, make())
        for name, make in POLICIES.items()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, steps):
    """Each policy trained `STEPS` steps uninterrupted, saving at `SAVE_AT` with
    `wait=False` while training goes on (the next step donates the saved buffers),
    and the same resumed from that checkpoint in a new process."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name, make in POLICIES.items():
        policy = make()
        model = eo.place(make_model(key=jax.random.key(0)), policy)
        opt_state = eo.init_opt_state(OPTIMIZER, model, policy)
        step = steps[name]
        extra = {"key": jax.random.key(1), "step": 0}
        record = {}

        def on_step(model, opt_state, extra, name=name, record=record):
            if extra["step"] == SAVE_AT:
                record["saved"] = [np.array(x) for x in bits((model, opt_state))]
                record["saved_leaves"] = jax.tree.leaves(
                    eqx.filter((model, opt_state), eqx.is_array)
                )
                record["saving"] = eo.save(
                    root / name, model, opt_state, step=SAVE_AT, extra=extra, wait=False
                )

        model, opt_state, extra, losses = train(
            step, model, opt_state, extra, STEPS, on_step
        )
        record["saving"].wait()
        out[name] = dict(
            record,
            model=model,
            opt_state=opt_state,
            extra=extra,
            losses=losses,
            policy=policy,
        )
    child = _child("resume", str(root), str(root / "resumed"))
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 0, stderr[-3000:]
    results = json.loads((root / "resumed" / "results.json").read_text())
    return root, out, results


@pytest.mark.parametrize("name", list(POLICIES))
def test_resume_in_new_process_is_exact(runs, name):
    root, out, results = runs
    run = out[name]
    assert results[name]["losses"] == run["losses"][SAVE_AT:]  # bit for bit
    assert results[name]["compiled_on"] == [0]  # one compile for all its steps
    # Loaded into the concrete final state as `like`: also checks placements.
    model, opt_state, step, extra = eo.load(
        root / "resumed" / name,
        (run["model"], run["opt_state"]),
        run["policy"],
        optimizer=OPTIMIZER,
        extra=EXTRA_TEMPLATE,
    )
    assert step == STEPS == extra["step"]
    assert_trees_equal(
        (model, opt_state, extra), (run["model"], run["opt_state"], run["extra"])
    )
    assert placements((model, opt_state)) == placements(
        (run["model"], run["opt_state"])
    )


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_leaf_restored_in_its_memory_kind(runs, name):
    root, out, _ = runs
    policy = out[name]["policy"]
    model, opt_state, _ = eo.load(root / name, abstract_like(policy), policy)
    params = "device" if name == "none" else "pinned_host"
    for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)):
        assert x.sharding.memory_kind == params
    kinds = {
        x.shape: x.sharding.memory_kind
        for x in jax.tree.leaves(opt_state)
        if isinstance(x, jax.Array)
    }
    assert kinds.pop(()) == "device"  # Adam's step count stays on the device
    assert set(kinds.values()) == {params}
    fresh = eo.place(make_model(key=jax.random.key(0)), policy)
    assert placements(model) == placements(fresh)
    assert placements(opt_state) == placements(
        eo.init_opt_state(OPTIMIZER, fresh, policy)
    )
    # A model placed under one policy loads under another.
    model, _, _ = eo.load(
        root / name,
        abstract_like(eo.Policy.remat()),
        eo.Policy.remat(params="pinned_host"),
        optimizer=OPTIMIZER,
    )
    kinds = {
        x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    }
    assert kinds == {"pinned_host"}


@pytest.mark.parametrize("name", list(POLICIES))
def test_async_save_survives_donation(runs, name):
    root, out, _ = runs
    run = out[name]
    # The step after the save donated the saved buffers ...
    assert all(x.is_deleted() for x in run["saved_leaves"])
    # ... and the checkpoint holds the values they had when `save` returned.
    model, opt_state, _ = eo.load(
        root / name, abstract_like(run["policy"]), run["policy"], optimizer=OPTIMIZER
    )
    assert_trees_equal(bits((model, opt_state)), run["saved"])


def test_sigkill_mid_save_leaves_previous_step(tmp_path):
    directory = tmp_path / "ckpt"
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:  # a file: a full pipe would stall the child
        child = _child("save_until_killed", str(directory), stderr=stderr)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "saved\n", log.read_text()[-3000:]
        deadline = time.monotonic() + 60
        while not glob.glob(str(directory / "*tmp*")):
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.002)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert glob.glob(str(directory / "*tmp*"))  # killed mid-save
    steps = eo.saved_steps(directory)
    assert steps
    like = ({"a": jax.ShapeDtypeStruct((4,), jnp.float32)}, None)
    if steps[-1] == 1:
        model, _, step = eo.load(directory, like, eo.Policy.none())
        assert step == 1 and np.array_equal(model["a"], np.ones(4))
    else:  # some big steps were committed before the kill: the latest loads
        big = [jax.ShapeDtypeStruct((2**22,), jnp.float32)] * 16
        model, _, step = eo.load(directory, (big, None), eo.Policy.none())
        assert step == steps[-1] and not np.any(model[0])
    # The next save removes the killed one's temporary directory.
    eo.save(directory, {"a": jnp.zeros(4)}, None, step=100)
    assert not glob.glob(str(directory / "*tmp*"))


# A 4×2 mesh ("fsdp" × "tp"): the MLP's first layer split by its outputs over "tp",
# the second by its inputs; the rest FSDP or replicated.
MESH_SPECS = {
    "blocks.layers.layers[0].weight": P(None, "tp", "fsdp"),
    "blocks.layers.layers[0].bias": P(None, "tp"),
    "blocks.layers.layers[1].weight": P(None, "fsdp", "tp"),
    "blocks.layers.layers[1].bias": P(None, "fsdp"),
    "head.weight": P(None, "fsdp"),
}
# Partly offloaded: the first layer and the head's weight on the host, and the
# optimizer state of the second layer (not of its parameters).
PARTLY = eo.Policy(
    params={"blocks.layers[0]": "pinned_host", "head.weight": "pinned_host"},
    opt_state={"blocks.layers[1]": "pinned_host"},
)


def lay_out(model: StackedNet, mesh: jax.sharding.Mesh) -> StackedNet:
    """Every array leaf (or `jax.ShapeDtypeStruct`) laid out on `mesh`: as
    `MESH_SPECS` says, else replicated."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
    out = []
    for path, x in leaves:
        if not isinstance(x, jax.Array | jax.ShapeDtypeStruct):
            out.append(x)
            continue
        spec = MESH_SPECS.get(jax.tree_util.keystr(path)[1:], P())
        sharding = NamedSharding(mesh, spec)
        if isinstance(x, jax.ShapeDtypeStruct):
            out.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding))
        else:
            out.append(jax.device_put(x, sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def layouts(tree) -> list[tuple]:
    return [
        (tuple(x.sharding.spec), x.sharding.memory_kind, x.sharding.mesh.shape)
        for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    ]


def test_mesh_sharded_partly_offloaded_state_keeps_its_layout(tmp_path):
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    assert mesh.size == 8
    model = eo.place(lay_out(make_model(key=jax.random.key(0)), mesh), PARTLY)
    opt_state = eo.init_opt_state(OPTIMIZER, model, PARTLY)
    step = eo.train_step(loss_fn, OPTIMIZER, PARTLY)
    batch = [
        jax.device_put(a, NamedSharding(mesh, P())) for a in data(jax.random.key(2))
    ]
    model, opt_state, _, _ = step(model, opt_state, *batch)  # moments not zero
    saved = layouts((model, opt_state))
    kinds = {(spec, kind) for spec, kind, _ in saved}
    assert ((None, "tp", "fsdp"), "pinned_host") in kinds  # sharded, offloaded
    assert ((None, "fsdp", "tp"), "device") in kinds  # sharded, on the device
    assert ((None, "fsdp", "tp"), "pinned_host") in kinds  # ... its state offloaded
    eo.save(tmp_path, model, opt_state, step=1)

    abstract = eqx.filter_eval_shape(make_model, key=jax.random.key(0))
    abstract = eo.place(lay_out(abstract, mesh), PARTLY)
    like = (abstract, eo.init_opt_state(OPTIMIZER, abstract, PARTLY))
    restored = eo.load(tmp_path, like, PARTLY, optimizer=OPTIMIZER)
    assert restored.step == 1
    assert layouts(restored[:2]) == saved
    assert placements(restored[:2]) == placements((model, opt_state))
    assert_trees_equal(restored[:2], (model, opt_state))
    weight = restored.model.blocks.layers.layers[0].weight
    assert jax.typeof(weight).memory_space == jax.memory.Space.Host
    # A `like` only laid out (everything on the device), without the optimizer:
    # the policy gives the memory kinds, the `like` the shardings.
    bare = lay_out(eqx.filter_eval_shape(make_model, key=jax.random.key(0)), mesh)
    bare_state = eo.init_opt_state(OPTIMIZER, bare, eo.Policy.none())
    again = eo.load(tmp_path, (bare, bare_state), PARTLY)
    assert layouts(again[:2]) == saved
    assert_trees_equal(again[:2], (model, opt_state))
    # Laid out as the step returns its outputs: it trains on without compiling.
    with compiles() as compiled:
        step(restored.model, restored.opt_state, *batch)
    assert compiled == []


def test_keep_last_n_and_latest(tmp_path):
    for s in range(1, 6):
        eo.save(tmp_path, {"a": jnp.full((2,), float(s))}, None, step=s, keep=3)
    assert eo.saved_steps(tmp_path) == [3, 4, 5]
    like = ({"a": jax.ShapeDtypeStruct((2,), jnp.float32)}, None)
    none = eo.Policy.none()
    model, _, step = eo.load(tmp_path, like, none, optimizer=OPTIMIZER)
    assert step == 5 and model["a"].tolist() == [5.0, 5.0]
    model, _, step = eo.load(tmp_path, like, none, step=3)
    assert step == 3 and model["a"].tolist() == [3.0, 3.0]
    assert eo.saved_steps(tmp_path / "missing") == []


def test_wait_until_finished(tmp_path):
    handles = [
        eo.save(tmp_path / str(i), {"a": jnp.ones(3)}, None, step=0, wait=False)
        for i in range(2)
    ]
    eo.wait_until_finished()
    assert all(h.done() for h in handles)
    assert eo.saved_steps(tmp_path / "1") == [0]


def test_extra_keeps_types_and_sharding(tmp_path, getkey):
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    extra = {
        "key": jax.random.key(3, impl="rbg"),
        "keys": jax.random.split(getkey(), 4),
        "pos": 7,
        "lr": 0.25,
        "name": "run-1",
        "flag": True,
        "table": jax.device_put(jnp.arange(6.0), sharding),
    }
    eo.save(tmp_path, {}, None, step=0, extra=extra)
    template = {
        "key": jax.random.key(0, impl="rbg"),
        "keys": jax.ShapeDtypeStruct((4,), extra["keys"].dtype),
        "pos": 0,
        "lr": 0.0,
        "name": "",
        "flag": False,
        "table": jax.ShapeDtypeStruct((6,), jnp.float32, sharding=sharding),
    }
    _, _, _, got = eo.load(
        tmp_path, ({}, None), eo.Policy.none(), optimizer=OPTIMIZER, extra=template
    )
    assert {k: type(v) for k, v in got.items()} == {
        k: type(v) for k, v in extra.items()
    }
    assert (got["pos"], got["lr"], got["name"], got["flag"]) == (7, 0.25, "run-1", True)
    assert_trees_equal(got, extra)
    assert got["table"].sharding == sharding
    assert jax.random.key_impl(got["key"]) == jax.random.key_impl(extra["key"])


def test_place_opt_state_keeps_values(getkey, steps):
    step = steps["offload_all"]
    policy = step.policy
    model = eo.place(make_model(key=getkey()), policy)
    opt_state = eo.init_opt_state(OPTIMIZER, model, policy)
    model, opt_state, _, _ = step(model, opt_state, *data(getkey()))
    before = [np.array(x) for x in bits(opt_state)]
    moved = eo.place(opt_state, policy)  # the count goes to the host too
    with pytest.raises(ValueError, match=r"count.*place_opt_state\(optimizer"):
        step(model, moved, *data(getkey()))
    placed = eo.place_opt_state(OPTIMIZER, moved, model, policy)
    assert placements(placed) == placements(opt_state)
    assert_trees_equal(bits(placed), before)
    step(model, placed, *data(getkey()))  # accepted
    abstract = eo.place_opt_state(
        OPTIMIZER, eoi.abstract_tree(opt_state), model, policy
    )
    assert [x.sharding.memory_kind for x in jax.tree.leaves(abstract)] == [
        x.sharding.memory_kind for x in jax.tree.leaves(opt_state)
    ]
    # A state for another model is named, not placed.
    deeper = eqx.filter_eval_shape(make_model, DEPTH + 1, key=jax.random.key(0))
    deeper = eo.place(deeper, policy)  # (abstract: none to build)
    with pytest.raises(
        ValueError, match=r"`place_opt_state`: optimizer state leaf .* has shape"
    ):
        eo.place_opt_state(OPTIMIZER, opt_state, deeper, policy)


def test_errors(tmp_path):
    policy = eo.Policy.offload_all()
    like = abstract_like(policy)
    with pytest.raises(FileNotFoundError, match="no saved step .*no such directory"):
        eo.load(tmp_path / "missing", like, policy, optimizer=OPTIMIZER)
    model = eo.place(make_model(key=jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(OPTIMIZER, model, policy)
    for s in (3, 7):
        eo.save(tmp_path, model, opt_state, step=s)
    with pytest.raises(FileNotFoundError, match=r"`load\(step=5\)`.*steps saved: 3, 7"):
        eo.load(tmp_path, like, policy, optimizer=OPTIMIZER, step=5)
    deeper = eqx.filter_eval_shape(make_model, DEPTH + 1, key=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"model saved at step 7 does not match `like\[0\]`.*"
        r"'blocks.layers.layers\[0\].weight' is float32\[3, 16, 8\] in the "
        r"checkpoint but float32\[4, 16, 8\]",
    ):
        eo.load(tmp_path, (deeper, like[1]), policy, optimizer=OPTIMIZER)
    sgd = optax.sgd(0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"opt_state saved at step 7 .*`like\[1\]`"):
        eo.load(
            tmp_path,
            (like[0], eo.init_opt_state(sgd, like[0], policy)),
            policy,
            optimizer=sgd,
        )
    with pytest.raises(ValueError, match="saved without `extra`"):
        eo.load(tmp_path, like, policy, optimizer=OPTIMIZER, extra={"step": 0})
    with pytest.raises(TypeError, match="like"):
        eo.load(tmp_path, [like[0]], policy, optimizer=OPTIMIZER)  # pyright: ignore
    with unchecked(), pytest.raises(TypeError, match=r"`load\(optimizer=...\)`.*adamw"):
        eo.load(tmp_path, like, policy, optimizer=optax.adamw)  # pyright: ignore
    with pytest.raises(ValueError, match="step 7 is already saved"):
        eo.save(tmp_path, model, opt_state, step=7)
    with pytest.raises(ValueError, match=r"`save\(step=...\)` must be an int >= 0"):
        eo.save(tmp_path, model, opt_state, step=-1)
    # Below the latest step (e.g. after resuming from an earlier one): orbax would
    # skip it silently.
    with pytest.raises(ValueError, match=r"`save\(step=5\)`: .* already holds step 7"):
        eo.save(tmp_path, model, opt_state, step=5)
    assert eo.saved_steps(tmp_path) == [3, 7]
    with pytest.raises(ValueError, match=r"`save\(keep=...\)`"):
        eo.save(tmp_path, model, opt_state, step=8, keep=0)
    with pytest.raises(TypeError, match=r"`save\(model=...\)`: leaf .* is abstract"):
        eo.save(tmp_path, like[0], opt_state, step=8)
    with pytest.raises(TypeError, match=r"`save\(extra=...\)`: leaf 'f' is a function"):
        eo.save(tmp_path, model, opt_state, step=8, extra={"f": lambda: 0})
    with pytest.raises(ValueError, match=r"extra.*leaf 'pos' is a Python int in the"):
        eo.save(tmp_path, model, opt_state, step=9, extra={"pos": 1})
        eo.load(tmp_path, like, policy, optimizer=OPTIMIZER, extra={"pos": 1.0})


if __name__ == "__main__":
    {"resume": resume, "save_until_killed": save_until_killed}[sys.argv[1]](
        *sys.argv[2:]
    )
