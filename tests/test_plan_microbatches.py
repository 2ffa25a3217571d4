"""`eo.plan(..., microbatches="search")`: the batch given is the batch per update,
and each placement takes the fewest micro-batches that fit, found by compiling;
the printed plan says the micro-batches and the examples and tokens of each; the
placement of compute copies on the device and the rest on the host is a
candidate; and a step too big for the device is told what takes its memory."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload as eo
import eqx_offload.internal as eoi


KEY = jax.random.key(0)
OPTIMIZER = optax.adam(1e-3)
# 512 examples of 32 tokens: micro-batch counts 1, 2, 4, ..., 512 (ten divisors).
TOKENS = jax.ShapeDtypeStruct((512, 32), jnp.int32)


class _Net(eqx.Module):
    """Two residual `[32, 32]` layers in a `Stacked`: its step's device memory is
    mostly what a micro-batch computes, which falls with the count."""

    blocks: eo.Stacked[eqx.nn.Linear]

    def __init__(self, *, key):
        self.blocks = eo.Stacked.from_fn(
            lambda k: eqx.nn.Linear(32, 32, key=k), 2, key=key
        )

    def __call__(self, x):
        return self.blocks.scan(lambda layer, h, _: (h + jnp.tanh(layer(h)), None), x)[
            0
        ]


def _loss(model, tokens, targets):
    x = tokens.astype(jnp.float32)
    return jnp.mean((jax.vmap(model)(x) - targets) ** 2)


def _device_bytes(k: int) -> int:
    policy = eo.Policy.none()
    model = eo.place(eqx.filter_eval_shape(_Net, key=KEY), policy)
    state = eo.init_opt_state(OPTIMIZER, model, policy)
    step = eo.train_step(_loss, OPTIMIZER, policy, microbatches=k)
    targets = jax.ShapeDtypeStruct(TOKENS.shape, jnp.float32)
    return eo.memory_report(step, model, state, TOKENS, targets).device_bytes


def test_the_search_takes_the_fewest_micro_batches_that_fit(capsys):
    """A device budget that one and two micro-batches exceed and four meet: the
    plan is four, found by compiling four of the ten counts (1, 32, 4, 2: the
    first, then bisected), not every one; the other counts compiled are probes,
    never the plan, though more micro-batches take less memory; the printed plan
    says the micro-batches, examples and tokens; its step has four."""
    budget = 560_000
    targets = jax.ShapeDtypeStruct(TOKENS.shape, jnp.float32)
    p = eo.plan(
        _loss,
        OPTIMIZER,
        eqx.filter_eval_shape(_Net, key=KEY),
        TOKENS,
        targets,
        device_budget=budget,
        host_budget="1GiB",
        microbatches="search",
    )
    rows = {r.microbatches: r for r in p.table.rows}
    assert sorted(rows) == [1, 2, 4, 32] and p.compiled == 4
    assert (rows[1].fits, rows[2].fits, rows[4].fits, rows[32].fits) == (
        False,
        False,
        True,
        True,
    )
    assert (rows[4].device_bytes or 0) <= budget < (rows[2].device_bytes or 0)
    assert (rows[32].device_bytes or 0) < (rows[4].device_bytes or 0)
    assert rows[4].status == "chosen" and rows[32].status == "micro-batch probe"
    assert p.microbatches == 4 and p.train_step().microbatches == 4
    assert (p.examples, p.sequence) == (512, 32)
    assert (p.tokens_per_update, p.tokens_per_microbatch) == (16384, 4096)
    print(p)
    printed = capsys.readouterr().out
    assert (
        "Per update: 512 examples (16,384 tokens), in 4 micro-batches of 128 "
        "examples (4,096 tokens)." in printed
    )
    assert "micro-batch probe fits" in printed
    # The same figures as `memory_report` of the step at that count.
    assert rows[4].device_bytes == _device_bytes(4)


def test_the_counts_searched_divide_the_batch_over_the_devices():
    """The counts that split every leading size of the batch, over the devices;
    a batch with a scalar argument is not split."""
    batch = (jax.ShapeDtypeStruct((24, 3), jnp.int32), jnp.zeros((36,)))
    assert eoi.searched_counts(batch, 1) == (1, 2, 3, 4, 6, 12)
    assert eoi.searched_counts(batch, 4) == (1, 3)
    assert eoi.searched_counts(batch + (jnp.zeros(()),), 1) == (1,)
    with pytest.raises(ValueError, match=r"Offer e.g. `\(1, 2, 4\)`, or `\"search\"`"):
        eo.plan(
            _loss,
            OPTIMIZER,
            eqx.filter_eval_shape(_Net, key=KEY),
            TOKENS,
            TOKENS,
            device_budget="1GiB",
            host_budget="1GiB",
            microbatches=(),
        )


def test_compute_copies_on_the_device_and_the_rest_on_the_host_is_a_candidate():
    """Whenever a compute dtype is offered, the presets are followed by the
    placement of the issue: every parameter and its optimizer state on the host,
    the compute copies on the device, every name recomputed; in the micro-batches
    the search is at. Without a compute dtype there are no copies to keep."""
    fields, names = ("embed", "blocks", "head"), ("blocks.input",)
    slots = tuple(eoi.Part(f, slot=s) for s in ("mu", "nu") for f in fields)
    plain, bf16 = eoi.Settings(microbatches=2), eoi.Settings(compute_dtype="bfloat16")
    base = eoi.Candidate.start(fields, slots, plain, copied=fields)
    labelled = eoi.presets(base, names, [plain, bf16])
    assert len(labelled) == 4 and len(eoi.presets(base, names, [plain])) == 3
    label, kept = labelled[-1]
    assert label.startswith("compute copies on device, the rest on host")
    assert kept.settings == bf16._replace(microbatches=2)
    policy = kept.policy()
    asked = eo.Policy.remat(
        params="pinned_host",
        opt_state={"**": "pinned_host", "copies:**": "device"},
        compute_dtype=jnp.bfloat16,
    )
    assert policy.save == asked.save == () and policy.offload == ()
    assert policy.compute_dtype == asked.compute_dtype
    assert isinstance(policy.params, tuple) and isinstance(policy.opt_state, tuple)
    assert dict(policy.params) == dict.fromkeys(fields, "pinned_host")
    state: dict[str, str] = dict(policy.opt_state)
    assert {k: v for k, v in state.items() if k.startswith("copies:")} == {
        f"copies:{f}": "device" for f in fields
    }
    assert {v for k, v in state.items() if not k.startswith("copies:")} == {
        "pinned_host"
    }


class _Decoder(eqx.Module):
    """An embedding, a stack of residual MLPs and a head read a chunk of tokens at
    a time (`eo.chunked_cross_entropy`): the logits never exist whole."""

    embed: eqx.nn.Embedding
    blocks: eo.Stacked[eqx.nn.MLP]
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(512, 64, key=k1)
        self.blocks = eo.Stacked.from_fn(
            lambda k: eqx.nn.MLP(64, 64, 128, 1, key=k), 1, key=k2
        )
        self.head = eqx.nn.Linear(64, 512, use_bias=False, key=k3)


def _chunked_loss(model, tokens, targets):
    h = jax.vmap(jax.vmap(model.embed))(tokens)
    layer = lambda mlp, x, _: (x + jax.vmap(mlp)(x), None)  # noqa: E731
    h = jax.vmap(lambda x: model.blocks.scan(layer, x)[0])(h)
    return eo.chunked_cross_entropy(h, model.head.weight, targets, chunk=32)


def test_the_advice_names_the_compute_copies_and_no_more_micro_batches(monkeypatch):
    """The issue's failure in small: compute copies on the device, the rest on the
    host, logits chunked, two micro-batches of a batch of two, on a GPU whose
    allocator takes a sliver of it. The copies are the largest part the step can
    move: named first, apart from the optimizer state (which is on the host), with
    their bytes (bf16, half the parameters'); what the compiler needs beyond what
    the step holds is named too; micro-batches are not advised to a step that has
    all its batch allows."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.000005")  # 400 KiB
    policy = eo.Policy.remat(
        params="pinned_host",
        opt_state={"**": "pinned_host", "copies:**": "device"},
        compute_dtype=jnp.bfloat16,
    )
    model = eo.place(eqx.filter_eval_shape(_Decoder, key=KEY), policy)
    state = eo.init_opt_state(optax.adamw(1e-4), model, policy)
    step = eo.train_step(_chunked_loss, optax.adamw(1e-4), policy, microbatches=2)
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    with pytest.raises(eo.DoesNotFit) as e:
        eo.memory_report(step, model, state, tokens, tokens, target="gpu-h100")
    params = sum(x.size for x in jax.tree.leaves(model) if hasattr(x, "size"))
    assert e.value.copies == {"device": 2 * params}
    assert (e.value.opt_state or {}).get("device", 0) < 2**10  # Adam's count
    assert e.value.microbatches == (2, 2)
    text = str(e.value)
    holds, advice = text.split("To shrink the device memory:")
    copies = f"{2 * params / 2**10:.2f} KiB"
    assert f"  compute copies: {copies} / 0 B" in holds
    assert "the rest (the batch, gradients and their accumulators" in holds
    first = advice.splitlines()[1]
    assert first.startswith(f"  - compute copies {copies} on the device: put ")
    assert "`copies:**` on the host" in first
    assert "micro-batch" not in advice.replace(first, "")
    assert "  - a smaller batch\n" in advice
    # The host memory behind one GPU is JAX's pinned host cap: how to raise it.
    assert "(JAX's pinned host cap: raise it with XLA_PJRT_GPU_HOST_MEMORY" in holds
