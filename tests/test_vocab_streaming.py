"""A vocabulary table streamed from the host (`Policy(host_tables=...)`): `eo.embed` and
`eo.chunked_cross_entropy` read it block by block, with the plain model's loss and
gradients, and misuse is an error that names the leaf."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqx_offload as eo

from .helpers import CountCompiles, TableLM, TanhBlock
from .numerics import assert_close, BF16_COMPUTE, excess, scaled, TRAINED


VOCAB, DIM = 256, 128  # a TPU can move row blocks of this table


def _block(dim, key) -> TanhBlock:
    return TanhBlock(jax.random.normal(key, (dim, dim)) / dim**0.5)


def _lm(key, vocab=VOCAB, dim=DIM) -> TableLM:
    """The losses below read its tables; `head` only the untied one."""
    k1, k2, k3 = jax.random.split(key, 3)
    embed = jax.random.normal(k1, (vocab, dim)) * 0.1
    blocks = eo.Stacked.from_fn(lambda k: _block(dim, k), 3, key=k2)
    return TableLM(embed, blocks, jax.random.normal(k3, (vocab, dim)) * 0.1)


def tied(model, tokens, targets):
    h, table = eo.embed(model.embed, tokens)
    return eo.chunked_cross_entropy(jax.vmap(model.blocks)(h), table, targets)


def untied(model, tokens, targets):
    h, _ = eo.embed(model.embed, tokens)
    return eo.chunked_cross_entropy(jax.vmap(model.blocks)(h), model.head, targets)


def _plain(tie):
    def loss(model, tokens, targets):
        hidden = jax.vmap(model.blocks)(model.embed[tokens])
        logits = hidden @ (model.embed if tie else model.head).T
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss


def _batch(seed=1, shape=(8, 24)):  # 8: one example per device on a mesh
    k1, k2 = jax.random.split(jax.random.key(seed))
    return (
        jax.random.randint(k1, shape, 0, VOCAB),
        jax.random.randint(k2, shape, 0, VOCAB),
    )


STEPS, LR = 3, 0.5


def _train(loss, policy, steps=STEPS, **kwargs):
    optimizer = optax.sgd(LR)
    model = eo.place(_lm(jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = CountCompiles(eo.train_step(loss, optimizer, policy, **kwargs))
    losses = []
    for _ in range(steps):
        model, opt_state, value, _ = step(model, opt_state, *_batch())
        losses.append(float(value))
    return model, losses, step


@functools.cache
def _reference(tie: bool) -> tuple[TableLM, list[float]]:
    """The plain model's SGD steps in plain Equinox + optax, with the whole
    logits: the model and the losses."""
    optimizer = optax.sgd(LR)

    @eqx.filter_jit
    def step(model, state, tokens, targets):
        loss, grads = eqx.filter_value_and_grad(_plain(tie))(model, tokens, targets)
        updates, state = optimizer.update(grads, state)
        return eqx.apply_updates(model, updates), state, loss

    model = _lm(jax.random.key(0))
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for _ in range(STEPS):
        model, state, loss = step(model, state, *_batch())
        losses.append(float(loss))
    return model, losses


def _assert_trains_like(model, losses, tie):
    """The losses and the parameters' updates of the plain model to float32
    rounding; losses 1% too large are caught (and updates 1% too large, by
    `assert_close` itself)."""
    ref, ref_losses = _reference(tie)
    assert_close(losses, ref_losses)
    assert excess(scaled(losses, 1.01), ref_losses) > 10
    start = _lm(jax.random.key(0))
    on_device = eo.place(model, eo.Policy(params="device"))
    assert_close(on_device, ref, tol=TRAINED, origin=start, steps=STEPS)


@pytest.mark.parametrize(
    "tie, stream, update, microbatches",
    [
        (True, ("embed",), "streamed", 1),
        (True, ("embed",), "auto", 2),
        (False, ("embed", "head"), "streamed", 1),
    ],
)
def test_equals_the_plain_model(tie, stream, update, microbatches):
    """SGD, 3 steps: the losses and every parameter's update equal the plain
    model's with the whole logits; the streamed tables stay on the host."""
    policy = eo.Policy.offload_all(host_tables=stream, update=update)
    model, losses, step = _train(
        tied if tie else untied, policy, microbatches=microbatches
    )
    _assert_trains_like(model, losses, tie)
    assert model.embed.sharding.memory_kind == "pinned_host"
    assert step.compiled_on == [0]


def test_bf16_compute_copy_is_what_streams():
    """With a compute dtype, the bf16 copy of a streamed table is what the step
    reads, block by block (half the bytes of the fp32 master, three times: the
    lookup, the logits, and the logits again in the backward pass), and the step
    is the same bf16 scheme by hand: the loss computed from a bf16 cast of every
    parameter, logits in fp32, the gradient applied to the fp32 master."""
    policy = eo.Policy.offload_all(host_tables=("embed",), compute_dtype=jnp.bfloat16)
    optimizer = optax.sgd(LR)
    start = _lm(jax.random.key(0))
    model = eo.place(start, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(tied, optimizer, policy)
    batch = _batch()
    report = eo.memory_report(step, model, opt_state, *batch)
    moved = sum(
        t.bytes
        for t in report.transfers or ()
        if t.name == "embed" and t.phase == "forward/backward"
    )
    assert moved == 3 * VOCAB * DIM * 2
    model, _, loss, _ = step(model, opt_state, *batch)

    def by_hand(model, tokens, targets):
        model = jax.tree.map(
            lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model
        )
        hidden = jax.vmap(model.blocks)(model.embed[tokens])
        logits = jnp.einsum(
            "...d,vd->...v", hidden, model.embed, preferred_element_type=jnp.float32
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(by_hand))(
        start, *batch
    )
    assert_close(loss, ref_loss, tol=BF16_COMPUTE)
    assert excess(scaled(loss, -1), ref_loss, tol=BF16_COMPUTE) > 10
    # One SGD step's update is `-LR` times the gradient.
    model = eo.place(model, eo.Policy(params="device"))
    grads = jax.tree.map(lambda p, p0: (p - p0) / -LR, model, start)
    assert_close(grads, ref_grads, tol=BF16_COMPUTE)
    assert excess(scaled(grads, -1), ref_grads, tol=BF16_COMPUTE) > 10


def test_embed_on_a_device_table_is_the_lookup():
    table = jax.random.normal(jax.random.key(0), (10, 4))
    tokens = jnp.array([[1, 9], [0, 3]])
    found, same = eo.embed(table, tokens)
    np.testing.assert_array_equal(found, table[tokens])
    assert same is table


def _step_error(loss, policy, match):
    optimizer = optax.sgd(0.1)
    model = eo.place(_lm(jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss, optimizer, policy)
    with pytest.raises(ValueError, match=match):
        step(model, opt_state, *_batch())


def test_misuse_names_the_leaf_and_the_fix():
    policy = eo.Policy.offload_all(host_tables=("embed",))

    def twice(model, tokens, targets):  # the tie through `model.embed` again
        h, _ = eo.embed(model.embed, tokens)
        hidden = jax.vmap(model.blocks)(h)
        return eo.chunked_cross_entropy(hidden, model.embed, targets)

    _step_error(twice, policy, r"'embed'.*two of .*pass the table `eo.embed` returns")

    def computed(model, tokens, targets):
        return tied(model, tokens, targets) + 1e-4 * jnp.sum(model.embed**2)

    _step_error(computed, policy, r"'embed'.*only `eo.embed` and")
    _step_error(
        tied, eo.Policy.offload_all(host_tables=("embedding",)), r"'embedding'.*no leaf"
    )
    _step_error(
        tied,
        eo.Policy.offload_all(host_tables=("embed",), params="device"),
        "on the device",
    )


def test_a_table_without_row_blocks_is_an_error():
    table = jnp.zeros((250, DIM))  # 250 rows: no blocks of whole 8-row tiles
    host = jax.device_put(
        table,
        jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"),
    )
    policy = eo.Policy(host_tables=("table",))
    lookup = eo.filter_offload(lambda m, ids: eo.embed(m["table"], ids)[0], policy)
    with pytest.raises(ValueError, match="pad the vocabulary"):
        eqx.filter_jit(lookup)({"table": host}, jnp.zeros((3,), jnp.int32))


class _Nested(eqx.Module):
    embed: eqx.nn.Embedding  # the table at `embed.weight`
    blocks: eo.Stacked[TanhBlock]

    def __init__(self, key, vocab, dim):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.blocks = eo.Stacked.from_fn(lambda k: _block(dim, k), 2, key=k2)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_module_pattern_names_its_table_with_micro_batches_too(microbatches):
    """`host_tables=("embed",)` covers the table of an `embed` module (`embed.weight`),
    with micro-batches too: a table whose rows make no blocks is the same error
    (with micro-batches, it was once moved to the device like an odd-shaped leaf,
    and then called misplaced)."""

    def loss(model, tokens, targets):
        h, table = eo.embed(model.embed.weight, tokens)
        return eo.chunked_cross_entropy(jax.vmap(model.blocks)(h), table, targets)

    policy = eo.Policy.offload_all(host_tables=("embed",))
    optimizer = optax.sgd(0.1)
    model = eo.place(_Nested(jax.random.key(0), 56, 16), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(loss, optimizer, policy, microbatches=microbatches)
    tokens = jnp.zeros((4, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"`embed`: the host-resident table .*pad"):
        step(model, opt_state, tokens, tokens)


NO_HOST_COMPUTE = {"xla_disable_automatic_host_compute_offload": True}


@pytest.mark.parametrize("tie, dtype", [(True, None), (False, jnp.bfloat16)])
def test_compiles_for_tpu_and_streams_the_table(tie, dtype, monkeypatch):
    """`tpu-v5e`, at an odd size (vocab 65552 = 16 x 4097, width 384: 17 blocks of
    3856 rows): the streamed loss compiles, tied or not, with a compute dtype or
    not, with no host compute (compiled with
    `xla_disable_automatic_host_compute_offload`, so any fails the compile: the
    gradient's blocks once went into the table's own buffer, which the compiler
    copied on the host first), the tables (or their compute copies) move to the
    device block by block, for the lookup, the logits, and the logits again in the
    backward pass, and the step never holds a whole table (96 MiB) on the device.
    (A table below `_tiling.PIECE_BYTES`, 32 MiB, is updated whole on the
    device.)"""
    monkeypatch.setattr(
        "eqx_offload._compiler.compile_options", lambda *_, **__: NO_HOST_COMPUTE
    )
    vocab, dim = 65552, 384
    optimizer = optax.sgd(1e-3)
    tokens = jax.ShapeDtypeStruct((3, 8), jnp.int32)
    stream = ("embed",) if tie else ("embed", "head")
    policy = eo.Policy.offload_all(host_tables=stream, compute_dtype=dtype)
    abstract = eqx.filter_eval_shape(_lm, jax.random.key(0), vocab, dim)
    model = eo.place(abstract, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(tied if tie else untied, optimizer, policy)
    report = eo.memory_report(step, model, opt_state, tokens, tokens, target="tpu-v5e")
    table = vocab * dim * 4
    for rows in (report.transfers, report.compiled_transfers):
        moved = sum(
            t.bytes
            for t in rows or ()
            if t.name in stream and t.phase == "forward/backward"
        )
        assert moved == 3 * table // (2 if dtype else 1)  # as traced, and compiled
    assert report.device_bytes < table
    assert report.time is not None and report.time.host_compute_seconds == 0
    assert report.time.compile_options == NO_HOST_COMPUTE


@pytest.mark.parametrize(
    "tie, stream, axis_type",
    [
        (True, ("embed",), "Auto"),
        (False, (), "Explicit"),
        (False, ("embed", "head"), "Explicit"),
    ],
)
def test_fsdp_over_8_devices_equals_the_plain_model(tie, stream, axis_type):
    """`Policy(shard="fsdp", batch="fsdp")` on 8 CPU devices, on `Explicit` and
    `Auto` axes: `eo.embed` and `eo.chunked_cross_entropy` (streamed or not) give
    the one-device plain model's losses and parameters; `FSDP` leaves a streamed
    table whole on every device. (A table on the device on `Auto` axes is plain
    FSDP; `Explicit` axes with it on the device compile for a slice too:
    `test_fsdp_with_a_streamed_table_compiles_for_a_slice`.)"""
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(kind,))
    with jax.set_mesh(mesh):
        policy = eo.Policy.offload_all(host_tables=stream, shard="fsdp", batch="fsdp")
        model, losses, _ = _train(tied if tie else untied, policy)
    _assert_trains_like(model, losses, tie)
    spec = model.embed.sharding.spec
    assert all(entry is None for entry in spec) == bool(stream), spec


def test_a_spec_that_splits_a_streamed_table_is_an_error():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    policy = eo.Policy.offload_all(
        host_tables=("embed",), shard={"embed": P("fsdp"), "**": "fsdp"}
    )
    with pytest.raises(ValueError, match=r"'embed' is streamed.*PartitionSpec\(\)"):
        eo.place(_lm(jax.random.key(0)), policy, mesh=mesh)


@pytest.mark.parametrize("stream", [("embed",), ()])
def test_fsdp_with_a_streamed_table_compiles_for_a_slice(stream):
    """`tpu-v5e:2x4` over `Explicit` axes at a small and odd size (vocab 272): the
    slice compiles with the table streamed (a table split over chips by rows would
    not) and with it on the device (`eo.embed` and `chunked_cross_entropy` on
    `Auto` axes inside)."""
    mesh = jax.sharding.AbstractMesh(
        (8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    policy = eo.Policy.offload_all(host_tables=stream, shard="fsdp", batch="fsdp")
    abstract = eqx.filter_eval_shape(_lm, jax.random.key(0), 272, 384)
    model = eo.place(abstract, policy, mesh=mesh)
    opt_state = eo.init_opt_state(optax.sgd(1e-3), model, policy)
    step = eo.train_step(tied, optax.sgd(1e-3), policy)
    tokens = jax.ShapeDtypeStruct((8, 8), jnp.int32)
    report = eo.memory_report(
        step, model, opt_state, tokens, tokens, target="tpu-v5e:2x4"
    )
    assert report.device_bytes > 0
    assert (model.embed.sharding.spec == P(None, None)) == bool(stream)
