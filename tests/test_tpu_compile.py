"""Every offloaded train step compiles for a TPU: a covering subset of
`benchmarks/compile_matrix.py` (the full matrix and its results are in
docs/benchmarks/tpu-compile.md), the steps the compiler cannot take refused with the
leaves named and a way out that compiles, and the tiling rules that avoid them."""

import re
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload as eo
import eqx_offload.internal as eoi


sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import compile_matrix as cm  # noqa: E402


# (target, arch, dtype, width, depth, policy): every architecture, odd and
# non-multiple-of-128 widths, depths 1 to 8, both dtypes, every preset plus host
# parameters and host optimizer state, and every TPU generation.
CASES = [
    ("tpu-v5e", "mlp", "float32", 32, 1, "offload_all"),
    ("tpu-v5e", "mlp", "float32", 200, 8, "host state"),
    ("tpu-v5e", "mlp", "bfloat16", 128, 4, "offload_all"),
    ("tpu-v5e", "mlp", "bfloat16", 96, 4, "host params"),
    ("tpu-v5e", "attention", "float32", 64, 4, "offload_all"),
    ("tpu-v5e", "attention", "bfloat16", 200, 2, "host state"),
    ("tpu-v5e", "attention", "float32", 96, 3, "remat"),
    ("tpu-v5e", "gpt", "float32", 64, 4, "offload_all"),
    ("tpu-v5e", "gpt", "bfloat16", 128, 8, "offload_residuals"),
    ("tpu-v5e", "gpt", "float32", 200, 1, "none"),
    ("tpu-v5e", "dict", "float32", 256, 1, "offload_all"),
    ("tpu-v5e", "dict", "bfloat16", 256, 1, "host state"),
    ("tpu-v6e", "mlp", "float32", 64, 4, "offload_all"),
    ("tpu-v6e", "gpt", "bfloat16", 128, 4, "offload_all"),
    ("tpu-v5p", "attention", "bfloat16", 64, 4, "host params"),
    ("tpu-v4", "mlp", "float32", 200, 2, "host state"),
    ("tpu-v4", "gpt", "bfloat16", 64, 4, "offload_all"),
]


@pytest.mark.parametrize("target, arch, dtype, width, depth, policy", CASES)
def test_train_step_compiles_for_tpu(
    target, arch, dtype, width, depth, policy, monkeypatch
):
    # Small enough leaves of the dict model are streamed in blocks of rows too.
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 32 * 1024)
    result = cm.compile_case(arch, width, depth, cm.DTYPES[dtype], policy, target)
    assert result.outcome == "compiles", result.message


# Micro-batches with host-resident parameters (issue 40): at width 2048 and up a
# layer's leaf (8192 x 2048 floats: 64 MiB) is twice `PIECE_BYTES`, here patched
# down so that small layers are "large" too; the heads of width 96 are not whole
# TPU tiles. The matrix at widths 2048 and 4096 is in docs/benchmarks/tpu-compile.md.
MICROBATCH_CASES = [
    ("llama", "float32", 128, "offload_all", 2),
    ("gpt", "bf16-compute", 96, "offload_all", 4),
]


@pytest.mark.parametrize("arch, dtype, width, policy, k", MICROBATCH_CASES)
def test_micro_batches_compile_for_tpu(arch, dtype, width, policy, k, monkeypatch):
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 32 * 1024)
    result = cm.compile_case(
        arch, width, 2, cm.DTYPES[dtype], policy, "tpu-v5e", microbatches=k, mlp=256
    )
    assert result.outcome == "compiles", result.message


def test_row_blocks_are_streamed_in_the_dict_case(monkeypatch):
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 32 * 1024)
    leaf = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)  # 128 KiB: 4 blocks
    cut = eoi.streaming.pieces(leaf, None, 0)
    assert cut is not None and cut[1:] == (4, 64)


def test_a_step_the_compiler_rejects_names_the_leaves_and_a_way_out():
    # Width 97: the compiler lays the (layers, 388, 97) weights out with the layer
    # axis inside a tile, and cannot slice that layout on the host, by hand too.
    model, loss, batch = cm.case("mlp", 97, 4, jnp.float32)
    optimizer = optax.adam(1e-3)

    def report(policy):
        placed = eo.place(model, policy)
        opt_state = eo.init_opt_state(optimizer, placed, policy)
        step = eo.train_step(loss, optimizer, policy)
        return eo.memory_report(step, placed, opt_state, *batch, target="tpu-v5e")

    with pytest.raises(eo.DoesNotCompile) as info:
        report(eo.Policy.offload_all())
    message = str(info.value)
    assert "'blocks.mlp.layers[0].weight' (float32[4, 388, 97])" in message
    assert "'blocks.mlp.layers[1].weight' (float32[4, 97, 388])" in message
    assert "'blocks.norm.weight'" not in message  # it compiles alone
    # The way out, as written in the message, compiles.
    found = re.search(r"`(params=.*)`\.", message)
    assert found is not None
    fields = eval(f"dict({found[1]})")
    r = report(eo.Policy.offload_all(**fields))
    assert r.params is not None and r.params["device"] > r.params["pinned_host"] > 0


def test_tiling_rules():
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert not eoi.tiling.slices_by_layer((4,))  # one element per layer
    assert not eoi.tiling.slices_by_layer((4, 128))  # one row per layer (a bias)
    assert eoi.tiling.slices_by_layer((4, 97, 97))
    assert eoi.tiling.slices_by_layer((4, 2, 64, 32))
    mib = 2**20
    assert eoi.tiling.row_blocks((4096, 1024), f32, 4 * mib) == 4  # 1024 rows each
    assert eoi.tiling.row_blocks((4096, 1000), f32, 4 * mib) == 1  # lanes not whole
    assert eoi.tiling.row_blocks((40, 1024), bf16, 8 * 1024) == 1  # 16-row tiles
    assert eoi.tiling.row_blocks((48, 1024), bf16, 8 * 1024) == 3
    assert eoi.tiling.row_blocks((6, 64, 128), f32, 64 * 1024) == 3  # any rows


@pytest.mark.parametrize("arch, width", [("gpt", 64), ("dict", 256)])
def test_the_default_update_streams_on_a_tpu(arch, width, monkeypatch):
    """`Policy(update="auto")` runs the whole update on the CPU, but the program it
    traces compiles for a TPU exactly as `update="streamed"` does."""
    monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", 32 * 1024)
    model, loss, batch = cm.case(arch, width, 4, jnp.float32)
    optimizer = optax.adam(1e-3)
    figures = {}
    for update in ("auto", "streamed", "whole"):
        policy = eo.Policy.offload_all(update=update)
        if arch == "dict":
            policy = eo.Policy(
                params="pinned_host", opt_state="pinned_host", update=update
            )
        placed = eo.place(model, policy)
        opt_state = eo.init_opt_state(optimizer, placed, policy)
        step = eo.train_step(loss, optimizer, policy)
        report = eo.memory_report(step, placed, opt_state, *batch, target="tpu-v5e")
        figures[update] = (report.device, report.host)
    assert figures["auto"] == figures["streamed"]
    assert figures["auto"] != figures["whole"]


class _Unrolled(eqx.Module):
    """Layers in a Python list (no `Stacked`): what the compiler rematerializes
    itself when the step is too big for the chip."""

    layers: list[eqx.nn.Linear]

    def __init__(self, width: int, depth: int, *, key):
        keys = jax.random.split(key, depth)
        self.layers = [eqx.nn.Linear(width, width, key=k) for k in keys]

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(jax.vmap(layer)(x))
        return x


def test_host_remat_lets_the_tpu_compiler_keep_what_it_recomputes_on_the_host():
    """A step whose activations are too big for a v5e chip: the compiler recomputes
    some to fit; with `Policy(host_remat=True)` it keeps some on the host instead
    (host temporaries), at an odd width. On the CPU the step refuses the option."""
    width, rows = 1000, 360_000  # 12 activations of 1.34 GiB: over 15.75 GiB

    def loss(model, x):
        return jnp.mean(model(x))

    model = eqx.filter_eval_shape(_Unrolled, width, 12, key=jax.random.key(0))
    x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    optimizer = optax.sgd(1e-3)
    reports = []
    for policy in (eo.Policy.none(), eo.Policy.none(host_remat=True)):
        step = eo.train_step(loss, optimizer, policy)
        state = eo.init_opt_state(optimizer, model, policy)
        reports.append(eo.memory_report(step, model, state, x, target="tpu-v5e"))
    plain, host = reports
    assert plain.host_bytes == 0 and plain.device_bytes <= plain.capacity
    assert host.host_bytes > 2**30 and host.device_bytes <= host.capacity
    # (What it recomputes is `tanh`, no matmul FLOPs; the host copies are priced.)
    assert host.time is not None and plain.time is not None
    assert host.time.seconds > plain.time.seconds
    step = eo.train_step(loss, optimizer, eo.Policy.none(host_remat=True))
    refused = r"`memory_report`: `Policy\(host_remat=True\)`"
    with pytest.raises(ValueError, match=refused):
        eo.memory_report(step, model, optimizer.init(model), x)
    small = _Unrolled(8, 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"and this backend is 'cpu'"):
        step(small, optimizer.init(eqx.filter(small, eqx.is_array)), jnp.ones((4, 8)))
    with pytest.raises(TypeError, match="host_remat"):  # (beartype, or our own)
        eo.Policy(host_remat=1)  # pyright: ignore[reportArgumentType]
