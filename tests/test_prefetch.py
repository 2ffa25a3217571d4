"""`Policy(prefetch=1)`: the scans that read the next layer while this one
computes (`_prefetch.py`) train and differentiate as plain JAX does, leave
forward-mode derivatives to the plain scan, and (compiled for an H100) start every
host read of a layer before a matmul of the layer computing and end it after.

Every test that expects the prefetching scan asserts that it ran
(`prefetching_scans`): a silent fallback to the plain scan, which computes the
same numbers, fails them."""

import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload as eo
import eqx_offload.internal as eoi

from .helpers import batches, cross_entropy, memory_kind, Outer
from .numerics import assert_close, excess, TRAINED


sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from _compiles import compiles  # noqa: E402


@contextlib.contextmanager
def prefetching_scans() -> Iterator[list[bool]]:
    """One entry per prefetching scan traced inside (`_prefetch._scan`, its
    forward and backward scans together), True where it also applies a pending
    update. A `Stacked` that runs the plain scan instead adds none."""
    found: list[bool] = []
    original = eoi.prefetch_scan

    def spy(args, how):
        found.append(how.pending is not None)
        return original(args, how)

    with mock.patch("eqx_offload._prefetch._scan", spy):
        yield found


def dropped_layer(tree: Any) -> Any:
    """A negative control: `tree` (a gradient) with layer 1's slice of every
    stacked leaf zeroed (index 1 of the leading axis: of per-example gradients,
    example 1's), as if that gradient were lost. As NumPy arrays."""

    def zeroed(x: Any) -> Any:
        x = np.array(x)
        x[1] = 0
        return x

    def drop(stacked: eo.Stacked) -> eo.Stacked:
        return jax.tree.map(zeroed, stacked)

    is_stacked = lambda x: isinstance(x, eo.Stacked)  # noqa: E731
    return jax.tree.map(
        lambda x: drop(x) if is_stacked(x) else x, tree, is_leaf=is_stacked
    )


def assert_grads_close(ours: Any, reference: Any) -> None:
    """Gradients (and losses) computed in another order (`F32`), with a negative
    control: layer 1's gradient lost is more than ten times beyond."""
    assert_close(ours, reference)
    assert excess(dropped_layer(ours), reference) > 10


def _kinds(tree: Any) -> list[str]:
    return [memory_kind(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


VOCAB, DIM, DEPTH = 32, 8, 3


class Layer(eqx.Module):
    """A residual layer of two named parts (`Policy(save=("**.attn",))` names the
    first's output): `attn`, mixing the tokens under a `mask` if given, and
    `mlp`."""

    attn: eqx.nn.Linear
    mlp: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.attn = eqx.nn.Linear(DIM, DIM, key=k1)
        self.mlp = eqx.nn.Linear(DIM, DIM, key=k2)

    def __call__(self, x, mask=None):
        h = jax.vmap(self.attn)(x)
        if mask is not None:
            h = mask @ h / mask.shape[0]
        x = x + jnp.tanh(h)
        return x + jnp.tanh(jax.vmap(self.mlp)(x))


class Net(eqx.Module):
    """`Layer`s between bare tables: `blocks(embed[tokens]) @ head.T`."""

    embed: jax.Array
    blocks: eo.Stacked[Layer]
    head: jax.Array

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = jax.random.normal(k1, (VOCAB, DIM))
        self.blocks = eo.Stacked.from_fn(lambda k: Layer(key=k), DEPTH, key=k2)
        self.head = jax.random.normal(k3, (VOCAB, DIM)) / DIM**0.5

    def __call__(self, tokens):
        return self.blocks(self.embed[tokens]) @ self.head.T


# Made in one compiled program, not an operation at a time.
net = eqx.filter_jit(Net)


LR, STEPS = 0.05, 3
SGD = optax.sgd(LR, momentum=0.9)


def model() -> Net:
    return net(jax.random.key(0))


@functools.cache
def plain_training() -> tuple[Any, list[float]]:
    """Plain Equinox and optax (the `Stacked`'s own `jax.lax.scan`), once."""
    plain = model()
    opt_state = SGD.init(eqx.filter(plain, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, tokens, targets):
        loss, grads = eqx.filter_value_and_grad(cross_entropy)(model, tokens, targets)
        updates, opt_state = SGD.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    data = batches(batch=4)
    losses = []
    for _ in range(STEPS):
        plain, opt_state, loss = step(plain, opt_state, *next(data))
        losses.append(float(loss))
    return plain, losses


POLICIES = {
    # Host parameters read ahead; the offloaded layer inputs read back ahead.
    "offload_all": eo.Policy.offload_all(prefetch=1),
    # Device parameters; only the offloaded layer inputs to read ahead.
    "offload_residuals": eo.Policy.offload_residuals(prefetch=1),
    # Host parameters; the saved residuals (the attention's output) on the device.
    "host params, attn saved": eo.Policy.remat(
        params="pinned_host", save=("**.attn",), prefetch=1
    ),
}


@pytest.mark.parametrize("name", POLICIES)
def test_trains_as_the_plain_scan(name):
    """Momentum SGD steps through the prefetching scans: every loss, and the
    updates of every leaf, those of plain Equinox + optax (`TRAINED`, with its
    negative control of an update 1% too large); the model where the policy put
    it."""
    policy = POLICIES[name]
    start = eo.place(model(), policy)
    kinds = _kinds(start)
    opt_state = eo.init_opt_state(SGD, start, policy)
    step = eo.train_step(cross_entropy, SGD, policy)
    data = batches(batch=4)
    ours, losses = start, []
    with prefetching_scans() as scans:
        for _ in range(STEPS):
            ours, opt_state, loss, _ = step(ours, opt_state, *next(data))
            losses.append(float(loss))
    assert scans, "the plain scan ran"
    reference, plain_losses = plain_training()
    assert_close(losses, plain_losses)
    assert_close(ours, reference, tol=TRAINED, origin=model(), steps=STEPS)
    assert _kinds(ours) == kinds


class _IntBlock(eqx.Module):
    block: Any
    scale: jax.Array  # an integer per layer (a window size, a layer index)

    def __call__(self, x):
        return self.block(x) * (1 + self.scale % 2)


def test_gradients_land_where_the_parameters_live():
    """`offload_all`: the gradient of each host-resident leaf comes out of the
    prefetching backward scan in host memory, as plain JAX's values. The layers
    hold an integer leaf: its slice is read with the rest, and the transpose of
    the read skips it (no gradient)."""

    def make(k):
        return _IntBlock(Layer(key=k), jax.random.randint(k, (), 0, 3))

    plain = eqx.tree_at(
        lambda m: m.blocks,
        net(jax.random.key(8)),
        eqx.filter_jit(eo.Stacked.from_fn)(make, DEPTH, key=jax.random.key(9)),
    )
    tokens, targets = next(batches())
    reference = eqx.filter_jit(eqx.filter_value_and_grad(cross_entropy))(
        plain, tokens, targets
    )
    policy = eo.Policy.offload_all(prefetch=1)
    placed = eo.place(plain, policy)
    fn = eqx.filter_jit(
        eqx.filter_value_and_grad(eo.filter_offload(cross_entropy, policy))
    )
    with prefetching_scans() as scans:
        loss, grads = fn(placed, tokens, targets)
    assert scans, "the plain scan ran"
    assert_grads_close((loss, grads), reference)
    assert _kinds(grads) == _kinds(eqx.filter(placed, eqx.is_inexact_array))
    assert set(_kinds(grads)) == {"pinned_host"}


def test_bad_prefetch_is_named():
    with pytest.raises(ValueError, match="prefetch=2"):
        eo.Policy(prefetch=2)
    with pytest.raises(ValueError, match="prefetch=True"):
        eo.Policy(prefetch=True)


# The async host copies XLA:GPU lets in flight at once (its default is 2): with the
# default, a layer's six reads queue behind each other (`docs/step-time.md`).
GPU_OPTIONS = {"xla_gpu_experimental_parallel_async_compute_limit": 16}


class _TwoMatmuls(eqx.Module):
    """A residual layer of two bare matrices: `x + tanh(tanh(x @ w1) @ w2)`."""

    w1: jax.Array
    w2: jax.Array

    def __call__(self, x):
        return x + jnp.tanh(jnp.tanh(x @ self.w1) @ self.w2)


class _BareLM(eqx.Module):
    """`_TwoMatmuls` layers between bare tables: `blocks(embed[tokens]) @ head.T`.
    No LayerNorm, no bias: few kernels, quick to compile for a GPU."""

    embed: jax.Array
    blocks: eo.Stacked[_TwoMatmuls]
    head: jax.Array

    def __call__(self, tokens):
        return self.blocks(self.embed[tokens]) @ self.head.T


def _gpu_loop_orders(width: int, depth: int, policy: eo.Policy) -> dict[str, str]:
    """The Adam step of a bfloat16 `_BareLM` (vocabulary 256, `depth` layers of
    `width`) under `policy`, compiled for an H100 with `GPU_OPTIONS`: the order of
    each loop body with a host read (`prefetch_schedule`'s letters)."""

    def make(key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        normal = functools.partial(jax.random.normal, dtype=jnp.bfloat16)
        layers = _TwoMatmuls(
            normal(k2, (depth, width, width)), normal(k3, (depth, width, width))
        )
        return _BareLM(
            normal(k1, (256, width)), eo.Stacked(layers), normal(k4, (256, width))
        )

    model = eo.place(eqx.filter_eval_shape(make, jax.random.key(0)), policy)
    optimizer = optax.adam(1e-3)
    opt_state = eo.init_opt_state(optimizer, model, policy)

    def loss(model, tokens, targets):
        logits = jax.vmap(model)(tokens).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    step = eo.train_step(loss, optimizer, policy)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    with compiles(GPU_OPTIONS) as texts:
        eo.memory_report(step, model, opt_state, tokens, tokens, target="gpu-h100")
    module = eoi.parse_hlo(texts[-1])
    from prefetch_schedule import loop_schedules, order

    orders = {name: order(e) for name, e in loop_schedules(module).items()}
    return {k: o for k, o in orders.items() if "S" in o}


def test_every_layer_read_overlaps_a_matmul_on_gpu():
    """The `offload_all` Adam step of a 3-layer model of width 128 (two matmuls a
    layer) with `prefetch=1` and `update_timing="next_forward"`, compiled for an
    H100 with `GPU_OPTIONS`: in each loop body, every host read (`S` ... `D`) has
    a matmul (`g`) between its start and its done. The forward body reads the
    next layer's weights, gradients and optimizer state (and writes this layer's
    update back); the backward body reads the previous layer. (A model with
    LayerNorms and biases, the `gpt` of `benchmarks/prefetch_schedule.py`, is
    scheduled the same way and takes twice as long to compile.) Under
    `next_forward` the scan that applies the pending update prefetches whatever
    `prefetch` says: the plain scan's control is the test below."""
    policy = eo.Policy.offload_all(prefetch=1, update_timing="next_forward")
    with prefetching_scans() as scans:
        orders = _gpu_loop_orders(128, 3, policy)
    assert scans and any(scans), "the plain scan ran"
    bodies = {k: o for k, o in orders.items() if "g" in o}
    assert len(bodies) == 2, orders  # the forward and backward scans
    forward = [o for o in bodies.values() if o.count("s") > 3]
    assert len(forward) == 1, bodies  # the forward scan writes the update back
    # Two weights, their gradients and their two moments: at least 8 reads.
    assert forward[0].count("S") >= 8, forward
    for name, order in bodies.items():
        assert _exposed_reads(order) == 0, (name, order)


def test_on_gpu_prefetching_hides_the_reads_the_plain_scan_exposes():
    """The same model's `offload_all` step with the update now, compiled for an
    H100 with `GPU_OPTIONS`: with `prefetch=1` the prefetching scans run and every
    host read in the forward and backward bodies has a matmul between its start
    and its done; with `prefetch=0` (the plain scan, the negative control) a read
    in each body waits with nothing to hide it."""
    exposed = {}
    for prefetch in (1, 0):
        with prefetching_scans() as scans:
            orders = _gpu_loop_orders(128, 3, eo.Policy.offload_all(prefetch=prefetch))
        assert bool(scans) == bool(prefetch), "the other scan ran"
        bodies = {k: o for k, o in orders.items() if "g" in o}
        assert len(bodies) == 2, orders  # the forward and backward scans
        exposed[prefetch] = {k: _exposed_reads(o) for k, o in bodies.items()}
    assert all(n == 0 for n in exposed[1].values()), exposed
    assert all(n > 0 for n in exposed[0].values()), exposed


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


def test_exposed_reads_are_counted():
    assert _exposed_reads("SSggDD") == 0
    assert _exposed_reads("SDSgD") == 1
    assert _exposed_reads("ggSSDSgDD") == 1


class PerToken(eqx.Module):
    """A `Stacked` applied to each token on its own, inside the model's `jax.vmap`
    over examples: two `jax.vmap`s around the scans."""

    model: Net

    def __call__(self, tokens):
        x = self.model.embed[tokens]
        x = jax.vmap(lambda t: self.model.blocks.scan(_mlp_only, t)[0])(x)
        return x @ self.model.head.T


def _mlp_only(layer, x, _):
    return x + jnp.tanh(layer.mlp(x)), None


def test_nested_vmaps_and_micro_batches():
    """Each `jax.vmap` moves inside the layer: a gradient tap that adds its
    accumulator (the second micro-batch) adds it once, not once per example.
    One SGD step from two micro-batches: the update of plain JAX's gradient of
    the whole batch."""

    def loss(model, tokens, targets):
        logits = jax.vmap(model)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    sgd = optax.sgd(1.0)
    start = PerToken(net(jax.random.key(3)))
    tokens, targets = next(batches(batch=16))
    grads = eqx.filter_jit(eqx.filter_grad(loss))(start, tokens, targets)
    reference = eqx.apply_updates(start, jax.tree.map(jnp.negative, grads))

    policy = eo.Policy.offload_all(prefetch=1)
    placed = eo.place(start, policy)
    opt_state = eo.init_opt_state(sgd, placed, policy)
    train = eo.train_step(loss, sgd, policy, microbatches=2)
    with prefetching_scans() as scans:
        ours = train(placed, opt_state, tokens, targets)[0]
    assert scans, "the plain scan ran"
    assert_close(ours, reference, tol=TRAINED, origin=start)


class Masked(eqx.Module):
    """A layer stack given a mask made outside the step (a constant of the
    program, which JAX 0.10 passes to it as one more argument)."""

    model: Net
    masked: bool = True

    def __call__(self, tokens):
        x = self.model.embed[tokens]
        mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0])))
        if not self.masked:
            mask = jnp.ones_like(mask)
        x = self.model.blocks.scan(lambda layer, x, _: (layer(x, mask), None), x)[0]
        return x @ self.model.head.T


def test_a_closed_over_constant_is_an_input_of_the_scans():
    """The transform traces the loss twice (its check, then the step): each trace
    hands the scans its own values, and the report reads the program's own
    arguments (not the constants JAX passes before them). The step's loss is
    plain JAX's; negative control: the loss without the mask is not."""

    def loss(model, tokens, targets):
        logits = jax.vmap(model)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    policy = eo.Policy.offload_all(prefetch=1)
    start = Masked(net(jax.random.key(4)))
    model = eo.place(start, policy)
    opt_state = eo.init_opt_state(SGD, model, policy)
    step = eo.train_step(loss, SGD, policy)
    batch = next(batches())
    with prefetching_scans() as scans:
        report = eo.memory_report(step, model, opt_state, *batch)
        assert report.host_bytes > 0
        value = step(model, opt_state, *batch)[2]
    assert len(scans) >= 2, "the plain scan ran"  # (the report's and the step's)
    reference = eqx.filter_jit(loss)(start, *batch)
    assert_close(value, reference)
    unmasked = eqx.filter_jit(loss)(Masked(start.model, masked=False), *batch)
    assert excess(value, unmasked) > 10


def test_an_ensemble():
    """One set of layers per member: the gradient of each member (`jax.vmap` of
    the gradient) as plain JAX's; a gradient of all members at once (`jax.vmap`
    inside the differentiated function) is refused, naming `prefetch=0` (the
    prefetching scan moves a batch of examples inside the layer, not a batch of
    layers)."""
    keys = jax.random.split(jax.random.key(5), 2)
    ensemble = eqx.filter_jit(eqx.filter_vmap(Net))(keys)
    tokens, targets = next(batches())
    axes = (eqx.if_array(0), None, None)
    fn = eo.filter_offload(cross_entropy, eo.Policy.offload_residuals(prefetch=1))

    def each(fn):
        return eqx.filter_jit(eqx.filter_vmap(eqx.filter_grad(fn), in_axes=axes))(
            ensemble, tokens, targets
        )

    with prefetching_scans() as scans:
        ours = each(fn)
    assert scans, "the plain scan ran"
    reference = each(cross_entropy)
    assert_close(ours, reference)
    # Negative control: one member's layer 1 gradient lost.
    weight = ours.blocks.layers.mlp.weight
    lost = eqx.tree_at(
        lambda g: g.blocks.layers.mlp.weight, ours, weight.at[0, 1].set(0)
    )
    assert excess(lost, reference) > 10

    def total(members, tokens, targets):
        return jnp.sum(eqx.filter_vmap(fn, in_axes=axes)(members, tokens, targets))

    with pytest.raises(
        ValueError, match=r"prefetch=1.*batched by `jax.vmap`.*prefetch=0"
    ):
        eqx.filter_grad(total)(ensemble, tokens, targets)


def test_nested_stacked():
    """An outer `Stacked` whose layer holds another, its parameters on the host:
    the outer scan reads each outer layer ahead (the inner stack whole), the
    inner scan runs on it on the device; gradients as plain JAX's, in host
    memory."""

    def make(k):
        return Outer(
            eo.Stacked.from_fn(lambda k2: eqx.nn.Linear(8, 8, key=k2), 2, key=k)
        )

    outer = eqx.filter_jit(eo.Stacked.from_fn)(make, 3, key=jax.random.key(6))
    x = jnp.ones(8)

    def loss(s, x):
        return jnp.sum(jnp.tanh(s(x)))

    reference = eqx.filter_jit(eqx.filter_grad(loss))(outer, x)
    policy = eo.Policy(params="pinned_host", offload=("inner.input",), prefetch=1)
    placed = eo.place(outer, policy)
    fn = eqx.filter_jit(eqx.filter_grad(eo.filter_offload(loss, policy)))
    with prefetching_scans() as scans:
        grads = fn(placed, x)
    assert scans, "the plain scan ran"
    assert_grads_close(grads, reference)
    assert set(_kinds(grads)) == {"pinned_host"}


def test_fsdp_and_micro_batches_are_verified():
    """FSDP over 2 devices (the loss on `Auto` axes), two micro-batches of 2
    examples and a bfloat16 compute dtype (the compute copies read ahead, through
    the micro-batches' gradient taps): `eo.verify` against the plain step."""
    from jax.sharding import AxisType

    policy = eo.Policy.offload_all(
        shard=eo.FSDP("fsdp", min_size=0),
        batch="fsdp",
        update="whole",
        compute_dtype=jnp.bfloat16,
        prefetch=1,
    )
    mesh = jax.make_mesh(
        (2,), ("fsdp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )
    optimizer = optax.sgd(0.1)
    model = eo.place(net(jax.random.key(7)), policy, mesh=mesh)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens, targets = next(batches(batch=8))
    step = eo.train_step(cross_entropy, optimizer, policy, microbatches=2)
    with prefetching_scans() as scans:
        report = eo.verify(step, model, opt_state, tokens, targets, examples=4)
    assert scans, "the plain scan ran"
    assert report.passed


class _Scaled(eqx.Module):
    """The layers close over `t` and over a batched padding mask."""

    model: Net

    def __call__(self, tokens, t):
        x = self.model.embed[tokens]
        keep = (tokens != 0)[:, None].astype(x.dtype)

        def f(layer, x, _):
            return layer(x) * keep * t, None

        return self.model.blocks.scan(f, x)[0] @ self.model.head.T


def test_other_transformations():
    """Forward mode (`jax.jvp` with respect to the layers, and inside `jax.vmap`
    through a closed-over value; `jax.hessian`) runs the plain scan: a
    `custom_vjp` has no forward-mode rule. Per-example gradients (`jax.vmap` of
    the gradient, a batched mask closed over) run the prefetching one. All as
    plain JAX's."""
    model = _Scaled(net(jax.random.key(10)))
    tokens, targets = next(batches())
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tangent = jax.tree.map(jnp.ones_like, params)

    def example_loss(m, tokens, targets, t):
        logits = m(tokens, t)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def derivatives(fn):
        batch = eqx.filter_vmap(fn, in_axes=(None, 0, 0, None))

        def loss(t):
            return batch(model, tokens, targets, t).mean()

        def of_params(p):
            return batch(eqx.combine(p, static), tokens, targets, 1.0).mean()

        return (
            jax.jvp(of_params, (params,), (tangent,)),
            jax.jvp(loss, (1.0,), (1.0,)),
            jax.hessian(loss)(1.0),
        )

    def per_example(fn):
        grad = eqx.filter_vmap(eqx.filter_grad(fn), in_axes=(None, 0, 0, None))
        return eqx.filter_jit(grad)(model, tokens, targets, 1.0)

    fn = eo.filter_offload(example_loss, eo.Policy.offload_residuals(prefetch=1))
    with prefetching_scans() as scans:
        forward = eqx.filter_jit(derivatives)(fn)
    assert not scans, "forward mode ran a prefetching scan"
    with prefetching_scans() as scans:
        grads = per_example(fn)
    assert scans, "the plain scan ran"
    expected = eqx.filter_jit(derivatives)(example_loss)
    assert_close(forward, expected)
    assert excess(jax.tree.map(jnp.negative, forward), expected) > 10
    reference = per_example(example_loss)
    assert_grads_close(grads, reference)


def test_a_host_layer_read_outside_the_scans_is_still_refused():
    """Only the prefetching scan's own reads of a host-resident stack are slices
    the transform lets through: one the loss takes itself is the usual error."""

    def loss(model, tokens, targets):
        w = model.blocks.layers.mlp.weight
        extra = jax.device_put(w[tokens[0, 0] % 4], jax.memory.Space.Device)
        return cross_entropy(model, tokens, targets) + jnp.sum(extra**2)

    policy = eo.Policy.offload_all(prefetch=1)
    model = eo.place(net(jax.random.key(11)), policy)
    fn = eqx.filter_grad(eo.filter_offload(loss, policy))
    with pytest.raises(
        ValueError, match=r"computed on outside its scan \(by `dynamic_slice`\)"
    ):
        fn(model, *next(batches()))
