"""Every offloaded train step compiles for a TPU: a covering few of
`benchmarks/compile_matrix.py`'s cases (the full matrices and their results are in
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


# The compile matrix's share, each compile checking several things at once (the
# `SHARE` of tests/test_gpu_targets.py swaps the last two policies): `offload_all`
# (parameters, optimizer state and the layer inputs on the host) with micro-batches
# and bf16 compute, the GPT's embedding and head (256 x 96) not whole TPU tiles;
# bfloat16 parameters of the layers on the host at width 200; the optimizer state
# on the host and the layer inputs offloaded at the odd width 97 (host parameters
# are refused there: `test_a_step_the_compiler_rejects_names_the_leaves_and_a_way_out`).
# Elsewhere: leaves outside any `Stacked` streamed in blocks of rows
# (`test_the_default_update_streams_on_a_tpu`), `none`, `remat` and
# `offload_residuals` (tests/test_step_time.py), `offload_all` on every TPU
# generation (tests/test_memory_report.py). `_tiling.PIECE_BYTES` is patched down,
# so that small layers take the path of large ones. The full matrices, and the cases
# these tests compiled before, are in docs/benchmarks/tpu-compile.md.
SHARE = [
    ("gpt", "bf16-compute", 96, "offload_all", 2),
    ("mlp", "bfloat16", 200, "host params", 1),
    ("mlp", "float32", 97, "host state", 1),
]


@pytest.mark.parametrize("arch, dtype, width, policy, k", SHARE)
def test_train_step_compiles_for_tpu(arch, dtype, width, policy, k, monkeypatch):
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 32 * 1024)
    result = cm.compile_case(
        arch, width, 2, cm.DTYPES[dtype], policy, "tpu-v5e", microbatches=k
    )
    assert result.outcome == "compiles", result.message
    report = result.report
    assert report is not None and report.params is not None
    assert report.opt_state is not None
    host_params = policy in ("offload_all", "host params")
    host_state = policy in ("offload_all", "host state")
    assert (report.params.get("pinned_host", 0) > 0) == host_params
    assert (report.opt_state.get("pinned_host", 0) > 0) == host_state


def test_row_blocks_are_streamed_in_the_dict_case(monkeypatch):
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 32 * 1024)
    leaf = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)  # 128 KiB: 4 blocks
    cut = eoi.streaming_pieces(leaf, None, 0)
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
    assert not eoi.slices_by_layer((4,))  # one element per layer
    assert not eoi.slices_by_layer((4, 128))  # one row per layer (a bias)
    assert eoi.slices_by_layer((4, 97, 97))
    assert eoi.slices_by_layer((4, 2, 64, 32))
    mib = 2**20
    assert eoi.row_blocks((4096, 1024), f32, 4 * mib) == 4  # 1024 rows each
    assert eoi.row_blocks((4096, 1000), f32, 4 * mib) == 1  # lanes not whole
    assert eoi.row_blocks((40, 1024), bf16, 8 * 1024) == 1  # 16-row tiles
    assert eoi.row_blocks((48, 1024), bf16, 8 * 1024) == 3
    assert eoi.row_blocks((6, 64, 128), f32, 64 * 1024) == 3  # any rows


def test_the_default_update_streams_on_a_tpu(monkeypatch):
    """`Policy(update="auto")` runs the whole update on the CPU, but the program it
    traces compiles for a TPU exactly as `update="streamed"` does: here the dict
    model's leaves, outside any `Stacked`, streamed in blocks of rows."""
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 32 * 1024)
    model, loss, batch = cm.case("dict", 256, 1, jnp.float32)
    optimizer = optax.adam(1e-3)
    figures = {}
    for update in ("auto", "streamed", "whole"):
        policy = eo.Policy(params="pinned_host", opt_state="pinned_host", update=update)
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
    """A step whose activations are too big for a v5e chip (the compiler recomputes
    some to fit, with nothing on the host: `Policy.none()`): with
    `Policy(host_remat=True)` it keeps some on the host instead (host temporaries,
    at an odd width), and the step time prices their copies. On the CPU the step
    refuses the option."""
    # 12 activations of 1.34 GiB: over 15.75 GiB. (Narrow and tall: at width 1000
    # and 360,000 rows, the same bytes, the compiler takes three times as long.)
    width, rows = 100, 3_600_000

    def loss(model, x):
        return jnp.mean(model(x))

    model = eqx.filter_eval_shape(_Unrolled, width, 12, key=jax.random.key(0))
    x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    optimizer = optax.sgd(1e-3)
    policy = eo.Policy.none(host_remat=True)
    step = eo.train_step(loss, optimizer, policy)
    state = eo.init_opt_state(optimizer, model, policy)
    host = eo.memory_report(step, model, state, x, target="tpu-v5e")
    # Nothing is placed on the host: what is there, the compiler put there.
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model))
    assert host.params == {"device": weights}
    assert host.host["argument"] == host.host["output"] == 0
    assert host.host["temp"] > 2**30 and host.fits_device
    # (What it recomputes is `tanh`, no matmul FLOPs; the host copies are priced.)
    t = host.time
    assert t is not None and t.bound == "host link"
    assert t.host_to_device_bytes == t.device_to_host_bytes > 2**30
    refused = r"`memory_report`: `Policy\(host_remat=True\)`"
    with pytest.raises(ValueError, match=refused):
        eo.memory_report(step, model, optimizer.init(model), x)
    small = _Unrolled(8, 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"and this backend is 'cpu'"):
        step(small, optimizer.init(eqx.filter(small, eqx.is_array)), jnp.ones((4, 8)))
    with pytest.raises(TypeError, match="host_remat"):  # (beartype, or our own)
        eo.Policy(host_remat=1)  # pyright: ignore[reportArgumentType]
