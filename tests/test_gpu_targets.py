"""Reports for NVIDIA GPUs compiled here, without a GPU (JAX's CUDA plugin)."""

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import eqx_offload as eo
from eqx_offload import _compat
from eqx_offload._report import _targets

from .helpers import cross_entropy, Model


def _abstract_step(policy: eo.Policy):
    optimizer = optax.adam(1e-3)
    model = eo.place(eqx.filter_eval_shape(Model, key=jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    step = eo.train_step(cross_entropy, optimizer, policy)
    return step, model, opt_state, tokens, tokens


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
    assert _targets.parse(target) == (chip, topology)
    assert _targets.platform(target) == "gpu"


@pytest.mark.parametrize("target", ["gpu-a100", "gpu-h100:2x2x2", "tpu-v5e:8"])
def test_unknown_targets_name_the_valid_ones(target):
    with pytest.raises(ValueError, match="'gpu-h100:8'.*'gpu-h100:4x8'"):
        _targets.parse(target)


def test_the_devices_of_nodes_and_hosts():
    assert len(_targets.devices("gpu-h100")) == 1
    assert len(_targets.devices("gpu-h100:8")) == 8
    assert len(_targets.devices("gpu-h100:4x8")) == 32
    assert _targets.chips_per_host("gpu-h100:4x8") == 8


def test_capacity_is_the_allocators_share_of_the_device(monkeypatch):
    """79.1 GiB (H100 SXM) and 141.0 GiB (H200), as XLA's target configurations
    state them, times 0.75 (JAX's default), or `XLA_PYTHON_CLIENT_MEM_FRACTION`."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert _targets.capacity("gpu-h100") == int(84942979072 * 0.75)
    assert _targets.capacity("gpu-h200:8") == int(151397597184 * 0.75)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert _targets.capacity("gpu-h100") == int(84942979072 * 0.9)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "lots")
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        _targets.capacity("gpu-h100")


def test_host_leaves_are_counted_on_the_host():
    """`offload_all` on one H100: every parameter and optimizer-state leaf the
    policy puts on `pinned_host` is a host argument of the compiled step, and the
    compiled program's transfers are read."""
    step, model, opt_state, *batch = _abstract_step(eo.Policy.offload_all())
    report = eo.memory_report(step, model, opt_state, *batch, target="gpu-h100")
    assert report.params is not None and report.opt_state is not None
    on_host = report.params["pinned_host"] + report.opt_state["pinned_host"]
    assert on_host > 0 and report.params.get("device", 0) == 0
    assert report.host["argument"] == on_host
    assert report.host["output"] == on_host  # written back in place
    assert report.capacity == _targets.capacity("gpu-h100") and report.fits
    assert report.compiled_transfers
    moved = {(t.what, t.direction) for t in report.compiled_transfers}
    assert ("params", "host_to_device") in moved
    assert ("opt_state", "device_to_host") in moved


def test_a_device_only_step_has_nothing_on_the_host():
    step, model, opt_state, *batch = _abstract_step(eo.Policy.none())
    report = eo.memory_report(step, model, opt_state, *batch, target="gpu-h200")
    assert report.host_bytes == 0 and report.device["argument"] > 0


def test_the_trap_is_refused_not_reported(monkeypatch):
    """Without the workaround, a compile-only GPU device drops the memory kind of
    a `NamedSharding` and counts host leaves as device memory: the report refuses
    rather than print wrong numbers."""
    device = _targets.devices("gpu-h100")[0]
    mesh = Mesh([device], ("x",))
    plain = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
    assert plain.memory_kind is None  # the trap, in this JAX
    kept = _compat.named_sharding(mesh, PartitionSpec(), "pinned_host")
    assert kept.memory_kind == "pinned_host" and kept != plain

    def dropped(mesh, spec, kind):
        return NamedSharding(mesh, spec, memory_kind=kind)

    monkeypatch.setattr(_compat, "named_sharding", dropped)
    step, model, opt_state, *batch = _abstract_step(eo.Policy.offload_all())
    with pytest.raises(NotImplementedError, match="pinned_host would be compiled"):
        eo.memory_report(step, model, opt_state, *batch, target="gpu-h100")


def test_too_big_for_the_allocators_share_does_not_fit(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1e-9")
    step, model, opt_state, *batch = _abstract_step(eo.Policy.none())
    with pytest.raises(eo.DoesNotFit, match="XLA_PYTHON_CLIENT_MEM_FRACTION") as e:
        eo.memory_report(step, model, opt_state, *batch, target="gpu-h100")
    assert e.value.target == "gpu-h100" and e.value.params is not None


def test_a_missing_plugin_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda12", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[gpu-aot\]'"):
        _targets.devices("gpu-h200:8")


def test_a_compile_that_lost_the_host_is_refused():
    """The second guard, after compiling: host-resident arguments the compiler
    did not count on the host."""
    from eqx_offload._report import _memory_report

    step, model, opt_state, *batch = _abstract_step(eo.Policy.offload_all())
    report = eo.memory_report(step, model, opt_state, *batch, target="gpu-h100")
    where = _memory_report._where("gpu-h100", ())
    _memory_report._check_host_kept(report, where)  # as compiled: fine
    lost = eqx.tree_at(lambda r: r.host, report, {**report.host, "argument": 0})
    with pytest.raises(NotImplementedError, match="host memory"):
        _memory_report._check_host_kept(lost, where)
