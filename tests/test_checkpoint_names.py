"""`eo.checkpoint_names` lists the names a policy can select, with the bytes
`memory_report` counts for each."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload as eo
from eqx_offload.internal import saved_for_backward

from .helpers import Block, cross_entropy, Model


def _batch():
    tokens = jnp.arange(16).reshape(2, 8) % 32
    return tokens, (tokens + 1) % 32


def test_names_and_bytes_match_memory_report(getkey):
    model = Model(key=getkey())  # most tests' shapes: in a full run, built before
    x, y = _batch()
    rows = eo.checkpoint_names(cross_entropy, model, x, y)
    names = [r.name for r in rows]
    assert names[0] == "blocks.input"
    assert len(set(names)) == len(names)
    residual = [r for r in rows if r.residual]
    assert residual and all(r.bytes > 0 for r in residual)
    assert all(r.bytes == 0 for r in rows if not r.residual)
    for row in residual:
        # What `memory_report` of the policy saving it counts (its residual rows
        # come from this trace; one compiled report checks it is that trace's).
        loss = eo.filter_offload(cross_entropy, eo.Policy.remat(save=(row.name,)))
        saved = {r.name: r.bytes for r in saved_for_backward(loss, model, x, y).rows}
        assert saved[row.name] == row.bytes, row.name
    report = eo.memory_report(loss, model, x, y)
    assert report.residuals is not None
    assert {r.name: r.bytes for r in report.residuals}[residual[-1].name] == (
        residual[-1].bytes
    )
    for row in rows:
        if not row.residual:
            loss = eo.filter_offload(cross_entropy, eo.Policy.remat(save=(row.name,)))
            with pytest.raises(ValueError, match="not saved for the backward pass"):
                eqx.filter_make_jaxpr(eqx.filter_grad(loss))(model, x, y)


def test_no_stacked_is_an_error(getkey):
    block = Block(16, 2, key=getkey())
    x = jnp.ones((8, 16))
    with pytest.raises(ValueError, match=r"hold no `Stacked`"):
        eo.checkpoint_names(lambda m, x: jnp.sum(m(x)), block, x)
    with pytest.raises(TypeError, match="needs `fn`'s arguments"):
        eo.checkpoint_names(cross_entropy)


class _Small(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: eo.Stacked[eqx.nn.MLP]

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(32, 8, key=k1)
        self.blocks = eo.Stacked.from_fn(
            lambda k: eqx.nn.MLP(8, 8, 16, 1, key=k), 2, key=k2
        )

    def __call__(self, tokens):
        return self.embed.weight @ self.blocks(self.embed(tokens))


def _small_loss(model, tokens, targets):
    logits = jax.vmap(jax.vmap(model))(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.fixture(scope="module")
def small():
    """`_Small`, a batch, and its names as `_small_loss` offers them."""
    model = _Small(jax.random.key(0))
    x, y = _batch()
    return model, x, y, eo.checkpoint_names(_small_loss, model, x, y)


def test_abstract_arguments_and_wrapped_functions(small):
    model, _, _, concrete = small
    abstract = eqx.filter_eval_shape(lambda: model)
    x = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    assert eo.checkpoint_names(_small_loss, abstract, x, x) == concrete
    wrapped = eo.filter_offload(_small_loss, eo.Policy.offload_residuals())
    assert eo.checkpoint_names(wrapped, abstract, x, x) == concrete


def test_a_train_step_is_read_as_it_calls_its_loss(small):
    model, x, y, plain = small
    assert [r.name for r in plain if r.residual] == ["blocks.input", "blocks.layers[0]"]
    optimizer = optax.sgd(0.1)
    policy = eo.Policy.remat()
    step = eo.train_step(_small_loss, optimizer, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    assert eo.checkpoint_names(step, model, opt_state, x, y) == plain
    # In bf16, in two micro-batches: a quarter of the bytes.
    policy = eo.Policy.offload_all(compute_dtype=jnp.bfloat16)
    host = eo.place(model, policy)
    step = eo.train_step(_small_loss, optimizer, policy, microbatches=2)
    rows = eo.checkpoint_names(
        step, host, eo.init_opt_state(optimizer, host, policy), x, y
    )
    assert [(r.name, r.residual) for r in rows] == [(r.name, r.residual) for r in plain]
    assert [r.bytes for r in rows] == [r.bytes // 4 for r in plain]
    with pytest.raises(TypeError, match=r"checkpoint_names\(step, model, opt_state"):
        eo.checkpoint_names(step, host)
