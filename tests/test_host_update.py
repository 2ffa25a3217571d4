"""`Policy(update="host")`: the optimizer update on the host's CPU (JAX's host
compute). On the CPU it must train exactly like the plain step; compiled for a TPU
or GPU, the update's arithmetic must be inside the host computation and no
optimizer state may cross the host link."""

import contextlib
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload as eo
import eqx_offload.internal as eoi

from .helpers import assert_trees_close, batches, cross_entropy, Model


sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import compile_matrix as cm  # noqa: E402


LR, STEPS = 1e-2, 3
CLIPPED = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(LR))

# How far parameters after STEPS AdamW steps may be from the plain step's. The host
# computation is a program of its own, fused and contracted (FMA) apart from the step,
# and a first micro-batch run before the loop (`_microbatch`) is compiled apart from the
# others: float32 rounding that Adam turns into a fraction of `lr` where a gradient is
# near zero (design notes, "JAX facts relied on"). Measured: one element of 1024 at
# 3.5e-4 x lr x steps (`mu_dtype=bf16`), 5.3e-4 (two micro-batches); the rest within
# `assert_trees_close`'s 1e-4. A run at lr x 1.001 is 7.1e-3 x lr x steps away
# (`assert_trees_close`'s docstring) and still fails.
ADAM_ATOL = 1e-3 * LR * STEPS


def host_policy(**fields: Any) -> eo.Policy:
    defaults: dict[str, Any] = dict(
        params="pinned_host", opt_state="pinned_host", update="host"
    )
    return eo.Policy(**(defaults | fields))


def train(policy, optimizer, *, microbatches=1, metrics=False, steps=STEPS):
    model = eo.place(Model(key=jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(
        cross_entropy, optimizer, policy, microbatches=microbatches, metrics=metrics
    )
    data = batches(batch=4)
    losses, norms = [], []
    for _ in range(steps):
        out = step(model, opt_state, *next(data))
        model, opt_state, loss, step_metrics = out
        losses.append(float(loss))
        if metrics:
            assert step_metrics is not None
            norms.append({k: float(v) for k, v in step_metrics.items()})
    return model, opt_state, losses, norms


def assert_same_training(ours, reference) -> None:
    np.testing.assert_allclose(ours[2], reference[2], rtol=1e-5)
    assert_trees_close(ours[0], reference[0], atol=ADAM_ATOL)


@pytest.mark.parametrize(
    "placement",
    [
        dict(),  # everything on the host
        dict(params="device"),  # host state: new parameters go back to the device
        # The head's state on the device: updated there, but tied to the host by
        # the global-norm clip, so on the host with the rest.
        dict(opt_state={"**": "pinned_host", "head": "device"}),
    ],
    ids=["all on host", "host state", "mixed state"],
)
def test_trains_like_the_plain_step(placement):
    reference = train(eo.Policy.none(), CLIPPED)
    ours = train(host_policy(**placement), CLIPPED)
    assert_same_training(ours, reference)
    kinds = {
        x.sharding.memory_kind
        for x in jax.tree.leaves(eqx.filter(ours[0], eqx.is_array))
    }
    assert kinds == {placement.get("params", "pinned_host")}
    states = [x for x in jax.tree.leaves(ours[1]) if x.ndim]
    assert any(x.sharding.memory_kind == "pinned_host" for x in states)


@pytest.mark.parametrize("compute_dtype", [None, jnp.bfloat16], ids=["fp32", "bf16"])
def test_micro_batches_and_compute_dtype(compute_dtype):
    """Two micro-batches, fp32 or a bf16 compute dtype with fp32 masters on the
    host: the plain step's (on the device) from the same micro-batches."""
    policy = host_policy(compute_dtype=compute_dtype)
    ours = train(policy, CLIPPED, microbatches=2)
    plain = eo.Policy.none(compute_dtype=compute_dtype)
    assert_same_training(ours, train(plain, CLIPPED, microbatches=2))


@pytest.mark.parametrize(
    "optimizer",
    [
        optax.adamw(optax.cosine_decay_schedule(LR, 10), mu_dtype=jnp.bfloat16),
        optax.MultiSteps(optax.adamw(LR), 2),
        optax.masked(optax.adamw(LR), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    ],
    ids=["schedule and mu_dtype", "MultiSteps", "masked"],
)
def test_optax_features(optimizer):
    ours = train(host_policy(), optimizer, metrics=True)
    reference = train(eo.Policy.none(), optimizer, metrics=True)
    assert_same_training(ours, reference)
    for mine, theirs in zip(ours[3], reference[3]):
        for name in ("grad_norm", "update_norm", "param_norm"):
            np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-5)


def test_optimizer_update_and_verify():
    policy = host_policy()
    model = eo.place(Model(key=jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(CLIPPED, model, policy)
    tokens, targets = next(batches(batch=4))

    @eqx.filter_jit(donate="all-except-first")
    def step(batch, model, opt_state):
        loss, grads = eqx.filter_value_and_grad(
            eo.filter_offload(cross_entropy, policy)
        )(model, *batch)
        model, opt_state, _ = eo.optimizer_update(
            CLIPPED, grads, opt_state, model, policy
        )
        return loss, model, opt_state

    plain = eo.Policy.none()
    ref_model = eo.place(Model(key=jax.random.key(0)), plain)
    ref_state = eo.init_opt_state(CLIPPED, ref_model, plain)
    ref_model, _, _, _ = eo.train_step(cross_entropy, CLIPPED, plain)(
        ref_model, ref_state, tokens, targets
    )
    report = eo.verify(
        eo.train_step(cross_entropy, CLIPPED, policy), model, opt_state, tokens, targets
    )
    assert report.passed, report
    assert report.update is not None  # the host step was run against optax's own
    _, model, _ = step((tokens, targets), model, opt_state)
    assert_trees_close(model, ref_model, atol=ADAM_ATOL)


def test_errors():
    with pytest.raises(ValueError, match=r"opt_state='pinned_host'"):
        eo.Policy(params="pinned_host", update="host")
    with pytest.raises(ValueError, match=r"opt_state='pinned_host'"):
        eo.Policy(opt_state={"**": "device"}, update="host")
    # An optimizer with no parameter-shaped state: nothing to update on the host.
    with pytest.raises(ValueError, match=r"no optimizer state on the host"):
        train(host_policy(), optax.sgd(LR), steps=1)

    def looping(updates, state, params=None):
        del params
        halve = lambda _, u: jax.tree.map(lambda x: x / 2, u)  # noqa: E731
        return jax.lax.fori_loop(0, state, halve, updates), state

    optimizer = optax.chain(
        optax.GradientTransformation(lambda params: jnp.asarray(2), looping),
        optax.adamw(LR),
    )
    with pytest.raises(ValueError, match=r"`while` \(a loop\).*update='streamed'"):
        train(host_policy(), optimizer, steps=1)


@pytest.mark.parametrize("form", eoi.compat.host_forms())
def test_both_forms_of_host_compute(form):
    """Pinned to jax 0.10.2, which has both; after 0.11.0 only the decorator."""
    assert jax.__version__ != "0.10.2" or eoi.compat.host_forms() == (
        "decorator",
        "context",
    )
    host = jax.sharding.SingleDeviceSharding(
        jax.devices()[0], memory_kind="pinned_host"
    )
    x = jax.device_put(jnp.arange(4.0), host)

    def double(x):
        return [x * 2 + jnp.zeros_like(x)]  # a fresh array, typed device memory

    (out,) = jax.jit(lambda x: eoi.compat.on_host(double, form)(x))(x)
    assert out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(out, [0.0, 2.0, 4.0, 6.0])


# --- Compiled for a TPU and a GPU ---------------------------------------------


@contextlib.contextmanager
def compiled_texts():
    texts: list[str] = []
    original = jax.stages.Lowered.compile

    def compile(self, *args, **kwargs):
        compiled = original(self, *args, **kwargs)
        texts.append(compiled.as_text() or "")
        return compiled

    jax.stages.Lowered.compile = compile
    try:
        yield texts
    finally:
        jax.stages.Lowered.compile = original


def host_and_device_ops(text: str) -> tuple[list, list]:
    """The instructions the program runs on the host's CPU and the others."""
    comps, entry = eoi.compiler.parse_hlo(text)
    on_host: set[str] = set()
    todo = [
        c for comp in comps.values() for i in comp.insts.values() for c in i.host_calls
    ]
    while todo:
        name = todo.pop()
        if name in on_host or name not in comps:
            continue
        on_host.add(name)
        for inst in comps[name].insts.values():
            called = inst.computation("calls")
            if called is not None:
                todo.append(called)
    host, device = [], []
    for comp in comps.values():
        for inst in comp.insts.values():
            (host if comp.name in on_host or inst.host_compute else device).append(inst)
    return host, device


@pytest.mark.parametrize("target", ["tpu-v5e", "gpu-h100"])
@pytest.mark.parametrize(
    "width, microbatches, dtype",
    [(96, 1, "float32"), (200, 2, "bf16-compute"), (64, 1, "bfloat16")],
)
def test_compiled_update_runs_on_the_host(target, width, microbatches, dtype):
    model, loss, batch = cm.case(
        "gpt",
        width,
        2,
        jnp.float32 if dtype == "bf16-compute" else cm.DTYPES[dtype],
        batch=cm.BATCH * microbatches,
    )
    extra = {"compute_dtype": jnp.bfloat16} if dtype == "bf16-compute" else {}
    policy = cm.policy_for("gpt", "host update", **extra)
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(CLIPPED, model, policy)
    step = eo.train_step(loss, CLIPPED, policy, microbatches=microbatches)
    with compiled_texts() as texts:
        report = eo.memory_report(step, model, opt_state, *batch, target=target)
    assert report.compiled_transfers is not None
    assert not [
        t for t in report.compiled_transfers if t.what == "opt_state" and t.bytes > 4
    ]
    # Adam's square roots (one per parameter leaf) are computed on the host.
    host, device = host_and_device_ops(texts[-1])
    roots = ("sqrt", "rsqrt")
    assert any(i.opcode in roots for i in host)
    in_update = [
        i for i in device if i.opcode in roots and "optimizer_update" in i.op_name
    ]
    assert not in_update, [i.name for i in in_update]
    # Only the gradients cross to the host in the update.
    update = [t for t in report.compiled_transfers if t.phase == "update"]
    assert {t.what for t in update if t.bytes > 4} <= {"gradients"}


def test_a_learning_rate_passed_to_the_step():
    """An optimizer built inside the step from a traced learning rate: the host
    computation takes it as an operand (it closes over a tracer)."""
    policy = host_policy()
    model = eo.place(Model(key=jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optax.adamw(LR), model, policy)
    tokens, targets = next(batches(batch=4))
    loss = eo.filter_offload(cross_entropy, policy)

    @eqx.filter_jit(donate="all-except-first")
    def step(batch, lr, model, opt_state):
        _, grads = eqx.filter_value_and_grad(loss)(model, *batch)
        optimizer = optax.adamw(lr)
        return eo.optimizer_update(optimizer, grads, opt_state, model, policy)

    model, _, _ = step((tokens, targets), jnp.asarray(LR), model, opt_state)
    plain = eo.Policy.none()
    reference = eo.place(Model(key=jax.random.key(0)), plain)
    state = eo.init_opt_state(optax.adamw(LR), reference, plain)
    step_plain = eo.train_step(cross_entropy, optax.adamw(LR), plain)
    reference, _, _, _ = step_plain(reference, state, tokens, targets)
    assert_trees_close(model, reference, atol=ADAM_ATOL)


def test_metrics_tie_no_leaf_to_the_host():
    """`metrics=True`: each leaf's sum of squares is computed where the leaf is
    updated, so the global norms do not bring the leaves updated on the device
    (the embedding's and head's, whose state stays there) to the host: the
    compiled step moves what it moves without metrics, but a few scalars."""
    model, loss, batch = cm.case("gpt", 128, 2, jnp.float32)
    optimizer = optax.adamw(LR)
    state = {"**": "pinned_host", "head": "device", "embed": "device"}
    policy = host_policy(params="device", opt_state=state)
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    moved = []
    for metrics in (False, True):
        step = eo.train_step(loss, optimizer, policy, metrics=metrics)
        report = eo.memory_report(step, model, opt_state, *batch, target="tpu-v5e")
        directions = ("host_to_device", "device_to_host")
        moved.append([report.transfer_bytes(d, compiled=True) for d in directions])
    (h2d, d2h), (h2d_metrics, d2h_metrics) = moved
    assert 0 <= h2d_metrics - h2d <= 256 and 0 <= d2h_metrics - d2h <= 256, moved
