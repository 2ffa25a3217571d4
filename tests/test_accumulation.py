"""Micro-batches with the compute copies on the device: the masters and moments on
the host, the gradients added up on the device beside the copies, the update once a
step. Nothing crosses the host link per micro-batch: a step's host traffic is the
update's alone, whatever the micro-batch count, on a GPU and a TPU, with no host
compute (compiled with `xla_disable_automatic_host_compute_offload`, so any fails
the compile). Its numbers are `test_mixed_precision.py`'s (the same scheme by hand)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload as eo

from .helpers import cross_entropy, table_lm


# The placement a full fine-tune on one GPU takes (issue 54): bf16 compute copies on
# the device, fp32 masters and AdamW moments on the host.
COPIES_ON_DEVICE = eo.Policy.remat(
    params="pinned_host",
    opt_state={"**": "pinned_host", "copies:**": "device"},
    compute_dtype=jnp.bfloat16,
)
HOST = eo.Policy(params="pinned_host")
NO_HOST_COMPUTE = {"xla_disable_automatic_host_compute_offload": True}
SEQ, PER_MICRO_BATCH = 16, 2
VOCAB, DIM, DEPTH = 64, 256, 4
STACKED = DEPTH * DIM * DIM  # the layers' parameters
PARAMS = 2 * VOCAB * DIM + STACKED  # and the tables


@functools.cache
def _report(
    target: str, k: int, vocab: int = VOCAB, dim: int = DIM, depth: int = DEPTH
) -> eo.MemoryReport:
    optimizer = optax.adamw(1e-3)
    abstract = eqx.filter_eval_shape(table_lm, jax.random.key(0), vocab, dim, depth)
    model = eo.place(abstract, COPIES_ON_DEVICE)
    opt_state = eo.init_opt_state(optimizer, model, COPIES_ON_DEVICE)
    tokens = jax.ShapeDtypeStruct((PER_MICRO_BATCH * k, SEQ), jnp.int32)
    step = eo.train_step(cross_entropy, optimizer, COPIES_ON_DEVICE, microbatches=k)
    return eo.memory_report(step, model, opt_state, tokens, tokens, target=target)


@pytest.fixture
def no_host_compute(monkeypatch):
    """Every step compiled here refuses host compute instead of adding it."""
    monkeypatch.setattr(
        "eqx_offload._compiler.compile_options", lambda *_, **__: NO_HOST_COMPUTE
    )


@pytest.mark.parametrize("target", ["gpu-h100", "tpu-v5e"])
def test_host_traffic_does_not_grow_with_the_micro_batches(target, no_host_compute):
    """k = 1, 4, 16: the bytes each way are the update's (fp32 masters and two
    moments, read and written once), within 1%."""
    reports = [_report(target, k) for k in (1, 4, 16)]
    for report in reports:
        for direction in ("host_to_device", "device_to_host"):
            moved = report.transfer_bytes(direction, compiled=True)
            assert moved == pytest.approx(3 * 4 * PARAMS, rel=0.01), direction
        assert report.time is not None and report.time.host_compute_seconds == 0
        assert report.time.compile_options == NO_HOST_COMPUTE


def test_host_compute_fails_the_compile_here(no_host_compute):
    """The guard above is live: computing on a host-resident array, which XLA
    would otherwise turn into host compute, does not compile under it."""
    x = eo.place(jax.ShapeDtypeStruct((128, 128), jnp.float32), HOST)
    with pytest.raises(eo.DoesNotCompile, match="host compute offloading is disabled"):
        eo.memory_report(lambda x: x * 2, x, target="gpu-h100")


def test_the_layers_gradients_add_up_in_one_buffer():
    """On a GPU, k = 4 micro-batches of the same size as k = 1 hold one fp32
    accumulator of the layers (4 bytes a parameter) where k = 1 holds their bf16
    gradient (2): about 2 bytes a parameter more, not the 6 of an accumulator read
    while a second one takes the sums (as a scanned input, before it rode in the
    scan's carry)."""
    one, four = _report("gpu-h100", 1), _report("gpu-h100", 4)
    assert 0 < four.device_bytes - one.device_bytes < 3 * STACKED


def test_the_tables_gradients_add_up_in_place_on_a_tpu(no_host_compute, monkeypatch):
    """On `tpu-v5e`, 2 micro-batches hold the fp32 accumulators of the embedding
    and the head (outside the `Stacked`, 64 MiB each: too large for the chip's
    on-chip memory) and little else: each micro-batch's gradient is added into its
    accumulator as it is computed. Not five tables: each gradient cast to fp32
    whole and each accumulator's old value copied whole, beside the accumulators
    (an optimization barrier kept XLA from fusing the cast and the sum). The
    update's pieces are made small, so the accumulators are what the temporaries
    hold."""
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 4 * 2**20)
    vocab, dim = 32768, 512
    report = _report("tpu-v5e", 2, vocab, dim, 1)
    assert report.device["temp"] < 2.5 * (4 * vocab * dim)


def test_tables_of_odd_width_add_up_beside_their_copies(no_host_compute):
    """At width 72 (not whole TPU tiles), a `tpu-v5e` step of 2 micro-batches moves
    the update's bytes alone, as at whole tiles: the tables' gradients add up on the
    device beside their compute copies, their fp32 masters not moved there too (21%
    more bytes each way here)."""
    report = _report("tpu-v5e", 2, VOCAB, 72, 1)
    for direction in ("host_to_device", "device_to_host"):
        moved = report.transfer_bytes(direction, compiled=True)
        assert moved == pytest.approx(3 * 4 * (2 * VOCAB + 72) * 72, rel=0.01)


@pytest.mark.xfail(
    strict=True,
    raises=eo.DoesNotCompile,
    reason="accumulators on the host (no compute copy on the device) at k >= 2 on "
    "a TPU: the loop starts them as the masters, which the update still needs, and "
    "each micro-batch's layers' backward scan gives their sums as a fresh stacked "
    "output, copied into the loop's carry: two host-side copies, automatic host "
    "compute (docs/design-notes.md, known limits)",
)
def test_host_accumulators_add_up_without_host_compute_on_a_tpu(no_host_compute):
    """With the masters, moments and accumulators all on the host, 2 micro-batches
    compile for `tpu-v5e` without host compute."""
    optimizer = optax.adamw(1e-3)
    abstract = eqx.filter_eval_shape(table_lm, jax.random.key(0), VOCAB, 128, 2)
    policy = eo.Policy.remat(params="pinned_host", opt_state="pinned_host")
    model = eo.place(abstract, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens = jax.ShapeDtypeStruct((2 * PER_MICRO_BATCH, SEQ), jnp.int32)
    step = eo.train_step(cross_entropy, optimizer, policy, microbatches=2)
    eo.memory_report(step, model, opt_state, tokens, tokens, target="tpu-v5e")
