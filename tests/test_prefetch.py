"""`Policy(prefetch=1)`: the scans that read the next layer while this one
computes train exactly as the plain scans do, leave forward-mode derivatives to the
plain scan, and (compiled for an H100) start every host read of a layer before a
matmul of the layer computing and end it after."""

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
from eqx_offload.internal import replace_policy

from .helpers import assert_trees_close, batches, cross_entropy, Model, Outer


sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import prefetch_schedule  # noqa: E402


LR = 1e-2
STEPS = 3
# As `test_host_update.py`: Adam divides by the root of tiny second moments, so
# rounding differences in a gradient grow to this after a few steps.
ADAM_ATOL = 1e-3 * LR * STEPS
CLIPPED = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR))


def train(policy: eo.Policy, *, microbatches: int = 1) -> tuple[Any, list[float]]:
    model = eo.place(Model(key=jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(CLIPPED, model, policy)
    step = eo.train_step(cross_entropy, CLIPPED, policy, microbatches=microbatches)
    data = batches(batch=4)
    losses = []
    for _ in range(STEPS):
        model, opt_state, loss, _ = step(model, opt_state, *next(data))
        losses.append(float(loss))
    return model, losses


@pytest.mark.parametrize(
    "policy",
    [
        eo.Policy.offload_all(),
        eo.Policy.offload_residuals(),
        eo.Policy.remat(params="pinned_host", save=("**.attn",)),
        eo.Policy.offload_all(update="host"),
        eo.Policy.offload_all(compute_dtype=jnp.bfloat16),
    ],
    ids=[
        "offload_all",
        "offload_residuals",
        "host params, attn saved",
        "host update",
        "bf16",
    ],
)
def test_trains_as_the_plain_scan(policy):
    plain_model, plain_losses = train(policy)
    model, losses = train(replace_policy(policy, prefetch=1))
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    assert_trees_close(model, plain_model, atol=ADAM_ATOL)
    kinds = {
        x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    }
    assert kinds == {
        x.sharding.memory_kind
        for x in jax.tree.leaves(eqx.filter(plain_model, eqx.is_array))
    }


def test_micro_batches():
    policy = eo.Policy.offload_all(compute_dtype=jnp.bfloat16)
    plain = train(policy, microbatches=2)
    ours = train(replace_policy(policy, prefetch=1), microbatches=2)
    np.testing.assert_allclose(ours[1], plain[1], rtol=1e-6)
    assert_trees_close(ours[0], plain[0], atol=ADAM_ATOL)


def _grads(policy: eo.Policy):
    model = eo.place(Model(key=jax.random.key(1)), policy)
    tokens, targets = next(batches())
    fn = eqx.filter_jit(
        eqx.filter_value_and_grad(eo.filter_offload(cross_entropy, policy))
    )
    return fn(model, tokens, targets)


def test_gradients_land_where_the_parameters_live():
    policy = eo.Policy.offload_all()
    (loss0, g0) = _grads(policy)
    (loss1, g1) = _grads(replace_policy(policy, prefetch=1))
    assert float(loss0) == float(loss1)
    assert_trees_close(g1, g0)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert a.sharding.memory_kind == b.sharding.memory_kind


def test_forward_mode_runs_the_plain_scan():
    """`jax.jvp` cannot run a `custom_vjp`: the scan is plain there, and agrees."""
    policy = eo.Policy.offload_residuals(prefetch=1)
    model = Model(key=jax.random.key(2))
    tokens, targets = next(batches())
    fn = eo.filter_offload(cross_entropy, policy)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tangent = jax.tree.map(jnp.ones_like, params)

    def loss(p):
        return fn(eqx.combine(p, static), tokens, targets)

    value, derivative = jax.jvp(loss, (params,), (tangent,))
    grads = jax.grad(loss)(params)
    expected = sum(jnp.sum(g) for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(float(derivative), float(expected), rtol=1e-4)
    np.testing.assert_allclose(float(value), float(loss(params)), rtol=1e-6)


def test_bad_prefetch_is_named():
    with pytest.raises(ValueError, match="prefetch=2"):
        eo.Policy(prefetch=2)
    with pytest.raises(ValueError, match="prefetch=True"):
        eo.Policy(prefetch=True)


# The async host copies XLA:GPU lets in flight at once (its default is 2): with the
# default, a layer's six reads queue behind each other (`docs/step-time.md`).
GPU_OPTIONS = {"xla_gpu_experimental_parallel_async_compute_limit": 16}


def _gpu_schedules() -> dict[str, str]:
    """The loop bodies with host reads and matmuls of the `offload_all` step of a
    4-layer GPT of width 256 with `prefetch=1`, compiled for an H100 with
    `GPU_OPTIONS`: their order as letters."""
    _, orders = prefetch_schedule.schedules(
        "gpt", 256, 4, "gpu-h100", 1, "offload_all", GPU_OPTIONS
    )
    return {k: o for k, o in orders.items() if "g" in o}


def _exposed_reads(order: str) -> int:
    """How many reads (`S` ... `D`, in order) have no matmul between start and
    done."""
    exposed, open_reads = 0, []
    for letter in order:
        if letter == "S":
            open_reads.append(False)
        elif letter == "g":
            open_reads = [True for _ in open_reads]
        elif letter == "D":
            exposed += not open_reads.pop(0)
    return exposed


def test_every_layer_read_overlaps_a_matmul_on_gpu():
    schedules = _gpu_schedules()
    assert len(schedules) == 2, schedules  # the forward and backward scans
    for name, order in schedules.items():
        assert _exposed_reads(order) == 0, (name, order)


def test_the_pending_updates_reads_overlap_a_matmul_on_gpu():
    """`Policy(update_timing="next_forward")`: the forward loop body reads the next
    layer's weights, gradients and optimizer state (and writes this layer's
    update back); every read has a matmul between its start and its done."""
    _, orders = prefetch_schedule.schedules(
        "gpt", 256, 4, "gpu-h100", 0, "offload_all", GPU_OPTIONS,
        update_timing="next_forward",
    )  # fmt: skip
    forward = [o for o in orders.values() if "g" in o and o.count("s") > 3]
    assert len(forward) == 1, orders  # the forward scan writes the update back
    assert forward[0].count("S") >= 8, forward  # weights, gradients, moments
    assert _exposed_reads(forward[0]) == 0, forward


def test_exposed_reads_are_counted():
    assert _exposed_reads("SSggDD") == 0
    assert _exposed_reads("SDSgD") == 1
    assert _exposed_reads("ggSSDSgDD") == 1


class PerToken(eqx.Module):
    """A `Stacked` applied to each token on its own, inside the model's `jax.vmap`
    over examples: two `jax.vmap`s around the scans."""

    model: Model

    def __call__(self, tokens):
        x = jax.vmap(self.model.embed)(tokens)
        x = jax.vmap(lambda t: self.model.blocks.scan(_mlp_only, t)[0])(x)
        return jax.vmap(self.model.head)(x)


def _mlp_only(layer, x, _):
    return x + layer.mlp(layer.norm2(x)), None


def test_nested_vmaps_and_micro_batches():
    """Each `jax.vmap` moves inside the layer: a gradient tap that adds its
    accumulator (the second micro-batch) adds it once, not once per example."""

    def loss(model, tokens, targets):
        logits = jax.vmap(model)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def step(prefetch):
        policy = eo.Policy.offload_all(prefetch=prefetch)
        model = eo.place(PerToken(Model(key=jax.random.key(3))), policy)
        opt_state = eo.init_opt_state(optax.sgd(1.0), model, policy)
        train = eo.train_step(loss, optax.sgd(1.0), policy, microbatches=2)
        return train(model, opt_state, *next(batches(batch=16)))[0]

    assert_trees_close(step(1), step(0))


class Masked(eqx.Module):
    """A layer stack given a mask made outside the step (a constant of the
    program, which JAX 0.10 passes to it as one more argument)."""

    model: Model

    def __call__(self, tokens):
        x = jax.vmap(self.model.embed)(tokens)
        mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), dtype=bool))
        x = self.model.blocks.scan(
            lambda layer, x, _: (_masked(layer, x, mask), None), x
        )[0]
        return jax.vmap(self.model.head)(x)


def _masked(layer, x, mask):
    h = jax.vmap(layer.norm1)(x)
    return x + layer.attn(h, h, h, mask=mask)


def test_a_closed_over_constant_is_an_input_of_the_scans():
    """The transform traces the loss twice (its check, then the step): each trace
    hands the scans its own values, and the report reads the program's own
    arguments (not the constants JAX passes before them)."""

    def loss(model, tokens, targets):
        logits = jax.vmap(model)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    out = {}
    for prefetch in (0, 1):
        policy = eo.Policy.offload_all(prefetch=prefetch)
        model = eo.place(Masked(Model(key=jax.random.key(4))), policy)
        opt_state = eo.init_opt_state(CLIPPED, model, policy)
        step = eo.train_step(loss, CLIPPED, policy)
        batch = next(batches())
        report = eo.memory_report(step, model, opt_state, *batch)
        assert report.host_bytes > 0
        out[prefetch] = step(model, opt_state, *batch)[2]
    np.testing.assert_allclose(float(out[1]), float(out[0]), rtol=1e-6)


def test_an_ensemble():
    """One set of layers per member: the gradient of each member (`jax.vmap` of
    the gradient) as with the plain scan; a gradient of all members at once
    (`jax.vmap` inside the differentiated function) is refused, naming
    `prefetch=0` (the prefetching scan moves a batch of examples inside the
    layer, not a batch of layers)."""
    keys = jax.random.split(jax.random.key(5), 2)
    ensemble = eqx.filter_vmap(lambda k: Model(key=k))(keys)
    tokens, targets = next(batches())
    axes = (eqx.if_array(0), None, None)

    def each(prefetch):
        fn = eo.filter_offload(
            cross_entropy, eo.Policy.offload_residuals(prefetch=prefetch)
        )
        return eqx.filter_vmap(eqx.filter_grad(fn), in_axes=axes)(
            ensemble, tokens, targets
        )

    assert_trees_close(each(1), each(0))

    fn = eo.filter_offload(cross_entropy, eo.Policy.offload_residuals(prefetch=1))

    def total(members, tokens, targets):
        return jnp.sum(eqx.filter_vmap(fn, in_axes=axes)(members, tokens, targets))

    with pytest.raises(
        ValueError, match=r"prefetch=1.*batched by `jax.vmap`.*prefetch=0"
    ):
        eqx.filter_grad(total)(ensemble, tokens, targets)


def test_nested_stacked():
    """An outer `Stacked` whose layer holds another, its parameters on the host:
    the outer scan reads each outer layer ahead (the inner stack whole), the
    inner scan runs on it on the device; gradients as plain JAX's."""

    def make(k):
        return Outer(
            eo.Stacked.from_fn(lambda k2: eqx.nn.Linear(8, 8, key=k2), 2, key=k)
        )

    outer = eo.Stacked.from_fn(make, 3, key=jax.random.key(6))
    x = jnp.ones(8)

    def loss(s, x):
        return jnp.sum(jnp.tanh(s(x)))

    reference = eqx.filter_grad(loss)(outer, x)
    for prefetch in (0, 1):
        policy = eo.Policy(
            params="pinned_host", offload=("inner.input",), prefetch=prefetch
        )
        placed = eo.place(outer, policy)
        grads = eqx.filter_jit(eqx.filter_grad(eo.filter_offload(loss, policy)))(
            placed, x
        )
        assert_trees_close(grads, reference)
        kinds = {g.sharding.memory_kind for g in jax.tree.leaves(grads)}
        assert kinds == {"pinned_host"}


def test_fsdp_and_micro_batches_are_verified():
    """FSDP over 8 devices (the loss on `Auto` axes), two micro-batches of 8
    examples: `eo.verify` against the plain step."""
    from jax.sharding import AxisType

    policy = eo.Policy.offload_all(
        shard=eo.FSDP("fsdp", min_size=0), batch="fsdp", update="whole", prefetch=1
    )
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    optimizer = optax.sgd(0.1)
    model = eo.place(Model(key=jax.random.key(7)), policy, mesh=mesh)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens, targets = next(batches(batch=32))
    step = eo.train_step(cross_entropy, optimizer, policy, microbatches=2)
    report = eo.verify(step, model, opt_state, tokens, targets, examples=16)
    assert report.passed


class _IntBlock(eqx.Module):
    block: Any
    scale: jax.Array  # an integer per layer (a window size, a layer index)

    def __call__(self, x):
        return self.block(x) * (1 + self.scale % 2)


def test_an_integer_leaf_in_the_layers():
    """A layer with an integer leaf: its slice is read with the rest, and the
    transpose of the read skips it (no gradient)."""
    from .helpers import Block

    def make(k):
        return _IntBlock(Block(16, 2, key=k), jax.random.randint(k, (), 0, 3))

    model = Model(key=jax.random.key(8))
    model = eqx.tree_at(
        lambda m: m.blocks, model, eo.Stacked.from_fn(make, 4, key=jax.random.key(9))
    )
    tokens, targets = next(batches())
    grads = {}
    for prefetch in (0, 1):
        policy = eo.Policy.offload_all(prefetch=prefetch)
        fn = eo.filter_offload(cross_entropy, policy)
        placed = eo.place(model, policy)
        grads[prefetch] = eqx.filter_jit(eqx.filter_grad(fn))(placed, tokens, targets)
    assert_trees_close(grads[1], grads[0])


class _Scaled(eqx.Module):
    """The layers close over `t` and over a batched padding mask."""

    model: Model

    def __call__(self, tokens, t):
        x = jax.vmap(self.model.embed)(tokens)
        keep = (tokens != 0)[:, None].astype(x.dtype)

        def f(layer, x, _):
            return layer(x) * keep * t, None

        return jax.vmap(self.model.head)(self.model.blocks.scan(f, x)[0])


def test_other_transformations():
    """Forward mode inside `jax.vmap` and through a closed-over value (`jax.jvp`,
    `jax.hessian`) runs the plain scan; per-example gradients (`jax.vmap` of the
    gradient, a batched mask closed over) run the prefetching one: all as with
    `prefetch=0`."""
    model = _Scaled(Model(key=jax.random.key(10)))
    tokens, targets = next(batches())
    out = {}
    for prefetch in (0, 1):
        fn = eo.filter_offload(
            lambda m, tokens, targets, t: (
                optax.softmax_cross_entropy_with_integer_labels(
                    m(tokens, t), targets
                ).mean()
            ),
            eo.Policy.offload_residuals(prefetch=prefetch),
        )
        batch = eqx.filter_vmap(fn, in_axes=(None, 0, 0, None))

        def loss(t):
            return batch(model, tokens, targets, t).mean()

        per_example = eqx.filter_vmap(eqx.filter_grad(fn), in_axes=(None, 0, 0, None))
        out[prefetch] = (
            jax.jvp(loss, (1.0,), (1.0,)),
            jax.hessian(loss)(1.0),
            per_example(model, tokens, targets, 1.0),
        )
    assert_trees_close(out[1], out[0])


def test_a_host_layer_read_outside_the_scans_is_still_refused():
    """Only the prefetching scan's own reads of a host-resident stack are slices
    the transform lets through: one the loss takes itself is the usual error."""

    def loss(model, tokens, targets):
        w = model.blocks.layers.mlp.layers[0].weight
        extra = jax.device_put(w[tokens[0, 0] % 4], jax.memory.Space.Device)
        return cross_entropy(model, tokens, targets) + jnp.sum(extra**2)

    policy = eo.Policy.offload_all(prefetch=1)
    model = eo.place(Model(key=jax.random.key(11)), policy)
    fn = eqx.filter_grad(eo.filter_offload(loss, policy))
    with pytest.raises(
        ValueError, match=r"computed on outside its scan \(by `dynamic_slice`\)"
    ):
        fn(model, *next(batches()))
