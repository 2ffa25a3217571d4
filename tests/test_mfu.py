"""Model FLOPs utilisation and the compute-bound step in `StepTime`, and JAX's cap on
pinned host memory as a GPU report's and `plan`'s host limit: model FLOPs equal to
the formula (6 × parameters × tokens plus attention), the compute-bound step
never longer than the step and shorter for an offloaded one, MFU as its
definition, the table's rows, and the cap read from `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jaxtyping import Array, Float, Int

import eqx_offload as eo
import eqx_offload.internal as eoi


LAYERS, DIM, HIDDEN, VOCAB, SEQ, BATCH, K = 2, 32, 64, 64, 16, 4, 2
CAP = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


class Block(eqx.Module):
    """Causal single-head attention and an MLP."""

    wq: Float[Array, "d d"]
    wk: Float[Array, "d d"]
    wv: Float[Array, "d d"]
    wo: Float[Array, "d d"]
    w1: Float[Array, "d h"]
    w2: Float[Array, "h d"]

    def __call__(self, x: Float[Array, "b s d"]) -> Float[Array, "b s d"]:
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        scores = jnp.einsum("bqd,bkd->bqk", q, k)
        scores = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), scores, -1e9)
        x = x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores), v) @ self.wo
        return x + jax.nn.gelu(x @ self.w1) @ self.w2


class Decoder(eqx.Module):
    embed: Float[Array, "v d"]
    blocks: eo.Stacked[Block]
    head: Float[Array, "d v"]

    def __call__(self, tokens: Int[Array, "b s"]) -> Float[Array, "b s v"]:
        return self.blocks(self.embed[tokens]) @ self.head


def _decoder(key) -> Decoder:
    def block(k):
        shapes = [(DIM, DIM)] * 4 + [(DIM, HIDDEN), (HIDDEN, DIM)]
        keys = jax.random.split(k, len(shapes))
        return Block(*(jax.random.normal(k, s) for k, s in zip(keys, shapes)))

    k1, k2, k3 = jax.random.split(key, 3)
    blocks = eo.Stacked.from_fn(block, LAYERS, key=k2)
    return Decoder(
        jax.random.normal(k1, (VOCAB, DIM)), blocks, jax.random.normal(k3, (DIM, VOCAB))
    )


def _loss(model: Decoder, tokens, targets) -> Float[Array, ""]:
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def test_matmul_flops_count_loops_branches_and_calls_as_their_rules_say():
    """2 × M × N × K per dot (with batch dimensions); a scan's body × its length, a
    `cond`'s largest branch, a `while`'s body once, a checkpointed function and a
    `custom_vjp` function's primal once; a convolution by its kernel."""
    a, b = jnp.zeros((2, 4, 5)), jnp.zeros((6, 6))

    @jax.custom_vjp
    def primal(x):
        return x @ b

    primal.defvjp(lambda x: (primal(x), x), lambda x, g: (g @ b.T @ b,))

    def fn(a, b):
        x = jnp.einsum("bij,bjk->bik", a, jnp.zeros((2, 5, 6)))[0]  # 2·2·4·5·6
        x = jax.lax.scan(lambda h, _: (h @ b, None), x, length=3)[0]  # 3·2·4·6·6
        x = jax.lax.cond(x.sum() > 0, lambda t: t @ b @ b, lambda t: t, x)  # 2·...
        x = jax.lax.while_loop(
            lambda c: c[1] < 5, lambda c: (c[0] @ b, c[1] + 1), (x, 0)
        )[0]
        return jax.checkpoint(primal)(x)  # 1·2·4·6·6 each

    dot = 2 * 4 * 6 * 6
    expected = 2 * 2 * 4 * 5 * 6 + (3 + 2 + 1 + 1) * dot
    assert eoi.matmul_flops(jax.make_jaxpr(fn)(a, b)) == expected
    conv = jax.make_jaxpr(lambda x, k: jax.lax.conv(x, k, (1, 1), "SAME"))
    x, k = jnp.zeros((1, 3, 8, 8)), jnp.zeros((4, 3, 3, 3))
    assert eoi.matmul_flops(conv(x, k)) == 2 * (4 * 8 * 8) * (3 * 3 * 3)


@pytest.fixture(scope="module")
def offloaded():
    """The decoder's step, everything offloaded, K micro-batches, compiled for
    `gpu-h100` with JAX's pinned host cap set to 0 GiB (so it does not fit the host)."""
    policy, optimizer = eo.Policy.offload_all(), optax.sgd(0.1)
    model = eo.place(eqx.filter_eval_shape(_decoder, jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    step = eo.train_step(_loss, optimizer, policy, microbatches=K)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CAP, "0")
        return eo.memory_report(
            step, model, opt_state, tokens, tokens, target="gpu-h100"
        )


def test_model_flops_are_six_per_parameter_and_token_plus_attention(offloaded):
    """3 × the forward's matmuls: 2 per matmul parameter and token (the embedding is
    a gather), and per layer and sequence QKᵀ and the scores times V, 2 × SEQ² × DIM
    each (the causal mask halves nothing), over every micro-batch."""
    params = LAYERS * (4 * DIM * DIM + 2 * DIM * HIDDEN) + DIM * VOCAB
    tokens = BATCH * SEQ
    expected = 6 * params * tokens + 12 * LAYERS * DIM * SEQ * tokens
    assert offloaded.time.model_flops == expected


def test_mfu_is_model_flops_over_time_at_the_compute_precision_peak(offloaded):
    t = offloaded.time
    assert set(t.flops_by_precision) == {"tf32"}  # float32 dots on an H100
    peak = t.hardware.matmul_flops["tf32"]
    assert t.precision == "tf32" and t.peak_flops == peak
    assert t.mfu == pytest.approx(t.model_flops / (t.seconds * peak), rel=1e-12)


def test_an_offloaded_step_is_longer_than_its_compute_bound_step(offloaded):
    """The same replay with the host link free: shorter, and no shorter than the
    device's own work alone (its compute and HBM time, where nothing overlaps)."""
    t = offloaded.time
    assert t.exposed_transfer_seconds > 0
    assert 0 < t.compute_bound_seconds < t.seconds - t.exposed_transfer_seconds / 2
    assert t.compute_bound_seconds >= max(t.compute_seconds, t.hbm_seconds)


def test_a_step_without_host_traffic_is_its_own_compute_bound_step():
    """A function: no host traffic, its compute-bound step is the step itself, and
    no model FLOPs (no loss known), so no MFU."""
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    report = eo.memory_report(lambda a: jnp.tanh(a @ a) @ a, x, target="gpu-h100")
    t = report.time
    assert (
        t is not None
        and t.kind == "device"
        and t.compute_bound_seconds == t.seconds > 0
    )
    assert t.model_flops is None and t.mfu is None
    text = str(report)
    assert "compute-bound step (estimate)" in text and "MFU" not in text


def test_the_table_prints_the_compute_bound_step_and_mfu(offloaded):
    t = offloaded.time
    lines = str(offloaded).splitlines()
    bound = next(line for line in lines if line.startswith("compute-bound step"))
    assert eoi.time_text(t.compute_bound_seconds) in bound
    assert f"{t.seconds / t.compute_bound_seconds:.2f}x" in bound
    mfu = next(line for line in lines if line.startswith("MFU (estimate)"))
    assert f"{t.mfu:.1%}" in mfu and "tf32 peak" in mfu


def test_the_new_fields_round_trip_and_old_results_read_without_them(offloaded):
    t = offloaded.time
    data = t.to_dict()
    assert data["mfu"] == t.mfu and data["model_flops"] == t.model_flops
    again = eo.StepTime.from_dict(data)
    assert again == t and again.mfu == t.mfu
    old = {
        k: v
        for k, v in t.to_dict().items()
        if k not in ("model_flops", "compute_bound_seconds")
    }
    read = eo.StepTime.from_dict(old)
    assert read.model_flops is None and read.compute_bound_seconds == 0.0
    assert read.mfu is None
    assert "compute-bound" not in str(read) and "MFU" not in str(read)
    report = eo.MemoryReport.from_dict(offloaded.to_dict())
    assert report.host_limit == "pinned host cap" and report.time == t


def test_the_pinned_host_cap_bounds_a_gpu_report_and_is_named(offloaded):
    """Set to 0 GiB, the cap is the host limit: the step does not fit the host, and
    the table says which variable raises it, to what."""
    assert offloaded.host_limit == "pinned host cap" and offloaded.host_capacity == 0
    assert offloaded.host_bytes > 0 and offloaded.fits_host is False
    gib = -(-offloaded.host_bytes // 2**30)
    assert f"set {CAP}={gib} before JAX starts" in str(offloaded)


def test_the_host_limit_is_the_smaller_of_ram_and_the_pinned_cap(monkeypatch):
    """64 GiB per process by default (16 preallocated), shared by its GPUs; a TPU's
    is its RAM."""
    monkeypatch.delenv(CAP, raising=False)
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", raising=False)
    assert eoi.host_memory("gpu-h100", 10**12) == (64 * 2**30, "pinned host cap")
    assert eoi.host_memory("gpu-h100", 2**30) == (2**30, "RAM")
    assert eoi.host_memory("gpu-h100:8", 10**12) == (8 * 2**30, "pinned host cap")
    assert eoi.host_memory("tpu-v5e", 10**15) == (10**15, "RAM")
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "true")
    assert eoi.host_memory("gpu-h100", 10**12)[0] == 16 * 2**30
    monkeypatch.setenv(CAP, "512")
    assert eoi.host_memory("gpu-h100", 10**12)[0] == 512 * 2**30
    monkeypatch.setenv(CAP, "lots")
    with pytest.raises(ValueError, match=CAP):
        eoi.host_memory("gpu-h100", 10**12)


def test_the_plan_host_budget_follows_the_pinned_cap(monkeypatch):
    monkeypatch.setenv(CAP, "3")
    (_, host), _ = eoi.planner_budgets(None, None, "gpu-h100")
    assert host == 3 * 2**30
    small = dataclasses.replace(eo.Hardware.of("gpu-h100"), host_memory_bytes=2**30)
    (_, host), _ = eoi.planner_budgets(None, None, "gpu-h100", hardware=small)
    assert host == 2**30
    (_, host), _ = eoi.planner_budgets(None, None, "tpu-v5e")
    assert host == eo.Hardware.of("tpu-v5e").host_memory_bytes
