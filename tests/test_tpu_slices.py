"""`memory_report` for a whole TPU slice, compiled here with libtpu: the figures are
per chip (each array as one chip's shard, padded to the compiler's tiles; a
replicated array whole on every chip) and a host holds those of the chips it
serves. Checked against arithmetic on shapes small enough to do by hand."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

import eqx_offload as eo
import eqx_offload.internal as eoi

from .helpers import cross_entropy, MLPBlock, StackedNet, table_lm


pytest.importorskip("libtpu")

F32 = 4  # bytes
TARGET = "tpu-v5e:2x4"  # 8 chips; libtpu lays them out as 2 hosts of 4


def sds(shape, spec, kind, mesh):
    sharding = NamedSharding(mesh, spec, memory_kind=kind)
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)


def to_device(x):
    return jax.device_put(x, jax.memory.Space.Device)


def padded_bytes(shape, dtype, fmt) -> int:
    """One chip's bytes of an array as the compiler lays it out: its shard, the
    dimensions in the layout's order, the minor ones rounded up to the first tile."""
    shard = fmt.sharding.shard_shape(shape)
    layout = fmt.layout
    dims = [shard[d] for d in layout.major_to_minor]
    tile = layout.tiling[0] if layout.tiling else ()
    major, minor = dims[: len(dims) - len(tile)], dims[len(dims) - len(tile) :]
    tiles = [-(-d // t) * t for d, t in zip(minor, tile[len(tile) - len(minor) :])]
    return math.prod(major) * math.prod(tiles) * jnp.dtype(dtype).itemsize


def test_host_bytes_of_sharded_and_replicated_host_arrays_by_hand():
    mesh = AbstractMesh((8,), ("fsdp",))
    w = sds((4, 256, 256), P(None, "fsdp"), "pinned_host", mesh)
    b = sds((4, 256), P(), "pinned_host", mesh)
    m = sds((64, 64), P("fsdp"), "pinned_host", mesh)

    def f(w, b, m):
        return to_device(w).sum() + to_device(b).sum() + to_device(m).sum()

    report = eo.memory_report(f, w, b, m, target=TARGET)
    # By hand, per chip: w's shard is 4 x 32 x 256 (whole 8 x 128 tiles); b is
    # replicated, so whole on every chip (4 x 256, the compiler's 4 x 128 tiles); m's
    # shard is 8 x 64, padded to 8 x 128 lanes: twice its 2 KiB.
    w_chip, b_chip, m_chip = 4 * 32 * 256 * F32, 4 * 256 * F32, 8 * 128 * F32
    assert (w_chip, b_chip, m_chip) == (131072, 4096, 4096)
    assert report.host == {
        "argument": w_chip + b_chip + m_chip,
        "output": 0,
        "temp": 0,
        "alias": 0,
    }
    assert report.host_bytes == 139264
    assert (report.chips, report.chips_per_host) == (8, 4)
    assert report.host_bytes_per_host == 4 * 139264  # four chips' buffers
    # The rows are one chip's shards, unpadded.
    assert report.arguments == {
        "argument 0": {"pinned_host": w_chip},
        "argument 1": {"pinned_host": b_chip},
        "argument 2": {"pinned_host": 8 * 64 * F32},
    }
    # The same arithmetic from the layouts the compiler reports.
    slice_mesh = eoi.slice_mesh(TARGET, mesh)
    layouts = [(w.shape, P(None, "fsdp")), (b.shape, P()), (m.shape, P("fsdp"))]
    args = [sds(shape, spec, "pinned_host", slice_mesh) for shape, spec in layouts]
    compiled = jax.jit(f).trace(*args).lower().compile()
    formats = jax.tree.leaves(compiled.input_formats)
    by_layout = [padded_bytes(x.shape, x.dtype, fmt) for x, fmt in zip(args, formats)]
    assert by_layout == [w_chip, b_chip, m_chip]
    text = str(report)
    assert "8 chips, 4 per host (2 hosts)" in text and "per chip" in text
    assert "host memory of a host (4 chips)" in text and "544.00 KiB" in text
    data = report.to_dict()
    assert (data["chips"], data["chips_per_host"]) == (8, 4)
    assert data["host_bytes_per_host"] == 557056


def test_a_2d_mesh_and_explicit_axes():
    mesh = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x = sds((64, 64), P("data", "model"), "pinned_host", mesh)
    report = eo.memory_report(lambda x: to_device(x) * 2, x, target=TARGET)
    # A 32 x 16 shard (2 KiB): row-major it would fill 32 x 128; the compiler lays
    # it out transposed, 16 rows of 32 lanes padded to 128: 8 KiB.
    assert report.host["argument"] == 16 * 128 * F32 == 8192
    assert report.device["output"] == 8192  # its device copy, tiled the same way
    assert report.arguments == {"argument 0": {"pinned_host": 32 * 16 * F32}}


class Net(eqx.Module):
    layers: eo.Stacked[eqx.nn.Linear]

    def __init__(self, *, key: PRNGKeyArray):
        make = lambda k: eqx.nn.Linear(256, 256, key=k)  # noqa: E731
        self.layers = eo.Stacked.from_fn(make, 4, key=key)

    def __call__(self, x: Float[Array, " 256"]) -> Float[Array, " 256"]:
        return self.layers(x)


def loss_fn(model: Net, x: Float[Array, "batch 256"]) -> Float[Array, ""]:
    return jnp.mean(jax.vmap(model)(x) ** 2)


POLICY = eo.Policy.offload_all(shard="fsdp", batch="fsdp")
OPTIMIZER = optax.sgd(0.1)


def slice_report(model, x, policy=POLICY):
    opt_state = eo.init_opt_state(OPTIMIZER, model, policy)
    step = eo.train_step(loss_fn, OPTIMIZER, policy)
    return eo.memory_report(step, model, opt_state, x, target=TARGET)


@pytest.fixture(scope="module")
def abstract_report():
    mesh = AbstractMesh((8,), ("fsdp",))
    model = eo.place(
        eqx.filter_eval_shape(Net, key=jax.random.key(0)), POLICY, mesh=mesh
    )
    return slice_report(model, jax.ShapeDtypeStruct((16, 256), jnp.float32))


def test_a_train_step_on_a_slice_by_hand(abstract_report):
    report = abstract_report
    # FSDP splits each (256, 256) layer's rows over 8 chips: a 4 x 32 x 256 shard
    # per chip; the (4, 256) biases are too small to split, so every chip holds them
    # whole. The step takes them, returns them and updates them in place.
    params = 4 * 32 * 256 * F32 + 4 * 256 * F32
    assert report.params == {"pinned_host": params}
    assert report.host["argument"] == report.host["output"] == params == 135168
    assert report.host["alias"] == params
    # Temporaries on the host: the weight's gradient shard, gathered there before the
    # update, and the residual each chip saves (its 2 of the 16 rows, 4 layers).
    residual_chip = 4 * 2 * 256 * F32
    assert report.host["temp"] >= 4 * 32 * 256 * F32 + residual_chip
    assert report.host_bytes_per_host == 4 * report.host_bytes
    assert report.arguments["batch"] == {"device": 2 * 256 * F32}  # 2 rows a chip
    # Residuals are traced whole: the 16 rows of every layer.
    residuals = {(r.name, r.memory_kind): r.bytes for r in report.residuals or ()}
    assert residuals[("layers.input", "pinned_host")] == 8 * residual_chip
    assert "saved for the backward pass (as traced, whole arrays)" in str(report)


def test_explicit_axes_are_carried_onto_the_slice():
    """An abstract mesh with `Explicit` axes, and a concrete one: the same report,
    laid out as under `Auto` axes (a concrete mesh gives its abstract mesh's
    report, whatever its axis types)."""
    explicit = (AxisType.Explicit,)
    abstract_mesh = AbstractMesh((8,), ("fsdp",), axis_types=explicit)
    abstract = eqx.filter_eval_shape(Net, key=jax.random.key(0))
    model = eo.place(abstract, POLICY, mesh=abstract_mesh)
    report = slice_report(model, jax.ShapeDtypeStruct((16, 256), jnp.float32))
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=explicit)
    with jax.set_mesh(mesh):
        concrete = eo.place(Net(key=jax.random.key(0)), POLICY)
    assert slice_report(concrete, jnp.ones((16, 256))).to_dict() == report.to_dict()
    params = 4 * 32 * 256 * F32 + 4 * 256 * F32  # laid out as under `Auto` axes
    assert report.params == {"pinned_host": params} and report.host["alias"] == params


def test_a_model_on_no_mesh_is_replicated_on_every_chip():
    policy = eo.Policy.offload_all()
    model = eo.place(eqx.filter_eval_shape(Net, key=jax.random.key(0)), policy)
    report = slice_report(model, jax.ShapeDtypeStruct((16, 256), jnp.float32), policy)
    whole = 4 * 256 * 256 * F32 + 4 * 256 * F32
    assert report.params == {"pinned_host": whole}
    assert report.host["argument"] == whole
    assert report.host_bytes_per_host == 4 * report.host_bytes


def test_one_chip_targets_are_unchanged():
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    report = eo.memory_report(lambda x: x * 2, x, target="tpu-v5e")
    assert (report.chips, report.chips_per_host) == (1, 1)
    assert report.host_bytes_per_host == report.host_bytes
    assert "host memory of a host" not in str(report)
    cpu = eo.memory_report(lambda x: x * 2, jnp.ones(3))
    assert cpu.chips is None and cpu.host_bytes_per_host == cpu.host_bytes


def test_chips_per_host_follow_libtpu():
    # (chips or TensorCores compiled for, how many one host serves)
    assert len(eoi.targets_devices("tpu-v5e:16x16")) == 256
    assert eoi.chips_per_host("tpu-v5e:16x16") == 4
    assert eoi.chips_per_host("tpu-v5e:2x2") == 4
    assert len(eoi.targets_devices("tpu-v5p:2x2x2")) == 8
    assert eoi.chips_per_host("tpu-v5p:2x2x2") == 4
    assert eoi.chips_per_host("tpu-v4:2x2x2") == 8  # two cores per chip


def test_a_program_too_big_for_a_chip_of_the_slice():
    mesh = AbstractMesh((8,), ("fsdp",))
    x = sds((2**33,), P("fsdp"), "device", mesh)  # 32 GiB, 4 GiB a chip

    def f(x):
        return jnp.broadcast_to(x, (5, x.shape[0])) * 2.0  # 20 GiB a chip

    with pytest.raises(eo.DoesNotFit, match=r"one chip of tpu-v5e:2x4") as info:
        eo.memory_report(f, x, target=TARGET)
    assert info.value.arguments == {"argument 0": {"device": 4 * 2**30}}
    assert info.value.target == TARGET


def test_unknown_targets_and_topologies_libtpu_rejects():
    x = jnp.ones(3)
    for target in ("tpu-v7:2x2", "tpu-v5e:", "tpu-v5e:4", "v5e:2x2", "tpu-v5e-4x4"):
        with pytest.raises(ValueError, match=r"unknown target; valid targets: None"):
            eo.memory_report(lambda x: x, x, target=target)
    with pytest.raises(
        ValueError,
        match=r"target='tpu-v5e:3x3'\)`: libtpu does not accept the topology "
        r"'v5e:3x3': .*not divisible.*'tpu-v5e' for one chip",
    ):
        eo.memory_report(lambda x: x, x, target="tpu-v5e:3x3")


def test_a_mesh_of_another_size_than_the_slice():
    x = sds((64, 64), P("fsdp"), "pinned_host", AbstractMesh((4,), ("fsdp",)))
    with pytest.raises(
        ValueError,
        match=r"mesh of shape \{'fsdp': 4\} \(4 devices\), but tpu-v5e:2x4 has 8 "
        r"chips\. Lay them out on a mesh of 8 devices",
    ):
        eo.memory_report(lambda x: x, x, target=TARGET)


def _mlp_stack(width: int, *, key: PRNGKeyArray) -> StackedNet:
    """3 residual MLPs in a `Stacked`, no head."""
    return StackedNet(lambda k: MLPBlock(width, 3 * width, key=k), 3, key=key)


def _loss(model: StackedNet, x: Float[Array, "b w"]) -> Float[Array, ""]:
    return jnp.mean(jax.vmap(model)(x) ** 2)


def test_fsdp_under_explicit_axes_streams_like_auto():
    """Under `Explicit` axes kept inside the loss (`Policy(loss_axes="explicit")`)
    the step gathers each FSDP-sharded layer itself, inside the scan: the compiler
    must not hoist that gather out of the loop, which would gather every layer at
    once in host memory (the host temporaries were then the whole stacked
    weight). One width is enough to see it: without the barrier the compile
    fails at 40 and at 200 alike (the TPU compiler aborts), and 40 compiles
    faster."""
    width = 40
    host = {}
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = AbstractMesh((8,), ("fsdp",), axis_types=(axis_type,))
        policy = eo.Policy.offload_all(
            shard=eo.FSDP("fsdp", min_size=0), batch="fsdp", loss_axes="explicit"
        )
        abstract = eqx.filter_eval_shape(_mlp_stack, width, key=jax.random.key(0))
        model = eo.place(abstract, policy, mesh=mesh)
        optimizer = optax.adamw(0.1)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(_loss, optimizer, policy)
        x = jax.ShapeDtypeStruct((16, width), jnp.float32)
        report = eo.memory_report(step, model, opt_state, x, target=TARGET)
        host[axis_type] = report.host
    explicit, auto = host[AxisType.Explicit], host[AxisType.Auto]
    assert {k: v for k, v in explicit.items() if k != "temp"} == {
        k: v for k, v in auto.items() if k != "temp"
    }
    # Hoisted, the gathers held every layer's whole weights in host memory (more
    # than twice `Auto`'s temporaries at width 200).
    assert explicit["temp"] <= 1.25 * auto["temp"]


def _square(*, key: PRNGKeyArray) -> StackedNet:
    """8 square `Linear` layers without biases in a `Stacked`, no head."""
    linear = lambda k: eqx.nn.Linear(256, 256, use_bias=False, key=k)  # noqa: E731
    return StackedNet(linear, 8, key=key)


def _square_loss(model: StackedNet, x: Float[Array, "b 256"]) -> Float[Array, ""]:
    return jnp.mean(jax.vmap(model)(x) ** 2)


def test_host_outputs_are_not_copied_on_the_host():
    """A step over several chips constrains its host-resident outputs (parameters,
    AdamW's moments) to their sharding in host memory. Sent through the device
    for it, each became a host-side copy: host temporaries three times the
    state's shard, against the gradient's one."""
    mesh = AbstractMesh((8,), ("fsdp",))
    policy = eo.Policy.offload_all(shard=eo.FSDP("fsdp", min_size=0), batch="fsdp")
    model = eo.place(
        eqx.filter_eval_shape(_square, key=jax.random.key(0)), policy, mesh=mesh
    )
    optimizer = optax.adamw(0.1)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(_square_loss, optimizer, policy)
    x = jax.ShapeDtypeStruct((16, 256), jnp.float32)
    report = eo.memory_report(step, model, opt_state, x, target=TARGET)
    shard = 8 * 256 * 256 * F32 // 8  # one chip's slice of the weights: 256 KiB
    assert report.host["argument"] == 3 * shard  # weights and two moments
    # The weight gradient, accumulated in host memory, and the offloaded carries.
    assert report.host["temp"] <= 1.25 * shard


def test_an_fsdp_table_moves_only_each_chips_rows_in_the_update(monkeypatch):
    """A table split by rows over the chips and streamed in the update in blocks
    of rows (`_tiling.PIECE_BYTES` patched down: 2 blocks a chip) moves each chip's
    own rows: 12 bytes a parameter each way (fp32 master and AdamW's two moments)
    over 4 chips, and no host compute (which fails this compile). A block along
    the split axis was gathered from every chip, on the host: the whole table on
    every chip, and host compute."""
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 16 * 1024)
    no_host_compute = {"xla_disable_automatic_host_compute_offload": True}
    monkeypatch.setattr(
        "eqx_offload._compiler.compile_options", lambda *_, **__: no_host_compute
    )
    vocab, dim, depth = 256, 128, 2  # tables of 128 KiB, 32 KiB a chip
    mesh = AbstractMesh((4,), ("fsdp",), axis_types=(AxisType.Auto,))
    policy = eo.Policy.remat(
        params="pinned_host",
        opt_state={"**": "pinned_host", "copies:**": "device"},
        compute_dtype=jnp.bfloat16,
        shard=eo.FSDP("fsdp"),
        batch="fsdp",
    )
    abstract = eqx.filter_eval_shape(table_lm, jax.random.key(0), vocab, dim, depth)
    model = eo.place(abstract, policy, mesh=mesh)
    optimizer = optax.adamw(1e-3)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    tokens = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    report = eo.memory_report(
        step, model, opt_state, tokens, tokens, target="tpu-v5e:2x2"
    )
    params = 2 * vocab * dim + depth * dim * dim
    for direction in ("host_to_device", "device_to_host"):
        moved = report.transfer_bytes(direction, compiled=True)
        assert moved == pytest.approx(3 * F32 * params / 4, rel=0.01), direction
    assert report.time is not None and report.time.host_compute_seconds == 0


def test_fsdp_host_accumulators_take_only_each_chips_rows(monkeypatch):
    """Gradients added into host accumulators (no compute copies) over 2
    micro-batches, tables split by rows over 4 chips and added to in blocks of rows
    (`_tiling.PIECE_BYTES` patched down): each micro-batch writes each chip's own
    rows, k times 4 bytes a parameter over 4 chips, and reads no more. A block along
    the split axis was gathered from every chip, on the host: 3x the bytes, 80x the
    host compute. (What host compute is left copies each chip's masters, where the
    accumulators start: a single-chip step has it too.)"""
    monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES", 16 * 1024)
    vocab, dim, depth, k = 256, 128, 2, 2  # tables of 128 KiB, 32 KiB a chip
    mesh = AbstractMesh((4,), ("fsdp",), axis_types=(AxisType.Auto,))
    policy = eo.Policy.remat(
        params="pinned_host", opt_state="pinned_host", shard="fsdp", batch="fsdp"
    )
    abstract = eqx.filter_eval_shape(table_lm, jax.random.key(0), vocab, dim, depth)
    model = eo.place(abstract, policy, mesh=mesh)
    optimizer = optax.adamw(1e-3)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy, microbatches=k)
    tokens = jax.ShapeDtypeStruct((4 * k, 16), jnp.int32)
    report = eo.memory_report(
        step, model, opt_state, tokens, tokens, target="tpu-v5e:2x2"
    )
    chip = F32 * (2 * vocab * dim + depth * dim * dim) // 4
    tables = F32 * 2 * vocab * dim // 4  # a chip's rows of both
    moved = {
        d: report.transfer_bytes(d, phase="forward/backward", compiled=True)
        for d in ("host_to_device", "device_to_host")
    }
    assert moved["device_to_host"] == k * chip
    assert moved["host_to_device"] <= (1 + k) * chip  # the masters, the sums
    assert report.time is not None
    assert report.time.host_compute_bytes <= 2 * tables  # read and written
