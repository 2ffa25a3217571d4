"""Reports for NVIDIA GPUs compiled here, without a GPU (JAX's CUDA plugin): the
same answers as on a TPU where they must agree (offloaded bytes on the host, a
covering few of the compile matrix's steps compile, FSDP divides the bytes per
GPU), and refusals where the compile would lie."""

import dataclasses
import functools
import importlib.util
import os
import runpy
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

import eqx_offload as eo
import eqx_offload.internal as eoi

from .helpers import ProjectedStack, TanhBlock


sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import compile_matrix as cm  # noqa: E402
import tutorial  # noqa: E402


MIB = 2**20


def _small(key) -> ProjectedStack:
    """An input projection and three stacked `TanhBlock`s of width 128."""
    k1, k2 = jax.random.split(key)
    blocks = TanhBlock(jax.random.normal(k2, (3, 128, 128)))
    return ProjectedStack(jax.random.normal(k1, (16, 128)), eo.Stacked(blocks))


def _abstract_step(policy: eo.Policy, *, mesh=None, batch=2):
    """`_small`'s train step (Adam) and abstract arguments, laid out on `mesh` if
    the policy shards it, and `batch` examples."""
    optimizer = optax.adam(1e-3)
    abstract = eqx.filter_eval_shape(_small, jax.random.key(0))
    placed = eo.place(abstract, policy, mesh=mesh)
    opt_state = eo.init_opt_state(optimizer, placed, policy)
    x = jax.ShapeDtypeStruct((batch, 16), jnp.float32)
    step = eo.train_step(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), optimizer, policy)
    return step, placed, opt_state, x


@pytest.mark.parametrize(
    "target, chip, topology",
    [
        ("gpu-h100", "gpu-h100", None),
        ("gpu-h200", "gpu-h200", None),
        ("gpu-h100:8", "gpu-h100", "8"),
        ("gpu-h100:4x8", "gpu-h100", "4x8"),
    ],
)
def test_gpu_targets_parse(target, chip, topology):
    assert eoi.targets_parse(target) == (chip, topology)
    assert eoi.targets_platform(target) == "gpu"


@pytest.mark.parametrize("target", ["gpu-a100", "gpu-h100:2x2x2", "tpu-v5e:8"])
def test_unknown_targets_name_the_valid_ones(target):
    with pytest.raises(ValueError, match="'gpu-h100:8'.*'gpu-h100:4x8'"):
        eoi.targets_parse(target)


def test_the_devices_of_nodes_and_hosts():
    assert len(eoi.targets_devices("gpu-h100")) == 1
    assert len(eoi.targets_devices("gpu-h100:8")) == 8
    assert len(eoi.targets_devices("gpu-h100:4x8")) == 32
    assert eoi.chips_per_host("gpu-h100:4x8") == 8


def test_capacity_is_the_allocators_share_of_the_device(monkeypatch):
    """79.1 GiB (H100 SXM) and 141.0 GiB (H200), as XLA's target configurations
    state them, times 0.75 (JAX's default), or `XLA_PYTHON_CLIENT_MEM_FRACTION`."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert eoi.targets_capacity("gpu-h100") == int(84942979072 * 0.75)
    assert eoi.targets_capacity("gpu-h200:8") == int(151397597184 * 0.75)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert eoi.targets_capacity("gpu-h100") == int(84942979072 * 0.9)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "lots")
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        eoi.targets_capacity("gpu-h100")


# The compile matrix's share, each compile checking several things at once (the
# `SHARE` of tests/test_tpu_compile.py swaps the last two policies): `offload_all`
# (parameters, optimizer state and the layer inputs on the host) with micro-batches
# and bf16 compute, the GPT's embedding and head at width 96; the optimizer state
# on the host and the layer inputs offloaded, bfloat16 parameters at width 200; the
# layers' parameters on the host at the odd width 97 (which a TPU refuses).
# Elsewhere: `none` (`test_too_big_for_the_allocators_share_does_not_fit`), `remat`
# (`test_fsdp_over_several_nodes_divides_the_parameters_and_state`), `none`,
# `remat`, `offload_residuals` and `offload_all` on a stack of matmuls
# (tests/test_step_time.py). `_tiling.PIECE_BYTES` is patched down, so that small
# layers take the path of large ones. The full matrix for gpu-h100, and the cases
# these tests compiled before, are in docs/benchmarks/nvidia-gpus.md and
# docs/benchmarks/tpu-compile.md.
SHARE = {
    "offload_all": ("gpt", "bf16-compute", 96, 2),
    "host state": ("mlp", "bfloat16", 200, 1),
    "host params": ("mlp", "float32", 97, 1),
}


@pytest.fixture(scope="module")
def share():
    """`share(policy)`: the report of `SHARE[policy]`'s step (two layers) compiled
    for one H100, compiled once in this module."""

    @functools.cache
    def compiled(policy: str) -> eo.MemoryReport:
        arch, dtype, width, k = SHARE[policy]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("eqx_offload._tiling.PIECE_BYTES", 32 * 1024)
            result = cm.compile_case(
                arch, width, 2, cm.DTYPES[dtype], policy, "gpu-h100", microbatches=k
            )
        assert result.outcome == "compiles" and result.report, result.message
        return result.report

    return compiled


@pytest.mark.parametrize("policy", list(SHARE))
def test_train_step_compiles_for_gpu(policy, share):
    """Each share's step compiles, its leaves where its policy puts them: every
    parameter and optimizer-state leaf on `pinned_host` is a host argument of the
    compiled step (and an output: written back in place), and the compiled
    program's transfers are read."""
    report = share(policy)
    assert report.params is not None and report.opt_state is not None
    host_params = report.params.get("pinned_host", 0)
    host_state = report.opt_state.get("pinned_host", 0)
    assert (host_params > 0) == (policy in ("offload_all", "host params"))
    assert (host_state > 0) == (policy in ("offload_all", "host state"))
    assert report.host["argument"] == report.host["output"] == host_params + host_state
    assert report.capacity == eoi.targets_capacity("gpu-h100") and report.fits
    assert report.compiled_transfers
    moved = {(t.what, t.direction) for t in report.compiled_transfers}
    if host_params:
        assert ("params", "host_to_device") in moved
    if host_state:
        assert ("opt_state", "device_to_host") in moved


def test_host_leaves_are_counted_on_the_host(share):
    """`offload_all` on one H100: nothing of the parameters on the device; the
    compiled step reads them from the host and writes them back there, in place."""
    report = share("offload_all")
    assert report.params is not None and report.params.get("device", 0) == 0
    assert report.host["alias"] == report.host["argument"]  # donated


def test_the_trap_is_refused_not_reported(monkeypatch):
    """Without the workaround, a compile-only GPU device drops the memory kind of
    a `NamedSharding` and counts host leaves as device memory: the report refuses
    rather than print wrong numbers."""
    device = eoi.targets_devices("gpu-h100")[0]
    mesh = Mesh([device], ("x",))
    plain = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
    assert plain.memory_kind is None  # the trap, in this JAX
    kept = eoi.named_sharding(mesh, PartitionSpec(), "pinned_host")
    assert kept.memory_kind == "pinned_host" and kept != plain

    def dropped(mesh, spec, kind):
        return NamedSharding(mesh, spec, memory_kind=kind)

    monkeypatch.setattr("eqx_offload._compat.named_sharding", dropped)
    step, model, opt_state, *batch = _abstract_step(eo.Policy.offload_all())
    with pytest.raises(NotImplementedError, match="pinned_host would be compiled"):
        eo.memory_report(step, model, opt_state, *batch, target="gpu-h100")


def test_too_big_for_the_allocators_share_does_not_fit(monkeypatch):
    """A device-only step (`Policy.none()`) on one H200, its capacity made tiny:
    refused with what it holds, all of it on the device."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1e-9")
    step, model, opt_state, *batch = _abstract_step(eo.Policy.none())
    with pytest.raises(eo.DoesNotFit, match="XLA_PYTHON_CLIENT_MEM_FRACTION") as e:
        eo.memory_report(step, model, opt_state, *batch, target="gpu-h200")
    assert e.value.target == "gpu-h200"
    assert e.value.params is not None and set(e.value.params) == {"device"}
    assert e.value.opt_state is not None and set(e.value.opt_state) == {"device"}
    assert e.value.host_required_bytes == 0  # nothing on the host
    assert e.value.available_bytes == int(151397597184 * 1e-9)
    assert e.value.required_bytes is not None and e.value.required_bytes > 10**5
    assert "one gpu-h200 GPU" in str(e.value) and "compiler says" not in str(e.value)


def test_a_missing_plugin_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda12", None)
    monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda13", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[gpu-aot\]'"):
        eoi.targets_devices("gpu-h200:8")


def test_a_compile_that_lost_the_host_is_refused(share):
    """The second guard, after compiling: host-resident arguments the compiler
    did not count on the host."""

    report = share("offload_all")
    where = eoi.memory_report_where("gpu-h100", ())
    eoi.check_host_kept(report, where)  # as compiled: fine
    lost = dataclasses.replace(report, host={**report.host, "argument": 0})
    with pytest.raises(NotImplementedError, match="host memory"):
        eoi.check_host_kept(lost, where)


# --- The same answers as on a TPU -------------------------------------------------


def _reports(rows, skip=()):
    """The rows' reports for one H100, by (experiment, name), but those named in
    `skip`."""
    return {
        (experiment, name): eo.memory_report(fn, *args, target="gpu-h100")
        for name, experiment, fn, args in rows
        if name not in skip
    }


def test_the_tutorials_activations_and_parameters_go_to_the_host():
    """Experiments 1 and 2 of JAX's host-offloading tutorial (its ten-layer scan of
    two matmuls, 256 x 256 inputs, 256 x 1024 weights), the tutorial's recipes and
    eqx_offload's, compiled for one H100: the offloaded residual (x, 256 KiB a
    layer) and the host-resident weights (20 MiB) are host memory, and the device
    holds less than without offloading (the tutorial's own GPU printed 57.50 MB
    without offloading and 46.75 MB with the activations offloaded)."""
    r = _reports(tutorial.experiments_1_and_2())
    plain = r["activations", "plain JAX, no offload"]
    assert plain.host_bytes == 0
    residuals = 10 * 256 * 256 * 4
    for name in ("tutorial recipe", "eqx_offload, Policy.offload_residuals()"):
        report = r["activations", name]
        assert report.host["temp"] == residuals, name
        assert report.host["argument"] == 0
        assert report.device_bytes < plain.device_bytes - residuals
    weights = 2 * 10 * 256 * 1024 * 4
    for name in ("tutorial recipe", "eqx_offload, params on pinned_host"):
        report = r["parameters", name]
        assert report.host["argument"] == weights, name
        assert report.device["argument"] == 256 * 256 * 4  # the input alone
        assert report.device_bytes < plain.device_bytes - weights


def test_the_tutorials_optimizer_state_goes_to_the_host():
    """Experiment 3 (four 7168 x 7168 weights, clip + Adam): Adam's two moments on
    the host (1568 MiB), read there by eqx_offload's streamed update, and the
    device footprint smaller than without offloading by more than the state."""
    # (Its plain JAX step, compiled in `benchmarks/tutorial.py`, is not needed.)
    r = _reports(tutorial.experiment_3(), skip=("plain JAX, no offload",))
    state = 2 * 4 * 7168 * 7168 * 4
    plain = r["optimizer state", "eqx_offload, Policy.none()"]
    assert plain.host_bytes == 0 and plain.opt_state is not None
    assert plain.opt_state["device"] >= state
    report = r["optimizer state", "eqx_offload, opt_state on pinned_host"]
    assert report.opt_state is not None
    assert report.opt_state.get("device", 0) < MIB  # Adam's step count
    assert report.opt_state["pinned_host"] == state
    assert report.host["argument"] == report.host["output"] == state
    assert report.device_bytes < plain.device_bytes - state / 2
    recipe = r["optimizer state", "tutorial recipe"]
    assert recipe.host["argument"] >= state


def test_residuals_offloaded_under_scan_and_remat_are_host_memory(share):
    """A `Stacked` model's layers scanned with remat, the carry entering each layer
    offloaded (`offload_residuals`, with the optimizer state on the host): the
    compiled step's host temporaries are exactly the traced `blocks.input`
    residuals, moved out in the forward pass and back in the backward pass (the
    state moves in the update)."""
    report = share("host state")
    offloaded = {
        r.name: r.bytes for r in report.residuals or () if r.memory_kind != "device"
    }
    # layers x batch x tokens x width, bfloat16
    assert offloaded == {"blocks.input": 2 * cm.BATCH * cm.SEQ * 200 * 2}
    assert report.opt_state is not None
    state = report.opt_state["pinned_host"]
    assert report.host == {
        "argument": state,
        "output": state,
        "temp": offloaded["blocks.input"],
        "alias": state,
    }
    for direction in ("device_to_host", "host_to_device"):
        moved = report.transfer_bytes(
            direction, phase="forward/backward", compiled=True
        )
        assert moved == offloaded["blocks.input"], direction


FSDP = eo.FSDP("fsdp", min_size=0)


def test_fsdp_over_several_nodes_divides_the_parameters_and_state():
    """Four hosts of eight H100s, every leaf split FSDP-style over the 32 GPUs:
    each GPU holds a 32nd of the parameters on the device and of the optimizer
    state on its host, and a host's memory is that of its eight GPUs."""
    policy = eo.Policy.remat(shard=FSDP, batch="fsdp", opt_state="pinned_host")
    mesh = AbstractMesh((32,), ("fsdp",))
    args = _abstract_step(policy, mesh=mesh, batch=32)
    report = eo.memory_report(*args, target="gpu-h100:4x8")
    abstract = eqx.filter_eval_shape(_small, jax.random.key(0))
    shard = 4 * sum(x.size for x in jax.tree.leaves(abstract)) // 32
    assert (report.chips, report.chips_per_host) == (32, 8)
    assert report.params == {"device": shard}
    # Adam's two moments; its step count (int32) is whole on every GPU.
    assert report.opt_state == {"pinned_host": 2 * shard, "device": 4}
    assert report.host["argument"] == 2 * shard
    assert report.host_bytes_per_host == 8 * report.host_bytes
    text = str(report)
    assert "32 GPUs, 8 per host (4 hosts)" in text and "per GPU" in text
    assert "host memory of a host (8 GPUs)" in text


def test_a_plugin_that_did_not_load_names_jax_platforms(monkeypatch):
    """Without `JAX_PLATFORMS=cpu` on a machine without CUDA, the plugin fails to
    load and JAX answers "topology not implemented for cuda"."""
    from jax.experimental import topologies

    def not_loaded(platform, **kwargs):
        raise NotImplementedError(f"topology not implemented for {platform}")

    monkeypatch.setattr(topologies, "get_topology_desc", not_loaded)
    with pytest.raises(RuntimeError, match="JAX_PLATFORMS=cpu"):
        eoi.targets_devices("gpu-h100:3")  # a topology not compiled (cached) before


def test_the_quickstart_compiles_for_gpus_without_the_cuda_plugins_noise(capfd):
    """`python examples/quickstart.py` on a machine without a GPU, `JAX_PLATFORMS`
    unset: JAX runs on the CPU, so `--target gpu-h100` (which it accepts) compiles,
    and none of the lines JAX's CUDA plugin logs from C++ as it loads ("Could not
    find cuda drivers") reach stderr (in a child process: they come with `import
    jax`), while anything else written there meanwhile is passed on."""
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip("JAX's CUDA plugin is not installed (the `gpu-aot` extra)")
    quickstart = str(Path(__file__).parent.parent / "examples" / "quickstart.py")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # if JAX did look for a TPU: no lock
    child = (
        "import os, runpy, sys\n"
        "sys.path.insert(0, os.path.dirname(sys.argv[1]))  # as `python <script>`\n"
        "sys.argv = [sys.argv[1], '--help']  # its start, not its training\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "import jax, eqx_offload as eo\n"
        "print(os.environ['JAX_PLATFORMS'], jax.default_backend())\n"
        "x = jax.ShapeDtypeStruct((8,), jax.numpy.float32)\n"
        "print(eo.memory_report(jax.numpy.sin, x, target='gpu-h100').target)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", child, quickstart],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "{tpu-v5e,tpu-v6e,tpu-v5p,tpu-v4,gpu-h100,gpu-h200}" in run.stdout
    assert run.stdout.endswith("\ncpu cpu\ngpu-h100\n")
    assert "cuda drivers" not in run.stderr and "InitializeLog" not in run.stderr

    platform = str(Path(quickstart).parent / "_platform.py")
    drop = runpy.run_path(platform)["without_cuda_driver_lines"]
    capfd.readouterr()
    with drop():
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() ")
        os.write(2, b"is called are written to STDERR\nI0000 cudart_stub.cc:31] ")
        os.write(2, b"Could not find cuda drivers on your machine, GPU will not be ")
        os.write(2, b"used.\nE0000 a real error\n")
    assert capfd.readouterr().err == "E0000 a real error\n"


def test_the_diagnosis_of_a_rejected_step_compiles_its_probes_for_a_gpu(monkeypatch):
    """A probe's host-resident leaf keeps its memory kind on compile-only GPU
    devices (it used to be traced in device memory, and the probe itself raised
    "memory_space of all inputs passed to `dynamic_update_slice` must be the
    same"); and a probe that fails for a reason of its own blames no leaf."""
    mesh = eoi.chip_mesh("gpu-h100")
    leaf = eoi.Streamed("blocks.w", (2, 256, 128), jnp.float32, 1, True)
    assert eoi.diagnose_probe(leaf, mesh) is None  # it compiles

    def broken(leaf, mesh):
        raise ValueError("the probe's own bug")

    monkeypatch.setattr("eqx_offload._diagnose._probe", broken)
    other = leaf._replace(shape=(2, 128, 128))  # not in the probes' cache
    assert eoi.diagnose_rejected([other], mesh) == []
