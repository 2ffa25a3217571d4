"""`Policy(update="host")`: the optimizer update on the host's CPU (JAX's host
compute). On the CPU it must train like the plain step, and its Adam must be
optax's own on the same gradients; compiled for a TPU or GPU, the update's
arithmetic must be inside the host computation and no optimizer state may cross the
host link."""

import functools
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

from .helpers import (
    assert_trees_equal,
    batches,
    cross_entropy,
    memory_kind,
    table_lm,
    TableLM,
)
from .numerics import (
    assert_close,
    BF16,
    BF16_COMPUTE,
    excess,
    F32,
    scaled_update,
    TRAINED,
)


sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import compile_matrix as cm  # noqa: E402
from _compiles import compiles  # noqa: E402


def host_policy(**fields: Any) -> eo.Policy:
    defaults: dict[str, Any] = dict(
        params="pinned_host", opt_state="pinned_host", update="host"
    )
    return eo.Policy(**(defaults | fields))


# A small language model: four stacked `TanhBlock`s of width 16.
lm = functools.partial(table_lm, jax.random.key(0))


def kinds(tree) -> dict[str, str]:
    """The memory kind of each array leaf with an axis, by path."""
    return {
        jax.tree_util.keystr(path): memory_kind(x)
        for path, x in jax.tree.leaves_with_path(eqx.filter(tree, eqx.is_array))
        if x.ndim
    }


def updates(tree, origin) -> list[np.ndarray]:
    """`tree - origin`, leaf by leaf, in float64: bf16-compute runs are compared
    through their updates at `BF16_COMPUTE`, which `assert_close(origin=...)`
    refuses (it cannot see an update 1% too large; masters in float32 round to
    `1e-7` of themselves, far inside)."""
    pairs = zip(
        jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array)),
        jax.tree.leaves(eqx.filter(origin, eqx.is_inexact_array)),
    )
    return [np.asarray(x, np.float64) - np.asarray(o, np.float64) for x, o in pairs]


# --- Training through the updates: SGD, against the plain step -----------------

LR, STEPS = 0.05, 5


def clipped_sgd(learning_rate):
    """SGD with momentum behind a global-norm clip (active: the gradients' norm is
    above 0.1). The clip makes every new leaf depend on every gradient, so the whole
    update runs on the host, a leaf whose state the policy keeps on the device
    included."""
    return optax.chain(
        optax.clip_by_global_norm(0.1), optax.sgd(learning_rate, momentum=0.9)
    )


# The learning rate in the optimizer state: a negative control changes it without
# compiling the step again.
SGD = optax.inject_hyperparams(clipped_sgd)(learning_rate=LR)

CONFIGS = {
    # Every leaf on the host, two micro-batches: the first is run before the loop
    # (`_microbatch`), the second in it.
    "all on host, 2 micro-batches": (host_policy(), 2),
    # The embedding's parameters on the device: updated on the host and written back
    # there. The head's state on the device: tied to the host by the clip.
    "mixed placement": (
        host_policy(
            params={"**": "pinned_host", "embed": "device"},
            opt_state={"**": "pinned_host", "head": "device"},
        ),
        1,
    ),
    # fp32 masters on the host, bf16 compute: the gradients cross in bf16 and are
    # cast on the host.
    "bf16 compute": (host_policy(compute_dtype=jnp.bfloat16), 1),
}


@functools.cache
def host_step(name: str) -> eo.TrainStep:
    """One step per configuration, shared by the tests (each new step compiles)."""
    policy, microbatches = CONFIGS[name]
    return eo.train_step(cross_entropy, SGD, policy, microbatches=microbatches)


def train(step, policy: eo.Policy, lr: float | None = None) -> tuple:
    """`STEPS` steps of `step` from `lm()`; `lr` replaces the learning rate."""
    model = eo.place(lm(), policy)
    opt_state = eo.init_opt_state(SGD, model, policy)
    if lr is not None:  # of the same type and placement: no new compilation
        old = opt_state.hyperparams["learning_rate"]
        new = jax.device_put(jnp.asarray(lr, old.dtype), old.sharding)
        hyperparams = {**opt_state.hyperparams, "learning_rate": new}
        opt_state = opt_state._replace(hyperparams=hyperparams)
    data = batches(batch=4)
    losses = []
    for _ in range(STEPS):
        model, opt_state, loss, _ = step(model, opt_state, *next(data))
        losses.append(float(loss))
    return model, opt_state, losses


@functools.cache
def plain(compute_dtype: Any) -> tuple:
    """The plain step's training (parameters and state on the device, the whole
    update there, no micro-batches: SGD's update is the same whatever the split),
    in fp32 or under the bf16 compute dtype."""
    policy = eo.Policy.none(compute_dtype=compute_dtype)
    return train(eo.train_step(cross_entropy, SGD, policy), policy)


@pytest.mark.parametrize("name", CONFIGS)
def test_trains_like_the_plain_step(name):
    policy, _ = CONFIGS[name]
    model, opt_state, losses = train(host_step(name), policy)
    ref_model, _, ref_losses = plain(policy.compute_dtype)
    if policy.compute_dtype is None:
        assert_close(losses, ref_losses)
        assert_close(model, ref_model, tol=TRAINED, origin=lm(), steps=STEPS)
    else:
        # Both runs are the same bf16 scheme.
        assert_close(losses, ref_losses, tol=BF16_COMPUTE)
        ours, reference = updates(model, lm()), updates(ref_model, lm())
        assert_close(ours, reference, tol=BF16_COMPUTE)
        # The negative control: the update of the wrong sign.
        wrong = updates(scaled_update(model, lm(), -1.0), lm())
        assert excess(wrong, reference, tol=BF16_COMPUTE) > 10
    params, state = kinds(model), kinds(opt_state)
    if name == "mixed placement":
        assert params.pop(".embed") == "device"
        heads = [k for k in state if k.endswith(".head")]
        assert heads and {state.pop(k) for k in heads} == {"device"}
    assert set(params.values()) == set(state.values()) == {"pinned_host"}


def test_a_changed_learning_rate_or_a_wrong_sign_is_caught():
    """The negative controls of the fp32 comparisons above, with the same compiled
    host step: at `lr x 1.01` the updates are more than ten times beyond their
    tolerance; at `-lr` (a wrong gradient sign) the losses are."""
    name = "all on host, 2 micro-batches"
    ref_model, _, ref_losses = plain(None)
    for lr, losses_too in ((1.01 * LR, False), (-LR, True)):
        model, _, losses = train(host_step(name), CONFIGS[name][0], lr)
        off = excess(model, ref_model, tol=TRAINED, origin=lm(), steps=STEPS)
        assert off > 10
        if losses_too:
            assert excess(losses, ref_losses) > 10


def test_verify_checks_the_host_update():
    name = "mixed placement"
    policy = CONFIGS[name][0]
    model = eo.place(lm(), policy)
    opt_state = eo.init_opt_state(SGD, model, policy)
    report = eo.verify(host_step(name), model, opt_state, *next(batches(batch=4)))
    assert report.passed, report
    assert report.update is not None  # the host step was run against optax's own


# --- Adam, one step at a time on the same gradients ---------------------------

ADAM_LR = 1e-2


def clipped_adamw(learning_rate):
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, weight_decay=0.1)
    )


def all_but_the_embedding(params):
    """`optax.masked`'s mask: the embedding's update passes through unchanged."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "embed" not in jax.tree_util.keystr(path), params
    )


# `(optimizer of the learning rate, policy, whether the learning rate is traced)`.
# A traced one is passed to the step and the optimizer built inside it: the host
# computation takes it as an operand (it closes over a tracer). The others close
# over constants.
ADAM = {
    "clip + adamw, traced learning rate": (clipped_adamw, host_policy(), True),
    "schedule and mu_dtype": (
        lambda lr: optax.adamw(
            optax.cosine_decay_schedule(lr, 10), mu_dtype=jnp.bfloat16
        ),
        host_policy(),
        False,
    ),
    # Of the two compared steps, one accumulates and one applies.
    "MultiSteps": (
        lambda lr: optax.MultiSteps(optax.adamw(lr), 2),
        host_policy(),
        False,
    ),
    # Without a clip, the head (its state on the device) is updated on the device.
    "masked, head state on the device": (
        lambda lr: optax.masked(optax.adamw(lr), all_but_the_embedding),
        host_policy(opt_state={"**": "pinned_host", "head": "device"}),
        False,
    ),
}


def adam_steps(name: str):
    """`(ours, theirs)`: `(lr, grads, opt_state, model)` to the new model, state and
    norms, by `eo.optimizer_update` under the configuration's policy and by optax
    on the device."""
    make, policy, traced = ADAM[name]

    def optimizer(lr):
        return make(lr) if traced else make(ADAM_LR)

    @eqx.filter_jit
    def ours(lr, grads, opt_state, model):
        return eo.optimizer_update(
            optimizer(lr), grads, opt_state, model, policy, metrics=True
        )

    @eqx.filter_jit
    def theirs(lr, grads, opt_state, params):
        updates, opt_state = optimizer(lr).update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        norms = [optax.tree.norm(x) for x in (grads, updates, new)]
        return (
            new,
            opt_state,
            dict(zip(("grad_norm", "update_norm", "param_norm"), norms)),
        )

    return ours, theirs


def random_grads(params, key):
    """Gradients over six orders of magnitude (Adam's normalisation, `eps`)."""
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for k, x in zip(jax.random.split(key, len(leaves)), leaves):
        k1, k2 = jax.random.split(k)
        size = 10.0 ** jax.random.uniform(k2, x.shape, minval=-6, maxval=0)
        out.append(jax.random.normal(k1, x.shape) * size)
    return jax.tree.unflatten(treedef, out)


def on_device(tree):
    """A copy in device memory: the reference's arguments."""
    return jax.tree.map(lambda x: jnp.array(np.asarray(x)), tree)


def bf16(x) -> bool:
    return eqx.is_array(x) and x.dtype == jnp.bfloat16


def state_excess(ours, theirs) -> float:
    """How far the states are, in their tolerances: `F32`, and `BF16` for a leaf
    in bf16 (`mu_dtype`: a float32 result rounded once)."""
    wide = [eqx.filter(x, bf16, inverse=True) for x in (ours, theirs)]
    narrow = [eqx.filter(x, bf16) for x in (ours, theirs)]
    return max(excess(*wide, tol=F32), excess(*narrow, tol=BF16))


@pytest.mark.parametrize("name", ADAM)
def test_adam_on_the_host_is_optax_on_the_same_gradients(name):
    """One step at a time from a state two steps old (nonzero moments, a count: the
    bias correction matters), on the same gradients as optax's whole update: the
    parameters' updates, the new state and the norms within float32's tolerance.
    Negative controls on the same compiled update: the gradients' sign flipped
    (the state), and, with the learning rate passed in, one 1% too large (the
    parameters and norms)."""
    make, policy, traced = ADAM[name]
    ours, theirs = adam_steps(name)
    model = eo.place(lm(), policy)
    opt_state = eo.init_opt_state(make(ADAM_LR), model, policy)
    lr = jnp.asarray(ADAM_LR)
    applied = []
    for i in range(4):
        grads = random_grads(eqx.filter(model, eqx.is_inexact_array), jax.random.key(i))
        new_model, new_state, norms = ours(lr, grads, opt_state, model)
        if i >= 2:
            start = on_device(model)
            ref_model, ref_state, ref_norms = theirs(
                lr, on_device(grads), on_device(opt_state), start
            )
            applied.append(
                not all(
                    np.array_equal(x, y)
                    for x, y in zip(jax.tree.leaves(ref_model), jax.tree.leaves(start))
                )
            )
            if applied[-1]:
                assert_close(new_model, ref_model, origin=start)
            else:  # accumulated: nothing changes
                assert_trees_equal(new_model, start)
            assert state_excess(new_state, ref_state) <= 1
            assert_close(norms, ref_norms)
            flipped = jax.tree.map(jnp.negative, grads)
            _, wrong_state, _ = ours(lr, flipped, opt_state, model)
            assert state_excess(wrong_state, ref_state) > 10
            if traced:
                wrong, _, wrong_norms = ours(1.01 * lr, grads, opt_state, model)
                assert excess(wrong, ref_model, origin=start) > 10
                assert excess(wrong_norms, ref_norms) > 10
        model, opt_state = new_model, new_state
    assert applied == ([False, True] if name == "MultiSteps" else [True, True])
    assert set(kinds(model).values()) == {"pinned_host"}
    for path, kind in kinds(opt_state).items():
        head = name.startswith("masked") and path.endswith(".head")
        assert kind == ("device" if head else "pinned_host"), path


def test_errors():
    with pytest.raises(ValueError, match=r"opt_state='pinned_host'"):
        eo.Policy(params="pinned_host", update="host")
    with pytest.raises(ValueError, match=r"opt_state='pinned_host'"):
        eo.Policy(opt_state={"**": "device"}, update="host")

    def first_step(optimizer):
        policy = host_policy()
        model = eo.place(lm(), policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(cross_entropy, optimizer, policy)
        step(model, opt_state, *next(batches()))

    # An optimizer with no parameter-shaped state: nothing to update on the host.
    with pytest.raises(ValueError, match=r"no optimizer state on the host"):
        first_step(optax.sgd(LR))

    def looping(updates, state, params=None):
        del params
        halve = lambda _, u: jax.tree.map(lambda x: x / 2, u)  # noqa: E731
        return jax.lax.fori_loop(0, state, halve, updates), state

    optimizer = optax.chain(
        optax.GradientTransformation(lambda params: jnp.asarray(2), looping),
        optax.adamw(LR),
    )
    with pytest.raises(ValueError, match=r"`while` \(a loop\).*update='streamed'"):
        first_step(optimizer)


@pytest.mark.parametrize("form", eoi.host_forms())
def test_both_forms_of_host_compute(form):
    """Pinned to jax 0.10.2, which has both; after 0.11.0 only the decorator."""
    assert jax.__version__ != "0.10.2" or eoi.host_forms() == (
        "decorator",
        "context",
    )
    host = jax.sharding.SingleDeviceSharding(
        jax.devices()[0], memory_kind="pinned_host"
    )
    x = jax.device_put(jnp.arange(4.0), host)

    def double(x):
        return [x * 2 + jnp.zeros_like(x)]  # a fresh array, typed device memory

    (out,) = jax.jit(lambda x: eoi.on_host(double, form)(x))(x)
    assert out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(out, [0.0, 2.0, 4.0, 6.0])


# --- Compiled for a TPU and a GPU ---------------------------------------------

CLIPPED = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(ADAM_LR))


def host_and_device_ops(text: str) -> tuple[list, list]:
    """The instructions the program runs on the host's CPU and the others."""
    comps, entry = eoi.parse_hlo(text)
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


def abstract_lm(width: int) -> TableLM:
    """`compile_matrix.py`'s `gpt` without its kernels (`TableLM`: no LayerNorm, no
    bias; GPU compile time grows with the kernels): abstract, its vocabulary's."""
    return eqx.filter_eval_shape(table_lm, jax.random.key(0), cm.VOCAB, width, 2)


# A share of `benchmarks/compile_matrix.py`'s matrix (every width, dtype and
# micro-batch count for both targets: `--policies "host update"`), on bare tables
# around two stacked layers: for the TPU, an odd width, two micro-batches (the first
# outside the loop: the TPU compiler aliases nothing twice) and a bf16 compute
# dtype; for the GPU, float32.
@pytest.mark.parametrize(
    "target, width, microbatches, dtype",
    [("tpu-v5e", 200, 2, "bf16-compute"), ("gpu-h100", 96, 1, "float32")],
)
def test_compiled_update_runs_on_the_host(target, width, microbatches, dtype):
    model, loss = abstract_lm(width), cm.token_loss
    tokens = jax.ShapeDtypeStruct((cm.BATCH * microbatches, cm.SEQ), jnp.int32)
    batch = (tokens, tokens)
    extra = {"compute_dtype": jnp.bfloat16} if dtype == "bf16-compute" else {}
    policy = cm.policy_for("gpt", "host update", **extra)
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(CLIPPED, model, policy)
    step = eo.train_step(loss, CLIPPED, policy, microbatches=microbatches)
    with compiles() as texts:
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


def test_a_transposed_gradient_compiles_for_a_gpu():
    """The gradient of `x @ w` is a transposed product. XLA:GPU made the host
    computation's parameter in its first, transposed layout, then laid the operand
    out by default, and rejected the step ("The async-start expects the async
    shape at index {0} to match async computation parameter shape"), for a leaf
    outside every `Stacked` at any size: it compiles, the update on the host."""
    policy = host_policy()
    params = {"w": jax.ShapeDtypeStruct((16, 16), jnp.float32)}
    model = eo.place(params, policy)
    opt_state = eo.init_opt_state(CLIPPED, model, policy)

    def loss(params, x):
        return jnp.mean((x @ params["w"]) ** 2)

    step = eo.train_step(loss, CLIPPED, policy)
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    with compiles() as texts:
        eo.memory_report(step, model, opt_state, x, target="gpu-h100")
    host, _ = host_and_device_ops(texts[-1])
    assert any(i.opcode == "sqrt" for i in host)


def test_metrics_tie_no_leaf_to_the_host():
    """`metrics=True`: each leaf's sum of squares is computed where the leaf is
    updated, so the global norms do not bring the leaves updated on the device
    (the embedding's and head's, whose state stays there) to the host: the
    compiled step moves what it moves without metrics, but a few scalars."""
    tokens = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    optimizer = optax.adamw(ADAM_LR)
    state = {"**": "pinned_host", "head": "device", "embed": "device"}
    policy = host_policy(params="device", opt_state=state)
    model = eo.place(eqx.filter_eval_shape(lm), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    moved = []
    for metrics in (False, True):
        step = eo.train_step(cross_entropy, optimizer, policy, metrics=metrics)
        report = eo.memory_report(
            step, model, opt_state, tokens, tokens, target="tpu-v5e"
        )
        directions = ("host_to_device", "device_to_host")
        moved.append([report.transfer_bytes(d, compiled=True) for d in directions])
    (h2d, d2h), (h2d_metrics, d2h_metrics) = moved
    assert 0 <= h2d_metrics - h2d <= 256 and 0 <= d2h_metrics - d2h <= 256, moved
