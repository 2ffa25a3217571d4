"""`chunked_cross_entropy`: the plain loss and its gradients, without the whole
logits."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload as eo

from .numerics import assert_close, BF16, excess, scaled


def _plain(hidden, weight, targets, mask=None):
    logits = hidden.astype(jnp.float32) @ weight.astype(jnp.float32).T
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    w = jnp.ones_like(losses) if mask is None else mask.astype(jnp.float32)
    return jnp.sum(losses * w) / jnp.sum(w)


@pytest.mark.parametrize("chunk, masked", [(16, True), (7, False), (1000, True)])
def test_equals_the_plain_loss_and_its_gradients(getkey, chunk, masked):
    hidden = jax.random.normal(getkey(), (3, 37, 24))
    weight = jax.random.normal(getkey(), (101, 24)) / 5
    targets = jax.random.randint(getkey(), (3, 37), 0, 101)
    mask = jax.random.bernoulli(getkey(), 0.7, (3, 37)) if masked else None

    def chunked(h, w):
        return eo.chunked_cross_entropy(h, w, targets, mask=mask, chunk=chunk)

    def plain(h, w):
        return _plain(h, w, targets, mask)

    value, grads = jax.jit(jax.value_and_grad(chunked, (0, 1)))(hidden, weight)
    ref, ref_grads = jax.jit(jax.value_and_grad(plain, (0, 1)))(hidden, weight)
    assert_close((value, grads), (ref, ref_grads))
    # A loss or a gradient 1% too large is caught.
    for i in range(3):
        wrong = [value, *grads]
        wrong[i] = scaled(wrong[i], 1.01)
        assert excess(wrong, [ref, *ref_grads]) > 10


def test_bf16_inputs_within_bf16_rounding(getkey):
    """bf16 hidden states and weight: logits in fp32, gradients rounded to bf16
    (relative error about 2^-8)."""
    hidden = jax.random.normal(getkey(), (64, 32)).astype(jnp.bfloat16)
    weight = (jax.random.normal(getkey(), (50, 32)) / 5).astype(jnp.bfloat16)
    targets = jax.random.randint(getkey(), (64,), 0, 50)
    fn = jax.value_and_grad(
        lambda h, w: eo.chunked_cross_entropy(h, w, targets, chunk=16), (0, 1)
    )
    value, grads = jax.jit(fn)(hidden, weight)
    plain = jax.value_and_grad(lambda h, w: _plain(h, w, targets), (0, 1))
    ref, ref_grads = jax.jit(plain)(
        hidden.astype(jnp.float32), weight.astype(jnp.float32)
    )
    assert grads[0].dtype == grads[1].dtype == jnp.bfloat16
    assert_close(value, ref)
    assert excess(scaled(value, 1.01), ref) > 10
    # The fp32 gradients, rounded to bf16 once.
    assert_close(grads, ref_grads, tol=BF16)
    assert excess(scaled(grads, 1.1), ref_grads, tol=BF16) > 10  # 10% too large


def test_bad_arguments_name_the_fix(getkey):
    """Without a runtime type checker these are our `ValueError`s; with one (as
    in these tests) the jaxtyping annotations may catch them first."""
    hidden = jnp.zeros((4, 8))
    targets = jnp.zeros((4,), jnp.int32)
    with pytest.raises((ValueError, TypeError), match="weight"):
        eo.chunked_cross_entropy(hidden, jnp.zeros((8, 10)), targets)
    with pytest.raises((ValueError, TypeError), match="targets"):
        eo.chunked_cross_entropy(hidden, jnp.zeros((10, 8)), targets[:3])
    with pytest.raises((ValueError, TypeError), match="targets"):
        eo.chunked_cross_entropy(hidden, jnp.zeros((10, 8)), targets.astype(float))
    with pytest.raises(ValueError, match="positive int"):
        eo.chunked_cross_entropy(hidden, jnp.zeros((10, 8)), targets, chunk=0)


class _LM(eqx.Module):
    embed: jax.Array
    blocks: eo.Stacked[eqx.nn.Linear]

    def __init__(self, vocab, dim, key):
        k1, k2 = jax.random.split(key)
        self.embed = jax.random.normal(k1, (vocab, dim)) * 0.02
        self.blocks = eo.Stacked.from_fn(
            lambda k: eqx.nn.Linear(dim, dim, key=k), 2, key=k2
        )

    def hidden(self, tokens):
        return jax.vmap(lambda t: self.blocks(self.embed[t]))(tokens)


@pytest.mark.parametrize("dim", [72])
def test_saves_the_logits_on_tpu(dim):
    """`offload_all` on `tpu-v5e`, at small and odd widths: the chunked loss
    compiles and needs less device memory than the plain one. (How much less:
    `benchmarks/llama.py`; here 42% of the logits' bytes, with an optimizer that
    has state: without any, neither step's peak holds the whole logits.)"""
    vocab, batch, seq = 2048, 2, 128
    optimizer = optax.sgd(1e-3, momentum=0.9)
    policy = eo.Policy.offload_all()
    model = eo.place(eqx.filter_eval_shape(_LM, vocab, dim, jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    def plain(model, tokens, targets):
        hidden = jax.vmap(model.hidden)(tokens)
        logits = hidden @ model.embed.T
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def chunked(model, tokens, targets):
        hidden = jax.vmap(model.hidden)(tokens)
        return eo.chunked_cross_entropy(hidden, model.embed, targets, chunk=128)

    device = {}
    for name, fn in (("plain", plain), ("chunked", chunked)):
        step = eo.train_step(fn, optimizer, policy)
        report = eo.memory_report(
            step, model, opt_state, tokens, tokens, target="tpu-v5e"
        )
        device[name] = report.device_bytes
    logits = batch * seq * vocab * 4
    assert device["plain"] - device["chunked"] >= 0.1 * logits
